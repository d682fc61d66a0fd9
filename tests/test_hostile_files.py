"""Issue 26, part 2: untrusted files and places. Caches of code trust only this user's private directories and
entries this user's package wrote (an HMAC key); no home means no cache, never a `~` directory; a hub cache
cannot point a load elsewhere; every small file is read as a bounded regular file; hub ids, paths and
revisions are told apart; non-UTF-8 JSON says so."""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import pwd
import re
import shutil
import stat
import tarfile
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dflash_jax import CheckpointError, ConfigError, Qwen3Target, _executables, _private, load_config, load_drafter
from dflash_jax.cli import main
from dflash_jax.compile_cache import enable_compile_cache
from dflash_jax.hub import check_revision, resolve
from dflash_jax.nvfp4 import quantize
from dflash_jax.testing import write_checkpoint, write_qwen3_checkpoint

from ._hub import add_to_cache, directory_files, repo_folder  # sets HF_HUB_OFFLINE=1; the hub is faked anyway
from ._io import deadline

huggingface_hub = pytest.importorskip("huggingface_hub")

DEVICE = jax.local_devices()[0]
INPUTS = (((64, 16), np.dtype(np.uint8)), ((64, 2), np.dtype(ml_dtypes.float8_e4m3fn)), ((), np.dtype(np.float32)))
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """Nothing compiled in this process, nothing warned about, a key of this test's own (a test may damage it);
    counts compilations and deserialisations."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setattr(_executables, "_COMPILED", {})
    monkeypatch.setattr(_private, "_WARNED", set())
    counts = {"compiled": 0, "deserialised": 0, "read": 0}
    compile_, problem, read = _executables._compile, _executables._signature_problem, _executables._read_entry

    def counted_compile(*a):
        counts["compiled"] += 1
        return compile_(*a)

    def counted_problem(*a):  # runs on every program: a fresh compile or one deserialised from disk
        counts["deserialised"] += 1
        return problem(*a)

    def counted_read(*a):  # entries whose payload went on to be deserialised
        payload = read(*a)
        counts["read"] += payload is not None
        return payload

    monkeypatch.setattr(_executables, "_read_entry", counted_read)
    monkeypatch.setattr(_executables, "_compile", counted_compile)
    monkeypatch.setattr(_executables, "_signature_problem", counted_problem)
    return counts


def convert():
    """One tiny dequantizer, through the cache; returns its output."""
    (n, half_k), _ = INPUTS[0]
    packed, scale, scale_2 = quantize(np.random.default_rng(0).normal(size=(n, 2 * half_k)).astype(np.float32))
    arrays = [jax.device_put(x, DEVICE) for x in (packed, scale.view(INPUTS[1][1]), scale_2)]
    return _executables.compiled("nvfp4", INPUTS, jnp.bfloat16, DEVICE).result()(*arrays)


def entries(directory):
    return sorted(p for p in directory.iterdir() if p.name.endswith(".jaxexec"))


def new_process(monkeypatch):
    monkeypatch.setattr(_executables, "_COMPILED", {})


# --- code from files: the CLI's JAX compilation cache follows the package's rules -----------------------------

def make_unsafe(directory, how):
    directory.mkdir(parents=True, exist_ok=True)
    if how == "writable by others":
        directory.chmod(0o777)
    elif how == "owned by another user":
        os.chown(directory, 12345, 12345)
    else:  # not sticky: anyone could rename the cache away and put theirs in its place
        directory.parent.chmod(0o777)


@pytest.mark.parametrize("how", ["writable by others", "owned by another user", "in a parent anyone can write"])
@pytest.mark.parametrize("where", ["JAX_COMPILATION_CACHE_DIR", "default"])
def test_the_cli_does_not_use_a_jax_compilation_cache_others_can_write(tmp_path, monkeypatch, fresh, how, where):
    before = jax.config.jax_compilation_cache_dir
    if where == "default":
        monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
        directory = tmp_path / "xdg" / "dflash_jax" / "jax-compilation-cache"
    else:
        directory = tmp_path / "shared" / "jax"
        monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(directory))  # JAX itself would use it as it is
    make_unsafe(directory, how)
    try:
        with pytest.warns(RuntimeWarning, match=f"not using {directory} for JAX's compilation cache") as record:
            assert enable_compile_cache() is None
        assert jax.config.jax_compilation_cache_dir is None and len(record) == 1
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


# --- code from files: only entries this user's package wrote are deserialised ---------------------------------

def test_an_entry_from_another_cache_is_never_deserialised(tmp_path, monkeypatch, fresh):
    """A "warm cache" from elsewhere (another key): intact, of this very signature, yet not this user's."""
    monkeypatch.setenv(_executables.CACHE_ENV, str(tmp_path / "theirs"))
    convert()
    (theirs,) = entries(tmp_path / "theirs")
    monkeypatch.setenv(_executables.CACHE_ENV, str(tmp_path / "mine"))
    (tmp_path / "mine").mkdir(mode=0o700)
    planted = tmp_path / "mine" / theirs.name
    planted.write_bytes(theirs.read_bytes())
    planted.chmod(0o600)  # this user's file, private: every rule but the key holds
    new_process(monkeypatch)
    convert()
    # one compile and one signature check per cache: the planted entry was replaced, never deserialised
    assert fresh == {"compiled": 2, "deserialised": 2, "read": 0}
    assert planted.read_bytes() != theirs.read_bytes()


def _their_cache(tmp_path, monkeypatch):
    """Another user's cache: written under their key (another state home), with their key file beside the entries
    (where the package kept it before: the key then travelled with every copy)."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "their-state"))
    monkeypatch.setenv(_executables.CACHE_ENV, str(tmp_path / "theirs"))
    convert()
    key = tmp_path / "theirs" / _private.KEY_FILE
    key.write_bytes(_private.key_file().read_bytes())
    key.chmod(0o600)
    return tmp_path / "theirs"


@pytest.mark.parametrize("how", ["copied over mine", "unpacked from a tarball"])
def test_a_cache_from_elsewhere_with_its_key_is_recompiled(tmp_path, monkeypatch, fresh, how):
    """`cp -r theirs/. ~/.cache/dflash_jax/`, or a "warm cache" tarball shipping its key: their entries (same name,
    this very signature) are never deserialised, since the key that verifies an entry is this user's, kept outside
    every cache and bound to the cache directory."""
    theirs = _their_cache(tmp_path, monkeypatch)
    mine = tmp_path / "mine"
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "my-state"))
    monkeypatch.setenv(_executables.CACHE_ENV, str(mine))
    if how == "copied over mine":
        new_process(monkeypatch)
        convert()  # my own entry first
        shutil.copytree(theirs, mine, dirs_exist_ok=True)  # their entry (same file name) and key over mine
    else:
        with tarfile.open(tmp_path / "warm-cache.tar", "w") as archive:
            archive.add(theirs, arcname=".")
        mine.mkdir(mode=0o700)
        with tarfile.open(tmp_path / "warm-cache.tar") as archive:
            archive.extractall(mine, filter="fully_trusted")  # as `tar -xpf` would, modes and all
    (planted,) = entries(mine)
    assert planted.read_bytes() == entries(theirs)[0].read_bytes()
    before = dict(fresh)
    new_process(monkeypatch)
    convert()
    assert fresh["read"] == before["read"] == 0 and fresh["compiled"] == before["compiled"] + 1
    assert planted.read_bytes() != entries(theirs)[0].read_bytes()  # recompiled and replaced


def test_an_entry_forged_over_a_keyless_digest_is_never_deserialised(tmp_path, monkeypatch, fresh):
    """Anyone can compute a plain SHA-256 of a description and a payload; the key is what they lack."""
    directory = tmp_path / "cache"
    monkeypatch.setenv(_executables.CACHE_ENV, str(directory))
    convert()
    (path,) = entries(directory)
    head = len(_executables.MAGIC) + 32
    payload = bytearray(path.read_bytes()[head:])
    payload[len(payload) // 2] ^= 0x01  # one forged byte: could crash the process (SIGSEGV) if deserialised
    description = _executables._describe(("nvfp4", INPUTS, jnp.dtype(jnp.bfloat16), DEVICE))
    keyless = hashlib.sha256(len(description).to_bytes(8, "little") + description + payload).digest()
    path.write_bytes(_executables.MAGIC + keyless + bytes(payload))
    new_process(monkeypatch)
    convert()
    assert fresh == {"compiled": 2, "deserialised": 2, "read": 0}


def test_the_key_is_a_private_file_of_this_user(tmp_path, monkeypatch, fresh):
    directory = tmp_path / "cache"
    monkeypatch.setenv(_executables.CACHE_ENV, str(directory))
    convert()
    key = _private.key_file()  # kept out of every cache (a copied cache brings no key that verifies it)
    status = os.lstat(key)
    assert stat.S_ISREG(status.st_mode) and stat.S_IMODE(status.st_mode) == 0o600
    assert status.st_uid == os.getuid() and status.st_size == _private.KEY_BYTES
    assert [p.name for p in directory.iterdir()] == [entries(directory)[0].name]
    new_process(monkeypatch)
    convert()  # the same key: the entry is this user's
    assert fresh == {"compiled": 1, "deserialised": 2, "read": 1}


@pytest.mark.parametrize("bad", ["group-readable", "a symlink", "a FIFO", "a directory", "too short", "too long",
                                 "another user's"])
def test_a_bad_key_file_turns_the_cache_off_with_one_warning(tmp_path, monkeypatch, fresh, bad):
    directory = tmp_path / "cache"
    monkeypatch.setenv(_executables.CACHE_ENV, str(directory))
    convert()
    key = _private.key_file()
    good = key.read_bytes()
    if bad == "group-readable":
        key.chmod(0o640)
    elif bad == "a symlink":
        (tmp_path / "elsewhere").write_bytes(good)
        (tmp_path / "elsewhere").chmod(0o600)
        key.unlink()
        key.symlink_to(tmp_path / "elsewhere")
    elif bad in ("a FIFO", "a directory"):
        key.unlink()
        os.mkfifo(key) if bad == "a FIFO" else key.mkdir()
    elif bad == "another user's":
        os.chown(key, 12345, 12345)
    else:
        key.write_bytes(good[:-1] if bad == "too short" else good + b"x")
    (entry,) = entries(directory)
    stored = entry.read_bytes()
    new_process(monkeypatch)
    with deadline(10), pytest.warns(RuntimeWarning, match="key file") as record:
        convert()
        new_process(monkeypatch)
        convert()
    assert len(record) == 1 and fresh["compiled"] == 3  # neither read nor written
    assert entry.read_bytes() == stored


# --- files outside their place: no home, no cache, no `~` directory --------------------------------------------

def no_home(monkeypatch, tmp_path, home=None):
    """`docker --user 12345`: HOME unset (or `home`) and no passwd entry for the uid."""
    def no_entry(uid):
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    for variable in ("HOME", "XDG_CACHE_HOME", _executables.CACHE_ENV, "JAX_COMPILATION_CACHE_DIR"):
        monkeypatch.delenv(variable, raising=False)
    if home is not None:
        monkeypatch.setenv("HOME", home)
    monkeypatch.setattr(pwd, "getpwuid", no_entry)
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="module")
def nvfp4_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("nvfp4") / "ckpt"
    write_checkpoint(path, "tiny-dflash", nvfp4=True)
    return path


def test_an_nvfp4_load_without_a_home_works_uncached(tmp_path, monkeypatch, fresh, nvfp4_checkpoint):
    work = tmp_path / "work"
    work.mkdir()
    no_home(monkeypatch, work)
    with pytest.warns(RuntimeWarning, match="no home directory") as record:
        drafter = load_drafter(nvfp4_checkpoint, dtype=jnp.float32)
    assert drafter.config.family == "dflash" and len([w for w in record if "no home" in str(w.message)]) == 1
    assert list(work.iterdir()) == []  # never ./~/.cache/...


@pytest.mark.parametrize("home", [None, "", "relative"])
def test_the_cli_without_a_home_has_no_compilation_cache(tmp_path, monkeypatch, fresh, home):
    no_home(monkeypatch, tmp_path, home)
    before = jax.config.jax_compilation_cache_dir
    try:
        with pytest.warns(RuntimeWarning, match="no home directory"):
            assert enable_compile_cache() is None
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("setting", ["~nosuchuser", "~nosuchuser/cache", "relative/cache"])
def test_a_cache_setting_that_is_no_absolute_path_is_off(tmp_path, monkeypatch, fresh, setting):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(_executables.CACHE_ENV, setting)
    with pytest.warns(RuntimeWarning, match="not an absolute path"):
        convert()
    assert list(tmp_path.iterdir()) == [] and fresh["compiled"] == 1


# --- files outside their place: directories the package makes pass its own rules -------------------------------

def test_directories_made_under_umask_002_are_private(tmp_path, monkeypatch, fresh):
    directory = tmp_path / "a" / "b" / "cache"
    monkeypatch.setenv(_executables.CACHE_ENV, str(directory))
    old = os.umask(0o002)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "not using" warning
            convert()
            new_process(monkeypatch)
            convert()
    finally:
        os.umask(old)
    assert fresh["compiled"] == 1  # the second "process" loaded the stored entry
    for made in (tmp_path / "a", tmp_path / "a" / "b", directory):
        assert stat.S_IMODE(made.stat().st_mode) == 0o700, made


def test_a_group_writable_directory_is_refused_with_the_fix(tmp_path, monkeypatch, fresh):
    directory = tmp_path / "cache"
    directory.mkdir()
    directory.chmod(0o775)
    monkeypatch.setenv(_executables.CACHE_ENV, str(directory))
    with pytest.warns(RuntimeWarning, match=f"writable by group or others .*`chmod go-w {directory}`"):
        convert()


# --- files outside their place: a hub cache cannot point a load elsewhere ---------------------------------------

@pytest.fixture(scope="module")
def drafter_files(tmp_path_factory):
    source = tmp_path_factory.mktemp("src") / "drafter"
    write_checkpoint(source, "tiny-dflash", num_shards=2)
    return directory_files(source)


@pytest.fixture
def no_network(monkeypatch):
    """huggingface_hub's download, failing at once as an unreachable hub does; counts the calls."""
    calls = []

    def unreachable(repo_id, **kw):
        calls.append((repo_id, kw.get("revision")))
        raise huggingface_hub.errors.LocalEntryNotFoundError("the hub is unreachable (test)")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    return calls


def elsewhere(tmp_path, drafter_files):
    """A drafter directory outside the hub cache, holding what an attacker wants loaded."""
    other = tmp_path / "elsewhere"
    for name, data in drafter_files.items():
        (other / name).parent.mkdir(parents=True, exist_ok=True)
        (other / name).write_bytes(data)
    return other


@pytest.mark.parametrize("attack", ["ref with ..", "absolute ref", "ref is a FIFO", "snapshot links out",
                                    "config.json links out", "ref of a tag with ..", "snapshot is a file"])
def test_a_hub_cache_that_points_elsewhere_is_refused(tmp_path, drafter_files, no_network, attack):
    cache = tmp_path / "hub"
    add_to_cache(cache, "org/drafter", drafter_files, commit=COMMIT)
    folder = repo_folder(cache, "org/drafter")
    other = elsewhere(tmp_path, drafter_files)
    revision = "v1" if attack == "ref of a tag with .." else None
    ref = folder / "refs" / (revision or "main")
    blamed = ref
    if attack in ("ref with ..", "ref of a tag with .."):
        ref.write_text(os.path.relpath(other, folder / "snapshots"))
    elif attack == "absolute ref":
        ref.write_text(str(other))
    elif attack == "ref is a FIFO":
        ref.unlink()
        os.mkfifo(ref)
    elif attack == "snapshot is a file":  # it would be read as config.json
        snapshot = folder / "snapshots" / COMMIT
        snapshot.rename(tmp_path / "moved")
        snapshot.write_bytes((other / "config.json").read_bytes())
    elif attack == "snapshot links out":
        snapshot = folder / "snapshots" / COMMIT
        snapshot.rename(tmp_path / "moved")
        snapshot.symlink_to(other)
    else:
        config = folder / "snapshots" / COMMIT / "config.json"
        config.unlink()
        config.symlink_to(other / "config.json")
    with deadline(10), pytest.raises(ConfigError) as e:
        load_drafter("org/drafter", revision=revision, cache_dir=cache)
    assert str(e.value).startswith(f"{blamed}: ") and no_network == []


# --- files outside their place: every small file is a bounded regular file -------------------------------------

@pytest.mark.parametrize("swap", ["a FIFO", "a directory", "a device"])
def test_a_config_json_that_is_no_regular_file_is_refused_without_blocking(tmp_path, swap):
    write_checkpoint(tmp_path / "d", "tiny-dflash")
    config = tmp_path / "d" / "config.json"
    config.unlink()
    if swap == "a FIFO":
        os.mkfifo(config)
    elif swap == "a directory":
        config.mkdir()
    else:
        config.symlink_to("/dev/zero")  # a read of it never ends
    with deadline(10), pytest.raises(ConfigError, match=re.escape(f"{config}: not a regular file")):
        load_config(tmp_path / "d")


# --- hub ids, paths and revisions ------------------------------------------------------------------------------

@pytest.mark.parametrize("revision", [None, "v2", COMMIT])
def test_a_complete_cached_snapshot_does_not_wait_on_the_network(tmp_path, drafter_files, no_network, revision):
    cache = tmp_path / "hub"
    snapshot = add_to_cache(cache, "org/drafter", drafter_files, commit=COMMIT)
    add_to_cache(cache, "org/drafter", drafter_files, revision="v2", commit=COMMIT)
    assert resolve("org/drafter", revision=revision, cache_dir=cache) == str(snapshot)
    assert load_config("org/drafter", revision=revision, cache_dir=cache).family == "dflash"
    assert no_network == []  # not asked once (it used to be asked twice, each waiting ~23 s on retries)


def test_files_already_cached_are_not_fetched_again(tmp_path, drafter_files, monkeypatch):
    """Resolved once: the metadata step finds the shards in the cache, so there is no pinned second listing."""
    cache = tmp_path / "hub"
    calls = []

    def hub(repo_id, *, allow_patterns, revision, **kw):
        calls.append(revision)  # a fresh snapshot of the branch: metadata and shards arrive together
        return str(add_to_cache(cache, repo_id, drafter_files, commit=COMMIT))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub)
    assert load_config("org/drafter", cache_dir=cache).family == "dflash"
    assert calls == [None]


@pytest.mark.parametrize("text", ["configs/x.json", "./x", "../x", "a/b/c", "x.json", "org/model.safetensors",
                                  "~/x", "dir/", "x"])
def test_a_path_that_does_not_exist_is_no_hub_id(tmp_path, monkeypatch, no_network, capsys, text):
    monkeypatch.chdir(tmp_path)
    expected = f"no such file or directory: {text}"
    for load in (load_config, load_drafter, Qwen3Target.from_pretrained):
        with pytest.raises(ConfigError) as e:
            load(text)
        assert str(e.value) == expected
    assert main(["inspect", text]) == 2
    assert capsys.readouterr().err == f"error: {expected}\n" and no_network == []


@pytest.mark.parametrize("revision", ["", "..", "../main", "a//b", "/main", "main/", ".hidden", "a/.b", "x.lock",
                                      "a b", "a:b", "a\\b", "@", "a@{1}", "main."])
def test_a_malformed_revision_is_blamed_on_the_revision(tmp_path, no_network, capsys, revision):
    with pytest.raises(ValueError) as e:
        load_config("org/drafter", revision=revision, cache_dir=tmp_path)
    assert not isinstance(e.value, ConfigError) and str(e.value).startswith(f"revision {revision!r}: ")
    assert main(["inspect", "org/drafter", "--revision", revision, "--cache-dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith(f"error: revision {revision!r}: ") and no_network == []


@pytest.mark.parametrize("revision", ["main", "v1.0", "refs/pr/1", "release/2025-01", COMMIT])
def test_valid_revisions_pass(revision):
    check_revision(revision)


# --- non-UTF-8 JSON says so, naming the file --------------------------------------------------------------------

ENCODINGS = {
    "UTF-16 without a BOM": (lambda t: t.encode("utf-16-le"), "NUL characters"),
    "UTF-16 with a BOM": (lambda t: t.encode("utf-16"), "byte-order mark of UTF-16"),
    "UTF-32": (lambda t: t.encode("utf-32"), "byte-order mark of UTF-32"),
    "UTF-8 with a BOM": (lambda t: codecs.BOM_UTF8 + t.encode(), "byte-order mark"),
    "Latin-1": (lambda t: t.replace("{", '{"comment": "caf\u00e9", ', 1).encode("latin-1"), "byte 0xe9 at offset 16"),
}


@pytest.mark.parametrize("encoding", sorted(ENCODINGS))
def test_a_config_json_not_in_utf8_says_so(tmp_path, encoding):
    encode, says = ENCODINGS[encoding]
    write_checkpoint(tmp_path / "drafter", "tiny-dflash")
    write_qwen3_checkpoint(tmp_path / "target", "tiny-qwen3")
    for name, load in (("drafter", load_config), ("target", Qwen3Target.from_pretrained)):
        file = tmp_path / name / "config.json"
        file.write_bytes(encode(file.read_text()))
        with pytest.raises(ConfigError) as e:
            load(tmp_path / name)
        assert str(e.value).startswith(f"{file}: ") and "not UTF-8" in str(e.value) and says in str(e.value)


def test_an_hf_quant_config_not_in_utf8_says_so(tmp_path, nvfp4_checkpoint):
    from dflash_jax.nvfp4.checkpoint import QUANT_CONFIG_FILE, check_quant_config

    file = tmp_path / QUANT_CONFIG_FILE
    file.write_bytes(json.dumps({"quantization": {"quant_algo": "NVFP4"}}).encode("utf-16"))
    config = load_config(nvfp4_checkpoint)
    with pytest.raises(CheckpointError, match=f"{file}: .*not UTF-8 .*byte-order mark of UTF-16"):
        check_quant_config(str(tmp_path), config, frozenset())


@pytest.mark.parametrize("swap", ["a FIFO", "a directory"])
@pytest.mark.parametrize("which", ["index", "hf_quant_config.json"])
def test_an_index_or_quant_config_that_is_no_regular_file_is_refused_not_skipped(tmp_path, swap, which):
    """Skipped, the index would let the stray model.safetensors load instead; the quant config, its checks."""
    write_checkpoint(tmp_path / "d", "tiny-dflash", nvfp4=True)
    file = tmp_path / "d" / ("model.safetensors.index.json" if which == "index" else "hf_quant_config.json")
    file.unlink(missing_ok=True)
    os.mkfifo(file) if swap == "a FIFO" else file.mkdir()
    with deadline(10), pytest.raises(CheckpointError, match=re.escape(f"{file}: not a regular file")):
        load_drafter(tmp_path / "d")

"""Hub ids: resolution from a hub cache laid out as huggingface_hub lays it out, no network (tests/_hub.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import chex
import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ._hub import add_to_cache, directory_files, repo_folder  # first: sets HF_HUB_OFFLINE=1

huggingface_hub = pytest.importorskip("huggingface_hub")

from dflash_jax import ConfigError, Qwen3Target, load_config, load_drafter  # noqa: E402
from dflash_jax.hub import is_repo_id, resolve  # noqa: E402
from dflash_jax.testing import write_checkpoint, write_qwen3_checkpoint  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OFFLINE = dict(local_files_only=True)


@pytest.fixture
def cache(tmp_path):
    return tmp_path / "hub"


def cached_checkpoint(tmp_path, cache, repo_id, preset="tiny-dflash", **kw) -> str:
    source = tmp_path / f"src-{preset}-{len(os.listdir(tmp_path))}"
    write_checkpoint(source, preset, **kw)
    return str(add_to_cache(cache, repo_id, directory_files(source)))


def test_a_hub_id_loads_like_its_directory(tmp_path, cache):
    snapshot = cached_checkpoint(tmp_path, cache, "z-lab/tiny-drafter", num_shards=3)  # index + 3 shards
    from_id = load_drafter("z-lab/tiny-drafter", cache_dir=cache, dtype=jnp.float32, **OFFLINE)
    from_dir = load_drafter(snapshot, dtype=jnp.float32)
    chex.assert_trees_all_equal(from_id.params, from_dir.params)
    assert from_id.config == from_dir.config == load_config("z-lab/tiny-drafter", cache_dir=cache, **OFFLINE)
    assert resolve("z-lab/tiny-drafter", cache_dir=cache, **OFFLINE) == snapshot
    assert os.path.islink(os.path.join(snapshot, "config.json"))  # read through the cache's symlinks


def test_revision_picks_the_snapshot(tmp_path, cache):
    cached_checkpoint(tmp_path, cache, "org/drafter", "tiny-dflash")
    v2 = tmp_path / "v2"
    write_checkpoint(v2, "tiny-dspark")
    commit = "0123456789abcdef0123456789abcdef01234567"
    add_to_cache(cache, "org/drafter", directory_files(v2), revision="v2", commit=commit)
    assert load_config("org/drafter", cache_dir=cache, **OFFLINE).family == "dflash"
    assert load_config("org/drafter", revision="v2", cache_dir=cache, **OFFLINE).family == "dspark"
    assert load_drafter("org/drafter", revision=commit, cache_dir=cache, **OFFLINE).config.family == "dspark"


def test_target_from_a_hub_id(tmp_path, cache):
    source = tmp_path / "qwen3"
    write_qwen3_checkpoint(source, "tiny-qwen3", num_shards=2)
    add_to_cache(cache, "Qwen/tiny-qwen3", directory_files(source))
    target = Qwen3Target.from_pretrained("Qwen/tiny-qwen3", cache_dir=cache, dtype=jnp.float32, **OFFLINE)
    chex.assert_trees_all_equal(target.params, Qwen3Target.from_pretrained(source, dtype=jnp.float32).params)


def test_not_cached_offline_is_a_clear_error(cache):
    with pytest.raises(ConfigError, match=r"z-lab/absent: .*'main'.* not in the hub cache") as e:
        load_drafter("z-lab/absent", cache_dir=cache, **OFFLINE)
    assert str(cache) in str(e.value)
    with pytest.raises(ConfigError, match="z-lab/absent: .*'v9'.* not in the hub cache"):
        Qwen3Target.from_pretrained("z-lab/absent", revision="v9", cache_dir=cache, **OFFLINE)


def test_paths_are_not_ids(tmp_path, monkeypatch):
    for text in ("z-lab/Qwen3-8B-DFlash-b16", "Qwen/Qwen3-8B", "a.b/c_d-e"):
        assert is_repo_id(text)
    for text in ("/abs/dir", "./rel", "a/b/c", "../x", "x", "a/../b", "a--b/c", "dir/", "configs/x.json"):
        assert not is_repo_id(text)
    with pytest.raises(ConfigError, match="^no such file or directory: /no/such/dir$"):
        resolve("/no/such/dir")
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "missing")
    # a local directory wins over a repo id of the same name, as in transformers
    monkeypatch.chdir(tmp_path)
    write_checkpoint(tmp_path / "org" / "local", "tiny-dspark")
    assert resolve("org/local") == "org/local" and load_config("org/local").family == "dspark"


@pytest.mark.parametrize("text", ["a/.", "a/b.", "a/-b", "a./b", "a/.b", "a/b-", "a/x.git", "a/caf\u00e9",
                                  "a/" + "b" * 97])
def test_ids_huggingface_hub_refuses_are_no_such_path(text):
    """Not huggingface_hub's `HFValidationError` (a regression for "a/."): the error every other malformed id
    gets, naming the argument."""
    with pytest.raises(ConfigError, match=f"^no such file or directory: {re.escape(text)}$"):
        load_drafter(text)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(st.text(alphabet="aZ9_.-/\u00e9", max_size=10))
def test_every_id_taken_for_the_hub_is_one_huggingface_hub_accepts(text):
    if is_repo_id(text):
        huggingface_hub.utils.validate_repo_id(text)


def test_without_huggingface_hub_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import fails
    with pytest.raises(ConfigError, match=r"org/drafter: no such file or directory; .*dflash_jax\[hub\]"):
        load_drafter("org/drafter")


class FakeHub:
    """`snapshot_download` against an in-memory repo: huggingface_hub's own pattern filter picks the files,
    which land in a real cache layout; records what each call fetched and at which revision."""

    commit = "fedcba9876543210fedcba9876543210fedcba98"

    def __init__(self, cache, repo_id, files):
        self.cache, self.repo_id, self.files, self.calls = cache, repo_id, files, []

    def __call__(self, repo_id, *, allow_patterns, ignore_patterns, revision, cache_dir, local_files_only, token):
        from huggingface_hub.utils import filter_repo_objects

        assert repo_id == self.repo_id and cache_dir == self.cache and revision in (None, self.commit)
        chosen = sorted(filter_repo_objects(self.files, allow_patterns=allow_patterns, ignore_patterns=ignore_patterns))
        self.calls.append((revision, chosen))
        return str(add_to_cache(self.cache, repo_id, {n: self.files[n] for n in chosen}, commit=self.commit))

    @property
    def fetched(self):
        return sorted(n for _, names in self.calls for n in names)


def remote_repo(tmp_path, **kw) -> dict[str, bytes]:
    """A repository holding a checkpoint and the files a load must not download."""
    source = tmp_path / "remote"
    write_checkpoint(source, "tiny-dflash", **kw)
    extras = {"README.md": b"# card", "pytorch_model.bin": b"x" * 64, "original/model.safetensors": b"x" * 64,
              "consolidated.safetensors": b"x" * 64, "training_state/optimizer.pt": b"x" * 64}
    return {**directory_files(source), **extras}


@pytest.mark.parametrize("layout", ["sharded", "single", "nvfp4"])
def test_only_what_a_load_reads_is_downloaded(tmp_path, cache, monkeypatch, layout):
    kw = {"sharded": dict(num_shards=2), "single": {}, "nvfp4": dict(nvfp4=True)}[layout]
    fake = FakeHub(cache, "org/drafter", remote_repo(tmp_path, **kw))
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    drafter = load_drafter("org/drafter", cache_dir=cache)
    assert drafter.config.family == "dflash"
    expected = {
        "sharded": ["config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                    "model.safetensors.index.json"],
        "single": ["config.json", "model.safetensors"],
        "nvfp4": ["config.json", "hf_quant_config.json", "model.safetensors"],
    }[layout]
    assert fake.fetched == expected
    assert [rev for rev, _ in fake.calls] == [None, FakeHub.commit]  # the second step pinned to the commit


def test_any_top_level_safetensors_without_index_or_model_safetensors(tmp_path, cache, monkeypatch):
    files = remote_repo(tmp_path)
    files["drafter.safetensors"] = files.pop("model.safetensors")
    files.pop("consolidated.safetensors")
    fake = FakeHub(cache, "org/drafter", files)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    assert load_drafter("org/drafter", cache_dir=cache).config.family == "dflash"
    assert fake.fetched == ["config.json", "drafter.safetensors"]  # not original/model.safetensors


def test_env_hf_home_and_offline_are_honoured(tmp_path):
    """A fresh process (huggingface_hub reads its environment on import): HF_HOME/hub is the cache and
    HF_HUB_OFFLINE=1 keeps it offline; through the CLI, which reports a miss without a traceback."""
    source = tmp_path / "src"
    write_checkpoint(source, "tiny-dspark")
    add_to_cache(tmp_path / "home" / "hub", "org/drafter", directory_files(source))
    env = {**os.environ, "HF_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1", "PYTHONPATH": ROOT}
    env.pop("HF_HUB_CACHE", None)
    def run(*args):
        return subprocess.run([sys.executable, "-m", "dflash_jax", *args], env=env, capture_output=True, text=True,
                              timeout=120)

    found = run("inspect", "--json", "org/drafter")
    assert found.returncode == 0, found.stderr
    assert '"family": "dspark"' in found.stdout
    missing = run("inspect", "org/other")
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert missing.stderr.startswith("error: org/other: ") and "not in the hub cache" in missing.stderr
    assert str(repo_folder(tmp_path / "home" / "hub", "x").parent) in missing.stderr


def test_a_cached_snapshot_missing_a_shard_gets_one_bounded_attempt(tmp_path, cache, monkeypatch):
    """The snapshot_download path retried for 52 s (ten "Retrying" lines) before its error: now one request to
    the hub, pinned to the snapshot's commit, then the files fetched or an error naming what is missing."""
    snapshot = cached_checkpoint(tmp_path, cache, "org/partial", num_shards=2)
    shard = os.path.join(snapshot, "model-00001-of-00002.safetensors")
    blob = os.path.realpath(shard)
    os.unlink(shard)

    def never(*args, **kwargs):
        raise AssertionError("snapshot_download: the listing that retries")

    probes, fetched = [], []

    def refused(url, token=None):
        probes.append(url)
        raise ConnectionRefusedError(111, "Connection refused")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", never)
    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", refused)
    refusal = r"org/partial: .*revision 'main'.* without model-00001-of-00002.safetensors, which its index names"
    with pytest.raises(ConfigError, match=refusal + r".*ConnectionRefusedError"):
        resolve("org/partial", cache_dir=cache)
    assert len(probes) == 1 and os.path.basename(snapshot) in probes[0]
    with pytest.raises(ConfigError, match=refusal + r".*local_files_only"):
        load_drafter("org/partial", cache_dir=cache, **OFFLINE)
    assert len(probes) == 1  # offline: not even the one request

    def download(repo_id, name, *, revision, **options):
        fetched.append((name, revision))
        os.symlink(os.path.relpath(blob, snapshot), shard)

    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", lambda url, token=None: None)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    assert resolve("org/partial", cache_dir=cache) == snapshot
    assert fetched == [("model-00001-of-00002.safetensors", os.path.basename(snapshot))]

"""The per-process and on-disk cache of compiled conversions: reuse across processes, privacy, damage, opt-out,
and (issue 13) trust: no pickle, this user's private files only, digest and signature checked, size capped."""

import os
import pickle
import stat
from concurrent.futures import Future
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dflash_jax import _executables, _private, load_drafter
from dflash_jax.nvfp4 import dequantize, quantize
from dflash_jax.testing import write_checkpoint

DEVICE = jax.local_devices()[0]
INPUTS = (((64, 16), np.dtype(np.uint8)), ((64, 2), np.dtype(ml_dtypes.float8_e4m3fn)), ((), np.dtype(np.float32)))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh cache directory, an empty per-process cache, and a count of the compilations."""
    directory = tmp_path / "cache"
    monkeypatch.setenv(_executables.CACHE_ENV, str(directory))
    monkeypatch.setattr(_executables, "_COMPILED", {})
    calls = []
    compile_ = _executables._compile
    monkeypatch.setattr(_executables, "_compile", lambda *a: calls.append(a[0]) or compile_(*a))
    return directory, calls


def forget_process_cache(monkeypatch):
    """What a fresh process starts with: nothing compiled in memory (the disk cache stays)."""
    monkeypatch.setattr(_executables, "_COMPILED", {})


def entries(directory):
    """The stored executables of `directory` (besides them it holds the key, `_private.KEY_FILE`)."""
    return sorted(p for p in directory.iterdir() if p.name.endswith(".jaxexec"))


def nvfp4_arguments(inputs=INPUTS):
    (n, half_k), _ = inputs[0]
    packed, scale, scale_2 = quantize(np.random.default_rng(0).normal(size=(n, 2 * half_k)).astype(np.float32))
    return [jax.device_put(x, DEVICE) for x in (packed, scale.view(inputs[1][1]), scale_2)]


def run(inputs=INPUTS, dtype=jnp.bfloat16):
    return _executables.compiled("nvfp4", inputs, dtype, DEVICE).result()(*nvfp4_arguments(inputs))


def test_a_later_process_loads_the_stored_executable_instead_of_compiling(cache, monkeypatch):
    directory, calls = cache
    first = run()
    assert calls == ["nvfp4"]
    (path,) = entries(directory)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700 and stat.S_IMODE(path.stat().st_mode) == 0o600
    forget_process_cache(monkeypatch)
    second = run()
    assert calls == ["nvfp4"]  # not compiled again
    expected = dequantize(*nvfp4_arguments())
    np.testing.assert_array_equal(np.asarray(second).view(np.uint16), np.asarray(expected).view(np.uint16))
    np.testing.assert_array_equal(np.asarray(first).view(np.uint16), np.asarray(second).view(np.uint16))


def test_the_same_conversion_is_compiled_once_per_process(cache):
    _, calls = cache
    futures = [_executables.compiled("nvfp4", INPUTS, jnp.bfloat16, DEVICE) for _ in range(3)]
    assert len({id(f) for f in futures}) == 1
    futures[0].result()
    assert calls == ["nvfp4"]


def test_each_signature_has_its_own_entry(cache):
    directory, calls = cache
    run()
    run(dtype=jnp.float16)
    run(inputs=(((64, 16), np.dtype(np.uint8)), ((64, 2), np.dtype(np.uint8)), ((), np.dtype(np.float32))))
    run(inputs=(((32, 16), np.dtype(np.uint8)), ((32, 2), np.dtype(np.uint8)), ((), np.dtype(np.float32))))
    assert calls == ["nvfp4"] * 4 and len(entries(directory)) == 4


@pytest.mark.parametrize("damage", ["garbage", "empty", "truncated"])
def test_a_damaged_entry_is_recompiled_and_replaced(cache, monkeypatch, damage):
    directory, calls = cache
    run()
    (path,) = entries(directory)
    good = path.read_bytes()
    path.write_bytes({"garbage": b"\x80\x04not a pickle", "empty": b"", "truncated": good[: len(good) // 2]}[damage])
    forget_process_cache(monkeypatch)
    expected = dequantize(*nvfp4_arguments())
    np.testing.assert_array_equal(np.asarray(run()).view(np.uint16), np.asarray(expected).view(np.uint16))
    assert calls == ["nvfp4", "nvfp4"] and len(path.read_bytes()) == len(good)


@pytest.mark.parametrize("unsafe", ["writable by others", "a symlink", "a FIFO"])
def test_entries_others_could_have_written_are_ignored(cache, monkeypatch, tmp_path, unsafe):
    directory, calls = cache
    run()
    (path,) = entries(directory)
    if unsafe == "writable by others":
        path.chmod(0o666)
    elif unsafe == "a symlink":
        target = tmp_path / "elsewhere"
        path.rename(target)
        path.symlink_to(target)
    else:
        path.unlink()
        os.mkfifo(path)  # would block a plain open(); replaced by the recompiled entry
    forget_process_cache(monkeypatch)
    run()
    assert calls == ["nvfp4", "nvfp4"]


def test_an_empty_setting_turns_the_disk_cache_off(cache, monkeypatch):
    directory, calls = cache
    monkeypatch.setenv(_executables.CACHE_ENV, "")
    run()
    forget_process_cache(monkeypatch)
    run()
    assert calls == ["nvfp4", "nvfp4"] and not directory.exists()


def test_an_unwritable_directory_warns_once_and_loads_anyway(cache, monkeypatch, tmp_path):
    _, calls = cache
    blocker = tmp_path / "a file"
    blocker.write_text("not a directory")
    monkeypatch.setenv(_executables.CACHE_ENV, str(blocker / "cache"))
    monkeypatch.setattr(_private, "_WARNED", set())
    with pytest.warns(RuntimeWarning, match="not using .*Not a directory"):
        run()
    run(dtype=jnp.float16)  # the same directory again: no second warning
    assert calls == ["nvfp4", "nvfp4"] and len(_private._WARNED) == 1


def test_default_directory_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv(_executables.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert _executables.cache_dir() == tmp_path / "dflash_jax"


def test_an_nvfp4_load_in_a_later_process_compiles_nothing(cache, monkeypatch, tmp_path):
    directory, calls = cache
    write_checkpoint(tmp_path / "ckpt", "tiny-dflash", nvfp4=True)
    first = load_drafter(tmp_path / "ckpt", dtype=jnp.float32)  # dequantizers and bf16 -> f32 casts
    assert calls and len(entries(directory)) == len(calls)
    forget_process_cache(monkeypatch)
    compiled_before = len(calls)
    second = load_drafter(tmp_path / "ckpt", dtype=jnp.float32)
    assert len(calls) == compiled_before
    jax.tree.map(np.testing.assert_array_equal, first.params, second.params)


# --- issue 13: the cache trusts only what this user wrote, intact, for this signature ---------------

def entry_of(directory):
    (path,) = entries(directory)
    return path


class _Planted:
    """Unpickling this creates the file `marker`: what a planted pickle could do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def test_a_planted_pickle_is_never_run(cache, monkeypatch, tmp_path):
    directory, calls = cache
    run()
    path = entry_of(directory)
    marker = tmp_path / "the planted code ran"
    path.write_bytes(pickle.dumps(_Planted(marker)))
    path.chmod(0o600)  # this user's, private: the old cache unpickled it
    forget_process_cache(monkeypatch)
    run()
    assert not marker.exists() and calls == ["nvfp4", "nvfp4"]
    assert path.read_bytes().startswith(_executables.MAGIC)  # replaced by a good entry


@pytest.mark.parametrize("where", ["magic", "digest", "payload", "last byte"])
def test_a_flipped_byte_is_recompiled_never_deserialised(cache, monkeypatch, where):
    directory, calls = cache
    run()
    path = entry_of(directory)
    blob = bytearray(path.read_bytes())
    head = len(_executables.MAGIC)
    blob[{"magic": 0, "digest": head + 5, "payload": (head + 32 + len(blob)) // 2, "last byte": -1}[where]] ^= 0x10
    path.write_bytes(bytes(blob))
    forget_process_cache(monkeypatch)
    deserialised = []
    monkeypatch.setattr(_executables, "_signature_problem", lambda *a: deserialised.append(a) or None)
    expected = dequantize(*nvfp4_arguments())
    np.testing.assert_array_equal(np.asarray(run()).view(np.uint16), np.asarray(expected).view(np.uint16))
    assert calls == ["nvfp4", "nvfp4"] and len(deserialised) == 1  # only the fresh compile was checked


def test_an_entry_renamed_to_another_signature_is_recompiled(cache, monkeypatch):
    """A float16 entry moved to the bfloat16 entry's name: the bfloat16 load stays bfloat16."""
    directory, calls = cache
    run(dtype=jnp.bfloat16)
    (bf16,) = entries(directory)
    run(dtype=jnp.float16)
    (f16,) = set(entries(directory)) - {bf16}
    f16.replace(bf16)
    forget_process_cache(monkeypatch)
    assert run(dtype=jnp.bfloat16).dtype == jnp.bfloat16
    assert calls == ["nvfp4"] * 3


def test_an_intact_entry_of_another_program_is_refused_by_its_signature(cache, monkeypatch):
    """Belt and braces behind the digest: the loaded program's parameters and result are checked."""
    directory, calls = cache
    run(dtype=jnp.float16)
    (f16,) = entries(directory)
    key = ("nvfp4", INPUTS, jnp.dtype(jnp.bfloat16), DEVICE)
    description = _executables._describe(key)
    payload = f16.read_bytes()[len(_executables.MAGIC) + 32:]
    target = directory / "bf16.jaxexec"
    secret = _private.user_key(directory, "test")
    _executables._write_entry(target, secret, description, payload)  # digest right, program wrong
    output = _executables._output("nvfp4", INPUTS, jnp.bfloat16)
    assert _executables._load(target, secret, description, DEVICE, INPUTS, output) is None
    good = _executables._load(f16, secret, _executables._describe((*key[:2], jnp.dtype(jnp.float16), DEVICE)), DEVICE,
                              INPUTS, _executables._output("nvfp4", INPUTS, jnp.float16))
    assert good is not None


def test_entries_above_the_size_cap_are_neither_read_nor_written(cache, monkeypatch):
    directory, calls = cache
    run()
    size = entry_of(directory).stat().st_size
    monkeypatch.setattr(_executables, "MAX_ENTRY_BYTES", size - 1)
    forget_process_cache(monkeypatch)
    entry_of(directory).unlink()
    run()
    assert calls == ["nvfp4", "nvfp4"] and not entries(directory)


def test_an_entry_of_another_user_is_ignored(cache, monkeypatch):
    directory, calls = cache
    run()
    os.chown(entry_of(directory), 12345, 12345)
    forget_process_cache(monkeypatch)
    run()
    assert calls == ["nvfp4", "nvfp4"] and entry_of(directory).stat().st_uid == os.getuid()


@pytest.mark.parametrize("unsafe", ["owned by another user", "writable by others", "writable by its group",
                                    "in a parent anyone can write", "a file"])
def test_a_directory_others_could_write_is_not_used(cache, monkeypatch, tmp_path, unsafe):
    directory, calls = cache
    if unsafe == "in a parent anyone can write":
        parent = tmp_path / "open"
        parent.mkdir()
        directory = parent / "cache"
        monkeypatch.setenv(_executables.CACHE_ENV, str(directory))
    run()
    planted = list(directory.iterdir())
    if unsafe == "owned by another user":
        os.chown(directory, 12345, 12345)
    elif unsafe == "a file":
        for p in planted:
            p.unlink()
        directory.rmdir()
        directory.write_bytes(b"")
    elif unsafe == "in a parent anyone can write":
        directory.parent.chmod(0o777)  # not sticky: anyone could rename our directory away and put theirs
    else:
        directory.chmod(0o777 if unsafe == "writable by others" else 0o770)
    forget_process_cache(monkeypatch)
    monkeypatch.setattr(_private, "_WARNED", set())
    with pytest.warns(RuntimeWarning, match="not using"):
        run()
    assert calls == ["nvfp4", "nvfp4"]  # the entry there was not used


def test_a_sticky_world_writable_parent_is_fine(cache, monkeypatch, tmp_path):
    """Like /tmp: others can write there but cannot rename or remove what is ours."""
    parent = tmp_path / "sticky"
    parent.mkdir()
    parent.chmod(0o1777)
    monkeypatch.setenv(_executables.CACHE_ENV, str(parent / "cache"))
    _, calls = cache
    run()
    forget_process_cache(monkeypatch)
    run()
    assert calls == ["nvfp4"]


def test_a_directory_at_an_entry_path_warns_and_loads(cache, monkeypatch):
    directory, calls = cache
    run()
    path = entry_of(directory)
    path.unlink()
    path.mkdir()
    (path / "inside").write_bytes(b"")
    for _ in range(2):  # every later load still works
        forget_process_cache(monkeypatch)
        monkeypatch.setattr(_private, "_WARNED", set())
        with pytest.warns(RuntimeWarning, match="cannot write compiled conversions"):
            expected = dequantize(*nvfp4_arguments())
            np.testing.assert_array_equal(np.asarray(run()).view(np.uint16), np.asarray(expected).view(np.uint16))
    assert calls == ["nvfp4"] * 3 and path.is_dir()


class _Synchronous:
    """An executor that runs the task before `submit` returns: the future is done before any callback."""

    def submit(self, fn, *args):
        future = Future()
        try:
            future.set_result(fn(*args))
        except Exception as e:
            future.set_exception(e)
        return future


def test_a_compile_that_fails_at_once_raises_its_error_and_is_retried(cache, monkeypatch):
    _, calls = cache
    monkeypatch.setattr(_executables, "_POOL", _Synchronous())
    monkeypatch.setattr(_executables, "_compile", lambda *a: calls.append("failed") or 1 / 0)
    future = _executables.compiled("nvfp4", INPUTS, jnp.bfloat16, DEVICE)  # no KeyError
    with pytest.raises(ZeroDivisionError):
        future.result()
    _executables.compiled("nvfp4", INPUTS, jnp.bfloat16, DEVICE)
    assert calls == ["failed", "failed"]  # forgotten, so tried again


def test_the_key_covers_every_module_a_conversion_imports(tmp_path):
    """The entries' key hashes the sources the conversion imports, found from its imports (a hand list missed
    `_shapes.py`, which the NVFP4 kernel sizes its tiles with): editing it makes new entries; editing a module
    the conversion never imports (the CLI) does not."""
    package = tmp_path / "dflash_jax"
    for source in Path(_executables.__file__).parent.rglob("*.py"):
        copy = package / source.relative_to(Path(_executables.__file__).parent)
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_bytes(source.read_bytes())
    before = _executables.source_digest(package)
    with open(package / "cli.py", "a") as f:
        f.write("# an edit\n")
    assert _executables.source_digest(package) == before
    with open(package / "_shapes.py", "a") as f:
        f.write("# an edit\n")
    assert _executables.source_digest(package) != before

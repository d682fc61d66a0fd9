"""The per-process and on-disk cache of compiled conversions: reuse across processes, privacy, damage, opt-out."""

import os
import stat

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dflash_jax import _executables, load_drafter
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
    (path,) = directory.iterdir()
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700 and stat.S_IMODE(path.stat().st_mode) == 0o600
    forget_process_cache(monkeypatch)
    second = run()
    assert calls == ["nvfp4"]  # not compiled again
    expected = dequantize(*nvfp4_arguments(), backend="xla")
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
    assert calls == ["nvfp4"] * 4 and len(list(directory.iterdir())) == 4


@pytest.mark.parametrize("damage", ["garbage", "empty", "truncated"])
def test_a_damaged_entry_is_recompiled_and_replaced(cache, monkeypatch, damage):
    directory, calls = cache
    run()
    (path,) = directory.iterdir()
    good = path.read_bytes()
    path.write_bytes({"garbage": b"\x80\x04not a pickle", "empty": b"", "truncated": good[: len(good) // 2]}[damage])
    forget_process_cache(monkeypatch)
    expected = dequantize(*nvfp4_arguments(), backend="xla")
    np.testing.assert_array_equal(np.asarray(run()).view(np.uint16), np.asarray(expected).view(np.uint16))
    assert calls == ["nvfp4", "nvfp4"] and len(path.read_bytes()) == len(good)


@pytest.mark.parametrize("unsafe", ["writable by others", "a symlink", "a FIFO"])
def test_entries_others_could_have_written_are_ignored(cache, monkeypatch, tmp_path, unsafe):
    directory, calls = cache
    run()
    (path,) = directory.iterdir()
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
    monkeypatch.setattr(_executables, "_WARNED", set())
    with pytest.warns(RuntimeWarning, match="cannot write compiled conversions"):
        run()
    run(dtype=jnp.float16)  # the same directory again: no second warning
    assert calls == ["nvfp4", "nvfp4"] and len(_executables._WARNED) == 1


def test_default_directory_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv(_executables.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert _executables.cache_dir() == tmp_path / "dflash_jax"


def test_an_nvfp4_load_in_a_later_process_compiles_nothing(cache, monkeypatch, tmp_path):
    directory, calls = cache
    write_checkpoint(tmp_path / "ckpt", "tiny-dflash", nvfp4=True)
    first = load_drafter(tmp_path / "ckpt", dtype=jnp.float32)  # dequantizers and bf16 -> f32 casts
    assert calls and len(list(directory.iterdir())) == len(calls)
    forget_process_cache(monkeypatch)
    compiled_before = len(calls)
    second = load_drafter(tmp_path / "ckpt", dtype=jnp.float32)
    assert len(calls) == compiled_before
    jax.tree.map(np.testing.assert_array_equal, first.params, second.params)

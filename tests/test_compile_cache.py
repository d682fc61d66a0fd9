"""`enable_compile_cache`: JAX's persistent compilation cache from Python, as the CLI turns it on, under the
package's trust rules (the hostile cases, for the CLI's default and variable: tests/test_hostile_files.py)."""

import jax
import jax.numpy as jnp
import pytest

import dflash_jax
from dflash_jax import enable_compile_cache


@pytest.fixture
def restore_jax_cache():
    """JAX's cache setting as the test found it (a process-wide setting)."""
    before = jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs
    yield
    jax.config.update("jax_compilation_cache_dir", before[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", before[1])


def test_directory_and_off_switch(tmp_path, monkeypatch, restore_jax_cache):
    """The default under XDG_CACHE_HOME, JAX's own variable when set, its empty value turning the cache off."""
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    expected = str(tmp_path / "dflash_jax" / "jax-compilation-cache")
    assert enable_compile_cache() == expected == jax.config.jax_compilation_cache_dir
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "")  # off: JAX reads the variable itself
    assert enable_compile_cache() is None and jax.config.jax_compilation_cache_dir is None
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "mine"))
    assert enable_compile_cache() == str(tmp_path / "mine")


def test_a_path_is_made_private_and_used_after_a_first_compile(tmp_path, monkeypatch, restore_jax_cache):
    """`path=` wins over the variable; it is created 0700; JAX stores programs there although this process compiled
    before (JAX decides whether it has a cache at its first compile)."""
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "not this"))
    jax.jit(lambda x: x + 1)(jnp.ones(3))
    directory = tmp_path / "cache"
    assert dflash_jax.enable_compile_cache(directory) == str(directory) == jax.config.jax_compilation_cache_dir
    assert directory.stat().st_mode & 0o777 == 0o700
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # store this tiny program too
    jax.jit(lambda x: x * 3 - 1)(jnp.ones(5))
    assert any(directory.iterdir()) and not (tmp_path / "not this").exists()


def test_a_directory_others_can_write_is_refused(tmp_path, restore_jax_cache):
    directory = tmp_path / "shared"
    directory.mkdir()
    directory.chmod(0o777)
    with pytest.warns(RuntimeWarning, match=f"not using {directory} for JAX's compilation cache.*writable"):
        assert enable_compile_cache(directory) is None
    assert jax.config.jax_compilation_cache_dir is None

"""The private JAX APIs behind `_jax_compat`: each resolves on the installed jax (CI's 0.10.2; the GPU machines
run 0.11.2), and a jax outside the supported range is refused by name at import."""

import inspect
import os
import tomllib

import jax
import pytest

from dflash_jax import _jax_compat


def test_the_installed_jax_is_supported():
    _jax_compat.check_version(jax.__version__)


@pytest.mark.parametrize("version", ["0.9.1", "0.12.0", "1.0.0", "nightly"])
def test_a_jax_outside_the_range_is_refused_by_name(version):
    with pytest.raises(_jax_compat.UnsupportedJaxError, match=rf"supports jax >= 0\.10 and < 0\.12 .*jax {version}"):
        _jax_compat.check_version(version)


@pytest.mark.parametrize("version", ["0.10.2", "0.11.2", "0.11.0.dev20260101"])
def test_the_versions_the_package_runs_on_pass(version):
    _jax_compat.check_version(version)


def test_every_private_api_resolves():
    """What the kernels, the executable cache and the tests reach: names that would fail only on a GPU or deep in a
    load if a jax release moved them."""
    ir, arith, llvm, vector = _jax_compat.mlir()
    assert all(callable(f) for f in (ir.IntegerType.get_signless, ir.VectorType.get, ir.BF16Type.get, arith.bitcast,
                                     llvm.inline_asm, vector.extract, vector.bitcast, vector.from_elements))
    from jax.experimental.mosaic import gpu as mgpu

    assert {"_registers", "_layout", "_is_signed"} <= inspect.signature(mgpu.FragmentedArray).parameters.keys()
    assert _jax_compat.interpret_params() is not None
    switch = _jax_compat.pallas_interpret_switch()
    assert switch is not None and callable(switch.swap_local) and callable(switch.set_local)
    client = _jax_compat.xla_client
    assert all(hasattr(client, name) for name in ("LoadedExecutable", "XlaComputation"))
    assert _jax_compat.JAXLIB_VERSION


def test_the_package_metadata_states_the_same_range():
    """pyproject.toml's jax requirement is `SUPPORTED`: pip refuses what the import would."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        requirements = tomllib.load(f)["project"]["dependencies"]
    (low, high) = _jax_compat.SUPPORTED
    assert f"jax>={low[0]}.{low[1]},<{high[0]}.{high[1]}" in requirements

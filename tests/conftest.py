"""Test set-up: 8 simulated CPU devices (so replication over a mesh is exercised on any machine), strict dtype
promotion (an implicit promotion in the package is a bug: casts are written out), a private executable cache."""

import atexit
import os
import shutil
import tempfile

import jax
import pytest

# Before any backend is initialised. JAX's own option, not XLA_FLAGS, so subprocesses keep their one device.
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_dtype_promotion", "strict")
# compiled conversions go to a cache of this run, not the user's (tests that need their own set it themselves)
os.environ["DFLASH_JAX_CACHE_DIR"] = tempfile.mkdtemp(prefix="dflash_jax-test-cache-")
atexit.register(shutil.rmtree, os.environ["DFLASH_JAX_CACHE_DIR"], ignore_errors=True)

DATA = os.path.join(os.path.dirname(__file__), "data")
GOLDEN = os.path.join(DATA, "golden")  # copy of the shared PyTorch-reference outputs (README inside)


@pytest.fixture(scope="session")
def cpu_mesh():
    """A 1-D mesh over every local device (8 simulated CPU devices in the suite)."""
    return jax.make_mesh((len(jax.devices()),), ("data",))

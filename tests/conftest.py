"""Test set-up: 8 simulated CPU devices (so replication over a mesh is exercised on any machine), a private
executable cache."""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
# compiled conversions go to a cache of this run, not the user's (tests that need their own set it themselves)
os.environ["DFLASH_JAX_CACHE_DIR"] = tempfile.mkdtemp(prefix="dflash_jax-test-cache-")
atexit.register(shutil.rmtree, os.environ["DFLASH_JAX_CACHE_DIR"], ignore_errors=True)

import jax  # noqa: E402  (after XLA_FLAGS)
import pytest  # noqa: E402

DATA = os.path.join(os.path.dirname(__file__), "data")
GOLDEN = os.path.join(DATA, "golden")  # copy of the shared PyTorch-reference outputs (README inside)


@pytest.fixture(scope="session")
def cpu_mesh():
    """A 1-D mesh over every local device (8 simulated CPU devices in the suite)."""
    return jax.make_mesh((len(jax.devices()),), ("data",))

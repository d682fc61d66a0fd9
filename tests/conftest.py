"""Test set-up: 8 simulated CPU devices (so replication over a mesh is exercised on any machine)."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402  (after XLA_FLAGS)
import pytest  # noqa: E402

DATA = os.path.join(os.path.dirname(__file__), "data")
GOLDEN = os.path.join(DATA, "golden")  # copy of the shared PyTorch-reference outputs (README inside)


@pytest.fixture(scope="session")
def cpu_mesh():
    """A 1-D mesh over every local device (8 simulated CPU devices in the suite)."""
    return jax.make_mesh((len(jax.devices()),), ("data",))

"""Explicit kernel choice and device-side buffers: the `impl` vocabulary, the kernel tuning table, caches made on
their devices, and the target's forward and prefill donating the cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from dflash_jax.drafting import init_cache
from dflash_jax.testing import random_drafter, random_qwen3, random_qwen3_5


def test_caches_are_made_on_their_devices_without_a_transfer():
    """A host array copied over would be a disallowed host-to-device transfer (and host memory the size of the
    cache); the caches are made by a compiled program where they live."""
    drafter = random_drafter("tiny-dflash", dtype=jnp.float32)
    dense, hybrid = random_qwen3("tiny-qwen3", dtype=jnp.float32), random_qwen3_5("tiny-qwen3_5", dtype=jnp.float32)
    with jax.transfer_guard_host_to_device("disallow"):
        caches = init_cache(drafter, 2, 40), dense.init_cache(2, 40), hybrid.init_cache(2, 40)
    assert not any(leaf.any() for leaf in jax.tree.leaves(caches))
    assert all(leaf.committed for leaf in jax.tree.leaves(caches[0]))  # where the drafter's params are

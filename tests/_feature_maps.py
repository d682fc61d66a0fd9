"""A row-wise `FeatureMap` for the prefill tests (`tanh(features @ w)`, narrower than the features, as the drafter's
context projection is), and its NumPy twin to check the mapped rows against the reference's features."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.target import FeatureMap


def _squash(params: dict, features: jax.Array) -> jax.Array:
    return jnp.tanh(features @ params["w"])  # [batch, rows, F] -> [batch, rows, D]


def squash(width: int, out: int, seed: int = 0) -> tuple[FeatureMap, np.ndarray]:
    """A `FeatureMap` `[..., width] -> [..., out]` of random float32 weights `w` (columns of unit norm, so the
    mapped rows stay O(1)), and `w`."""
    w = np.random.default_rng(seed).standard_normal((width, out)).astype(np.float32) / np.sqrt(width)
    return FeatureMap({"w": jnp.asarray(w)}, _squash), w


def numpy_squash(w: np.ndarray, features: np.ndarray) -> np.ndarray:
    return np.tanh(np.asarray(features, np.float64) @ w.astype(np.float64))

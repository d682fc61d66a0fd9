"""Integer shape arithmetic and the chunking of long inputs, written once for the package."""

from __future__ import annotations

import functools
from typing import TypeVar

import jax
import jax.numpy as jnp

N = TypeVar("N", int, jax.Array)


def ceil_div(n: N, d: int) -> N:
    """`ceil(n / d)` for a non-negative `n` (an int, or an integer array) and a positive `d`."""
    return -(-n // d)


def round_up(n: int, multiple: int) -> int:
    """`n` rounded up to a multiple of `multiple`."""
    return ceil_div(n, multiple) * multiple


def chunked(x: jax.Array, chunk: int) -> jax.Array:
    """`x [batch, n, ...]` as chunk-major pieces `[ceil(n / chunk), batch, chunk, ...]`, the last one zero-padded:
    what a `lax.scan` over a long input takes, so that only one chunk's activations are live at a time."""
    batch, n = x.shape[:2]
    pieces = ceil_div(n, chunk)
    padded = jnp.pad(x, [(0, 0), (0, pieces * chunk - n)] + [(0, 0)] * (x.ndim - 2))
    return padded.reshape(batch, pieces, chunk, *x.shape[2:]).swapaxes(0, 1)


def zeros(shape: tuple[int, ...], dtype: jnp.dtype, sharding: jax.sharding.Sharding | None = None) -> jax.Array:
    """A zero array made on its devices (`sharding`; None: the default device) by a compiled program: no host
    array and no host-to-device copy, so that a cache of many GB costs no transfer and no host memory."""
    out = _zeros_program(sharding)(tuple(shape), jnp.dtype(dtype))
    return out if sharding is None else jax.device_put(out, sharding)  # committed there; no copy, it is there


@functools.cache
def _zeros_program(sharding: jax.sharding.Sharding | None):
    return jax.jit(jnp.zeros, static_argnums=(0, 1), out_shardings=sharding)

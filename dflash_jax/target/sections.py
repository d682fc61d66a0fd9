"""A projection whose rows are several sections (a mixer's inputs: Mamba-2's z, x, B, C, dt; a Gated DeltaNet's q, k,
v, z, b, a), split over a tensor axis of `shards` devices so that each runs ONE product of its own rows.

Checkpoints store the sections one after the other, so a contiguous split of the rows would hand a device whole
sections instead of its share of each. The sharded tensor holds its rows permuted (`section_order`): shard d is
the d-th contiguous block of each section, in the sections' order, and the product's output splits by static sizes
within each shard's block (`split_sections`). With one shard the order is the identity.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["section_order", "split_sections", "moved_rows", "take_rows", "Sectioned", "move_sections"]


def section_order(sizes: Sequence[int], shards: int) -> np.ndarray:
    """`[sum(sizes)]`: the stored row of each row of the sharded tensor whose sections have `sizes` rows (each
    divisible by `shards`), stored one after the other: shard d the d-th block of each section, in order."""
    starts = np.cumsum((0, *sizes[:-1]))
    blocks = [start + np.arange(size).reshape(shards, -1) for start, size in zip(starts, sizes)]
    return np.concatenate(blocks, axis=1).reshape(-1)


def moved_rows(sizes: Sequence[int], old: int, new: int) -> np.ndarray:
    """The rows of a tensor held in `section_order(sizes, old)` that make it `section_order(sizes, new)`'s."""
    return np.argsort(section_order(sizes, old))[section_order(sizes, new)]


def take_rows(x: jax.Array, rows: np.ndarray) -> jax.Array:
    """`x`'s rows (dim 0) `rows`, placed as `x` is."""
    return jax.device_put(jnp.take(x, jnp.asarray(rows), axis=0), x.sharding)


class Sectioned(NamedTuple):
    """A family's mixers whose tensors hold their rows in `section_order`'s blocks: the `layers` holding one, the
    mixer's key in a layer, and the section sizes of each such tensor by its key in the mixer."""

    layers: tuple[int, ...]
    mixer: str
    sizes: Mapping[str, Sequence[int]]


def move_sections(layers: Sequence[dict[str, Any]], sectioned: Sectioned, old: int, new: int
                  ) -> tuple[dict[str, Any], ...]:
    """`layers` with each sectioned tensor's rows moved from `old` blocks into `new` ones (`moved_rows`): every leaf
    of it with a row per stored row (a weight, a conv's bias; not a scalar scale)."""
    out = list(layers)
    for name, sizes in sectioned.sizes.items():
        rows = moved_rows(sizes, old, new)
        for i in sectioned.layers:
            mixer = out[i][sectioned.mixer]
            tensor = {key: take_rows(x, rows) if x.shape[:1] == rows.shape else x for key, x in mixer[name].items()}
            out[i] = {**out[i], sectioned.mixer: {**mixer, name: tensor}}
    return tuple(out)


def split_sections(t: jax.Array, sizes: Sequence[int], shards: int) -> list[jax.Array]:
    """`t [..., shards * sum(sizes)]`, each shard's block the sections of `sizes` in order, as one array per section
    `[..., shards * size]`, shard after shard (a whole section as stored: in its order). A split within each
    shard's own block, so on a mesh no device reads another's rows. One shard: a plain split (through a unit axis,
    XLA fuses the slices otherwise: one device's program stays the unsharded one)."""
    cuts = np.cumsum(sizes[:-1]).tolist()
    if shards == 1:
        return jnp.split(t, cuts, axis=-1)
    lead = t.shape[:-1]
    return [part.reshape(*lead, -1) for part in jnp.split(t.reshape(*lead, shards, -1), cuts, axis=-1)]

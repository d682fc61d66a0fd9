"""Where a target's arrays live on a mesh: logical axes -> mesh axes, Megatron-style tensor parallelism."""

from __future__ import annotations

import dataclasses
import math
from typing import Protocol

import jax
from jax.sharding import NamedSharding, PartitionSpec

from ..errors import ConfigError
from ..placement import auto_mesh
from ..spec import BATCH, EXPERT_MLP, HEADS, KV_HEADS, MLP, VOCAB

__all__ = ["Layout", "make_layout", "tensor_shards"]


@dataclasses.dataclass(frozen=True)
class Layout:
    """A target's placement on a mesh: logical axes -> mesh axes (hashable: static metadata of the target).

    `tensor_axis` (None: replicated, no tensor parallelism) splits heads, the MLP width (each MoE expert's too:
    every device holds a slice of every expert, `target.moe`) and the vocabulary; KV heads
    only when it has at most `num_key_value_heads` devices (`split_kv`), else every device keeps all KV heads
    and each query shard attends with its own group's. The other mesh axes (`batch_axes`) split the batch where
    it divides (else it is replicated). The mesh has Auto axis types (`placement.auto_mesh`).
    """

    mesh: jax.sharding.Mesh
    tensor_axis: str | None
    batch_axes: tuple[str, ...]
    split_kv: bool

    @property
    def tensor_size(self) -> int:
        return self.mesh.shape[self.tensor_axis] if self.tensor_axis else 1

    @property
    def batch_devices(self) -> int:
        """The devices a batch is split over (where its size divides by this)."""
        return math.prod(self.mesh.shape[a] for a in self.batch_axes)

    def splits_batch(self, batch_size: int) -> bool:
        """Whether a batch of `batch_size` sequences is split over more than one device."""
        return self.batch_devices > 1 and batch_size % self.batch_devices == 0

    def spec(self, axes: tuple[str | None, ...], batch_size: int | None = None) -> PartitionSpec:
        """The PartitionSpec of logical `axes` (`BATCH` needs `batch_size`: split only where it divides)."""
        rules: dict[str | None, str | tuple[str, ...] | None] = {
            VOCAB: self.tensor_axis, HEADS: self.tensor_axis, MLP: self.tensor_axis, EXPERT_MLP: self.tensor_axis,
            KV_HEADS: self.tensor_axis if self.split_kv else None}
        rules[BATCH] = self.batch_axes if self.batch_axes and batch_size is not None \
            and batch_size % self.batch_devices == 0 else None
        return PartitionSpec(*(rules.get(a) for a in axes))

    def sharding(self, axes: tuple[str | None, ...], batch_size: int | None = None) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(axes, batch_size))

    def constrain(self, x: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
        """`x` pinned to the layout of `axes` (dim 0 the batch when `BATCH` is among them)."""
        return jax.lax.with_sharding_constraint(x, self.sharding(axes, x.shape[0]))


def tensor_shards(layout: Layout | None) -> int:
    """The devices `layout`'s tensor axis splits a tensor over (1 without a layout): the blocks a mixer's input
    projection is in (`target.sections`)."""
    return 1 if layout is None else layout.tensor_size


class Splits(Protocol):
    """The sizes a layout splits over the tensor axis (`DecoderConfig`, `Qwen3_5Config`)."""

    @property
    def num_attention_heads(self) -> int: ...
    @property
    def num_key_value_heads(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...


def make_layout(config: Splits, mesh: jax.sharding.Mesh, tensor_axis: str | None, source: str) -> Layout:
    """The layout of `config` on `mesh`; a tensor axis that does not divide a split dimension is a ConfigError.

    `tensor_axis` None replicates the target on every device; an axis the mesh lacks is a `ValueError` (the
    target would silently load a full copy per device)."""
    if tensor_axis is not None and tensor_axis not in mesh.axis_names:
        raise ValueError(
            f"{source}: tensor_axis={tensor_axis!r} is not an axis of the mesh (its axes: "
            f"{', '.join(map(repr, mesh.axis_names))}), so every device would hold a full copy of the target; "
            "expected the name of the mesh axis to split it over, or tensor_axis=None to replicate it"
        )
    mesh = auto_mesh(mesh)
    axis = tensor_axis
    tp = mesh.shape[axis] if axis else 1
    c = config
    for field in ("num_attention_heads", "vocab_size", "intermediate_size"):
        if getattr(c, field) % tp:
            raise ConfigError(
                f"{source}: tensor axis {tensor_axis!r} has {tp} devices, which does not divide "
                f"{field}={getattr(c, field)}; expected a tensor-parallel size dividing the heads, the vocabulary "
                "and the intermediate size"
            )
    n_kv = c.num_key_value_heads
    if (n_kv % tp if tp <= n_kv else tp % n_kv):
        raise ConfigError(
            f"{source}: tensor axis {tensor_axis!r} has {tp} devices and num_key_value_heads={n_kv}: expected one "
            "to divide the other (KV heads are split, or replicated when the axis is larger)"
        )
    batch_axes = tuple(a for a in mesh.axis_names if a != axis)
    return Layout(mesh, axis, batch_axes, split_kv=tp <= n_kv)


CACHE_AXES = (BATCH, KV_HEADS, None, None)  # [batch, n_kv, T, d_h]
ROWS_AXES = (BATCH, None, None)  # the residual stream [batch, S, H]: replicated over the tensor axis

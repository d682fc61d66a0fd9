"""MoE expert weights as the stacks the block runs (`target.moe`), from either layout checkpoints store them in.

`moe.moe_block` reads, per MoE layer, `experts.gate_proj` / `experts.up_proj` `[E, I, H]` and `experts.down_proj`
`[E, H, I]`. On disk they are either

    fused (released Qwen3.5 / 3.6 MoE)   experts.gate_up_proj [E, 2I, H] (gate rows, then up), experts.down_proj
    per expert (transformers 4 layout)   experts.{j}.gate_proj.weight / up_proj.weight [I, H], down_proj.weight [H, I]

(transformers 5.24.0 `conversion_mapping.py`: `qwen3_5_moe_text` = the `qwen2_moe` converter, which stacks the
per-expert layout into the fused one on load; a fused checkpoint is read as it is.)

`ExpertStacks` wraps an open `Checkpoint` so that every MoE layer's stacks appear as tensors of their own: a fused
`gate_up_proj` as two row ranges (views of the map, nothing copied), per-expert tensors stacked on the fly (a
part of a stack reads only its experts' bytes, one part of one layer in memory at a time). The loader's plan,
checks and placement (`plan.check_tensors`, `placement.place_all`) run on it unchanged; every source tensor's
presence, dtype and shape is checked when it is built (`CheckpointError` naming the tensor).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import numpy as np

from ..errors import CheckpointError
from ..safetensors import Checkpoint, TensorInfo
from .moe import MoeConfig

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class _Rows:
    """A stack that is rows `[start, start + n)` of dim 1 of a fused source tensor."""

    source: str
    start: int


@dataclasses.dataclass(frozen=True)
class _Stack:
    """A stack of per-expert source tensors along a new dim 0."""

    sources: tuple[str, ...]


class ExpertStacks(Checkpoint):
    """`checkpoint` with each MoE block's experts as `{prefix}experts.{gate_proj,up_proj,down_proj}` stacks.

    `prefixes`: the MoE blocks' name prefixes, one per block (e.g. `model.language_model.layers.0.mlp.`); `c`: their
    sizes. The source tensors a stack is made of are hidden; the other tensors pass through. A `Checkpoint` (the
    loader reads it as one); closing it leaves `checkpoint` open.
    """

    def __init__(self, checkpoint: Checkpoint, prefixes: Sequence[str], c: MoeConfig):
        self.path, self.directory, self.metadata = checkpoint.path, checkpoint.directory, checkpoint.metadata
        self._base = checkpoint
        self._virtual: dict[str, _Rows | _Stack] = {}
        self._infos: dict[str, TensorInfo] = {}
        hidden: set[str] = set()
        for prefix in prefixes:
            hidden |= self._add_block(prefix, c)
        self._names = [n for n in checkpoint if n not in hidden and n not in self._infos] + list(self._infos)
        self._visible = frozenset(self._names)

    def _add_block(self, prefix: str, c: MoeConfig) -> set[str]:
        """Declare one block's stacks; return the source names they hide."""
        E, I, H = c.num_experts, c.moe_intermediate_size, c.hidden_size
        shapes = {"gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}
        fused = prefix + "experts.gate_up_proj"
        if fused in self._base:
            info = self._source(fused, (E, 2 * I, H), "fused gate and up projections")
            self._declare(prefix + "experts.gate_proj", _Rows(fused, 0), info, (E, I, H))
            self._declare(prefix + "experts.up_proj", _Rows(fused, I), info, (E, I, H))
            return {fused}  # `experts.down_proj` is stored as the stack itself
        if prefix + "experts.0.gate_proj.weight" not in self._base:
            raise CheckpointError(
                f"{self.path}: no expert weights under {prefix!r}: expected {fused!r} [{E}, {2 * I}, {H}] (fused, as "
                f"released) and {prefix}experts.down_proj, or {prefix}experts.{{j}}.gate_proj.weight, up_proj, "
                f"down_proj for each of the {E} experts"
            )
        hidden = set()
        for proj, shape in shapes.items():
            sources = tuple(f"{prefix}experts.{j}.{proj}.weight" for j in range(E))
            infos = [self._source(name, shape, f"expert {j}'s {proj}") for j, name in enumerate(sources)]
            dtypes = {i.dtype for i in infos}
            if len(dtypes) > 1:
                odd = next(i for i in infos if i.dtype != infos[0].dtype)
                raise CheckpointError(
                    f"{odd.file}: tensor {odd.name!r} has dtype {odd.dtype} but {infos[0].name!r} has "
                    f"{infos[0].dtype}; expected one dtype for all the experts of a layer"
                )
            self._declare(f"{prefix}experts.{proj}", _Stack(sources), infos[0], (E, *shape))
            hidden |= set(sources)
        return hidden

    def _source(self, name: str, shape: tuple[int, ...], what: str) -> TensorInfo:
        if name not in self._base:
            raise CheckpointError(f"{self.path}: missing tensor {name!r} ({what}, expected shape {list(shape)})")
        info = self._base[name]
        if info.shape != shape:
            raise CheckpointError(
                f"{info.file}: tensor {name!r} ({what}) has shape {list(info.shape)}, expected {list(shape)} from "
                "the config"
            )
        return info

    def _declare(self, name: str, how: _Rows | _Stack, source: TensorInfo, shape: tuple[int, ...]) -> None:
        """A stack's header: its source's file and dtype, and its own shape and size (no byte range of its own)."""
        nbytes = int(np.prod(shape)) * source.np_dtype.itemsize
        self._virtual[name] = how
        self._infos[name] = TensorInfo(name, source.dtype, shape, source.file, 0, nbytes)

    def __getitem__(self, name: str) -> TensorInfo:
        info = self._infos.get(name)
        if info is not None:
            return info
        if name not in self._visible:
            raise KeyError(name)
        return self._base[name]

    def __contains__(self, name: object) -> bool:
        return name in self._visible

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    @property
    def files(self) -> list[str]:
        return self._base.files

    def array(self, name: str) -> np.ndarray:
        return self.read(name)

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        """A tensor's part `index` (None: all of it). A fused stack's is a view of the map; a per-expert stack's
        a new array of that part only, read expert by expert."""
        how = self._virtual.get(name)
        if how is None:
            return self._base.read(name, index)
        shape = self._infos[name].shape
        bounds = [(0, n) if index is None else index[d].indices(n)[:2] for d, n in enumerate(shape)]
        if isinstance(how, _Rows):
            (e0, e1), (r0, r1), *rest = bounds
            return self._base.read(how.source, (slice(e0, e1), slice(how.start + r0, how.start + r1),
                                                *(slice(a, b) for a, b in rest)))
        inner = tuple(slice(a, b) for a, b in bounds[1:])
        return np.stack([self._base.read(how.sources[j], inner) for j in range(*bounds[0])])

    def release(self, name: str) -> None:
        how = self._virtual.get(name)
        sources = [name] if how is None else [how.source] if isinstance(how, _Rows) else list(how.sources)
        for source in sources:
            self._base.release(source)

    def close(self) -> None:
        """Nothing to close: the wrapped checkpoint is its opener's."""

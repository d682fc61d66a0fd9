"""A checkpoint seen as the tensors a parameter tree holds: the parts of a fused tensor as tensors of their own, and
per-expert tensors as stacks.

Checkpoints store some projections fused along one dim: the released MoE layers' `experts.gate_up_proj`. A fused
tensor split contiguously over devices would not give each device whole gate/up pairs; each part split
contiguously does. `TensorViews` wraps an open `Checkpoint` so that the parts (`Fused`) and the stacks
appear as tensors; the loader's plan, checks and placement (`plan.check_tensors`, `placement.place_all`) run on
it unchanged, and a device's shard of a part reads only that part's bytes (a row range of the fused tensor;
nothing copied). Every source tensor's presence and shape is checked when a view is declared (`CheckpointError`
naming it and what it is), the sources are hidden, other tensors pass through. A view whose name is stored too (a
delta net's `in_proj` beside the `in_proj_qkv` it merges, a stacked `experts.down_proj` beside the per-expert ones)
is refused naming both: one copy would load and the other be ignored.

A stored tensor may also be read with its rows permuted under its own name (`reorder`: a Nemotron-H Mamba block's
`in_proj` and conv, a Gated DeltaNet's conv, each device's shard its own sections, `target.sections`), and several
stored tensors as one, their rows concatenated and permuted (`merge`: a Gated DeltaNet's `in_proj_qkv`, `_z`, `_b`,
`_a` as its one `in_proj`, `target.delta_net`). A shard reads its rows as the runs of consecutive rows of one stored
tensor they are (five for a shard of a Mamba `in_proj`, six of a delta net's), so again only its own bytes; a
quantized tensor (read whole, dequantized, then moved onto its shards) reads them all, in the permuted order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence

import numpy as np

from ..errors import CheckpointError
from ..safetensors import WEIGHT_DTYPES, Checkpoint, TensorInfo

__all__ = ["TensorViews", "Fused", "fuse"]


@dataclasses.dataclass(frozen=True)
class Fused:
    """A stored tensor (`stored`, a name suffix) that concatenates `parts` (the tree's name suffixes, in order)
    along dim `axis`: what `TensorViews.split` reads and `fuse` writes."""

    stored: str
    parts: tuple[str, ...]
    axis: int
    what: str


@dataclasses.dataclass(frozen=True)
class _Rows:
    """A part: indices `[start, start + n)` of dim `axis` of a fused source tensor."""

    source: str
    axis: int
    start: int


@dataclasses.dataclass(frozen=True, eq=False)
class _Reordered:
    """Stored tensors' rows (dim 0), `sources` one after the other, in `order`, a permutation: row i is their row
    `order[i]`; `starts`: each source's first row among them."""

    sources: tuple[str, ...]
    starts: np.ndarray
    order: np.ndarray


@dataclasses.dataclass(frozen=True)
class _Stack:
    """A stack of source tensors along a new dim 0."""

    sources: tuple[str, ...]


class TensorViews(Checkpoint):
    """`checkpoint` with declared views (`split`, `stack`, `reorder`, `merge`) in place of their sources. A
    `Checkpoint` (the loader reads it as one); closing it leaves `checkpoint` open."""

    def __init__(self, checkpoint: Checkpoint):
        self.path, self.directory, self.metadata = checkpoint.path, checkpoint.directory, checkpoint.metadata
        self._base = checkpoint
        self._virtual: dict[str, _Rows | _Reordered | _Stack] = {}
        self._infos: dict[str, TensorInfo] = {}
        self._hidden: set[str] = set()

    def source(self, name: str, shape: tuple[int, ...], what: str) -> TensorInfo:
        """The header of source tensor `name`, which must exist with `shape` and a weight dtype (`what` it is, for
        the error: checked here, the plan's checks would name the view, a tensor the file does not hold)."""
        if name not in self._base:
            raise CheckpointError(f"{self.path}: missing tensor {name!r} ({what}, expected shape {list(shape)})")
        info = self._base[name]
        if info.shape != shape:
            raise CheckpointError(
                f"{info.file}: tensor {name!r} ({what}) has shape {list(info.shape)}, expected {list(shape)} from "
                "the config"
            )
        if info.dtype not in WEIGHT_DTYPES:
            raise CheckpointError(f"{info.file}: tensor {name!r} ({what}) has dtype {info.dtype}, expected one of "
                                  f"{', '.join(WEIGHT_DTYPES)}")
        return info

    def split(self, prefix: str, fused: Fused, shapes: Sequence[tuple[int, ...]]) -> None:
        """Declare `prefix + part` for each of `fused.parts` (of `shapes`) as its range of `prefix + fused.stored`,
        whose shape is theirs concatenated along `fused.axis`."""
        axis, name = fused.axis, prefix + fused.stored
        whole = list(shapes[0])
        whole[axis] = sum(s[axis] for s in shapes)
        info = self.source(name, tuple(whole), fused.what)
        start = 0
        for part, shape in zip(fused.parts, shapes):
            self._declare(prefix + part, _Rows(name, axis, start), info, shape)
            start += shape[axis]
        self._hidden.add(name)

    def stack(self, name: str, sources: Sequence[str], shape: tuple[int, ...], what: str) -> None:
        """Declare `name` `[len(sources), *shape]` as the `sources` (each of `shape`, one dtype) stacked."""
        infos = [self.source(s, shape, f"{what} {j}") for j, s in enumerate(sources)]
        odd = next((i for i in infos if i.dtype != infos[0].dtype), None)
        if odd is not None:
            raise CheckpointError(
                f"{odd.file}: tensor {odd.name!r} has dtype {odd.dtype} but {infos[0].name!r} has "
                f"{infos[0].dtype}; expected one dtype for all the tensors of {name!r}"
            )
        self._declare(name, _Stack(tuple(sources)), infos[0], (len(sources), *shape))
        self._hidden |= set(sources)

    def reorder(self, name: str, order: np.ndarray) -> None:
        """Read stored tensor `name` with its rows in `order` (a permutation of its dim 0: row i is the stored row
        `order[i]`), under its own name. A tensor the file lacks, or of another length (a per-tensor scale, or a
        malformed tensor, which the plan's checks then name), is left as it is."""
        info = self._base[name] if name in self._base else None
        if info is not None and info.shape[:1] == order.shape:
            self._virtual[name] = _Reordered((name,), np.zeros(1, int), order)
            self._infos[name] = info

    def merge(self, name: str, sources: Sequence[tuple[str, tuple[int, ...], str]], order: np.ndarray) -> None:
        """Declare `name` as the stored `sources` (`(name, shape, what it is)`: one dtype, one shape but for dim 0)
        concatenated along dim 0, its rows in `order` (row i is their row `order[i]`; a permutation)."""
        infos = [self.source(s, shape, what) for s, shape, what in sources]
        odd = next((i for i in infos if i.dtype != infos[0].dtype), None)
        if odd is not None:
            raise CheckpointError(
                f"{odd.file}: tensor {odd.name!r} has dtype {odd.dtype} but {infos[0].name!r} has "
                f"{infos[0].dtype}; expected one dtype for all the tensors {name!r} concatenates")
        lengths = [i.shape[0] for i in infos]
        how = _Reordered(tuple(i.name for i in infos), np.cumsum([0, *lengths[:-1]]), order)
        self._declare(name, how, infos[0], (sum(lengths), *infos[0].shape[1:]))
        self._hidden |= set(how.sources)

    def _declare(self, name: str, how: _Rows | _Reordered | _Stack, source: TensorInfo, shape: tuple[int, ...]
                 ) -> None:
        """A view's header: its source's file and dtype, and its own shape and size (no byte range of its own). A
        tensor stored under the view's name too is the same weights in another form: the view would shadow it."""
        if name in self._base:
            joins = "stacks into it" if isinstance(how, _Stack) else "concatenate into it"
            form = (f"which holds it as its [{how.start}:{how.start + shape[how.axis]}] along dim {how.axis}"
                    if isinstance(how, _Rows) else
                    f"which, with {len(how.sources) - 1} more up to {how.sources[-1]!r}, {joins}")
            self.refuse_twice(name, source.name, form)
        nbytes = int(np.prod(shape)) * source.np_dtype.itemsize
        self._virtual[name] = how
        self._infos[name] = TensorInfo(name, source.dtype, shape, source.file, 0, nbytes)

    def refuse_twice(self, stored: str, other: str, form: str) -> None:
        """Raise `CheckpointError`: `stored` is stored beside `other` (`form`: how they relate), the same weights in
        two forms, of which one would load and the other be ignored (as a tensor in two shards is refused)."""
        raise CheckpointError(
            f"{self._base[stored].file}: tensor {stored!r} is stored beside {other!r} ({form}): the same weights in "
            "two forms, one of which would be ignored; expected one of them")

    def __getitem__(self, name: str) -> TensorInfo:
        info = self._infos.get(name)
        if info is not None:
            return info
        if name in self._hidden:
            raise KeyError(name)
        return self._base[name]

    def __contains__(self, name: object) -> bool:
        return name in self._infos or (name not in self._hidden and name in self._base)

    def __iter__(self) -> Iterator[str]:
        return iter([n for n in self._base if n not in self._hidden and n not in self._infos] + list(self._infos))

    def __len__(self) -> int:
        return sum(1 for _ in self)

    @property
    def files(self) -> list[str]:
        return self._base.files

    def array(self, name: str) -> np.ndarray:
        return self.read(name)

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        """A tensor's part `index` (None: all of it). A fused tensor's part is a view of the map; a stack's is a
        new array of that part only, read source by source; a reordered or merged tensor's, its rows read run by
        run."""
        how = self._virtual.get(name)
        if how is None:
            return self._base.read(name, index)
        shape = self._infos[name].shape
        bounds = [slice(*((0, n) if index is None else index[d].indices(n)[:2])) for d, n in enumerate(shape)]
        if isinstance(how, _Reordered):
            rows = how.order[bounds[0]]  # the sources' rows, in order
            source = np.searchsorted(how.starts, rows, side="right") - 1  # each row's source
            runs = np.split(np.arange(len(rows)), np.flatnonzero((np.diff(rows) != 1) | (np.diff(source) != 0)) + 1)
            return np.concatenate([self._read_run(how, source[run[0]], rows[run[0]], len(run), bounds[1:])
                                   for run in runs])  # each run consecutive rows of one source, in its file
        if isinstance(how, _Rows):
            moved = bounds[how.axis]
            bounds[how.axis] = slice(how.start + moved.start, how.start + moved.stop)
            return self._base.read(how.source, tuple(bounds))
        return np.stack([self._base.read(how.sources[j], tuple(bounds[1:]))
                         for j in range(bounds[0].start, bounds[0].stop)])

    def _read_run(self, how: _Reordered, source: int, row: int, length: int, rest: list[slice]) -> np.ndarray:
        """`length` rows of `how`'s source `source` from its sources' row `row`."""
        start = row - int(how.starts[source])
        return self._base.read(how.sources[source], (slice(start, start + length), *rest))

    def release(self, name: str) -> None:
        how = self._virtual.get(name)
        sources = list(how.sources) if isinstance(how, _Stack | _Reordered) else [name if how is None else how.source]
        for source in sources:
            self._base.release(source)

    def close(self) -> None:
        """Nothing to close: the wrapped checkpoint is its opener's."""


def fuse(arrays: Mapping[str, np.ndarray], fused: Sequence[Fused]) -> dict[str, np.ndarray]:
    """`arrays` (tree-layout tensors by checkpoint name) with each complete set of `Fused.parts` under one prefix
    concatenated into the stored tensor, as checkpoints store them (the inverse of `TensorViews.split`; for
    writing test checkpoints)."""
    out = dict(arrays)
    for f in fused:
        for name in [n for n in arrays if n.endswith("." + f.parts[0])]:
            prefix = name.removesuffix(f.parts[0])
            out[prefix + f.stored] = np.concatenate([out.pop(prefix + p) for p in f.parts], axis=f.axis)
    return out

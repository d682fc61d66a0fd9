"""Putting planned tensors onto devices: one host->device copy per tensor, then device-to-device.

For each tensor (each part of a sharded one, `pieces`), the memory-mapped bytes are copied once to the first
local device holding it, converted there once they have arrived (cast to the load dtype, or NVFP4-dequantized, by
executables from `_executables`), then copied device-to-device to the other local devices, and the
per-device copies are assembled with `jax.make_array_from_single_device_arrays`. Under a multi-process
runtime each process does this for its own devices only, so no process ever holds or sends another's data.

Host memory stays bounded: copies are asynchronous, at most `inflight_bytes` of them are outstanding, and
once a tensor's copy is done its pages are dropped from this process (MADV_DONTNEED: the data stays in
the page cache, it is only unmapped from us).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import sys
from collections.abc import Sequence, Set

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from ._executables import compiled
from ._memory import device_free_bytes, host_available_bytes
from .errors import CheckpointError
from .nvfp4.checkpoint import nvfp4_companions
from .plan import TensorPlan
from .safetensors import Checkpoint

DEFAULT_INFLIGHT_BYTES = 64 * 1024 * 1024


def auto_mesh(mesh: jax.sharding.Mesh) -> jax.sharding.Mesh:
    """`mesh` with Auto axis types (same devices and names): leaves live there, the drafter's and the target's
    alike, so that they meet in one program, and GSPMD picks the collectives of a sharded target (Explicit axes,
    `jax.make_mesh`'s default, would need an `out_sharding` at every gather from a vocabulary-sharded table)."""
    auto = (jax.sharding.AxisType.Auto,) * len(mesh.axis_names)
    return mesh if tuple(mesh.axis_types) == auto else jax.sharding.Mesh(mesh.devices, mesh.axis_names, axis_types=auto)


def target_sharding(mesh: jax.sharding.Mesh | None) -> jax.sharding.Sharding:
    """Replicated over `mesh` (with Auto axes), or the first local device without one."""
    if mesh is None:
        return SingleDeviceSharding(jax.local_devices()[0])
    return NamedSharding(auto_mesh(mesh), PartitionSpec())


@dataclasses.dataclass(frozen=True)
class Piece:
    """A part of a leaf held by some of this process's devices: `index` (a step-1 slice per dimension) and the
    local devices holding that part (replicas of it), in device id order."""

    index: tuple[slice, ...]
    devices: tuple[jax.Device, ...]

    def shape(self) -> tuple[int, ...]:
        return tuple(s.stop - s.start for s in self.index)

    def key(self) -> tuple[tuple[int, int], ...]:
        """`index` as hashable bounds."""
        return tuple((s.start, s.stop) for s in self.index)


def pieces(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> list[Piece]:
    """The distinct parts of a leaf of `shape` this process's devices hold under `sharding`, each read once."""
    by_index: dict[tuple[tuple[int, int], ...], list[jax.Device]] = {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        assert index is not None  # typed Optional by jax; a concrete `shape` gives every device its slices
        key = tuple((s.start or 0, n if s.stop is None else s.stop) for s, n in zip(index, shape))
        by_index.setdefault(key, []).append(device)
    return [Piece(tuple(slice(a, b) for a, b in key), tuple(sorted(devices, key=lambda d: d.id)))
            for key, devices in sorted(by_index.items())]


def place_all(
    plan: list[TensorPlan],
    checkpoint: Checkpoint,
    packed: Set[str],
    *,
    mesh: jax.sharding.Mesh | None,
    dtype: jnp.dtype,
    progress: bool | None,
    inflight_bytes: int = DEFAULT_INFLIGHT_BYTES,
    shardings: Sequence[jax.sharding.Sharding] | None = None,
) -> list[jax.Array]:
    """Place every planned tensor (in plan order) on its sharding: `shardings[i]` for leaf i, or (None) every
    leaf replicated on `mesh` (`target_sharding`).

    A sharded leaf is read part by part (`pieces`): each distinct part this process's devices hold is read from
    the map once, only its own byte ranges, put on the first device holding it and copied to that part's
    other holders; no process reads or sends another's parts. NVFP4-packed tensors are placed replicated only.
    Raises `CheckpointError` before the first copy when the leaves cannot fit in a device's free memory.
    """
    if shardings is None:
        shardings = [target_sharding(mesh)] * len(plan)
    sources = [_sources(t, packed) for t in plan]
    distinct = {id(sh): sh for sh in shardings}.values()
    devices = sorted({d for sh in distinct for d in sh.addressable_devices},
                     key=lambda d: d.id)  # type: ignore[attr-defined]  # jax.Device: unresolved in jax's stubs
    check_fits(plan, sources, checkpoint, devices, jnp.dtype(dtype),
               [sh.shard_shape(t.shape) for t, sh in zip(plan, shardings)])
    parts = [pieces(sh, t.shape) for t, sh in zip(plan, shardings)]
    for t, names, leaf_parts in zip(plan, sources, parts):
        if len(names) > 1 and leaf_parts[0].shape() != t.shape:
            raise ValueError(f"{t.name}: an NVFP4-packed tensor can only be placed replicated, not sharded")
    converters = _Converters(checkpoint, plan, sources, parts, dtype)
    # (plan, sharding, pieces, per piece its arrays on its first device, source names, bytes read)
    arriving: collections.deque[tuple] = collections.deque()
    placed: collections.deque[tuple[jax.Array, list[str], int]] = collections.deque()  # host pages still mapped
    pending = 0  # bytes put and not yet retired
    leaves = []

    def convert_and_place(t: TensorPlan, sharding, leaf_parts: list[Piece], on_device: list[list[jax.Array]],
                          names: list[str], size: int) -> None:
        copies = []
        for piece, arrays in zip(leaf_parts, on_device):
            first = converters(t, piece, arrays)
            copies += [first] + [jax.device_put(first, d) for d in piece.devices[1:]]
        leaf = copies[0] if isinstance(sharding, SingleDeviceSharding) else (
            jax.make_array_from_single_device_arrays(t.shape, sharding, copies)
        )
        leaves.append(leaf)
        placed.append((leaf, names, size))

    total = sum(_read_bytes(checkpoint, t, names, p) for t, names, p in zip(plan, sources, parts))
    with _Progress(len(plan), total, progress) as bar:
        for t, names, sharding, leaf_parts in zip(plan, sources, shardings, parts):
            whole = len(names) > 1  # NVFP4 sources (replicated): each read whole
            on_device = [jax.device_put([_host_array(checkpoint, n, t.kind, None if whole else piece.index)
                                         for n in names], piece.devices[0]) for piece in leaf_parts]
            size = _read_bytes(checkpoint, t, names, leaf_parts)
            arriving.append((t, sharding, leaf_parts, on_device, names, size))
            pending += size
            # A conversion launched before its inputs have arrived blocks this thread until they do, and the
            # next transfers wait behind it (an NVFP4 load took 2x longer on an H200): convert the tensors
            # that have arrived, and the others only when over the budget.
            while arriving and (pending > inflight_bytes or all(a.is_ready() for p in arriving[0][3] for a in p)):
                convert_and_place(*arriving.popleft())
            while pending > inflight_bytes and placed:
                pending -= _retire(checkpoint, *placed.popleft())
            bar.advance(size)
        while arriving:
            convert_and_place(*arriving.popleft())
        while placed:
            _retire(checkpoint, *placed.popleft())
    return leaves


def _read_bytes(checkpoint: Checkpoint, t: TensorPlan, names: list[str], leaf_parts: list[Piece]) -> int:
    """Bytes of the checkpoint read for one leaf: its parts' share of each source tensor."""
    whole = math.prod(t.shape)
    share = sum(math.prod(p.shape()) for p in leaf_parts)
    return sum(checkpoint[n].nbytes * share // whole if whole else 0 for n in names)


def check_fits(plan: list[TensorPlan], sources: list[list[str]], checkpoint: Checkpoint, devices: list,
               dtype: jnp.dtype, shards: list[tuple[int, ...]] | None = None) -> None:
    """Refuse a load whose leaves (`shards`: the per-device shape of each, else whole), plus the inputs of its
    largest conversion, exceed a device's free memory (`bytes_limit - bytes_in_use` of `memory_stats()`), or,
    for devices that report none (CPUs, which share the host's memory), exceed the host's available memory
    once per such device (`_memory`): a clear error before anything is placed instead of RESOURCE_EXHAUSTED (or
    the kernel's OOM killer) halfway through."""
    shapes = shards if shards is not None else [t.shape for t in plan]
    leaves = sum(math.prod(shape) * (4 if t.kind == "int" else dtype.itemsize)  # int32 d2t
                 for t, shape in zip(plan, shapes))
    converted = [sum(checkpoint[n].nbytes for n in names) for t, names in zip(plan, sources)
                 if len(names) > 1 or (t.kind != "int" and checkpoint[t.name].np_dtype != dtype)]
    needed = leaves + max(converted, default=0)
    on_host = [d for d in devices if device_free_bytes(d) is None]
    host = host_available_bytes() if on_host else None
    if host is not None and needed * len(on_host) > host:
        raise CheckpointError(
            f"{checkpoint.path}: the checkpoint needs {needed / 2**20:,.0f} MiB as {dtype.name} on each of "
            f"{len(on_host)} host-memory device(s) ({on_host[0]}, ...), {needed * len(on_host) / 2**20:,.0f} MiB in "
            f"all, but the host has {host / 2**20:,.0f} MiB available; expected a host with more free memory (or a "
            "narrower dtype, or fewer devices)"
        )
    for device in devices:
        free = device_free_bytes(device)
        if free is None:
            continue
        if needed > free:
            raise CheckpointError(
                f"{checkpoint.path}: the checkpoint needs {needed / 2**20:,.0f} MiB on each device as {dtype.name} "
                f"but {device} has {free / 2**20:,.0f} MiB free; expected a device with more free memory (or a "
                "narrower dtype)"
            )


def _host_array(checkpoint: Checkpoint, name: str, kind: str, index: tuple[slice, ...] | None) -> np.ndarray:
    """A tensor's part as NumPy, ready to put: the memory-mapped view (index tables narrowed to int32, JAX's
    default)."""
    array = checkpoint.read(name, index)
    return array.astype(np.int32) if kind == "int" else array


def _sources(t: TensorPlan, packed: Set[str]) -> list[str]:
    """The checkpoint tensors one leaf is made from: itself, or a packed weight and its two scales."""
    if t.name not in packed:
        return [t.name]
    return [t.name, *nvfp4_companions(t.name)]


class _Converters:
    """The on-device conversions of a load (NVFP4 dequantization, casts to the load dtype), compiled ahead.

    All of them (one per part shape and device that receives it from the host) are requested from
    `_executables` as soon as the load starts, so they compile (or load from the disk cache) on its thread pool
    while the first tensors stream.
    """

    def __init__(self, checkpoint: Checkpoint, plan: list[TensorPlan], sources: list[list[str]],
                 parts: list[list[Piece]], dtype):
        dtype = jnp.dtype(dtype)
        self._futures = {}
        for t, names, leaf_parts in zip(plan, sources, parts):
            for piece in leaf_parts:
                device, key = piece.devices[0], (t.name, piece.key())
                if len(names) > 1:
                    inputs = tuple((checkpoint[n].shape, checkpoint[n].np_dtype) for n in names)
                    self._futures[key] = compiled("nvfp4", inputs, dtype, device)
                elif t.kind != "int" and checkpoint[t.name].np_dtype != dtype:
                    self._futures[key] = compiled("cast", ((piece.shape(), checkpoint[t.name].np_dtype),), dtype,
                                                  device)

    def __call__(self, t: TensorPlan, piece: Piece, arrays: list[jax.Array]) -> jax.Array:
        future = self._futures.get((t.name, piece.key()))
        return arrays[0] if future is None else future.result()(*arrays)


def _retire(checkpoint: Checkpoint, leaf: jax.Array, names: list[str], size: int) -> int:
    """Wait for a tensor's copies, then drop its host pages; returns the bytes released (`size`: those read)."""
    leaf.block_until_ready()
    for name in names:
        checkpoint.release(name)
    return size


class _Progress:
    """A rich progress bar (tensors, bytes, bytes/s) on a terminal, or nothing."""

    def __init__(self, tensors: int, total_bytes: int, enabled: bool | None):
        if enabled is None:
            enabled = sys.stderr.isatty() and total_bytes >= 256 * 1024 * 1024
        self._bar = None
        if enabled:
            from rich import progress as rp

            self._bar = rp.Progress(
                rp.TextColumn("loading drafter"), rp.BarColumn(), rp.DownloadColumn(),
                rp.TransferSpeedColumn(), rp.TextColumn("{task.fields[tensors]}"), rp.TimeRemainingColumn(),
                transient=True,
            )
            self._task = self._bar.add_task("load", total=total_bytes, tensors=f"0/{tensors} tensors")
            self._count, self._tensors = 0, tensors

    def advance(self, nbytes: int) -> None:
        if self._bar is not None:
            self._count += 1
            self._bar.update(self._task, advance=nbytes, tensors=f"{self._count}/{self._tensors} tensors")

    def __enter__(self) -> _Progress:
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()

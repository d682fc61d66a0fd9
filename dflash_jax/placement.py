"""Putting planned tensors onto devices: one host->device copy per tensor, then device-to-device.

For each tensor (each part of a sharded one, `pieces`), the memory-mapped bytes are copied once to the first
local device holding it, converted there once they have arrived (cast to the load dtype, or NVFP4-dequantized, by
executables from `_executables`; FP8-dequantized), then copied device-to-device to the other local devices, and
the per-device copies are assembled with `jax.make_array_from_single_device_arrays`. With `weights="packed"`
quantized weights are not converted: each of their arrays is assembled likewise, and the arrays are wrapped in
an `nvfp4.Packed` or `fp8.Fp8` leaf; with `weights="fp8"` NVFP4 codes are widened to FP8 bytes on the device
first (`nvfp4.Fp8Codes`). Which form `weights="auto"` places: `auto_weights`. Under a multi-process runtime each
process does this for its own devices only, so no process ever holds or sends another's data.

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
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from ._executables import compiled
from ._memory import device_free_bytes, host_available_bytes
from .errors import CheckpointError
from .fp8 import Fp8
from .fp8 import dequantize as fp8_dequantize
from .fp8.checkpoint import fp8_companions
from .nvfp4 import Fp8Codes, Packed, padded
from .nvfp4.checkpoint import nvfp4_companions
from .plan import TensorPlan
from .platform import Platform, platform_of
from .safetensors import Checkpoint
from .spec import leaf_dtype
from .tuning import TUNING

__all__ = ["auto_mesh", "auto_weights"]

DEFAULT_INFLIGHT_BYTES = 64 * 1024 * 1024
# How quantized linear weights are placed (`load_drafter(weights=...)`): FORMS, or "auto" (`auto_weights`)
FORMS = ("dequantized", "packed", "fp8")
WEIGHTS = ("auto", *FORMS)
EVERY_BATCH = ((float("inf"), "dequantized"),)


def auto_rules(platform: Platform, dtype: Any) -> tuple[tuple[tuple[float, str], ...], str]:
    """`weights="auto"`'s forms on `platform` for a load in `dtype`, as (up to this batch, form) rules
    (`tuning.Tuning.auto_weights`), and whose rules they are, in words. The device kind's entry where the kind was
    measured (`tuning.TUNING`) and the load is bfloat16 (the dtype its rows were measured in); "dequantized" at
    every batch elsewhere: on a CPU or a GPU never measured, kept weights would be dequantized by XLA at every
    product (the packed GEMM's kernel runs on Hopper only), and other dtypes are not what the entries measured."""
    if platform.kind not in TUNING:
        return EVERY_BATCH, f"{platform.kind} has no measured entry"
    if jnp.dtype(dtype) != jnp.bfloat16:
        return EVERY_BATCH, f"{jnp.dtype(dtype).name}: the {platform.kind} entry is measured in bfloat16"
    return platform.tuning.auto_weights, f"the {platform.kind} entry"


def auto_weights(platform: Platform, dtype: Any, batch: int) -> str:
    """The form `weights="auto"` places quantized weights in for `batch` sequences a step (`auto_rules`)."""
    rules, _ = auto_rules(platform, dtype)
    return next(form for up_to, form in rules if batch <= up_to)


def describe_rules(rules: tuple[tuple[float, str], ...]) -> str:
    """`auto_rules`' rules in words: "packed up to batch 1, dequantized beyond"."""
    if len(rules) == 1:
        return f"{rules[0][1]} at every batch"
    return ", ".join(f"{form} beyond" if math.isinf(up_to) else f"{form} up to batch {up_to:g}"
                     for up_to, form in rules)


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
    weights: str = "dequantized",
) -> list[Any]:
    """Place every planned tensor (in plan order) on its sharding: `shardings[i]` for leaf i, or (None) every
    leaf replicated on `mesh` (`target_sharding`).

    A sharded leaf is read part by part (`pieces`): each distinct part this process's devices hold is read from
    the map once, only its own byte ranges, put on the first device holding it and copied to that part's
    other holders; no process reads or sends another's parts. Quantized (NVFP4, FP8) tensors are placed
    replicated only: dequantized to `dtype` (`weights="dequantized"`), or as `nvfp4.Packed` / `fp8.Fp8` leaves
    computed in `dtype` (`weights="packed"`), or as `nvfp4.Fp8Codes` / `fp8.Fp8` leaves (`weights="fp8"`). Raises
    `CheckpointError` before the first copy when the leaves cannot fit in a device's free memory.
    """
    if weights not in FORMS:
        raise ValueError(f"place_all: weights={weights!r}; expected one of {', '.join(map(repr, FORMS))}")
    keep = weights != "dequantized"
    if shardings is None:
        shardings = [target_sharding(mesh)] * len(plan)
    sources = [_sources(t, packed, checkpoint) for t in plan]
    distinct = {id(sh): sh for sh in shardings}.values()
    devices = sorted({d for sh in distinct for d in sh.addressable_devices},
                     key=lambda d: d.id)  # type: ignore[attr-defined]  # jax.Device: unresolved in jax's stubs
    check_fits(plan, sources, checkpoint, devices, jnp.dtype(dtype),
               [sh.shard_shape(t.shape) for t, sh in zip(plan, shardings)], weights=weights)
    parts = [pieces(sh, t.shape) for t, sh in zip(plan, shardings)]
    for t, names, leaf_parts in zip(plan, sources, parts):
        if len(names) > 1 and leaf_parts[0].shape() != t.shape:
            raise ValueError(f"{t.name}: a quantized tensor can only be placed replicated, not sharded")
    converters = _Converters(checkpoint, plan, sources, parts, dtype, keep)
    # (plan, sharding, pieces, per piece its arrays on its first device, source names, bytes read)
    arriving: collections.deque[tuple] = collections.deque()
    placed: collections.deque[tuple[Any, list[str], int]] = collections.deque()  # host pages still mapped
    pending = 0  # bytes put and not yet retired
    leaves = []

    def convert_and_place(t: TensorPlan, sharding, leaf_parts: list[Piece], on_device: list[list[jax.Array]],
                          names: list[str], size: int) -> None:
        if keep and len(names) > 1:  # a quantized weight kept as it is stored: one leaf of its arrays
            (piece,), (arrays,) = leaf_parts, on_device  # replicated: one piece
            replicas = [_replicate(a, piece, sharding) for a in arrays]
            if len(replicas) == 3:
                codes, scale, scale_2 = replicas
                leaf: Any = Packed(codes, scale, scale_2, dtype=dtype)
                platform = platform_of(sharding)
                if weights == "fp8":  # widened where they are, from one transfer of the packed bytes
                    leaf = Fp8Codes.from_packed(leaf)
                elif platform.hopper:  # the K its kernel tiles (`nvfp4.padded`: products unchanged)
                    leaf = padded(leaf, platform.tuning.nvfp4_gemm.tile_k)
            else:
                weight, weight_scale = replicas
                leaf = Fp8(weight, weight_scale, dtype=dtype)
        else:
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
            whole = len(names) > 1  # quantized sources (replicated): each read whole
            on_device = [jax.device_put([_host_array(checkpoint, n, t.kind, None if whole else piece.index)
                                         for n in names] if not (keep and whole) else _stored(checkpoint, names),
                                        piece.devices[0]) for piece in leaf_parts]
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
               dtype: jnp.dtype, shards: list[tuple[int, ...]] | None = None, *, weights: str = "dequantized") -> None:
    """Refuse a load whose leaves (`shards`: the per-device shape of each, else whole; quantized weights at the size
    of `weights`' form), plus the inputs of its largest conversion, exceed a device's free memory
    (`bytes_limit - bytes_in_use` of `memory_stats()`), or, for devices that report none (CPUs, which share the
    host's memory), exceed the host's available memory once per such device (`_memory`); the host must also hold
    the int32 copy `_host_array` narrows an index table (d2t) to before it is put, beside its leaf: a clear error
    naming the largest tensor before anything is placed, instead of RESOURCE_EXHAUSTED (or a MemoryError, or the
    kernel's OOM killer) halfway through."""
    packed = weights != "dequantized"
    shapes = shards if shards is not None else [t.shape for t in plan]
    sizes = [_kept_bytes(checkpoint, names, weights) if packed and len(names) > 1
             else math.prod(shape) * leaf_dtype(t.kind, dtype).itemsize  # int32 d2t, float32 routers
             for t, shape, names in zip(plan, shapes, sources)]
    converted = [sum(checkpoint[n].nbytes for n in names) for t, names in zip(plan, sources)
                 if (len(names) == 3 and weights == "fp8") or (len(names) > 1 and not packed)
                 or (len(names) == 1 and t.kind != "int" and checkpoint[t.name].np_dtype != leaf_dtype(t.kind, dtype))]
    needed = sum(sizes) + max(converted, default=0)
    copy, copied = max(((size, t.name) for t, size in zip(plan, sizes) if t.kind == "int"), default=(0, ""))
    size, name = max(zip(sizes, (t.name for t in plan)), default=(0, ""))
    largest = f"the largest leaf: {name!r}, {size / 2**20:,.0f} MiB"
    on_host = [d for d in devices if device_free_bytes(d) is None]
    host = host_available_bytes() if on_host or copy else None
    if host is not None and needed * len(on_host) + copy > host:
        needs = []
        if on_host:
            needs.append(f"{needed / 2**20:,.0f} MiB as {dtype.name} on each of {len(on_host)} host-memory "
                         f"device(s) ({on_host[0]}, ...)")
        if copy:
            needs.append(f"{copy / 2**20:,.0f} MiB on the host for {copied!r} narrowed to int32")
        raise CheckpointError(
            f"{checkpoint.path}: the checkpoint needs {' and '.join(needs)}, "
            f"{(needed * len(on_host) + copy) / 2**20:,.0f} MiB in all, but the host has {host / 2**20:,.0f} MiB "
            f"available ({largest}); expected a host with more free memory (or a narrower dtype, or fewer devices)"
        )
    for device in devices:
        free = device_free_bytes(device)
        if free is None:
            continue
        if needed > free:
            raise CheckpointError(
                f"{checkpoint.path}: the checkpoint needs {needed / 2**20:,.0f} MiB on each device as {dtype.name} "
                f"but {device} has {free / 2**20:,.0f} MiB free ({largest}); expected a device with more free memory "
                "(or a narrower dtype)"
            )


def _kept_bytes(checkpoint: Checkpoint, names: list[str], weights: str) -> int:
    """A quantized weight's bytes on a device as `weights` ("packed" or "fp8") keeps it: as stored, but NVFP4 codes
    (`names[0]` of three) one byte a value for "fp8", twice their packed bytes."""
    stored = sum(checkpoint[n].nbytes for n in names)
    return stored + checkpoint[names[0]].nbytes if weights == "fp8" and len(names) == 3 else stored


def _host_array(checkpoint: Checkpoint, name: str, kind: str, index: tuple[slice, ...] | None) -> np.ndarray:
    """A tensor's part as NumPy, ready to put: the memory-mapped view (index tables narrowed to int32, JAX's
    default)."""
    array = checkpoint.read(name, index)
    return array.astype(np.int32) if kind == "int" else array


def _sources(t: TensorPlan, packed: Set[str], checkpoint: Checkpoint) -> list[str]:
    """The checkpoint tensors one leaf is made from: itself, or a quantized weight and its scales (NVFP4: U8
    codes and two scales; FP8: the weight and one scale)."""
    if t.name not in packed:
        return [t.name]
    return [t.name, *(nvfp4_companions(t.name) if checkpoint[t.name].dtype == "U8" else fp8_companions(t.name))]


def _stored(checkpoint: Checkpoint, names: list[str]) -> list[np.ndarray]:
    """A quantized weight's arrays as its leaf holds them: the data as stored, block scales as float8_e4m3fn
    (some exports store their bits as U8), the per-tensor scale as a float32 [] (some store [1], bf16, f16)."""
    data, *scales = (checkpoint.read(n, None) for n in names)
    *block, last = scales
    block = [b.view(ml_dtypes.float8_e4m3fn) for b in block]  # NVFP4 only
    return [data, *block, np.asarray(last, np.float32).reshape(())]


def _replicate(array: jax.Array, piece: Piece, sharding: jax.sharding.Sharding) -> jax.Array:
    """`array` (on `piece`'s first device) copied to the piece's other devices and assembled on `sharding`."""
    copies = [array] + [jax.device_put(array, d) for d in piece.devices[1:]]
    if isinstance(sharding, SingleDeviceSharding):
        return array
    return jax.make_array_from_single_device_arrays(array.shape, sharding, copies)


class _Converters:
    """The on-device conversions of a load (NVFP4 dequantization, casts to the load dtype), compiled ahead.

    All of them (one per part shape and device that receives it from the host) are requested from
    `_executables` as soon as the load starts, so they compile (or load from the disk cache) on its thread pool
    while the first tensors stream.
    """

    def __init__(self, checkpoint: Checkpoint, plan: list[TensorPlan], sources: list[list[str]],
                 parts: list[list[Piece]], dtype, packed: bool = False):
        dtype = jnp.dtype(dtype)
        self._dtype = dtype
        self._futures = {}
        for t, names, leaf_parts in zip(plan, sources, parts):
            for piece in leaf_parts:
                device, key = piece.devices[0], (t.name, piece.key())
                if len(names) == 2 or (len(names) > 1 and packed):
                    continue  # FP8 (dequantized by `fp8.dequantize`, jitted) or kept packed: nothing to compile
                if len(names) > 1:
                    inputs = tuple((checkpoint[n].shape, checkpoint[n].np_dtype) for n in names)
                    self._futures[key] = compiled("nvfp4", inputs, dtype, device)
                elif t.kind != "int" and checkpoint[t.name].np_dtype != leaf_dtype(t.kind, dtype):
                    self._futures[key] = compiled("cast", ((piece.shape(), checkpoint[t.name].np_dtype),),
                                                  leaf_dtype(t.kind, dtype), device)

    def __call__(self, t: TensorPlan, piece: Piece, arrays: list[jax.Array]) -> jax.Array:
        if len(arrays) == 2:  # FP8: not an `_executables` kind; jitted, compiled once per shape and process
            return fp8_dequantize(*arrays, dtype=self._dtype)
        future = self._futures.get((t.name, piece.key()))
        return arrays[0] if future is None else future.result()(*arrays)


def _retire(checkpoint: Checkpoint, leaf: Any, names: list[str], size: int) -> int:
    """Wait for a tensor's copies, then drop its host pages; returns the bytes released (`size`: those read)."""
    jax.block_until_ready(leaf)  # an array, or a quantized leaf's arrays
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

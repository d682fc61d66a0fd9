"""Putting planned tensors onto devices: one host->device copy per tensor, then device-to-device.

For each tensor, the memory-mapped bytes are copied once to the first local device of the target
sharding, converted there once they have arrived (cast to the load dtype, or NVFP4-dequantized, by
executables from `_executables`), then copied device-to-device to the other local devices, and the
per-device copies are assembled with `jax.make_array_from_single_device_arrays`. Under a multi-process
runtime each process does this for its own devices only, so no process ever holds or sends another's data.

Host memory stays bounded: copies are asynchronous, at most `inflight_bytes` of them are outstanding, and
once a tensor's copy is done its pages are dropped from this process (MADV_DONTNEED: the data stays in
the page cache, it is only unmapped from us).
"""

from __future__ import annotations

import collections
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from ._executables import compiled
from .errors import CheckpointError
from .loader import TensorPlan, nvfp4_companions
from .safetensors import Checkpoint

DEFAULT_INFLIGHT_BYTES = 64 * 1024 * 1024


def target_sharding(mesh: jax.sharding.Mesh | None) -> jax.sharding.Sharding:
    """Replicated over `mesh`, or the first local device without one."""
    if mesh is None:
        return SingleDeviceSharding(jax.local_devices()[0])
    return NamedSharding(mesh, PartitionSpec())


def place_all(
    plan: list[TensorPlan],
    checkpoint: Checkpoint,
    packed: set[str],
    *,
    mesh: jax.sharding.Mesh | None,
    dtype: jnp.dtype,
    progress: bool | None,
    inflight_bytes: int = DEFAULT_INFLIGHT_BYTES,
) -> list[jax.Array]:
    """Place every planned tensor (in plan order) replicated on the sharding of `mesh`.

    Raises `CheckpointError` before the first copy when the leaves cannot fit in a device's free memory.
    """
    sharding = target_sharding(mesh)
    devices = sorted(sharding.addressable_devices, key=lambda d: d.id)
    sources = [_sources(t, packed) for t in plan]
    check_fits(plan, sources, checkpoint, devices, jnp.dtype(dtype))
    converters = _Converters(checkpoint, plan, sources, devices[0], dtype)
    arriving: collections.deque[tuple[TensorPlan, list[str], list[jax.Array]]] = collections.deque()
    placed: collections.deque[tuple[jax.Array, list[str]]] = collections.deque()  # host pages still mapped
    pending = 0  # bytes put and not yet retired
    leaves = []

    def convert_and_replicate(t: TensorPlan, names: list[str], on_device: list[jax.Array]) -> None:
        first = converters(t, on_device)
        copies = [first] + [jax.device_put(first, d) for d in devices[1:]]
        leaf = copies[0] if len(devices) == 1 and mesh is None else (
            jax.make_array_from_single_device_arrays(t.shape, sharding, copies)
        )
        leaves.append(leaf)
        placed.append((leaf, names))

    total = sum(checkpoint[n].nbytes for names in sources for n in names)
    with _Progress(len(plan), total, progress) as bar:
        for t, names in zip(plan, sources):
            on_device = jax.device_put([_host_array(checkpoint, n, t.kind) for n in names], devices[0])
            arriving.append((t, names, on_device))
            size = sum(checkpoint[n].nbytes for n in names)
            pending += size
            # A conversion launched before its inputs have arrived blocks this thread until they do, and the
            # next transfers wait behind it (an NVFP4 load took 2x longer on an H200): convert the tensors
            # that have arrived, and the others only when over the budget.
            while arriving and (pending > inflight_bytes or all(a.is_ready() for a in arriving[0][2])):
                convert_and_replicate(*arriving.popleft())
            while pending > inflight_bytes and placed:
                pending -= _retire(checkpoint, *placed.popleft())
            bar.advance(size)
        while arriving:
            convert_and_replicate(*arriving.popleft())
        while placed:
            _retire(checkpoint, *placed.popleft())
    return leaves


def check_fits(plan: list[TensorPlan], sources: list[list[str]], checkpoint: Checkpoint, devices: list,
               dtype: jnp.dtype) -> None:
    """Refuse a load whose leaves, plus the inputs of its largest conversion, exceed a device's free memory
    (`bytes_limit - bytes_in_use` of `memory_stats()`; devices that report none, like CPUs, are not checked):
    a clear error before anything is placed instead of RESOURCE_EXHAUSTED halfway through."""
    leaves = sum(math.prod(t.shape) * (4 if t.kind == "int" else dtype.itemsize) for t in plan)  # int32 d2t
    converted = [sum(checkpoint[n].nbytes for n in names) for t, names in zip(plan, sources)
                 if len(names) > 1 or (t.kind != "int" and checkpoint[t.name].np_dtype != dtype)]
    needed = leaves + max(converted, default=0)
    for device in devices:
        stats = device.memory_stats() or {}
        if "bytes_limit" not in stats:
            continue
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        if needed > free:
            raise CheckpointError(
                f"{checkpoint.path}: the drafter needs {needed / 2**20:,.0f} MiB on each device as {dtype.name} "
                f"but {device} has {free / 2**20:,.0f} MiB free; expected a device with more free memory (or a "
                "narrower dtype)"
            )


def _host_array(checkpoint: Checkpoint, name: str, kind: str) -> np.ndarray:
    """A tensor as NumPy, ready to put: the memory-mapped view (index tables narrowed to int32, JAX's default)."""
    array = checkpoint.array(name)
    return array.astype(np.int32) if kind == "int" else array


def _sources(t: TensorPlan, packed: set[str]) -> list[str]:
    """The checkpoint tensors one leaf is made from: itself, or a packed weight and its two scales."""
    if t.name not in packed:
        return [t.name]
    return [t.name, *nvfp4_companions(t.name)]


class _Converters:
    """The on-device conversions of a load (NVFP4 dequantization, casts to the load dtype), compiled ahead.

    All of them are requested from `_executables` as soon as the load starts, so they compile (or load from
    the disk cache) on its thread pool while the first tensors stream.
    """

    def __init__(self, checkpoint: Checkpoint, plan: list[TensorPlan], sources: list[list[str]], device, dtype):
        dtype = jnp.dtype(dtype)
        self._futures = {}
        for t, names in zip(plan, sources):
            inputs = tuple((checkpoint[n].shape, checkpoint[n].np_dtype) for n in names)
            if len(names) > 1:
                self._futures[t.name] = compiled("nvfp4", inputs, dtype, device)
            elif t.kind != "int" and inputs[0][1] != dtype:
                self._futures[t.name] = compiled("cast", inputs, dtype, device)

    def __call__(self, t: TensorPlan, arrays: list[jax.Array]) -> jax.Array:
        future = self._futures.get(t.name)
        return arrays[0] if future is None else future.result()(*arrays)


def _retire(checkpoint: Checkpoint, leaf: jax.Array, names: list[str]) -> int:
    """Wait for a tensor's copies, then drop its host pages; returns the bytes released."""
    leaf.block_until_ready()
    for name in names:
        checkpoint.release(name)
    return sum(checkpoint[n].nbytes for n in names)


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

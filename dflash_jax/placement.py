"""Putting planned tensors onto devices: one host->device copy per tensor, then device-to-device.

For each tensor, the memory-mapped bytes are copied once to the first local device of the target
sharding, converted there (cast to the load dtype, or NVFP4-dequantized), then copied device-to-device to
the other local devices, and the per-device copies are assembled with
`jax.make_array_from_single_device_arrays`. Under a multi-process runtime each process does this for its
own devices only, so no process ever holds or sends another's data.

Host memory stays bounded: copies are asynchronous, at most `inflight_bytes` of them are outstanding, and
once a tensor's copy is done its pages are dropped from this process (MADV_DONTNEED: the data stays in
the page cache, it is only unmapped from us).
"""

from __future__ import annotations

import collections
import sys
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from .safetensors import Checkpoint

if TYPE_CHECKING:
    from .loader import TensorPlan

DEFAULT_INFLIGHT_BYTES = 128 * 1024 * 1024


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
    """Place every planned tensor (in plan order) replicated on the sharding of `mesh`."""
    sharding = target_sharding(mesh)
    devices = sorted(sharding.addressable_devices, key=lambda d: d.id)
    inflight: collections.deque[tuple[jax.Array, list[str]]] = collections.deque()
    pending = 0
    leaves = []
    total = sum(_host_bytes(checkpoint, t, packed) for t in plan)
    with _Progress(len(plan), total, progress) as bar:
        for t in plan:
            names, first = _put_first(checkpoint, t, t.name in packed, devices[0], dtype)
            copies = [first] + [jax.device_put(first, d) for d in devices[1:]]
            leaf = copies[0] if len(devices) == 1 and mesh is None else (
                jax.make_array_from_single_device_arrays(t.shape, sharding, copies)
            )
            leaves.append(leaf)
            size = sum(checkpoint[n].nbytes for n in names)
            inflight.append((leaf, names))
            pending += size
            while pending > inflight_bytes and inflight:
                pending -= _retire(checkpoint, *inflight.popleft())
            bar.advance(size)
        while inflight:
            _retire(checkpoint, *inflight.popleft())
    return leaves


def _put_first(checkpoint: Checkpoint, t: TensorPlan, is_packed: bool, device, dtype) -> tuple[list[str], jax.Array]:
    """Copy one tensor's bytes to `device` and convert it there; returns the tensors read and the array."""
    from .loader import host_array

    if is_packed:
        from .nvfp4 import dequantize
        from .nvfp4.checkpoint import companions

        names = [t.name, *companions(t.name)]
        packed, scale, scale_2 = (jax.device_put(checkpoint.array(n), device) for n in names)
        return names, dequantize(packed, scale, scale_2.reshape(()).astype(jnp.float32), dtype=dtype)
    first = jax.device_put(host_array(checkpoint, checkpoint[t.name]), device)
    if t.kind != "int" and first.dtype != dtype:
        first = first.astype(dtype)
    return [t.name], first


def _retire(checkpoint: Checkpoint, leaf: jax.Array, names: list[str]) -> int:
    """Wait for a tensor's copies, then drop its host pages; returns the bytes released."""
    leaf.block_until_ready()
    for name in names:
        checkpoint.release(name)
    return sum(checkpoint[n].nbytes for n in names)


def _host_bytes(checkpoint: Checkpoint, t: TensorPlan, packed: set[str]) -> int:
    if t.name not in packed:
        return checkpoint[t.name].nbytes
    from .nvfp4.checkpoint import companions

    return sum(checkpoint[n].nbytes for n in (t.name, *companions(t.name)))


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

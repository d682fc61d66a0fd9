"""Which device a program runs on, answered once: the `Platform` value the kernels, their tiles and the cache
sizes are chosen by.

A `Platform` holds what the package reads of a device: its kind (`jax.Device.device_kind`, which keys the tuning
table), its CUDA compute capability (the Mosaic GPU kernels need a Hopper or newer; the WGMMA ones a Hopper), its
streaming multiprocessors (how many CTAs fill it), whether programs may be lowered for a CUDA GPU here, and the
kind's `tuning.Tuning` entry. `platform_of` reads it from the devices of the arrays or the mesh a program is given
(where they are known: the params of a drafter or target); inside a traced program, where arrays have no devices
yet, the functions that choose default to `process_platform()`, this process's GPUs (a process has one kind), the
only GPU a `on_gpu` branch can run on. Whether a program runs a GPU kernel at all is decided where it is lowered
(`on_gpu`: `lax.platform_dependent`), not here. Every function that reads one takes `platform=` (or `tuning=`,
where only the table's figures matter): an override is a value, e.g. `dataclasses.replace(platform, tuning=...)`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import jax

from .tuning import Tuning, tuning_for

__all__ = ["Platform", "process_platform", "platform_of", "has_cuda", "on_gpu"]

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Platform:
    """The device facts and tuning a program is built for (module docstring)."""

    kind: str  # `jax.Device.device_kind`: "NVIDIA H200", "cpu"
    compute_capability: float  # CUDA compute capability (9.0 on a Hopper); 0 off a GPU
    sm_count: int  # streaming multiprocessors; 1 where the device does not say (a CPU)
    cuda: bool  # whether programs may be lowered for a CUDA GPU here (then `on_gpu` traces the GPU branch)
    tuning: Tuning

    @classmethod
    def of(cls, device: jax.Device) -> Platform:
        """The platform of `device`."""
        gpu = device.platform == "gpu"
        return cls(kind=device.device_kind, compute_capability=float(getattr(device, "compute_capability", 0))
                   if gpu else 0.0, sm_count=getattr(device, "core_count", 0) or 1, cuda=gpu and has_cuda(),
                   tuning=tuning_for(device.device_kind if gpu else None))

    @property
    def hopper_or_newer(self) -> bool:
        """A GPU that Pallas Mosaic GPU compiles for (compute capability 9.0 or more)."""
        return self.compute_capability >= 9.0

    @property
    def hopper(self) -> bool:
        """A Hopper GPU (compute capability 9.0: WGMMA, which later GPUs do not have)."""
        return self.compute_capability == 9.0


@functools.cache
def process_platform() -> Platform:
    """This process's first CUDA GPU's platform (a process has one kind), else its first device's (a CPU)."""
    return Platform.of(jax.devices("cuda")[0] if has_cuda() else jax.devices()[0])


def platform_of(*where: Any) -> Platform:
    """The platform of the devices holding `where`: pytrees of arrays, meshes, shardings or devices. A GPU among
    them decides; else their first device; `process_platform()` where none has devices yet (tracers)."""
    devices = list(_devices(where))
    gpus = [d for d in devices if d.platform == "gpu"]
    return Platform.of((gpus or devices)[0]) if devices else process_platform()


def _devices(where: Iterable[Any]) -> Iterable[jax.Device]:
    for item in where:
        if isinstance(item, jax.sharding.Mesh):
            yield from item.devices.flat
        elif isinstance(item, jax.sharding.Sharding):
            yield from item.device_set
        elif isinstance(item, jax.Device):
            yield item
        else:
            for leaf in jax.tree.leaves(item):
                if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
                    yield from leaf.devices()


@functools.cache
def has_cuda() -> bool:
    """Whether this process has a CUDA backend (then a program may be lowered for its GPUs)."""
    try:
        return bool(jax.devices("cuda"))
    except RuntimeError:
        return False


def on_gpu(platform: Platform, gpu: Callable[..., T], other: Callable[..., T], *args: Any) -> T:
    """`gpu(*args)` where the program is lowered for a CUDA GPU, else `other(*args)`: decided by where the
    computation and its arrays live (`lax.platform_dependent`, resolved when lowering), not by the process's
    default backend. Both must return the same types. Where `platform` has no CUDA, `gpu` is not traced."""
    if not platform.cuda:
        return other(*args)
    return jax.lax.platform_dependent(*args, cuda=gpu, default=other)

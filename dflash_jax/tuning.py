"""Kernel tuning: one table keyed by device kind (`jax.Device.device_kind`), with a fallback for devices never
measured.

Each entry holds the figures measured on that device kind: the GPU span-attention kernel's splits and tiles
(`attention`), when the drafter reads its rings with that kernel (`drafting`), the NVFP4 dequantizer's tile
(`nvfp4`), and when the MoE block gathers experts (`target.moe`). The measurements, their commands and the
devices they ran on are in docs/benchmarks.md; the code keeps only the values. A device kind without an entry
runs the fallback, the only entry measured so far (an NVIDIA H200); to tune another, run the benchmarks that
docs/benchmarks.md names on it and add its entry.

The values decide programs at trace time, by the kind of this process's GPUs (a process has one kind); whether a
program runs a GPU kernel at all is decided by where it is lowered (`on_gpu`), not by the default backend.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Literal, TypeVar

import jax

__all__ = ["Tuning", "tuning", "device_kind", "has_cuda", "on_gpu"]

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Tuning:
    """The tuned parameters of one device kind."""

    # The GPU span kernel's key slots per program (split-K), by cache capacity: (up to this many slots, keys per
    # split for query tiles of < 64 rows, for 64- and 128-row tiles). Also decides cache capacities
    # (`attention.span_capacity`), on every platform.
    span_splits: tuple[tuple[float, int, int], ...]
    # The kernel's programs per split (sequences x KV heads x 64-row query tiles) at which `span_splits` was
    # measured; a read with fewer programs takes proportionally shorter splits, so that as many CTAs run.
    span_programs: int
    # Batches from this size on read the drafter's ring layers with the span kernel; smaller ones score a whole
    # ring densely (two kernel launches per ring cost more than one dense pass at small batches).
    ring_spans_min_batch: int
    # The NVFP4 dequantizer's 16-value blocks per CTA (`nvfp4._mosaic_gpu`: a multiple of 128, at most 1024; 256 and
    # 512 measured alike, 1024 slower: docs/benchmarks.md).
    nvfp4_tile: int
    # The MoE block gathers each token's experts up to this many (token, expert) pairs (decode and verify
    # steps); more go through a grouped matmul in tiles of `moe_tile_rows` rows, one expert's a tile (`target.moe`).
    moe_gather_max_rows: int
    moe_tile_rows: int
    # How those few pairs run: "gather" copies each token's experts' weights out, then multiplies; "reduce" reads
    # them in place inside a multiply-and-reduce (`target.moe._gathered_in_place`); "slots" reads each distinct
    # expert once in place in a Mosaic GPU kernel (`target._expert_gemm`).
    moe_few_rows: Literal["gather", "reduce", "slots"]
    # The dense target's fused (cuDNN) prefill runs whole sequences, at most this many prompt rows (batch x P) a
    # step (`target.dense._fused_rows`): 8 x 32k rows at once ran an 80 GB H100 out of memory (docs/benchmarks.md);
    # 32k-row GEMMs are compute-bound already.
    fused_prefill_rows: int


H200 = Tuning(
    span_splits=((16384, 512, 512), (65536, 1024, 1024), (float("inf"), 1024, 4096)),
    span_programs=8,  # 8 KV heads at batch 1 (Qwen3-8B shapes)
    ring_spans_min_batch=8,
    nvfp4_tile=256,
    moe_gather_max_rows=256,
    moe_tile_rows=128,
    moe_few_rows="reduce",
    fused_prefill_rows=32768,
)
TUNING: dict[str, Tuning] = {"NVIDIA H200": H200}
FALLBACK = H200  # a device kind never measured (and the CPU, where only `span_splits` sizes the caches)


def tuning(kind: str | None = None) -> Tuning:
    """The entry of device kind `kind` (default: this process's GPUs', `device_kind`), else `FALLBACK`."""
    return TUNING.get(kind or device_kind() or "", FALLBACK)


@functools.cache
def device_kind() -> str | None:
    """The kind of this process's first GPU (`"NVIDIA H200"`), or None in a process without one."""
    try:
        return jax.devices("gpu")[0].device_kind
    except RuntimeError:
        return None


@functools.cache
def has_cuda() -> bool:
    """Whether this process has a CUDA backend (then a program may be lowered for its GPUs)."""
    try:
        return bool(jax.devices("cuda"))
    except RuntimeError:
        return False


def on_gpu(gpu: Callable[..., T], other: Callable[..., T], *args: Any) -> T:
    """`gpu(*args)` where the program is lowered for a CUDA GPU, else `other(*args)`: decided by where the
    computation and its arrays live (`lax.platform_dependent`, resolved when lowering), not by the process's
    default backend. Both must return the same types. In a process without a CUDA backend `gpu` is not traced."""
    if not has_cuda():
        return other(*args)
    return jax.lax.platform_dependent(*args, cuda=gpu, default=other)

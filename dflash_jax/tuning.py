"""Kernel tuning: one table keyed by device kind (`jax.Device.device_kind`), with a fallback for devices never
measured.

Each entry holds every tile, chunk and threshold the package's programs take from the device: the span-attention
kernel's splits and tiles and the XLA span loop's block (`attention`, `_span_attention_mgpu`), when the drafter
reads its rings with that kernel (`drafting`), the packed NVFP4 GEMM's tiling (`nvfp4`),
how the MoE block runs its experts and the tiles of its kernels (`target.moe`, `target._expert_gemm`), the dense
target's fused prefill rows and the hybrid's delta-rule chunk (`target`), and the rates a decode step's cost is
predicted at (`step_cost_model`; `CPU_RATES` off a GPU). The measurements, their commands and the
devices they ran on are in docs/benchmarks.md; the code keeps only the values. A device kind without an entry
runs the fallback (the H200's figures); to tune another, run the benchmarks that docs/benchmarks.md names on it and
add its entry.

Which entry a program reads is `platform.Platform.tuning`: the kind of the devices the program runs on. A value
here is never changed in place: an override is a new value (`dataclasses.replace(entry, ...)`) passed as
`platform=` / `tuning=` to the functions that read it.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping
from typing import Literal

__all__ = ["Tuning", "GemmTiling", "RaggedDotTiling", "StepRates", "TUNING", "FALLBACK", "CPU_RATES", "tuning_for"]


@dataclasses.dataclass(frozen=True)
class GemmTiling:
    """The packed NVFP4 GEMM's tiles (`nvfp4._mosaic_gemm`). tile_n: weight rows per CTA (WGMMA M, 64 or 128);
    tile_k: K per pipeline step (256 or 512); max_concurrent_steps: pipeline depth (TMA copies in flight); split_k:
    CTAs sharing one output tile's K range (their float32 partial sums are added by XLA), 0 = enough to give every
    SM a CTA (`_mosaic_gemm.split_for`)."""

    tile_n: int = 64
    tile_k: int = 256
    max_concurrent_steps: int = 4
    split_k: int = 0


@dataclasses.dataclass(frozen=True)
class RaggedDotTiling:
    """The tiles of JAX's Mosaic GPU grouped matmul (`ragged_dot_mgpu.ragged_dot`'s keywords), as the MoE block's
    opt-in "grouped" form calls it (`target.moe._grouped_matmul`)."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    max_concurrent_steps: int = 4
    grid_block_n: int = 1


@dataclasses.dataclass(frozen=True)
class StepRates:
    """What a decode step's predicted cost is made of (`step_cost_model`): bytes read per second, bf16 FLOPs per
    second, and fixed seconds per layer of a forward and per step (kernel launches and the loop's small ops)."""

    read_bytes_per_s: float
    flops_per_s: float
    layer_seconds: float
    step_seconds: float


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
    # The span kernel's key slots per step, and the K/V slots in shared memory (1 for a head size of 256: 2 do not
    # fit beside the rest; `_span_attention_mgpu`).
    span_block_k: int
    span_stages: int
    # Key slots per step of the XLA span loop (`attention._span_xla`: the CPU and reference path; not tuned).
    span_block: int
    # Batches from this size on read the drafter's ring layers with the span kernel; smaller ones score a whole
    # ring densely (two kernel launches per ring cost more than one dense pass at small batches).
    ring_spans_min_batch: int
    # The packed NVFP4 GEMM's tiles (no configuration measured more than 11% faster on every shape and M, so the
    # defaults: docs/benchmarks.md, "Packed NVFP4 GEMM").
    nvfp4_gemm: GemmTiling
    # `load_drafter(weights="auto")` on this device (bfloat16 loads): the form quantized weights are placed in, by
    # the batch the caller declares, as (up to this batch, form) in increasing order; a batch between two measured
    # ones takes the next measured one's form. Each form's drafting steps: docs/benchmarks.md, "Drafting step with
    # packed weights". The FP8-stored form ("fp8") is in no entry: XLA does not fuse its dequantization into the
    # GEMM (1.9x bf16's product on an H100, "Nemotron 3.5 Lightning drafters").
    auto_weights: tuple[tuple[float, Literal["packed", "fp8", "dequantized"]], ...]
    # The MoE block gathers each token's experts up to this many (token, expert) pairs (decode and verify
    # steps); more go through a grouped matmul in tiles of `moe_tile_rows` rows, one expert's a tile (`target.moe`).
    moe_gather_max_rows: int
    moe_tile_rows: int
    # How those few pairs run: "gather" copies each token's experts' weights out, then multiplies; "reduce" reads
    # them in place inside a multiply-and-reduce (`target.moe._gathered_in_place`); "slots" reads each distinct
    # expert once in place in a Mosaic GPU kernel (`target._expert_gemm`).
    moe_few_rows: Literal["gather", "reduce", "slots"]
    # The expert-slot kernel's pipeline steps in flight (`target._expert_gemm`).
    expert_gemm_depth: int
    # The tiles of JAX's grouped matmul kernel (the MoE block's "grouped" form).
    ragged_dot: RaggedDotTiling
    # The dense target's fused (cuDNN) prefill runs whole sequences, at most this many prompt rows (batch x P) a
    # step (`target.dense._fused_rows`): 8 x 32k rows at once ran an 80 GB H100 out of memory (docs/benchmarks.md);
    # 32k-row GEMMs are compute-bound already.
    fused_prefill_rows: int
    # Rows of the hybrid target's chunked gated delta rule (`target.qwen3_5`: transformers' and flash-linear-
    # attention's default).
    delta_chunk: int
    # The rates a decode step's cost is predicted at (`step_cost_model`): `jnp.sum`'s read rate and one 8192^3 bf16
    # GEMM's rate as docs/benchmarks.md measured them; the fixed costs from greedy steps over their read floor
    # (a Qwen3-8B step on an H100: 6.6 ms against 6.0 ms of weights at 2.74 TB/s, ~17 us a layer).
    step_rates: StepRates


H200 = Tuning(
    span_splits=((16384, 512, 512), (65536, 1024, 1024), (float("inf"), 1024, 4096)),
    span_programs=8,  # 8 KV heads at batch 1 (Qwen3-8B shapes)
    span_block_k=64,
    span_stages=2,
    span_block=512,
    ring_spans_min_batch=8,
    nvfp4_gemm=GemmTiling(),
    # Qwen3-8B-DFlash-b16 shapes: packed 0.95x the bf16 step at batch 1, 1.27x at batch 8
    auto_weights=((1, "packed"), (float("inf"), "dequantized")),
    moe_gather_max_rows=256,
    moe_tile_rows=128,
    moe_few_rows="reduce",
    expert_gemm_depth=3,
    ragged_dot=RaggedDotTiling(),
    fused_prefill_rows=32768,
    delta_chunk=64,
    step_rates=StepRates(read_bytes_per_s=3.8e12, flops_per_s=7.3e14, layer_seconds=20e-6, step_seconds=100e-6),
)
# The H100's entry holds the H200's values until each is measured on an H100: the H100 runs of docs/benchmarks.md
# (the packed GEMM's splits and depths) chose these same values. Its own: `auto_weights`, and
# the step rates (the read rate of the Nemotron-H run, 2.74 TB/s; the GEMM rate an estimate, not measured here).
H100 = dataclasses.replace(
    H200,
    # The Nemotron 3.5 Lightning drafters: packed 0.85x (DSpark) and 1.07x (DFlash) the bf16 step at batch 1,
    # 0.90x and 1.08x at batch 8, 1.19x and 1.69x at batch 32 (Qwen3-8B-DFlash-b16 shapes: 0.87x at batch 1)
    auto_weights=((1, "packed"), (float("inf"), "dequantized")),
    step_rates=StepRates(read_bytes_per_s=2.74e12, flops_per_s=6.0e14, layer_seconds=20e-6, step_seconds=100e-6),
)
# device kind -> entry, read-only; the kinds as `jax.Device.device_kind` spells them (an H100 SXM: "NVIDIA H100 80GB
# HBM3")
TUNING: Mapping[str, Tuning] = types.MappingProxyType({"NVIDIA H200": H200, "NVIDIA H100 80GB HBM3": H100})
# A CPU: a few cores' memory and multiply rates; at the test models' sizes the fixed costs decide.
CPU_RATES = StepRates(read_bytes_per_s=2e10, flops_per_s=5e10, layer_seconds=50e-6, step_seconds=300e-6)
FALLBACK = H200  # a device kind never measured (and the CPU, where only the sizes of caches and loops matter)


def tuning_for(kind: str | None) -> Tuning:
    """The entry of device kind `kind` (`jax.Device.device_kind`), else `FALLBACK`."""
    return TUNING.get(kind or "", FALLBACK)

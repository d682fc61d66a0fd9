"""A few tokens' routed experts read where they lie: a Pallas Mosaic GPU kernel over expert slots (Hopper).

    expert_matmul(rhs, stack [E, out, in] bf16, slot_expert [S] i32, slots_used [1] i32) -> [splits, S, out, N] f32
        result[:, s] sums to stack[slot_expert[s]] @ rhs_s     for s < slots_used; later slots are not written

`rhs` is `[in, N]` bf16 shared by every slot (the tokens' x^T) or `[S, in, N]` (each slot's own columns).

Why: a decode or verify step routes a few tokens to a few experts. XLA has no product that reads one expert of a
stack by an index it computes: it copies each routed expert out before its GEMM, or fuses the gather into a
multiply-and-reduce that runs at 4.4x the read floor at one token (docs/benchmarks.md, "Qwen3.5 MoE block"). Here
a CTA loads its slot's expert id from global memory and its pipeline's TMA copies read that expert's rows in place.
A slot is one distinct expert, so an expert chosen by several tokens is read once: the tokens are the WGMMA's N
columns (padded to 16), and the caller picks each (token, expert) pair's column.

WGMMA's left operand has 64-row tiles, so the expert's rows are the left operand: out^T = W [out, in] @ rhs [in, N]
per 64-row tile. K (`in`) runs in a `plgpu.emit_pipeline` of 256-column (128 for narrow K) steps; where slots x row
tiles leave SMs idle (one token: 8 experts x 8 tiles of a 512-row projection), K is split and the float32 partial
sums are added by XLA. Slots past `slots_used` (the stack of distinct experts has a static size) exit at once.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from .._gpu import k_splits, kernel_params
from ..platform import process_platform

TILE_N = 64  # rows of the expert per CTA: WGMMA's M
MIN_COLUMNS = 16  # N, the tokens, padded to a multiple of this (bf16 rows of 32 bytes in shared memory)


def tile_k_for(inner: int) -> int:
    """The pipeline's K step: 256 where it divides `inner`, else 128."""
    return 256 if inner % 256 == 0 else 128


def takes(stack_shape: tuple[int, ...], dtype: Any) -> bool:
    """Whether the kernel takes a stack of this shape and dtype: bf16 `[E, out, in]`, out % 64, in % 128."""
    return len(stack_shape) == 3 and jnp.dtype(dtype) == jnp.bfloat16 and stack_shape[1] % TILE_N == 0 \
        and stack_shape[2] % 128 == 0


def splits_for(slots: int, out: int, inner: int, sms: int) -> int:
    """K splits by `k_splits`'s rule over the slots x row tiles."""
    return k_splits(inner // tile_k_for(inner), slots * (out // TILE_N), sms)


def _kernel(slot_expert_gmem, used_gmem, w_gmem, rhs_gmem, out_gmem, out_smem, *, out_rows: int, tile_k: int,
            shared_rhs: bool, columns: int, depth: int):
    """One CTA: partial sum `split` of slot `s`'s rows [n * 64, n * 64 + 64) x all columns."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    s, n, split = lax.axis_index("slot"), lax.axis_index("n"), lax.axis_index("split")
    splits = out_gmem.shape[0]
    k_steps = w_gmem.shape[1] // tile_k // splits  # this CTA's steps

    @pl.when(s < used_gmem[0])
    def _():
        row_tile = slot_expert_gmem[s] * (out_rows // TILE_N) + n  # the expert's tile n in the flat [E * out, in]
        rhs_step = split * k_steps if shared_rhs else (s * splits + split) * k_steps  # in [S * in, N] for per-slot

        concurrent = min(depth, k_steps)
        overlap = int(concurrent >= 2)  # with 1 step in flight its buffers are refilled next: wait for the product

        def step(_, w_smem, rhs_smem, acc_ref):
            plgpu.wgmma(acc_ref, w_smem, rhs_smem)  # [64, tile_k] @ [tile_k, N]
            plgpu.wgmma_wait(overlap)  # the previous step's product: its buffers are released after this step

        def accumulate(acc_ref):
            plgpu.emit_pipeline(
                lambda indices, w_smem, rhs_smem: step(indices, w_smem, rhs_smem, acc_ref),
                grid=(k_steps,),
                in_specs=[
                    plgpu.BlockSpec((TILE_N, tile_k), lambda k: (row_tile, split * k_steps + k),
                                    delay_release=overlap),
                    plgpu.BlockSpec((tile_k, columns), lambda k: (rhs_step + k, 0), delay_release=overlap),
                ],
                max_concurrent_steps=concurrent,
            )(w_gmem, rhs_gmem)
            plgpu.wgmma_wait(0)
            return acc_ref[...]

        out_smem[...] = pl.run_scoped(accumulate, plgpu.ACC((TILE_N, columns), jnp.float32))  # [64, N]
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[split, s, pl.ds(n * TILE_N, TILE_N)])
        plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("splits", "depth", "sms", "interpret"))
def expert_matmul(rhs: jax.Array, stack: jax.Array, slot_expert: jax.Array, slots_used: jax.Array, *,
                  splits: int | None = None, depth: int | None = None, sms: int | None = None,
                  interpret: bool = False) -> jax.Array:
    """`[splits, S, out, N]` float32 partial sums of `stack[slot_expert[s]] @ rhs_s` (module docstring). `rhs`
    `[in, N]` or `[S, in, N]` bf16 with N a multiple of 16; `splits` overrides `splits_for`; `depth` (pipeline steps
    in flight, `tuning.Tuning.expert_gemm_depth`) and `sms` (the GPU's streaming multiprocessors, which the splits
    fill) default to `platform.process_platform()`'s; `interpret=True` runs Pallas's GPU interpreter (on a CPU)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    E, out, inner = stack.shape
    (slots,), columns = slot_expert.shape, rhs.shape[-1]
    shared_rhs = rhs.ndim == 2
    if not takes(stack.shape, stack.dtype) or rhs.dtype != jnp.bfloat16 or columns % MIN_COLUMNS \
            or rhs.shape[-2] != inner or (not shared_rhs and rhs.shape[0] != slots):
        raise ValueError(f"expert kernel: stack {stack.shape} {stack.dtype}, rhs {rhs.shape} {rhs.dtype}, "
                         f"{slots} slots (stack bf16 [E, out % 64, in % 128], rhs bf16 [(S,) in, N % 16])")
    tile_k = tile_k_for(inner)
    here = process_platform()
    splits = splits or splits_for(slots, out, inner, sms or here.sm_count)
    kernel = plgpu.kernel(
        functools.partial(_kernel, out_rows=out, tile_k=tile_k, shared_rhs=shared_rhs, columns=columns,
                          depth=depth or here.tuning.expert_gemm_depth),
        out_type=jax.ShapeDtypeStruct((splits, slots, out, columns), jnp.float32),
        grid=(slots, out // TILE_N, splits),
        grid_names=("slot", "n", "split"),
        scratch_types=[plgpu.SMEM((TILE_N, columns), jnp.float32)],  # the output tile
        **kernel_params(interpret),
    )
    flat_rhs = rhs if shared_rhs else rhs.reshape(slots * inner, columns)  # [(S *) in, N]
    return kernel(slot_expert.astype(jnp.int32), slots_used.astype(jnp.int32).reshape(1),
                  stack.reshape(E * out, inner), flat_rhs)


def slots_of(experts: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The distinct experts of the (token, expert) pairs `experts [P]`: `(slot_expert [P], slots_used [],
    slot_of [P])`, slots in ascending expert order, slot_expert[slot_of[p]] == experts[p]; slots from slots_used on
    repeat the last expert (never read: the kernel skips them)."""
    P = experts.shape[0]
    order = jnp.argsort(experts)  # [P]
    by_expert = experts[order]  # [P] ascending
    first = jnp.concatenate([jnp.ones((1,), bool), by_expert[1:] != by_expert[:-1]])  # [P] a new expert starts
    slot_sorted = jnp.cumsum(first) - 1  # [P] the slot of each sorted pair
    slot_expert = jnp.zeros((P,), jnp.int32).at[slot_sorted].max(by_expert.astype(jnp.int32))
    used = slot_sorted[-1] + 1
    slot_expert = jnp.where(jnp.arange(P) < used, slot_expert, by_expert[-1].astype(jnp.int32))
    slot_of = jnp.zeros((P,), jnp.int32).at[order].set(slot_sorted.astype(jnp.int32), unique_indices=True)
    return slot_expert, used, slot_of


"""Attention of a few query rows over a cache span `[start, stop)`, split-K, as a Pallas Mosaic GPU kernel (Hopper).

The GPU kernel of `attention.Span` (it replaced JAX's Pallas Triton `decode_attention`): it returns the unnormalised
partial softmax `(acc, m, l)` that `attention` merges with its other sources, and reads only the key blocks that
intersect each sequence's range.

One CTA (one warpgroup) per (split, 64-row query tile, sequence x KV head): the split's key slots
`[split * keys_per_split, ...)` cut by the sequence's `[start, stop)`, read `block_k` keys at a time. K and V blocks
come GMEM -> SMEM by TMA into `stages` slots (the copy of block i + 1 is in flight while block i is computed);
`S = Q K^T` and `P V` run on WGMMA with float32 accumulators, P (rounded to the operands' dtype, as in the Triton
kernel) passing through SMEM: JAX's GPU interpreter takes WGMMA operands from SMEM only, and so the CPU tests run
this very kernel. The online softmax (FlashAttention, Dao et al. 2022, arXiv:2205.14135) keeps `m` in log2 units so
that `exp2` takes the scaled scores directly. Slots of a block outside `[start, stop)` are masked to -inf before the
max (the range need not be block-aligned; every block read holds a key of it). Each split writes its output
normalised, in the operands' dtype, over Q's SMEM (Q is read by then; a float32 output would take the SMEM that
lets two CTAs share an SM), with its `m` and `l` in float32; a split that meets no key writes `m = -inf, l = 0`
and zeros. The splits are merged in XLA.

Query rows: a KV head's `groups * Sq` rows (GQA: the query heads that share it, times the block's tokens), padded
to a multiple of 64 (the WGMMA tile's M); the padding rows score zeros and are dropped.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ._shapes import ceil_div, round_up

ROWS = 64  # query rows per CTA: one WGMMA M tile
_BOUNDS = 32  # start/stop are copied to SMEM as [2, a multiple of 32] int32: TMA moves multiples of 128 bytes
_LOG2E = math.log2(math.e)


def _kernel(q_gmem, k_gmem, v_gmem, bounds_gmem, o_gmem, m_gmem, l_gmem,
            qo_smem, k_smem, v_smem, p_smem, bounds_smem, m_smem, l_smem, barriers, k_barriers, v_barriers,
            *, n_kv: int, keys_per_split: int, block_k: int, stages: int, sm_scale: float, dtype):
    # q_gmem [BH, Rp, d] (query rows of one sequence and KV head), k/v_gmem [BH, capacity, d], bounds_gmem [2, Bp]
    # int32 (start, stop per sequence; BH = batch * n_kv)
    split, tile, bh = lax.axis_index("split"), lax.axis_index("tile"), lax.axis_index("bh")
    d_h = qo_smem.shape[-1]
    rows = pl.ds(tile * ROWS, ROWS)
    plgpu.copy_gmem_to_smem(q_gmem.at[bh, rows], qo_smem, barriers.at[0])
    plgpu.copy_gmem_to_smem(bounds_gmem, bounds_smem, barriers.at[1])
    plgpu.barrier_wait(barriers.at[1])
    sequence = bh // n_kv
    start, stop = bounds_smem[0, sequence], bounds_smem[1, sequence]
    lo = jnp.maximum(start, split * keys_per_split)
    hi = jnp.minimum(stop, (split + 1) * keys_per_split)
    first = lo // block_k
    steps = jnp.where(hi > lo, pl.cdiv(hi, block_k) - first, 0)  # blocks holding keys of the range: each holds one

    def fetch(step):
        slot, at = step % stages, (first + step) * block_k
        plgpu.copy_gmem_to_smem(k_gmem.at[bh, pl.ds(at, block_k)], k_smem.at[slot], k_barriers.at[slot])
        plgpu.copy_gmem_to_smem(v_gmem.at[bh, pl.ds(at, block_k)], v_smem.at[slot], v_barriers.at[slot])

    for step in range(stages - 1):  # the first blocks in flight before the loop
        pl.when(step < steps)(functools.partial(fetch, step))
    plgpu.barrier_wait(barriers.at[0])

    def body(step, carry):
        acc, m, l = carry  # [ROWS, d] f32, [ROWS] f32 (log2 units), [ROWS] f32
        pl.when(step + stages - 1 < steps)(functools.partial(fetch, step + stages - 1))
        slot = step % stages
        plgpu.barrier_wait(k_barriers.at[slot])

        def scores(s_ref):
            plgpu.wgmma(s_ref, qo_smem, plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
            return s_ref[...]

        s = pl.run_scoped(scores, plgpu.ACC((ROWS, block_k), jnp.float32)) * (sm_scale * _LOG2E)  # [ROWS, block_k]
        key = (first + step) * block_k + plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA)
        s = jnp.where((key >= lo) & (key < hi), s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=1))  # finite: every block holds a key of the range
        rescale = jnp.exp2(m - m_new)  # [ROWS]; 0 on the first block (m = -inf)
        p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, (0,)))  # [ROWS, block_k]
        l = l * rescale + p.sum(axis=1)
        plgpu.barrier_wait(v_barriers.at[slot])

        p_smem[...] = p.astype(dtype)  # WGMMA's left operand from SMEM (JAX's GPU interpreter runs no other)
        plgpu.commit_smem()

        def weighted_values(pv_ref):
            plgpu.wgmma(pv_ref, p_smem, v_smem.at[slot])
            return pv_ref[...]

        pv = pl.run_scoped(weighted_values, plgpu.ACC((ROWS, d_h), jnp.float32))  # [ROWS, d]
        return acc * lax.broadcast_in_dim(rescale, acc.shape, (0,)) + pv, m_new, l

    acc = plgpu.layout_cast(jnp.zeros((ROWS, d_h), jnp.float32), plgpu.Layout.WGMMA)
    m = plgpu.layout_cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    l = plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    acc, m, l = lax.fori_loop(0, steps, body, (acc, m, l))
    # The output normalised, in the operands' dtype, where Q was (Q is read; half the SMEM of a float32 `acc`)
    qo_smem[...] = (acc / lax.broadcast_in_dim(jnp.where(l > 0, l, 1.0), acc.shape, (0,))).astype(dtype)
    m_smem[...] = m * (1 / _LOG2E)  # natural-log units, as `attention` merges them
    l_smem[...] = l
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(qo_smem, o_gmem.at[split, bh, rows])
    plgpu.copy_smem_to_gmem(m_smem, m_gmem.at[split, bh, rows])
    plgpu.copy_smem_to_gmem(l_smem, l_gmem.at[split, bh, rows])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


@functools.partial(jax.jit, static_argnames=("keys_per_split", "block_k", "stages", "interpret"))
def span_partials(q: jax.Array, k: jax.Array, v: jax.Array, start: jax.Array, stop: jax.Array, *,
                  keys_per_split: int, block_k: int, stages: int, interpret=None):
    """Partial softmax of `q [batch, n_kv, rows, d]` over slots `[start, stop)` (`[batch]` int32) of `k, v [batch,
    n_kv, capacity, d]` -> `acc [batch, n_kv, rows, d]` f32 (unnormalised), `m`, `l [batch, n_kv, rows]` f32 (the
    row max in natural-log units, -inf where no key; the sum of exp(s - m)). bf16/f16 operands, `d` a multiple of
    64 up to 256, `capacity` and `keys_per_split` multiples of `block_k`. `block_k` and `stages`: the device
    kind's (`tuning.Tuning.span_block_k`, `span_stages`; 1 stage for `d` = 256); `interpret`:
    `plgpu.InterpretGPUParams()` runs the kernel in JAX's GPU interpreter (jax >= 0.11)."""
    batch, n_kv, rows, d_h = q.shape
    capacity = k.shape[2]
    if q.dtype not in (jnp.bfloat16, jnp.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"span_partials: bf16 or f16 operands of one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if d_h % 64 or d_h > 256 or capacity % block_k or keys_per_split % block_k:
        raise ValueError(f"span_partials: head size {d_h} (a multiple of 64 up to 256), capacity {capacity} and "
                         f"keys per split {keys_per_split} (multiples of {block_k}) do not fit the kernel")
    stages = stages if d_h <= 128 else 1  # for a head size of 256, 2 K/V slots do not fit beside the rest
    bh, padded = batch * n_kv, round_up(rows, ROWS)
    n_splits = ceil_div(capacity, keys_per_split)
    q = jnp.pad(q.reshape(bh, rows, d_h), ((0, 0), (0, padded - rows), (0, 0)))  # [BH, Rp, d]
    bounds = jnp.zeros((2, round_up(batch, _BOUNDS)), jnp.int32)
    bounds = bounds.at[:, :batch].set(jnp.stack([start, stop]).astype(jnp.int32))  # [2, Bp]
    operand = lambda shape: plgpu.SMEM(  # noqa: E731  a WGMMA operand: 64-element tiles, 128-byte swizzle
        shape, q.dtype, transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)))
    kernel = functools.partial(_kernel, n_kv=n_kv, keys_per_split=keys_per_split, block_k=block_k, stages=stages,
                               sm_scale=d_h**-0.5, dtype=q.dtype)
    o, m, l = plgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct((n_splits, bh, padded, d_h), q.dtype),
                  jax.ShapeDtypeStruct((n_splits, bh, padded), jnp.float32),
                  jax.ShapeDtypeStruct((n_splits, bh, padded), jnp.float32)),
        scratch_types=[
            operand((ROWS, d_h)), operand((stages, block_k, d_h)), operand((stages, block_k, d_h)),
            operand((ROWS, block_k)),
            plgpu.SMEM(bounds.shape, jnp.int32), plgpu.SMEM((ROWS,), jnp.float32), plgpu.SMEM((ROWS,), jnp.float32),
            plgpu.Barrier(num_barriers=2), plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
        ],
        grid=(n_splits, padded // ROWS, bh),
        grid_names=("split", "tile", "bh"),
        interpret=interpret,
    )(q, k.reshape(bh, capacity, d_h), v.reshape(bh, capacity, d_h), bounds)
    # The splits' partials merged: [n_splits, BH, Rp(, d)] -> [BH, Rp(, d)]
    top = m.max(axis=0)
    shift = jnp.where(jnp.isfinite(top), top, 0.0)
    weight = jnp.exp(m - shift)  # 0 for a split that saw nothing
    acc = (o.astype(jnp.float32) * (l * weight)[..., None]).sum(axis=0)[:, :rows]
    l = (l * weight).sum(axis=0)[:, :rows]
    return acc.reshape(batch, n_kv, rows, d_h), top[:, :rows].reshape(batch, n_kv, rows), l.reshape(batch, n_kv, rows)

"""The packed NVFP4 weight-only GEMM on Hopper: a Pallas Mosaic GPU kernel (`jax.experimental.pallas.mosaic_gpu`).

    mosaic_matmul(x [M, K] bf16, codes [N, K/2] u8, scale [N, K/16] e4m3, scale_2 f32 []) -> x @ W.T  [M, N]

Why this shape of kernel (NVIDIA's PTX ISA, "Asynchronous Warpgroup Level Matrix Multiply-Accumulate"):
- WGMMA's left operand has 64-row tiles and its right operand 8..256 columns, so with M = batch x block rows
  (16-512) the weight must be the left operand: the kernel computes out^T [N, M] = W [N, K] @ x^T [K, M], and
  XLA transposes the small result back.
- The decode is the kernel's cost (decoding one code at a time in float32 took more than half of a product's time:
  docs/benchmarks.md, Decisions), so it works on packed words: a thread reads 8 code bytes a register (Mosaic's
  WGMMA_UPCAST_4X layout), two u32 words (8 codes each, k = 8j .. 8j + 7, nibble i = code 8j + i), and each word
  becomes 4 registers of bf16 pairs by inline PTX (`plgpu.inline_mgpu`): nibbles p and p + 4 shifted into one
  pair's halves and masked (their exponent and mantissa bits land in bf16's exponent LSBs and mantissa MSB: the
  E2M1 value x 2^-126, code 0.5 a bf16 subnormal), one `mul.rn.bf16x2` by the block scale, the sign bits XORed
  in (`_ptx_pair`: 5 instructions for 2 weights). The pairs go to the WGMMA as its register operand, never
  through shared memory.
- Which K a register column holds follows from Mosaic's WGMMA register layout (a thread holds u32 words 8g + 2t
  and 8g + 2t + 1 of its rows, t its lane % 4): `column_order`. x^T is laid out in that order by XLA
  (`permute_x`, x is small beside the weight), so the sum pairs each code with its own x.
- Both words of a thread's register lie in one 16-value scale block. A small WGMMA gives each word its block's
  scale: bf16 [tile_n, K_tile/16] (`_e4m3_x1024`: 1024 x the E4M3 value, exact) @ E [K_tile/16, K_tile/8] with
  E[b, j] = (j // 2 == b) * 2^107, one non-zero product per sum, so exact: the scale x 2^117, in the layout the
  words are read in. Code (2 significant bits) x scale (4) is exact in bf16; the tile is the weight x 2^-9,
  undone with scale_2 on the float32 accumulator, which is rounded to the output dtype once.
  E4M3 NaN bytes (0x7F, 0xFF) decode as 480, not NaN: the loader refuses NaN scales (`check_scales`).
- One warpgroup per CTA, a grid over (N / tile_n, M_padded / tile_m, split_k), K pipelined by
  `plgpu.emit_pipeline` (TMA copies up to `max_concurrent_steps` ahead, fewer where shared memory runs out:
  `pipeline_depth`). Warpgroup lowering semantics: Mosaic infers register layouts and shared-memory tilings/swizzles.

Tile sizes come from `TILINGS`, keyed by `device.device_kind`, with `FALLBACK` for unmeasured devices.
Constraints: N % tile_n == 0 (tile_n 64 or 128), K % tile_k == 0 (tile_k 256 or 512: the scale block's TMA
row must be >= 16 bytes and the expansion WGMMA needs K_tile/16 % 16 == 0), x bf16; M is padded to tile_m.
Pallas's interpret mode (CPU) runs no PTX: there `_decode_interpreted` gives the same tile with jax ops, and the
PTX itself is checked by a NumPy model of its instructions (tests/test_mosaic_gemm.py) and on the GPU.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._gpu import k_splits, kernel_params, sm_count
from .._shapes import ceil_div, round_up
from ._reference import BLOCK


@dataclasses.dataclass(frozen=True)
class Tiling:
    """tile_n: weight rows per CTA (WGMMA M, 64 or 128); tile_k: K per pipeline step (256 or 512);
    max_concurrent_steps: pipeline depth (TMA copies in flight); split_k: CTAs sharing one output tile's K range
    (their float32 partial sums are added by XLA), 0 = enough to give every SM a CTA (`split_for`)."""

    tile_n: int = 64
    tile_k: int = 256
    max_concurrent_steps: int = 4
    split_k: int = 0


FALLBACK = Tiling()
TILINGS: dict[str, Tiling] = {}  # device_kind -> Tiling, filled from H200 measurements (benchmarks/packed_gemm.py)
# WGMMA N: x's rows per CTA; M above 128 spans several CTAs (a 256-row x tile leaves no room for 2 pipeline steps)
TILE_M = (16, 32, 64, 128)
SMEM_BYTES = 227 * 1024  # Hopper's shared memory per CTA (sm_90: 227 KiB usable)
# E's entries: _e4m3_x1024's 1024 x scale, times 2^107, is the scale x 2^117 that `_decode_registers` multiplies the
# codes' bf16 bits (E2M1 value x 2^-126) by: the weight x 2^-9, undone with scale_2.
_EXPAND = 2.0**107


def tiling_for(device: Any = None) -> Tiling:
    """The tiling measured for `device` (default: the first device), else `FALLBACK`."""
    kind = (device or jax.devices()[0]).device_kind
    return TILINGS.get(kind, FALLBACK)


def tile_m_for(m: int) -> int:
    """The WGMMA N (columns of x^T per CTA) for M rows: the smallest tile that holds M, at most 128."""
    return next((t for t in TILE_M if t >= m), TILE_M[-1])


def split_for(tiling: Tiling, n: int, m: int, k: int, sms: int) -> int:
    """How many CTAs share each output tile's K range: `tiling.split_k`, or (0) `k_splits`'s rule over the
    output tiles (8B-b16's k_proj is 16 tiles of 64 rows: without a split most SMs would idle)."""
    if tiling.split_k:
        return tiling.split_k
    return k_splits(k // tiling.tile_k, n // tiling.tile_n * ceil_div(m, tile_m_for(m)), sms)


def pipeline_depth(tiling: Tiling, tile_m: int, out_dtype: Any) -> int:
    """Pipeline steps in flight: the tiling's, or fewer where a step's buffers (code bytes, scale bytes, x^T) would
    not fit beside the fixed ones (the bf16 scales, E, the output tile)."""
    tn, tk = tiling.tile_n, tiling.tile_k
    step = tn * tk // 2 + tn * tk // BLOCK + tk * tile_m * 2  # code bytes, scale bytes, x^T
    fixed = tn * (tk // BLOCK) * 2 + (tk // BLOCK) * (tk // 8) * 2 \
        + tn * tile_m * jnp.dtype(out_dtype).itemsize + 1024  # bf16 scales, E, the output tile; barriers, alignment
    return max(0, min(tiling.max_concurrent_steps, (SMEM_BYTES - fixed) // step))


def check_shapes(m: int, n: int, k: int, x_dtype: Any, tiling: Tiling) -> None:
    """Raise ValueError naming the argument for a shape or dtype the kernel does not take."""
    if jnp.dtype(x_dtype) != jnp.bfloat16:
        raise ValueError(f"nvfp4 mosaic matmul: x must be bfloat16, got {jnp.dtype(x_dtype).name}")
    if tiling.tile_n not in (64, 128) or tiling.tile_k not in (256, 512):
        raise ValueError(f"nvfp4 mosaic matmul: tiling {tiling} (tile_n 64 or 128, tile_k 256 or 512)")
    if m < 1:
        raise ValueError(f"nvfp4 mosaic matmul: x has {m} rows")
    if n % tiling.tile_n:
        raise ValueError(f"nvfp4 mosaic matmul: the weight's N = {n} is not a multiple of {tiling.tile_n}")
    if k % tiling.tile_k:
        raise ValueError(f"nvfp4 mosaic matmul: the weight's K = {k} is not a multiple of {tiling.tile_k}")
    if tiling.split_k and (k // tiling.tile_k) % tiling.split_k:
        raise ValueError(f"nvfp4 mosaic matmul: split_k = {tiling.split_k} does not divide K's "
                         f"{k // tiling.tile_k} steps of {tiling.tile_k}")
    if pipeline_depth(tiling, tile_m_for(m), jnp.float32) < 1:
        raise ValueError(f"nvfp4 mosaic matmul: tiling {tiling} does not fit in shared memory at M = {m}")


def _e4m3_x1024(byte: jax.Array) -> jax.Array:
    """int32 E4M3 bytes -> 1024 x their value, int32 (bias 7; the subnormals m * 2^-9 included)."""
    e = (byte >> 3) & 15
    magnitude = ((byte & 7) | (jnp.minimum(e, 1) << 3)) << jnp.maximum(e, 1)
    return jnp.where(byte >= 128, 0 - magnitude, magnitude)


def expansion_matrix(tile_k: int) -> np.ndarray:
    """E [tile_k/16, tile_k/8] bf16: E[b, j] = 2^107 where code word j (8 codes) lies in scale block b, else 0."""
    words = np.arange(tile_k // 8) // (BLOCK // 8)
    return ((np.arange(tile_k // BLOCK)[:, None] == words[None, :]) * _EXPAND).astype(jnp.bfloat16)


def column_order(k: int) -> np.ndarray:
    """The K index each column of the kernel's decoded weight tile holds: `[k]` int, a permutation of range(k).

    Within each 64 columns, column c = 8 (4 e + p) + 2 t + h holds code k = 16 t + 8 e + 4 h + p: a thread of lane
    t % 4 holds (Mosaic's WGMMA layout) the u32 code words 8 g + 2 t + e of its rows, and nibbles p and p + 4 of a
    word become one 32-bit register (a bf16 pair) of the tile's column group 8 g + 4 e + p."""
    t, e, h, p = np.meshgrid(np.arange(4), np.arange(2), np.arange(2), np.arange(4), indexing="ij")
    by_column = np.empty(64, np.int64)
    by_column[(8 * (4 * e + p) + 2 * t + h).ravel()] = (16 * t + 8 * e + 4 * h + p).ravel()
    return (np.arange(0, k, 64)[:, None] + by_column[None, :]).ravel()


_PTX_PAIR = """{{
.reg .b32 m, t;
{mag_shift}
and.b32 m, m, 0x01C001C0;
mul.rn.bf16x2 m, m, $2;
{sign_shift}
lop3.b32 $0, m, t, 0x80008000, 0x78;
}}"""


def _ptx_pair(p: int) -> str:
    """PTX: u32 word $1, bf16 scale pair $2 -> bf16 pair (nibble p, nibble p + 4) x scale; lop3 0x78 is
    a ^ (b & c): the product's sign flipped by the code's sign bit."""
    mag = f"shl.b32 m, $1, {6 - 4 * p};" if p < 2 else f"shr.b32 m, $1, {4 * p - 6};"
    sign = f"shl.b32 t, $1, {12 - 4 * p};" if p < 3 else "mov.b32 t, $1;"
    return _PTX_PAIR.format(mag_shift=mag, sign_shift=sign)


def _decode_registers(ctx, codes, word_scale):
    """Mosaic GPU (lane level): code bytes [tn, tk/2] in the WGMMA_UPCAST_4X layout (a thread's register: 8
    consecutive bytes, u32 words 8 g + 2 t and 8 g + 2 t + 1 of its row) and each word's block scale x 2^117
    (f32 [tn, tk/8], the WGMMA layout: the same threads and rows) -> the weight tile x 2^-9, bf16 [tn, tk] in the
    WGMMA layout, columns in `column_order`. Exact: a code (2 significant bits) x an E4M3 scale (4) fits bf16."""
    del ctx
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import llvm, vector
    from jax.experimental.mosaic import gpu as mgpu
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    i32 = ir.IntegerType.get_signless(32)
    pair = ir.VectorType.get((2,), ir.BF16Type.get())
    tn, half_k = codes.shape
    out = np.empty(fa.WGMMA_LAYOUT.registers_shape((tn, 2 * half_k)), dtype=object)
    for index, eight_bytes in np.ndenumerate(codes.registers):  # vector<8 x i8>: words 8 g + 2 t + {0, 1}
        word_pair = vector.bitcast(ir.VectorType.get((2,), i32), eight_bytes)
        scale = vector.extract(word_scale.registers[index], [], [0])  # both words share a block's scale
        scale_pair = cast(ir.Value, llvm.inline_asm(i32, [scale], "cvt.rn.bf16x2.f32 $0, $1, $1;", "=r,f"))
        for e in range(2):
            word = vector.extract(word_pair, [], [e])
            for p in range(4):
                bits = cast(ir.Value, llvm.inline_asm(i32, [word, scale_pair], _ptx_pair(p), "=r,r,r"))
                out[(index[0], 8 * index[1] + 4 * e + p, *index[2:])] = mgpu_utils.bitcast(bits, pair)
    return mgpu.FragmentedArray(_registers=out, _layout=fa.WGMMA_LAYOUT, _is_signed=None)


def _decode_interpreted(codes: jax.Array, word_scale: jax.Array) -> jax.Array:
    """`_decode_registers`'s result with jax ops (Pallas's interpret mode runs no PTX): codes [tn, tk/2] u8,
    word_scale [tn, tk/8] f32 -> bf16 [tn, tk] in `column_order`."""
    tn, words_per_row = word_scale.shape
    nibbles = jnp.stack([codes & 15, codes >> 4], axis=-1).astype(jnp.int32)  # [tn, tk/2, 2]
    nibbles = nibbles.reshape(tn, words_per_row, 8)  # [tn, tk/8, 8], k order
    e, m = (nibbles >> 1) & 3, (nibbles & 1).astype(jnp.float32)
    magnitude = jnp.where(e == 0, 0.5 * m, (1 + 0.5 * m) * (1 << e).astype(jnp.float32) * 0.5)
    value = jnp.where(nibbles >= 8, -magnitude, magnitude) * (word_scale[:, :, None] * 2.0**-126)
    # [tn, g, t, e, h, p] (k order) -> [tn, g, e, p, t, h] (column order)
    value = value.reshape(tn, words_per_row // 8, 4, 2, 2, 4).transpose(0, 1, 3, 5, 2, 4)
    return value.reshape(tn, 8 * words_per_row).astype(jnp.bfloat16)


def _gemm_kernel(codes_gmem, scale_gmem, xt_gmem, expand_gmem, scale_2_gmem, out_gmem,
                 s_smem, expand_smem, out_smem, barrier, *w_smem, tiling: Tiling, tile_m: int, depth: int,
                 interpret: bool):
    """One CTA: out^T[split, n tile, m tile] = sum over the split's K range of W tile @ x^T tile, times scale_2."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    tn, tk = tiling.tile_n, tiling.tile_k
    ni, mi, si = lax.axis_index("n"), lax.axis_index("m"), lax.axis_index("s")
    k_steps = codes_gmem.shape[1] * 2 // tk // out_gmem.shape[0]  # this CTA's steps
    plgpu.copy_gmem_to_smem(expand_gmem, expand_smem, barrier)  # E, once per CTA
    plgpu.barrier_wait(barrier)
    def in_layout(a, layout):  # the register layout Mosaic gives `a`; the interpreter has none
        return a if interpret else plgpu.layout_cast(a, layout)

    if interpret:  # the interpreter's WGMMA reads its left operand from shared memory only
        def decode(codes, word_scale):
            w_smem[0][...] = _decode_interpreted(codes, word_scale)
            return w_smem[0]
    else:
        decode = plgpu.inline_mgpu(
            arg_types=(plgpu.Layout.WGMMA_UPCAST_4X, plgpu.Layout.WGMMA),
            return_type=plgpu.ShapeDtypeStruct((tn, tk), jnp.bfloat16, layout=plgpu.Layout.WGMMA),
        )(_decode_registers)

    def step(_, codes_smem, scale_smem, xt_smem, acc_ref):
        # Block scales -> bf16 [tn, tk/16] in shared memory (1024 x value: exact in bf16, <= 4 significant bits).
        scales = _e4m3_x1024(scale_smem[...].astype(jnp.int32))  # [tn, tk/16]
        s_smem[...] = in_layout(scales.astype(jnp.float32).astype(jnp.bfloat16), plgpu.Layout.WGMMA)
        plgpu.commit_smem()

        def expand(acc_s):  # [tn, tk/16] @ E [tk/16, tk/8] -> each code word's block scale x 2^117, f32
            plgpu.wgmma(acc_s, s_smem, expand_smem)
            plgpu.wgmma_wait(0)  # also the previous step's product, whose registers `decode` rewrites
            return acc_s[...]

        word_scale = pl.run_scoped(expand, plgpu.ACC((tn, tk // 8), jnp.float32))  # [tn, tk/8]
        codes = in_layout(codes_smem[...], plgpu.Layout.WGMMA_UPCAST_4X)  # [tn, tk/2] u8, 8 bytes a register
        w = decode(codes, word_scale)  # [tn, tk] bf16, x 2^-9, columns in column_order
        plgpu.wgmma(acc_ref, w, xt_smem)  # [tn, tk] @ [tk, tile_m]
        if not overlap:  # the pipeline refills this step's x^T buffer next
            plgpu.wgmma_wait(0)

    # With 2 or more steps in flight, a step's product runs on while the next step decodes: x^T's buffer is
    # released one step late (`delay_release`), after the next step's wgmma_wait(0). With 1, K has 1 step.
    concurrent = min(depth, k_steps)
    overlap = concurrent >= 2

    def accumulate(acc_ref):
        pipeline = plgpu.emit_pipeline(
            functools.partial(_with_acc, step, acc_ref),
            grid=(k_steps,),
            in_specs=[
                plgpu.BlockSpec((tn, tk // 2), lambda k: (ni, si * k_steps + k)),  # code bytes
                plgpu.BlockSpec((tn, tk // BLOCK), lambda k: (ni, si * k_steps + k)),  # scale bytes
                plgpu.BlockSpec((tk, tile_m), lambda k: (si * k_steps + k, mi),  # x^T, rows in column_order
                                delay_release=int(overlap)),
            ],
            max_concurrent_steps=concurrent,
        )
        pipeline(codes_gmem, scale_gmem, xt_gmem)
        plgpu.wgmma_wait(0)
        return acc_ref[...]

    acc = pl.run_scoped(accumulate, plgpu.ACC((tn, tile_m), jnp.float32))  # [tn, tile_m]
    out_smem[...] = (acc * scale_2_gmem[0]).astype(out_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[si, pl.ds(ni * tn, tn), pl.ds(mi * tile_m, tile_m)])
    plgpu.wait_smem_to_gmem(0)


def _with_acc(step, acc_ref, indices, *refs):
    return step(indices, *refs, acc_ref)


def permute_x(x: jax.Array, tile_m: int) -> jax.Array:
    """x [M, K] -> x^T [K, M padded to tile_m], rows in `column_order` (the decoded weight tile's columns)."""
    m, k = x.shape
    m_pad = round_up(m, tile_m)
    x = jnp.pad(x, ((0, m_pad - m), (0, 0)))
    # [M, K/64, t, e, h, p] -> [K/64, e, p, t, h, M]: column 8 (4 e + p) + 2 t + h holds k 16 t + 8 e + 4 h + p
    return x.reshape(m_pad, k // 64, 4, 2, 2, 4).transpose(1, 3, 5, 2, 4, 0).reshape(k, m_pad)


@functools.partial(jax.jit, static_argnames=("out_dtype", "tiling", "interpret"))
def mosaic_matmul(x: jax.Array, codes: jax.Array, scale: jax.Array, scale_2: jax.Array, *,
                  out_dtype: Any = jnp.bfloat16, tiling: Tiling | None = None, interpret: bool = False) -> jax.Array:
    """`x [M, K] bf16 @ W.T -> [M, N] out_dtype` for W packed NVFP4 (codes u8 [N, K/2], scale float8_e4m3fn or its
    uint8 bits [N, K/16], scale_2 f32 []). `interpret=True` runs Pallas's GPU interpreter (on a CPU)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    tiling = tiling or tiling_for()
    (m, k), n = x.shape, codes.shape[0]
    check_shapes(m, n, k, x.dtype, tiling)
    tile_m = tile_m_for(m)
    xt = permute_x(x, tile_m)  # [K, M_pad]
    m_pad = xt.shape[1]
    if scale.dtype != jnp.uint8:
        scale = lax.bitcast_convert_type(scale, jnp.uint8)
    expand = jnp.asarray(expansion_matrix(tiling.tile_k))
    splits = split_for(tiling, n, m, k, sm_count())
    part_dtype = jnp.dtype(out_dtype) if splits == 1 else jnp.dtype(jnp.float32)  # partial sums stay f32
    kernel = plgpu.kernel(
        functools.partial(_gemm_kernel, tiling=tiling, tile_m=tile_m, interpret=interpret,
                          depth=pipeline_depth(tiling, tile_m, part_dtype)),
        out_type=jax.ShapeDtypeStruct((splits, n, m_pad), part_dtype),
        grid=(n // tiling.tile_n, m_pad // tile_m, splits),
        grid_names=("n", "m", "s"),
        scratch_types=[
            plgpu.SMEM((tiling.tile_n, tiling.tile_k // BLOCK), jnp.bfloat16),  # block scales
            plgpu.SMEM((tiling.tile_k // BLOCK, tiling.tile_k // 8), jnp.bfloat16),  # E
            plgpu.SMEM((tiling.tile_n, tile_m), part_dtype),  # the output tile
            plgpu.Barrier(num_arrivals=1),  # E's copy
            *([plgpu.SMEM((tiling.tile_n, tiling.tile_k), jnp.bfloat16)] if interpret else []),  # the tile
        ],
        **kernel_params(interpret),
    )
    # The decoded tile is the weight x 2^-9 (`_decode_registers`), undone with scale_2.
    out_t = kernel(codes, scale, xt, expand, (scale_2.astype(jnp.float32) * 2.0**9).reshape(1))  # [splits, N, M_pad]
    out_t = out_t[0] if splits == 1 else out_t.sum(0)  # [N, M_pad]
    return out_t[:, :m].T.astype(out_dtype)


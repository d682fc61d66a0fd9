"""The packed NVFP4 weight-only GEMM on Hopper: a Pallas Mosaic GPU kernel (`jax.experimental.pallas.mosaic_gpu`).

    mosaic_matmul(x [M, K] bf16, codes [N, K/2] u8, scale [N, K/16] e4m3, scale_2 f32 []) -> x @ W.T  [M, N]

Why this shape of kernel (NVIDIA's PTX ISA, "Asynchronous Warpgroup Level Matrix Multiply-Accumulate"):
- WGMMA's left operand has 64-row tiles and its right operand 8..256 columns, so with M = batch x block rows
  (16-512) the weight must be the left operand: the kernel computes out^T [N, M] = W [N, K] @ x^T [K, M], and
  XLA transposes the small result back.
- The decode is the kernel's cost (decoding one code at a time in float32 took more than half of a product's time:
  docs/benchmarks.md, Decisions), so it works on packed words: the codes are read as u16 pairs of bytes in Mosaic's
  WGMMA_UPCAST_4X layout, so that a thread's register holds 16 consecutive code bytes of one row (32 codes: two
  whole scale blocks), and each of its four u32 words (8 codes, k = 8j .. 8j + 7, nibble i = code 8j + i) becomes
  4 registers of bf16 pairs by inline PTX (`plgpu.inline_mgpu`): nibbles p and p + 4 shifted into one pair's
  halves and masked (their exponent and mantissa bits land in bf16's exponent LSBs and mantissa MSB: the E2M1
  value x 2^-126, code 0.5 a bf16 subnormal), one `mul.rn.bf16x2` by the block scale, the sign bits XORed in
  (`_ptx_pair`: 5 instructions for 2 weights). The pairs go to the WGMMA as its register operand, never through
  shared memory.
- The scale bytes are read in the WGMMA layout, where a thread holds 2 consecutive bytes of its rows: exactly the
  scales of its two code blocks. They are decoded with jax ops in registers (`_e4m3_x1024`, times 2^107: the scale
  x 2^117, exact), with no trip through shared memory and no extra WGMMA; a step loads its codes and scales
  while the previous step's product is still in the tensor cores.
- Which K a register column holds follows from the two layouts (a thread holds u16 elements 32 g + 8 t .. + 7 of
  its rows, t its lane % 4): `column_order`. x^T is laid out in that order by XLA (`permute_x`, x is small beside
  the weight), so the sum pairs each code with its own x.
- Code (2 significant bits) x scale (4) is exact in bf16; the tile is the weight x 2^-9, undone with scale_2 on
  the float32 accumulator, which is rounded to the output dtype once.
  E4M3 NaN bytes (0x7F, 0xFF) decode as 480, not NaN: the loader refuses NaN scales (`check_scales`).
- One warpgroup per CTA, a grid over (N / tile_n, M_padded / tile_m, split_k), K pipelined by
  `plgpu.emit_pipeline` (TMA copies up to `max_concurrent_steps` ahead, fewer where shared memory runs out:
  `pipeline_depth`). Warpgroup lowering semantics: Mosaic infers register layouts and shared-memory tilings/swizzles.

Tile sizes come from the device kind's tuning entry (`tuning.Tuning.nvfp4_gemm`, a `tuning.GemmTiling`).
Constraints: N % tile_n == 0 (tile_n 64 or 128), K % tile_k == 0 (tile_k 256 or 512: the scale block's TMA
row must be >= 16 bytes), x bf16; M is padded to tile_m.
Pallas's interpret mode (CPU) runs no PTX: there `_decode_interpreted` gives the same tile with jax ops, and the
PTX itself is checked by a NumPy model of its instructions (tests/_ptx.py, run by tests/test_mosaic_gemm.py) and on
the GPU.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._gpu import k_splits, kernel_params
from .._jax_compat import fragmented_array, mlir
from .._shapes import ceil_div, round_up
from ..platform import process_platform
from ..tuning import GemmTiling
from ._reference import BLOCK

# WGMMA N: x's rows per CTA; M above 128 spans several CTAs (a 256-row x tile leaves no room for 2 pipeline steps)
TILE_M = (16, 32, 64, 128)
SMEM_BYTES = 227 * 1024  # Hopper's shared memory per CTA (sm_90: 227 KiB usable)
# _e4m3_x1024's 1024 x scale, times 2^107, is the scale x 2^117 that `_decode_registers` multiplies the codes' bf16
# bits (E2M1 value x 2^-126) by: the weight x 2^-9, undone with scale_2.
_SCALE_SHIFT = 2.0**107


def tile_m_for(m: int) -> int:
    """The WGMMA N (columns of x^T per CTA) for M rows: the smallest tile that holds M, at most 128."""
    return next((t for t in TILE_M if t >= m), TILE_M[-1])


def split_for(tiling: GemmTiling, n: int, m: int, k: int, sms: int) -> int:
    """How many CTAs share each output tile's K range: `tiling.split_k`, or (0) `k_splits`'s rule over the
    output tiles (8B-b16's k_proj is 16 tiles of 64 rows: without a split most SMs would idle)."""
    if tiling.split_k:
        return tiling.split_k
    return k_splits(k // tiling.tile_k, n // tiling.tile_n * ceil_div(m, tile_m_for(m)), sms)


def pipeline_depth(tiling: GemmTiling, tile_m: int, out_dtype: Any) -> int:
    """Pipeline steps in flight: the tiling's, or fewer where a step's buffers (code bytes, scale bytes, x^T) would
    not fit beside the output tile."""
    tn, tk = tiling.tile_n, tiling.tile_k
    step = tn * tk // 2 + tn * tk // BLOCK + tk * tile_m * 2  # code bytes, scale bytes, x^T
    fixed = tn * tile_m * jnp.dtype(out_dtype).itemsize + 1024  # the output tile; barriers, alignment
    return max(0, min(tiling.max_concurrent_steps, (SMEM_BYTES - fixed) // step))


def check_shapes(m: int, n: int, k: int, x_dtype: Any, tiling: GemmTiling) -> None:
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


def column_order(k: int) -> np.ndarray:
    """The K index each column of the kernel's decoded weight tile holds: `[k]` int, a permutation of range(k).

    Within each 128 columns, column c = 8 (4 w + p) + 2 t + h holds code k = 32 t + 8 w + 4 h + p: a thread of lane
    t % 4 holds (Mosaic's WGMMA_UPCAST_4X layout of u16 pairs of code bytes) the u32 code words 16 g + 4 t + w of its
    rows, and nibbles p and p + 4 of a word become one 32-bit register (a bf16 pair) of the tile's column group
    16 g + 4 w + p."""
    t, w, h, p = np.meshgrid(np.arange(4), np.arange(4), np.arange(2), np.arange(4), indexing="ij")
    by_column = np.empty(128, np.int64)
    by_column[(8 * (4 * w + p) + 2 * t + h).ravel()] = (32 * t + 8 * w + 4 * h + p).ravel()
    return (np.arange(0, k, 128)[:, None] + by_column[None, :]).ravel()


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


def _decode_registers(ctx, codes, block_scale):
    """Mosaic GPU (lane level): code bytes as u16 pairs [tn, tk/4] in the WGMMA_UPCAST_4X layout (a thread's
    register: 16 consecutive bytes, u32 words 16 g + 4 t + w of its row, w < 4) and each block's scale x 2^117
    (f32 [tn, tk/16], the WGMMA layout: a register holds blocks 8 g + 2 t and 8 g + 2 t + 1, the same threads and
    rows) -> the weight tile x 2^-9, bf16 [tn, tk] in the WGMMA layout, columns in `column_order`. Exact: a code (2
    significant bits) x an E4M3 scale (4) fits bf16."""
    del ctx
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    ir, _, llvm, vector = mlir()

    i32 = ir.IntegerType.get_signless(32)
    pair = ir.VectorType.get((2,), ir.BF16Type.get())
    tn, quarter_k = codes.shape
    out = np.empty(fa.WGMMA_LAYOUT.registers_shape((tn, 4 * quarter_k)), dtype=object)
    for index, sixteen_bytes in np.ndenumerate(codes.registers):  # vector<8 x i16>: words 16 g + 4 t + {0..3}
        words = vector.bitcast(ir.VectorType.get((4,), i32), sixteen_bytes)
        for block in range(2):  # words 2 block, 2 block + 1 lie in scale block 8 g + 2 t + block
            scale = vector.extract(block_scale.registers[index], [], [block])
            scale_pair = llvm.inline_asm(i32, [scale], "cvt.rn.bf16x2.f32 $0, $1, $1;", "=r,f")
            for w in (2 * block, 2 * block + 1):
                word = vector.extract(words, [], [w])
                for p in range(4):
                    bits = llvm.inline_asm(i32, [word, scale_pair], _ptx_pair(p), "=r,r,r")
                    out[(index[0], 16 * index[1] + 4 * w + p, *index[2:])] = mgpu_utils.bitcast(bits, pair)
    return fragmented_array(out, fa.WGMMA_LAYOUT, is_signed=None)


def _decode_interpreted(codes: jax.Array, block_scale: jax.Array) -> jax.Array:
    """`_decode_registers`'s result with jax ops (Pallas's interpret mode runs no PTX): codes [tn, tk/4] u16 (pairs
    of code bytes), block_scale [tn, tk/16] f32 (x 2^117) -> bf16 [tn, tk] in `column_order`."""
    tn, blocks = block_scale.shape
    code_bytes = lax.bitcast_convert_type(codes, jnp.uint8).reshape(tn, 8 * blocks)  # little-endian: low byte first
    nibbles = jnp.stack([code_bytes & 15, code_bytes >> 4], axis=-1).astype(jnp.int32)  # [tn, tk/2, 2]
    nibbles = nibbles.reshape(tn, blocks, BLOCK)  # [tn, tk/16, 16], k order
    e, m = (nibbles >> 1) & 3, (nibbles & 1).astype(jnp.float32)
    magnitude = jnp.where(e == 0, 0.5 * m, (1 + 0.5 * m) * (1 << e).astype(jnp.float32) * 0.5)
    value = jnp.where(nibbles >= 8, -magnitude, magnitude) * (block_scale[:, :, None] * 2.0**-126)
    # [tn, g, t, w, h, p] (k order) -> [tn, g, w, p, t, h] (column order)
    value = value.reshape(tn, blocks // 8, 4, 4, 2, 4).transpose(0, 1, 3, 5, 2, 4)
    return value.reshape(tn, BLOCK * blocks).astype(jnp.bfloat16)


def _gemm_kernel(codes_gmem, scale_gmem, xt_gmem, scale_2_gmem, out_gmem, out_smem, *w_smem, tiling: GemmTiling,
                 tile_m: int, depth: int, interpret: bool):
    """One CTA: out^T[split, n tile, m tile] = sum over the split's K range of W tile @ x^T tile, times scale_2."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    tn, tk = tiling.tile_n, tiling.tile_k
    ni, mi, si = lax.axis_index("n"), lax.axis_index("m"), lax.axis_index("s")
    k_steps = codes_gmem.shape[1] * 4 // tk // out_gmem.shape[0]  # this CTA's steps

    def in_layout(a, layout):  # the register layout Mosaic gives `a`; the interpreter has none
        return a if interpret else plgpu.layout_cast(a, layout)

    if interpret:  # the interpreter's WGMMA reads its left operand from shared memory only
        def decode(codes, block_scale):
            w_smem[0][...] = _decode_interpreted(codes, block_scale)
            return w_smem[0]
    else:
        decode = plgpu.inline_mgpu(
            arg_types=(plgpu.Layout.WGMMA_UPCAST_4X, plgpu.Layout.WGMMA),
            return_type=plgpu.ShapeDtypeStruct((tn, tk), jnp.bfloat16, layout=plgpu.Layout.WGMMA),
        )(_decode_registers)

    def step(_, codes_smem, scale_smem, xt_smem, acc_ref):
        scale_bytes = in_layout(scale_smem[...], plgpu.Layout.WGMMA).astype(jnp.int32)  # [tn, tk/16]
        block_scale = _e4m3_x1024(scale_bytes).astype(jnp.float32) * _SCALE_SHIFT  # the scale x 2^117, exact
        codes = in_layout(codes_smem[...], plgpu.Layout.WGMMA_UPCAST_4X)  # [tn, tk/4] u16, 16 bytes a register
        # The previous step's product must end before the decode writes its tile: PTX leaves a register operand
        # written before its wgmma.wait_group undefined (decoding during it gave wrong sums on an H100 where the
        # pipeline loop had 4 steps). Its x^T buffer is released after this step.
        plgpu.wgmma_wait(0)
        w = decode(codes, block_scale)  # [tn, tk] bf16, x 2^-9, columns in column_order
        plgpu.wgmma(acc_ref, w, xt_smem)  # [tn, tk] @ [tk, tile_m]
        if not overlap:  # the pipeline refills this step's x^T buffer next
            plgpu.wgmma_wait(0)

    # With 2 or more steps in flight, a step's product runs on while the next step loads its codes and scales: x^T's
    # buffer is released one step late (`delay_release`), after the next step's wgmma_wait(0). With 1, K has 1 step.
    concurrent = min(depth, k_steps)
    overlap = concurrent >= 2

    def accumulate(acc_ref):
        pipeline = plgpu.emit_pipeline(
            functools.partial(_with_acc, step, acc_ref),
            grid=(k_steps,),
            in_specs=[
                plgpu.BlockSpec((tn, tk // 4), lambda k: (ni, si * k_steps + k)),  # code bytes, u16 pairs
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
    # [M, K/128, t, w, h, p] -> [K/128, w, p, t, h, M]: column 8 (4 w + p) + 2 t + h holds k 32 t + 8 w + 4 h + p
    return x.reshape(m_pad, k // 128, 4, 4, 2, 4).transpose(1, 3, 5, 2, 4, 0).reshape(k, m_pad)


@functools.partial(jax.jit, static_argnames=("out_dtype", "tiling", "sms", "interpret"))
def mosaic_matmul(x: jax.Array, codes: jax.Array, scale: jax.Array, scale_2: jax.Array, *,
                  out_dtype: Any = jnp.bfloat16, tiling: GemmTiling | None = None, sms: int | None = None,
                  interpret: bool = False) -> jax.Array:
    """`x [M, K] bf16 @ W.T -> [M, N] out_dtype` for W packed NVFP4 (codes u8 [N, K/2], scale float8_e4m3fn or its
    uint8 bits [N, K/16], scale_2 f32 []). `tiling` and `sms` (the GPU's streaming multiprocessors, which the K
    split fills) default to `platform.process_platform()`'s; `interpret=True` runs Pallas's GPU interpreter (on a
    CPU)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    tiling = tiling or process_platform().tuning.nvfp4_gemm
    (m, k), n = x.shape, codes.shape[0]
    check_shapes(m, n, k, x.dtype, tiling)
    tile_m = tile_m_for(m)
    xt = permute_x(x, tile_m)  # [K, M_pad]
    m_pad = xt.shape[1]
    if scale.dtype != jnp.uint8:
        scale = lax.bitcast_convert_type(scale, jnp.uint8)
    code_pairs = lax.bitcast_convert_type(codes.reshape(n, k // 4, 2), jnp.uint16)  # [N, K/4]: a bitcast
    splits = split_for(tiling, n, m, k, sms or process_platform().sm_count)
    part_dtype = jnp.dtype(out_dtype) if splits == 1 else jnp.dtype(jnp.float32)  # partial sums stay f32
    kernel = plgpu.kernel(
        functools.partial(_gemm_kernel, tiling=tiling, tile_m=tile_m, interpret=interpret,
                          depth=pipeline_depth(tiling, tile_m, part_dtype)),
        out_type=jax.ShapeDtypeStruct((splits, n, m_pad), part_dtype),
        grid=(n // tiling.tile_n, m_pad // tile_m, splits),
        grid_names=("n", "m", "s"),
        scratch_types=[
            plgpu.SMEM((tiling.tile_n, tile_m), part_dtype),  # the output tile
            *([plgpu.SMEM((tiling.tile_n, tiling.tile_k), jnp.bfloat16)] if interpret else []),  # the tile
        ],
        **kernel_params(interpret),
    )
    # The decoded tile is the weight x 2^-9 (`_decode_registers`), undone with scale_2.
    out_t = kernel(code_pairs, scale, xt, (scale_2.astype(jnp.float32) * 2.0**9).reshape(1))  # [splits, N, M_pad]
    out_t = out_t[0] if splits == 1 else out_t.sum(0)  # [N, M_pad]
    return out_t[:, :m].T.astype(out_dtype)


"""NVFP4 -> bf16/f16 dequantization as a Pallas Mosaic GPU kernel, for the H100/H200.

The tensor is flattened to a list of 16-value blocks, 8 packed bytes and one E4M3 scale byte each; one CTA (one
warpgroup) decodes `tile` consecutive blocks (`tuning.Tuning.nvfp4_tile`): TMA copies the code words and the scale
bytes GMEM -> SMEM, each thread reads whole blocks back (Mosaic's strided register layout: thread t holds blocks t,
t + 128, ..., its two code words and its scale), decodes them in registers, writes the output words to SMEM, and
TMA copies them to GMEM. The last CTA's tile is shifted back to end at the last block (it rewrites some of its
neighbour's words with the same values), so no copy runs past an edge.

One output word per packed byte: byte j holds codes 2j (low nibble) and 2j+1 (high nibble); the kernel writes
both 16-bit results into one u32, low half = element 2j, and the u32 array is bitcast to `[..., K]` outside the
kernel (little-endian; XLA makes it a bitcast).

The decode is inline PTX (`_ptx_word`, one output word from one code word): the jax-op decode it replaced (an f16
per code, then a bf16 per value) spent two conversions a value, which Hopper runs at a quarter of its f32 rate, where
this spends half of one (1.13-1.19x faster on large tensors: docs/benchmarks.md). A code's magnitude comes from a
byte table (`prmt`) as the f32 8 + |value| (`_LUT`: the magnitude's bits land in the mantissa under 8's exponent),
8 is subtracted (exact), the difference is multiplied by the block scale (f32(E4M3) x scale_2, ModelOpt's
association) and rounded once, the code's sign is XORed in, and `cvt.rn.bf16x2.f32` rounds the pair to the output
dtype: the XLA path's arithmetic, so the same bits (NaN scales give NaN in both; the loader refuses them).

JAX's GPU interpreter (`InterpretGPUParams`, jax 0.10-0.11) cannot run this kernel (it refuses reshaped refs and
runs no PTX), so the CPU tests run the PTX on a NumPy model of its instructions and lower the kernel for CUDA; the
bit-identity tests of the kernel itself are marked `gpu`.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .._jax_compat import fragmented_array, mlir
from .._shapes import round_up

BLOCK_BYTES = 8  # 16 codes share one scale
WARPGROUP = 128
_OUT_DTYPES = (jnp.bfloat16, jnp.float16)
_CVT = {jnp.dtype(jnp.bfloat16): "bf16x2", jnp.dtype(jnp.float16): "f16x2"}
# Bytes 0-7 of the table: for code c = 0..7 (|value| = n / 2, n = 0, 1, 2, 3, 4, 6, 8, 12), n << 3. Placed in byte 2
# of 0x41000000 (8.0) it is n << 19, i.e. |value| in units of 8's last mantissa bit (2^-20): the f32 8 + |value|.
_LUT = (0x18100800, 0x60403020)
_EIGHT = 0x41000000


def e4m3_to_f32(b: jax.Array) -> jax.Array:
    """float8_e4m3fn bits (u32 in [0, 255]) -> f32, exactly; 0x7F/0xFF -> NaN. Through f16 bits: the seven low bits
    shifted under an f16 exponent are the value times 2**-8 (subnormals included), undone exactly in f32."""
    f16_bits = ((b & 0x7F) << 7) | ((b & 0x80) << 8)
    value = lax.bitcast_convert_type(f16_bits.astype(jnp.uint16), jnp.float16).astype(jnp.float32) * 256.0
    return jnp.where((b & 0x7F) == 0x7F, jnp.float32(jnp.nan), value)


def _ptx_word(j: int, dtype: Any) -> str:
    """PTX: code word $1 (4 bytes, 8 codes), block scale $2 (f32 bits) -> the output word of byte j: (low nibble,
    high nibble) x scale rounded to `dtype`, low half first. lop3 0x78 is a ^ (b & c): the sign of each product
    flipped by its code's sign bit (bit 3 of the nibble)."""
    select = f"shr.b32 s, s, {8 * j};" if j else ""
    return f"""{{
.reg .b32 s, t, lo, hi;
and.b32 s, $1, 0x77777777;
{select}
mov.b32 t, {_LUT[0]:#010x};
mov.b32 lo, {_LUT[1]:#010x};
prmt.b32 t, t, lo, s;
mov.b32 s, {_EIGHT:#010x};
prmt.b32 lo, t, s, 0x7054;
prmt.b32 hi, t, s, 0x7154;
sub.f32 lo, lo, 0f{_EIGHT:08X};
sub.f32 hi, hi, 0f{_EIGHT:08X};
mul.rn.f32 lo, lo, $2;
mul.rn.f32 hi, hi, $2;
shl.b32 s, $1, {28 - 8 * j};
shl.b32 t, $1, {24 - 8 * j};
lop3.b32 lo, lo, s, 0x80000000, 0x78;
lop3.b32 hi, hi, t, 0x80000000, 0x78;
cvt.rn.{_CVT[jnp.dtype(dtype)]}.f32 $0, hi, lo;
}}"""


def _decode_registers(ctx, words, block_scale, *, dtype):
    """Mosaic GPU (lane level): code words u32 [2 tile] and block scales f32 [tile], both in the strided layout (a
    thread's register i: block 128 i + t) -> output words u32 [8 tile], strided likewise (8 words a block)."""
    del ctx
    from jax.experimental.mosaic.gpu import fragmented_array as fa

    ir, arith, llvm, vector = mlir()

    i32 = ir.IntegerType.get_signless(32)
    blocks = block_scale.shape[0]
    out = words.registers.copy()
    for index, pair in np.ndenumerate(words.registers):  # vector<2 x i32>: the block's two code words
        scale = arith.bitcast(i32, vector.extract(block_scale.registers[index], [], [0]))
        outs = [llvm.inline_asm(i32, [vector.extract(pair, [], [w]), scale], _ptx_word(j, dtype), "=r,r,r")
                for w in range(2) for j in range(4)]
        out[index] = vector.from_elements(ir.VectorType.get((8,), i32), outs)
    layout = fa.WGStridedFragLayout((8 * blocks,), 8)
    return fragmented_array(out, layout, is_signed=False)


def _kernel(w_gmem, s_gmem, g_gmem, o_gmem, w_smem, s_smem, o_smem, barriers, *, n_blocks, tile, dtype):
    # w_gmem [n_blocks/8, 16] u32 (8 blocks a row), s_gmem [n_blocks/16, 16] u8, g_gmem [1] f32 (scale_2),
    # o_gmem [n_blocks/4, 32] u32 (4 blocks a row): 2D views, as TMA boxes hold at most 256 rows
    start = jnp.minimum(lax.axis_index("tiles") * tile, n_blocks - tile)  # a multiple of 16 (`padded_blocks`)
    plgpu.copy_gmem_to_smem(w_gmem.at[pl.ds(start // 8, tile // 8)], w_smem, barriers.at[0])
    plgpu.copy_gmem_to_smem(s_gmem.at[pl.ds(start // 16, tile // 16)], s_smem, barriers.at[1])
    scale_2 = g_gmem[0]  # read from GMEM by every thread (a TMA copy would have to move 128 bytes)
    for i in range(2):
        plgpu.barrier_wait(barriers.at[i])
    # a thread's registers hold whole blocks: 2 code words, 1 scale, 8 output words a block
    codes, scales, out = (plgpu.Layout.WG_STRIDED((n * tile,), n) for n in (2, 1, 8))
    words = plgpu.layout_cast(w_smem.reshape(2 * tile)[...], codes)  # [2 tile] u32
    scale_bits = plgpu.layout_cast(s_smem.reshape(tile)[...], scales)  # [tile] u8
    block_scale = e4m3_to_f32(scale_bits.astype(jnp.uint32)) * scale_2  # [tile] f32, ModelOpt's association
    decode = plgpu.inline_mgpu(
        arg_types=(codes, scales), return_type=plgpu.ShapeDtypeStruct((8 * tile,), jnp.uint32, layout=out),
    )(functools.partial(_decode_registers, dtype=dtype))
    o_smem.reshape(8 * tile)[...] = decode(words, block_scale)  # [8 tile] u32
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[pl.ds(start // 4, tile // 4)])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # SMEM must outlive the copy's reads, not its writes


def padded_blocks(n_real: int, tile: int) -> int:
    """The blocks the kernel runs over for `n_real` real ones: a multiple of 16 and at least one tile. Every CTA's
    first block (`_kernel`'s `start`, the last one shifted back) is then a multiple of 16, so the TMA copy of its
    scale bytes starts 16-byte aligned, as TMA requires: a ragged count (4097 x 130 blocks) put it 2 bytes off and
    the H200 stopped with CUDA_ERROR_ILLEGAL_INSTRUCTION. Drafter shapes (K a multiple of 256) need no padding."""
    return max(tile, round_up(n_real, 16))


@functools.partial(jax.jit, static_argnames=("dtype", "tile"))
def dequantize_mosaic_gpu(packed: jax.Array, scale_bits: jax.Array, scale_2: jax.Array, *, tile: int,
                          dtype=jnp.bfloat16) -> jax.Array:
    """packed [..., K/2] u8, scale_bits [..., K/16] u8 (E4M3 bits), scale_2 f32 [] or [1] -> [..., K] `dtype`.

    `dtype` is bfloat16 or float16; `tile`: blocks of 16 values per CTA (128 to 1024, a multiple of 128; the device
    kind's is `tuning.Tuning.nvfp4_tile`). GPU only (Hopper or newer).
    """
    if jnp.dtype(dtype) not in map(jnp.dtype, _OUT_DTYPES):
        raise ValueError(f"the Mosaic GPU kernel writes bfloat16 or float16, not {jnp.dtype(dtype).name}")
    if tile % WARPGROUP or not WARPGROUP <= tile <= 1024:
        raise ValueError(f"tile must be a multiple of 128 blocks from 128 to 1024, got {tile}")
    *lead, half_k = packed.shape
    n_real = packed.size // BLOCK_BYTES
    n_blocks = padded_blocks(n_real, tile)
    w, s = packed.reshape(n_real, BLOCK_BYTES), scale_bits.reshape(n_real)
    if n_blocks != n_real:  # only tensors under `tile` blocks, or whose count of blocks is not a multiple of 16
        w, s = jnp.pad(w, ((0, n_blocks - n_real), (0, 0))), jnp.pad(s, (0, n_blocks - n_real))
    w = lax.bitcast_convert_type(w.reshape(n_blocks // 8, 16, 4), jnp.uint32)  # [n_blocks/8, 16]: a bitcast
    words = plgpu.kernel(
        functools.partial(_kernel, n_blocks=n_blocks, tile=tile, dtype=dtype),
        out_type=jax.ShapeDtypeStruct((n_blocks // 4, 4 * BLOCK_BYTES), jnp.uint32),
        scratch_types=[
            plgpu.SMEM((tile // 8, 16), jnp.uint32),
            plgpu.SMEM((tile // 16, 16), jnp.uint8),
            plgpu.SMEM((tile // 4, 4 * BLOCK_BYTES), jnp.uint32),
            plgpu.Barrier(num_barriers=2),
        ],
        grid=(pl.cdiv(n_blocks, tile),),
        grid_names=("tiles",),
    )(w, s.reshape(n_blocks // 16, 16), scale_2.reshape(1))
    words = words.reshape(n_blocks, BLOCK_BYTES)[:n_real]  # [n_real, 8] u32
    return lax.bitcast_convert_type(words, dtype).reshape(*lead, 2 * half_k)  # u32 -> 2 x 16 bit, low first

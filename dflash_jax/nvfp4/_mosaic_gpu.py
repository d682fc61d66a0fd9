"""NVFP4 -> bf16/f16 dequantization as a Pallas Mosaic GPU kernel, for the H100/H200.

The tensor is flattened to a list of 16-value blocks, 8 packed bytes and one E4M3 scale byte each; one CTA (one
warpgroup) decodes `tile` consecutive blocks (`tuning.Tuning.nvfp4_tile`): TMA copies the bytes (viewed `[tile/2,
16]`: TMA needs rows of 16 bytes or more) and the scale bytes GMEM -> SMEM, the bytes are read back as `[tile, 8]`
in the WGMMA register layout (a thread holds 2 bytes of a row, so a row's scale is one WGMMA row value broadcast
along it), decoded in registers, written to SMEM and copied to GMEM by TMA. The last CTA's tile is shifted back to
end at the last block (it rewrites some of its neighbour's words with the same values), so no copy runs past an edge.

One output word per packed byte: byte j holds codes 2j (low nibble) and 2j+1 (high nibble); the kernel writes
both 16-bit results into one u32, low half = element 2j, and the u32 array is bitcast to `[..., K]` outside the
kernel (little-endian; XLA makes it a bitcast). No value is interleaved in registers.

Decoding avoids float conversions that differ between backends: an E2M1 code's three magnitude bits, shifted
under an f16 exponent, are that code's value times 2**-14 (code 1, an f16 subnormal, too); an E4M3 byte's
seven low bits shifted likewise are its value times 2**-8. f16 -> f32 is exact, the power of two is undone
exactly in f32, and then value = e2m1 * (f32(scale) * scale_2) is rounded once, as in the XLA path.

JAX's GPU interpreter (`InterpretGPUParams`, jax 0.10-0.11) cannot run this kernel (it refuses reshaped refs),
so the CPU tests run `decode`, the kernel's whole arithmetic, and lower the kernel for CUDA; the bit-identity
tests of the kernel itself are marked `gpu`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .._shapes import round_up
from ..tuning import tuning

BLOCK_BYTES = 8  # 16 codes share one scale
# Blocks per CTA: 4096 values. A TMA box holds at most 256 rows, and a copy moves a multiple of 128 bytes (the
# scale bytes: at least 128 blocks).
_OUT_DTYPES = (jnp.bfloat16, jnp.float16)


def _f16_bits_to_f32(bits: jax.Array) -> jax.Array:
    """Low 16 bits of a u32 read as an f16, widened exactly to f32."""
    return lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.float16).astype(jnp.float32)


def e4m3_to_f32(b: jax.Array) -> jax.Array:
    """float8_e4m3fn bits (u32 in [0, 255]) -> f32, exactly; 0x7F/0xFF -> NaN."""
    value = _f16_bits_to_f32(((b & 0x7F) << 7) | ((b & 0x80) << 8)) * 256.0
    return jnp.where((b & 0x7F) == 0x7F, jnp.float32(jnp.nan), value)


def e2m1_to_f32(code: jax.Array) -> jax.Array:
    """E2M1 code (u32 in [0, 15]: sign bit 3, magnitude bits 0-2) -> f32, exactly."""
    return _f16_bits_to_f32(((code & 7) << 9) | ((code & 8) << 12)) * 16384.0


def to_bits(x: jax.Array, dtype) -> jax.Array:
    """f32 -> dtype (round to nearest even) -> its 16 bits in a u32."""
    return lax.bitcast_convert_type(x.astype(dtype), jnp.uint16).astype(jnp.uint32)


def decode(w: jax.Array, s: jax.Array, scale_2: jax.Array, dtype) -> jax.Array:
    """Packed bytes `w [R, ...]` u8 (a block's 8 bytes per row) with their blocks' scale bytes `s [R]` u8 and
    `scale_2` f32 [] -> `[R, ...]` u32 output words (low half: element 2j, high half: 2j + 1). What the kernel
    computes per tile, in registers."""
    block_scale = e4m3_to_f32(s.astype(jnp.uint32)) * scale_2  # [R] f32, ModelOpt's association
    block_scale = lax.broadcast_in_dim(block_scale, w.shape, (0,))  # [R, ...]
    w = w.astype(jnp.uint32)
    return to_bits(e2m1_to_f32(w & 15) * block_scale, dtype) | (to_bits(e2m1_to_f32(w >> 4) * block_scale, dtype) << 16)


def _kernel(w_gmem, s_gmem, g_gmem, o_gmem, w_smem, s_smem, o_smem, barriers, *, n_blocks, tile, dtype):
    # w_gmem [n_blocks/2, 16] u8, s_gmem [n_blocks] u8, g_gmem [1] f32 (scale_2), o_gmem [n_blocks, 8] u32
    start = jnp.minimum(lax.axis_index("tiles") * tile, n_blocks - tile)  # even: n_blocks and tile are
    plgpu.copy_gmem_to_smem(w_gmem.at[pl.ds(start // 2, tile // 2)], w_smem, barriers.at[0])
    plgpu.copy_gmem_to_smem(s_gmem.at[pl.ds(start, tile)], s_smem, barriers.at[1])
    scale_2 = g_gmem[0]  # read from GMEM by every thread (a TMA copy would have to move 128 bytes)
    for i in range(2):
        plgpu.barrier_wait(barriers.at[i])
    w = plgpu.layout_cast(w_smem.reshape(tile, BLOCK_BYTES)[...], plgpu.Layout.WGMMA)  # [tile, 8] u8
    s = plgpu.layout_cast(s_smem[...], plgpu.Layout.WGMMA.reduce(1))  # [tile] u8: one value per WGMMA row
    o_smem[...] = decode(w, s, scale_2, dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[pl.ds(start, tile)])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # SMEM must outlive the copy's reads, not its writes


def padded_blocks(n_real: int, tile: int) -> int:
    """The blocks the kernel runs over for `n_real` real ones: a multiple of 16 and at least one tile. Every CTA's
    first block (`_kernel`'s `start`, the last one shifted back) is then a multiple of 16, so the TMA copy of its
    scale bytes starts 16-byte aligned, as TMA requires: a ragged count (4097 x 130 blocks) put it 2 bytes off and
    the H200 stopped with CUDA_ERROR_ILLEGAL_INSTRUCTION. Drafter shapes (K a multiple of 256) need no padding."""
    return max(tile, round_up(n_real, 16))


@functools.partial(jax.jit, static_argnames=("dtype", "tile"))
def dequantize_mosaic_gpu(packed: jax.Array, scale_bits: jax.Array, scale_2: jax.Array, *, dtype=jnp.bfloat16,
                          tile: int | None = None) -> jax.Array:
    """packed [..., K/2] u8, scale_bits [..., K/16] u8 (E4M3 bits), scale_2 f32 [] or [1] -> [..., K] `dtype`.

    `dtype` is bfloat16 or float16; `tile` (blocks of 16 values per CTA: 128 or 256) overrides the device kind's
    (`tuning.Tuning.nvfp4_tile`). GPU only (Hopper or newer).
    """
    tile = tile or tuning().nvfp4_tile
    if jnp.dtype(dtype) not in map(jnp.dtype, _OUT_DTYPES):
        raise ValueError(f"the Mosaic GPU kernel writes bfloat16 or float16, not {jnp.dtype(dtype).name}")
    if tile not in (128, 256):
        raise ValueError(f"tile must be 128 or 256 blocks, got {tile}")
    *lead, half_k = packed.shape
    n_real = packed.size // BLOCK_BYTES
    n_blocks = padded_blocks(n_real, tile)
    w, s = packed.reshape(n_real, BLOCK_BYTES), scale_bits.reshape(n_real)
    if n_blocks != n_real:  # only tensors under 4096 values, or whose count of blocks is not a multiple of 16
        w, s = jnp.pad(w, ((0, n_blocks - n_real), (0, 0))), jnp.pad(s, (0, n_blocks - n_real))
    words = plgpu.kernel(
        functools.partial(_kernel, n_blocks=n_blocks, tile=tile, dtype=dtype),
        out_type=jax.ShapeDtypeStruct((n_blocks, BLOCK_BYTES), jnp.uint32),
        scratch_types=[
            plgpu.SMEM((tile // 2, 2 * BLOCK_BYTES), jnp.uint8),
            plgpu.SMEM((tile,), jnp.uint8),
            plgpu.SMEM((tile, BLOCK_BYTES), jnp.uint32),
            plgpu.Barrier(num_barriers=2),
        ],
        grid=(pl.cdiv(n_blocks, tile),),
        grid_names=("tiles",),
    )(w.reshape(n_blocks // 2, 2 * BLOCK_BYTES), s, scale_2.reshape(1))
    words = words[:n_real]  # [n_real, 8] u32
    return lax.bitcast_convert_type(words, dtype).reshape(*lead, 2 * half_k)  # u32 -> 2 x 16 bit, low first

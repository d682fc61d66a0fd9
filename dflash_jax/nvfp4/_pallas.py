"""NVFP4 -> bf16/f16 dequantization as a Pallas kernel (Triton lowering), for the H100/H200.

Layout: one output word per packed byte. Byte j holds codes 2j (low nibble) and 2j+1 (high nibble); the kernel
writes both 16-bit results into one u32, low half = element 2j, and the u32 array [.., K/2] is bitcast to
[.., K] bf16 outside the kernel (little-endian; XLA makes it a bitcast). No value is interleaved inside the
kernel, so no Triton layout pass can misplace one: a first kernel that joined (low, high) pairs and reshaped
was reported to give wrong bytes on an H200 (we could not reproduce that with jax 0.11.2; see
docs/benchmarks.md), and this layout needs neither join nor reshape.

The problem is flattened to a list of 16-value blocks, each 8 bytes [2, 4] with one scale byte, so every
shape of every tensor maps onto the same power-of-two tiles (Triton needs those) and the only edge is the
end of the list, masked in the last program.

Decoding avoids float conversions that differ between backends: an E2M1 code's three magnitude bits, shifted
under an f16 exponent, are that code's value times 2**-14 (code 1, an f16 subnormal, too); an E4M3 byte's
seven low bits shifted likewise are its value times 2**-8. f16 -> f32 is exact, the power of two is undone
exactly in f32, and then value = e2m1 * (f32(scale) * scale_2) is rounded once, as in the XLA path.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from ..tuning import tuning

BLOCK_BYTES = 8  # 16 codes share one scale
_OUT_DTYPES = (jnp.bfloat16, jnp.float16)


def _f16_bits_to_f32(bits: jax.Array) -> jax.Array:
    """Low 16 bits of a u32 read as an f16, widened exactly to f32."""
    return lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.float16).astype(jnp.float32)


def _e4m3_to_f32(b: jax.Array) -> jax.Array:
    """float8_e4m3fn bits (u32 in [0, 255]) -> f32, exactly; 0x7F/0xFF -> NaN."""
    value = _f16_bits_to_f32(((b & 0x7F) << 7) | ((b & 0x80) << 8)) * 256.0
    return jnp.where((b & 0x7F) == 0x7F, jnp.float32(jnp.nan), value)


def _e2m1_to_f32(code: jax.Array) -> jax.Array:
    """E2M1 code (u32 in [0, 15]: sign bit 3, magnitude bits 0-2) -> f32, exactly."""
    return _f16_bits_to_f32(((code & 7) << 9) | ((code & 8) << 12)) * 16384.0


def _to_bits(x: jax.Array, dtype) -> jax.Array:
    """f32 -> dtype (round to nearest even) -> its 16 bits in a u32."""
    return lax.bitcast_convert_type(x.astype(dtype), jnp.uint16).astype(jnp.uint32)


def _kernel(w_ref, s_ref, g_ref, o_ref, *, n_blocks: int, dtype):
    # w_ref [R, 2, 4] u8 (8 packed bytes per block), s_ref [R] u8 (E4M3 bits), g_ref [1] f32, o_ref [R, 2, 4] u32
    rows = s_ref.shape[0]
    if n_blocks % rows:  # the last program runs past the end: mask its rows
        row = pl.program_id(0) * rows + lax.broadcasted_iota(jnp.int32, (rows,), 0)
        valid = row < n_blocks  # [R]
        valid_bytes = jnp.broadcast_to(valid[:, None, None], w_ref.shape)  # [R, 2, 4]
        s = plt.load(s_ref, mask=valid, other=0)
        w = plt.load(w_ref, mask=valid_bytes, other=0)
    else:
        s, w = s_ref[...], w_ref[...]
    block_scale = _e4m3_to_f32(s.astype(jnp.uint32)) * g_ref[0]  # [R] f32, ModelOpt's association
    block_scale = block_scale[:, None, None]  # [R, 1, 1]
    w = w.astype(jnp.uint32)  # [R, 2, 4]
    low = _to_bits(_e2m1_to_f32(w & 15) * block_scale, dtype)  # element 2j
    high = _to_bits(_e2m1_to_f32(w >> 4) * block_scale, dtype)  # element 2j + 1
    words = low | (high << 16)  # [R, 2, 4] u32
    if n_blocks % rows:
        plt.store(o_ref, words, mask=valid_bytes)
    else:
        o_ref[...] = words


@functools.partial(jax.jit, static_argnames=("dtype", "rows", "num_warps", "interpret"))
def dequantize_pallas(packed: jax.Array, scale_bits: jax.Array, scale_2: jax.Array, *, dtype=jnp.bfloat16,
                      rows: int | None = None, num_warps: int | None = None, interpret: bool = False) -> jax.Array:
    """packed [..., K/2] u8, scale_bits [..., K/16] u8 (E4M3 bits), scale_2 f32 [1] -> [..., K] `dtype`.

    `dtype` is bfloat16 or float16. `rows` (a power of two) and `num_warps` override the device kind's
    (`tuning.Tuning.nvfp4_rows` / `nvfp4_warps`);
    `interpret=True` runs the kernel through Pallas' interpreter (CPU tests).
    """
    if jnp.dtype(dtype) not in map(jnp.dtype, _OUT_DTYPES):
        raise ValueError(f"the Pallas kernel writes bfloat16 or float16, not {jnp.dtype(dtype).name}")
    *lead, half_k = packed.shape
    n_blocks = packed.size // BLOCK_BYTES
    rows, num_warps = rows or tuning().nvfp4_rows, num_warps or tuning().nvfp4_warps
    words = pl.pallas_call(
        functools.partial(_kernel, n_blocks=n_blocks, dtype=dtype),
        out_shape=jax.ShapeDtypeStruct((n_blocks, 2, 4), jnp.uint32),
        grid=(pl.cdiv(n_blocks, rows),),
        in_specs=[
            pl.BlockSpec((rows, 2, 4), lambda i: (i, 0, 0)),
            pl.BlockSpec((rows,), lambda i: (i,)),
            pl.BlockSpec((1,), lambda i: (0,)),
        ],
        out_specs=pl.BlockSpec((rows, 2, 4), lambda i: (i, 0, 0)),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="nvfp4_dequantize",
    )(packed.reshape(n_blocks, 2, 4), scale_bits.reshape(n_blocks), scale_2.reshape(1))
    return lax.bitcast_convert_type(words, dtype).reshape(*lead, 2 * half_k)  # u32 -> 2 x 16 bit, low first

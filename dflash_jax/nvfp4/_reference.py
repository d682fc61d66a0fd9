"""NVFP4 reference paths: dequantization in plain jnp (lowered by XLA) and ModelOpt's quantizer in NumPy.

Both follow NVIDIA ModelOpt's `NVFP4QTensor` (modelopt/torch/quantization/qtensor/nvfp4_tensor.py): its
dequantization formula and its dynamic quantization algorithm.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

BLOCK = 16  # E2M1 codes that share one E4M3 block scale
_FP8_MAX = 448.0  # largest finite float8_e4m3fn
_FP4_MAX = 6.0  # largest E2M1 magnitude
# ModelOpt `_cast_fp4`: |y| is rounded to E2M1 code searchsorted(bounds, |y|) (+1 on the ties that round up).
_E2M1_BOUNDS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
_E2M1_TIES_UP = np.array([0.75, 1.75, 3.5], np.float32)


@functools.partial(jax.jit, static_argnames="dtype")
def dequantize_xla(packed: jax.Array, scale: jax.Array, scale_2: jax.Array, dtype) -> jax.Array:
    """e2m1(code) * (f32(scale) * scale_2), computed in float32 and rounded once to `dtype`.

    packed [..., K/2] u8 (element 2j in the low nibble), scale [..., K/16] float8_e4m3fn, scale_2 f32 [].
    """
    return scaled_blocks(e2m1_values(packed), scale, scale_2, dtype)


def e2m1_values(packed: jax.Array) -> jax.Array:
    """The E2M1 values of packed codes u8 `[..., K/2]` (element 2j in the low nibble) as float32 `[..., K]`
    (exact)."""
    *lead, half_k = packed.shape
    codes = lax.bitcast_convert_type(packed, jnp.float4_e2m1fn)  # [..., K/2, 2], [..., 0] = low nibble
    return codes.astype(jnp.float32).reshape(*lead, 2 * half_k)


def scaled_blocks(values: jax.Array, scale: jax.Array, scale_2: jax.Array, dtype) -> jax.Array:
    """values * (f32(scale) * scale_2) per block of 16 along K, in float32, rounded once to `dtype`: the E2M1 values
    `[..., K]` (float32, exact) of any storage (packed nibbles, `fp8_codes.Fp8Codes`' E4M3 bytes) made weights.

    The association is ModelOpt's and changes bits: scale * scale_2 rounds in float32, then the product with the
    value rounds again (`(value * scale) * scale_2`, exact then one rounding, differs in some float32 weights)."""
    *lead, k = values.shape
    block_scale = scale.astype(jnp.float32) * scale_2  # [..., K/16], ModelOpt's association
    blocks = values.reshape(*lead, k // BLOCK, BLOCK)  # [..., K/16, 16]
    return (blocks * block_scale[..., None]).reshape(*lead, k).astype(dtype)


def quantize(w) -> tuple[np.ndarray, np.ndarray, np.float32]:
    """ModelOpt's dynamic NVFP4 quantization of `w` [..., K] (any float dtype), K a multiple of 16.

    Returns packed u8 [..., K/2], scale float8_e4m3fn [..., K/16] and scale_2 f32 [] such that
    dequantize(packed, scale, scale_2) approximates `w`.
    """
    w = np.asarray(w).astype(np.float32)
    if w.ndim < 1 or w.shape[-1] % BLOCK:
        raise ValueError(f"quantize: the last dim must be a multiple of {BLOCK}, got shape {w.shape}")
    if not np.isfinite(w).all():
        raise ValueError("quantize: the weight holds NaN or Inf")
    *lead, k = w.shape
    amax = np.abs(w).max(initial=np.float32(0))
    if amax == 0:  # ModelOpt would divide 0 by 0 here (0 / 0 block scales)
        return (np.zeros((*lead, k // 2), np.uint8), np.ones((*lead, k // BLOCK), ml_dtypes.float8_e4m3fn),
                np.float32(1.0))
    scale_2 = np.float32(amax / np.float32(_FP4_MAX * _FP8_MAX))
    blocks = w.reshape(*lead, k // BLOCK, BLOCK)  # [..., K/16, 16]
    block_scale = np.abs(blocks).max(axis=-1) / (np.float32(_FP4_MAX) * scale_2)  # [..., K/16] f32
    block_scale[block_scale == 0] = 1.0
    scale = np.maximum(block_scale, np.float32(2.0**-9)).astype(ml_dtypes.float8_e4m3fn)
    y = blocks / (scale.astype(np.float32) * scale_2)[..., None]  # [..., K/16, 16] f32
    magnitude = np.abs(y)
    codes = np.searchsorted(_E2M1_BOUNDS, magnitude, side="left") + np.isin(magnitude, _E2M1_TIES_UP)
    codes = (codes + 8 * (y < 0)).astype(np.uint8).reshape(*lead, k)  # sign bit from y < 0, so -0.0 -> +0
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, scale, scale_2

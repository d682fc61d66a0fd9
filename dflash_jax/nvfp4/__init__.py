"""NVFP4 (NVIDIA ModelOpt) weights: dequantization, quantization on the host, shape checks, packed leaves.

An NVFP4 Linear of a ModelOpt export stores three tensors:
  `<m>.weight`         u8 [N, K/2]             two E2M1 codes per byte along K, element 2j in the low nibble
  `<m>.weight_scale`   float8_e4m3fn [N, K/16] one scale per 16 consecutive values of a row, row-major
  `<m>.weight_scale_2` f32 [] (or [1], bf16/f16 in some exports)
and  value[n, k] = e2m1(code[n, k]) * (f32(scale[n, k // 16]) * scale_2), in float32 and in that association
(ModelOpt's), rounded once to the target dtype (code 8 is -0).

  dequantize(packed, scale, scale_2, *, dtype)           -> jax.Array [..., K], XLA's elementwise program
  quantize(w)                                            -> (packed, scale, scale_2), NumPy, ModelOpt's algorithm
  check_nvfp4_shapes(name, packed_shape, scale_shape, scale_2_shape, expected_nk)  -> (N, K)
  check_scales(name, scale, scale_2, dtype)                  NaN, negative, zero or overflowing scales
  Packed(codes, scale, scale_2, dtype)                       a weight kept packed on the device (`packed`)
  padded(w, multiple)                                        its K padded with zero codes for the kernel's tiles
  Fp8Codes(codes, scale, scale_2, dtype)                     a weight with its codes one E4M3 byte each
                                                                (`fp8_codes`: XLA's product, `weights="fp8"`)
  matmul(x, packed, backend)                                 -> x @ W.T, the packed weight-only GEMM (XLA, or
                                                                the Mosaic GPU kernel of `_mosaic_gemm`)

Notes. `quantize` needs K % 16 == 0 (ModelOpt zero-pads K instead; a padded tensor would no longer have the
shape the config declares) and maps an all-zero weight to zero codes, unit block scales and scale_2 = 1
(ModelOpt would divide 0 by 0). Products below the f32 normal range (scale_2 < ~1e-30, never seen in real
weights) follow the platform: XLA:CPU flushes them to zero. Dequantization is XLA's on every platform: a Pallas
Mosaic GPU kernel saved 0.5-32 us a tensor on an H100, about 0.1 ms a drafter load (docs/nvfp4.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ._checks import check_nvfp4_shapes, check_scales
from ._reference import BLOCK, dequantize_xla, quantize
from .fp8_codes import Fp8Codes
from .packed import Packed, matmul, padded

__all__ = ["dequantize", "quantize", "check_nvfp4_shapes", "check_scales", "Packed", "matmul", "padded", "Fp8Codes"]


def dequantize(packed, scale, scale_2, *, dtype=jnp.bfloat16) -> jax.Array:
    """Dequantizes NVFP4 `packed` [..., K/2] u8 with `scale` [..., K/16] and `scale_2` to [..., K] `dtype`.

    `scale` is float8_e4m3fn or its raw uint8 bits; `scale_2` any float dtype, shape [] or [1] (cast to f32;
    pass it as an array, so that a jitted caller does not recompile per tensor). Jit-compatible. Raises ValueError
    on inconsistent shapes or dtypes.
    """
    packed, scale = jnp.asarray(packed), jnp.asarray(scale)
    scale_2 = jnp.asarray(scale_2)
    if packed.dtype != jnp.uint8:
        raise ValueError(f"dequantize: packed must be uint8, got {packed.dtype}")
    if packed.ndim < 1 or packed.shape[-1] % (BLOCK // 2):
        raise ValueError(f"dequantize: packed must be [..., K/2] with K a multiple of {BLOCK}, got {packed.shape}")
    if scale.shape != (*packed.shape[:-1], packed.shape[-1] // (BLOCK // 2)):
        raise ValueError(f"dequantize: scale shape {scale.shape} does not match packed {packed.shape}")
    if scale.dtype not in (jnp.uint8, jnp.float8_e4m3fn):
        raise ValueError(f"dequantize: scale must be float8_e4m3fn or uint8 bits, got {scale.dtype}")
    if scale_2.size != 1 or not jnp.issubdtype(scale_2.dtype, jnp.floating):
        raise ValueError(f"dequantize: scale_2 must be one float, got {scale_2.dtype}{list(scale_2.shape)}")
    if scale.dtype == jnp.uint8:
        scale = lax.bitcast_convert_type(scale, jnp.float8_e4m3fn)
    return dequantize_xla(packed, scale, scale_2.astype(jnp.float32).reshape(()), dtype)

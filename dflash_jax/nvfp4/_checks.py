"""Validation of NVFP4 tensors as a checkpoint stores them, for the loader to call before dequantizing.

Pure functions over shapes and host arrays; each failure raises `CheckpointError` naming the tensor.
ModelOpt names the three tensors of a Linear `<m>.weight`, `<m>.weight_scale` and `<m>.weight_scale_2`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import ml_dtypes
import numpy as np

from dflash_jax.errors import CheckpointError

from ._reference import _FP4_MAX, BLOCK


def check_nvfp4_shapes(
    name: str,
    packed_shape: Sequence[int],
    scale_shape: Sequence[int],
    scale_2_shape: Sequence[int],
    expected_nk: tuple[int, ...] | None = None,
) -> tuple[int, int]:
    """Checks the shapes of one NVFP4 Linear and returns its unpacked (N, K).

    `name` is the packed tensor's name (`<m>.weight`); the scales are reported as `<name>_scale` and
    `<name>_scale_2`. Requires packed [N, K/2] with K a multiple of 32, scale [N, K/16], scale_2 [] or [1],
    and (N, K) == expected_nk when given (the shape the config implies).
    """
    packed_shape, scale_shape, scale_2_shape = tuple(packed_shape), tuple(scale_shape), tuple(scale_2_shape)
    if len(packed_shape) != 2:
        raise CheckpointError(f"{name}: an NVFP4 weight must be 2-D [N, K/2] uint8, got shape {list(packed_shape)}")
    n, k = packed_shape[0], 2 * packed_shape[1]
    if k % 32:
        raise CheckpointError(f"{name}: unpacked K = {k} (2 x {packed_shape[1]} bytes) is not a multiple of 32")
    if scale_shape != (n, k // BLOCK):
        raise CheckpointError(
            f"{name}_scale: shape {list(scale_shape)} does not match the weight; expected [{n}, {k // BLOCK}] "
            f"(one scale per {BLOCK} values of the [{n}, {k}] weight)")
    if scale_2_shape not in ((), (1,)):
        raise CheckpointError(f"{name}_scale_2: expected a scalar of shape [] or [1], got {list(scale_2_shape)}")
    if expected_nk is not None and (n, k) != tuple(expected_nk):
        raise CheckpointError(
            f"{name}: unpacked shape [{n}, {k}] disagrees with the config's [{expected_nk[0]}, {expected_nk[1]}]")
    return n, k


def check_scales(name: str, scale, scale_2, dtype=None) -> None:
    """Raises `CheckpointError` for scales that would load wrong weights without any NaN to show it.

    `scale`: the block scales (float8_e4m3fn or its uint8 bits), which must be non-NaN and >= 0 (ModelOpt's
    are amax / 6 of each block, rounded to E4M3; a set sign bit would negate the block). `scale_2`: finite
    and > 0 (zero or negative zeroes or negates every weight), and not subnormal (XLA flushes subnormals to zero,
    so every weight would dequantize to 0). With `dtype` (the load dtype), the largest
    value the scales allow, 6 x max(scale) x scale_2 (6 is the largest E2M1 magnitude), must be finite in it:
    3e38 would make every weight Inf or NaN.
    """
    bits = np.asarray(scale).view(np.uint8)  # float8_e4m3fn has no Inf; NaN is S.1111.111 (0x7F / 0xFF)
    magnitude = bits & 0x7F
    nan = np.count_nonzero(magnitude == 0x7F)  # on the bits: 40x faster than converting to float32
    if nan:
        raise CheckpointError(f"{name}_scale: {nan} of {bits.size} block scales are NaN")
    negative = np.count_nonzero((bits >= 0x80) & (magnitude != 0))  # -0 is zero, harmless
    if negative:
        raise CheckpointError(
            f"{name}_scale: {negative} of {bits.size} block scales are negative; expected scales >= 0 "
            "(amax / 6 of each block)")
    scale_2 = float(np.asarray(scale_2).astype(np.float32).reshape(-1)[0])
    if not math.isfinite(scale_2) or scale_2 <= 0:
        raise CheckpointError(f"{name}_scale_2: {scale_2} is not a finite number > 0")
    if scale_2 < np.finfo(np.float32).tiny:  # flushed to zero by the dequantization (XLA's FTZ)
        raise CheckpointError(f"{name}_scale_2: {scale_2:.3g} is subnormal in float32, which XLA flushes to 0: every "
                              "dequantized weight would be 0; expected a finite number >= "
                              f"{np.finfo(np.float32).tiny:.3g}")
    if dtype is not None and bits.size:
        largest = _FP4_MAX * float(magnitude.max(initial=0).view(ml_dtypes.float8_e4m3fn)) * scale_2
        limit = float(min(ml_dtypes.finfo(dtype).max, np.finfo(np.float32).max))  # dequantized in float32
        if largest > limit:
            raise CheckpointError(
                f"{name}_scale_2: {scale_2} times the largest block scale allows weights up to {largest:.3g}, "
                f"beyond {np.dtype(dtype).name}'s range ({limit:.3g}); the scales are corrupt")

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

_FP4_MIN = 0.5  # the smallest nonzero E2M1 magnitude


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
    so every weight would dequantize to 0). No nonzero code may dequantize to 0: the smallest nonzero one (0.5)
    times every nonzero block scale times scale_2 must be normal in float32 (the dequantization's products are
    float32, flushed to 0 below 2**-126: 1.2e-38 x 2**-9 zeroed a whole tensor of normal scales) and, with
    `dtype` (the load dtype), not round to 0 in it (float16's smallest subnormal is 6e-8). With `dtype`, the
    largest value the scales allow, 6 x max(scale) x scale_2 (6 is the largest E2M1 magnitude), must be finite in
    it: 3e38 would make every weight Inf or NaN. Both run on the block scales alone, not on the codes.
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
    if bits.size:
        _check_smallest_products(name, magnitude, np.float32(scale_2), dtype)
    if dtype is not None and bits.size:
        largest = _FP4_MAX * float(magnitude.max(initial=0).view(ml_dtypes.float8_e4m3fn)) * scale_2
        limit = float(min(ml_dtypes.finfo(dtype).max, np.finfo(np.float32).max))  # dequantized in float32
        if largest > limit:
            raise CheckpointError(
                f"{name}_scale_2: {scale_2} times the largest block scale allows weights up to {largest:.3g}, "
                f"beyond {np.dtype(dtype).name}'s range ({limit:.3g}); the scales are corrupt")


_E4M3 = np.arange(128, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)  # magnitude bits -> value
_TINY = float(np.finfo(np.float32).tiny)  # 2**-126, float32's smallest normal


def _times(a, b) -> np.ndarray:
    """a x b as XLA multiplies float32 numbers, in float64: rounded to float32, and 0 where the exact product is
    below float32's normal range (XLA flushes such results; x86 judges before rounding). Products past float32's
    range are its largest: only which ones are 0 matters here."""
    exact = np.minimum(np.asarray(a, np.float64) * np.asarray(b, np.float64), np.finfo(np.float32).max)
    return np.where(exact < _TINY, 0.0, exact.astype(np.float32).astype(np.float64))


def _vanishes(values: np.ndarray, dtype) -> np.ndarray:
    """Which dequantized `values` (`_times`'s, >= 0) are 0: flushed, or, with `dtype`, rounded to 0 in it."""
    zero = values == 0
    return zero if dtype is None else zero | (np.minimum(values, 1.0).astype(np.float32).astype(dtype) == 0)


def _check_smallest_products(name: str, magnitude: np.ndarray, scale_2: np.float32, dtype) -> None:
    """`check_scales`' underflow rule on the block scales' magnitude bits (E4M3 is ordered as its bits are): the
    smallest nonzero scale decides, and only a failure counts the blocks."""
    smallest = _E4M3[int(np.min(magnitude, where=magnitude != 0, initial=0x7E))]
    value = _times(_FP4_MIN, _times(smallest, scale_2))  # code x (scale x scale_2): the dequantization's order
    if not _vanishes(value, dtype):
        return
    bad = _vanishes(_times(_FP4_MIN, _times(_E4M3, scale_2)), dtype)
    bad[0] = False  # a zero block scale makes a zero block, as the export meant
    what = (f"{name}_scale: {np.count_nonzero(bad[magnitude])} of {magnitude.size} block scales times "
            f"{name}_scale_2 ({scale_2:.3g}) dequantize nonzero codes to 0")
    exact = _FP4_MIN * smallest * float(scale_2)
    product = f"{_FP4_MIN} x the smallest block scale {smallest:.3g} x {scale_2:.3g} = {exact:.3g}"
    if not value:
        raise CheckpointError(f"{what} ({product}, below float32's normal range {_TINY:.3g}, which XLA flushes "
                              "to 0); the scales are corrupt")
    raise CheckpointError(f"{what} in {np.dtype(dtype).name} ({product} rounds to 0 there); load in bfloat16 or "
                          "float32")

"""Validation of NVFP4 tensors as a checkpoint stores them, for the loader to call before dequantizing.

Pure functions over shapes and host arrays; each failure raises `CheckpointError` naming the tensor.
ModelOpt names the three tensors of a Linear `<m>.weight`, `<m>.weight_scale` and `<m>.weight_scale_2`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dflash_jax.errors import CheckpointError

from ._reference import BLOCK


def check_nvfp4_shapes(
    name: str,
    packed_shape: Sequence[int],
    scale_shape: Sequence[int],
    scale_2_shape: Sequence[int],
    expected_nk: tuple[int, int] | None = None,
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


def check_scales_finite(name: str, scale, scale_2) -> None:
    """Raises `CheckpointError` if the block scales (float8_e4m3fn or its uint8 bits) or scale_2 are NaN/Inf."""
    bits = np.asarray(scale).view(np.uint8)  # float8_e4m3fn has no Inf; NaN is S.1111.111 (0x7F / 0xFF)
    bad = np.count_nonzero((bits & 0x7F) == 0x7F)  # on the bits: 40x faster than converting to float32
    if bad:
        raise CheckpointError(f"{name}_scale: {bad} of {bits.size} block scales are NaN")
    scale_2 = np.asarray(scale_2).astype(np.float32)
    if not np.isfinite(scale_2).all():
        raise CheckpointError(f"{name}_scale_2: {scale_2.reshape(-1)[0]} is not finite")

"""FP8 per-tensor weights (NVIDIA ModelOpt `quant_algo: "FP8"`): the `Fp8` leaf, dequantization, the GEMM.

A ModelOpt FP8 Linear stores
  `<m>.weight`        float8_e4m3fn [N, K]
  `<m>.weight_scale`  f32 [] (or [1]; bf16/f16 accepted)    amax / 448 of the whole weight
  `<m>.input_scale`   f32 []                                 the activations' scale: ignored (weight-only)
and  value[n, k] = f32(weight[n, k]) * weight_scale, in float32, rounded once to the load dtype.

  dequantize(weight, scale, *, dtype)   -> jax.Array [N, K]
  quantize(w)                           -> (weight, scale), NumPy: amax / 448, round to nearest E4M3
  Fp8(weight, scale, dtype)             a weight kept in FP8 on the device (`load_drafter(weights="packed" or "fp8")`)
  matmul(x, fp8)                        -> x @ W.T, its weight-only GEMM: (x @ f(weight).T) * scale
  check_scale(name, scale, dtype)       zero, negative, NaN, Inf, subnormal or overflowing scales
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Literal

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from .._kernel_choice import kernel_choice
from .._precision import weight_dot
from .._weight_leaf import WeightLeaf
from ..errors import CheckpointError

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_MIN = 2.0**-9  # smallest nonzero float8_e4m3fn (a subnormal)
MatmulBackend = Literal["auto", "scaled", "xla"]

__all__ = ["Fp8", "check_scale", "dequantize", "matmul", "quantize"]


@functools.partial(jax.jit, static_argnames="dtype")
def dequantize(weight: jax.Array, scale: jax.Array, *, dtype: Any = jnp.bfloat16) -> jax.Array:
    """`f32(weight) * f32(scale)` rounded once to `dtype`: weight float8_e4m3fn [..., K], scale one float."""
    return (weight.astype(jnp.float32) * scale.astype(jnp.float32).reshape(())).astype(dtype)


def quantize(w: Any) -> tuple[np.ndarray, np.float32]:
    """Per-tensor FP8 as ModelOpt quantizes a weight: scale = amax / 448 (1 for an all-zero weight), weight =
    w / scale rounded to the nearest float8_e4m3fn. Returns (weight [..., K] float8_e4m3fn, scale f32)."""
    w = np.asarray(w).astype(np.float32)
    if not np.isfinite(w).all():
        raise ValueError("fp8.quantize: the weight holds NaN or Inf")
    amax = np.abs(w).max(initial=np.float32(0))
    scale = np.float32(amax / np.float32(FP8_MAX)) if amax > 0 else np.float32(1.0)
    return np.clip(w / scale, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn), scale


def check_scale(name: str, scale: Any, dtype: Any = None) -> None:
    """Raise `CheckpointError` naming `name` (the scale tensor) unless it is one normal float32 > 0.

    Zero or negative zeroes or negates every weight, NaN/Inf poisons them, and a subnormal one (below
    float32's normal range, ~1.2e-38) is no amax / 448 of a real weight. Nor is one whose product with the
    smallest nonzero code (2**-9) is subnormal: the dequantization multiplies in float32, which XLA flushes to 0
    below 2**-126, so a scale of 1.2e-38 zeroes every code below 1. With `dtype` (the load dtype), the largest
    weight the scale allows, 448 x scale, must be finite in it and not round to 0 (float16 below 6e-8); smaller
    codes rounding to 0 in float16 are float16's loss, as from a BF16 checkpoint (codes span 2**-9 to 448).
    """
    value = float(np.asarray(scale).astype(np.float32).reshape(-1)[0])
    if not math.isfinite(value) or value <= 0:
        raise CheckpointError(f"{name}: {value} is not a finite number > 0")
    tiny = float(np.finfo(np.float32).tiny)
    if value < tiny:
        raise CheckpointError(f"{name}: {value:.3g} is subnormal (below float32's normal range, {tiny:.3g}); "
                              "expected amax / 448 of the weight")
    if FP8_MIN * value < tiny:  # exact: XLA flushes a float32 product below it (x86 judges before rounding)
        raise CheckpointError(f"{name}: {value:.3g} dequantizes the weight's nonzero codes below {tiny / value:.3g} "
                              f"to 0 (2**-9 x {value:.3g} = {FP8_MIN * value:.3g} is below float32's normal range, "
                              "which XLA flushes to 0); expected amax / 448 of the weight")
    if dtype is not None:
        limit = float(min(ml_dtypes.finfo(dtype).max, np.finfo(np.float32).max))  # dequantized in float32
        if FP8_MAX * value > limit:
            raise CheckpointError(f"{name}: {value} allows weights up to {FP8_MAX * value:.3g}, beyond "
                                  f"{np.dtype(dtype).name}'s range ({limit:.3g}); the scale is corrupt")
        if np.float32(FP8_MAX * value).astype(dtype) == 0:
            raise CheckpointError(f"{name}: {value:.3g} rounds every weight to 0 in {np.dtype(dtype).name} (448 x "
                                  f"{value:.3g} = {FP8_MAX * value:.3g}); load in bfloat16 or float32")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, repr=False)
class Fp8(WeightLeaf):
    """One FP8 per-tensor linear weight `[N, K]`: `weight` float8_e4m3fn [N, K], `scale` float32 [], and
    (static) `dtype`, what it dequantizes to and is multiplied in. A registered dataclass that answers
    `.shape`, `.dtype`, `.ndim`, `.sharding`, `.nbytes` (1 per weight plus 4) as an array would (`WeightLeaf`).
    Constructed from arrays, the dtypes and shapes are checked (ValueError)."""

    LABEL = "fp8.Fp8"

    weight: jax.Array
    scale: jax.Array
    dtype: Any = dataclasses.field(default=jnp.bfloat16, metadata=dict(static=True))

    def check_arrays(self, w: Any, s: Any) -> None:
        if w.dtype != jnp.float8_e4m3fn or len(w.shape) != 2:
            raise ValueError(f"fp8.Fp8: weight must be float8_e4m3fn [N, K], got {jnp.dtype(w.dtype).name}"
                             f"{list(w.shape)}")
        if s.dtype != jnp.float32 or tuple(s.shape) != ():
            raise ValueError(f"fp8.Fp8: scale must be a float32 scalar [], got {jnp.dtype(s.dtype).name}"
                             f"{list(s.shape)}")

    def apply(self, x: jax.Array, out_dtype: Any) -> jax.Array:
        """`x [..., K] @ W.T` in `out_dtype` (`matmul`): what `layers.dot` calls for a `layers.QuantizedWeight`."""
        return matmul(x, self, out_dtype=out_dtype)

    @property
    def shape(self) -> tuple[int, int]:
        n, k = self.weight.shape
        return n, k

    def dequantize(self) -> jax.Array:
        """The weight `[N, K]` in `self.dtype`, bit for bit what `load_drafter(weights="dequantized")` places."""
        return dequantize(self.weight, self.scale, dtype=self.dtype)


def matmul(x: jax.Array, w: Fp8, *, out_dtype: Any = None, backend: MatmulBackend = "auto") -> jax.Array:
    """`x [..., K] @ W.T -> [..., N]` for an FP8 weight `W [N, K]`, in `out_dtype` (default x's).

    "scaled" (what "auto" runs): the FP8 codes converted to `w.dtype` (exact: E4M3 values are bf16, f16 and f32
    values) inside the product, accumulated in float32, times the per-tensor scale once, rounded once. XLA fuses
    the conversion into its GEMM, so a step reads 1 byte a weight (on the H200 an 8B-drafter fc at 16 rows took
    0.56x the bf16 GEMM's time, docs/benchmarks.md). "xla": the weight dequantized to `w.dtype` first
    (`Fp8.dequantize`), then multiplied: the reference, which rounds `weight * scale` to `w.dtype`; "scaled" does
    not, so it is the closer of the two to the exact product.
    """
    if not isinstance(w, Fp8):
        raise TypeError(f"fp8.matmul: w must be an fp8.Fp8, got {type(w).__name__}")
    if x.shape[-1] != w.shape[1]:
        raise ValueError(f"fp8.matmul: x has {x.shape[-1]} features, the weight [{w.shape[0]}, {w.shape[1]}] "
                         f"expects {w.shape[1]}")
    backend = kernel_choice("fp8.matmul", "backend", backend, ("auto", "scaled", "xla"))  # type: ignore[assignment]
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if backend == "xla":
        return weight_dot(x, w.dequantize(), out_dtype)
    product = weight_dot(x, w.weight.astype(w.dtype), jnp.float32)  # [..., N]
    return (product * w.scale.astype(jnp.float32)).astype(out_dtype)

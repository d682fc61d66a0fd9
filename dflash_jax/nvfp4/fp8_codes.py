"""NVFP4 weights with their codes stored one float8_e4m3fn byte each: the `Fp8Codes` leaf (`weights="fp8"`).

Every E2M1 value (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives) is an E4M3 value, so an NVFP4 weight's codes
widen to FP8 without losing a bit. Beside them stay the checkpoint's E4M3 block scales (one per 16 values along K)
and its global scale: 1.0625 bytes a weight instead of packed NVFP4's 0.5625 (bf16: 2). What the byte buys: the
weight is plain XLA, `f32(code) * (f32(scale) * scale_2)` rounded to the compute dtype, then the dot, where the
packed form needs its own kernel (`nvfp4._mosaic_gemm`). XLA does not fuse that producer into its GEMM as it fuses
`fp8.matmul`'s conversion: on an H100 it writes the bf16 weight out first, and the product takes 1.9x bf16's time
(docs/benchmarks.md, "Nemotron 3.5 Lightning drafters"), so `weights="auto"` never places this form; it is the
storage a kernel widening E4M3 codes in registers would read.

The product is the dequantized weight's bit for bit: `dequantize()` is `nvfp4.dequantize`'s formula on the same
values (`_reference.scaled_blocks`, ModelOpt's association), and `apply` multiplies it with `_precision.weight_dot`
as a dequantized load's weight is multiplied.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from .._precision import weight_dot
from .._weight_leaf import WeightLeaf
from ._reference import BLOCK, e2m1_values, scaled_blocks
from .packed import Packed

__all__ = ["Fp8Codes", "widen_codes"]


@jax.jit
def widen_codes(packed: jax.Array) -> jax.Array:
    """Packed E2M1 codes u8 `[..., K/2]` (element 2j in the low nibble) as float8_e4m3fn values `[..., K]` (exact;
    through float32, a conversion every backend lowers)."""
    return e2m1_values(packed).astype(jnp.float8_e4m3fn)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, repr=False)
class Fp8Codes(WeightLeaf):
    """One NVFP4 linear weight `[N, K]` with its codes widened to one byte each (module docstring).

    codes   float8_e4m3fn [N, K]      the E2M1 values, exact
    scale   float8_e4m3fn [N, K/16]   one scale per 16 consecutive values of a row (the checkpoint's)
    scale_2 float32 []                the global scale
    dtype   (static) the dtype it is computed in: `dequantize()` gives it, `apply` multiplies in it

    A registered dataclass that answers `.shape`, `.dtype`, `.ndim`, `.sharding`, `.nbytes` (1.0625 per weight plus
    4) as an array would (`WeightLeaf`). Constructed from arrays, the dtypes and shapes are checked (ValueError).
    """

    LABEL = "nvfp4.Fp8Codes"

    codes: jax.Array
    scale: jax.Array
    scale_2: jax.Array
    dtype: Any = dataclasses.field(default=jnp.bfloat16, metadata=dict(static=True))

    def check_arrays(self, codes: Any, scale: Any, scale_2: Any) -> None:
        """Raise ValueError for three arrays that do not make an `Fp8Codes` (its docstring has the layout)."""
        if codes.dtype != jnp.float8_e4m3fn or len(codes.shape) != 2 or codes.shape[1] % BLOCK:
            raise ValueError(f"nvfp4.Fp8Codes: codes must be float8_e4m3fn [N, K], K a multiple of {BLOCK}, got "
                             f"{jnp.dtype(codes.dtype).name}{list(codes.shape)}")
        n, k = codes.shape
        if scale.dtype != jnp.float8_e4m3fn or tuple(scale.shape) != (n, k // BLOCK):
            raise ValueError(f"nvfp4.Fp8Codes: scale must be float8_e4m3fn [{n}, {k // BLOCK}] for codes {[n, k]} "
                             f"(one scale per {BLOCK} values), got {jnp.dtype(scale.dtype).name}{list(scale.shape)}")
        if scale_2.dtype != jnp.float32 or tuple(scale_2.shape) != ():
            raise ValueError(f"nvfp4.Fp8Codes: scale_2 must be a float32 scalar [], got "
                             f"{jnp.dtype(scale_2.dtype).name}{list(scale_2.shape)}")

    @classmethod
    def from_packed(cls, w: Packed) -> Fp8Codes:
        """`w`'s codes widened on its devices (`widen_codes`), its scales as they are; a padded `w`
        (`nvfp4.padded`) loses its padding."""
        codes, scale, k = widen_codes(w.codes), w.scale, w.shape[1]
        if w.stored_columns != k:  # padded: the columns past K are zero codes
            codes, scale = codes[:, :k], scale[:, :k // BLOCK]
        return cls(codes, scale, w.scale_2, dtype=w.dtype)

    @property
    def shape(self) -> tuple[int, int]:
        n, k = self.codes.shape
        return n, k

    def dequantize(self) -> jax.Array:
        """The weight `[N, K]` in `self.dtype`, bit for bit what `load_drafter(weights="dequantized")` places."""
        return scaled_blocks(self.codes.astype(jnp.float32), self.scale, self.scale_2, self.dtype)

    def apply(self, x: jax.Array, out_dtype: Any) -> jax.Array:
        """`x [..., K] @ W.T` in `out_dtype`: the dequantized weight's product (what `layers.dot` calls for a
        `layers.QuantizedWeight`); the weight is a producer of the dot (XLA writes it out: module doc)."""
        if x.shape[-1] != self.shape[1]:
            raise ValueError(f"nvfp4.Fp8Codes: x has {x.shape[-1]} features, the weight {list(self.shape)} expects "
                             f"{self.shape[1]}")
        return weight_dot(x, self.dequantize(), out_dtype)

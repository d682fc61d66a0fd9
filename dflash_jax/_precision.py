"""The package's one rule for matmul precision, shared by `layers.dot`, attention and the quantized weights' GEMMs.

Matmuls accumulate in float32; when an operand is float32 the products are full-precision
(`Precision.HIGHEST`), so that float32 runs can be compared with a float64 reference; bf16 runs keep bf16
operands. The packed weights' XLA path (`nvfp4.matmul`, `fp8.matmul`) multiplies its dequantized weight with
`weight_dot`, so a packed drafter and a dequantized one run the same product.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def precision(a: Any, b: Any) -> jax.lax.Precision:
    """HIGHEST when either operand is float32, else DEFAULT."""
    return jax.lax.Precision.HIGHEST if jnp.float32 in (a.dtype, b.dtype) else jax.lax.Precision.DEFAULT


def dot(spec: str, a: jax.Array, b: jax.Array, out_dtype: Any = jnp.float32) -> jax.Array:
    """`einsum(spec, a, b)` accumulating in float32, result in `out_dtype` (`precision`): every product of two
    arrays in the package (`layers.dot` adds the quantized weights)."""
    return jnp.einsum(spec, a, b, precision=precision(a, b), preferred_element_type=out_dtype)


def weight_dot(x: jax.Array, w: jax.Array, out_dtype: Any) -> jax.Array:
    """`x [..., K] @ w [N, K].T -> [..., N]` in `out_dtype`, accumulating in float32 (`precision`)."""
    return dot("...k,nk->...n", x, w, out_dtype)

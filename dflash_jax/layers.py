"""The layers the drafters and the targets share: the weight product (float or quantized), RMSNorm, the LM head,
the Qwen3 / Llama attention projections and the pre-norm decoder layer.

Pure functions over Hugging Face-layout parameter dicts (`{"weight": [out, in]}`, applied as `x @ W.T`). A weight
kept quantized (`load_drafter(weights="packed"|"fp8")`: `nvfp4.Packed`, `nvfp4.Fp8Codes`, `fp8.Fp8`) is a
`QuantizedWeight`: it brings its own product (`apply`), so this module names no kernel. Numerics (`_precision`):
products accumulate in float32, full precision when an operand is float32; norms in float32.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp

from ._precision import dot as array_dot
from .rope import Rope, apply_rope

__all__ = ["QuantizedWeight", "Params", "Around", "dot", "is_quantized", "linear", "rms_norm", "lm_logits", "head_norm",
           "queries", "keys_values", "swiglu", "decoder_layer", "static_fp8_input"]

Params = dict[str, Any]
# A wrapper around a sublayer (`decoder_layer`'s `around`): `(layer params, name, x, run) -> run's output`, where
# `run(x) -> (y, aux)` is the sublayer itself.
Around = Callable[[Params, str, jax.Array, Callable[[jax.Array], tuple[jax.Array, Any]]], tuple[jax.Array, Any]]


@runtime_checkable
class QuantizedWeight(Protocol):
    """A linear weight `[out, in]` kept quantized (`nvfp4.Packed`, `nvfp4.Fp8Codes`, `fp8.Fp8`; a registered pytree
    node, `_weight_leaf.WeightLeaf`): it answers `shape`, `dtype` (what it computes in), `ndim` and `nbytes` as an
    array would (and `sharding`, outside a trace: not a member, since `isinstance` reads every member and a tracer
    has none), so that code reading a weight's shape or dtype needs no special case; `apply(x, out_dtype)` is
    `x @ W.T` by its own GEMM and `dequantize()` the weight in `dtype`. Code dispatches on this protocol (`dot`,
    `is_quantized`), never on the formats."""

    @property
    def shape(self) -> tuple[int, int]: ...

    @property
    def dtype(self) -> Any: ...

    @property
    def ndim(self) -> int: ...

    @property
    def nbytes(self) -> int: ...

    def apply(self, x: jax.Array, out_dtype: Any) -> jax.Array: ...

    def dequantize(self) -> jax.Array: ...


def dot(spec: str, a: jax.Array, b: Any, out_dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """`einsum` accumulating in float32, result in `out_dtype`; full-precision products when an operand is float32.

    A bf16 x bf16 product written as bf16 still accumulates in float32 (XLA's GEMMs use a float32 compute type)
    and rounds once, in the GEMM's epilogue, instead of writing float32 and converting in another kernel.

    `b` may be a weight kept quantized (`load_drafter(weights="packed"|"fp8")`: `nvfp4.Packed`, `nvfp4.Fp8Codes`,
    `fp8.Fp8`): this is the one place a linear weight meets its GEMM, so each goes to its own weight-only GEMM
    (`QuantizedWeight.apply`: `nvfp4.matmul`, XLA's dot of the dequantized weight, `fp8.matmul`). Every product
    with a weight is `x @ W.T` (`spec` "...i,oi->...o").
    """
    if isinstance(b, QuantizedWeight):
        _check_weight_spec(spec)
        return b.apply(a, out_dtype)
    return array_dot(spec, a, b, out_dtype)


def is_quantized(x: Any) -> bool:
    """Whether `x` is a quantized weight (`QuantizedWeight`): `jax.tree.map(f, params, is_leaf=is_quantized)` then
    takes each weight whole, as the NNX module wraps them, instead of its arrays."""
    return isinstance(x, QuantizedWeight)


def _check_weight_spec(spec: str) -> None:
    """A quantized weight `[out, in]` is only ever the right operand of `x @ W.T`: `"<x>i,oi-><x>o"`."""
    operands, _, out = spec.replace(" ", "").partition("->")
    lhs, _, rhs = operands.partition(",")
    if len(rhs) != 2 or not lhs.endswith(rhs[1]) or out != lhs[:-1] + rhs[0]:
        raise ValueError(f"dot: a quantized weight multiplies as x @ W.T ('...i,oi->...o'), not {spec!r}")


def linear(x: jax.Array, p: Params) -> jax.Array:
    """`x @ W.T (+ b)` for an HF-layout `{weight: [out, in], bias?: [out]}` (a float or quantized weight, `dot`);
    returns x's dtype."""
    y = dot("...i,oi->...o", x, p["weight"], out_dtype=x.dtype)  # [..., out]
    return y + p["bias"].astype(y.dtype) if "bias" in p else y


def static_fp8_input(x: jax.Array, p: Params) -> jax.Array:
    """The input of a projection `p` as an FP8 W8A8 kernel reads it (ModelOpt FP8 with a static `input_scale`):
    `e4m3(x / s) * s`, saturating at +-448, in x's dtype; `x` itself when `p` has no `input_scale`."""
    if "input_scale" not in p:
        return x
    s = p["input_scale"].astype(jnp.float32)
    largest = float(jnp.finfo(jnp.float8_e4m3fn).max)  # 448
    codes = jnp.clip(x.astype(jnp.float32) / s, -largest, largest).astype(jnp.float8_e4m3fn)
    return (codes.astype(jnp.float32) * s).astype(x.dtype)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Qwen3 RMSNorm: normalise in float32, cast back, then scale (`weight * x_hat.to(dtype)`)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * xf.astype(x.dtype)


def lm_logits(hidden: jax.Array, lm_head: jax.Array) -> jax.Array:
    """Float32 logits `hidden @ lm_head.T` for an HF-layout head `[V, H]`: `[..., H] -> [..., V]`."""
    return dot("...h,vh->...v", hidden, lm_head)




def head_norm(attn: Params, name: str, config, x: jax.Array) -> jax.Array:
    """Qwen3's per-head RMSNorm `q_norm` / `k_norm` over `d_h` when the params hold it (Llama has none)."""
    return rms_norm(x, attn[name]["weight"], config.rms_norm_eps) if name in attn else x


def queries(attn: Params, config, x: jax.Array, rope: Rope) -> jax.Array:
    """`q_norm(q_proj(x))` with RoPE: `[batch, S, H] -> [batch, S, n_h, d_h]` (no norm where `q_norm` is absent)."""
    batch, S, _ = x.shape
    q = linear(x, attn["q_proj"]).reshape(batch, S, config.num_attention_heads, config.head_dim)
    return apply_rope(head_norm(attn, "q_norm", config, q), rope)


def keys_values(attn: Params, config, x: jax.Array, rope: Rope) -> tuple[jax.Array, jax.Array]:
    """`k_norm(k_proj(x))` with RoPE and `v_proj(x)`, heads-major: `[batch, S, H] -> 2 x [batch, n_kv, S, d_h]`."""
    batch, S, _ = x.shape
    shape = (batch, S, config.num_key_value_heads, config.head_dim)
    k = apply_rope(head_norm(attn, "k_norm", config, linear(x, attn["k_proj"]).reshape(shape)), rope)
    v = linear(x, attn["v_proj"]).reshape(shape)
    return k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)


def decoder_layer(
    p: Params, config, x: jax.Array, attention: Callable[[Params, jax.Array], tuple[jax.Array, Any]],
    around: Around | None = None,
) -> tuple[jax.Array, Any]:
    """One pre-norm Qwen3 / Llama layer over `x [batch, S, H]`, shared by the drafters and the targets.

        x += o_proj(attention(input_layernorm(x)))
        x += down(silu(gate(h)) * up(h)),  h = post_attention_layernorm(x)

    `attention(self_attn params, normed x [batch, S, H])` returns `([batch, S, n_h * d_h], aux)`: where the
    queries, keys and values come from is the caller's (the drafter adds context rows, a target its cache).
    `around(p, name, x, run)` wraps each sublayer (`name` "attention_conv", then "mlp_conv"; DFlash2's grouped
    convolutions: `model.dflash2_around`). Returns the new `x` and `aux`.
    """
    around = around or _unwrapped
    eps = config.rms_norm_eps

    def attend(xn):  # [batch, S, H] -> ([batch, S, H], aux)
        a, aux = attention(p["self_attn"], xn)
        return linear(a, p["self_attn"]["o_proj"]), aux

    a, aux = around(p, "attention_conv", rms_norm(x, p["input_layernorm"]["weight"], eps), attend)
    x = x + a
    h = rms_norm(x, p["post_attention_layernorm"]["weight"], eps)
    h, _ = around(p, "mlp_conv", h, lambda h: (swiglu(p["mlp"], h), None))
    return x + h, aux


def swiglu(mlp: Params, h: jax.Array) -> jax.Array:
    """`down(silu(gate(h)) * up(h))`: `[..., H] -> [..., H]`."""
    return linear(jax.nn.silu(linear(h, mlp["gate_proj"])) * linear(h, mlp["up_proj"]), mlp["down_proj"])


def _unwrapped(p: Params, name: str, x: jax.Array, run: Callable[[jax.Array], tuple[jax.Array, Any]]):
    return run(x)

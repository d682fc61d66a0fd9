"""Gemma 4's drafter layer: DeepSpec's `Gemma4DSparkModel` (deepspec/modeling/dspark/gemma4/modeling.py).

The drafter around it is the DSpark drafter of `dflash_jax.model` (context rows `hidden_norm(fc(features))` as
extra keys/values, the block `[anchor, MASK x (B-1)]`, all B rows drafting, the Markov and confidence heads);
`model.forward` runs these functions in place of the Qwen3 ones for a config whose `variant` is "gemma4". Per layer,
over the block rows `x [batch, B, H]` and the context rows `ctx [batch, S, H]`:

    h = input_layernorm(x)
    q = RoPE(q_norm(q_proj(h)));  k = RoPE(k_norm(k_proj([ctx; h])))
    v = v_norm(k_proj([ctx; h]))   with attention_k_eq_v (no v_proj), else v_norm(v_proj([ctx; h]))
    x = x + post_attention_layernorm(o_proj(softmax(q . k) v))           attention scale 1, bidirectional
    x = x + post_feedforward_layernorm(down(gelu_tanh(gate(h')) * up(h'))),  h' = pre_feedforward_layernorm(x)
    x = x * layer_scalar

`v_norm` is an RMSNorm without a gain. Every layer is one of Gemma 4's full-attention (global) layers:
`num_attention_heads` heads of `global_head_dim`, KV heads `num_global_key_value_heads` with `attention_k_eq_v`
(`layouts._fold_gemma4` reads them into `head_dim` / `num_key_value_heads`), RoPE from
`rope_parameters.full_attention` (usually `proportional`: `model.rope_frequencies`). Around the layers: the block's
embeddings times `sqrt(hidden_size)` (`DflashConfig.input_embedding_scale`) and the logits softcapped,
`c * tanh(logits / c)`, before the Markov bias (`DflashConfig.logit_transform`).

Numerics as transformers' Gemma 4 modules: RMSNorm `x * (mean(x^2) + eps)^-1/2 * weight` in float32, cast once
(`rms_norm`; Qwen3's casts, then multiplies by the gain); GELU-tanh in float32. `attention.attend` scales scores by
`d_h ** -0.5`, so the queries carry `d_h ** 0.5`, applied in float32 before their one cast.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from . import model as base  # the shared blocks; read at call time (`model` imports this module)
from .config import DflashConfig

Params = dict[str, Any]


def rms_norm(x: jax.Array, weight: jax.Array | None, eps: float) -> jax.Array:
    """Gemma 4's RMSNorm (`Gemma4RMSNorm`): normalise and scale by `weight` in float32, then cast to x's dtype;
    `weight` None is the gain-free `v_norm`."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if weight is not None:
        xf = xf * weight.astype(jnp.float32)
    return xf.astype(x.dtype)


def queries(attn: Params, config: DflashConfig, x: jax.Array, rope: base.Rope) -> jax.Array:
    """`q_norm(q_proj(x))` with RoPE, times `d_h ** 0.5` (scale 1 under `attend`'s `d_h ** -0.5`):
    `[batch, S, H] -> [batch, S, n_h, d_h]`."""
    batch, S, _ = x.shape
    d_h = config.head_dim
    q = base.linear(x, attn["q_proj"]).reshape(batch, S, config.num_attention_heads, d_h)
    q = rms_norm(q, attn["q_norm"]["weight"], config.rms_norm_eps)
    return (base.apply_rope(q.astype(jnp.float32), rope) * math.sqrt(d_h)).astype(x.dtype)


def keys_values(attn: Params, config: DflashConfig, x: jax.Array, rope: base.Rope) -> tuple[jax.Array, jax.Array]:
    """`k_norm(k_proj(x))` with RoPE, and `v_norm` of the K projection's output (`attention_k_eq_v`) or of
    `v_proj(x)`, heads-major: `[batch, S, H] -> 2 x [batch, n_kv, S, d_h]`."""
    batch, S, _ = x.shape
    shape = (batch, S, config.num_key_value_heads, config.head_dim)
    k = base.linear(x, attn["k_proj"]).reshape(shape)
    v = k if config.attention_k_eq_v else base.linear(x, attn["v_proj"]).reshape(shape)
    k = base.apply_rope(rms_norm(k, attn["k_norm"]["weight"], config.rms_norm_eps), rope)
    v = rms_norm(v, None, config.rms_norm_eps)
    return k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)


def decoder_layer(
    p: Params, config: DflashConfig, x: jax.Array, attention: Callable[[Params, jax.Array], tuple[jax.Array, Any]]
) -> tuple[jax.Array, Any]:
    """One Gemma 4 layer over `x [batch, S, H]` (sandwich norms, GELU-tanh MLP, `layer_scalar`; the module
    docstring); `attention` as `model.decoder_layer` takes it. Returns the new `x` and `attention`'s aux."""
    eps = config.rms_norm_eps
    a, aux = attention(p["self_attn"], rms_norm(x, p["input_layernorm"]["weight"], eps))
    a = base.linear(a, p["self_attn"]["o_proj"])  # [batch, S, H]
    x = x + rms_norm(a, p["post_attention_layernorm"]["weight"], eps)
    h = rms_norm(x, p["pre_feedforward_layernorm"]["weight"], eps)
    mlp = p["mlp"]
    gate = base.linear(h, mlp["gate_proj"])  # [batch, S, I]
    act = jax.nn.gelu(gate.astype(jnp.float32), approximate=True).astype(gate.dtype)
    h = base.linear(act * base.linear(h, mlp["up_proj"]), mlp["down_proj"])
    x = x + rms_norm(h, p["post_feedforward_layernorm"]["weight"], eps)
    return x * p["layer_scalar"].astype(x.dtype), aux

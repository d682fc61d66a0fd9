"""The drafter forward pass: pure functions over the loader's parameter tree (docs/design.md).

One forward serves the three families (z-lab `dflash/model.py`, SpecForge's DFlash2, DeepSpec's DSpark;
docs/forward.md):

    ctx = hidden_norm(fc(target_hidden))               # context rows, shared by every layer
    x   = embed([anchor, MASK x (B-1)])                # the block
    per layer:  x += o_proj(attention(q from the block; K/V from [earlier context, ctx, block]))
                x += mlp(post_attention_layernorm(x))  # DFlash2: both sublayers wrapped in grouped convs
    hidden = norm(x)                                   # [batch, B, H]

The context enters only as extra keys/values (same k_proj/v_proj, k_norm, RoPE at its own positions); it never
passes through a layer's input norm nor joins the residual stream. A Gemma 4 DSpark drafter (`config.variant`
"gemma4") runs the same forward with Gemma 4's layer and norms (`gemma4_decoder_layer`). `draft_logits` is the plain,
uncached forward; `dflash_jax.drafting.propose` runs the same `forward` with earlier context K/V taken from a cache
(`dflash_jax.linen` and `dflash_jax.nnx` wrap it as Flax modules).

Which keys a query sees (`attention_rules`, under the switches of `AttentionOptions`):
- causal: `AttentionOptions.causal` when given, else `config.is_causal`, else `dflash_config.causal`, else
  "causal exactly on `sliding_attention` layers" -- vLLM's `_dflash_layer_causal` order, the serving rule
  trained checkpoints are run with (docs/references.md §1). Configs without `layer_types` are therefore
  non-causal, like z-lab's reference.
- sliding window (default on): on `sliding_attention` layers of a config with `use_sliding_window` and a
  `sliding_window` w, a query at position p sees keys at positions k with |p - k| <= w - 1: transformers'
  flash-attention rule, which on causal layers is vLLM's causal window. Honouring the trained window decides
  acceptance (docs/references.md §1). `AttentionOptions(sliding_window=False)` ignores windows, as z-lab's
  eager/sdpa paths do.

Numerics: matmuls accumulate in float32 (`preferred_element_type`); float32 runs use full-precision
(`Precision.HIGHEST`) products so they can be compared with a float64/float32 reference, bf16 runs keep bf16
operands. Norms, RoPE, softmax and the LM head run in float32; RoPE angles are formed in float32 exactly as
transformers does (`inv_freq` in float32, `position * inv_freq` in float32: transformers'
`modeling_rope_utils.py`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ._arguments import check_block_inputs, check_heads, check_params
from .attention import Impl, KeyValues, LayerRule, Span, attend, write_slots
from .config import DflashConfig
from .drafter import Drafter
from .layers import Params, decoder_layer, keys_values, linear, lm_logits, queries, rms_norm
from .rope import Rope, apply_rope, rope_tables

__all__ = ["AttentionOptions", "draft_hidden", "draft_logits", "forward", "embed_block", "attention_rules",
           "project_context", "Context", "Memory", "Absorb"]

# --------------------------------------------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AttentionOptions:
    """The drafter's attention switches, one static, hashable value (not a pytree: it decides the program).

    Every entry point takes it as `attention=` (`draft_logits`, `init_cache` / `propose`,
    `speculative_generate`, the Flax modules); a `ContextCache` records the one it was made with. Checked here,
    once, so no entry point repeats the checks.

    causal: True / False forces every layer causal / bidirectional; None takes the config's (module docstring).
    sliding_window: honour the config's trained windows (default); False ignores them, as z-lab's eager/sdpa
    paths do. draft_window / draft_sinks: an opt-in bound for the layers without a trained window (full
    attention): they then see only keys within `draft_window` positions of the query, plus the first
    `draft_sinks` positions (as dflash-mlx's `draft_window_size` / `draft_sink_size`). It changes drafts, so
    acceptance, never the output of greedy speculative decoding. Off by default: the trained behaviour.
    """

    causal: bool | None = None
    sliding_window: bool = True
    draft_window: int | None = None
    draft_sinks: int = 0

    def __post_init__(self) -> None:
        if self.causal is not None and not isinstance(self.causal, bool):
            raise ValueError(f"AttentionOptions.causal must be True, False or None, got {self.causal!r}")
        if not isinstance(self.sliding_window, bool):
            raise ValueError(f"AttentionOptions.sliding_window must be True or False, got {self.sliding_window!r}")
        if self.draft_window is not None:
            object.__setattr__(self, "draft_window", _integer("draft_window", self.draft_window, 1))
        object.__setattr__(self, "draft_sinks", _integer("draft_sinks", self.draft_sinks, 0))
        if self.draft_sinks and self.draft_window is None:
            raise ValueError(f"AttentionOptions.draft_sinks={self.draft_sinks} needs a draft_window (sinks are the "
                             "positions a window keeps visible)")


def _integer(field: str, value: Any, minimum: int) -> int:
    """`value` as a Python int (NumPy integers too: a plain int keeps the rules' arithmetic weakly typed), at least
    `minimum` and within int32 (positions are int32: a wider window would wrap); a bool is not an integer here."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not minimum <= value <= 2**31 - 1:
        raise ValueError(f"AttentionOptions.{field} must be an integer in [{minimum}, 2**31 - 1], got {value!r}")
    return int(value)


def attention_rules(config: DflashConfig, attention: AttentionOptions = AttentionOptions()) -> tuple[LayerRule, ...]:
    """Per-layer causality and window under `attention` (see the module docstring for the rule and why it is the
    default)."""
    sub = config.dflash_config
    rules = []
    for i in range(config.num_hidden_layers):
        sliding = config.layer_types is not None and config.layer_types[i] == "sliding_attention"
        stated = (attention.causal, config.is_causal, sub.causal if sub is not None else None, sliding)
        layer_causal = bool(next(c for c in stated if c is not None))
        trained = sliding and config.use_sliding_window and config.sliding_window is not None
        if attention.sliding_window and trained:
            rules.append(LayerRule(layer_causal, config.sliding_window))
        elif attention.draft_window is not None:
            rules.append(LayerRule(layer_causal, attention.draft_window, attention.draft_sinks))
        else:
            rules.append(LayerRule(layer_causal, None))
    return tuple(rules)


# --------------------------------------------------------------------------------------------------------------
# DFlash2 grouped dynamic causal convolution (SpecForge `dflash2.py`, docs/forward.md)
# --------------------------------------------------------------------------------------------------------------


def _convolve(z: jax.Array, delta: jax.Array, base: jax.Array) -> jax.Array:
    """`y[i, c] = sum_t (base[t, c] + delta[i, t, group(c)]) * z[i - t, c]`, taps before the block start are 0.

    z: [batch, B, H]; delta: [batch, B, taps, G]; base: [taps, H]; channel c is in group c // (H / G).
    """
    batch, rows, hidden = z.shape
    taps, groups = delta.shape[-2:]
    coeff = base.astype(jnp.float32).reshape(taps, groups, hidden // groups) + delta.astype(jnp.float32)[..., None]
    coeff = coeff.reshape(batch, rows, taps, hidden)  # [batch, B, taps, H]
    zf = z.astype(jnp.float32)
    out = coeff[:, :, 0] * zf
    for t in range(1, taps):
        shifted = jnp.pad(zf[:, : rows - t], ((0, 0), (t, 0), (0, 0)))  # z[i - t], zero before the block
        out = out + coeff[:, :, t] * shifted
    return out.astype(z.dtype)


def conv_prepare(p: Params, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Convolve a sublayer's input (side 0); also return the output side's dynamic kernel, made from the input.

    x: [batch, B, H] -> (convolved x [batch, B, H], delta for `conv_finish` [batch, B, taps, G]).
    """
    taps, hidden = p["base_kernel"].shape[1:]
    delta = linear(x, p["kernel_projection"])  # [batch, B, 2 * taps * G]
    delta = delta.reshape(*x.shape[:2], 2, taps, -1)  # [batch, B, side, taps, G]
    return _convolve(x, delta[:, :, 0], p["base_kernel"][0]), delta[:, :, 1]


def conv_finish(p: Params, y: jax.Array, delta: jax.Array) -> jax.Array:
    """Convolve a sublayer's output (side 1) with the kernel `conv_prepare` made from its input."""
    return _convolve(y, delta, p["base_kernel"][1])


def dflash2_around(p: Params, name: str, x: jax.Array, run: Callable[[jax.Array], tuple[jax.Array, Any]]):
    """`layers.decoder_layer`'s sublayer wrapper for DFlash2: where the layer holds the conv `name`, the sublayer's
    input is convolved before it and its output after it, with the kernel made from the input; else `run(x)`."""
    if name not in p:
        return run(x)
    x, delta = conv_prepare(p[name], x)
    y, aux = run(x)
    return conv_finish(p[name], y, delta), aux


# --------------------------------------------------------------------------------------------------------------
# The decoder
# --------------------------------------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Context:
    """Context rows entering this forward: `hidden_norm(fc(features))` with their positions."""

    hidden: jax.Array  # [batch, S, H]
    positions: jax.Array  # [batch, S] int32
    valid: jax.Array  # [batch, S] bool (False: padding)


def project_context(params: Params, config: DflashConfig, target_hidden: jax.Array) -> jax.Array:
    """`hidden_norm(fc(features))`: `[batch, S, Lf*H]` target features -> `[batch, S, H]` in the params' dtype."""
    dtype = params["fc"]["weight"].dtype
    ctx = linear(target_hidden.astype(dtype), params["fc"])  # [batch, S, H]
    return layer_functions(config).norm(ctx, params["hidden_norm"]["weight"], config.rms_norm_eps)


# --------------------------------------------------------------------------------------------------------------
# Gemma 4's layer: DeepSpec's `Gemma4DSparkModel` (deepspec/modeling/dspark/gemma4/modeling.py)
# --------------------------------------------------------------------------------------------------------------
# The DSpark drafter of this module (context rows `hidden_norm(fc(features))` as extra keys/values, the block
# `[anchor, MASK x (B-1)]`, all B rows drafting, the Markov and confidence heads) built of Gemma 4's layer, which
# `forward` runs for a config whose `variant` is "gemma4" (`layer_functions`). Per layer, over the block rows
# `x [batch, B, H]` and the context rows `ctx [batch, S, H]`:
#
#     h = input_layernorm(x)
#     q = RoPE(q_norm(q_proj(h)));  k = RoPE(k_norm(k_proj([ctx; h])))
#     v = v_norm(k_proj([ctx; h]))   with attention_k_eq_v (no v_proj), else v_norm(v_proj([ctx; h]))
#     x = x + post_attention_layernorm(o_proj(softmax(q . k) v))           attention scale 1, bidirectional
#     x = x + post_feedforward_layernorm(down(gelu_tanh(gate(h')) * up(h'))),  h' = pre_feedforward_layernorm(x)
#     x = x * layer_scalar
#
# `v_norm` is an RMSNorm without a gain. Every layer is one of Gemma 4's full-attention (global) layers:
# `num_attention_heads` heads of `global_head_dim`, KV heads `num_global_key_value_heads` with `attention_k_eq_v`
# (`layouts._fold_gemma4` reads them into `head_dim` / `num_key_value_heads`), RoPE from
# `rope_parameters.full_attention` (usually `proportional`: `rope_frequencies`). Around the layers: the block's
# embeddings times `sqrt(hidden_size)` (`DflashConfig.input_embedding_scale`) and the logits softcapped,
# `c * tanh(logits / c)`, before the Markov bias (`DflashConfig.logit_transform`).
#
# Numerics as transformers' Gemma 4 modules: RMSNorm `x * (mean(x^2) + eps)^-1/2 * weight` in float32, cast once
# (Qwen3's `rms_norm` casts, then multiplies by the gain); GELU-tanh in float32. `attention.attend` scales scores by
# `d_h ** -0.5`, so the queries carry `d_h ** 0.5`, applied in float32 before their one cast.


def gemma4_rms_norm(x: jax.Array, weight: jax.Array | None, eps: float) -> jax.Array:
    """Gemma 4's RMSNorm (`Gemma4RMSNorm`): normalise and scale by `weight` in float32, then cast to x's dtype;
    `weight` None is the gain-free `v_norm`."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if weight is not None:
        xf = xf * weight.astype(jnp.float32)
    return xf.astype(x.dtype)


def gemma4_queries(attn: Params, config: DflashConfig, x: jax.Array, rope: Rope) -> jax.Array:
    """`q_norm(q_proj(x))` with RoPE, times `d_h ** 0.5` (scale 1 under `attend`'s `d_h ** -0.5`):
    `[batch, S, H] -> [batch, S, n_h, d_h]`."""
    batch, S, _ = x.shape
    d_h = config.head_dim
    q = linear(x, attn["q_proj"]).reshape(batch, S, config.num_attention_heads, d_h)
    q = gemma4_rms_norm(q, attn["q_norm"]["weight"], config.rms_norm_eps)
    return (apply_rope(q.astype(jnp.float32), rope) * math.sqrt(d_h)).astype(x.dtype)


def gemma4_keys_values(attn: Params, config: DflashConfig, x: jax.Array, rope: Rope) -> tuple[jax.Array, jax.Array]:
    """`k_norm(k_proj(x))` with RoPE, and `v_norm` of the K projection's output (`attention_k_eq_v`) or of
    `v_proj(x)`, heads-major: `[batch, S, H] -> 2 x [batch, n_kv, S, d_h]`."""
    batch, S, _ = x.shape
    shape = (batch, S, config.num_key_value_heads, config.head_dim)
    k = linear(x, attn["k_proj"]).reshape(shape)
    v = k if config.attention_k_eq_v else linear(x, attn["v_proj"]).reshape(shape)
    k = apply_rope(gemma4_rms_norm(k, attn["k_norm"]["weight"], config.rms_norm_eps), rope)
    v = gemma4_rms_norm(v, None, config.rms_norm_eps)
    return k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)


def gemma4_decoder_layer(
    p: Params, config: DflashConfig, x: jax.Array, attention: Callable[[Params, jax.Array], tuple[jax.Array, Any]]
) -> tuple[jax.Array, Any]:
    """One Gemma 4 layer over `x [batch, S, H]` (sandwich norms, GELU-tanh MLP, `layer_scalar`: the section's
    comment); `attention` as `decoder_layer` takes it. Returns the new `x` and `attention`'s aux."""
    eps = config.rms_norm_eps
    a, aux = attention(p["self_attn"], gemma4_rms_norm(x, p["input_layernorm"]["weight"], eps))
    a = linear(a, p["self_attn"]["o_proj"])  # [batch, S, H]
    x = x + gemma4_rms_norm(a, p["post_attention_layernorm"]["weight"], eps)
    h = gemma4_rms_norm(x, p["pre_feedforward_layernorm"]["weight"], eps)
    mlp = p["mlp"]
    gate = linear(h, mlp["gate_proj"])  # [batch, S, I]
    act = jax.nn.gelu(gate.astype(jnp.float32), approximate=True).astype(gate.dtype)
    h = linear(act * linear(h, mlp["up_proj"]), mlp["down_proj"])
    x = x + gemma4_rms_norm(h, p["post_feedforward_layernorm"]["weight"], eps)
    return x * p["layer_scalar"].astype(x.dtype), aux


class Layers(NamedTuple):
    """The functions a drafter's network is built of: Qwen3's, or Gemma 4's (`gemma4_*`)."""

    norm: Callable[[jax.Array, jax.Array, float], jax.Array]
    queries: Callable[[Params, Any, jax.Array, Rope], jax.Array]
    keys_values: Callable[[Params, Any, jax.Array, Rope], tuple[jax.Array, jax.Array]]
    decoder_layer: Callable[..., tuple[jax.Array, Any]]


def layer_functions(config: DflashConfig) -> Layers:
    """The layer functions of `config.variant`."""
    if config.variant == "gemma4":
        return Layers(gemma4_rms_norm, gemma4_queries, gemma4_keys_values, gemma4_decoder_layer)
    return Layers(rms_norm, queries, keys_values, functools.partial(decoder_layer, around=dflash2_around))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Absorb:
    """A layer's cache that this forward's rows (context rows, then the block) are written into before the block
    attends, so that the cache and they are read as one span by one kernel: for layers whose every query sees every
    key (no causal mask, no window), where the rows would otherwise be a second, dense source."""

    k: jax.Array  # [batch, n_kv, capacity, d_h]
    v: jax.Array  # [batch, n_kv, capacity, d_h]
    slots: jax.Array  # [batch, S + B] int32: each row's slot (>= capacity: not written, not read)
    stop: jax.Array  # [batch] int32: the span `[0, stop)` the block reads once they are written


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Memory:
    """What one layer's block queries read besides this forward's rows: cached context, as `attention` sources."""

    spans: tuple[Span, ...] = ()  # slot ranges every query sees (read unmasked)
    dense: tuple[KeyValues, ...] = ()  # rows masked by the layer's rule (a ring buffer, a window's edge)
    absorb: Absorb | None = None  # a cache this forward's rows join, read as one more span (then not dense)


def forward(
    params: Params,
    config: DflashConfig,
    rules: Sequence[LayerRule],
    x: jax.Array,
    positions: jax.Array,
    context: Context,
    memory: Sequence[Memory] | None = None,
    *,
    impl: Impl = "auto",
) -> tuple[jax.Array, list[tuple[jax.Array, jax.Array]]]:
    """All layers and the final norm over the embedded block `x [batch, B, H]` at `positions [batch, B]`.

    Per layer the block's queries attend to `memory[i]` (earlier context), the new `context` rows and the block
    itself; the context rows enter only as keys/values (same k_proj/v_proj, k_norm, RoPE at their positions).
    Returns `norm(x)` `[batch, B, H]` and, per layer, the context rows' `(k, v)` `[batch, n_kv, S, d_h]`, or
    for a layer whose memory has an `absorb`, its cache `(k, v)` with this forward's rows written.
    """
    batch, B, _ = x.shape
    S = context.hidden.shape[1]
    rope = rope_tables(config, jnp.concatenate([context.positions, positions], axis=1))  # context rows, then block
    block_rope = Rope(rope.cos[:, S:], rope.sin[:, S:])
    key_positions = jnp.concatenate([context.positions, positions], axis=1)  # [batch, S + B]
    key_valid = jnp.concatenate([context.valid, jnp.ones((batch, B), bool)], axis=1)
    layers = layer_functions(config)
    new_kv = []
    for i, (p, rule) in enumerate(zip(params["layers"], rules)):
        mem = memory[i] if memory is not None else Memory()

        def attention(attn, xn, rule=rule, mem=mem):
            q = layers.queries(attn, config, xn, block_rope)  # [batch, B, n_h, d_h]
            k, v = layers.keys_values(attn, config, jnp.concatenate([context.hidden, xn], axis=1), rope)  # one GEMM
            sinks = attn.get("attention_sink_bias")  # [n_h] or None (`DflashConfig.attention_sinks`)
            if mem.absorb is None:
                fresh = KeyValues(k, v, key_positions, key_valid)  # [batch, n_kv, S + B, d_h]
                a = attend(q, positions, rule, (fresh, *mem.dense), mem.spans, impl=impl, sink_logits=sinks)
                return a.reshape(batch, B, -1), (k[:, :, :S], v[:, :, :S])
            cache = mem.absorb
            kc, vc = write_slots(cache.k, k, cache.slots), write_slots(cache.v, v, cache.slots)
            span = Span(kc, vc, jnp.zeros_like(cache.stop), cache.stop)
            a = attend(q, positions, rule, mem.dense, (*mem.spans, span), impl=impl, sink_logits=sinks)
            return a.reshape(batch, B, -1), (kc, vc)

        x, kv = layers.decoder_layer(p, config, x, attention)
        new_kv.append(kv)
    return layers.norm(x, params["norm"]["weight"], config.rms_norm_eps), new_kv


def embed_block(config: DflashConfig, embed: jax.Array, block_ids: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """`embed[block_ids]` `[batch, B] -> [batch, B, H]`, times `input_embedding_scale` when the config has one."""
    x = jnp.take(embed, block_ids, axis=0).astype(dtype)
    if config.input_embedding_scale is not None:
        x = x * jnp.asarray(config.input_embedding_scale, dtype)
    return x


@functools.partial(jax.jit, static_argnames=("attention",))
def draft_hidden(
    drafter: Drafter, target_hidden: jax.Array, block_ids: jax.Array, *, context_positions: jax.Array,
    block_positions: jax.Array, attention: AttentionOptions = AttentionOptions(),
) -> jax.Array:
    """The drafter's final hidden states (after `norm`) for every block row: `[batch, B, H]`, uncached.

    target_hidden: `[batch, S, Lf*H]` target features at `target_layer_ids`, shallow to deep;
    block_ids: `[batch, B]` (`[anchor, MASK x (B-1)]`); positions: `[batch, S]` / `[batch, B]` RoPE positions;
    attention: the attention rule (`AttentionOptions`, `attention_rules`). The block is embedded with the
    drafter's own embedding, else the target's attached with `Drafter.attach`. Shapes are checked against the
    config when the program is traced; under `jit` the ids' values are not (an id past the vocabulary would be
    clamped by the gather).
    """
    params, config = drafter.params, drafter.config
    check_params(config, params, "draft_hidden")
    check_heads(config, "draft_hidden", drafter.embed, drafter.lm_head)  # attached ones: a Drafter built by hand too
    check_block_inputs(config, "draft_hidden", target_hidden, block_ids, context_positions, block_positions)
    dtype = params["fc"]["weight"].dtype
    context = Context(
        project_context(params, config, target_hidden),
        context_positions.astype(jnp.int32),
        jnp.ones(context_positions.shape, bool),
    )
    x = embed_block(config, drafter.embedding, block_ids, dtype)
    rules = attention_rules(config, attention)
    hidden, _ = forward(params, config, rules, x, block_positions.astype(jnp.int32), context)
    return hidden


def draft_logits(
    drafter: Drafter, target_hidden: jax.Array, block_ids: jax.Array, *, context_positions: jax.Array,
    block_positions: jax.Array, attention: AttentionOptions = AttentionOptions(), checked: bool = False,
) -> jax.Array:
    """Float32 logits `[batch, B, V]` for every block row: `lm_head(draft_hidden(...))`, uncached.

    The plain LM-head output (the drafter's own head, else the target's attached with `Drafter.attach`), before
    any Markov bias (DSpark) or DFlash2 softcap/multiplier. Arguments as `draft_hidden`. The forward is
    jitted, so the ids' values are not checked there (an id past the vocabulary is clamped by the gather);
    `checked=True` checks them eagerly first (concrete inputs only; it reads `block_ids` back to the host).
    """
    if checked:
        check_block_inputs(drafter.config, "draft_logits", target_hidden, block_ids, context_positions,
                           block_positions)
    return _draft_logits(drafter, target_hidden, block_ids, context_positions=context_positions,
                         block_positions=block_positions, attention=attention)


@functools.partial(jax.jit, static_argnames=("attention",))
def _draft_logits(
    drafter: Drafter, target_hidden: jax.Array, block_ids: jax.Array, *, context_positions: jax.Array,
    block_positions: jax.Array, attention: AttentionOptions,
) -> jax.Array:
    hidden = draft_hidden(drafter, target_hidden, block_ids, context_positions=context_positions,
                          block_positions=block_positions, attention=attention)
    return lm_logits(hidden, drafter.output_head)

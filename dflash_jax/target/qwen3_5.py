"""The Qwen3.5 / 3.6 hybrid text target: Gated DeltaNet linear attention on most layers, gated full attention on
every `full_attention_interval`-th, a dense SwiGLU MLP on all (transformers 5.24.0 `models/qwen3_5/
modeling_qwen3_5.py`; the config in `target.qwen3_5_config`), or in the MoE variant (`qwen3_5_moe`,
`models/qwen3_5_moe/modeling_qwen3_5_moe.py`) the sparse MoE block on all (`target.moe.moe_block`; the experts
read from either stored layout by `target.experts.add_expert_stacks`).

Per layer, pre-norm (`x += mixer(norm(x))`, `x += mlp(norm(x))`); every RMSNorm but the delta-net's output norm is
zero-centred: `(1 + w) * x_hat`, computed in float32 (`Qwen3_5RMSNorm`).

- Gated attention: `q_proj` gives per head `[query | gate]` (2 d_h); per-head (1 + w) q/k norms; RoPE on the first
  `partial_rotary_factor * d_h` dimensions of each head only; GQA over the KV cache as the dense target
  (`steps.cached_attention`); the output times `sigmoid(gate)`, then `o_proj`.
- Gated DeltaNet: `target.delta_net` (its parameters, their split, its state and forward). Prefill runs the
  chunked form (the WY / UT transform within `delta_chunk` rows, the state carried across), a verify block as one
  chunk keeping each row's state.

Cache (`HybridCache`): full-attention layers a KV cache as the dense target's (slot t = position t, the loop's
`lengths` say what is committed); delta-net layers the conv state and the recurrent state, which have no
position and so must be committed explicitly: `__call__` returns a `PendingCache`, `commit(pending, kept)` the
state after the first `kept[b]` new tokens.

Pending cache (the choice): per delta-net layer the recurrent state before the block and after each of its S rows,
`[batch, S + 1, n_v, d_k, d_v]` float32, and the conv window `[batch, K - 1 + S, C]` (C: the q, k and v channels);
commit picks row `kept` of each (a gather, no recompute). Memory: (S + 1) x the state. At Qwen3.5-27B's shapes (48
delta-net layers; 48 value heads, d_k = d_v = 128) a state is 3 MiB per layer and sequence, 144 MiB per sequence in
all, so a 16-token verify holds 2.4 GiB per sequence while it lives (one verify step). Alternatives, both keeping
only the state before the block plus per row `S x (d_k + d_v + 2)` numbers per head (1/64 of the states here):
snapshot + replay (the rows' k, v, g, beta; `commit` reruns the first `kept` recurrent steps: S more steps per layer
per verify), or a tape (each row's rank-1 update `k_t delta_t^T` and decay; `commit` sums the kept ones, `S_k =
exp(G_k) S_0 + sum_{t<k} exp(G_k - G_t) k_t delta_t^T`, one masked `[d_k, S] x [S, d_v]` product per head). The
states are kept because `commit` is then a gather of the very arrays the verify produced; the tape is the way out
when batch x S makes them too large.

Tensor parallelism (`Layout`, the other mesh axes splitting the batch): attention q (with its gate) / k / v by
head, o by input, the KV cache by KV head, as the dense target; the dense MLP and the MoE block's shared expert
Megatron-style over `MLP`; each routed expert's width over the tensor axis (`moe.moe_parameter_spec`: every device a
slice of every expert); the vocabulary (embedding, LM head); the delta-net layers by head, ONE input product per
device (`in_proj`: its rows, and the conv's, read permuted so that each device's block is its heads' q, k, v, z, b, a;
`target.delta_net`). The tensor axis must divide
`num_attention_heads`, `linear_num_key_heads`, `linear_num_value_heads`, `vocab_size`, the MLP widths
(`intermediate_size`, or `moe_intermediate_size` and `shared_expert_intermediate_size`), and divide or be a
multiple of `num_key_value_heads` (`ConfigError` naming the field, before anything is read).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._arguments import check_integer
from .._shapes import zeros
from ..attention import span_capacity
from ..errors import ConfigError
from ..layers import linear, lm_logits
from ..plan import TensorPlan, planned
from ..platform import platform_of, process_platform
from ..rope import Rope, apply_rope, rope_tables
from ..safetensors import Checkpoint
from ..spec import EMBED, HEADS, KV_HEADS, MLP, NORM, VOCAB, Bias, ParamSpec
from . import PREFILL_CHUNK, FeatureMap, TargetOutput, check_layer_ids
from .delta_net import (
    CONV_AXES,
    IN_PROJ,
    STATE_AXES,
    add_delta_net_views,
    conv_sizes,
    conv_state,
    delta_net,
    delta_net_spec,
    in_proj_sizes,
    stored_in_proj,
)
from .experts import GATE_UP, add_expert_stacks
from .family import Family
from .layout import CACHE_AXES, ROWS_AXES, Layout, make_layout, tensor_shards
from .moe import moe_block, moe_parameter_spec
from .qwen3_5_config import ARCHITECTURES, FULL_ATTENTION, MOE_ARCHITECTURES, Qwen3_5Config, parse_qwen3_5_config
from .sections import Sectioned
from .steps import cached_attention, prefill_chunks
from .views import Fused, TensorViews, fuse

__all__ = ["Qwen3_5Target", "HybridCache", "parameter_spec", "plan_qwen3_5"]

log = logging.getLogger("dflash_jax")

Params = dict[str, Any]
MULTIMODAL_PREFIX = "model.language_model."  # the text model's tensors in a Qwen3_5ForConditionalGeneration
NOT_TEXT = ("model.visual.", "mtp.")  # a multimodal checkpoint's vision tower and multi-token-prediction head
FUSED: tuple[Fused, ...] = (GATE_UP,)  # tensors stored fused that the tree holds in parts


# --------------------------------------------------------------------------------------------------------------
# The parameters, declared once
# --------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Offset:
    """N(0, 0.1^2): the offsets `w` of a zero-centred RMSNorm `(1 + w) * x_hat`."""

    def host(self, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        return (0.1 * rng.standard_normal(shape)).astype(np.float32)

    def device(self, key: jax.Array, shape: tuple[int, ...], dtype: jnp.dtype) -> jax.Array:
        return 0.1 * jax.random.normal(key, shape, dtype)


def parameter_spec(c: Qwen3_5Config) -> list[ParamSpec]:
    """The tensors of a `qwen3_5_text` checkpoint of `c` (HF names, `model.` root; `{i}`: a layer; `self_attn.`
    ones exist on full-attention layers only, `linear_attn.` ones on delta-net layers only, `plan_qwen3_5`).

    Axes as the dense target's: q (with its gate) / k / v and gate / up split by output, o and down by input,
    embedding and LM head by the vocabulary, the norms replicated; the delta-net's by head, its input projections
    as one tensor (`delta_net.delta_net_spec`). An MoE config's `mlp.` tensors are
    the MoE block's (`moe.moe_parameter_spec`: the experts as `[E, ...]` stacks). The tree's parts of a tensor
    stored fused (`FUSED`), and the delta net's `in_proj` stored as four, are read by `stored_views`.
    """
    H, I, d_h = c.hidden_size, c.intermediate_size, c.head_dim
    q_dim, kv_dim = c.num_attention_heads * d_h, c.num_key_value_heads * d_h
    offset = Offset()
    layer, attn, delta, mlp = "model.layers.{i}.", "model.layers.{i}.self_attn.", "model.layers.{i}.linear_attn.", \
        "model.layers.{i}.mlp."
    specs = [ParamSpec("model.embed_tokens.weight", (c.vocab_size, H), axes=(VOCAB, EMBED)),
             ParamSpec("model.norm.weight", (H,), NORM, (EMBED,), offset)]
    if not c.tie_word_embeddings:
        specs.append(ParamSpec("lm_head.weight", (c.vocab_size, H), axes=(VOCAB, EMBED)))
    specs += [
        ParamSpec(layer + "input_layernorm.weight", (H,), NORM, (EMBED,), offset),
        ParamSpec(layer + "post_attention_layernorm.weight", (H,), NORM, (EMBED,), offset),
        *(moe_parameter_spec(c, mlp) if c.is_moe else [
            ParamSpec(mlp + "gate_proj.weight", (I, H), axes=(MLP, EMBED)),
            ParamSpec(mlp + "up_proj.weight", (I, H), axes=(MLP, EMBED)),
            ParamSpec(mlp + "down_proj.weight", (H, I), axes=(EMBED, MLP))]),
        ParamSpec(attn + "q_proj.weight", (2 * q_dim, H), axes=(HEADS, EMBED)),  # per head [query | gate]
        ParamSpec(attn + "k_proj.weight", (kv_dim, H), axes=(KV_HEADS, EMBED)),
        ParamSpec(attn + "v_proj.weight", (kv_dim, H), axes=(KV_HEADS, EMBED)),
        ParamSpec(attn + "o_proj.weight", (H, q_dim), axes=(EMBED, HEADS)),
        ParamSpec(attn + "q_norm.weight", (d_h,), NORM, (None,), offset),
        ParamSpec(attn + "k_norm.weight", (d_h,), NORM, (None,), offset),
    ]
    if c.attention_bias:
        specs += [ParamSpec(attn + "q_proj.bias", (2 * q_dim,), axes=(HEADS,), init=Bias()),
                  ParamSpec(attn + "k_proj.bias", (kv_dim,), axes=(KV_HEADS,), init=Bias()),
                  ParamSpec(attn + "v_proj.bias", (kv_dim,), axes=(KV_HEADS,), init=Bias()),
                  ParamSpec(attn + "o_proj.bias", (H,), axes=(EMBED,), init=Bias())]
    return specs + delta_net_spec(c, delta)


def plan_qwen3_5(config: Qwen3_5Config, prefix: str = "model.") -> list[TensorPlan]:
    """Every tensor of the tree, layer by layer, each layer's mixer as its type says, as `stored_views` shows a
    checkpoint of `config` (fused tensors as their parts); stored under `prefix` instead of `model.`
    (`MULTIMODAL_PREFIX` in a multimodal checkpoint), tree paths `model.`-less."""
    specs, plan = parameter_spec(config), []
    for s in specs:
        if "{i}" not in s.name:
            plan.append(planned(s, _stored(s.name, prefix), root="model."))
    for i, kind in enumerate(config.layer_types):
        skip = ".linear_attn." if kind == FULL_ATTENTION else ".self_attn."
        for s in specs:
            if "{i}" in s.name and skip not in s.name:
                s = s._replace(name=s.name.format(i=i))
                plan.append(planned(s, _stored(s.name, prefix), root="model."))
    return plan


def _stored(name: str, prefix: str) -> str:
    return prefix + name.removeprefix("model.") if name.startswith("model.") else name


def stored_views(stored: Checkpoint, c: Qwen3_5Config, prefix: str, shards: int = 1) -> TensorViews:
    """`stored` (its layers under `prefix`) as `plan_qwen3_5` plans it, split over `shards` devices: each delta-net
    layer's input projections as one (its rows, and the conv's, in `shards` blocks: `delta_net.add_delta_net_views`),
    each MoE block's experts as stacks (`experts.add_expert_stacks`)."""
    views = TensorViews(stored)
    for i, kind in enumerate(c.layer_types):
        if kind != FULL_ATTENTION:
            add_delta_net_views(views, f"{prefix}layers.{i}.linear_attn.", c, shards)
        if c.is_moe:
            add_expert_stacks(views, f"{prefix}layers.{i}.mlp.", c)
    return views


def fuse_stored(arrays: dict[str, np.ndarray], c: Qwen3_5Config) -> dict[str, np.ndarray]:
    """One-device tree-layout tensors of `c` (by checkpoint name) as a checkpoint stores them (`FUSED`, each
    delta-net `in_proj` as its four tensors, `delta_net.stored_in_proj`): for writing test checkpoints;
    `stored_views` reads them back."""
    out = fuse(arrays, FUSED)
    for name in [n for n in arrays if n.endswith(".linear_attn." + IN_PROJ)]:
        prefix = name.removesuffix(IN_PROJ)
        out |= {prefix + part: rows for part, rows in stored_in_proj(c, out.pop(name)).items()}
    return out


# --------------------------------------------------------------------------------------------------------------
# Caches
# --------------------------------------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HybridCache:
    """The committed cache: per full-attention layer `k`, `v` `[batch, n_kv, T, d_h]` (slot t = position t); per
    delta-net layer `conv`, the conv's last K - 1 inputs `[batch, K - 1, C]` (C: the q, k and v channels, in the
    conv weight's order, `target.delta_net`; params dtype), and `state` `[batch, n_v, d_k, d_v]` float32. Layers
    in model order within each tuple; on a mesh every array but the batch split by head (`CACHE_AXES`,
    `delta_net.CONV_AXES`, `STATE_AXES`)."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    conv: tuple[jax.Array, ...]
    state: tuple[jax.Array, ...]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PendingCache:
    """A cache after `__call__` over S new tokens, before `commit`: `k`, `v` with all S rows written; per
    delta-net layer `conv` `[batch, K - 1 + S, C]` (the committed conv state, then the S rows'
    inputs), and `state` `[batch, S + 1, n_v, d_k, d_v]` (the committed state, then the state after each new
    row)."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    conv: tuple[jax.Array, ...]
    state: tuple[jax.Array, ...]


@jax.jit
def commit(pending: PendingCache, kept: jax.Array) -> HybridCache:
    """The committed cache after keeping the first `kept [batch]` (0..S) of a `__call__`'s S new tokens: each
    delta-net layer's conv state and recurrent state after exactly those rows (0: the state before the call);
    the K/V are passed through (the loop's lengths trim them). Shapes do not depend on S."""
    kept = kept.astype(jnp.int32)
    taps = lambda window, states: window.shape[1] - states.shape[1] + 2  # noqa: E731  (K - 1 + S) - (S + 1) + 2
    conv = tuple(conv_state(window, kept, taps(window, s)) for window, s in zip(pending.conv, pending.state))
    state = tuple(jnp.take_along_axis(s, kept[:, None, None, None, None], axis=1)[:, 0] for s in pending.state)
    return HybridCache(pending.k, pending.v, conv, state)


# --------------------------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, repr=False)  # `HFTarget.__repr__`: a summary
class Qwen3_5Target(Family):
    """A Qwen3.5 / 3.6 hybrid text model, dense or MoE as its config says (module docstring). A pytree (params
    as leaves; config and layout static). Implements `Target`, with the delta-net state committed by `commit`.

    `params`: HF names with `model.` (or `model.language_model.`) stripped; `params["layers"][i]` holds
    `self_attn` (full attention) or `linear_attn` (Gated DeltaNet), `mlp` (dense, or the MoE block's tree,
    `target.moe`) and the two norms.
    """

    params: Params
    config: Qwen3_5Config = dataclasses.field(metadata=dict(static=True))
    layout: Layout | None = dataclasses.field(default=None, metadata=dict(static=True))

    ARCHITECTURES = (*ARCHITECTURES, *MOE_ARCHITECTURES)
    PREFIXES = (MULTIMODAL_PREFIX, "model.")  # the text model of a multimodal checkpoint, else a text-only one
    IGNORED = NOT_TEXT

    @classmethod
    def parse(cls, raw: dict[str, Any], source: str) -> Qwen3_5Config:
        return parse_qwen3_5_config(raw, source=source)

    @classmethod
    def plan(cls, config: Qwen3_5Config, prefix: str = "model.") -> list[TensorPlan]:
        return plan_qwen3_5(config, prefix)

    @classmethod
    def views(cls, checkpoint: Checkpoint, config: Qwen3_5Config, prefix: str,
              layout: Layout | None = None) -> TensorViews:
        """MoE experts read fused (as released) or per expert, each delta-net layer's input projections as one, its
        rows and the conv's in the layout's blocks (`stored_views`)."""
        return stored_views(checkpoint, config, prefix, tensor_shards(layout))

    @classmethod
    def layout_for(cls, config: Qwen3_5Config, mesh: jax.sharding.Mesh, tensor_axis: str | None,
                   source: str) -> Layout:
        """`layout.make_layout`, plus the delta-net's value and key heads and an MoE block's expert and
        shared-expert widths, which split over the tensor axis too."""
        layout = make_layout(config, mesh, tensor_axis, source)
        fields = ("linear_num_value_heads", "linear_num_key_heads",
                  *(("moe_intermediate_size", "shared_expert_intermediate_size") if config.is_moe else ()))
        odd = [f"{field}={getattr(config, field)}" for field in fields if getattr(config, field) % layout.tensor_size]
        if odd:
            raise ConfigError(
                f"{source}: tensor axis {tensor_axis!r} has {layout.tensor_size} devices, which does not divide "
                f"{', '.join(odd)}; expected a tensor-parallel size dividing the delta-net key and value heads and "
                "the MoE widths too"
            )
        return layout

    def sectioned(self) -> Sectioned:
        """Each delta-net layer's `in_proj` and conv (`delta_net`: rows in the tensor axis' blocks)."""
        c = self.config
        layers = tuple(i for i, kind in enumerate(c.layer_types) if kind != FULL_ATTENTION)
        return Sectioned(layers, "linear_attn", {"in_proj": in_proj_sizes(c), "conv1d": conv_sizes(c)})

    def describe(self) -> str:
        c = self.config
        return (f"qwen3_5{'_moe' if c.is_moe else ''} target, {c.num_hidden_layers} layers "
                f"({c.layer_types.count(FULL_ATTENTION)} full attention), hidden={c.hidden_size}, vocab={c.vocab_size}")

    def init_cache(self, batch_size: int, max_length: int) -> HybridCache:
        """An empty cache for `batch_size` sequences of up to `max_length` positions: K/V as the dense target's
        (`attention.span_capacity` slots, params dtype), conv states in the params' dtype, float32 states (zero:
        transformers' initial state); on a mesh split as the module docstring says."""
        c, dtype = self.config, self.embed.dtype
        kinds = c.layer_types
        n_full = kinds.count(FULL_ATTENTION)
        n_delta = len(kinds) - n_full

        def zeros_at(shape, dtype, axes):
            return zeros(shape, dtype, None if self.layout is None else self.layout.sharding(axes, batch_size))

        kv = (batch_size, c.num_key_value_heads, span_capacity(max_length, platform_of(self.embed).tuning), c.head_dim)
        state = (batch_size, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim)
        return HybridCache(
            tuple(zeros_at(kv, dtype, CACHE_AXES) for _ in range(n_full)),
            tuple(zeros_at(kv, dtype, CACHE_AXES) for _ in range(n_full)),
            tuple(zeros_at((batch_size, c.linear_conv_kernel_dim - 1, sum(conv_sizes(c))), dtype, CONV_AXES)
                  for _ in range(n_delta)),
            tuple(zeros_at(state, jnp.float32, STATE_AXES) for _ in range(n_delta)))

    def __call__(self, tokens: jax.Array, cache: HybridCache, lengths: jax.Array, *,
                 layer_ids: tuple[int, ...] = ()) -> TargetOutput:
        """Run `tokens [batch, S]` at positions `lengths .. lengths + S - 1` after the committed `cache`.

        Returns float32 logits `[batch, S, V]`, the features at `layer_ids` `[batch, S, Lf * H]` and a
        `PendingCache` (K/V written for all S rows; per delta-net layer the state after each row), to be
        committed with `commit(pending, kept)` before the next call. `lengths + S <= T`.
        """
        return _forward(self, tokens, cache, lengths, tuple(layer_ids))

    def commit(self, pending: PendingCache, kept: jax.Array) -> HybridCache:
        """The committed cache after keeping the first `kept [batch]` (0..S) new tokens of the last `__call__`:
        exactly the cache of running only those tokens (`commit`)."""
        return commit(pending, kept)

    def prefill(self, tokens: jax.Array, cache: HybridCache, lengths: jax.Array, *, layer_ids: tuple[int, ...] = (),
                chunk: int = PREFILL_CHUNK, delta_chunk: int | None = None, project: FeatureMap | None = None
                ) -> TargetOutput:
        """Run right-padded prompts `tokens [batch, P]` (`lengths [batch]` real tokens) into an empty cache, `chunk`
        token rows at a time over the whole batch (`chunk // batch` of each prompt: a step's activations, the MoE
        tiles among them, are those of `chunk` tokens whatever the batch; `steps.prefill_chunks`) through every
        layer (attention chunked as the dense target's; the delta rule chunked by `delta_chunk` rows within,
        default the embedding's device kind's `tuning.Tuning.delta_chunk`, its state carried across; padding rows
        leave the states untouched). Returns the features of every row `[batch, P, Lf * H]` (a `FeatureMap`
        `project`: its map of them, made a chunk at a time), the logits of each prompt's last token `[batch, V]`
        float32, and the committed cache after each prompt's real tokens. A chunk or delta chunk below 1 or not an
        int: `ValueError`/`TypeError`.
        """
        chunk = check_integer("prefill", "chunk", chunk, 1)
        if delta_chunk is None:
            delta_chunk = platform_of(self.embed).tuning.delta_chunk
        delta_chunk = check_integer("prefill", "delta_chunk", delta_chunk, 1)
        return _prefill(self, tokens, cache, lengths, project, tuple(layer_ids), chunk, delta_chunk)


# --------------------------------------------------------------------------------------------------------------
# The forward's pieces
# --------------------------------------------------------------------------------------------------------------


def centred_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Qwen3.5's RMSNorm: `(1 + w) * x_hat`, normalised and scaled in float32, then cast to x's dtype."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


def _partial_rope(x: jax.Array, rope: Rope) -> jax.Array:
    """RoPE on the first rotary dimensions of each head of `x [batch, S, heads, d_h]`; the rest pass through."""
    rot = rope.cos.shape[-1]
    return jnp.concatenate([apply_rope(x[..., :rot], rope), x[..., rot:]], axis=-1)


def _gated_attention(target: Qwen3_5Target, p: Params, xn: jax.Array, rope: Rope, past_k: jax.Array,
                     past_v: jax.Array, positions: jax.Array, start: jax.Array):
    """One full-attention layer's mixer over `xn [batch, S, H]`: `(out [batch, S, H], past_k, past_v)` with the
    new rows' K/V written at `positions` (`steps.cached_attention`: the cache's `[0, start)` and causal new rows)."""
    c = target.config
    batch, S, _ = xn.shape
    n_h, n_kv, d_h, eps = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps
    q, gate = jnp.split(linear(xn, p["q_proj"]).reshape(batch, S, n_h, 2 * d_h), 2, axis=-1)  # [batch, S, n_h, d_h]
    q = _partial_rope(centred_norm(q, p["q_norm"]["weight"], eps), rope)
    k = _partial_rope(centred_norm(linear(xn, p["k_proj"]).reshape(batch, S, n_kv, d_h), p["k_norm"]["weight"], eps),
                      rope)
    v = linear(xn, p["v_proj"]).reshape(batch, S, n_kv, d_h)
    out, past_k, past_v = cached_attention(target.layout, n_h, q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3),
                                     past_k, past_v, positions, start, None)
    out = out.reshape(batch, S, n_h * d_h) * jax.nn.sigmoid(gate.reshape(batch, S, n_h * d_h))
    return linear(out, p["o_proj"]), past_k, past_v


def _layers(target: Qwen3_5Target, tokens: jax.Array, cache: HybridCache, start: jax.Array,
            layer_ids: tuple[int, ...], valid: jax.Array | None, delta_chunk: int):
    """All layers over `tokens [batch, S]` at positions `start[b] ..`: `(hidden [batch, S, H], features, cache)`,
    the cache pending (`valid` None) or committed (prefill; `valid [batch, S]` the real rows), `delta_net`."""
    params, c, layout = target.params, target.config, target.layout
    N, eps = c.num_hidden_layers, c.rms_norm_eps
    batch, S = tokens.shape
    positions = start[:, None] + jnp.arange(S, dtype=jnp.int32)  # [batch, S]
    rope = rope_tables(c.rotary, positions)  # cos/sin [batch, S, rotary dims]
    with jax.named_scope("embed"):  # scopes: names in the HLO metadata, for profiles (benchmarks/gpu_trace.py)
        x = x0 = jnp.take(target.embed, tokens, axis=0).astype(target.embed.dtype)  # [batch, S, H]
    keys, values, convs, states = list(cache.k), list(cache.v), list(cache.conv), list(cache.state)
    by_id: dict[int, jax.Array] = {}
    a = d = 0  # the next attention / delta-net layer's cache entry
    for i, p in enumerate(params["layers"]):
        xn = centred_norm(x, p["input_layernorm"]["weight"], eps)
        if "self_attn" in p:
            with jax.named_scope("gated_attention"):
                out, keys[a], values[a] = _gated_attention(target, p["self_attn"], xn, rope, keys[a], values[a],
                                                           positions, start)
            a += 1
        else:
            with jax.named_scope("delta_net"):
                out, convs[d], states[d] = delta_net(c, layout, p["linear_attn"], xn, convs[d], states[d], valid,
                                                     delta_chunk)
            d += 1
        x = x + out
        h, mlp = centred_norm(x, p["post_attention_layernorm"]["weight"], eps), p["mlp"]
        if c.is_moe:
            with jax.named_scope("moe"):
                x = x + moe_block(mlp, c, h)
        else:
            with jax.named_scope("mlp"):
                x = x + linear(jax.nn.silu(linear(h, mlp["gate_proj"])) * linear(h, mlp["up_proj"]),
                               mlp["down_proj"])
        if layout is not None:  # the row-parallel o/down sums end replicated over the tensor axis
            x = layout.constrain(x, ROWS_AXES)
        if i in layer_ids and i < N - 1:
            by_id[i] = x
    with jax.named_scope("final_norm"):
        hidden = centred_norm(x, params["norm"]["weight"], eps)
    by_id |= {-1: x0, N - 1: hidden}
    features = jnp.concatenate([by_id[l] for l in layer_ids], axis=-1) if layer_ids else jnp.zeros((batch, S, 0),
                                                                                                     x0.dtype)
    kind = HybridCache if valid is not None else PendingCache
    return hidden, features, kind(tuple(keys), tuple(values), tuple(convs), tuple(states))


@functools.partial(jax.jit, static_argnames=("layer_ids",))
def _forward(target: Qwen3_5Target, tokens: jax.Array, cache: HybridCache, lengths: jax.Array,
             layer_ids: tuple[int, ...]) -> TargetOutput:
    check_layer_ids(layer_ids, target.config.num_hidden_layers)
    hidden, features, pending = _layers(target, tokens, cache, lengths.astype(jnp.int32), layer_ids, None,
                                        process_platform().tuning.delta_chunk)
    with jax.named_scope("lm_head"):
        logits = lm_logits(hidden, target.lm_head)
    return TargetOutput(logits, features, pending)


@functools.partial(jax.jit, static_argnames=("layer_ids", "chunk", "delta_chunk"), donate_argnames=("cache",))
def _prefill(target: Qwen3_5Target, tokens: jax.Array, cache: HybridCache, lengths: jax.Array,
             project: FeatureMap | None, layer_ids: tuple[int, ...], chunk: int, delta_chunk: int) -> TargetOutput:
    check_layer_ids(layer_ids, target.config.num_hidden_layers)
    lengths = lengths.astype(jnp.int32)

    def run(piece, cache, start):
        valid = start[:, None] + jnp.arange(piece.shape[1]) < lengths[:, None]  # [batch, chunk]
        return _layers(target, piece, cache, start, layer_ids, valid, delta_chunk)

    zeros = jnp.zeros((tokens.shape[0], target.config.hidden_size), target.embed.dtype)
    last_hidden, features, cache = prefill_chunks(run, tokens, cache, lengths, chunk, zeros, project)
    return TargetOutput(lm_logits(last_hidden, target.lm_head), features, cache)

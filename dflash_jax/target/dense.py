"""The dense decoder target (Qwen3 and Llama 3.x: one forward, the architectures differing only in their config
class), with its parameters declared once and its tensor-parallel placement.

`DecoderTarget.from_pretrained(path, mesh=..., tensor_axis="model")` loads a checkpoint (config.json +
safetensors, sharded or not) with the package's header-first reader; `Qwen3Target.from_pretrained(path)` reads a
Qwen3 directory only. The forward runs the new tokens of each sequence against a static-shape KV cache and
returns, besides the final hidden states, the target features a DFlash-family drafter reads (`dflash_jax.target`).

KV cache: `KVCache(k, v)`, per layer `[batch, n_kv, T, d_h]`; slot t holds position t. The cache itself carries
no length: the caller keeps `lengths [batch]` (tokens committed per sequence). A forward over `S` new tokens
attends to slots `[0, lengths)` (only those are read: `attention.Span`) and causally among the new rows, then
writes their K/V at slots `lengths .. lengths + S - 1`, so slots beyond a sequence's length are never read:
trimming the cache to an accepted prefix is just passing a smaller length next time (the rejected slots are
overwritten). Sequences of a batch may have different lengths; prompts of different lengths are right-padded.
`prefill` runs a long prompt in chunks and returns only the last token's logits.

Tensor parallelism (Megatron-style, through jax.sharding): every parameter is declared once with logical axes
(`parameter_spec`); a `Layout` maps them onto a mesh: q/k/v and gate/up split by output, o and down by input,
KV heads split (replicated where the tensor axis is larger than `num_key_value_heads`), embedding and LM head
split over the vocabulary, the cache by KV heads; the other mesh axes split the batch. GSPMD inserts the
collectives (an all-reduce after o and down; the vocabulary-sharded embedding lookup and LM head are a local
gather / matmul plus a reduction, never a gathered table); attention runs per device under `shard_map`.

Parameter tree (`DecoderTarget.params`): HF names with `model.` stripped, as the drafter's (docs/design.md);
`params["layers"]` is a tuple of per-layer dicts (each weight its own buffer, as placed), run unrolled, every
matmul reading its weights in place.

One decoder layer serves the drafter and the targets (`layers.decoder_layer`, `layers.queries` /
`layers.keys_values`, `attention.attend`: GQA, float32 online softmax).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, ClassVar, Literal

import jax
import jax.numpy as jnp

from .._arguments import check_integer
from .._shapes import zeros
from ..attention import (
    PREFILL_IMPLS,
    Impl,
    check_impl,
    span_capacity,
    use_cudnn,
)
from ..layers import decoder_layer, keys_values, lm_logits, queries, rms_norm
from ..plan import TensorPlan, planned
from ..platform import on_gpu, platform_of, process_platform
from ..rope import rope_tables
from ..spec import EMBED, HEADS, KV_HEADS, MLP, NORM, VOCAB, Bias, Gain, ParamSpec, expand
from . import PREFILL_CHUNK, FeatureMap, KVCache, TargetOutput, check_layer_ids, mapped
from .config import ARCHITECTURES as DECODER_ARCHITECTURES
from .config import DecoderConfig, Qwen3Config, not_a_target, parse_decoder_config
from .family import Family
from .layout import CACHE_AXES, ROWS_AXES, Layout
from .steps import cached_attention, prefill_chunks

__all__ = ["DecoderTarget", "Qwen3Target", "parameter_spec", "plan_decoder"]

log = logging.getLogger("dflash_jax")

Params = dict[str, Any]


# --------------------------------------------------------------------------------------------------------------
# The parameters, declared once: shapes and logical axes
# --------------------------------------------------------------------------------------------------------------

def parameter_spec(c: DecoderConfig) -> list[ParamSpec]:
    """The tensors of a checkpoint of `c` (`spec.ParamSpec`; `{i}`: the layer), with their logical axes.

    Megatron-style axes: q/k/v and gate/up split by output (`HEADS` / `KV_HEADS` / `MLP` on dim 0), o and down by
    input (dim 1), embedding and LM head by the vocabulary; norms and the residual width (`EMBED`) replicated.
    `lm_head.weight` only when untied (a tied checkpoint may carry a copy: ignored, as transformers does).
    """
    H, I, d_h = c.hidden_size, c.intermediate_size, c.head_dim
    q_dim, kv_dim = c.num_attention_heads * d_h, c.num_key_value_heads * d_h
    gain_init = Gain()

    def norm(name: str, shape: tuple[int, ...], axes: tuple[str | None, ...]) -> ParamSpec:
        return ParamSpec(name, shape, kind=NORM, axes=axes, init=gain_init)

    bias_init = Bias()

    def bias(name: str, shape: tuple[int, ...], axes: tuple[str | None, ...]) -> ParamSpec:
        return ParamSpec(name, shape, axes=axes, init=bias_init)

    attn, mlp = "model.layers.{i}.self_attn.", "model.layers.{i}.mlp."
    specs = [ParamSpec("model.embed_tokens.weight", (c.vocab_size, H), axes=(VOCAB, EMBED)),
             norm("model.norm.weight", (H,), (EMBED,))]
    if not c.tie_word_embeddings:
        specs.append(ParamSpec("lm_head.weight", (c.vocab_size, H), axes=(VOCAB, EMBED)))
    # Targets load unquantized checkpoints: their matrices are `spec.FLOAT`, never `LINEAR` (NVFP4-packed).
    specs += [
        norm("model.layers.{i}.input_layernorm.weight", (H,), (EMBED,)),
        norm("model.layers.{i}.post_attention_layernorm.weight", (H,), (EMBED,)),
        ParamSpec(attn + "q_proj.weight", (q_dim, H), axes=(HEADS, EMBED)),
        ParamSpec(attn + "k_proj.weight", (kv_dim, H), axes=(KV_HEADS, EMBED)),
        ParamSpec(attn + "v_proj.weight", (kv_dim, H), axes=(KV_HEADS, EMBED)),
        ParamSpec(attn + "o_proj.weight", (H, q_dim), axes=(EMBED, HEADS)),
    ]
    if c.QK_NORM:
        specs += [norm(attn + "q_norm.weight", (d_h,), (None,)),
                  norm(attn + "k_norm.weight", (d_h,), (None,))]
    specs += [
        ParamSpec(mlp + "gate_proj.weight", (I, H), axes=(MLP, EMBED)),
        ParamSpec(mlp + "up_proj.weight", (I, H), axes=(MLP, EMBED)),
        ParamSpec(mlp + "down_proj.weight", (H, I), axes=(EMBED, MLP)),
    ]
    if c.attention_bias:
        specs += [bias(attn + "q_proj.bias", (q_dim,), (HEADS,)),
                  bias(attn + "k_proj.bias", (kv_dim,), (KV_HEADS,)),
                  bias(attn + "v_proj.bias", (kv_dim,), (KV_HEADS,)),
                  bias(attn + "o_proj.bias", (H,), (EMBED,))]
    if c.mlp_bias:
        specs += [bias(mlp + "gate_proj.bias", (I,), (MLP,)),
                  bias(mlp + "up_proj.bias", (I,), (MLP,)),
                  bias(mlp + "down_proj.bias", (H,), (EMBED,))]
    return specs


def plan_decoder(config: DecoderConfig) -> list[TensorPlan]:
    """Every tensor a checkpoint of `config` holds, with its tree path (HF name, `model.` stripped) and axes."""
    return [planned(s, s.name, root="model.") for s in expand(parameter_spec(config), config.num_hidden_layers)]


# --------------------------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, repr=False)  # `HFTarget.__repr__`: a summary
class DecoderTarget(Family):
    """A dense decoder: RMSNorm, GQA, RoPE, SwiGLU, tied or untied embeddings, and Qwen3's per-head q/k norm where
    the config declares it (`DecoderConfig.QK_NORM`). Qwen3 and Llama 3 are this one class with another config.

    A pytree (params as leaves; config and layout static): pass it whole through `jax.jit`. Implements `Target`;
    loads and shards as every family does (`family.Family`: `from_pretrained`, `shard`). `layout` is None on one
    device, else where the leaves and the cache live on a mesh (`Layout`).
    """

    params: Params
    config: DecoderConfig = dataclasses.field(metadata=dict(static=True))
    layout: Layout | None = dataclasses.field(default=None, metadata=dict(static=True))

    CONFIG: ClassVar[type[DecoderConfig] | None] = None  # the config class read; None: what `architectures` names
    ARCHITECTURES = tuple(DECODER_ARCHITECTURES)

    @classmethod
    def parse(cls, raw: dict[str, Any], source: str) -> DecoderConfig:
        """`raw` as `CONFIG`, else as the config class its `architectures` names (`target.config.ARCHITECTURES`);
        another architecture is a `ConfigError` (`not_a_target`)."""
        names = raw.get("architectures")
        names = [a for a in names if isinstance(a, str)] if isinstance(names, list) else []
        known = [DECODER_ARCHITECTURES[a] for a in names if a in DECODER_ARCHITECTURES]
        if cls.CONFIG is None and not known:
            raise not_a_target(source, raw, list(DECODER_ARCHITECTURES))
        return parse_decoder_config(raw, cls.CONFIG or known[0], source=source)

    @classmethod
    def plan(cls, config: DecoderConfig, prefix: str = "model.") -> list[TensorPlan]:
        return plan_decoder(config)

    def describe(self) -> str:
        c = self.config
        return (f"{c.MODEL_TYPE} target, {c.num_hidden_layers} layers, hidden={c.hidden_size}, heads="
                f"{c.num_attention_heads}/{c.num_key_value_heads}, vocab={c.vocab_size}, "
                f"{'tied' if c.tie_word_embeddings else 'untied'} embeddings")

    def commit(self, pending: KVCache, kept: jax.Array) -> KVCache:
        """The KV cache after a forward whose first `kept [batch]` rows are kept: unchanged, since the rows past
        them lie at slots past the committed lengths, never read and later overwritten (`Target.commit`)."""
        del kept
        return pending

    def init_cache(self, batch_size: int, max_length: int) -> KVCache:
        """An empty KV cache for `batch_size` sequences of up to `max_length` positions (rounded up by
        `attention.span_capacity`, so that the GPU kernel reads it well), in the params' dtype (on a mesh: split by KV
        heads over the tensor axis and by sequences over the others, `CACHE_AXES`)."""
        c = self.config
        rows = span_capacity(max_length, platform_of(self.embed).tuning)  # the embedding's devices' tuning
        shape = (batch_size, c.num_key_value_heads, rows, c.head_dim)
        where = None if self.layout is None else self.layout.sharding(CACHE_AXES, batch_size)
        layers = lambda: tuple(zeros(shape, self.embed.dtype, where)  # noqa: E731
                               for _ in range(c.num_hidden_layers))
        return KVCache(layers(), layers())

    def __call__(
        self, tokens: jax.Array, cache: KVCache, lengths: jax.Array, *, layer_ids: tuple[int, ...] = ()
    ) -> TargetOutput:
        """Run `tokens [batch, S]` after `lengths [batch]` cached positions (see the module docstring).

        Returns float32 logits `[batch, S, V]`, the features at `layer_ids` `[batch, S, len(layer_ids) * H]`
        (transformers' hidden_states[l + 1] convention) and the cache with the new K/V written. The caller must
        leave room: `lengths + S <= T` (writes past the cache's end are dropped). The cache is donated (its
        buffers hold the result's): keep the returned one.
        """
        return _forward(self, tokens, cache, lengths, tuple(layer_ids))

    def prefill(
        self, tokens: jax.Array, cache: KVCache, lengths: jax.Array, *, layer_ids: tuple[int, ...] = (),
        chunk: int = PREFILL_CHUNK, impl: Impl = "auto", project: FeatureMap | None = None,
    ) -> TargetOutput:
        """Run right-padded prompts `tokens [batch, P]` (`lengths [batch]` real tokens) into an empty cache.

        impl "xla" (and "auto" where the program is not lowered for a GPU): chunked, `chunk` token rows at a time
        over the whole batch (`chunk // batch` of each prompt, `steps.prefill_chunks`) through every layer (a
        `lax.scan`), each chunk attending to the cache written so far and causally to itself, so activations and
        scores are a chunk's, never `[P, P]`. "cudnn" (and "auto" lowered for a GPU,
        with 16-bit weights): the whole prompt at once, each layer's attention cuDNN's fused causal flash kernel
        (no `[P, P]` scores either; measured faster, docs/benchmarks.md). Another `impl` is a `ValueError`. The
        cache is donated: keep the returned one.
        Returns the features of every row `[batch, P, Lf * H]` (a `FeatureMap` `project`: its map of them, made a
        step at a time), the logits of each prompt's last token `[batch, V]` float32, and the cache.
        """
        chunk = check_integer("prefill", "chunk", chunk, 1)
        impl = check_impl("prefill", impl, PREFILL_IMPLS)
        return _prefill(self, tokens, cache, lengths, project, tuple(layer_ids), chunk, impl)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, repr=False)
class Qwen3Target(DecoderTarget):
    """A dense Qwen3 decoder: `DecoderTarget` whose `from_pretrained` reads only Qwen3 configs."""

    CONFIG = Qwen3Config



# --------------------------------------------------------------------------------------------------------------
# The forward
# --------------------------------------------------------------------------------------------------------------

def _layers(target: DecoderTarget, tokens, cache: KVCache, start: jax.Array, layer_ids: tuple[int, ...],
            fused: Literal["cudnn", "xla"] | None = None, first: jax.Array | int = 0):
    """The decoder over `tokens [batch, S]` at positions `start[b] .. start[b] + S - 1`: `(hidden, features,
    cache)`. Each layer attends to its cache's slots `[0, start)` (a span: only those are read) and causally
    to the new rows, then writes the new rows' K/V at their positions (`steps.cached_attention`). `fused`: the cache is
    empty (start = 0) and the new rows attend to themselves with `causal_self_attention` of that implementation,
    their K/V written to the cache's sequences from `first` on (default 0)."""
    params, c, layout = target.params, target.config, target.layout
    N = c.num_hidden_layers
    batch, S = tokens.shape
    positions = start[:, None] + jnp.arange(S, dtype=jnp.int32)  # [batch, S]
    rope = rope_tables(c, positions)  # cos/sin [batch, S, d_h]

    x = x0 = jnp.take(target.embed, tokens, axis=0).astype(target.embed.dtype)  # [batch, S, H]
    keys, values, by_id = list(cache.k), list(cache.v), {}
    for i, p in enumerate(params["layers"]):

        def attention(attn, xn, i=i):
            q = queries(attn, c, xn, rope)  # [batch, S, n_h, d_h]
            k, v = keys_values(attn, c, xn, rope)  # [batch, n_kv, S, d_h]
            out, new_k, new_v = cached_attention(layout, c.num_attention_heads, q, k, v, keys[i], values[i], positions,
                                            start, fused, first)
            return out.reshape(batch, S, -1), (new_k, new_v)

        x, (keys[i], values[i]) = decoder_layer(p, c, x, attention)
        if fused:  # each layer's K/V written before the next runs: XLA:GPU otherwise held every layer's new rows
            x, keys[i], values[i] = jax.lax.optimization_barrier((x, keys[i], values[i]))  # to the end (36 x 128 MiB)
        if layout is not None:  # the row-parallel o/down sums end replicated over the tensor axis
            x = layout.constrain(x, ROWS_AXES)
        if i in layer_ids and i < N - 1:
            by_id[i] = x
    hidden = rms_norm(x, params["norm"]["weight"], c.rms_norm_eps)  # [batch, S, H]
    by_id |= {-1: x0, N - 1: hidden}
    features = jnp.concatenate([by_id[l] for l in layer_ids], axis=-1) if layer_ids else jnp.zeros((batch, S, 0),
                                                                                                     x0.dtype)
    return hidden, features, KVCache(tuple(keys), tuple(values))


@functools.partial(jax.jit, static_argnames=("layer_ids",), donate_argnames=("cache",))
def _forward(
    target: DecoderTarget, tokens: jax.Array, cache: KVCache, lengths: jax.Array, layer_ids: tuple[int, ...]
) -> TargetOutput:
    check_layer_ids(layer_ids, target.config.num_hidden_layers)
    hidden, features, cache = _layers(target, tokens, cache, lengths.astype(jnp.int32), layer_ids)
    return TargetOutput(lm_logits(hidden, target.lm_head), features, cache)


@functools.partial(jax.jit, static_argnames=("layer_ids", "chunk", "impl"), donate_argnames=("cache",))
def _prefill(
    target: DecoderTarget, tokens: jax.Array, cache: KVCache, lengths: jax.Array, project: FeatureMap | None,
    layer_ids: tuple[int, ...], chunk: int, impl: Impl,
) -> TargetOutput:
    check_layer_ids(layer_ids, target.config.num_hidden_layers)
    batch = tokens.shape[0]

    def fused(cache: KVCache) -> tuple[jax.Array, jax.Array, KVCache]:  # whole prompts, cuDNN's kernel
        return _fused_rows(target, tokens, cache, lengths, layer_ids, "cudnn", project=project)

    def chunked(cache: KVCache) -> tuple[jax.Array, jax.Array, KVCache]:
        return prefill_chunks(lambda piece, cache, start: _layers(target, piece, cache, start, layer_ids), tokens,
                              cache, lengths, chunk, jnp.zeros((batch, target.config.hidden_size), target.embed.dtype),
                              project)

    if impl == "cudnn":
        last_hidden, features, cache = fused(cache)
    elif impl == "auto" and use_cudnn(target.embed.dtype, target.config.head_dim):
        last_hidden, features, cache = on_gpu(process_platform(), fused, chunked, cache)
    else:
        last_hidden, features, cache = chunked(cache)
    return TargetOutput(lm_logits(last_hidden, target.lm_head), features, cache)


def _fused_rows(target: DecoderTarget, tokens: jax.Array, cache: KVCache, lengths: jax.Array,
                layer_ids: tuple[int, ...], implementation: Literal["cudnn", "xla"], max_rows: int | None = None,
                project: FeatureMap | None = None) -> tuple[jax.Array, jax.Array, KVCache]:
    """The whole prompts into an empty cache, whole sequences at a time: `(last_hidden [batch, H], features [batch, P,
    Lf * H] or `project`'s map of each step's, cache)`. A step runs `group` sequences (the largest divisor of the batch
    whose rows, group x P, stay within `max_rows`, default the device's `fused_prefill_rows`; at least one), a
    `lax.scan` over the groups writing each one's K/V in place at its batch offset: a step's activations (the MLP's
    [rows, intermediate], the GEMM autotuner's scratch) scale with its rows. Where a mesh splits the batch the whole
    batch is one step (a batch offset into a split axis would gather it)."""
    batch, P = tokens.shape
    max_rows = process_platform().tuning.fused_prefill_rows if max_rows is None else max_rows
    group = max([g for g in range(1, batch + 1) if batch % g == 0 and g * P <= max_rows], default=1)
    if target.layout is not None and target.layout.splits_batch(batch):
        group = batch

    def run(cache: KVCache, first: jax.Array):
        tokens_, lengths_ = (jax.lax.dynamic_slice_in_dim(a, first, group) for a in (tokens, lengths))  # [group, ..]
        last = lengths_.astype(jnp.int32) - 1  # [group] each prompt's last row
        hidden, features, cache = _layers(target, tokens_, cache, jnp.zeros(last.shape, jnp.int32), layer_ids,
                                          implementation, first)
        last_hidden = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]  # [group, H]
        return cache, (last_hidden, mapped(project, features))  # features: [group, P, Lf * H or D]

    if group == batch:
        cache, (last_hidden, features) = run(cache, jnp.int32(0))
        return last_hidden, features, cache

    cache, (last_hidden, features) = jax.lax.scan(run, cache, jnp.arange(0, batch, group, dtype=jnp.int32))
    # last_hidden: [batch / group, group, H]; features: [batch / group, group, P, Lf * H or D]
    return last_hidden.reshape(batch, -1), features.reshape(batch, P, -1), cache


def prefill_fused(target: DecoderTarget, tokens: jax.Array, cache: KVCache, lengths: jax.Array,
                  layer_ids: tuple[int, ...], implementation: Literal["cudnn", "xla"], max_rows: int | None = None,
                  project: FeatureMap | None = None) -> TargetOutput:
    """The whole prompts into an empty cache, each layer's attention `causal_self_attention` of `implementation`
    ("cudnn", as `prefill` runs it; "xla" runs the same masking, last-row gather and grouping of sequences on any
    backend, as the tests do); at most `max_rows` prompt rows a step (default: the device's
    `fused_prefill_rows`); `project` as `prefill`'s."""
    last_hidden, features, cache = _fused_rows(target, tokens, cache, lengths, layer_ids, implementation, max_rows,
                                               project)
    return TargetOutput(lm_logits(last_hidden, target.lm_head), features, cache)



"""The target side of speculative decoding: a `Target` protocol and `Qwen3Target`, a dense Qwen3 decoder in JAX.

`Qwen3Target.from_pretrained(path)` reads a Hugging Face Qwen3 directory (config.json + safetensors, sharded or
not) with the package's header-first reader and puts the weights on devices with `placement.place_all`, the
drafter's loader path. The forward runs the new tokens of each sequence against a static-shape KV cache and
returns, besides the final hidden states, the target features a DFlash-family drafter reads (spec §1.2, §7):

    feature l = transformers' hidden_states[l + 1]   the output of decoder layer l, for 0 <= l < N - 1
    feature N - 1 = hidden_states[N]                 the LAST layer's output AFTER the final norm
    feature -1 = hidden_states[0]                    the embedding output (DeepSpec)

concatenated shallow-to-deep in `layer_ids` order: `[batch, S, Lf * H]`.

KV cache: `KVCache(k, v)`, per layer `[batch, n_kv, T, d_h]`; slot t holds position t. The cache itself carries
no length: the caller keeps `lengths [batch]` (tokens committed per sequence). A forward over `S` new tokens
attends to slots `[0, lengths)` (only those are read: `attention.Span`) and causally among the new rows, then
writes their K/V at slots `lengths .. lengths + S - 1`, so slots beyond a sequence's length are never read:
trimming the cache to an accepted prefix is just passing a smaller length next time (the rejected slots are
overwritten). Sequences of a batch may have different lengths; prompts of different lengths are right-padded.
`prefill` runs a long prompt in chunks and returns only the last token's logits.

Parameter tree (`Qwen3Target.params`): HF names with `model.` stripped, as the drafter's (docs/design.md);
`params["layers"]` is a tuple of per-layer dicts (each weight its own buffer, as placed), run unrolled, every
matmul reading its weights in place.

One decoder layer serves the drafter and the targets (`model.decoder_layer`, `model.queries` /
`model.keys_values`, `attention.attend`: GQA, float32 online softmax). `Qwen3Config` has the attributes
`rope_frequencies` reads.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import Any, NamedTuple, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import msgspec

from .config import (
    MAX_CONFIG_BYTES, Dim, LayerCount, PositiveFloat, RopeScaling, RopeTheta, declared_rope_type, normalise_raw,
)
from .errors import CheckpointError, ConfigError
from .loader import TensorPlan, build_tree, check_tensor
from .attention import KeyValues, LayerRule, Span, attend, causal_self_attention, use_cudnn
from .model import decoder_layer, keys_values, lm_logits, queries, rms_norm, rope_tables
from .safetensors import Checkpoint, read_json

log = logging.getLogger("dflash_jax")

PREFILL_CHUNK = 2048  # prompt tokens per prefill step (`Qwen3Target.prefill`)

Params = dict[str, Any]


# --------------------------------------------------------------------------------------------------------------
# The protocol the speculative loop needs
# --------------------------------------------------------------------------------------------------------------


class KVCache(NamedTuple):
    """A static-shape KV cache: per layer `k`, `v` `[batch, n_kv, T, d_h]` (post k_norm + RoPE keys, heads-major
    as `attention.KeyValues`); slot t = position t. One buffer per layer, updated in place."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]


class TargetOutput(NamedTuple):
    """What one target forward returns."""

    logits: jax.Array  # [batch, S, V] float32 (`prefill`: [batch, V], at each prompt's last token)
    features: jax.Array  # [batch, S, Lf * H] at the requested layer ids, shallow to deep
    cache: Any  # the cache with the new tokens' K/V written


@runtime_checkable
class Target(Protocol):
    """A causal LM that `speculative_generate` can verify drafts with.

    Requirements:
    - It is a JAX pytree (arrays as leaves, configuration as static metadata), so it is passed through `jax.jit`
      as an argument rather than baked into the program as constants.
    - `vocab_size`: the size of the logits' last axis; `embed`, `lm_head`: `[V, H]` in HF layout, handed to
      `drafter.attach` (DFlash drafters use the target's embedding and LM head).
    - `init_cache(batch, max_length)`: an empty cache pytree for up to `max_length` positions per sequence.
    - `__call__(tokens, cache, lengths, *, layer_ids)`: run `tokens [batch, S]` at positions
      `lengths[b] .. lengths[b] + S - 1`, attending to the first `lengths[b]` cached positions and causally
      among the new ones; return `TargetOutput` (logits and features for every new token, the updated cache).
      Cache entries at positions `>= lengths[b] + S` must never influence the result: the loop trims a cache to
      an accepted prefix by passing a smaller `lengths` next time.
    - `prefill(tokens, cache, lengths, *, layer_ids, chunk)`: run right-padded prompts `tokens [batch, P]` (real lengths
      `lengths`) into an empty cache; return the features of every row and the logits `[batch, V]` of each
      prompt's last token only (a long prompt's `[P, V]` logits would not fit), `chunk` tokens at a time.
    - `max_positions`: the longest sequence it runs (`max_position_embeddings`), or None for no limit.
    """

    @property
    def vocab_size(self) -> int: ...

    @property
    def embed(self) -> jax.Array: ...

    @property
    def lm_head(self) -> jax.Array: ...

    def init_cache(self, batch_size: int, max_length: int) -> Any: ...

    def __call__(
        self, tokens: jax.Array, cache: Any, lengths: jax.Array, *, layer_ids: tuple[int, ...]
    ) -> TargetOutput: ...

    def prefill(
        self, tokens: jax.Array, cache: Any, lengths: jax.Array, *, layer_ids: tuple[int, ...], chunk: int
    ) -> TargetOutput: ...

    @property
    def max_positions(self) -> int | None: ...


# --------------------------------------------------------------------------------------------------------------
# Qwen3 config
# --------------------------------------------------------------------------------------------------------------


class Qwen3Config(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """The fields of a Hugging Face Qwen3 `config.json` the forward reads (defaults: transformers' Qwen3Config).

    Frozen and hashable: a static `jax.jit` argument. Also satisfies what `model.rope_frequencies` reads
    (`head_dim`, `rope_theta`, `rope_type`, `rope_scaling`, `max_position_embeddings`).
    """

    vocab_size: Dim = 151936
    hidden_size: Dim = 4096
    intermediate_size: Dim = 22016
    num_hidden_layers: LayerCount = 32
    num_attention_heads: Dim = 32
    num_key_value_heads: Dim = 32
    head_dim: Dim = 128
    hidden_act: str = "silu"
    max_position_embeddings: Dim = 32768
    rms_norm_eps: PositiveFloat = 1e-6
    tie_word_embeddings: bool = False
    rope_theta: RopeTheta = 10000.0
    rope_scaling: RopeScaling | None = None
    attention_bias: bool = False
    use_sliding_window: bool = False
    eos_token_id: int | tuple[int, ...] | None = None
    model_type: str | None = None
    architectures: tuple[str, ...] = ()

    @property
    def rope_type(self) -> str:
        return "yarn" if declared_rope_type(self.rope_scaling) == "yarn" else "default"

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """`eos_token_id` as a tuple (configs state one id or a list)."""
        eos = self.eos_token_id
        return () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)


def parse_qwen3_config(raw: dict[str, Any], *, source: str = "<config>") -> Qwen3Config:
    """Decode a Qwen3 config dict (transformers 4 `rope_theta`/`rope_scaling` or 5 `rope_parameters` layout)."""
    try:
        config = msgspec.convert(normalise_raw(raw, source), Qwen3Config)
    except msgspec.ValidationError as e:
        raise ConfigError(f"{source}: {e}") from None
    problems = []
    if config.model_type not in (None, "qwen3"):
        problems.append(f"model_type is {config.model_type!r}, expected 'qwen3' (a dense Qwen3 decoder)")
    if config.hidden_act != "silu":
        problems.append(f"hidden_act is {config.hidden_act!r}; only 'silu' (SwiGLU) is implemented")
    if config.num_attention_heads % config.num_key_value_heads:
        problems.append(
            f"num_attention_heads={config.num_attention_heads} is not a multiple of "
            f"num_key_value_heads={config.num_key_value_heads}"
        )
    if config.use_sliding_window:
        problems.append("use_sliding_window=true is not implemented (released Qwen3 dense models leave it off)")
    if declared_rope_type(config.rope_scaling) not in ("default", "yarn"):
        problems.append(f"rope type {declared_rope_type(config.rope_scaling)!r}; only default and yarn are implemented")
    if problems:
        raise ConfigError(f"{source}: " + "; ".join(problems))
    return config


def load_qwen3_config(path: str | os.PathLike[str]) -> Qwen3Config:
    """Read `config.json` from a Qwen3 checkpoint directory."""
    file = os.path.join(os.fspath(path), "config.json")
    if not os.path.lexists(file):
        raise ConfigError(f"{path}: no config.json; expected a Hugging Face Qwen3 checkpoint directory")
    try:  # a regular file of bounded size (a FIFO would block forever), UTF-8, duplicate keys refused
        raw = read_json(file, "config.json", MAX_CONFIG_BYTES)
    except CheckpointError as e:
        raise ConfigError(str(e)) from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{file}: expected a JSON object at the top level")
    return parse_qwen3_config(raw, source=file)


# --------------------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------------------

def _layer_shapes(c: Qwen3Config) -> dict[str, tuple[int, ...]]:
    """Per-layer tensors by their name inside `model.layers.{i}.`, with their shapes."""
    H, I, d_h = c.hidden_size, c.intermediate_size, c.head_dim
    q_dim, kv_dim = c.num_attention_heads * d_h, c.num_key_value_heads * d_h
    shapes = {
        "input_layernorm.weight": (H,),
        "post_attention_layernorm.weight": (H,),
        "self_attn.q_proj.weight": (q_dim, H),
        "self_attn.k_proj.weight": (kv_dim, H),
        "self_attn.v_proj.weight": (kv_dim, H),
        "self_attn.o_proj.weight": (H, q_dim),
        "self_attn.q_norm.weight": (d_h,),
        "self_attn.k_norm.weight": (d_h,),
        "mlp.gate_proj.weight": (I, H),
        "mlp.up_proj.weight": (I, H),
        "mlp.down_proj.weight": (H, I),
    }
    if c.attention_bias:
        shapes |= {"self_attn.q_proj.bias": (q_dim,), "self_attn.k_proj.bias": (kv_dim,),
                   "self_attn.v_proj.bias": (kv_dim,), "self_attn.o_proj.bias": (H,)}
    return shapes


def plan_qwen3(config: Qwen3Config) -> list[TensorPlan]:
    """Every tensor a Qwen3 checkpoint of `config` holds, with its tree path (per layer; stacked after placing).

    `lm_head.weight` is planned unless the embeddings are tied (a tied checkpoint may still carry a copy:
    it is then ignored, as transformers does).
    """
    c = config
    plan = [
        TensorPlan(("embed_tokens", "weight"), "model.embed_tokens.weight", (c.vocab_size, c.hidden_size), "float"),
        TensorPlan(("norm", "weight"), "model.norm.weight", (c.hidden_size,), "float"),
    ]
    if not c.tie_word_embeddings:
        plan.append(TensorPlan(("lm_head", "weight"), "lm_head.weight", (c.vocab_size, c.hidden_size), "float"))
    for i in range(c.num_hidden_layers):
        for name, shape in _layer_shapes(c).items():
            path = ("layers", i, *name.split("."))
            plan.append(TensorPlan(path, f"model.layers.{i}.{name}", shape, "float"))
    return plan


# --------------------------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Qwen3Target:
    """A dense Qwen3 decoder (RMSNorm, per-head q/k norm, GQA, RoPE, SwiGLU, tied or untied embeddings).

    A pytree (params as leaves, config static): pass it whole through `jax.jit`. Implements `Target`.
    """

    params: Params
    config: Qwen3Config = dataclasses.field(metadata=dict(static=True))

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str],
        *,
        mesh: jax.sharding.Mesh | None = None,
        dtype: jnp.dtype = jnp.bfloat16,
        progress: bool | None = None,
        revision: str | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        local_files_only: bool = False,
        token: str | bool | None = None,
    ) -> Qwen3Target:
        """Load a Hugging Face Qwen3 directory: config.json + `model.safetensors` or an index with shards; or a
        hub id (`revision`, `cache_dir`, `local_files_only`, `token` as transformers spells them: `dflash_jax.hub`).

        Floating tensors are cast to `dtype`; with `mesh` every leaf is replicated over it (as the drafter's),
        without it they land on the first local device. Every tensor's presence, dtype and shape is checked
        against the config before any data is read (`CheckpointError` otherwise).
        """
        from .hub import resolve
        from .placement import place_all

        path = resolve(path, revision=revision, cache_dir=cache_dir, local_files_only=local_files_only, token=token)
        config = load_qwen3_config(path)
        with Checkpoint(path) as checkpoint:
            plan = plan_qwen3(config)
            for t in plan:
                check_tensor(t, checkpoint, path)
            leaves = place_all(plan, checkpoint, set(), mesh=mesh, dtype=dtype, progress=progress)
        params = build_tree(plan, leaves)
        params["layers"] = tuple(params["layers"])  # one buffer per weight, as placed
        log.info(
            "%s: Qwen3 target, %d layers, hidden=%d, heads=%d/%d, vocab=%d, %s embeddings",
            path, config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
            config.num_key_value_heads, config.vocab_size, "tied" if config.tie_word_embeddings else "untied",
        )
        return cls(params=params, config=config)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def embed(self) -> jax.Array:
        """The input embedding `[V, H]` (HF layout), for `drafter.attach(embed=...)`."""
        return self.params["embed_tokens"]["weight"]

    @property
    def lm_head(self) -> jax.Array:
        """The LM head `[V, H]` (HF layout; the embedding when tied), for `drafter.attach(lm_head=...)`."""
        own = self.params.get("lm_head")
        return self.embed if own is None else own["weight"]

    @property
    def max_positions(self) -> int:
        return self.config.max_position_embeddings

    def init_cache(self, batch_size: int, max_length: int) -> KVCache:
        """An empty KV cache for `batch_size` sequences of up to `max_length` positions, in the params' dtype."""
        c = self.config
        shape = (batch_size, c.num_key_value_heads, max_length, c.head_dim)
        zeros = lambda: tuple(jnp.zeros(shape, self.embed.dtype) for _ in range(c.num_hidden_layers))  # noqa: E731
        return KVCache(zeros(), zeros())

    def __call__(
        self, tokens: jax.Array, cache: KVCache, lengths: jax.Array, *, layer_ids: tuple[int, ...] = ()
    ) -> TargetOutput:
        """Run `tokens [batch, S]` after `lengths [batch]` cached positions (see the module docstring).

        Returns float32 logits `[batch, S, V]`, the features at `layer_ids` `[batch, S, len(layer_ids) * H]`
        (transformers' hidden_states[l + 1] convention) and the cache with the new K/V written. The caller must
        leave room: `lengths + S <= T` (writes past the cache's end are dropped).
        """
        return _forward(self, tokens, cache, lengths, tuple(layer_ids))

    def prefill(
        self, tokens: jax.Array, cache: KVCache, lengths: jax.Array, *, layer_ids: tuple[int, ...] = (),
        chunk: int = PREFILL_CHUNK, impl: str = "auto",
    ) -> TargetOutput:
        """Run right-padded prompts `tokens [batch, P]` (`lengths [batch]` real tokens) into an empty cache.

        impl "xla" (and "auto" off GPU): chunked, `chunk` tokens at a time through every layer (a `lax.scan`),
        each chunk attending to the cache written so far and causally to itself, so activations and scores are a
        chunk's, never `[P, P]`. "cudnn" (and "auto" on a GPU with 16-bit weights): the whole prompt at once,
        each layer's attention cuDNN's fused causal flash kernel (no `[P, P]` scores either; measured faster,
        docs/benchmarks.md).
        Returns the features of every row `[batch, P, Lf * H]`, the logits of each prompt's last token
        `[batch, V]` float32, and the cache.
        """
        return _prefill(self, tokens, cache, lengths, tuple(layer_ids), chunk, impl)


# --------------------------------------------------------------------------------------------------------------
# The forward
# --------------------------------------------------------------------------------------------------------------

_CAUSAL = LayerRule(causal=True, window=None)


def _check_layer_ids(layer_ids: tuple[int, ...], N: int) -> None:
    for l in layer_ids:
        if not -1 <= l < N:
            raise ValueError(f"target layer id {l} is outside [-1, {N - 1}] for a {N}-layer target")


def _layers(target: Qwen3Target, tokens, cache: KVCache, start: jax.Array, layer_ids: tuple[int, ...],
            fused: bool = False):
    """The decoder over `tokens [batch, S]` at positions `start[b] .. start[b] + S - 1`: `(hidden, features,
    cache)`. Each layer attends to its cache's slots `[0, start)` (a span: only those are read) and causally
    to the new rows, then writes the new rows' K/V at their positions. `fused`: the cache is empty (start = 0)
    and the new rows attend to themselves with cuDNN's flash kernel (`attention.causal_self_attention`)."""
    params, c = target.params, target.config
    N = c.num_hidden_layers
    batch, S = tokens.shape
    positions = start[:, None] + jnp.arange(S, dtype=jnp.int32)  # [batch, S]
    rope = rope_tables(c, positions)  # cos/sin [batch, S, d_h]
    new_rows = jnp.ones((batch, S), bool)
    seq, heads = jnp.arange(batch)[:, None, None], jnp.arange(c.num_key_value_heads)[None, :, None]
    slots = positions[:, None, :]  # [batch, 1, S]: broadcast with seq and heads to [batch, n_kv, S]

    x = x0 = jnp.take(target.embed, tokens, axis=0).astype(target.embed.dtype)  # [batch, S, H]
    keys, values, by_id = list(cache.k), list(cache.v), {}
    for i, p in enumerate(params["layers"]):

        def attention(attn, xn, i=i):
            q = queries(attn, c, xn, rope)  # [batch, S, n_h, d_h]
            k, v = keys_values(attn, c, xn, rope)  # [batch, n_kv, S, d_h]
            if fused:
                return causal_self_attention(q, k, v).reshape(batch, S, -1), (k, v)
            past = Span(keys[i], values[i], jnp.zeros_like(start), start)
            a = attend(q, positions, _CAUSAL, (KeyValues(k, v, positions, new_rows),), (past,))
            return a.reshape(batch, S, -1), (k, v)

        x, (k, v) = decoder_layer(p, c, x, attention)
        keys[i] = keys[i].at[seq, heads, slots].set(k.astype(keys[i].dtype), mode="drop")  # past the end: dropped
        values[i] = values[i].at[seq, heads, slots].set(v.astype(values[i].dtype), mode="drop")
        if i in layer_ids and i < N - 1:
            by_id[i] = x
    hidden = rms_norm(x, params["norm"]["weight"], c.rms_norm_eps)  # [batch, S, H]
    by_id |= {-1: x0, N - 1: hidden}
    features = jnp.concatenate([by_id[l] for l in layer_ids], axis=-1) if layer_ids else jnp.zeros((batch, S, 0),
                                                                                                     x0.dtype)
    return hidden, features, KVCache(tuple(keys), tuple(values))


@functools.partial(jax.jit, static_argnames=("layer_ids",))
def _forward(
    target: Qwen3Target, tokens: jax.Array, cache: KVCache, lengths: jax.Array, layer_ids: tuple[int, ...]
) -> TargetOutput:
    _check_layer_ids(layer_ids, target.config.num_hidden_layers)
    hidden, features, cache = _layers(target, tokens, cache, lengths.astype(jnp.int32), layer_ids)
    return TargetOutput(lm_logits(hidden, target.lm_head), features, cache)


@functools.partial(jax.jit, static_argnames=("layer_ids", "chunk", "impl"))
def _prefill(
    target: Qwen3Target, tokens: jax.Array, cache: KVCache, lengths: jax.Array, layer_ids: tuple[int, ...],
    chunk: int, impl: str,
) -> TargetOutput:
    _check_layer_ids(layer_ids, target.config.num_hidden_layers)
    batch, P = tokens.shape
    last = lengths.astype(jnp.int32) - 1  # [batch] each prompt's last row
    if impl == "cudnn" or (impl == "auto" and use_cudnn(target.embed.dtype, target.config.head_dim)):  # the whole prompt at once, fused
        hidden, features, cache = _layers(target, tokens, cache, jnp.zeros((batch,), jnp.int32), layer_ids, True)
        last_hidden = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]  # [batch, H]
        return TargetOutput(lm_logits(last_hidden, target.lm_head), features, cache)
    chunk = min(P, chunk)
    n_chunks = -(-P // chunk)
    pieces = jnp.pad(tokens, ((0, 0), (0, n_chunks * chunk - P))).reshape(batch, n_chunks, chunk).swapaxes(0, 1)

    def step(carry, inputs):
        cache, last_hidden = carry
        c, piece = inputs  # piece: [batch, chunk]
        hidden, features, cache = _layers(target, piece, cache, jnp.full((batch,), c * chunk, jnp.int32), layer_ids)
        row = jnp.clip(last - c * chunk, 0, chunk - 1)
        here = ((last >= c * chunk) & (last < (c + 1) * chunk))[:, None]
        last_hidden = jnp.where(here, jnp.take_along_axis(hidden, row[:, None, None], axis=1)[:, 0], last_hidden)
        return (cache, last_hidden), features

    H = target.config.hidden_size
    (cache, last_hidden), features = jax.lax.scan(
        step, (cache, jnp.zeros((batch, H), target.embed.dtype)), (jnp.arange(n_chunks), pieces)
    )  # features: [n_chunks, batch, chunk, Lf * H]
    features = features.swapaxes(0, 1).reshape(batch, n_chunks * chunk, -1)[:, :P]
    return TargetOutput(lm_logits(last_hidden, target.lm_head), features, cache)

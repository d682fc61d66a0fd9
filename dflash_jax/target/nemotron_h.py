"""The NVIDIA Nemotron-H / Nemotron 3 hybrid target's maths (transformers 5.25.0 `models/nemotron_h/
modeling_nemotron_h.py`, `NemotronHForCausalLM`): pure functions over the parameter tree, no I/O. The config is
`target.nemotron_h_config`; the tensors and their logical axes `target.nemotron_h_spec`.

Every block is `x + mixer(norm(x))`, one mixer a block, as `layers_block_type` says:

    Mamba-2 (M)      `target.mamba2.mixer` (in_proj -> causal conv -> SSD scan -> gated group norm -> out_proj)
    attention (*)    causal GQA, scale d_h^-1/2, NO positional encoding (no RoPE), no bias, no q/k norm
    MoE (E)          router: logits = x W^T in float32, scores = sigmoid(logits); the k experts chosen on
                     scores + e_score_correction_bias (within the `topk_group` best of `n_group` groups, a group
                     scored by its two best); weights = the UNBIASED scores of those experts, divided by their
                     sum (+1e-20) when `norm_topk_prob`, times `routed_scaling_factor`;
                     y = sum_k w_k down_k(relu(up_k x)^2) + shared_experts(x)
    MLP (-)          down(relu(up x)^2)

then `norm_f` and the untied `lm_head`. The RMSNorms (block `norm`, `norm_f`) normalise in float32 and multiply
the weight in float32 before casting back (`norm`; unlike Qwen3's `layers.rms_norm`, which casts first).

Parameter tree (`params`; HF names with `backbone.` stripped):

    embeddings.weight [V, H];  norm_f.weight [H];  lm_head.weight [V, H] (absent when tied)
    layers[i].norm.weight [H]
    layers[i].mixer.  M: in_proj.weight [2 d_inner + 2 G N + nh, H], conv1d.weight [d_inner + 2 G N, 1, K],
                         conv1d.bias, dt_bias [nh], A_log [nh], D [nh], norm.weight [d_inner], out_proj.weight
                         (in_proj's rows and the conv's channels in `Ops.mamba_shards` blocks, `mamba2`)
                      *: q_proj.weight [n_h d_h, H], k_proj.weight / v_proj.weight [n_kv d_h, H], o_proj.weight
                      E: gate.weight [E, H], gate.e_score_correction_bias [E] (both used in float32),
                         experts.up_proj [E, I, H], experts.down_proj [E, H, I] (the checkpoint's per-expert
                         `experts.{e}.up_proj.weight` / `down_proj.weight` stacked, as `target.moe` stacks them),
                         shared_experts.up_proj.weight [Is, H], shared_experts.down_proj.weight [H, Is]
                      -: up_proj.weight [I, H], down_proj.weight [H, I]

What depends on where the model runs is passed in (`Ops`, static): the routed experts' products
(`RoutedExperts`: `gathered_experts` here, each token's k experts' slices gathered, which reads only the routed
experts but copies `[T, k, I, H]`, fit for tests and a few rows only; or `target.moe.weighted_experts`, read in
place for few rows, tiles by expert for a prefill, a Mosaic GPU kernel, its experts without `gate_proj` being these
relu^2 experts: what `NemotronHTarget` passes), an attention block's attention and cache
write (`cached_attention` here; on a mesh `target.steps.cached_attention` under its `shard_map`), and a constraint
on the residual stream after each block. This module imports neither `target.moe` nor `target.steps`, so that it
reaches no checkpoint I/O, no drafter config and no expert kernel (the one kernel module it reaches is the span
attention kernel of `attention.attend`, which picks it only where the program runs on a Hopper GPU).

Cache (`NemotronHCache`): per attention block K/V `[batch, n_kv, T, d_h]` (slot t = position t; the caller's
`lengths` say what is committed, as for the dense target), per Mamba block a `mamba2.Mamba2State` (conv inputs
`[batch, conv_dim, K - 1]` in the activation dtype, SSM state `[batch, nh, hd, N]` float32). A `forward` over S
rows returns a `PendingCache`: K/V with all S rows written, and per Mamba block the state before the call and
after each row (`[batch, S + 1, ...]`, `mixer(..., keep_states=True)`); `commit(pending, kept)` picks each
sequence's state after `kept[b]` rows (`select_state`), exactly the state of running only those rows. Memory at
Nemotron 3 Nano's sizes (23 Mamba blocks, 64 heads x 64 x state 128, float32): 2 MiB of SSM state per block and
sequence, so a pending cache holds 46 MiB x (S + 1) per sequence (782 MiB for a 16-row verify) while it lives.

Features (`target` package docstring): feature l = the output of block l, except that of the last block, taken
after `norm_f`; -1 the embedding output; `[batch, S, Lf * H]` shallow to deep, in the embedding's dtype.

`time_step_limit`: dt is clamped in every row, prefill, verify and decode alike (`mamba2`); transformers 5.25 clamps
only in its multi-row path, so where the limit bites its cached single-token decode differs from its own forward,
and this module matches the forward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from .._precision import dot
from .._shapes import chunked
from ..attention import KeyValues, LayerRule, Span, attend, span_capacity, write_slots
from ..layers import linear, lm_logits
from . import FeatureMap, check_layer_ids, mapped
from .mamba2 import Mamba2State, empty_state, mixer, select_state
from .nemotron_h_config import ATTENTION, MAMBA, MOE, NemotronHConfig

__all__ = ["NemotronHCache", "init_cache", "commit", "forward", "prefill", "blocks"]

Params = dict[str, Any]
F32 = jnp.float32
CAUSAL = LayerRule(causal=True, window=None)
NORM_TOPK_EPS = 1e-20  # transformers' denominator guard of the renormalised router weights

# The routed experts' weighted sum: `(block params p (p["experts"]: the stacks), x [T, H], weights [T, k] float32,
# experts [T, k] int32) -> [T, H] float32`.
RoutedExperts = Callable[[Params, jax.Array, jax.Array, jax.Array], jax.Array]
# One attention block's attention and cache write: `(q [batch, S, n_h, d_h], k, v [batch, n_kv, S, d_h], past_k,
# past_v [batch, n_kv, T, d_h], positions [batch, S], start [batch]) -> (out [batch, S, n_h, d_h], past_k, past_v)`:
# the rows attend to the cache's slots `[0, start)` and causally to each other, their K/V then written at
# `positions` (`target.steps.cached_attention`'s contract, which runs it per device on a mesh).
CachedAttention = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array, jax.Array, jax.Array],
                           tuple[jax.Array, jax.Array, jax.Array]]


# --------------------------------------------------------------------------------------------------------------
# Caches
# --------------------------------------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NemotronHCache:
    """The committed cache: per attention block `k`, `v` `[batch, n_kv, T, d_h]`, per Mamba block a `Mamba2State`;
    blocks in model order within each tuple."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    mamba: tuple[Mamba2State, ...]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PendingCache:
    """The cache after `forward` over S rows, before `commit`: K/V with all S rows written; per Mamba block the
    state before the call and after each row (`Mamba2State` with an axis 1 of S + 1)."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    mamba: tuple[Mamba2State, ...]


def init_cache(config: NemotronHConfig, batch: int, max_length: int, dtype: Any) -> NemotronHCache:
    """An empty cache for `batch` sequences of up to `max_length` positions: K/V zeros of `attention.span_capacity`
    slots (the GPU span kernel reads aligned caches) in `dtype`, Mamba states zero (transformers' initial state)."""
    c = config
    kv = (batch, c.num_key_value_heads, span_capacity(max_length), c.head_dim)
    n_attention = len(c.blocks(ATTENTION))
    return NemotronHCache(tuple(jnp.zeros(kv, dtype) for _ in range(n_attention)),
                          tuple(jnp.zeros(kv, dtype) for _ in range(n_attention)),
                          tuple(empty_state(c.mamba_dims, batch, dtype) for _ in c.blocks(MAMBA)))


def commit(pending: PendingCache, kept: jax.Array) -> NemotronHCache:
    """The cache after keeping the first `kept [batch]` (0..S) rows of the last `forward`: each Mamba block's state
    after exactly those rows (0: the state before the call); K/V as written (the slots past the committed length
    are never read, and are overwritten next time). Shapes do not depend on S."""
    kept = kept.astype(jnp.int32)
    return NemotronHCache(pending.k, pending.v, tuple(select_state(s, kept) for s in pending.mamba))


# --------------------------------------------------------------------------------------------------------------
# The mixers
# --------------------------------------------------------------------------------------------------------------


def norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """`NemotronHRMSNorm`: normalise and scale in float32, then cast to x's dtype."""
    xf = x.astype(F32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (weight.astype(F32) * xf).astype(x.dtype)


def relu2(x: jax.Array) -> jax.Array:
    """transformers' `relu2`: `relu(x)^2`."""
    return jnp.square(jax.nn.relu(x))


def mlp(p: Params, x: jax.Array) -> jax.Array:
    """`down(relu(up x)^2)` (`NemotronHMLP`: the MLP blocks and the shared expert), in x's dtype."""
    return linear(relu2(linear(x, p["up_proj"])), p["down_proj"])


def route(p: Params, c: NemotronHConfig, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`NemotronHTopkRouter` over tokens `x [T, H]`: `(weights [T, k] float32, experts [T, k] int32)`, by
    descending biased score. Logits from float32 x and weights; the choice on `sigmoid(logits) +
    e_score_correction_bias`, limited to the `topk_group` groups (of `n_group`) whose two best biased scores sum
    highest; the weights the unbiased sigmoid scores of the chosen, renormalised when `norm_topk_prob`, times
    `routed_scaling_factor`."""
    gate = p["gate"]
    logits = dot("th,eh->te", x.astype(F32), gate["weight"].astype(F32))  # [T, E]
    scores = jax.nn.sigmoid(logits)
    choice = scores + gate["e_score_correction_bias"].astype(F32)
    if c.topk_group < c.n_group:  # group-limited choice (a no-op when every group is kept)
        T, E = choice.shape
        grouped = choice.reshape(T, c.n_group, E // c.n_group)
        group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [T, G]
        top_groups = jax.lax.top_k(group_scores, c.topk_group)[1]  # [T, topk_group]
        kept = jnp.any(top_groups[:, :, None] == jnp.arange(c.n_group), axis=1)  # [T, G]
        choice = jnp.where(kept[:, :, None], grouped, -jnp.inf).reshape(T, E)
    experts = jax.lax.top_k(choice, c.num_experts_per_tok)[1]  # [T, k]
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if c.norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + NORM_TOPK_EPS)
    return weights * c.routed_scaling_factor, experts.astype(jnp.int32)


def gathered_experts(p: Params, x: jax.Array, weights: jax.Array, experts: jax.Array) -> jax.Array:
    """The routed experts' weighted sum (`RoutedExperts`) with each token's k experts' `up` / `down` slices gathered
    (`[T, k, out, in]`: only the routed experts are read, each copied once per token routed to it): `[T, H]`
    float32, the hidden activations rounded to x's dtype between the products, as transformers' experts do."""
    e = p["experts"]
    up, down = (jnp.take(e[name], experts, axis=0) for name in ("up_proj", "down_proj"))  # [T, k, I, H], [T, k, H, I]
    h = relu2(dot("th,tkih->tki", x, up, x.dtype))  # [T, k, I]
    out = dot("tki,tkhi->tkh", h, down)  # [T, k, H] float32
    return dot("tkh,tk->th", out, weights)


def moe(p: Params, c: NemotronHConfig, x: jax.Array, routed: RoutedExperts = gathered_experts) -> jax.Array:
    """`NemotronHMoE` over `x [batch, S, H]`: the routed experts (`route`, `routed`) plus the shared expert, summed
    in float32: `[batch, S, H]` in x's dtype."""
    batch, S, H = x.shape
    xt = x.reshape(batch * S, H)
    with jax.named_scope("router"):
        weights, experts = route(p, c, xt)
    with jax.named_scope("routed"):
        y = routed(p, xt, weights, experts)  # [T, H] float32
    with jax.named_scope("shared"):
        y = y + mlp(p["shared_experts"], xt).astype(F32)
    return y.astype(x.dtype).reshape(batch, S, H)


def cached_attention(q: jax.Array, k: jax.Array, v: jax.Array, past_k: jax.Array, past_v: jax.Array,
                     positions: jax.Array, start: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`CachedAttention` on one device: the cache's slots `[0, start)` as a span, the new rows scored densely and
    causally (`attention.attend`), then their K/V written at their positions (past the capacity: dropped)."""
    new = KeyValues(k, v, positions, jnp.ones(positions.shape, bool))
    out = attend(q, positions, CAUSAL, (new,), (Span(past_k, past_v, jnp.zeros_like(start), start),))
    return out, write_slots(past_k, k.astype(past_k.dtype), positions), write_slots(past_v, v.astype(past_v.dtype),
                                                                                    positions)


def attention(p: Params, c: NemotronHConfig, xn: jax.Array, past_k: jax.Array, past_v: jax.Array,
              positions: jax.Array, start: jax.Array, run: CachedAttention = cached_attention
              ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`NemotronHAttention` over `xn [batch, S, H]` at `positions [batch, S]`: `(out [batch, S, H], past_k,
    past_v)`, `run` attending and writing the cache. No RoPE: a key is the same at every position."""
    batch, S, _ = xn.shape
    n_h, n_kv, d_h = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    q = linear(xn, p["q_proj"]).reshape(batch, S, n_h, d_h)
    k, v = (linear(xn, p[name]).reshape(batch, S, n_kv, d_h).transpose(0, 2, 1, 3) for name in ("k_proj", "v_proj"))
    out, past_k, past_v = run(q, k, v, past_k, past_v, positions, start)
    return linear(out.reshape(batch, S, n_h * d_h), p["o_proj"]), past_k, past_v


@dataclasses.dataclass(frozen=True)
class Ops:
    """How the parts that depend on where the model runs are computed (hashable: static under `jax.jit`).
    `routed`: the routed experts' products (`gathered_experts`, or `target.moe`'s machinery); `attention`: an
    attention block's attention and cache write (`cached_attention`, or on a mesh `target.steps.cached_attention`
    under its `shard_map`); `constrain`: applied to the residual stream after each block (on a mesh: pinning it
    replicated over the tensor axis after the row-parallel sums, `Layout.constrain(x, ROWS_AXES)`), or None;
    `mamba_shards`: the blocks each Mamba block's `in_proj` rows and conv channels are in (`mamba2.Mamba2Dims.shards`:
    the tensor axis' size where the mixer is split over it, else 1)."""

    routed: RoutedExperts = gathered_experts
    attention: CachedAttention = cached_attention
    constrain: Callable[[jax.Array], jax.Array] | None = None
    mamba_shards: int = 1


ONE_DEVICE = Ops()  # the defaults: plain XLA on one device, importing no kernel module


# --------------------------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------------------------


def lm_head(params: Params) -> jax.Array:
    """The LM head `[V, H]`: `lm_head.weight`, or the embedding when tied (no `lm_head` in the tree)."""
    own = params.get("lm_head")
    return params["embeddings"]["weight"] if own is None else own["weight"]


def blocks(params: Params, c: NemotronHConfig, tokens: jax.Array, cache: NemotronHCache | PendingCache,
           start: jax.Array, valid: jax.Array, layer_ids: tuple[int, ...], *, keep_states: bool,
           ops: Ops = ONE_DEVICE):
    """Every block over `tokens [batch, S]` at positions `start[b] ..`, after the committed `cache`: `(hidden
    [batch, S, H] after norm_f, features [batch, S, Lf * H], k, v, mamba)`, the Mamba states after the last
    `valid [batch, S]` row (a right-padded prefix), or with `keep_states` after each row."""
    check_layer_ids(layer_ids, c.num_hidden_layers)
    N, eps, dims = c.num_hidden_layers, c.layer_norm_epsilon, c.mamba_dims._replace(shards=ops.mamba_shards)
    batch, S = tokens.shape
    positions = start[:, None] + jnp.arange(S, dtype=jnp.int32)  # [batch, S]
    embed = params["embeddings"]["weight"]
    with jax.named_scope("embed"):
        x = x0 = jnp.take(embed, tokens, axis=0).astype(embed.dtype)  # [batch, S, H]
    keys, values, states = list(cache.k), list(cache.v), list(cache.mamba)
    by_id: dict[int, jax.Array] = {}
    a = m = 0  # the next attention / Mamba block's cache entry
    for i, (kind, p) in enumerate(zip(c.layers_block_type, params["layers"])):
        xn, mp = norm(x, p["norm"]["weight"], eps), p["mixer"]
        if kind == MAMBA:
            with jax.named_scope("mamba"):
                out, states[m] = mixer(mp, dims, xn, states[m], valid, keep_states=keep_states)
            m += 1
        elif kind == ATTENTION:
            with jax.named_scope("attention"):
                out, keys[a], values[a] = attention(mp, c, xn, keys[a], values[a], positions, start, ops.attention)
            a += 1
        elif kind == MOE:
            with jax.named_scope("moe"):
                out = moe(mp, c, xn, ops.routed)
        else:
            with jax.named_scope("mlp"):
                out = mlp(mp, xn)
        x = x + out
        if ops.constrain is not None:
            x = ops.constrain(x)
        if i in layer_ids and i < N - 1:
            by_id[i] = x
    with jax.named_scope("norm_f"):
        hidden = norm(x, params["norm_f"]["weight"], eps)
    by_id |= {-1: x0, N - 1: hidden}
    features = (jnp.concatenate([by_id[l] for l in layer_ids], axis=-1) if layer_ids
                else jnp.zeros((batch, S, 0), x0.dtype))
    return hidden, features, tuple(keys), tuple(values), tuple(states)


def forward(params: Params, config: NemotronHConfig, tokens: jax.Array, cache: NemotronHCache, lengths: jax.Array,
            layer_ids: tuple[int, ...] = (), *, ops: Ops = ONE_DEVICE) -> tuple[jax.Array, jax.Array, PendingCache]:
    """Run `tokens [batch, S]` at positions `lengths[b] .. lengths[b] + S - 1` after the committed `cache` (its
    attention slots `[0, lengths)` read; `lengths + S` within its capacity): `(logits [batch, S, V] float32,
    features [batch, S, Lf * H], PendingCache)`, the pending cache to be committed with `commit(pending, kept)`.
    `config`, `layer_ids` and `ops` are static under `jax.jit`."""
    start = lengths.astype(jnp.int32)
    valid = jnp.ones(tokens.shape, bool)
    hidden, features, k, v, mamba = blocks(params, config, tokens, cache, start, valid, tuple(layer_ids),
                                           keep_states=True, ops=ops)
    with jax.named_scope("lm_head"):
        logits = lm_logits(hidden, lm_head(params))
    return logits, features, PendingCache(k, v, mamba)


def prefill(params: Params, config: NemotronHConfig, tokens: jax.Array, cache: NemotronHCache, lengths: jax.Array,
            layer_ids: tuple[int, ...] = (), chunk: int = 2048, *, ops: Ops = ONE_DEVICE,
            project: FeatureMap | None = None) -> tuple[jax.Array, jax.Array, NemotronHCache]:
    """Right-padded prompts `tokens [batch, P]` (`lengths [batch]` real tokens, each at least 1) into an empty
    `cache`, `chunk` token rows a step over the whole batch (`chunk // batch` rows of each prompt, at least one; a
    `lax.scan`, the last step padded; the Mamba scan runs in `chunk_size` pieces within a step): `(logits of each
    prompt's last token [batch, V] float32, features of every row [batch, P, Lf * H] (or `project`'s map of each
    step's), the committed cache)`. Rows past a prompt's length leave its Mamba states as they were; their K/V land
    past its length, where nothing reads them. `config`, `layer_ids`, `chunk` and `ops` are static."""
    batch, P = tokens.shape
    rows = min(P, max(1, chunk // batch))  # rows of each prompt a step
    lengths = lengths.astype(jnp.int32)
    last = lengths - 1  # [batch] each prompt's last row
    layer_ids = tuple(layer_ids)

    def step(carry, inputs):
        cache, last_hidden = carry
        index, piece = inputs  # piece: [batch, rows]
        start = jnp.full((batch,), index * rows, jnp.int32)
        valid = start[:, None] + jnp.arange(rows) < lengths[:, None]  # [batch, rows]
        hidden, features, k, v, mamba = blocks(params, config, piece, cache, start, valid, layer_ids,
                                               keep_states=False, ops=ops)
        row = jnp.clip(last - index * rows, 0, rows - 1)
        here = ((last >= index * rows) & (last < (index + 1) * rows))[:, None]
        last_hidden = jnp.where(here, jnp.take_along_axis(hidden, row[:, None, None], axis=1)[:, 0], last_hidden)
        return (NemotronHCache(k, v, mamba), last_hidden), mapped(project, features)

    pieces = chunked(tokens, rows)  # [n, batch, rows]
    n = pieces.shape[0]
    zeros = jnp.zeros((batch, config.hidden_size), params["embeddings"]["weight"].dtype)
    (cache, last_hidden), features = jax.lax.scan(step, (cache, zeros), (jnp.arange(n), pieces))
    features = features.swapaxes(0, 1).reshape(batch, n * rows, -1)[:, :P]  # [batch, P, Lf * H or D]
    with jax.named_scope("lm_head"):
        logits = lm_logits(last_hidden, lm_head(params))
    return logits, features, cache

"""One drafting step: `propose`, with a static-shape context K/V cache, and the draft samplers.

The step (z-lab `dflash/model.py`'s `dflash_generate`, batched): the target's features for the rows accepted
since the last step are projected
into every layer's K/V and appended to `ContextCache`; the block `[anchor, MASK x (B-1)]` attends to the whole
cache plus itself (on full layers that see every key, with the new rows and the block written into the cache
first, so that one span is read); the draft rows' hidden states become tokens:

- DFlash: argmax (or a sample) of `lm_head(h)` on rows 1..B-1 (z-lab convention).
- DSpark: all B rows, sampled sequentially with the Markov bias `markov_w2(markov_w1[prev])` (prev_0 = anchor;
  prev are target ids: with a reduced draft vocabulary, `markov_w1` is `[V, r]` and `markov_w2` `[draft V, r]`,
  as vLLM speculators' DSpark head is); the confidence head gives `sigmoid(proj([h_k ; markov_w1[prev_k]]))` per
  row and can cut the proposal. Gemma 4 softcaps the logits before the bias.
- DFlash2: `softcap(lm_head(h) * output_multiplier)`, top-K candidates per row, then the candidate selector walk
  (bilinear predecessor/successor scores, greedy or sampled).

Every shape is static: the cache holds `max_context` rows per sequence, `lengths` says how many are real, new
rows are padded to a fixed count and masked by `num_new`, so one compiled program serves every step.
Rejected context rows are dropped by passing a smaller `num_new`, or afterwards with `ContextCache.trim`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from ._arguments import (
    as_ids,
    call_donating,
    check_heads,
    check_integer,
    check_load_arguments,
    check_params,
    check_propose_inputs,
    check_sampling,
)
from ._shapes import ceil_div, round_up, zeros
from .attention import (
    ATTEND_IMPLS,
    SPAN_ALIGN,
    Impl,
    KeyValues,
    LayerRule,
    Span,
    check_impl,
    span_capacity,
    write_slots,
)
from .config import DflashConfig
from .drafter import Drafter, draft_to_target_ids
from .layers import dot, lm_logits
from .model import (
    Absorb,
    AttentionOptions,
    Context,
    Memory,
    attention_rules,
    embed_block,
    forward,
    layer_functions,
    project_context,
)
from .platform import Platform, platform_of
from .rope import rope_tables
from .sampling import Warp, choose
from .target import FeatureMap
from .tuning import Tuning

__all__ = ["ContextCache", "Proposal", "init_cache", "propose", "append_context", "sample_drafts", "context_projection"]

APPEND_CHUNK = 2048  # context rows projected at a time when a step brings more (a long prompt's first step)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ContextCache:
    """Per-layer context K/V of a batch of sequences (keys after k_norm and RoPE at their absolute positions).

    A layer with a window (a trained `sliding_attention` layer, or a full one under `draft_window`) keeps a ring
    buffer: position p in slot `p % ring`, `ring` = window + block size rows (past 128 rows rounded up to a
    multiple of 128 for the GPU's GEMMs), so its memory does not grow with the context. With `ring_spans`
    (`init_cache` sets it from `tuning.Tuning.ring_spans_min_batch` sequences on) a ring is read as spans by
    the GPU kernel, and past 128 rows rounded up by `attention.span_capacity` for it instead. The other layers keep
    every position p in slot p, up to `max_context`, and room for a block after it (`_absorbed`; their rows are rounded
    up by `attention.span_capacity`, so that the GPU kernel reads them well). `attention`: the options the cache
    was made with (`propose` refuses others: they decide which layers are rings).
    """

    keys: tuple[jax.Array, ...]  # per layer [batch, n_kv, rows, d_h]; rows: max_context + block rounded up, or a ring's
    values: tuple[jax.Array, ...]  # per layer [batch, n_kv, rows, d_h]
    lengths: jax.Array  # [batch] int32: context positions 0 .. lengths-1 have been appended
    overflow: jax.Array  # [batch] bool: a sequence outgrew max_context (rows past it were dropped)
    max_context: int = dataclasses.field(metadata=dict(static=True))
    rings: tuple[bool, ...] = dataclasses.field(metadata=dict(static=True))  # per layer: a ring buffer
    attention: AttentionOptions = dataclasses.field(metadata=dict(static=True))
    ring_spans: bool = dataclasses.field(default=False, metadata=dict(static=True))  # rings read as spans (below)

    def trim(self, lengths: jax.Array) -> ContextCache:
        """Forget rows at and past `lengths` `[batch]` (rejected context): only the lengths change.

        Exact for a trim of up to `block_size + 1` rows per append on ring-buffered layers (the ring's slack);
        a deeper trim loses the oldest window rows there. The speculative loop never trims (it appends only
        accepted rows).
        """
        return dataclasses.replace(self, lengths=jnp.minimum(self.lengths, jnp.asarray(lengths, jnp.int32)))

    def check(self) -> None:
        """Raise `ValueError` if a sequence outgrew `max_context` (reads the flags: a host sync)."""
        overflow = np.asarray(self.overflow)
        if overflow.any():
            raise ValueError(
                f"context cache overflow: sequences {np.flatnonzero(overflow).tolist()} outgrew "
                f"max_context={self.max_context}; their newest context rows were dropped, so their drafts are "
                "wrong. Make the cache with a larger max_context."
            )


def _rings(rules) -> tuple[bool, ...]:
    """Per layer: a ring buffer (a window and no sinks), else every position kept."""
    return tuple(r.window is not None and r.sinks == 0 for r in rules)


def _ring_rows(needed: int, spans: bool, tuning: Tuning) -> int:
    """A ring's rows: `needed` (window + block size), rounded up past `SPAN_ALIGN` rows (a longer ring holds more
    positions, outside the window): read as spans, by `span_capacity` so that the GPU kernel reads it; scored
    whole, to a multiple of `SPAN_ALIGN`, since XLA pads an unaligned ring for its GPU GEMMs on every step
    (docs/benchmarks.md)."""
    if needed <= SPAN_ALIGN:
        return needed
    return span_capacity(needed, tuning) if spans else round_up(needed, SPAN_ALIGN)


def init_cache(
    drafter: Drafter,
    batch_size: int,
    max_context: int,
    *,
    dtype: jnp.dtype | None = None,
    sharding: jax.sharding.Sharding | None = None,
    attention: AttentionOptions = AttentionOptions(),
    platform: Platform | None = None,
) -> ContextCache:
    """An empty cache for `batch_size` sequences of up to `max_context` context rows.

    dtype: the params' by default. sharding: where the cache lives, by default where the params do (one device,
    or replicated over their mesh); e.g. `NamedSharding(mesh, P("data"))` to split the batch. The arrays are
    committed there, as `propose` returns them, so the first step and the later ones share one compiled program.
    `attention` (`AttentionOptions`) decides which layers are ring buffers: the cache records it, and `propose`
    must be given the same. `platform`: whose tuning sizes the rows and decides ring spans (default: that of the
    devices `sharding` names, `platform.platform_of`).
    """
    batch_size = check_integer("init_cache", "batch_size", batch_size, 1)
    max_context = check_integer("init_cache", "max_context", max_context, 1)
    if dtype is not None:
        dtype = check_load_arguments("init_cache", dtype, None)
    c = drafter.config
    fc = drafter.params["fc"]["weight"]
    dtype, sharding = dtype or fc.dtype, sharding or fc.sharding
    rules = attention_rules(c, attention)
    rings = _rings(rules)
    # aligned for the GPU kernel, with room for the block after a full context (`_absorbed`)
    tuning = (platform or platform_of(sharding)).tuning
    full_rows = span_capacity(max_context + c.effective_block_size, tuning)
    ring_spans = batch_size >= tuning.ring_spans_min_batch
    rows = [full_rows if not ring or r.window is None else
            _ring_rows(min(max_context, r.window + c.effective_block_size), ring_spans, tuning)
            for r, ring in zip(rules, rings)]

    def empty(shape, dtype) -> jax.Array:  # distinct committed buffers, so the whole cache can be donated
        where = sharding
        if isinstance(where, jax.sharding.NamedSharding):  # spelled as jit outputs spell it: one entry per axis
            if any(where.spec[len(shape):]):  # the params' sharding splits an axis the array does not have
                raise ValueError(f"init_cache: sharding {where.spec} does not fit a {len(shape)}-d cache array; "
                                 "pass sharding= for the cache")
            where = where.update(spec=(*where.spec, *(None,) * len(shape))[: len(shape)])
        return zeros(shape, dtype, where)

    shapes = [(batch_size, c.num_key_value_heads, n, c.head_dim) for n in rows]
    return ContextCache(
        keys=tuple(empty(shape, dtype) for shape in shapes),
        values=tuple(empty(shape, dtype) for shape in shapes),
        lengths=empty((batch_size,), jnp.int32),
        overflow=empty((batch_size,), bool),
        max_context=max_context,
        rings=rings,
        attention=attention,
        ring_spans=ring_spans,
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Proposal:
    """The drafts of one step, in target vocabulary ids."""

    tokens: jax.Array  # [batch, num_draft_tokens] int32
    num_tokens: jax.Array  # [batch] int32: drafts to verify (fewer than num_draft_tokens after a confidence cut)
    probs: jax.Array | None = None  # [batch, num_draft_tokens, V] f32: q, the distribution each draft was drawn from
    confidence: jax.Array | None = None  # [batch, num_draft_tokens] f32: DSpark's predicted acceptance, sigmoid
    draft_prob: jax.Array | None = None  # [batch, num_draft_tokens] f32: the drafter's probability of each draft
    # (q's, sampled; greedily, the softmax of the scores it took the argmax of): the adaptive policy's signal

    def head(self, n: int) -> Proposal:
        """The first `n` drafts (a static count): the rest are not proposed."""
        return Proposal(
            tokens=self.tokens[:, :n], num_tokens=jnp.minimum(self.num_tokens, n),
            probs=None if self.probs is None else self.probs[:, :n],
            confidence=None if self.confidence is None else self.confidence[:, :n],
            draft_prob=None if self.draft_prob is None else self.draft_prob[:, :n])

    def predicted_acceptance(self) -> jax.Array:
        """`[batch, num_draft_tokens]`: DSpark's confidence head where there is one, else `draft_prob`."""
        out = self.draft_prob if self.confidence is None else self.confidence
        assert out is not None, "a proposal from sample_drafts carries draft_prob"
        return out


def _row_keys(key: jax.Array | None, rows: int) -> jax.Array | None:
    return None if key is None else jax.random.split(key, rows)


def _chosen_prob(scores: jax.Array, pick: jax.Array, probs: jax.Array | None) -> jax.Array:
    """The probability the drafter gave its `pick` `[...]` among `scores [..., n]`: q's when sampled (`probs`), else
    softmax(scores)'s."""
    if probs is not None:
        return jnp.take_along_axis(probs, pick[..., None], axis=-1)[..., 0]
    chosen = jnp.take_along_axis(scores, pick[..., None], axis=-1)[..., 0]
    return jnp.exp(chosen - jax.nn.logsumexp(scores, axis=-1))


def _markov_walk(params, logits, anchor_ids, key, warp: Warp):
    """DSpark: row k draws from `logits_k + markov_w2(markov_w1[prev_k])`, prev_0 = anchor, prev_k = draft k-1 as a
    target id (`d2t` maps a reduced vocabulary's draft ids: `markov_w1` is indexed by target ids, speculators').
    Returns `(tokens, q or None, the probability of each draft)`, tokens as draft ids."""
    w1 = params["markov_head"]["markov_w1"]["weight"]  # [V, r]
    w2 = params["markov_head"]["markov_w2"]["weight"]  # [draft V, r]
    d2t = params.get("d2t")

    def step(prev, row):
        base, row_key = row  # [batch, draft V] f32
        bias = dot("br,vr->bv", jnp.take(w1, prev, axis=0), w2)  # [batch, draft V]
        token, probs = choose(row_key, base + bias, warp)  # a draft id
        return draft_to_target_ids(token, d2t), (token, probs, _chosen_prob(base + bias, token, probs))

    rows = (jnp.moveaxis(logits, 1, 0), _row_keys(key, logits.shape[1]))  # scan over draft rows
    _, (tokens, probs, chosen) = jax.lax.scan(step, anchor_ids, rows)
    return tokens.T, None if probs is None else jnp.moveaxis(probs, 0, 1), chosen.T


def _selector_walk(params, config, hidden, logits, anchor_ids, key, warp: Warp):
    """DFlash2: per row, top-K candidates by unary score `u`, then `s[k] = u[k] + <A[pred] * P h, Bc[cand_k]>`."""
    sel = params["candidate_selector"]
    unary, cand = jax.lax.top_k(logits, config.dflash_config.selector_top_k)  # [batch, n, K]
    context = dot("bnh,rh->bnr", hidden, sel["hidden_projection"]["weight"])  # [batch, n, r]
    successors = jnp.take(sel["successor_codebook"], cand, axis=0)  # [batch, n, K, r]
    predecessors = sel["predecessor_codebook"]  # [V, r]

    def step(pred, row):
        u, ids, ctx, succ, row_key = row  # [batch, K], [batch, K], [batch, r], [batch, K, r]
        state = jnp.take(predecessors, pred, axis=0).astype(jnp.float32) * ctx  # [batch, r]
        scores = u + dot("br,bkr->bk", state, succ.astype(jnp.float32))  # [batch, K]
        pick, probs = choose(row_key, scores, warp)
        token = jnp.take_along_axis(ids, pick[:, None], axis=1)[:, 0]
        return token, (token, probs, _chosen_prob(scores, pick, probs))

    rows = tuple(jnp.moveaxis(a, 1, 0) for a in (unary, cand, context, successors))
    _, (tokens, cand_probs, chosen) = jax.lax.scan(step, anchor_ids, (*rows, _row_keys(key, logits.shape[1])))
    if cand_probs is None:
        return tokens.T, None, chosen.T
    batch, n, vocab = logits.shape
    probs = jnp.zeros((batch, n, vocab), jnp.float32)  # q is zero off the candidates
    probs = probs.at[jnp.arange(batch)[:, None, None], jnp.arange(n)[None, :, None], cand].set(
        jnp.moveaxis(cand_probs, 0, 1)
    )
    return tokens.T, probs, chosen.T


def _confidence(params, hidden, anchor_ids, tokens):
    """DSpark's `sigmoid(proj([h_k ; markov_w1[prev_k]]))` (or `proj(h_k)` for a head without the Markov input)."""
    proj = params["confidence_head"]["proj"]
    features = hidden  # [batch, n, H]
    if proj["weight"].shape[1] != hidden.shape[-1]:
        prev = jnp.concatenate([anchor_ids[:, None], tokens[:, :-1]], axis=1)  # [batch, n]
        latent = jnp.take(params["markov_head"]["markov_w1"]["weight"], prev, axis=0).astype(hidden.dtype)
        features = jnp.concatenate([hidden, latent], axis=-1)  # [batch, n, H + r]
    logit = dot("bnf,of->bno", features, proj["weight"])[..., 0] + proj["bias"][0].astype(jnp.float32)
    return jax.nn.sigmoid(logit)


def sample_drafts(
    drafter: Drafter,
    hidden: jax.Array,
    anchor_ids: jax.Array,
    *,
    key: jax.Array | None = None,
    temperature: float | jax.Array = 0.0,
    top_k: int | jax.Array | None = None,
    top_p: float | jax.Array | None = None,
    min_p: float | jax.Array | None = None,
    confidence_threshold: float | jax.Array = 0.0,
) -> Proposal:
    """Turn the draft rows' final hidden states `[batch, num_draft_tokens, H]` into a `Proposal`.

    anchor_ids: `[batch]` the block's row-0 token (the predecessor of the first draft). Without `key`, greedy
    (argmax); with one, sampled at `temperature` (scalar or `[batch]`; 0 keeps a sequence greedy) after the
    `top_k` / `top_p` / `min_p` cuts (scalars or `[batch]`; None: off; `dflash_jax.sampling`), and `probs`, the
    warped distribution each draft was drawn from, returned. `confidence_threshold`: DSpark proposals end
    before the first row whose confidence is below it (0 disables the cut). The LM head is the drafter's own,
    else the target's attached with `Drafter.attach`.
    """
    params, config = drafter.params, drafter.config
    batch = hidden.shape[0]
    selector, markov = "candidate_selector" in params, "markov_head" in params
    if "d2t" in params and selector:
        raise NotImplementedError(
            "a reduced draft vocabulary (d2t) with a candidate selector needs the anchor in draft ids (t2d), which "
            "checkpoints do not ship"
        )
    logits = lm_logits(hidden, drafter.output_head)  # [batch, n, V] f32
    multiplier, cap = config.logit_transform  # DFlash2 only (`DflashConfig.logit_transform`)
    if multiplier is not None:
        logits = logits * multiplier
    if cap is not None:
        logits = cap * jnp.tanh(logits / cap)
    anchor_ids = anchor_ids.astype(jnp.int32)
    def per_sequence(x, dtype) -> jax.Array:  # [batch]
        return jnp.broadcast_to(jnp.asarray(x, dtype), (batch,))

    warp = Warp(per_sequence(temperature, jnp.float32),
                top_k=None if top_k is None else per_sequence(top_k, jnp.int32),
                top_p=None if top_p is None else per_sequence(top_p, jnp.float32),
                min_p=None if min_p is None else per_sequence(min_p, jnp.float32))

    if selector:
        tokens, probs, draft_prob = _selector_walk(params, config, hidden, logits, anchor_ids, key, warp)
    elif markov:
        tokens, probs, draft_prob = _markov_walk(params, logits, anchor_ids, key, warp)
    else:
        tokens, probs = choose(key, logits, warp)
        draft_prob = _chosen_prob(logits, tokens, probs)

    n = tokens.shape[1]
    num_tokens = jnp.full((batch,), n, jnp.int32)
    if "d2t" in params:
        if probs is not None:  # spread q over the target vocabulary: draft id i is target id i + d2t[i]
            target_ids = jnp.arange(params["d2t"].shape[0]) + params["d2t"]
            probs = jnp.zeros((*probs.shape[:2], config.vocab_size), probs.dtype).at[..., target_ids].set(probs)
        tokens = draft_to_target_ids(tokens, params["d2t"])
    confidence = None
    if "confidence_head" in params:
        confidence = _confidence(params, hidden, anchor_ids, tokens)  # [batch, n]; prev as target ids
        below = confidence < confidence_threshold
        num_tokens = jnp.where(below.any(axis=1), jnp.argmax(below, axis=1), n).astype(jnp.int32)
    return Proposal(tokens=tokens, num_tokens=num_tokens, probs=probs, confidence=confidence, draft_prob=draft_prob)


def _append(cache: ContextCache, new_kv, num_new: jax.Array) -> ContextCache:
    """Write the first `num_new [batch]` of the new rows' K/V `[batch, n_kv, n_new, d_h]` at positions `lengths..`.

    Ring layers keep the last `ring` of them (older ones would share a slot); full layers drop rows past
    `max_context` and flag the sequence in `overflow`. A layer whose entry is None keeps its arrays (the forward
    wrote its rows: `_absorbed`).
    """
    end = cache.lengths + num_new  # [batch]
    keys, values = [], []
    for k, v, new, ring in zip(cache.keys, cache.values, new_kv, cache.rings):
        if new is not None:
            slots = _context_slots(cache, k.shape[2], ring, num_new, new[0].shape[2])
            k, v = write_slots(k, new[0], slots), write_slots(v, new[1], slots)
        keys.append(k)
        values.append(v)
    return dataclasses.replace(cache, keys=tuple(keys), values=tuple(values), lengths=end,
                               overflow=cache.overflow | (end > cache.max_context))


def _context_slots(cache: ContextCache, rows: int, ring: bool, num_new: jax.Array, n_new: int) -> jax.Array:
    """`[batch, n_new]` slots of a layer of `rows` rows for `n_new` new context rows at positions `lengths..`, the
    first `num_new` real: `p % rows` on a ring (the last `rows` of them), p on a full layer (below `max_context`),
    `rows` (dropped) for the others."""
    positions = cache.lengths[:, None] + jnp.arange(n_new)  # [batch, n_new]
    fresh = jnp.arange(n_new) < num_new[:, None]
    if ring:
        keep = fresh & (positions >= (cache.lengths + num_new)[:, None] - rows)
    else:
        keep = fresh & (positions < cache.max_context)
    return jnp.where(keep, positions % rows if ring else positions, rows)


def _append_chunked(drafter: Drafter, cache: ContextCache, target_hidden: jax.Array, num_new: jax.Array,
                    chunk: int, projected: bool = False) -> ContextCache:
    """Project and append `target_hidden [batch, n_new, Lf*H]` (`projected`: already projected, `[batch, n_new,
    H]`) `chunk` rows at a time (a `lax.scan`), so a long prompt needs a chunk's activations, not the prompt's.
    Each step slices its rows out of `target_hidden` (a chunk-major copy of it would double its memory); the last
    step's slice ends at `n_new` and starts early, its rows rolled so that the new ones come first."""
    params, config = drafter.params, drafter.config
    n = target_hidden.shape[1]

    def step(cache, c):
        start = jnp.minimum(c * chunk, n - chunk)
        rows = jax.lax.dynamic_slice_in_dim(target_hidden, start, chunk, axis=1)  # [batch, chunk, Lf*H or H]
        rows = jnp.roll(rows, start - c * chunk, axis=1)  # the last step: its rows before c * chunk go last
        ctx = rows if projected else project_context(params, config, rows)  # [batch, chunk, H]
        rope = rope_tables(config, cache.lengths[:, None] + jnp.arange(chunk, dtype=jnp.int32))
        keys_values = layer_functions(config).keys_values  # the variant's (Gemma 4: V from K)
        kv = [keys_values(p["self_attn"], config, ctx, rope) for p in params["layers"]]
        return _append(cache, kv, jnp.clip(num_new - c * chunk, 0, chunk)), None

    cache, _ = jax.lax.scan(step, cache, jnp.arange(ceil_div(n, chunk), dtype=jnp.int32))
    return cache


def _memory(cache: ContextCache, layer: int, rule: LayerRule, start: jax.Array, block: int) -> Memory:
    """What layer `layer`'s block queries (positions `start .. start + block - 1`) read of the cache.

    Without a window: the span of slots `[0, lengths)`. A ring (no sinks) holds positions `[lengths - rows,
    lengths)` in slots `p % rows`: scored whole, masked by position, or (`cache.ring_spans`) read as below. With
    a window: the keys every query's window covers, as spans (read unmasked, by the GPU kernel where it applies),
    and the `block - 1` positions at the window's edge that only some queries see, as a masked strip. On a ring
    the covered range is one slot range, or two where it wraps; a full layer keeps its sinks `[0, sinks)` as a
    span of their own.
    """
    k, v, lengths = cache.keys[layer], cache.values[layer], cache.lengths
    rows, ring = k.shape[2], cache.rings[layer]
    if ring and not cache.ring_spans:
        newest = lengths[:, None] - 1 - jnp.mod(lengths[:, None] - 1 - jnp.arange(rows), rows)  # position in a slot
        return Memory(dense=(KeyValues(k, v, newest, newest >= 0),))
    stop = lengths if ring else jnp.minimum(lengths, cache.max_context)  # [batch]
    if rule.window is None:
        return Memory(spans=(Span(k, v, jnp.zeros_like(stop), stop),))
    oldest = jnp.maximum(stop - rows, 0) if ring else jnp.minimum(rule.sinks, stop)  # [batch] the window's floor
    interior = jnp.clip(start + block - rule.window, oldest, stop)  # every query's window reaches back to here
    positions = (start - rule.window + 1)[:, None] + jnp.arange(block - 1)  # [batch, block - 1] the edge
    slots = (jnp.mod(positions, rows) if ring else jnp.clip(positions, 0, rows - 1))[:, None, :, None]
    strip = KeyValues(
        jnp.take_along_axis(k, slots, axis=2),  # [batch, n_kv, block - 1, d_h]
        jnp.take_along_axis(v, slots, axis=2),
        positions,
        (positions >= oldest[:, None]) & (positions < interior[:, None]),
    )
    if ring:
        first = jnp.mod(interior, rows)
        end = first + stop - interior  # past `rows`: the range wraps to slot 0
        spans = (Span(k, v, first, jnp.minimum(end, rows)), Span(k, v, jnp.zeros_like(end), jnp.maximum(end - rows, 0)))
    else:
        spans = (Span(k, v, jnp.zeros_like(stop), oldest), Span(k, v, interior, stop))
    return Memory(spans=spans, dense=(strip,))


def _absorbed(cache: ContextCache, layer: int, num_new: jax.Array, n_new: int, block: int) -> Memory:
    """What a full layer whose queries see every key (no causal mask, no window) reads: the cache, with this step's
    `n_new` context rows (the first `num_new` real) at their positions and the block's rows right after the kept
    context, as one span. Context rows past `max_context` are not written; the block's slots past the context are
    scratch that the next step's context overwrites (`init_cache` leaves room for a block after `max_context`)."""
    k = cache.keys[layer]
    context = _context_slots(cache, k.shape[2], False, num_new, n_new)  # [batch, n_new]
    kept = jnp.minimum(cache.lengths + num_new, cache.max_context)  # [batch] the context's end in the cache
    slots = jnp.concatenate([context, kept[:, None] + jnp.arange(block)], axis=1)  # [batch, n_new + block]
    return Memory(absorb=Absorb(k, cache.values[layer], slots, kept + block))


def _check_attention(cache: ContextCache, attention: AttentionOptions, where: str) -> None:
    if attention != cache.attention:
        raise ValueError(f"the cache was made with {cache.attention}, this {where} call has {attention}: pass "
                         f"init_cache and {where} the same attention options (they decide the cache's layout)")


def append_context(
    drafter: Drafter,
    cache: ContextCache,
    target_hidden: jax.Array,
    num_new: jax.Array,
    *,
    attention: AttentionOptions = AttentionOptions(),
    append_chunk: int = APPEND_CHUNK,
    projected: bool = False,
) -> ContextCache:
    """Append context rows without drafting: `propose`'s first half, for steps that make no drafts.

    target_hidden `[batch, n_new, Lf*H]` and num_new `[batch]` as in `propose`; the rows are projected and their
    K/V written `append_chunk` at a time. `projected`: target_hidden is already `context_projection(drafter)` of
    the features, `[batch, n_new, H]` (what a target's `prefill` returns given it). The cache is donated;
    `attention` must be the cache's.
    """
    num_new = as_ids("append_context", "num_new", num_new)
    return call_donating("append_context", cache, _append_context, drafter, cache, target_hidden, num_new,
                         attention=attention, append_chunk=append_chunk, projected=projected)


@functools.partial(jax.jit, static_argnames=("attention", "append_chunk", "projected"), donate_argnames=("cache",))
def _append_context(drafter: Drafter, cache: ContextCache, target_hidden: jax.Array, num_new: jax.Array, *,
                    attention: AttentionOptions, append_chunk: int, projected: bool) -> ContextCache:
    check_integer("append_context", "append_chunk", append_chunk, 1)
    check_params(drafter.config, drafter.params, "append_context")
    check_propose_inputs(drafter.config, "append_context", cache.lengths.shape[0], target_hidden, num_new,
                         projected=projected)
    _check_attention(cache, attention, "append_context")
    return _append_chunked(drafter, cache, target_hidden, jnp.asarray(num_new, jnp.int32),
                           min(append_chunk, target_hidden.shape[1]), projected)


@dataclasses.dataclass(frozen=True)
class _ContextProjection:
    """`project_context` of one drafter config: hashable, so that a `FeatureMap` of it keys compiled programs."""

    config: DflashConfig

    def __call__(self, params: dict, features: jax.Array) -> jax.Array:
        return project_context(params, self.config, features)  # [batch, rows, H]


def context_projection(drafter: Drafter) -> FeatureMap:
    """The drafter's context projection (`fc`, then `hidden_norm`: `[batch, rows, Lf*H] -> [batch, rows, H]`) as a
    `FeatureMap`, for a target's `prefill` to apply as it makes the features; `append_context(...,
    projected=True)` takes its output."""
    params = {name: drafter.params[name] for name in ("fc", "hidden_norm")}
    return FeatureMap(params, _ContextProjection(drafter.config))


def propose(
    drafter: Drafter,
    cache: ContextCache,
    target_hidden: jax.Array,
    num_new: jax.Array,
    anchor_ids: jax.Array,
    *,
    key: jax.Array | None = None,
    temperature: float | jax.Array = 0.0,
    top_k: int | jax.Array | None = None,
    top_p: float | jax.Array | None = None,
    min_p: float | jax.Array | None = None,
    confidence_threshold: float | jax.Array = 0.0,
    attention: AttentionOptions = AttentionOptions(),
    impl: Impl = "auto",
    append_chunk: int = APPEND_CHUNK,
    checked: bool = False,
) -> tuple[Proposal, ContextCache]:
    """One drafting step for a batch; returns the proposal and the cache with the new context appended.

    target_hidden: `[batch, n_new, Lf*H]` target features of the context rows since the last step (the prompt
    at the first step, then the anchor and accepted drafts), padded to a fixed `n_new`; num_new: `[batch]`
    how many of them are real; they take positions `cache.lengths ...`. anchor_ids: `[batch]` the last
    committed token, at position `cache.lengths + num_new` (the block start). The cache is donated: keep the
    returned one. More than `append_chunk` new rows are projected and appended in chunks of it first. A sequence
    whose context outgrows `max_context` is flagged in `cache.overflow` (`ContextCache.check` raises): under
    `jit` the values cannot raise.

    key / temperature / top_k / top_p / min_p / confidence_threshold: as `sample_drafts` (the embedding and LM
    head: the drafter's own, else the target's attached with `Drafter.attach`); attention: the attention rule
    (`AttentionOptions`), the one the
    cache was made with (another raises ValueError); impl: the attention's kernel, "auto", "xla" or "pallas"
    (`dflash_jax.attention.attend`; another is a `ValueError`). Shapes (and the parameter tree, the embedding and LM
    head against the config) are checked when the program is traced; values are not, since the step is jitted: a
    `num_new` outside `[0, n_new]` still moves `cache.lengths` by that much (over rows never written, or back over
    real ones), an id past the vocabulary is clamped by the gather, and a temperature > 0 without a key, or a
    negative one, drafts greedily.
    `checked=True` checks those values eagerly first (concrete inputs only: it reads `num_new`, `anchor_ids`
    and `temperature` back to the host, a sync per call, so it is for debugging, not the decode loop; the
    default path adds a Python call and no device work). A cache passed to an earlier call (donated) is a
    `ValueError` saying so.
    """
    num_new, anchor_ids = as_ids("propose", "num_new", num_new), as_ids("propose", "anchor_ids", anchor_ids)
    impl = check_impl("propose", impl, ATTEND_IMPLS)
    if checked:
        check_propose_inputs(drafter.config, "propose", cache.lengths.shape[0], target_hidden, num_new, anchor_ids)
        check_sampling("propose", key, temperature)
    return call_donating(
        "propose", cache, _propose, drafter, cache, target_hidden, num_new, anchor_ids, key=key,
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, confidence_threshold=confidence_threshold,
        attention=attention, impl=impl, append_chunk=append_chunk)


@functools.partial(jax.jit, static_argnames=("attention", "impl", "append_chunk"), donate_argnames=("cache",))
def _propose(drafter: Drafter, cache: ContextCache, target_hidden: jax.Array, num_new: jax.Array,
             anchor_ids: jax.Array, *, key: jax.Array | None, temperature: float | jax.Array,
             top_k: int | jax.Array | None, top_p: float | jax.Array | None, min_p: float | jax.Array | None,
             confidence_threshold: float | jax.Array, attention: AttentionOptions, impl: Impl,
             append_chunk: int) -> tuple[Proposal, ContextCache]:
    """`propose`'s step, jitted: its checks of shapes and static arguments run once, at trace time."""
    params, config = drafter.params, drafter.config
    check_integer("propose", "append_chunk", append_chunk, 1)
    check_params(config, params, "propose")
    check_heads(config, "propose", drafter.embed, drafter.lm_head)  # attached ones: a Drafter built by hand too
    check_propose_inputs(config, "propose", cache.lengths.shape[0], target_hidden, num_new, anchor_ids)
    batch, n_new = target_hidden.shape[:2]
    B, n_draft = config.effective_block_size, config.num_draft_tokens
    _check_attention(cache, attention, "propose")
    rules = attention_rules(config, attention)
    num_new = jnp.asarray(num_new, jnp.int32)
    dtype = params["fc"]["weight"].dtype
    chunked = n_new > append_chunk
    if chunked:  # append first, then the block reads everything from the cache
        cache = _append_chunked(drafter, cache, target_hidden, num_new, append_chunk)
        start = cache.lengths
        context = Context(jnp.zeros((batch, 0, config.hidden_size), dtype), jnp.zeros((batch, 0), jnp.int32),
                          jnp.zeros((batch, 0), bool))
    else:
        start = cache.lengths + num_new  # [batch] the anchor's position
        context = Context(
            project_context(params, config, target_hidden),  # [batch, n_new, H]
            cache.lengths[:, None] + jnp.arange(n_new, dtype=jnp.int32),  # [batch, n_new]
            jnp.arange(n_new) < num_new[:, None],
        )
    block_ids = jnp.concatenate(
        [anchor_ids[:, None].astype(jnp.int32), jnp.full((batch, B - 1), config.checked_mask_token_id, jnp.int32)],
        axis=1,
    )  # [batch, B]
    x = embed_block(config, drafter.embedding, block_ids, dtype)
    n_context = context.hidden.shape[1]  # this forward's context rows: n_new, or none after a chunked append
    absorbs = [r.window is None and not r.causal for r in rules]
    fresh = jnp.zeros_like(num_new) if chunked else num_new  # [batch] context rows in this forward
    memory = [_absorbed(cache, i, fresh, n_context, B) if absorb else _memory(cache, i, rule, start, B)
              for i, (rule, absorb) in enumerate(zip(rules, absorbs))]
    hidden, new_kv = forward(
        params, config, rules, x, start[:, None] + jnp.arange(B, dtype=jnp.int32), context, memory, impl=impl
    )  # [batch, B, H]
    cache = dataclasses.replace(  # absorbing layers come back written
        cache, keys=tuple(kv[0] if a else k for kv, a, k in zip(new_kv, absorbs, cache.keys)),
        values=tuple(kv[1] if a else v for kv, a, v in zip(new_kv, absorbs, cache.values)))
    if not chunked:
        cache = _append(cache, [None if a else kv for kv, a in zip(new_kv, absorbs)], num_new)
    proposal = sample_drafts(
        drafter,
        hidden[:, B - n_draft :],  # the draft rows: 1..B-1 (z-lab) or all B (`sample_from_anchor`, DSpark)
        anchor_ids,
        key=key,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        confidence_threshold=confidence_threshold,
    )
    return proposal, cache

"""One drafting step: `propose`, with a static-shape context K/V cache, and the draft samplers.

The step (spec §1.6, batched): the target's features for the rows accepted since the last step are projected
into every layer's K/V and appended to `ContextCache`; the block `[anchor, MASK x (B-1)]` attends to the whole
cache plus itself; the draft rows' hidden states become tokens:

- DFlash: argmax (or a sample) of `lm_head(h)` on rows 1..B-1 (z-lab convention).
- DSpark: all B rows, sampled sequentially with the Markov bias `markov_w2(markov_w1[prev])` (prev_0 = anchor);
  the confidence head gives `sigmoid(proj([h_k ; markov_w1[prev_k]]))` per row and can cut the proposal.
- DFlash2: `softcap(lm_head(h) * output_multiplier)`, top-K candidates per row, then the candidate selector walk
  (bilinear predecessor/successor scores, greedy or sampled).

Every shape is static: the cache holds `max_context` rows per sequence, `lengths` says how many are real, new
rows are padded to a fixed count and masked by `num_new`, so one compiled program serves every step.
Rejected context rows are dropped by passing a smaller `num_new`, or afterwards with `ContextCache.trim`.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from .loader import Drafter, draft_to_target_ids
from .model import (
    Context,
    attention_rules,
    dot,
    embed_block,
    forward,
    lm_logits,
    project_context,
)


@flax.struct.dataclass
class ContextCache:
    """Per-layer context K/V of a batch of sequences; row j of sequence b is its context token at position j."""

    keys: tuple[jax.Array, ...]  # per layer [batch, n_kv, max_context, d_h], after k_norm and RoPE
    values: tuple[jax.Array, ...]  # per layer [batch, n_kv, max_context, d_h]
    lengths: jax.Array  # [batch] int32: rows 0..lengths-1 are real

    @property
    def max_context(self) -> int:
        return self.keys[0].shape[2]

    def trim(self, lengths: jax.Array) -> ContextCache:
        """Forget rows at and past `lengths` `[batch]` (rejected context): only the lengths change."""
        return self.replace(lengths=jnp.minimum(self.lengths, jnp.asarray(lengths, jnp.int32)))


def init_cache(
    drafter: Drafter,
    batch_size: int,
    max_context: int,
    *,
    dtype: jnp.dtype | None = None,
    sharding: jax.sharding.Sharding | None = None,
) -> ContextCache:
    """An empty cache for `batch_size` sequences of up to `max_context` context rows.

    dtype: the params' by default. sharding: where the cache lives, by default where the params do (one device,
    or replicated over their mesh); e.g. `NamedSharding(mesh, P("data"))` to split the batch. The arrays are
    committed there, as `propose` returns them, so the first step and the later ones share one compiled program.
    """
    c = drafter.config
    fc = drafter.params["fc"]["weight"]
    dtype, sharding = dtype or fc.dtype, sharding or fc.sharding
    shape = (batch_size, c.num_key_value_heads, max_context, c.head_dim)

    def zeros(shape, dtype) -> jax.Array:  # distinct committed buffers, so the whole cache can be donated
        where = sharding
        if isinstance(where, jax.sharding.NamedSharding):  # spelled as jit outputs spell it: one entry per axis
            where = where.update(spec=(*where.spec, *(None,) * (len(shape) - len(where.spec))))
        return jax.device_put(np.zeros(shape, dtype), where)

    return ContextCache(
        keys=tuple(zeros(shape, dtype) for _ in range(c.num_hidden_layers)),
        values=tuple(zeros(shape, dtype) for _ in range(c.num_hidden_layers)),
        lengths=zeros((batch_size,), jnp.int32),
    )


@flax.struct.dataclass
class Proposal:
    """The drafts of one step, in target vocabulary ids."""

    tokens: jax.Array  # [batch, num_draft_tokens] int32
    num_tokens: jax.Array  # [batch] int32: drafts to verify (fewer than num_draft_tokens after a confidence cut)
    probs: jax.Array | None = None  # [batch, num_draft_tokens, V] f32: q, the distribution each draft was drawn from
    confidence: jax.Array | None = None  # [batch, num_draft_tokens] f32: DSpark's predicted acceptance, sigmoid


def _choose(key: jax.Array | None, logits: jax.Array, temperature: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    """Pick one id per row of `logits [batch, ..., n]`: argmax without a key, else a sample at `temperature [batch]`.

    With a key, also returns the distribution the pick was drawn from, `[batch, ..., n]`: `softmax(logits / T)`,
    or one-hot at the argmax for sequences with T = 0 (greedy rows stay deterministic in a sampled batch).
    """
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if key is None:
        return greedy, None
    t = temperature.reshape(-1, *([1] * (logits.ndim - 1)))  # [batch, 1, ..., 1]
    hot = t > 0
    scaled = logits / jnp.where(hot, t, 1.0)
    sampled = jax.random.categorical(key, scaled).astype(jnp.int32)
    probs = jnp.where(hot, jax.nn.softmax(scaled, axis=-1), jax.nn.one_hot(greedy, logits.shape[-1]))
    return jnp.where(hot[..., 0], sampled, greedy), probs


def _row_keys(key: jax.Array | None, rows: int) -> jax.Array | None:
    return None if key is None else jax.random.split(key, rows)


def _markov_walk(params, logits, anchor_ids, key, temperature):
    """DSpark: row k draws from `logits_k + markov_w2(markov_w1[prev_k])`, prev_0 = anchor, prev_k = draft k-1."""
    w1 = params["markov_head"]["markov_w1"]["weight"]  # [V, r]
    w2 = params["markov_head"]["markov_w2"]["weight"]  # [V, r]

    def step(prev, row):
        base, row_key = row  # [batch, V] f32
        bias = dot("br,vr->bv", jnp.take(w1, prev, axis=0), w2)  # [batch, V]
        token, probs = _choose(row_key, base + bias, temperature)
        return token, (token, probs)

    rows = (jnp.moveaxis(logits, 1, 0), _row_keys(key, logits.shape[1]))  # scan over draft rows
    _, (tokens, probs) = jax.lax.scan(step, anchor_ids, rows)
    return tokens.T, None if probs is None else jnp.moveaxis(probs, 0, 1)


def _selector_walk(params, config, hidden, logits, anchor_ids, key, temperature):
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
        pick, probs = _choose(row_key, scores, temperature)
        token = jnp.take_along_axis(ids, pick[:, None], axis=1)[:, 0]
        return token, (token, probs)

    rows = tuple(jnp.moveaxis(a, 1, 0) for a in (unary, cand, context, successors))
    _, (tokens, cand_probs) = jax.lax.scan(step, anchor_ids, (*rows, _row_keys(key, logits.shape[1])))
    if cand_probs is None:
        return tokens.T, None
    batch, n, vocab = logits.shape
    probs = jnp.zeros((batch, n, vocab), jnp.float32)  # q is zero off the candidates
    probs = probs.at[jnp.arange(batch)[:, None, None], jnp.arange(n)[None, :, None], cand].set(
        jnp.moveaxis(cand_probs, 0, 1)
    )
    return tokens.T, probs


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
    lm_head: jax.Array | None = None,
    key: jax.Array | None = None,
    temperature: float | jax.Array = 0.0,
    confidence_threshold: float | jax.Array = 0.0,
) -> Proposal:
    """Turn the draft rows' final hidden states `[batch, num_draft_tokens, H]` into a `Proposal`.

    anchor_ids: `[batch]` the block's row-0 token (the predecessor of the first draft). Without `key`, greedy
    (argmax); with one, sampled at `temperature` (scalar or `[batch]`; 0 keeps a sequence greedy) and
    `probs` returned. `confidence_threshold`: DSpark proposals end before the first row whose confidence is
    below it (0 disables the cut). lm_head: `[V, H]`, None for the drafter's own or attached one.
    """
    params, config = drafter.params, drafter.config
    batch = hidden.shape[0]
    selector, markov = "candidate_selector" in params, "markov_head" in params
    if "d2t" in params and (selector or markov):
        raise NotImplementedError(
            "a reduced draft vocabulary (d2t) with a Markov head or candidate selector needs the anchor in draft "
            "ids (t2d), which checkpoints do not ship"
        )
    logits = lm_logits(hidden, drafter.output_head if lm_head is None else lm_head)  # [batch, n, V] f32
    multiplier, cap = config.logit_transform  # DFlash2 only (`DflashConfig.logit_transform`)
    if multiplier is not None:
        logits = logits * multiplier
    if cap is not None:
        logits = cap * jnp.tanh(logits / cap)
    anchor_ids = anchor_ids.astype(jnp.int32)
    temperature = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (batch,))

    if selector:
        tokens, probs = _selector_walk(params, config, hidden, logits, anchor_ids, key, temperature)
    elif markov:
        tokens, probs = _markov_walk(params, logits, anchor_ids, key, temperature)
    else:
        tokens, probs = _choose(key, logits, temperature)

    n = tokens.shape[1]
    num_tokens = jnp.full((batch,), n, jnp.int32)
    confidence = None
    if "confidence_head" in params:
        confidence = _confidence(params, hidden, anchor_ids, tokens)  # [batch, n]
        below = confidence < confidence_threshold
        num_tokens = jnp.where(below.any(axis=1), jnp.argmax(below, axis=1), n).astype(jnp.int32)
    if "d2t" in params:
        if probs is not None:  # spread q over the target vocabulary: draft id i is target id i + d2t[i]
            target_ids = jnp.arange(params["d2t"].shape[0]) + params["d2t"]
            probs = jnp.zeros((*probs.shape[:2], config.vocab_size), probs.dtype).at[..., target_ids].set(probs)
        tokens = draft_to_target_ids(tokens, params["d2t"])
    return Proposal(tokens=tokens, num_tokens=num_tokens, probs=probs, confidence=confidence)


def _append(cache: ContextCache, new_kv, num_new: jax.Array) -> ContextCache:
    """Write the first `num_new [batch]` of the new rows' K/V after each sequence's last real row."""
    batch, _, n_new, _ = new_kv[0].k.shape
    fresh = jnp.arange(n_new) < num_new[:, None]  # [batch, n_new]
    rows = jnp.where(fresh, cache.lengths[:, None] + jnp.arange(n_new), cache.max_context)  # padding: dropped
    seq, rows = jnp.arange(batch)[:, None, None], rows[:, None, :]  # indices broadcast to [batch, n_kv, n_new]
    heads = jnp.arange(new_kv[0].k.shape[1])[None, :, None]
    keys = tuple(k.at[seq, heads, rows].set(kv.k, mode="drop") for k, kv in zip(cache.keys, new_kv))
    values = tuple(v.at[seq, heads, rows].set(kv.v, mode="drop") for v, kv in zip(cache.values, new_kv))
    return ContextCache(keys, values, jnp.minimum(cache.lengths + num_new, cache.max_context))


@functools.partial(jax.jit, static_argnames=("causal", "sliding_window"), donate_argnames=("cache",))
def propose(
    drafter: Drafter,
    cache: ContextCache,
    target_hidden: jax.Array,
    num_new: jax.Array,
    anchor_ids: jax.Array,
    *,
    key: jax.Array | None = None,
    temperature: float | jax.Array = 0.0,
    confidence_threshold: float | jax.Array = 0.0,
    embed: jax.Array | None = None,
    lm_head: jax.Array | None = None,
    causal: bool | None = None,
    sliding_window: bool = True,
) -> tuple[Proposal, ContextCache]:
    """One drafting step for a batch; returns the proposal and the cache with the new context appended.

    target_hidden: `[batch, n_new, Lf*H]` target features of the context rows since the last step (the prompt
    at the first step, then the anchor and accepted drafts), padded to a fixed `n_new`; num_new: `[batch]`
    how many of them are real; they take positions `cache.lengths ...`. anchor_ids: `[batch]` the last
    committed token, at position `cache.lengths + num_new` (the block start). The cache is donated: keep the
    returned one. `max_context` must hold every sequence's context (rows past it are dropped).

    key / temperature / confidence_threshold / lm_head: as `sample_drafts`; embed: `[V, H]`, None for the
    drafter's own or attached one; causal / sliding_window: the attention rule (`dflash_jax.model`).
    """
    params, config = drafter.params, drafter.config
    batch, n_new = target_hidden.shape[:2]
    B, n_draft = config.effective_block_size, config.num_draft_tokens
    lengths, num_new = cache.lengths, jnp.asarray(num_new, jnp.int32)

    context = Context(
        project_context(params, config, target_hidden),  # [batch, n_new, H]
        lengths[:, None] + jnp.arange(n_new, dtype=jnp.int32),  # [batch, n_new]
        jnp.arange(n_new) < num_new[:, None],
    )
    start = lengths + num_new  # [batch] the anchor's position
    block_ids = jnp.concatenate(
        [anchor_ids[:, None].astype(jnp.int32), jnp.full((batch, B - 1), config.mask_token_id, jnp.int32)], axis=1
    )  # [batch, B]
    x = embed_block(config, drafter.embedding if embed is None else embed, block_ids, params["fc"]["weight"].dtype)
    memory_positions = jnp.broadcast_to(jnp.arange(cache.max_context, dtype=jnp.int32), (batch, cache.max_context))
    hidden, new_kv = forward(
        params,
        config,
        attention_rules(config, causal=causal, sliding_window=sliding_window),
        x,
        start[:, None] + jnp.arange(B, dtype=jnp.int32),  # [batch, B]
        context,
        memory=list(zip(cache.keys, cache.values)),
        memory_positions=memory_positions,
        memory_valid=memory_positions < lengths[:, None],
    )  # [batch, B, H]
    proposal = sample_drafts(
        drafter,
        hidden[:, B - n_draft :],  # the draft rows: 1..B-1 (z-lab) or all B (DSpark)
        anchor_ids,
        lm_head=lm_head,
        key=key,
        temperature=temperature,
        confidence_threshold=confidence_threshold,
    )
    return proposal, _append(cache, new_kv, num_new)

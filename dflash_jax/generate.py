"""Speculative decoding end to end: draft with a DFlash-family drafter, verify with a `Target`, commit, repeat.

    result = speculative_generate(target, drafter, prompt_ids, max_new_tokens=128)
    result.tokens, result.acceptance_lengths, result.decode_tokens_per_second

One step (z-lab `dflash/model.py`'s `dflash_generate`, batched; K = `drafter.config.num_draft_tokens`: B-1 for
DFlash/DFlash2, B for DSpark):

    verify  [anchor, d_1 .. d_K] with the target at positions len .. len+K  -> logits, features
    accept  a = the longest accepted prefix of the drafts (greedy: equal to the target's argmax;
            T > 0: the rejection rule below), then one more token from the target (the "bonus")
    commit  d_1..d_a + bonus; the target cache keeps len + a + 1 positions (anchor and accepted drafts; the
            rejected slots are overwritten later), the drafter's context grows by the same a + 1 feature rows,
            and the bonus becomes the next anchor
    draft   the next proposal from the new context and anchor (`drafting.propose`)

Sampling (temperature T > 0) is the standard speculative-sampling rule (Leviathan et al. 2023, Chen et al.
2023), so the output is distributed exactly as the target's own sampling at T: draft x (drawn from q) is
accepted with probability min(1, p(x) / q(x)); at the first rejection the token is drawn from
norm(max(p - q, 0)); after the last proposed draft it is drawn from p. p = softmax(target logits / T), cut by
`top_k` / `top_p` / `min_p` when given, and q is the distribution the drafter actually drew from
(`Proposal.probs`: its own logits under the same controls; `dflash_jax.sampling`). z-lab's reference loop
compares each draft with a token sampled from the target, which is lossless too, but accepts less
(docs/references.md).

Drafts past a DSpark confidence cut (`Proposal.num_tokens`) are never accepted: the step then ends with a
token drawn from p (greedy: the target's argmax), which is what the rule gives for a draft that was not made.

Loop: every shape is static (prompts right-padded and bucketed, caches sized up front), so `prefill` and
`decode` compile once per (batch, bucket) and the decode runs as ONE `lax.while_loop` program. Measured on
CPU (2 cores, tiny models, 39 steps; docs/generate.md): 21 ms for the while_loop against 31 ms for the same
jitted step driven from Python, whose per-step dispatch and host sync (to test "all done") a small model
cannot hide. A progress callback, when given, is called from inside the loop (`jax.debug.callback`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._arguments import check_cache_fits, check_generate
from ._shapes import round_up
from .drafter import Drafter
from .drafting import ContextCache, Proposal, append_context, init_cache, propose
from .errors import IncompatiblePairError
from .model import AttentionOptions
from .pairing import check_pair
from .sampling import Warp, choose, rng_key, sampling_controls
from .target import PREFILL_CHUNK, Target

PROMPT_BUCKET = 16  # prompts are right-padded to a multiple of this, so prompt lengths share compilations
CACHE_BUCKET = 128  # cache capacities are rounded up to a multiple of this
BUDGET_BUCKET = 64  # output buffers hold a multiple of this many tokens: budgets within one share compilations


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    """New tokens and statistics of one `speculative_generate` / `greedy_generate` / `sample_generate` call.

    Always batched, whether `prompt_ids` was one prompt or several: `tokens[i]` are prompt i's new ids,
    `acceptance_lengths[i]` its verify steps' acceptance lengths, `plain_tokens[i]` how many of its tokens plain
    target steps made (`Backoff`), not verifies; one prompt is `result.tokens[0]`. Acceptance lengths count the
    bonus token (the reference's tau per step: accepted drafts + 1); the first new token comes from the prefill
    and belongs to no step. Times are wall clock and include compilation the first time a shape is seen: warm up
    first to measure speed.
    """

    tokens: list[list[int]]
    acceptance_lengths: list[list[int]]
    prefill_seconds: float
    decode_seconds: float
    plain_tokens: list[int]

    @property
    def num_tokens(self) -> int:
        """New tokens over all prompts."""
        return sum(len(t) for t in self.tokens)

    @property
    def tokens_per_second(self) -> float:
        """New tokens per second of prefill + decode."""
        return self.num_tokens / max(self.prefill_seconds + self.decode_seconds, 1e-9)

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens made by the decode loop (all but each prompt's first) per second of decode."""
        return (self.num_tokens - len(self.tokens)) / max(self.decode_seconds, 1e-9)

    @property
    def mean_acceptance_length(self) -> float:
        """Mean tokens per verify step (accepted drafts + 1), over all prompts; nan without steps."""
        steps = [a for seq in self.acceptance_lengths for a in seq]
        return float(np.mean(steps)) if steps else float("nan")


# --------------------------------------------------------------------------------------------------------------
# Shared pieces: prompts, the first token, stop tokens
# --------------------------------------------------------------------------------------------------------------


def _pad_prompts(prompts: list[list[int]]) -> tuple[jax.Array, jax.Array]:
    """Right-pad to a bucketed length: `(tokens [batch, P] int32, lengths [batch] int32)`."""
    width = round_up(max(len(p) for p in prompts), PROMPT_BUCKET)
    tokens = np.zeros((len(prompts), width), np.int32)
    for row, p in zip(tokens, prompts):
        row[: len(p)] = p
    return jnp.asarray(tokens), jnp.asarray([len(p) for p in prompts], jnp.int32)


def _stop_array(stop_token_ids: Sequence[int] | None) -> jax.Array:
    """Stop ids as int32, padded with -1 (matches nothing) to a multiple of 8 entries, so that different stop
    lists share a compilation."""
    ids = list(stop_token_ids or [])
    return jnp.asarray(ids + [-1] * (round_up(max(len(ids), 1), 8) - len(ids)), jnp.int32)


def _pick(key: jax.Array | None, logits: jax.Array, warp: Warp) -> jax.Array:
    """The target's own choice from `logits [batch, V]`: argmax without a key, else a sample from the `warp`ed
    distribution."""
    return choose(key, logits, warp)[0]


def _to_lists(tokens: np.ndarray, counts: np.ndarray) -> list[list[int]]:
    return [row[:n].tolist() for row, n in zip(tokens, counts)]


# --------------------------------------------------------------------------------------------------------------
# Speculative decoding
# --------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Backoff:
    """Stop drafting while it does not pay: `speculative_generate(..., backoff=Backoff())` (off by default).

    A verify step costs more than a plain target step: K + 1 tokens through the target, then a drafting step (on
    an H200 at a 32k context, a 16-draft DSpark step costs ~1.6 plain steps). The loop keeps a running mean of
    the tokens a verify commits per running sequence (accepted drafts + the bonus; each verify weighs half, the
    older ones the other half; it starts at K + 1). While that mean is below `min_tokens`, it runs plain target
    steps, one token and no drafting each, before drafting again: 1 after the first verify below it, then 2, 4,
    ... up to `max_plain_steps` while the verifies in between keep it below. The drafter's context keeps up
    during plain steps (their features are appended to it), so the next draft sees the whole sequence.

    Output is unchanged: the target's greedy tokens at temperature 0, its sampling distribution at T > 0 (a
    plain step samples from the target; when to verify depends only on past steps). The decision is one for the
    batch, which runs in lockstep. Varying how much to speculate from the acceptance so far is the idea of
    adaptive speculation lengths (Mamou et al. 2024, arXiv:2405.04304; Huang et al. 2024, arXiv:2405.19715).
    """

    min_tokens: float = 1.5
    max_plain_steps: int = 32

    def __post_init__(self):
        if isinstance(self.min_tokens, bool) or not (isinstance(self.min_tokens, (int, float))
                                                     and 1 <= self.min_tokens < float("inf")):
            raise ValueError(f"Backoff.min_tokens must be a finite number >= 1 (a verify commits at least one "
                             f"token), got {self.min_tokens!r}")
        if isinstance(self.max_plain_steps, bool) or not (isinstance(self.max_plain_steps, int)
                                                          and 1 <= self.max_plain_steps <= 2**31 - 1):
            raise ValueError(f"Backoff.max_plain_steps must be an int in [1, 2**31 - 1], got {self.max_plain_steps!r}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _State:
    """The decode loop's carry (every array has a static shape)."""

    step: jax.Array  # [] int32
    target_cache: Any  # the target's KV cache
    lengths: jax.Array  # [batch] positions in the target cache (= context rows in the drafter's cache)
    context: ContextCache  # the drafter's context K/V
    anchor: jax.Array  # [batch] the last committed token, not yet run through the target
    proposal: Proposal  # drafts for the next verify
    out: jax.Array  # [batch, capacity] new tokens (capacity: the budget rounded up to BUDGET_BUCKET)
    n_out: jax.Array  # [batch] tokens in `out`
    budget: jax.Array  # [] int32 max_new_tokens: a value, so that budgets of one bucket share the program
    accept: jax.Array  # [batch, capacity] acceptance length of each verify step (0: done, or a plain step)
    plain: jax.Array  # [batch] tokens made by plain steps
    done: jax.Array  # [batch] bool
    key: jax.Array
    mean_tokens: jax.Array  # [] float32 `Backoff`'s running mean of tokens per verify
    plain_run: jax.Array  # [] int32 the length of the current run of plain steps (0: none)
    plain_left: jax.Array  # [] int32 plain steps before the next verify (0: this step verifies)


def _in_vocabulary(drafts: jax.Array, vocab_size: int) -> tuple[jax.Array, jax.Array]:
    """`(drafts with ids outside [0, vocab_size) replaced by 0, which drafts were inside)`, both `[batch, K]`.

    A second line of defence behind `pairing.check_pair`: an id past the target's vocabulary would be embedded as
    NaN by the verify's gather (and poison the cache), so the target sees 0 there, and `_acceptance` never
    accepts such a draft: greedily it is no argmax; sampled, it is a draw where p = 0, always rejected, and the
    residual max(p - q, 0) of the standard rule keeps the output distributed as p.
    """
    inside = (drafts >= 0) & (drafts < vocab_size)
    return jnp.where(inside, drafts, 0), inside


def _acceptance(
    key: jax.Array | None, logits: jax.Array, proposal: Proposal, warp: Warp
) -> tuple[jax.Array, jax.Array]:
    """Verify a proposal: `(accepted drafts [batch], the step's last token [batch])`.

    logits: `[batch, K + 1, V]`, row j the target's logits for the token after verify row j (row j < K checks
    draft j, row K follows the last draft).
    """
    drafts, in_vocabulary = _in_vocabulary(proposal.tokens, logits.shape[-1])  # [batch, K]
    K = drafts.shape[1]
    proposed = jnp.arange(K) < proposal.num_tokens[:, None]  # [batch, K]
    if key is None:  # greedy: a draft stands if it is the target's argmax
        choice = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [batch, K + 1]
        ok = (drafts == choice[:, :K]) & proposed & in_vocabulary
        accepted = jnp.cumprod(ok, axis=1).sum(axis=1).astype(jnp.int32)
        return accepted, jnp.take_along_axis(choice, accepted[:, None], axis=1)[:, 0]

    accept_key, residual_key = jax.random.split(key)
    assert proposal.probs is not None  # a proposal drafted with a key carries its q (`_choose`)
    p = warp.probs(logits)  # [batch, K + 1, V] the target's warped distribution (`sampling`)
    q = jnp.where(proposed[..., None], proposal.probs, 0.0)  # [batch, K, V]; 0: no draft
    q = jnp.pad(q, ((0, 0), (0, 1), (0, 0)))  # [batch, K + 1, V]
    p_draft = jnp.take_along_axis(p[:, :K], drafts[..., None], axis=2)[..., 0]  # [batch, K]
    q_draft = jnp.take_along_axis(q[:, :K], drafts[..., None], axis=2)[..., 0]
    u = jax.random.uniform(accept_key, drafts.shape)
    ok = (u * q_draft < p_draft) & proposed & in_vocabulary  # accept with probability min(1, p / q)
    accepted = jnp.cumprod(ok, axis=1).sum(axis=1).astype(jnp.int32)
    p_a = jnp.take_along_axis(p, accepted[:, None, None], axis=1)[:, 0]  # [batch, V]
    q_a = jnp.take_along_axis(q, accepted[:, None, None], axis=1)[:, 0]  # zero after the last proposed draft
    residual = jnp.maximum(p_a - q_a, 0.0)
    residual = jnp.where(residual.sum(-1, keepdims=True) > 0, residual, p_a)  # p == q: never rejected
    last = jax.random.categorical(residual_key, jnp.log(residual)).astype(jnp.int32)
    return accepted, last


@functools.partial(
    jax.jit, static_argnames=("capacity", "sampling", "attention", "prefill_chunk"),
    donate_argnames=("target_cache", "context"),
)
def _spec_prefill(
    target: Target, drafter: Drafter, target_cache, context: ContextCache, tokens, lengths, stop, warp: Warp,
    threshold, key, budget, *, capacity: int, sampling: bool, attention: AttentionOptions, prefill_chunk: int
) -> _State:
    """Run the prompts through the target, take the first token, fill the drafter's context, make drafts.

    The empty caches come in as arguments: made inside, XLA would constant-fold work over them at compile time.
    """
    batch = tokens.shape[0]
    first_key, draft_key, key = jax.random.split(key, 3)
    out = target.prefill(tokens, target_cache, lengths, layer_ids=drafter.config.checked_target_layer_ids,
                         chunk=prefill_chunk)
    first = _pick(first_key if sampling else None, out.logits, warp)  # [batch]
    proposal, context = propose(drafter, context, out.features, lengths, first,
                                key=draft_key if sampling else None, temperature=warp.temperature,
                                top_k=warp.top_k, top_p=warp.top_p, min_p=warp.min_p,  # the target's controls
                                confidence_threshold=threshold, append_chunk=prefill_chunk, attention=attention)
    return _State(
        step=jnp.zeros((), jnp.int32),
        target_cache=out.cache,
        lengths=lengths,
        context=context,
        anchor=first,
        proposal=proposal,
        out=jnp.zeros((batch, capacity), jnp.int32).at[:, 0].set(first),
        n_out=jnp.ones((batch,), jnp.int32),
        budget=budget,
        accept=jnp.zeros((batch, capacity), jnp.int32),
        plain=jnp.zeros((batch,), jnp.int32),
        done=(first[:, None] == stop).any(-1) | (budget <= 1),
        key=key,
        mean_tokens=jnp.float32(drafter.config.num_draft_tokens + 1),
        plain_run=jnp.zeros((), jnp.int32),
        plain_left=jnp.zeros((), jnp.int32),
    )


def _spec_step(target: Target, drafter: Drafter, stop, warp: Warp, threshold, call, sampling: bool,
               attention: AttentionOptions, backoff: Backoff | None, report: bool, s: _State) -> _State:
    """One verify + commit + draft step for every sequence still running (under `backoff`, some steps are plain:
    one target token, no drafts)."""
    batch, K = s.anchor.shape[0], drafter.config.num_draft_tokens
    layer_ids = drafter.config.checked_target_layer_ids
    verify_key, draft_key, key = jax.random.split(s.key, 3)
    live = ~s.done

    def verify(s: _State):
        drafts, _ = _in_vocabulary(s.proposal.tokens, target.vocab_size)
        tokens = jnp.concatenate([s.anchor[:, None], drafts], axis=1)  # [batch, K + 1]
        out = target(tokens, s.target_cache, s.lengths, layer_ids=layer_ids)
        accepted, last = _acceptance(verify_key if sampling else None, out.logits, s.proposal, warp)
        cache = target.commit(out.cache, jnp.where(live, accepted + 1, 0))  # the anchor and the accepted drafts
        return cache, out.features, accepted, last  # features [batch, K + 1, Lf*H]

    def plain(s: _State):  # the anchor alone: a verify that rejects every draft
        out = target(s.anchor[:, None], s.target_cache, s.lengths, layer_ids=layer_ids)
        last = _pick(verify_key if sampling else None, out.logits[:, 0], warp)  # [batch]
        features = jnp.pad(out.features, ((0, 0), (0, K), (0, 0)))  # [batch, K + 1, Lf*H]; only row 0 is real
        return target.commit(out.cache, live.astype(jnp.int32)), features, jnp.zeros_like(last), last

    verifies = s.plain_left == 0  # [] always, without a backoff
    if backoff is None:
        target_cache, features, accepted, last = verify(s)
    else:
        target_cache, features, accepted, last = jax.lax.cond(verifies, verify, plain, s)

    # Commit d_1..d_a + last, cut after a stop token and at the token budget.
    made = jnp.pad(s.proposal.tokens, ((0, 0), (0, 1)))
    made = jnp.where(jnp.arange(K + 1) == accepted[:, None], last[:, None], made)  # [batch, K + 1]
    is_stop = (made[..., None] == stop).any(-1) & (jnp.arange(K + 1) <= accepted[:, None])  # [batch, K + 1]
    keep = jnp.where(is_stop.any(1), jnp.argmax(is_stop, axis=1) + 1, accepted + 1)
    keep = jnp.where(live, jnp.minimum(keep, s.budget - s.n_out), 0)  # [batch]
    rows = jnp.arange(batch)[:, None]
    kept = jnp.arange(K + 1) < keep[:, None]  # [batch, K + 1]
    slots = jnp.where(kept, s.n_out[:, None] + jnp.arange(K + 1), s.out.shape[1])  # past the end: dropped
    n_out = s.n_out + keep
    done = s.done | (is_stop & kept).any(1) | (n_out >= s.budget)
    committed = jnp.where(live, accepted + 1, 0)  # anchor + accepted drafts enter both caches

    mean_tokens, plain_run, plain_left = _backoff_schedule(backoff, s, committed, live)

    def draft(context: ContextCache):
        return propose(drafter, context, features, committed, last, key=draft_key if sampling else None,
                       temperature=warp.temperature, top_k=warp.top_k, top_p=warp.top_p, min_p=warp.min_p,
                       confidence_threshold=threshold, attention=attention)

    def keep_up(context: ContextCache):  # the next step is plain: its drafts are never read
        return s.proposal, append_context(drafter, context, features, committed, attention=attention)

    if backoff is None:
        proposal, context = draft(s.context)
    else:
        proposal, context = jax.lax.cond(plain_left == 0, draft, keep_up, s.context)
    if report:
        jax.debug.callback(_report, call, n_out)
    return _State(
        step=s.step + 1,
        target_cache=target_cache,
        lengths=s.lengths + committed,
        context=context,
        anchor=jnp.where(live, last, s.anchor),
        proposal=proposal,
        out=s.out.at[rows, slots].set(made, mode="drop"),
        n_out=n_out,
        budget=s.budget,
        accept=s.accept.at[:, s.step].set(jnp.where(verifies, committed, 0)),
        plain=s.plain + jnp.where(verifies, 0, committed),
        done=done,
        key=key,
        mean_tokens=mean_tokens,
        plain_run=plain_run,
        plain_left=plain_left,
    )


def _backoff_schedule(backoff: Backoff | None, s: _State, committed: jax.Array, live: jax.Array):
    """`Backoff`'s rule after a step: `(mean tokens per verify, plain run length, plain steps left)`."""
    if backoff is None:
        return s.mean_tokens, s.plain_run, s.plain_left
    verified = s.plain_left == 0
    tokens = committed.sum() / jnp.maximum(live.sum(), 1)  # [] this step's tokens per running sequence
    mean = jnp.where(verified, (s.mean_tokens + tokens) / 2, s.mean_tokens)
    failing = mean < backoff.min_tokens
    run = jnp.where(failing, jnp.clip(2 * s.plain_run, 1, backoff.max_plain_steps), 0)  # 1, 2, 4, ... max
    return (mean, jnp.where(verified, run, s.plain_run).astype(jnp.int32),
            jnp.where(verified, jnp.where(failing, run, 0), s.plain_left - 1).astype(jnp.int32))


@functools.partial(
    jax.jit, static_argnames=("sampling", "attention", "backoff", "report"), donate_argnames=("state",),
)
def _spec_decode(target: Target, drafter: Drafter, state: _State, stop, warp: Warp, threshold, call, *,
                 sampling: bool, attention: AttentionOptions, backoff: Backoff | None = None,
                 report: bool = False) -> _State:
    """Steps until every sequence is done, as one `lax.while_loop`. `report`: call the progress callback
    registered under `call` after every step (`_report`)."""
    step = functools.partial(_spec_step, target, drafter, stop, warp, threshold, call, sampling, attention, backoff,
                             report)
    return jax.lax.while_loop(lambda s: ~s.done.all() & (s.step < s.budget), step, state)


_PROGRESS: dict[int, Callable[[np.ndarray], None]] = {}  # the progress callbacks of the calls running now, by id
_CALLS = itertools.count()


def _report(call: np.ndarray, n_out: np.ndarray) -> None:
    """The host side of the loop's progress callback: the callback is looked up by a traced call id, so that it is
    no part of the compiled program (another callback, or none, reuses it)."""
    callback = _PROGRESS.get(int(call))
    if callback is not None:
        callback(n_out)


def speculative_generate(
    target: Target,
    drafter: Drafter,
    prompt_ids: Sequence[int] | Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    key: jax.Array | None = None,
    seed: int | None = None,
    stop_token_ids: Sequence[int] | None = None,
    confidence_threshold: float = 0.0,
    progress: Callable[[np.ndarray], None] | None = None,
    attention: AttentionOptions = AttentionOptions(),
    prefill_chunk: int = PREFILL_CHUNK,
    beyond_max_positions: bool = False,
    backoff: Backoff | None = None,
) -> GenerationResult:
    """Generate up to `max_new_tokens` new tokens per prompt with speculative decoding.

    prompt_ids: one prompt (ids) or a batch of prompts (any lengths); each sequence accepts drafts on its own, and
    the result is batched either way (`GenerationResult`: one prompt's tokens are `result.tokens[0]`).
    temperature 0: greedy, token for token the target's own greedy decoding; > 0: sampled, distributed as the
    target's sampling at that temperature after the `top_k` / `top_p` / `min_p` cuts (transformers' warpers,
    in its order; None: off), which the drafts are drawn under too (`dflash_jax.sampling`; `sample_generate`
    is the plain target's sampling). Randomness: `key` (a JAX PRNG key), or `seed` (an int) as a shorthand for
    `key=jax.random.key(seed)`; neither: seed 0. `drafter`: a `Drafter` or an
    `nnx.DFlashDrafter`; the pair is checked first (`pairing.check_pair`). A sequence stops after a token of
    `stop_token_ids` (kept in the output). The drafter is given the target's embedding and LM head when it
    ships none. `confidence_threshold` (DSpark drafters with a confidence head): proposals end before the
    first draft whose predicted acceptance is below it; 0 verifies every draft. `progress(n_out)`, if given, is
    called after every step with the tokens made so far per sequence (`[batch]` NumPy).

    attention: the drafter's attention rule (`AttentionOptions`; default: the trained rule; a draft window
    changes acceptance, never the greedy output). Long prompts are prefilled `prefill_chunk` tokens at a time.
    A prompt plus `max_new_tokens` beyond the target's or the drafter's `max_position_embeddings` is refused
    (ValueError) unless `beyond_max_positions`. `backoff` (`Backoff`): run plain target steps while drafts are
    rarely accepted (`GenerationResult.plain_tokens` counts their tokens); None: every step verifies drafts.
    """
    if not isinstance(drafter, Drafter) and isinstance(getattr(drafter, "drafter", None), Drafter):
        drafter = drafter.drafter  # an `nnx.DFlashDrafter` module: its current values
    prompts = check_generate(
        "speculative_generate", target, prompt_ids, max_new_tokens=max_new_tokens, prefill_chunk=prefill_chunk,
        stop_token_ids=stop_token_ids, drafter=drafter, confidence_threshold=confidence_threshold)
    warp = sampling_controls("speculative_generate", temperature, top_k, top_p, min_p)
    key = rng_key("speculative_generate", key, seed)
    check_pair(target, drafter)
    if backoff is not None and not isinstance(backoff, Backoff):
        raise TypeError(f"backoff must be a dflash_jax.Backoff or None, got {type(backoff).__name__}")
    drafter = _attach(target, drafter)
    _check_positions(prompts, max_new_tokens, target, drafter, beyond_max_positions)
    tokens, lengths = _pad_prompts(prompts)
    K = drafter.config.num_draft_tokens
    capacity = round_up(tokens.shape[1] + round_up(max_new_tokens, BUDGET_BUCKET) + K + 1, CACHE_BUCKET)
    check_cache_fits("speculative_generate", target, drafter, len(prompts), capacity)
    stop = _stop_array(stop_token_ids)
    threshold = jnp.float32(confidence_threshold)
    sampling = temperature > 0

    start = time.perf_counter()
    caches = target.init_cache(len(prompts), capacity), init_cache(drafter, len(prompts), capacity,
                                                                   attention=attention)
    state = _spec_prefill(target, drafter, *caches, tokens, lengths, stop, warp, threshold, key,
                          jnp.int32(max_new_tokens), capacity=round_up(max_new_tokens, BUDGET_BUCKET),
                          sampling=sampling, attention=attention, prefill_chunk=prefill_chunk)
    jax.block_until_ready(state)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    call = next(_CALLS)
    if progress is not None:
        _PROGRESS[call] = progress
    try:
        state = _spec_decode(target, drafter, state, stop, warp, threshold, jnp.int32(call), sampling=sampling,
                             attention=attention, backoff=backoff, report=progress is not None)
        out, n_out, accept, plain = jax.device_get((state.out, state.n_out, state.accept, state.plain))
    finally:
        _PROGRESS.pop(call, None)
    decode = time.perf_counter() - start
    state.context.check()  # sized above to hold every sequence: an overflow would be a bug, never silent

    steps = [[int(a) for a in row if a > 0] for row in accept]
    return GenerationResult(_to_lists(out, n_out), steps, prefill, decode, [int(n) for n in plain])


def _check_positions(prompts: list[list[int]], max_new_tokens: int, target: Target, drafter: Drafter | None,
                     allowed: bool) -> None:
    """Refuse, before anything compiles, sequences longer than the models' `max_position_embeddings`."""
    longest = max(len(p) for p in prompts) + max_new_tokens
    limits = [("target", target.max_positions)]
    if drafter is not None:
        limits.append(("drafter", drafter.config.max_position_embeddings))
    for name, limit in limits:
        if limit is not None and longest > limit and not allowed:
            raise ValueError(
                f"a prompt of {longest - max_new_tokens} tokens plus max_new_tokens={max_new_tokens} reaches "
                f"position {longest}, beyond the {name}'s max_position_embeddings={limit}; shorten it, or pass "
                "beyond_max_positions=True to run past what the model was trained for"
            )


def _attach(target: Target, drafter: Drafter) -> Drafter:
    """The drafter with the target's embedding / LM head attached where it has none of its own."""
    own = drafter.params
    return drafter.attach(
        embed=target.embed if "embed_tokens" not in own and drafter.embed is None else None,
        lm_head=target.lm_head if "lm_head" not in own and drafter.lm_head is None else None,
    )


# --------------------------------------------------------------------------------------------------------------
# Plain target decoding (the baselines): greedy, and sampled under the same controls
# --------------------------------------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _GreedyState:
    """The plain loop's carry (every array has a static shape)."""

    cache: Any  # the target's KV cache
    lengths: jax.Array  # [batch] positions in the cache
    last: jax.Array  # [batch] the last new token, not yet run through the target
    out: jax.Array  # [batch, capacity] new tokens
    n_out: jax.Array  # [batch] tokens in `out`
    budget: jax.Array  # [] int32 max_new_tokens
    done: jax.Array  # [batch] bool
    key: jax.Array  # sampling: split every step; greedy: unused


@functools.partial(jax.jit, static_argnames=("capacity", "prefill_chunk", "sampling"), donate_argnames=("cache",))
def _greedy_prefill(target: Target, cache, tokens, lengths, stop, budget, warp: Warp, key, *, capacity: int,
                    prefill_chunk: int, sampling: bool) -> _GreedyState:
    """Run the prompts, take the first token."""
    batch = tokens.shape[0]
    first_key, key = jax.random.split(key)
    out = target.prefill(tokens, cache, lengths, layer_ids=(), chunk=prefill_chunk)
    first = _pick(first_key if sampling else None, out.logits, warp)  # [batch]
    return _GreedyState(
        cache=out.cache,
        lengths=lengths,
        last=first,
        out=jnp.zeros((batch, capacity), jnp.int32).at[:, 0].set(first),
        n_out=jnp.ones((batch,), jnp.int32),
        budget=budget,
        done=(first[:, None] == stop).any(-1) | (budget <= 1),
        key=key,
    )


@functools.partial(jax.jit, static_argnames=("sampling",), donate_argnames=("state",))
def _greedy_decode(target: Target, state: _GreedyState, stop, warp: Warp, *, sampling: bool) -> _GreedyState:
    """One target forward per token, in a `lax.while_loop`, until every sequence is done."""

    def step(s: _GreedyState) -> _GreedyState:
        step_key, key = jax.random.split(s.key)
        o = target(s.last[:, None], s.cache, s.lengths, layer_ids=())  # `last` enters the cache at position `lengths`
        nxt = _pick(step_key if sampling else None, o.logits[:, 0], warp)  # [batch]
        slots = jnp.where(s.done, s.out.shape[1], s.n_out)  # past the end: dropped
        live = ~s.done
        advance = live.astype(jnp.int32)  # [batch] 1 while running
        n_out = s.n_out + advance
        return _GreedyState(
            cache=target.commit(o.cache, advance),
            lengths=s.lengths + advance,
            last=jnp.where(live, nxt, s.last),
            out=s.out.at[jnp.arange(s.out.shape[0]), slots].set(nxt, mode="drop"),
            n_out=n_out,
            budget=s.budget,
            done=s.done | (live & (nxt[:, None] == stop).any(-1)) | (n_out >= s.budget),
            key=key,
        )

    return jax.lax.while_loop(lambda s: ~s.done.all(), step, state)


def greedy_generate(
    target: Target,
    prompt_ids: Sequence[int] | Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    stop_token_ids: Sequence[int] | None = None,
    prefill_chunk: int = PREFILL_CHUNK,
    beyond_max_positions: bool = False,
) -> GenerationResult:
    """The target alone, greedy: the baseline speculative decoding must reproduce and beat.

    Same prompt handling, stop rule, position check and result as `speculative_generate` (no acceptance lengths).
    """
    return _plain_generate("greedy_generate", target, prompt_ids, max_new_tokens, sampling_controls(
        "greedy_generate", 0.0, None, None, None), None, stop_token_ids, prefill_chunk, beyond_max_positions)


def sample_generate(
    target: Target,
    prompt_ids: Sequence[int] | Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    key: jax.Array | None = None,
    seed: int | None = None,
    stop_token_ids: Sequence[int] | None = None,
    prefill_chunk: int = PREFILL_CHUNK,
    beyond_max_positions: bool = False,
) -> GenerationResult:
    """The target alone, sampled (transformers' `generate(do_sample=True, ...)`): the baseline a sampled
    `speculative_generate` must match in distribution and beat in speed.

    The sampling controls, `key` and `seed` are `speculative_generate`'s (temperature 0: greedy, as
    `greedy_generate`); the rest as `greedy_generate`.
    """
    warp = sampling_controls("sample_generate", temperature, top_k, top_p, min_p)
    return _plain_generate("sample_generate", target, prompt_ids, max_new_tokens, warp,
                           rng_key("sample_generate", key, seed), stop_token_ids, prefill_chunk, beyond_max_positions)


def _plain_generate(where: str, target: Target, prompt_ids: Sequence[int] | Sequence[Sequence[int]],
                    max_new_tokens: int, warp: Warp, key: jax.Array | None, stop_token_ids: Sequence[int] | None,
                    prefill_chunk: int, beyond_max_positions: bool) -> GenerationResult:
    """`greedy_generate` (`key` None) and `sample_generate`: one target step per token."""
    if not hasattr(target, "commit"):
        raise IncompatiblePairError(f"{where}: {type(target).__name__} has no commit(pending, kept): it "
                                    "does not implement the Target protocol (dflash_jax.Target)")
    prompts = check_generate(where, target, prompt_ids, max_new_tokens=max_new_tokens, prefill_chunk=prefill_chunk,
                             stop_token_ids=stop_token_ids)
    _check_positions(prompts, max_new_tokens, target, None, beyond_max_positions)
    tokens, lengths = _pad_prompts(prompts)
    out_capacity = round_up(max_new_tokens, BUDGET_BUCKET)
    capacity = round_up(tokens.shape[1] + out_capacity, CACHE_BUCKET)
    check_cache_fits(where, target, None, len(prompts), capacity)
    stop = _stop_array(stop_token_ids)
    sampling = key is not None and float(warp.temperature) > 0
    key = jax.random.key(0) if key is None else key  # greedy: carried, never read
    start = time.perf_counter()
    state = jax.block_until_ready(
        _greedy_prefill(target, target.init_cache(len(prompts), capacity), tokens, lengths, stop,
                        jnp.int32(max_new_tokens), warp, key, capacity=out_capacity, prefill_chunk=prefill_chunk,
                        sampling=sampling)
    )
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    state = _greedy_decode(target, state, stop, warp, sampling=sampling)
    new, n_out = jax.device_get((state.out, state.n_out))
    decode = time.perf_counter() - start
    return GenerationResult(_to_lists(new, n_out), [[] for _ in prompts], prefill, decode, [0] * len(prompts))

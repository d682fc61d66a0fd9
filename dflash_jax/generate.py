"""Speculative decoding end to end: draft with a DFlash-family drafter, verify with a `Target`, commit, repeat.

    result = speculative_generate(target, drafter, prompt_ids, max_new_tokens=128)
    result.tokens, result.acceptance_lengths, result.decode_tokens_per_second

One step (z-lab `dflash/model.py`'s `dflash_generate`, batched; K = `drafter.config.num_draft_tokens`: B-1 for
DFlash/DFlash2, B for DSpark):

    draft   a proposal d_1 .. d_K from the new context rows and the anchor (`drafting.propose`)
    verify  [anchor, d_1 .. d_K] with the target at positions len .. len+K  -> logits, features
    accept  a = the longest accepted prefix of the drafts (greedy: equal to the target's argmax;
            T > 0: the rejection rule below), then one more token from the target (the "bonus")
    commit  d_1..d_a + bonus; the target cache keeps len + a + 1 positions (anchor and accepted drafts; the
            rejected slots are overwritten later), their a + 1 feature rows are the next step's new context
            rows, and the bonus becomes the next anchor

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

How many drafts a step verifies: `draft_length="fixed"`, all K; `"adaptive"` (the default at temperature 0,
`DRAFT_LENGTH`), one of a few static lengths (0: a plain target step, no drafting) chosen per step for the most
progress per second of the sequences the batch will wait for (for one sequence: the most expected tokens per second)
from measured step costs, the drafter's confidences and each sequence's acceptance history (`dflash_jax.adaptive`).
Drafts past the chosen length are not proposed, as past a confidence cut. A plain step's context row waits in a
buffer (`_State.pending`) until the next drafting step or until the buffer is full, and then enters the drafter's
cache with the other waiting rows in one `append_context` (the projections read their weights once for all of them):
the drafter sees the same rows at the same positions as if each had been appended at once.

Loop: every shape is static (prompts right-padded and bucketed, caches sized up front), so `prefill` and
`decode` compile once per (batch, bucket) and the decode runs as ONE program of `lax.while_loop`s: runs of
drafting steps (the verify lengths are branches of a `lax.switch`), and, under the adaptive policy, runs of plain
steps between them (`_Loop.run`). Each kind of step is a loop of its own rather than a branch of a conditional:
on a GPU XLA reads a conditional's predicate on the host, and it copies a buffer that two branches of a
conditional both update (the drafter's cache, were drafting and appending branches). Measured on CPU (2 cores,
tiny models, 39 steps; docs/generate.md): 21 ms for the while_loop against 31 ms for the same jitted step driven
from Python, whose per-step dispatch and host sync (to test "all done") a small model cannot hide. A progress
callback, when given, is called from inside the loop (`jax.debug.callback`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._arguments import check_cache_fits, check_generate
from ._shapes import round_up
from .adaptive import Adaptive, History, Probing, StepCosts, choose_length, longest_gap, weights
from .drafter import Drafter
from .drafting import ContextCache, Proposal, append_context, context_projection, init_cache, propose
from .errors import IncompatiblePairError
from .model import AttentionOptions
from .pairing import check_pair
from .sampling import Warp, choose, rng_key, sampling_controls
from .target import PREFILL_CHUNK, Target

__all__ = ["GenerationResult", "speculative_generate", "greedy_generate", "sample_generate", "DRAFT_LENGTH"]

PROMPT_BUCKET = 16  # prompts are right-padded to a multiple of this, so prompt lengths share compilations
CACHE_BUCKET = 128  # cache capacities are rounded up to a multiple of this
BUDGET_BUCKET = 64  # output buffers hold a multiple of this many tokens: budgets within one share compilations


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    """New tokens and statistics of one `speculative_generate` / `greedy_generate` / `sample_generate` call.

    Always batched, whether `prompt_ids` was one prompt or several: `tokens[i]` are prompt i's new ids,
    `acceptance_lengths[i]` its verify steps' acceptance lengths, `plain_tokens[i]` how many of its tokens plain
    target steps made (steps verifying no drafts, which the adaptive policy chooses), not verifies; one prompt is
    `result.tokens[0]`. Acceptance lengths count the bonus token (the reference's tau per step: accepted drafts +
    1); the first new token comes from the prefill and belongs to no step. Times are wall clock and include
    compilation the first time a shape is seen: warm up first to measure speed. `step_costs`: the step times the
    adaptive policy chose lengths by (measured in this call or an earlier one of the same setup, or given), None at
    the fixed length or where they could not be measured; `Adaptive(costs=result.step_costs)` gives them to a call in
    another process, which then measures nothing.
    """

    tokens: list[list[int]]
    acceptance_lengths: list[list[int]]
    prefill_seconds: float
    decode_seconds: float
    plain_tokens: list[int]
    step_costs: StepCosts | None = None

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
# Commit, stop and budget: one bookkeeping for both loops
# --------------------------------------------------------------------------------------------------------------


def _commit(out: jax.Array, n_out: jax.Array, done: jax.Array, budget: jax.Array, stop: jax.Array,
            made: jax.Array, accepted: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Append a step's tokens: `(out, n_out, done)` after writing `made [batch, R]`'s first `accepted + 1` tokens
    (`accepted [batch]`; a plain step: `R = 1`, `accepted = 0`) of each running sequence to `out [batch, capacity]`
    at `n_out [batch]`, cut after a stop token (kept) and at the `budget`."""
    batch, R = made.shape
    live = ~done
    is_stop = (made[..., None] == stop).any(-1) & (jnp.arange(R) <= accepted[:, None])  # [batch, R]
    keep = jnp.where(is_stop.any(1), jnp.argmax(is_stop, axis=1) + 1, accepted + 1)
    keep = jnp.where(live, jnp.minimum(keep, budget - n_out), 0)  # [batch]
    kept = jnp.arange(R) < keep[:, None]  # [batch, R]
    slots = jnp.where(kept, n_out[:, None] + jnp.arange(R), out.shape[1])  # past the end: dropped
    n_out = n_out + keep
    out = out.at[jnp.arange(batch)[:, None], slots].set(made, mode="drop")
    return out, n_out, done | (is_stop & kept).any(1) | (n_out >= budget)


# --------------------------------------------------------------------------------------------------------------
# Speculative decoding
# --------------------------------------------------------------------------------------------------------------

DRAFT_LENGTH = "adaptive"  # `speculative_generate`'s default draft_length at temperature 0: "adaptive" or "fixed"
# When the costs are measured (`_calibrate`), each length runs calls of CALIBRATION_STEPS and of twice as many steps,
# CALIBRATION_REPEATS times each: the difference of the fastest of each is the steps' own time, without what a call
# of the decode program costs on its own. Measured on an H200 (docs/benchmarks.md): 3 steps once gave K-draft steps
# cheaper than plain ones (one slow call early in the run); 6 steps, fastest of 2, stay within 5% of the steps'
# times in the decode.
CALIBRATION_STEPS = 6
CALIBRATION_REPEATS = 2
PENDING_BLOCKS = 2  # plain steps' context rows wait in a buffer of this many verify blocks (K + 1 rows each)
_NO_LIMIT = 2**31 - 1


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Settings:
    """`Adaptive`'s numbers as the loop's traced input (`[]` float32 each): another setting runs the same program."""

    memory: jax.Array
    prior: jax.Array
    margin: jax.Array
    probe_share: jax.Array
    focus: jax.Array

    @classmethod
    def of(cls, adaptive: Adaptive | None) -> _Settings:
        adaptive = adaptive or Adaptive()  # the fixed length reads none of them
        return cls(*(jnp.float32(getattr(adaptive, f.name)) for f in dataclasses.fields(cls)))


@dataclasses.dataclass(frozen=True)
class _Policy:
    """What the compiled loop knows of the draft-length policy (static): the lengths it chooses from, and whether
    it chooses (`adaptive`; its settings are a traced `_Settings`); if not, every step verifies `lengths[0]`, the
    drafter's K."""

    lengths: tuple[int, ...]
    adaptive: bool

    @property
    def plain(self) -> bool:
        """Plain target steps are among the lengths (`lengths[0]` is 0)."""
        return self.lengths[0] == 0

    def choose(self, settings: _Settings, proposal: Proposal | None, history: History, seconds: jax.Array,
               remaining: jax.Array, live: jax.Array, sampling: bool, plain_margin: jax.Array | float = 0.0
               ) -> jax.Array:
        """The index of a step's length: before drafting (`proposal` None) from the history alone, a plain step's
        rate counting `1 - plain_margin` times; after, from the proposal's calibrated confidences at T = 0 and the
        history at T > 0 (`dflash_jax.adaptive`)."""
        assert self.adaptive
        batch, n, prior = live.shape[0], self.lengths[-1], settings.prior
        if proposal is None or sampling:
            p = jnp.broadcast_to(history.rate(prior)[:, None], (batch, n))
        else:
            confidence = proposal.predicted_acceptance()[:, :n]  # [batch, n]
            p = jnp.clip(confidence * history.scale(prior)[:, None], 0.0, 1.0)
            p = jnp.where(jnp.arange(n) < proposal.num_tokens[:, None], p, 0.0)  # past a DSpark cut: not proposed
        weight = weights(history.run_rate(prior), n, remaining, live, settings.focus)  # [batch]
        return choose_length(p, self.lengths, seconds, remaining, weight, drafted=proposal is not None,
                             plain_margin=plain_margin)


def _resolve_policy(draft_length: Any, num_draft_tokens: int) -> tuple[_Policy, _Settings, StepCosts | None]:
    """`speculative_generate`'s `draft_length` as the loop's `_Policy`, its settings and the costs the user gave,
    if any."""
    if isinstance(draft_length, str) and draft_length == "fixed":
        return _Policy((num_draft_tokens,), False), _Settings.of(None), None
    if isinstance(draft_length, str) and draft_length == "adaptive":
        draft_length = Adaptive()
    if not isinstance(draft_length, Adaptive):
        raise TypeError(f"speculative_generate: draft_length must be 'adaptive', 'fixed' or a dflash_jax.Adaptive, "
                        f"got {draft_length!r}")
    return _Policy(draft_length.lengths(num_draft_tokens), True), _Settings.of(draft_length), draft_length.costs


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _State:
    """The decode loop's carry (every array has a static shape). Between steps no proposal is held: a drafting
    step drafts and verifies."""

    step: jax.Array  # [] int32
    target_cache: Any  # the target's KV cache
    lengths: jax.Array  # [batch] positions in the target cache (= the drafter's context rows + num_pending)
    context: ContextCache  # the drafter's context K/V
    pending: jax.Array  # [batch, PENDING_BLOCKS * (K + 1), Lf*H] target features of committed rows not yet in
    # `context` (the last verify's, then plain steps'), at positions context.lengths ..
    num_pending: jax.Array  # [batch] rows in `pending` (at most K + 1 whenever the next step drafts)
    anchor: jax.Array  # [batch] the last committed token, not yet run through the target
    out: jax.Array  # [batch, capacity] new tokens (capacity: the budget rounded up to BUDGET_BUCKET)
    n_out: jax.Array  # [batch] tokens in `out`
    budget: jax.Array  # [] int32 max_new_tokens: a value, so that budgets of one bucket share the program
    accept: jax.Array  # [batch, capacity] acceptance length of each verify step (0: done, or a plain step)
    plain: jax.Array  # [batch] tokens made by plain steps (verifying no drafts)
    done: jax.Array  # [batch] bool
    key: jax.Array
    draft: jax.Array  # [] bool: the next step drafts and verifies (else a plain target step)
    history: History  # per sequence: the adaptive policy's acceptance history
    probing: Probing  # the batch: when plain steps turn to drafting again


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
    target: Target, drafter: Drafter, target_cache, context: ContextCache, tokens, lengths, stop, warp: Warp, key,
    budget, *, capacity: int, sampling: bool, attention: AttentionOptions, prefill_chunk: int
) -> _State:
    """Run the prompts through the target, take the first token and fill the drafter's context with the prompts'
    features; the first step drafts from there. A target whose `prefill` takes a `FeatureMap` returns the
    features already projected for the drafter, a step at a time: the prompts' `Lf * H`-wide features never
    exist whole (8 x 32k rows of a Qwen3-8B: 10 GiB).

    The empty caches come in as arguments: made inside, XLA would constant-fold work over them at compile time.
    """
    batch = tokens.shape[0]
    K = drafter.config.num_draft_tokens
    first_key, key = jax.random.split(key)
    projected = "project" in inspect.signature(target.prefill).parameters
    mapping = {"project": context_projection(drafter)} if projected else {}
    out = target.prefill(tokens, target_cache, lengths, layer_ids=drafter.config.checked_target_layer_ids,
                         chunk=prefill_chunk, **mapping)
    first = _pick(first_key if sampling else None, out.logits, warp)  # [batch]
    context = append_context(drafter, context, out.features, lengths, attention=attention,
                             append_chunk=prefill_chunk, projected=projected)
    width = len(drafter.config.checked_target_layer_ids) * target.hidden_size  # Lf * H
    return _State(
        step=jnp.zeros((), jnp.int32),
        target_cache=out.cache,
        lengths=lengths,
        context=context,
        pending=jnp.zeros((batch, PENDING_BLOCKS * (K + 1), width), target.embed.dtype),  # features: embed's dtype
        num_pending=jnp.zeros((batch,), jnp.int32),
        anchor=first,
        out=jnp.zeros((batch, capacity), jnp.int32).at[:, 0].set(first),
        n_out=jnp.ones((batch,), jnp.int32),
        budget=budget,
        accept=jnp.zeros((batch, capacity), jnp.int32),
        plain=jnp.zeros((batch,), jnp.int32),
        done=(first[:, None] == stop).any(-1) | (budget <= 1),
        key=key,
        draft=jnp.ones((), bool),
        history=History.empty(batch),
        probing=Probing.start(),
    )


@dataclasses.dataclass(frozen=True)
class _Loop:
    """The decode loop (`_spec_decode`): its steps and how they nest, with what stays fixed over it. `seconds`:
    the step costs of `policy.lengths`; `force`: -1, or the index of the length every step takes (`_calibrate`);
    `until`: the loop stops at this step; `report`: call the progress callback registered under `call` after every
    step (`_report`)."""

    target: Target
    drafter: Drafter
    stop: jax.Array
    warp: Warp
    threshold: jax.Array
    call: jax.Array
    seconds: jax.Array
    force: jax.Array
    until: jax.Array
    sampling: bool
    attention: AttentionOptions
    policy: _Policy
    settings: _Settings
    report: bool

    def run(self, s: _State) -> _State:
        """Steps until every sequence is done, the budget's steps are taken or `until` is reached: runs of drafting
        steps while the policy drafts and, between them, runs of plain steps, each run of plain steps ending (and
        split where the pending rows' buffer is full) with their context rows appended to the drafter's cache.
        Each run is a `lax.while_loop` of one kind of step: whether a step drafts is no conditional (module doc)."""
        if not self.policy.plain:
            return jax.lax.while_loop(self.running, self.draft_step, s)
        rows = s.pending.shape[1]

        def plain_run(s: _State) -> _State:
            s = jax.lax.while_loop(lambda s: self.running(s) & ~self.drafts(s) & (s.num_pending.max() < rows),
                                   self.plain_step, s)
            return self.flush(s)

        def cycle(s: _State) -> _State:
            s = jax.lax.while_loop(lambda s: self.running(s) & self.drafts(s), self.draft_step, s)
            return jax.lax.while_loop(lambda s: self.running(s) & ~self.drafts(s), plain_run, s)

        return jax.lax.while_loop(self.running, cycle, s)

    def running(self, s: _State) -> jax.Array:
        return ~s.done.all() & (s.step < s.budget) & (s.step < self.until)

    def drafts(self, s: _State) -> jax.Array:
        """`[]` bool: the next step drafts (the forced length's kind while the costs are measured)."""
        return jnp.where(self.force >= 0, jnp.asarray(self.policy.lengths)[self.force] > 0, s.draft)

    def draft_step(self, s: _State) -> _State:
        """Draft from the pending context rows (`propose`), verify as many drafts as the policy chooses (a
        `lax.switch` over the nonzero lengths: the target on that many rows), commit, and plan the next step."""
        target, policy = self.target, self.policy
        K = self.drafter.config.num_draft_tokens
        draft_key, verify_key, key = jax.random.split(s.key, 3)
        live = ~s.done
        proposal, context = propose(
            self.drafter, s.context, s.pending[:, : K + 1], s.num_pending, s.anchor,
            key=draft_key if self.sampling else None, temperature=self.warp.temperature, top_k=self.warp.top_k,
            top_p=self.warp.top_p, min_p=self.warp.min_p, confidence_threshold=self.threshold,
            attention=self.attention)
        index = self.verify_index(s, proposal)
        drafts, _ = _in_vocabulary(proposal.tokens, target.vocab_size)
        tokens = jnp.concatenate([s.anchor[:, None], drafts], axis=1)  # [batch, K + 1]

        def verify(n: int):  # the anchor and the first n drafts through the target
            def run(target_cache):
                out = target(tokens[:, : n + 1], target_cache, s.lengths,
                             layer_ids=self.drafter.config.checked_target_layer_ids)
                accepted, last = _acceptance(verify_key if self.sampling else None, out.logits, proposal.head(n),
                                             self.warp)
                cache = target.commit(out.cache, jnp.where(live, accepted + 1, 0))  # the anchor, accepted drafts
                features = jnp.pad(out.features, ((0, 0), (0, K - n), (0, 0)))  # [batch, K + 1, Lf*H]; n + 1 real
                return cache, features, accepted, last
            return run

        branches = [verify(n) for n in policy.lengths if n > 0]
        if len(branches) == 1:
            target_cache, features, accepted, last = branches[0](s.target_cache)
        else:
            target_cache, features, accepted, last = jax.lax.switch(index - int(policy.plain), branches,
                                                                    s.target_cache)
        made = jnp.pad(proposal.tokens, ((0, 0), (0, 1)))
        made = jnp.where(jnp.arange(K + 1) == accepted[:, None], last[:, None], made)  # [batch, K + 1] d_1..d_a, last
        out, n_out, done = _commit(s.out, s.n_out, s.done, s.budget, self.stop, made, accepted)
        committed = jnp.where(live, accepted + 1, 0)  # anchor + accepted drafts enter the caches
        s = dataclasses.replace(
            s, step=s.step + 1, target_cache=target_cache, lengths=s.lengths + committed, context=context,
            pending=jax.lax.dynamic_update_slice(s.pending, features, (0, 0, 0)), num_pending=committed,
            anchor=jnp.where(live, last, s.anchor), out=out, n_out=n_out,
            accept=s.accept.at[:, s.step].set(committed), done=done, key=key)
        if policy.adaptive:
            verified = jnp.minimum(jnp.asarray(policy.lengths)[index], proposal.num_tokens)  # [batch]
            history = s.history.update(verified, accepted, proposal.predicted_acceptance(), live,
                                       self.settings.memory)
            s = dataclasses.replace(s, history=history)
        if policy.adaptive and policy.plain:  # whether the next step drafts, from the history alone
            running = ~done
            plan = policy.choose(self.settings, None, s.history, self.seconds, s.budget - n_out, running,
                                 self.sampling, plain_margin=s.history.margin(self.settings.margin, running))
            draft = jnp.asarray(policy.lengths)[plan] > 0
            longest = longest_gap(self.seconds, self.settings.probe_share)
            s = dataclasses.replace(s, draft=draft, probing=s.probing.after_verify(~draft, longest))
        return self.reported(s)

    def verify_index(self, s: _State, proposal: Proposal) -> jax.Array:
        """`[]` int32: the index into `policy.lengths` of the drafting step's verify: the forced one while the costs
        are measured, the longest at the first step (nothing is known yet), else the policy's choice."""
        policy = self.policy
        if not policy.adaptive:
            return jnp.zeros((), jnp.int32)
        chosen = policy.choose(self.settings, proposal, s.history, self.seconds, s.budget - s.n_out, ~s.done,
                               self.sampling)
        return jnp.where(self.force >= 0, self.force, jnp.where(s.step == 0, len(policy.lengths) - 1, chosen))

    def plain_step(self, s: _State) -> _State:
        """The target on each sequence's anchor alone: one token; its context row waits in `pending` (`flush`)."""
        step_key, key = jax.random.split(s.key)
        live = ~s.done
        o = self.target(s.anchor[:, None], s.target_cache, s.lengths,
                        layer_ids=self.drafter.config.checked_target_layer_ids)
        nxt = _pick(step_key if self.sampling else None, o.logits[:, 0], self.warp)  # [batch]
        out, n_out, done = _commit(s.out, s.n_out, s.done, s.budget, self.stop, nxt[:, None], jnp.zeros_like(nxt))
        advance = live.astype(jnp.int32)  # [batch] 1 while running
        batch = nxt.shape[0]
        probing = s.probing.after_plain()
        return self.reported(dataclasses.replace(
            s, step=s.step + 1, target_cache=self.target.commit(o.cache, advance), lengths=s.lengths + advance,
            pending=s.pending.at[jnp.arange(batch), s.num_pending].set(o.features[:, 0]),
            num_pending=s.num_pending + advance, anchor=jnp.where(live, nxt, s.anchor), out=out, n_out=n_out,
            plain=s.plain + advance, done=done, key=key, draft=probing.due(), probing=probing))

    def flush(self, s: _State) -> _State:
        """The pending context rows into the drafter's cache, all in one `append_context`."""
        context = append_context(self.drafter, s.context, s.pending, s.num_pending, attention=self.attention)
        return dataclasses.replace(s, context=context, num_pending=jnp.zeros_like(s.num_pending))

    def reported(self, s: _State) -> _State:
        if self.report:
            jax.debug.callback(_report, self.call, s.n_out)
        return s


@functools.partial(
    jax.jit, static_argnames=("sampling", "attention", "policy", "report"), donate_argnames=("state",),
)
def _spec_decode(target: Target, drafter: Drafter, state: _State, stop, warp: Warp, threshold, call, seconds, force,
                 until, settings: _Settings, *, sampling: bool, attention: AttentionOptions, policy: _Policy,
                 report: bool = False) -> _State:
    """Decode steps from `state` as one program (`_Loop.run`), until every sequence is done or `state.step` reaches
    `until`."""
    return _Loop(target, drafter, stop, warp, threshold, call, seconds, force, until, sampling, attention, policy,
                 settings, report).run(state)


_PROGRESS: dict[int, Callable[[np.ndarray], None]] = {}  # the progress callbacks of the calls running now, by id
_CALLS = itertools.count()
_COSTS: dict[tuple, StepCosts] = {}  # measured step costs, by what determines them (`_costs_key`)
_CALIBRATIONS: dict[tuple, _Calibration] = {}  # what calls of a setup measured before they ended (`_calibrate`)


def _report(call: np.ndarray, n_out: np.ndarray) -> None:
    """The host side of the loop's progress callback: the callback is looked up by a traced call id, so that it is
    no part of the compiled program (another callback, or none, reuses it)."""
    callback = _PROGRESS.get(int(call))
    if callback is not None:
        callback(n_out)


def _device_kind(tree: Any) -> tuple[str, int]:
    """The kind of device the first array of `tree` lives on, and on how many devices it lives."""
    devices = jax.tree_util.tree_leaves(tree)[0].devices()
    return next(iter(devices)).device_kind, len(devices)


def _costs_key(target: Target, drafter: Drafter, batch: int, capacity: int, policy: _Policy, sampling: bool,
               attention: AttentionOptions) -> tuple:
    """What a step's cost depends on: the devices, both models' configs and dtypes, the shapes, the lengths."""
    dtypes = tuple(str(jax.tree_util.tree_leaves(m)[0].dtype) for m in (target, drafter))
    return (_device_kind(target), type(target).__name__, repr(getattr(target, "config", None)),
            repr(drafter.config), dtypes, batch, capacity, policy.lengths, sampling, attention)


@dataclasses.dataclass
class _Calibration:
    """A setup's measurement so far, kept across its calls (`_calibrate`): the length indices that ran their untimed
    step in this process, and the seconds of each timed call by (length index, steps)."""

    warmed: set[int] = dataclasses.field(default_factory=set)
    seconds: dict[tuple[int, int], list[float]] = dataclasses.field(default_factory=dict)


def _sure_steps(state: _State, drafts: int) -> int:
    """Steps of `drafts` drafts the decode from `state` runs for certain (short of a stop token): a step makes at
    most drafts + 1 tokens a sequence, and the batch runs while any sequence has budget left."""
    n_out, done = jax.device_get((state.n_out, state.done))
    left = np.where(done, 0, int(state.budget) - n_out)  # [batch]
    return int(np.max(-(-left // (drafts + 1))))


def _calibrate(run: Callable[..., _State], state: _State, policy: _Policy, batch: int, device: str,
               progress: _Calibration) -> tuple[_State, StepCosts | None]:
    """Measure the step costs on the run itself, going on from `progress` (which it updates), longest length first:
    at each length, calls of n = `CALIBRATION_STEPS` steps and of 2n, `CALIBRATION_REPEATS` times each, timed from
    the host, after one untimed step the first time the process runs that length (the first call at a length is
    slower); a step costs the difference of the fastest call of each count over n. A call of the decode program has
    a cost of its own (on an H200, 4-20 ms: dispatch, the loops' start, the host sync), which a plain average over a
    few steps would add to every step: it made plain steps look 45% dearer than greedy decoding's; and a call early
    in a run can be slower than the rest (docs/benchmarks.md). The plain steps' time includes appending their
    context rows to the drafter's cache (`_Loop.flush`, once at the end of each call).

    A timed call starts only where the decode surely lasts its steps even if every draft is accepted
    (`_sure_steps`): a run too short for the next one forces no step to another length and keeps its progress, so
    short runs decode at the fixed length at its own speed and longer ones finish the measurement. Returns the state
    and the costs, or None (the caller runs the fixed length) while the measurement is unfinished or its times are not
    usable (with a warning)."""
    placeholder = jnp.ones(len(policy.lengths), jnp.float32)
    n = CALIBRATION_STEPS
    for i in reversed(range(len(policy.lengths))):
        for count in (n, 2 * n) * CALIBRATION_REPEATS:
            if len(progress.seconds.get((i, count), ())) >= CALIBRATION_REPEATS:  # timed in an earlier call
                continue
            warm = i not in progress.warmed
            if _sure_steps(state, policy.lengths[i]) < count + warm:
                return state, None
            if warm:  # the first call at each length (the first of all compiles) is slower
                state = run(state, placeholder, jnp.int32(i), jnp.int32(int(state.step) + 1))
                progress.warmed.add(i)
            first = int(state.step)
            start = time.perf_counter()
            state = run(state, placeholder, jnp.int32(i), jnp.int32(first + count))
            if int(state.step) - first < count:  # (a host sync: the steps are done) a stop token ended the decode
                return state, None
            progress.seconds.setdefault((i, count), []).append(time.perf_counter() - start)
    measured = []
    for i in range(len(policy.lengths)):
        once, twice = (min(progress.seconds[i, count]) for count in (n, 2 * n))
        measured.append((twice - once) / n if twice > once else twice / (2 * n))  # else a clock too coarse for it
    if jax.process_count() > 1:  # every process must choose the same lengths (one program): process 0's clock decides
        from jax.experimental import multihost_utils

        measured = [float(t) for t in multihost_utils.broadcast_one_to_all(np.asarray(measured, np.float32))]
    progress.seconds.clear()  # measured: a setup that cannot use these times measures anew
    try:
        return state, StepCosts(policy.lengths, tuple(measured), batch, device)
    except ValueError as e:  # a clock that did not move: no costs to trust, so the longest length from here on
        warnings.warn(f"speculative_generate: the step costs could not be measured ({e}); verifying "
                      f"{policy.lengths[-1]} drafts every step instead", RuntimeWarning, stacklevel=3)
        return state, None


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
    draft_length: str | Adaptive | None = None,
) -> GenerationResult:
    """Generate up to `max_new_tokens` new tokens per prompt with speculative decoding.

    prompt_ids: one prompt (ids) or a batch of prompts (any lengths); each sequence accepts drafts on its own, and
    the result is batched either way (`GenerationResult`: one prompt's tokens are `result.tokens[0]`).
    temperature 0 (or below float32's normal range, 2**-126): greedy, token for token the target's own greedy
    decoding; > 0: sampled, distributed as the target's sampling at that temperature after the `top_k` / `top_p` /
    `min_p` cuts (transformers' warpers, in its order; None: off), which the drafts are drawn under too
    (`dflash_jax.sampling`; `sample_generate` is the plain target's sampling). Randomness: `key` (a JAX PRNG
    key), or `seed` (an int) as a shorthand for `key=jax.random.key(seed)`; neither: seed 0. `drafter`: a
    `Drafter` or an `nnx.DFlashDrafter`; the pair is checked first (`pairing.check_pair`). A sequence stops after
    a token of `stop_token_ids` (kept in the output). The drafter is given the target's embedding and LM head when it
    ships none. `confidence_threshold` in [0, 1] (DSpark drafters with a confidence head): proposals end before
    the first draft whose predicted acceptance is below it; 0 verifies every draft. `progress(n_out)`, if given, is
    called after every step with the tokens made so far per sequence (`[batch]` NumPy).

    attention: the drafter's attention rule (`AttentionOptions`; default: the trained rule; a draft window changes
    acceptance, never the greedy output). Long prompts are prefilled `prefill_chunk` tokens at a time. A prompt plus
    `max_new_tokens` beyond the target's or the drafter's `max_position_embeddings` is refused (ValueError) unless
    `beyond_max_positions`. `draft_length`: "adaptive" (`Adaptive()`: per step, as many drafts as make the most
    progress per second for the sequences the batch waits for, none included; `dflash_jax.adaptive`), an `Adaptive`
    with other settings or given costs, or "fixed" (every step verifies all of the drafter's drafts); None:
    `DRAFT_LENGTH` ("adaptive") at temperature 0, "fixed" above it. Sampled, the tokens a key draws depend on the
    lengths chosen (their distribution does not), and the adaptive lengths on step times measured in the run: by
    default a key reproduces its tokens; pass "adaptive" to adapt anyway.
    `GenerationResult.plain_tokens` counts the tokens of steps that verified no drafts.
    """
    if not isinstance(drafter, Drafter) and isinstance(getattr(drafter, "drafter", None), Drafter):
        drafter = drafter.drafter  # an `nnx.DFlashDrafter` module: its current values
    prompts = check_generate(
        "speculative_generate", target, prompt_ids, max_new_tokens=max_new_tokens, prefill_chunk=prefill_chunk,
        stop_token_ids=stop_token_ids, drafter=drafter, confidence_threshold=confidence_threshold)
    warp = sampling_controls("speculative_generate", temperature, top_k, top_p, min_p)
    key = rng_key("speculative_generate", key, seed)
    check_pair(target, drafter)
    K = drafter.config.num_draft_tokens
    sampling = float(warp.temperature) > 0  # a temperature below float32's normal range is 0 (`sampling_controls`)
    if draft_length is None:
        draft_length = "fixed" if sampling else DRAFT_LENGTH
    policy, settings, costs = _resolve_policy(draft_length, K)
    drafter = _attach(target, drafter)
    _check_positions(prompts, max_new_tokens, target, drafter, beyond_max_positions)
    tokens, lengths = _pad_prompts(prompts)
    batch = len(prompts)
    capacity = round_up(tokens.shape[1] + round_up(max_new_tokens, BUDGET_BUCKET) + K + 1, CACHE_BUCKET)
    check_cache_fits("speculative_generate", target, drafter, batch, capacity)
    stop = _stop_array(stop_token_ids)
    threshold = jnp.float32(confidence_threshold)
    device = _device_kind(target)[0]
    cost_key = _costs_key(target, drafter, batch, capacity, policy, sampling, attention)
    if costs is not None:
        costs.check_fits("speculative_generate", policy.lengths, batch, device)
    elif policy.adaptive:
        costs = _COSTS.get(cost_key)
    seconds = jnp.asarray(costs.seconds if costs is not None else [1.0] * len(policy.lengths), jnp.float32)

    start = time.perf_counter()
    caches = target.init_cache(batch, capacity), init_cache(drafter, batch, capacity, attention=attention)
    state = _spec_prefill(target, drafter, *caches, tokens, lengths, stop, warp, key, jnp.int32(max_new_tokens),
                          capacity=round_up(max_new_tokens, BUDGET_BUCKET), sampling=sampling, attention=attention,
                          prefill_chunk=prefill_chunk)
    jax.block_until_ready(state)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    call = next(_CALLS)
    if progress is not None:
        _PROGRESS[call] = progress
    try:
        def run(state: _State, seconds: jax.Array, force: jax.Array, until: jax.Array) -> _State:
            return _spec_decode(target, drafter, state, stop, warp, threshold, jnp.int32(call), seconds, force,
                                until, settings, sampling=sampling, attention=attention, policy=policy,
                                report=progress is not None)

        force = jnp.int32(-1)
        if policy.adaptive and costs is None:
            progress_so_far = _CALIBRATIONS.setdefault(cost_key, _Calibration())
            state, costs = _calibrate(run, state, policy, batch, device, progress_so_far)
            if costs is None:
                force = jnp.int32(len(policy.lengths) - 1)  # the fixed length: never wrong output, only slower
            else:
                _COSTS[cost_key] = costs
                seconds = jnp.asarray(costs.seconds, jnp.float32)
        state = run(state, seconds, force, jnp.int32(_NO_LIMIT))
        out, n_out, accept, plain = jax.device_get((state.out, state.n_out, state.accept, state.plain))
    finally:
        _PROGRESS.pop(call, None)
    decode = time.perf_counter() - start
    state.context.check()  # sized above to hold every sequence: an overflow would be a bug, never silent

    steps = [[int(a) for a in row if a > 0] for row in accept]
    return GenerationResult(_to_lists(out, n_out), steps, prefill, decode, [int(n) for n in plain], costs)


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
        live = ~s.done
        advance = live.astype(jnp.int32)  # [batch] 1 while running
        out, n_out, done = _commit(s.out, s.n_out, s.done, s.budget, stop, nxt[:, None], jnp.zeros_like(nxt))
        return _GreedyState(
            cache=target.commit(o.cache, advance),
            lengths=s.lengths + advance,
            last=jnp.where(live, nxt, s.last),
            out=out,
            n_out=n_out,
            budget=s.budget,
            done=done,
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

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

The acceptance rule (greedy, and the standard speculative-sampling rule at T > 0, lossless under the `top_k` /
`top_p` / `min_p` cuts) is `dflash_jax.acceptance`'s; drafts past a DSpark confidence cut are never accepted.

How many drafts a step verifies (`dflash_jax.draft_policy`): `draft_length="fixed"`, all K; an int n, n;
`"adaptive"` (the default at temperature 0, `DRAFT_LENGTH`) or an `Adaptive`, one of a few static lengths (0: a
plain target step, no drafting) chosen per step for the most progress per second of the sequences the batch will
wait for (for one sequence: the most expected tokens per second) from step costs (predicted from the models and the
device from the first step, measured in a long run: `dflash_jax.step_cost_model`), the drafter's confidences
and each sequence's acceptance history (`dflash_jax.adaptive`). Drafts past the chosen length are not proposed, as
past a confidence cut. A plain step's context row waits in a buffer (`_State.pending`) until the next drafting step
or until the buffer is full, and then enters the drafter's cache with the other waiting rows in one `append_context`
(the projections read their weights once for all of them): the drafter sees the same rows at the same positions as
if each had been appended at once.

Loop: every shape is static (prompts right-padded and bucketed, caches sized up front), so `prefill` and
`decode` compile once per (batch, bucket) and the decode runs as ONE program of `lax.while_loop`s: runs of
drafting steps (each verify length a loop of zero or one trip: `_one_of`), and, under the adaptive policy, runs of plain
steps between them (`_Loop.run`). Each kind of step is a loop of its own rather than a branch of a conditional:
on a GPU XLA reads a conditional's predicate on the host, and it copies a buffer that two branches of a
conditional both update (the drafter's cache, were drafting and appending branches). Measured on CPU (2 cores,
tiny models, 39 steps; docs/generate.md): 21 ms for the while_loop against 31 ms for the same jitted step driven
from Python, whose per-step dispatch and host sync (to test "all done") a small model cannot hide. A progress
callback, when given, is called from inside the loop (`jax.debug.callback`, through `_progress.CALLBACKS`).

`greedy_generate` and `sample_generate` (the target alone) are `dflash_jax.plain`'s, and `GenerationResult`
`dflash_jax.bookkeeping`'s; both are importable from here too.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._arguments import check_cache_fits, check_generate
from ._progress import CALLBACKS
from ._shapes import round_up
from .acceptance import accept, in_vocabulary
from .adaptive import History, Probing, first_length, probe_gaps, probe_payback
from .bookkeeping import (
    BUDGET_BUCKET,
    CACHE_BUCKET,
    PROMPT_BUCKET,
    GenerationResult,
    check_positions,
    commit,
    pad_prompts,
    stop_array,
    stop_ids,
    to_lists,
)
from .draft_policy import (
    DRAFT_LENGTH,
    DraftLength,
    Policy,
    Settings,
    calibrate,
    device_kind,
    predicted_costs,
    resolve_draft_length,
    setup_key,
)
from .drafter import Drafter
from .drafting import ContextCache, Proposal, append_context, context_projection, init_cache, propose
from .model import AttentionOptions
from .pairing import check_pair
from .plain import greedy_generate, sample_generate
from .sampling import Sampling, Warp, choose, resolve_sampling
from .target import PREFILL_CHUNK, Target

__all__ = ["BUDGET_BUCKET", "CACHE_BUCKET", "DRAFT_LENGTH", "PROMPT_BUCKET", "GenerationResult", "greedy_generate",
           "sample_generate", "speculative_generate"]

PENDING_BLOCKS = 2  # plain steps' context rows wait in a buffer of this many verify blocks (K + 1 rows each)
_NO_LIMIT = 2**31 - 1


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
    first = choose(first_key if sampling else None, out.logits, warp)[0]  # [batch]
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
    the step costs of `policy.lengths`; `force`: -1, or the index of the length every step takes
    (`draft_policy.calibrate`); `until`: the loop stops at this step; `report`: call the progress callback held
    under `call` after every step (`_progress.CALLBACKS`)."""

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
    policy: Policy
    settings: Settings
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
        `_one_of` the nonzero lengths: the target on that many rows), commit, and plan the next step."""
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
        drafts, _ = in_vocabulary(proposal.tokens, target.vocab_size)
        tokens = jnp.concatenate([s.anchor[:, None], drafts], axis=1)  # [batch, K + 1]

        def verify(n: int):  # the anchor and the first n drafts through the target
            def run(target_cache):
                out = target(tokens[:, : n + 1], target_cache, s.lengths,
                             layer_ids=self.drafter.config.checked_target_layer_ids)
                accepted, last = accept(verify_key if self.sampling else None, out.logits, proposal.head(n),
                                             self.warp)
                cache = target.commit(out.cache, jnp.where(live, accepted + 1, 0))  # the anchor, accepted drafts
                features = jnp.pad(out.features, ((0, 0), (0, K - n), (0, 0)))  # [batch, K + 1, Lf*H]; n + 1 real
                return cache, features, accepted, last
            return run

        branches = [verify(n) for n in policy.lengths if n > 0]
        if len(branches) == 1:
            target_cache, features, accepted, last = branches[0](s.target_cache)
        else:
            blank = jnp.zeros_like(s.pending[:, : K + 1]), jnp.zeros_like(s.anchor), jnp.zeros_like(s.anchor)
            target_cache, features, accepted, last = _one_of(index - int(policy.plain), branches, s.target_cache,
                                                             blank)  # features, accepted, last
        made = jnp.pad(proposal.tokens, ((0, 0), (0, 1)))
        made = jnp.where(jnp.arange(K + 1) == accepted[:, None], last[:, None], made)  # [batch, K + 1] d_1..d_a, last
        out, n_out, done = commit(s.out, s.n_out, s.done, s.budget, self.stop, made, accepted)
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
            probing = s.probing.after_verify(~draft, self.probe_gaps(), s.history.right(running) >= 1)
            s = dataclasses.replace(s, draft=draft, probing=probing)
        return self.reported(s)

    def probe_gaps(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The first gaps between probes (a drafter right, never right) and the longest (`adaptive.probe_gaps`)."""
        return probe_gaps(self.seconds, self.settings.probe_share, self.settings.early_probe_share)

    def verify_index(self, s: _State, proposal: Proposal) -> jax.Array:
        """`[]` int32: the index into `policy.lengths` of the drafting step's verify: the forced one while the costs
        are measured; at the first step, where nothing is known of the drafter, the length whose worse case of
        never and always accepted is best (`adaptive.first_length`); else the policy's choice."""
        policy = self.policy
        if not policy.adaptive:
            return jnp.zeros((), jnp.int32)
        chosen = policy.choose(self.settings, proposal, s.history, self.seconds, s.budget - s.n_out, ~s.done,
                               self.sampling)
        first = first_length(self.seconds, policy.lengths, _most_left(s.done, s.n_out, s.budget))
        return jnp.where(self.force >= 0, self.force, jnp.where(s.step == 0, first, chosen))

    def plain_step(self, s: _State) -> _State:
        """The target on each sequence's anchor alone: one token; its context row waits in `pending` (`flush`)."""
        step_key, key = jax.random.split(s.key)
        live = ~s.done
        o = self.target(s.anchor[:, None], s.target_cache, s.lengths,
                        layer_ids=self.drafter.config.checked_target_layer_ids)
        nxt = choose(step_key if self.sampling else None, o.logits[:, 0], self.warp)[0]  # [batch]
        out, n_out, done = commit(s.out, s.n_out, s.done, s.budget, self.stop, nxt[:, None], jnp.zeros_like(nxt))
        advance = live.astype(jnp.int32)  # [batch] 1 while running
        batch = nxt.shape[0]
        probing = s.probing.after_plain()
        draft = probing.due(probe_payback(self.seconds, self.policy.lengths, _most_left(done, n_out, s.budget)))
        return self.reported(dataclasses.replace(
            s, step=s.step + 1, target_cache=self.target.commit(o.cache, advance), lengths=s.lengths + advance,
            pending=s.pending.at[jnp.arange(batch), s.num_pending].set(o.features[:, 0]),
            num_pending=s.num_pending + advance, anchor=jnp.where(live, nxt, s.anchor), out=out, n_out=n_out,
            plain=s.plain + advance, done=done, key=key, draft=draft, probing=probing))

    def flush(self, s: _State) -> _State:
        """The pending context rows into the drafter's cache, all in one `append_context`."""
        context = append_context(self.drafter, s.context, s.pending, s.num_pending, attention=self.attention)
        return dataclasses.replace(s, context=context, num_pending=jnp.zeros_like(s.num_pending))

    def reported(self, s: _State) -> _State:
        if self.report:
            jax.debug.callback(CALLBACKS.report, self.call, s.n_out)
        return s


def _one_of(index: jax.Array, branches: Sequence[Callable[[Any], tuple]], cache: Any, blank: tuple) -> tuple:
    """`branches[index](cache)` (each branch: the cache -> (the cache, *rest)) as `lax.switch` gives it, each branch
    a `lax.while_loop` of zero or one trip: XLA copies the buffers that a conditional's branches update in place
    (each branch writes the target's cache: compiled for a CPU, the whole cache once more each drafting step,
    `benchmarks/loop_copies.py`), where a while loop's state stays in place. `blank`: zeros shaped as `rest`, the
    loops' state before the branch taken fills it."""
    def trip(branch: Callable[[Any], tuple]) -> Callable[[tuple], tuple]:
        def body(carry: tuple) -> tuple:
            return (*branch(carry[0]), jnp.int32(-1))
        return body

    def taken(i: int) -> Callable[[tuple], jax.Array]:
        return lambda carry: carry[-1] == i

    carry = (cache, *blank, index.astype(jnp.int32))
    for i, branch in enumerate(branches):
        carry = jax.lax.while_loop(taken(i), trip(branch), carry)
    return carry[:-1]


def _most_left(done: jax.Array, n_out: jax.Array, budget: jax.Array) -> jax.Array:
    """`[]` the most tokens a running sequence still has to make (`done`, `n_out` `[batch]`; 0 when none runs)."""
    return jnp.where(done, 0, budget - n_out).max()


@functools.partial(
    jax.jit, static_argnames=("sampling", "attention", "policy", "report"), donate_argnames=("state",),
)
def _spec_decode(target: Target, drafter: Drafter, state: _State, stop, warp: Warp, threshold, call, seconds, force,
                 until, settings: Settings, *, sampling: bool, attention: AttentionOptions, policy: Policy,
                 report: bool = False) -> _State:
    """Decode steps from `state` as one program (`_Loop.run`), until every sequence is done or `state.step` reaches
    `until`."""
    return _Loop(target, drafter, stop, warp, threshold, call, seconds, force, until, sampling, attention, policy,
                 settings, report).run(state)


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
    sampling: Sampling | None = None,
    stop_token_ids: Sequence[int] | None = None,
    confidence_threshold: float = 0.0,
    progress: Callable[[np.ndarray], None] | None = None,
    attention: AttentionOptions = AttentionOptions(),
    prefill_chunk: int = PREFILL_CHUNK,
    beyond_max_positions: bool = False,
    draft_length: DraftLength | None = None,
) -> GenerationResult:
    """Generate up to `max_new_tokens` new tokens per prompt with speculative decoding.

    prompt_ids: one prompt (ids) or a batch of prompts (any lengths); each sequence accepts drafts on its own, and
    the result is batched either way (`GenerationResult`: one prompt's tokens are `result.tokens[0]`).
    temperature 0 (the default, or below float32's normal range, 2**-126): greedy, token for token the target's own
    greedy decoding (`top_k` / `top_p` / `min_p` are then ignored, with a warning); > 0: sampled, distributed as the
    target's sampling at that temperature after the `top_k` / `top_p` / `min_p` cuts (transformers' warpers, in its
    order; None: off), which the drafts are drawn under too (`dflash_jax.sampling`; `sample_generate` is the plain
    target's sampling). Randomness: `key` (a JAX PRNG key), or `seed` (an int) as a shorthand for
    `key=jax.random.key(seed)`; neither: seed 0. `sampling`: all of these as one `Sampling` value, instead of the
    loose keywords. `drafter`: a `Drafter` or an `nnx.DFlashDrafter`; the pair is checked first
    (`pairing.check_pair`). A sequence stops after a token of `stop_token_ids` (kept in the output); None (the
    default): the target's end-of-sequence ids (`eos_token_ids`, from its checkpoint's generation_config.json, else
    config.json), as transformers and vLLM stop; `()`: no stop, every sequence runs to `max_new_tokens`. The
    drafter is given the target's embedding and LM head when it ships none. `confidence_threshold` in [0, 1]
    (DSpark drafters with a confidence head): proposals end before the first draft whose predicted acceptance is
    below it; 0 verifies every draft. `progress(n_out)`, if given, is called after every step with the tokens made
    so far per sequence (`[batch]` NumPy).

    attention: the drafter's attention rule (`AttentionOptions`; default: the trained rule; a draft window changes
    acceptance, never the greedy output). Long prompts are prefilled `prefill_chunk` tokens at a time. A prompt plus
    `max_new_tokens` beyond the target's or the drafter's `max_position_embeddings` is refused (ValueError) unless
    `beyond_max_positions`. `draft_length` (`dflash_jax.draft_policy`): "adaptive" (a new `Adaptive()`: per step,
    as many drafts as make the most progress per second for the sequences the batch waits for, none included, from
    step costs predicted from the models and the device, and measured in this call if it is long enough;
    `dflash_jax.adaptive`), an `Adaptive` (other settings, given costs, or costs it measured in an earlier call of
    the same setup and keeps in its `calibration`), "fixed" (every step
    verifies all of the drafter's drafts) or an int n in [1, K] (every step verifies n); None: `DRAFT_LENGTH`
    ("adaptive") at temperature 0, "fixed" above it. Sampled, the tokens a key draws depend on the lengths chosen
    (their distribution does not), and the adaptive lengths on step times measured in the run: by default a key
    reproduces its tokens; pass "adaptive" to adapt anyway. `GenerationResult.plain_tokens` counts the tokens of
    steps that verified no drafts.
    """
    if not isinstance(drafter, Drafter) and isinstance(getattr(drafter, "drafter", None), Drafter):
        drafter = drafter.drafter  # an `nnx.DFlashDrafter` module: its current values
    prompts = check_generate(
        "speculative_generate", target, prompt_ids, max_new_tokens=max_new_tokens, prefill_chunk=prefill_chunk,
        stop_token_ids=stop_token_ids, drafter=drafter, confidence_threshold=confidence_threshold)
    warp, key = resolve_sampling("speculative_generate", sampling, temperature, 0.0, top_k, top_p, min_p, key, seed)
    check_pair(target, drafter)
    K = drafter.config.num_draft_tokens
    sampled = float(warp.temperature) > 0  # a temperature below float32's normal range is 0 (`sampling_controls`)
    if draft_length is None:
        draft_length = "fixed" if sampled else DRAFT_LENGTH
    policy, settings, adaptive = resolve_draft_length(draft_length, K)
    drafter = _attach(target, drafter)
    check_positions(prompts, max_new_tokens, target, drafter, beyond_max_positions)
    tokens, lengths = pad_prompts(prompts)
    batch = len(prompts)
    capacity = round_up(tokens.shape[1] + round_up(max_new_tokens, BUDGET_BUCKET) + K + 1, CACHE_BUCKET)
    check_cache_fits("speculative_generate", target, drafter, batch, capacity)
    stop = stop_array(stop_ids(target, stop_token_ids))
    threshold = jnp.float32(confidence_threshold)
    device = device_kind(target)[0]
    setup = setup_key(target, drafter, batch, capacity, policy, sampled, attention)
    costs = None if adaptive is None else adaptive.costs
    if costs is not None:
        costs.check_fits("speculative_generate", policy.lengths, batch, device)
    elif adaptive is not None:
        costs = adaptive.calibration.known(setup, policy.lengths, batch, device)

    start = time.perf_counter()
    caches = target.init_cache(batch, capacity), init_cache(drafter, batch, capacity, attention=attention)
    predicted = None if adaptive is None or costs is not None else predicted_costs(target, drafter, *caches, batch,
                                                                                   policy)
    state = _spec_prefill(target, drafter, *caches, tokens, lengths, stop, warp, key, jnp.int32(max_new_tokens),
                          capacity=round_up(max_new_tokens, BUDGET_BUCKET), sampling=sampled, attention=attention,
                          prefill_chunk=prefill_chunk)
    jax.block_until_ready(state)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    with CALLBACKS.held(progress) as call:
        def run(state: _State, seconds: jax.Array, force: jax.Array, until: jax.Array) -> _State:
            return _spec_decode(target, drafter, state, stop, warp, threshold, jnp.int32(call), seconds, force,
                                until, settings, sampling=sampled, attention=attention, policy=policy,
                                report=progress is not None)

        if adaptive is not None and predicted is not None:  # measured only where that costs little of the run
            if adaptive.calibration.worth(predicted, max_new_tokens):
                state, costs = calibrate(run, state, policy, batch, device, adaptive.calibration, setup)
            costs = costs or predicted
        seconds = jnp.asarray(costs.seconds if costs is not None else [1.0] * len(policy.lengths), jnp.float32)
        state = run(state, seconds, jnp.int32(-1), jnp.int32(_NO_LIMIT))
        out, n_out, accepted, plain = jax.device_get((state.out, state.n_out, state.accept, state.plain))
    decode = time.perf_counter() - start
    state.context.check()  # sized above to hold every sequence: an overflow would be a bug, never silent

    steps = [[int(a) for a in row if a > 0] for row in accepted]
    return GenerationResult(to_lists(out, n_out), steps, prefill, decode, [int(n) for n in plain], costs)


def _attach(target: Target, drafter: Drafter) -> Drafter:
    """The drafter with the target's embedding / LM head attached where it has none of its own."""
    own = drafter.params
    return drafter.attach(
        embed=target.embed if "embed_tokens" not in own and drafter.embed is None else None,
        lm_head=target.lm_head if "lm_head" not in own and drafter.lm_head is None else None,
    )

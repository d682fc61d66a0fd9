"""speculative_generate at temperature 0: lossless against the target's own greedy decoding, whatever the drafter
proposes (random drafters of each family, a drafter that is right nearly always) and however many drafts the
adaptive policy verifies (measured or given step costs, the fixed length), with stop tokens, budgets, confidence
cuts and batches of prompts of different lengths."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import Adaptive, AttentionOptions, StepCosts, load_drafter
from dflash_jax._qwen3_testing import QWEN3_TINY_CONFIGS, random_qwen3, successor_drafter, successor_target
from dflash_jax._shapes import round_up
from dflash_jax.bookkeeping import pad_prompts, stop_array
from dflash_jax.draft_policy import Policy, Settings
from dflash_jax.drafting import append_context, init_cache, propose
from dflash_jax.generate import (
    BUDGET_BUCKET,
    CACHE_BUCKET,
    GenerationResult,
    _attach,
    _one_of,
    _spec_decode,
    _spec_prefill,
    greedy_generate,
    speculative_generate,
)
from dflash_jax.sampling import Warp
from dflash_jax.target import PREFILL_CHUNK
from dflash_jax.target.dense import plan_decoder
from dflash_jax.testing import preset_dict, write_checkpoint

from . import _numpy_reference as ref
from ._io import leaf

MAX_NEW = 24
RNG = np.random.default_rng(7)
PROMPTS = [RNG.integers(0, 127, n).tolist() for n in (1, 2, 3, 5, 8, 13, 17, 21, 24, 24)]  # one prompt bucket
SUCCESSOR = np.random.default_rng(0).permutation(128)
NUDGE = 1.7  # the layers' scale of a target that leaves the successor map now and then (21 of 35 verifies whole)
# Step costs (lengths 0, 3, 7) given, so that the choices do not hang on a CPU's timings: a verify of 3 drafts costs
# 1.3 plain steps, of 7 a whole 2; with drafts rarely accepted, the policy soon turns to plain steps.
PLAIN_OFTEN = Adaptive(costs=StepCosts((0, 3, 7), (1.0, 1.3, 2.0), batch=len(PROMPTS), device="cpu"))


@pytest.fixture(scope="module")
def target():
    # seed 2: no prompt's greedy continuation meets the eos token (1) within MAX_NEW, so every budget is exact and the
    # NumPy reference, which knows no stop tokens, decodes as far
    return random_qwen3("tiny-qwen3", seed=2, dtype=jnp.float32)


@pytest.fixture(scope="module")
def greedy(target):
    return greedy_generate(target, PROMPTS, max_new_tokens=MAX_NEW)


def _drafter(tmp_path_factory, preset: str | dict, seed: int = 0):
    directory = tmp_path_factory.mktemp("drafter")
    write_checkpoint(directory, preset, seed=seed)
    return load_drafter(directory, dtype=jnp.float32)


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    """A DSpark drafter (Markov rank = vocab) whose rows walk SUCCESSOR, so it copies a successor target."""
    config = copy.deepcopy(preset_dict("tiny-dspark"))
    config["markov_rank"] = config["dspark_config"]["markov_rank"] = 128
    return successor_drafter(_drafter(tmp_path_factory, config), SUCCESSOR)


def test_greedy_equals_the_numpy_reference(target, greedy):
    """The baseline against an independent implementation: token for token what a float64 NumPy Qwen3 forward,
    run over the whole sequence per token, decodes greedily (tests/_numpy_reference.py `greedy`; the
    transformers comparison, tests/test_reference_transformers.py, needs torch). No program compiled here."""
    weights = {t.name: leaf(target.params, t.path) for t in plan_decoder(target.config)}
    for i in (0, 4, 9):  # 1, 5 and 24 prompt tokens
        assert ref.greedy(QWEN3_TINY_CONFIGS["tiny-qwen3"], weights, PROMPTS[i], MAX_NEW) == greedy.tokens[i], i


def test_greedy_baseline(target, greedy):
    """The baseline itself: a batch equals its prompts run one at a time, and the budget is exact. One prompt
    gives a batch of one (`GenerationResult` is always batched)."""
    assert isinstance(greedy, GenerationResult)
    assert [len(t) for t in greedy.tokens] == [MAX_NEW] * len(PROMPTS)
    for i in (0, 9):
        alone = greedy_generate(target, PROMPTS[i], max_new_tokens=MAX_NEW)
        assert alone.tokens == [greedy.tokens[i]] and alone.acceptance_lengths == [[]] and alone.plain_tokens == [0]


@pytest.mark.parametrize("preset,draft_length", [("tiny-dflash", "fixed"), ("tiny-dflash2", PLAIN_OFTEN),
                                                 ("tiny-dspark", "measured"), ("tiny-nemotron-dspark", None)])
def test_lossless_with_random_drafters(tmp_path_factory, target, greedy, preset, draft_length, quick_calibration):
    """Random drafters are nearly always wrong: every step is a rejection, and the output is still exactly the
    target's greedy continuation, for every prompt of the batch. (DSpark: the tests below, with a drafter that
    is right, wrong, or cut by its confidence head at varying points.) Every token is the prefill's, a verify's or
    a plain step's; under the adaptive policy some are plain steps (the policy's, with the costs given, dflash2;
    with DSpark the costs are measured in the run, in calls of 1 and 2 steps here so that 24 tokens hold them,
    plain steps included, and the policy then takes its own; the Nemotron drafter under the default, from the
    first step by the predicted costs)."""
    drafter = _drafter(tmp_path_factory, preset, seed=2)
    policy = Adaptive(calibration=quick_calibration) if draft_length == "measured" else draft_length
    result = speculative_generate(target, drafter, PROMPTS, max_new_tokens=MAX_NEW, draft_length=policy)
    assert result.tokens == greedy.tokens
    K = drafter.config.num_draft_tokens
    for steps, plain, tokens in zip(result.acceptance_lengths, result.plain_tokens, result.tokens):
        assert all(1 <= a <= K + 1 for a in steps)
        assert 1 + sum(steps) + plain >= len(tokens) == MAX_NEW  # the last step may be cut at the budget
        assert (plain > 0) == (draft_length != "fixed")


def test_accept_path_with_a_drafter_that_copies_the_target(target, oracle):
    """A target that (mostly) follows SUCCESSOR and a drafter that walks it: whole blocks are accepted, some
    steps are cut short where the context moves the target off the map, and the output is still lossless."""
    K = oracle.config.num_draft_tokens  # 7: DSpark drafts all B rows
    exact = successor_target(target, SUCCESSOR, layer_scale=0.5)
    result = speculative_generate(exact, oracle, PROMPTS, max_new_tokens=MAX_NEW, draft_length="fixed")
    expected = greedy_generate(exact, PROMPTS, max_new_tokens=MAX_NEW).tokens
    assert result.tokens == expected
    assert all(a == K + 1 for steps in result.acceptance_lengths for a in steps)
    assert result.mean_acceptance_length == K + 1
    # Verifying 7 drafts costs 100 times as much as verifying 3 here: from the first step on (where 7 drafts never
    # accepted would cost 100 steps' time: `adaptive.first_length`) the policy verifies 3 of them, all accepted, every
    # step. (No plain steps among its lengths: a branch less to compile.)
    three = Adaptive(draft_lengths=(3, 7), costs=StepCosts((3, 7), (1.0, 100.0), batch=len(PROMPTS), device="cpu"))
    result = speculative_generate(exact, oracle, PROMPTS, max_new_tokens=MAX_NEW, draft_length=three)
    assert result.tokens == expected
    assert {a for steps in result.acceptance_lengths for a in steps[:-1]} == {4}  # the last may end at the budget
    # The default (a fresh process's: the predicted costs from the first step) verifies every draft of a drafter
    # that is always right, and takes no plain step.
    result = speculative_generate(exact, oracle, PROMPTS, max_new_tokens=MAX_NEW)
    assert result.tokens == expected and result.plain_tokens == [0] * len(PROMPTS)
    assert {a for steps in result.acceptance_lengths for a in steps[:-1]} == {K + 1}
    # An int draft length verifies that many drafts every step, the first included, and takes no plain step.
    result = speculative_generate(exact, oracle, PROMPTS, max_new_tokens=MAX_NEW, draft_length=3)
    assert result.tokens == expected and result.plain_tokens == [0] * len(PROMPTS)
    assert {a for steps in result.acceptance_lengths for a in steps[:-1]} == {4}

    nudged = successor_target(target, SUCCESSOR, layer_scale=NUDGE)
    reference = greedy_generate(nudged, PROMPTS, max_new_tokens=MAX_NEW)
    result = speculative_generate(nudged, oracle, PROMPTS, max_new_tokens=MAX_NEW, draft_length="fixed")
    assert result.tokens == reference.tokens
    steps = [a for seq in result.acceptance_lengths for a in seq]
    assert steps.count(K + 1) >= len(steps) // 2 and min(steps) < K + 1
    assert result.mean_acceptance_length > 5

    # DSpark's confidence head (random here) cuts proposals: fewer drafts verified, still lossless.
    cut = speculative_generate(nudged, oracle, PROMPTS, max_new_tokens=MAX_NEW, confidence_threshold=0.5,
                               draft_length="fixed")
    assert cut.tokens == reference.tokens
    assert cut.mean_acceptance_length < result.mean_acceptance_length


def _stepper(target, drafter):
    """`(prefill(prompts), steps(state, force, n))` of the speculative loop under the adaptive policy of lengths
    (0, 3, 7), greedy, with the caches `speculative_generate` makes for PROMPTS (so the programs are shared; longer
    prompts fit them too): `steps` runs `n` decode steps of the length of index `force` (0: plain steps, their
    context rows appended to the drafter's cache at the end)."""
    stop, warp, threshold = stop_array(()), Warp(jnp.float32(1.0)), jnp.float32(0.0)
    policy, settings, seconds = Policy((0, 3, 7), True), Settings.of(Adaptive()), jnp.ones(3, jnp.float32)
    budget = round_up(MAX_NEW, BUDGET_BUCKET)
    capacity = round_up(pad_prompts(PROMPTS)[0].shape[1] + budget + drafter.config.num_draft_tokens + 1,
                        CACHE_BUCKET)

    def prefill(prompts):
        tokens, lengths = pad_prompts(prompts)
        caches = target.init_cache(len(prompts), capacity), init_cache(drafter, len(prompts), capacity)
        return _spec_prefill(target, drafter, *caches, tokens, lengths, stop, warp, jax.random.key(0),
                             jnp.int32(budget), capacity=budget, sampling=False, attention=AttentionOptions(),
                             prefill_chunk=PREFILL_CHUNK)

    def steps(state, force, n):
        return _spec_decode(target, drafter, state, stop, warp, threshold, jnp.int32(0), seconds, jnp.int32(force),
                            state.step + n, settings, sampling=False, attention=AttentionOptions(), policy=policy)

    return prefill, steps


def _copy(tree):
    return jax.tree.map(jnp.copy, tree)


def _assert_as_if_prefilled(prefill, drafter, state, prompts):
    """Each sequence's target KV cache and drafter context (its cache with the rows still pending appended) are
    what a fresh prefill of its committed tokens (prompt + output, less the pending anchor) gives, and so is the
    next drafting step's proposal (the pending rows absorbed by `propose`, as the loop's next step does)."""
    out, n_out = np.asarray(state.out), np.asarray(state.n_out)
    committed = [p + out[b, : n_out[b] - 1].tolist() for b, p in enumerate(prompts)]
    fresh = prefill(committed)
    lengths = [len(c) for c in committed]
    context = append_context(drafter, _copy(state.context), state.pending, state.num_pending)
    for got in (state.lengths, context.lengths, fresh.lengths, fresh.context.lengths):
        assert np.asarray(got).tolist() == lengths
    np.testing.assert_array_equal(np.asarray(state.anchor), out[np.arange(len(prompts)), n_out - 1])
    np.testing.assert_array_equal(np.asarray(fresh.anchor), np.asarray(state.anchor))
    pairs = zip(state.target_cache.k + state.target_cache.v + context.keys + context.values,
                fresh.target_cache.k + fresh.target_cache.v + fresh.context.keys + fresh.context.values)
    for a, b in pairs:  # per layer [batch, n_kv, T, d_h] (a ring layer's slots hold the same positions too)
        a, b = np.asarray(a), np.asarray(b)  # sliced on the host: a device slice compiles per (row, length)
        for row, n in enumerate(lengths):
            np.testing.assert_allclose(a[row, :, :n], b[row, :, :n], rtol=0, atol=1e-5)
    rows = drafter.config.num_draft_tokens + 1
    assert int(state.num_pending.max()) <= rows  # the next drafting step takes them all
    ours, _ = propose(drafter, _copy(state.context), state.pending[:, :rows], state.num_pending, state.anchor)
    theirs, _ = propose(drafter, fresh.context, jnp.zeros_like(state.pending[:, :rows]),
                        jnp.zeros_like(state.num_pending), fresh.anchor)
    np.testing.assert_array_equal(np.asarray(ours.tokens), np.asarray(theirs.tokens))


@pytest.fixture(scope="module", params=["oracle", "tiny-dflash", "tiny-dflash2"])
def family(request, tmp_path_factory, target, oracle):
    """A drafter of each family on the target it is paired with: DSpark's oracle on a target that leaves the
    successor map now and then (acceptances differ per sequence), random DFlash and DFlash2 drafters (a ring
    layer of 16 rows) on the random target."""
    if request.param == "oracle":
        nudged = successor_target(target, SUCCESSOR, layer_scale=NUDGE)
        return nudged, _attach(nudged, oracle)
    return target, _attach(target, _drafter(tmp_path_factory, request.param, seed=2))


def test_caches_hold_exactly_the_committed_tokens(family):
    """After a verify with partial acceptance, then plain steps past the pending rows' buffer (appended to the
    drafter's cache when it is full and when the plain run ends), then a verify of 3 drafts, the caches hold exactly
    the committed tokens of each sequence of a ragged batch: rejected drafts are trimmed away, no committed token
    is missing, every context row is at its position, and the next proposal is the one a fresh prefill gives. So
    waiting rows change nothing the drafter sees."""
    target, drafter = family
    prefill, steps = _stepper(target, drafter)
    state = steps(prefill(PROMPTS), 2, 1)  # all 7 drafts
    assert not state.done.any()
    _assert_as_if_prefilled(prefill, drafter, state, PROMPTS)  # the verify's rows pending
    n_out, rows = np.asarray(state.n_out), state.pending.shape[1]
    state = steps(state, 0, rows - 1)  # plain steps: the buffer fills on the way (a verify leaves at least a row)
    np.testing.assert_array_equal(np.asarray(state.plain), np.full(len(PROMPTS), rows - 1))
    np.testing.assert_array_equal(np.asarray(state.num_pending), np.zeros(len(PROMPTS)))
    state = steps(state, 1, 1)  # 3 drafts, drafted from the flushed context
    np.testing.assert_array_equal(np.asarray(state.accept[:, : rows + 1]) > 0,
                                  [[True] + [False] * (rows - 1) + [True]] * len(PROMPTS))
    assert (np.asarray(state.n_out) > n_out + rows - 1).all()
    _assert_as_if_prefilled(prefill, drafter, state, PROMPTS)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _WholeFeatures:
    """A target whose `prefill` takes no `project` (the protocol before `FeatureMap`): features returned whole."""

    inner: Any

    def __getattr__(self, name: str):
        if name == "inner":  # not set yet (copies, unflattening)
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __call__(self, *args, **kwargs):
        return self.inner(*args, **kwargs)

    def prefill(self, tokens, cache, lengths, *, layer_ids, chunk):
        return self.inner.prefill(tokens, cache, lengths, layer_ids=layer_ids, chunk=chunk)


def test_a_prefill_that_takes_no_feature_map_fills_the_same_context(tmp_path_factory, target):
    """The speculative prefill hands the target's `prefill` the drafter's context projection (so the prompts'
    features exist a step at a time); a target whose `prefill` takes none returns them whole and the loop projects
    them after: the same drafter context, row for row, and the same first token."""
    drafter = _attach(target, _drafter(tmp_path_factory, "tiny-dflash", seed=2))
    mapped, whole = (_stepper(t, drafter)[0](PROMPTS) for t in (target, _WholeFeatures(target)))
    np.testing.assert_array_equal(np.asarray(mapped.anchor), np.asarray(whole.anchor))
    lengths = [len(p) for p in PROMPTS]
    for a, b in zip(mapped.context.keys + mapped.context.values, whole.context.keys + whole.context.values):
        for row, n in enumerate(lengths):  # [batch, n_kv, T, d_h]
            np.testing.assert_allclose(np.asarray(a[row, :, :n]), np.asarray(b[row, :, :n]), rtol=0, atol=0)


def test_stop_tokens_and_batch_independence(target, greedy, oracle):
    """A sequence ends after its first stop token (kept); the others in the batch run to the budget."""
    stop = greedy.tokens[3][6]
    expected = []
    for tokens in greedy.tokens:
        expected.append(tokens[: tokens.index(stop) + 1] if stop in tokens else tokens)
    assert greedy_generate(target, PROMPTS, max_new_tokens=MAX_NEW, stop_token_ids=[stop]).tokens == expected
    result = speculative_generate(target, oracle, PROMPTS, max_new_tokens=MAX_NEW, stop_token_ids=[stop, 500])
    assert result.tokens == expected
    assert any(len(t) == MAX_NEW for t in result.tokens) and len(result.tokens[3]) <= 7


def test_result_figures(target, oracle):
    result = speculative_generate(target, oracle, PROMPTS, max_new_tokens=MAX_NEW)
    assert result.prefill_seconds > 0 and result.decode_seconds > 0
    assert result.num_tokens == MAX_NEW * len(PROMPTS)
    assert result.tokens_per_second > 0 and result.decode_tokens_per_second > 0
    steps = [a for seq in result.acceptance_lengths for a in seq]
    assert result.mean_acceptance_length == pytest.approx(np.mean(steps))
    with pytest.raises(ValueError, match="at least one token"):
        speculative_generate(target, oracle, [[1, 2], []], max_new_tokens=4)


LONG_PROMPTS = [RNG.integers(0, 127, n).tolist() for n in (150, 97)]  # past the DFlash2 window (8) and a chunk


@pytest.fixture(scope="module")
def long_greedy(target):
    return greedy_generate(target, LONG_PROMPTS, max_new_tokens=12)  # one prefill chunk: the other path than below


@pytest.mark.parametrize("preset,attention", [("tiny-dflash", AttentionOptions(draft_window=16, draft_sinks=4)),
                                              ("tiny-dflash2", AttentionOptions()),
                                              ("tiny-dspark", AttentionOptions())])
def test_long_prompts_are_lossless(tmp_path_factory, target, long_greedy, preset, attention):
    """Prompts several times the drafter's window and the prefill chunk (target prefill and the drafter's first
    append both in chunks of 32): exactly the target's greedy tokens, for every family; the DFlash run also
    bounds its full layers with the opt-in draft window, which changes drafts, never the greedy output. At the
    fixed draft length: a decode program a third the size (one length's branch, not three)."""
    result = speculative_generate(target, _drafter(tmp_path_factory, preset), LONG_PROMPTS, max_new_tokens=12,
                                  prefill_chunk=32, attention=attention, draft_length="fixed")
    assert result.tokens == long_greedy.tokens


def test_positions_past_the_models_are_refused_before_compiling(tmp_path_factory, target):
    """The tiny target declares 1024 positions: a prompt plus new tokens past them is a ValueError up front."""
    drafter = _drafter(tmp_path_factory, {**preset_dict("tiny-dflash"), "max_position_embeddings": 200})
    with pytest.raises(ValueError, match="target's max_position_embeddings=1024"):
        greedy_generate(target, [[1] * 1000], max_new_tokens=30)
    with pytest.raises(ValueError, match="drafter's max_position_embeddings=200"):
        speculative_generate(target, drafter, [[1] * 190], max_new_tokens=20)


def test_beyond_max_positions_runs_on():
    """`beyond_max_positions=True` runs past a target declaring 16 positions (RoPE continues): greedy decoding is
    the NumPy forward's. (`speculative_generate` shares the check, `bookkeeping.check_positions`.)"""
    raw = {**QWEN3_TINY_CONFIGS["tiny-qwen3"], "max_position_embeddings": 16}
    short = random_qwen3(raw, seed=1, dtype=jnp.float32)
    prompt = PROMPTS[5]  # 8 tokens, + 12 reaches position 20
    with pytest.raises(ValueError, match="max_position_embeddings=16"):
        greedy_generate(short, [prompt], max_new_tokens=12)
    plain = greedy_generate(short, [prompt], max_new_tokens=12, beyond_max_positions=True)
    weights = {t.name: leaf(short.params, t.path) for t in plan_decoder(short.config)}
    assert plain.tokens[0] == ref.greedy(raw, weights, prompt, 12)


@pytest.mark.parametrize("index", [0, 1, 2])
def test_one_of_takes_the_branch_and_updates_the_cache_in_place(index):
    """`_one_of` gives `lax.switch`'s result, and in a decode-like loop (each branch writes rows into a cache carried
    by a while loop, then reads it) the compiled program copies no cache-sized buffer, where `lax.switch`'s copies
    the cache (the copies a verify of the adaptive policy paid each step)."""
    cache = jnp.zeros((4096, 64), jnp.float32)
    queries = jnp.arange(8 * 64, dtype=jnp.float32).reshape(8, 64) / 512

    def write(rows: int):  # cache -> (cache with `rows` new rows at 0, a read of the updated cache)
        def branch(c):
            c = jax.lax.dynamic_update_slice(c, jnp.tanh(queries[:rows]), (0, 0))
            return c, (c @ queries[0]).max()
        return branch

    branches = [write(rows) for rows in (1, 2, 4)]
    blank = (jnp.zeros((), jnp.float32),)
    chex.assert_trees_all_equal(_one_of(jnp.int32(index), branches, cache, blank),
                                jax.lax.switch(index, branches, cache))

    def looped(select):
        def step(s):
            i, c, total = s
            c, v = select(i % 3, branches, c, blank)
            return i + 1, c, total + v
        return jax.jit(lambda c: jax.lax.while_loop(lambda s: s[0] < 10, step, (0, c, 0.0)), donate_argnums=0)

    def cache_copies(select) -> int:
        text = looped(select).lower(cache).compile().as_text()
        return sum(" copy(" in line and "f32[4096,64]" in line for line in text.splitlines())

    assert cache_copies(_one_of) == 0
    assert cache_copies(lambda i, branches, c, blank: jax.lax.switch(i, branches, c)) > 0

"""speculative_generate at temperature 0: lossless against the target's own greedy decoding, whatever the drafter
proposes (random drafters of each family, a drafter that is right nearly always), with stop tokens, budgets,
confidence cuts and batches of prompts of different lengths."""

from __future__ import annotations

import copy
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import AttentionOptions, Backoff, load_drafter
from dflash_jax._qwen3_testing import QWEN3_TINY_CONFIGS, random_qwen3, successor_drafter, successor_target
from dflash_jax.drafting import init_cache
from dflash_jax.generate import (
    GenerationResult,
    _attach,
    _backoff_schedule,
    _pad_prompts,
    _spec_prefill,
    _spec_step,
    _stop_array,
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
ALWAYS = Backoff(min_tokens=100.0, max_plain_steps=4)  # every verify falls short: plain runs of 1, 2, 4, 4, ...


@pytest.fixture(scope="module")
def target():
    return random_qwen3("tiny-qwen3", seed=1, dtype=jnp.float32)


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


@pytest.mark.parametrize("preset,backoff", [("tiny-dflash", None), ("tiny-dflash2", ALWAYS)])
def test_lossless_with_random_drafters(tmp_path_factory, target, greedy, preset, backoff):
    """Random drafters are nearly always wrong: every step is a rejection, and the output is still exactly the
    target's greedy continuation, for every prompt of the batch. (DSpark: the tests below, with a drafter that
    is right, wrong, or cut by its confidence head at varying points.) With a `Backoff` the loop turns to plain
    steps, and every token is the prefill's, a verify's or a plain step's."""
    drafter = _drafter(tmp_path_factory, preset, seed=2)
    result = speculative_generate(target, drafter, PROMPTS, max_new_tokens=MAX_NEW, backoff=backoff)
    assert result.tokens == greedy.tokens
    K = drafter.config.num_draft_tokens
    for steps, plain, tokens in zip(result.acceptance_lengths, result.plain_tokens, result.tokens):
        assert all(1 <= a <= K + 1 for a in steps)
        assert 1 + sum(steps) + plain >= len(tokens) == MAX_NEW  # the last step may be cut at the budget
        assert (plain > 0) == (backoff is not None)
    if backoff is not None:
        with pytest.raises(TypeError, match="backoff must be a dflash_jax.Backoff"):
            speculative_generate(target, drafter, PROMPTS, max_new_tokens=MAX_NEW, backoff=1.5)


def test_accept_path_with_a_drafter_that_copies_the_target(target, oracle):
    """A target that (mostly) follows SUCCESSOR and a drafter that walks it: whole blocks are accepted, some
    steps are cut short where the context moves the target off the map, and the output is still lossless."""
    K = oracle.config.num_draft_tokens  # 7: DSpark drafts all B rows
    exact = successor_target(target, SUCCESSOR, layer_scale=0.5)
    result = speculative_generate(exact, oracle, PROMPTS, max_new_tokens=MAX_NEW)
    assert result.tokens == greedy_generate(exact, PROMPTS, max_new_tokens=MAX_NEW).tokens
    assert all(a == K + 1 for steps in result.acceptance_lengths for a in steps)
    assert result.mean_acceptance_length == K + 1

    nudged = successor_target(target, SUCCESSOR, layer_scale=0.9)
    reference = greedy_generate(nudged, PROMPTS, max_new_tokens=MAX_NEW)
    result = speculative_generate(nudged, oracle, PROMPTS, max_new_tokens=MAX_NEW)
    assert result.tokens == reference.tokens
    steps = [a for seq in result.acceptance_lengths for a in seq]
    assert steps.count(K + 1) >= len(steps) // 2 and min(steps) < K + 1
    assert result.mean_acceptance_length > 5

    # DSpark's confidence head (random here) cuts proposals: fewer drafts verified, still lossless.
    cut = speculative_generate(nudged, oracle, PROMPTS, max_new_tokens=MAX_NEW, confidence_threshold=0.5)
    assert cut.tokens == reference.tokens
    assert cut.mean_acceptance_length < result.mean_acceptance_length


def _stepper(target, drafter):
    """`(prefill(prompts), step(state, backoff))` of the speculative loop, greedy, with 128-slot caches."""
    stop, temperature, threshold = _stop_array(None), Warp(jnp.float32(1.0)), jnp.float32(0.0)

    def prefill(prompts):
        tokens, lengths = _pad_prompts(prompts)
        caches = target.init_cache(len(prompts), 128), init_cache(drafter, len(prompts), 128)
        return _spec_prefill(target, drafter, *caches, tokens, lengths, stop, temperature, threshold,
                             jax.random.key(0), jnp.int32(MAX_NEW), capacity=MAX_NEW, sampling=False,
                             attention=AttentionOptions(), prefill_chunk=PREFILL_CHUNK)

    step = jax.jit(_spec_step, static_argnums=(6, 7, 8, 9))
    return prefill, lambda state, backoff: step(target, drafter, stop, temperature, threshold, 0, False,
                                                AttentionOptions(), backoff, False, state)


def _assert_as_if_prefilled(prefill, state, prompts):
    """Each sequence's target KV cache, drafter context and next proposal are what a fresh prefill of its committed
    tokens (prompt + output, less the pending anchor) gives."""
    out, n_out = np.asarray(state.out), np.asarray(state.n_out)
    committed = [p + out[b, : n_out[b] - 1].tolist() for b, p in enumerate(prompts)]
    fresh = prefill(committed)
    lengths = [len(c) for c in committed]
    for got in (state.lengths, state.context.lengths, fresh.lengths, fresh.context.lengths):
        assert np.asarray(got).tolist() == lengths
    np.testing.assert_array_equal(np.asarray(state.anchor), out[np.arange(len(prompts)), n_out - 1])
    np.testing.assert_array_equal(np.asarray(fresh.anchor), np.asarray(state.anchor))
    np.testing.assert_array_equal(np.asarray(fresh.proposal.tokens), np.asarray(state.proposal.tokens))
    pairs = zip(state.target_cache.k + state.target_cache.v + state.context.keys + state.context.values,
                fresh.target_cache.k + fresh.target_cache.v + fresh.context.keys + fresh.context.values)
    for a, b in pairs:  # per layer [batch, n_kv, T, d_h]
        for row, n in enumerate(lengths):
            np.testing.assert_allclose(np.asarray(a[row, :, :n]), np.asarray(b[row, :, :n]), rtol=0, atol=1e-5)


def test_caches_hold_exactly_the_committed_tokens(target, oracle):
    """After a step with partial acceptance, the caches hold exactly the committed tokens: rejected drafts are
    trimmed away, no accepted token is missing, and the next proposal is the same as after a fresh prefill."""
    nudged = successor_target(target, SUCCESSOR, layer_scale=0.9)
    prefill, step = _stepper(nudged, _attach(nudged, oracle))
    # One step: at most 1 + 8 tokens (no sequence reaches the budget), and the committed prompts stay in the
    # prompts' bucket, so the fresh prefill reuses the compiled prefill.
    state = step(prefill(PROMPTS), None)
    assert not state.done.any() and len(set(np.asarray(state.n_out).tolist())) > 1  # different acceptances
    _assert_as_if_prefilled(prefill, state, PROMPTS)


def test_plain_steps_keep_the_drafters_context(target, oracle):
    """`Backoff`: after a verify, a plain step and the drafting step that ends it, the caches and the proposal are
    again those of a fresh prefill: the plain step's features were appended, once, at the right positions."""
    nudged = successor_target(target, SUCCESSOR, layer_scale=0.9)
    prefill, step = _stepper(nudged, _attach(nudged, oracle))
    state = prefill(PROMPTS)
    verified = []
    for _ in range(2):
        verified.append(int(state.plain_left) == 0)
        state = step(state, ALWAYS)
    assert verified == [True, False] and int(state.plain_left) == 0  # verify, plain; the next step verifies
    np.testing.assert_array_equal(np.asarray(state.plain), np.ones(len(PROMPTS)))
    _assert_as_if_prefilled(prefill, state, PROMPTS)


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
    bounds its full layers with the opt-in draft window, which changes drafts, never the greedy output."""
    result = speculative_generate(target, _drafter(tmp_path_factory, preset), LONG_PROMPTS, max_new_tokens=12,
                                  prefill_chunk=32, attention=attention)
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
    the NumPy forward's. (`speculative_generate` shares the check, `_check_positions`.)"""
    raw = {**QWEN3_TINY_CONFIGS["tiny-qwen3"], "max_position_embeddings": 16}
    short = random_qwen3(raw, seed=1, dtype=jnp.float32)
    prompt = PROMPTS[5]  # 8 tokens, + 12 reaches position 20
    with pytest.raises(ValueError, match="max_position_embeddings=16"):
        greedy_generate(short, [prompt], max_new_tokens=12)
    plain = greedy_generate(short, [prompt], max_new_tokens=12, beyond_max_positions=True)
    weights = {t.name: leaf(short.params, t.path) for t in plan_decoder(short.config)}
    assert plain.tokens[0] == ref.greedy(raw, weights, prompt, 12)


# --- Backoff: plain target steps while drafts are rarely accepted ----------------------------------------------


def _schedule(backoff: Backoff, tokens_per_verify: list[int], K: int = 7) -> str:
    """The rule on one sequence that commits `tokens_per_verify[i]` at its i-th verify: 'v' verify, 'p' plain,
    up to the verify after the last."""
    s = types.SimpleNamespace(mean_tokens=jnp.float32(K + 1), plain_run=jnp.int32(0), plain_left=jnp.int32(0))
    kinds, verifies = "", iter(tokens_per_verify)
    while True:
        verified = int(s.plain_left) == 0
        committed = next(verifies, None) if verified else 1
        if committed is None:
            return kinds
        kinds += "v" if verified else "p"
        s.mean_tokens, s.plain_run, s.plain_left = _backoff_schedule(backoff, s, jnp.asarray([committed]),
                                                                     jnp.asarray([True]))


def test_the_backoff_schedule():
    """A running mean that halves the weight of older verifies (8 -> 4.5 -> 2.75 -> 1.88 -> 1.44): the fourth
    1-token verify takes it under 1.5; then plain runs double up to the maximum, and a good verify ends them."""
    backoff = Backoff(min_tokens=1.5, max_plain_steps=4)
    assert _schedule(backoff, [1] * 8) == "vvvv" + "pv" + "ppv" + "ppppv" + "ppppv" + "pppp"
    assert _schedule(backoff, [1] * 5 + [8, 8]) == "vvvv" + "pv" + "ppv" + "v"  # 8 lifts the mean to 4.6
    assert _schedule(backoff, [8] * 6) == "v" * 6
    assert _schedule(Backoff(min_tokens=1.0), [1] * 6) == "v" * 6  # a verify makes >= 1: never backs off


@pytest.mark.parametrize("bad", [dict(min_tokens=0.5), dict(min_tokens=float("nan")), dict(min_tokens=float("inf")),
                                 dict(max_plain_steps=0), dict(max_plain_steps=2.0)])
def test_bad_backoffs(bad):
    with pytest.raises(ValueError, match="Backoff"):
        Backoff(**bad)

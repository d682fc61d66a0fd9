"""The adaptive draft-length policy on its own (`dflash_jax.adaptive`): its choice is the length with the most
weighted progress per second under the cost model, checked against a NumPy reference that enumerates the acceptance
outcomes; its weights serve the sequences the batch waits for; its history, margin and
probing schedule; bad cost tables and settings; and, in the loop, step costs measured once per setup, with the
fixed length (and a warning) when they cannot be measured, and a drafter that is never right costing few probes.
Losslessness with the policy on: tests/test_generate*.py."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import Adaptive, Calibration, CostStore, StepCosts, greedy_generate, speculative_generate
from dflash_jax import generate as generate_module
from dflash_jax.adaptive import (
    History,
    Probing,
    choose_length,
    expected_tokens,
    first_length,
    probe_gaps,
    probe_payback,
    weights,
)
from dflash_jax.testing import random_drafter, random_qwen3, successor_drafter, successor_target

LENGTHS = (0, 3, 7, 16)


def _expected_by_enumeration(p: np.ndarray, length: int, remaining: int) -> float:
    """Sum over a = 0..length accepted drafts of P(a) * the tokens the step commits within the budget."""
    total = 0.0
    for a in range(length + 1):
        prob = np.prod(p[:a]) * (1.0 - p[a] if a < length else 1.0)
        total += prob * min(a + 1, remaining)
    return total


def _weights_by_enumeration(run_rate: np.ndarray, remaining: np.ndarray, live: np.ndarray, focus: float) -> np.ndarray:
    """(S_i / max S) ** focus over the live sequences, S_i = remaining_i / the tokens a K-draft step makes."""
    steps = np.array([r / _expected_by_enumeration(np.full(16, a), 16, r) for a, r in zip(run_rate, remaining)])
    return np.where(live, (steps / steps[live].max()) ** focus, 0.0)


def test_the_chosen_length_has_the_most_weighted_progress_per_second():
    rng = np.random.default_rng(0)
    choose = jax.jit(choose_length, static_argnames=("lengths", "drafted"))  # one program per `drafted`
    batch = 3
    for trial in range(30):
        p = rng.uniform(0, 1, (batch, 16)) ** rng.uniform(0.1, 3)  # from rarely to nearly always accepted
        run_rate = rng.uniform(0, 1, batch)
        seconds = np.sort(rng.uniform(1, 3, len(LENGTHS))) * rng.uniform(0.5, 2)  # longer verifies cost more
        remaining = rng.integers(1, 20, batch)
        live = rng.uniform(size=batch) < 0.8
        live[0] = True
        focus = rng.choice([0.0, 1.0, 8.0])
        tokens = np.array([[_expected_by_enumeration(p[i], n, remaining[i]) for n in LENGTHS] for i in range(batch)])
        np.testing.assert_allclose(np.asarray(expected_tokens(jnp.asarray(p), LENGTHS, jnp.asarray(remaining))),
                                   tokens, rtol=1e-5)
        w = _weights_by_enumeration(run_rate, remaining, live, focus)
        got_w = weights(jnp.asarray(run_rate, jnp.float32), 16, jnp.asarray(remaining), jnp.asarray(live), focus)
        np.testing.assert_allclose(np.asarray(got_w), w, rtol=1e-4, atol=1e-7)
        rate = (w[:, None] * tokens / remaining[:, None]).sum(0) / seconds
        margin = rng.choice([0.0, 0.1, 0.3])
        for drafted in (False, True):
            plain = -np.inf if drafted else rate[0] * (1 - margin)
            want = np.argmax(np.concatenate([[plain], rate[1:]]))
            got = choose(jnp.asarray(p, jnp.float32), LENGTHS, jnp.asarray(seconds, jnp.float32),
                         jnp.asarray(remaining), got_w, drafted=drafted, plain_margin=margin)
            assert int(got) == want, (trial, drafted, rate)


def test_the_choice_follows_acceptance_and_costs():
    """The extremes, by hand: drafts always accepted and a flat cost -> the longest; never accepted -> a plain
    step, or after drafting the cheapest verify; a sequence with one token left gains nothing from drafts."""
    seconds = jnp.asarray([1.0, 1.2, 1.4, 1.8])
    weight = jnp.ones(2)
    for p, remaining, drafted, want in [(1.0, 100, False, 3), (0.0, 100, False, 0), (0.0, 100, True, 1),
                                        (1.0, 1, False, 0), (1.0, 4, True, 1)]:
        got = choose_length(jnp.full((2, 16), p), LENGTHS, seconds, jnp.int32(remaining), weight, drafted=drafted)
        assert int(got) == want, (p, remaining, drafted)


def test_a_batch_waits_for_its_slowest_sequence():
    """With one sequence whose drafts are never accepted and one whose drafts always are (over the whole call so
    far), every step makes one token of the first, which sets when the batch ends: plain steps (the cheapest) are
    chosen, though verifies make far more tokens per second summed over the batch (focus 0, the objective this
    replaced, chooses the longest verify here). Once the slow sequence is done, or where the fast one is far further
    from its end, the fast one's tokens count and it drafts."""
    seconds = jnp.asarray([1.0, 1.2, 1.4, 1.8])
    p, run_rate = jnp.stack([jnp.zeros(16), jnp.ones(16)]), jnp.asarray([0.0, 1.0])

    def choice(remaining, live=(True, True), focus=8.0, drafted=False):
        remaining, live = jnp.asarray(remaining), jnp.asarray(live)
        return int(choose_length(p, LENGTHS, seconds, remaining, weights(run_rate, 16, remaining, live, focus),
                                 drafted=drafted))

    assert choice([100, 100]) == 0
    assert choice([100, 100], drafted=True) == 1  # drafted anyway: the cheapest verify
    assert choice([100, 100], focus=0.0) == 3
    assert choice([100, 100], live=(False, True)) == 3
    assert choice([2, 100]) == 3


def test_sequences_in_a_stretch_of_low_acceptance_do_not_hold_the_batch_back():
    """Equal acceptance over the call so far (equal weights), one sequence in a stretch of low acceptance and one in
    a stretch of high: the choice is the summed progress's (the longest verify here), not the plain steps that would
    suit the first alone; its acceptance will recover, and the batch will need the second's tokens then."""
    seconds = jnp.asarray([1.0, 1.4, 1.5, 1.8])
    p = jnp.stack([jnp.full(16, 0.1), jnp.full(16, 0.95)])
    remaining, live = jnp.asarray([100, 100]), jnp.ones(2, bool)
    w = weights(jnp.asarray([0.6, 0.6]), 16, remaining, live, 8.0)
    np.testing.assert_allclose(np.asarray(w), [1.0, 1.0])
    assert int(choose_length(p, LENGTHS, seconds, remaining, w, drafted=False)) == 3
    assert int(choose_length(p[:1], LENGTHS, seconds, remaining[:1], w[:1], drafted=False)) == 0


def test_the_history():
    """hits / tries / predicted and the call's totals after verifies, against the sums by hand; a sequence that
    verified nothing (a DSpark cut) or has finished keeps its evidence as it was."""
    h = History.empty(2)
    confidence = jnp.asarray([[0.9, 0.8, 0.7, 0.6], [0.5, 0.5, 0.5, 0.5]])
    live = jnp.asarray([True, True])
    h = h.update(jnp.asarray([3, 3]), jnp.asarray([3, 1]), confidence, live, 0.5)  # all 3; 1 then a miss
    np.testing.assert_allclose(np.asarray(h.hits), [3, 1])
    np.testing.assert_allclose(np.asarray(h.tries), [3, 2])
    np.testing.assert_allclose(np.asarray(h.predicted), [2.4, 1.0], rtol=1e-6)
    h = h.update(jnp.asarray([0, 2]), jnp.asarray([0, 2]), confidence, jnp.asarray([True, False]), 0.5)
    np.testing.assert_allclose(np.asarray(h.tries), [3, 2])  # nothing verified; finished
    h = h.update(jnp.asarray([4, 2]), jnp.asarray([0, 2]), confidence, live, 0.5)  # a miss at once; both accepted
    np.testing.assert_allclose(np.asarray(h.hits), [1.5, 2.5])
    np.testing.assert_allclose(np.asarray(h.tries), [2.5, 3])
    np.testing.assert_allclose(np.asarray(h.rate(0.5)), [2 / 3.5, 3 / 4], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(h.scale(0.5)), [2 / (1.2 + 0.9 + 0.5), 3 / (0.5 + 1 + 0.5)], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(h.run_hits), [3, 3])  # over the call: nothing forgotten
    np.testing.assert_allclose(np.asarray(h.run_tries), [4, 4])
    np.testing.assert_allclose(np.asarray(h.run_rate(0.5)), [3.5 / 5, 3.5 / 5], rtol=1e-6)


def test_the_margin_counts_the_accepted_drafts_on_record():
    """`Adaptive.margin` in proportion to the running sequences' accepted drafts, in full from one: none for a
    drafter that has not been right (a finished sequence's record does not count)."""
    live = jnp.asarray([True, True, False])
    for hits, want in [([0, 0, 5], 0.0), ([0.3, 0.2, 5], 0.05), ([3, 0, 0], 0.1), ([0.6, 0.6, 0], 0.1)]:
        h = History(jnp.asarray(hits, jnp.float32), *[jnp.full(3, 10.0)] * 4)
        assert float(h.margin(0.1, live)) == pytest.approx(want), hits


def test_probes_space_out_geometrically():
    """After a run of verifies the first probe comes after `c` plain steps (at least 1) if the drafter has been
    right (accepted drafts on record), else after `c / early_share` (`probe_gaps`, c: a probe's extra cost); each
    probe that finds drafting still not paying doubles the gap, up to the longest (`c / share`); a probe that finds
    the drafter right keeps the gap, and the end of the run of verifies it starts resets it. A probe is not taken
    where less is left to win back than its gap (`probe_payback`: the tokens left at the best saving of full
    acceptance)."""
    gaps = probe_gaps(jnp.asarray([1.0, 1.25, 1.5]), 0.005, 0.02)  # a probe costs 0.25 plain steps
    assert tuple(map(int, gaps)) == (1, 13, 50)
    assert tuple(map(int, probe_gaps(jnp.asarray([1.0, 3.5]), 0.005, 0.02))) == (3, 125, 500)
    assert tuple(map(int, probe_gaps(jnp.asarray([1.0, 0.9]), 0.005, 0.02))) == (1, 1, 1)  # cheaper than plain steps
    left = jnp.float32(1000)
    for right, want in [(True, [1, 2, 4, 8, 16, 32, 50, 50]), (False, [13, 26, 50, 50, 50, 50, 50, 50])]:
        p = Probing.start().after_verify(jnp.bool_(True), gaps, jnp.bool_(right))  # a run of verifies ends
        spaced = []
        for _ in range(8):
            plain = 0
            while not bool(p.due(left)):
                p, plain = p.after_plain(), plain + 1
            spaced.append(plain)
            p = p.after_verify(jnp.bool_(True), gaps, jnp.bool_(right))  # the probe fails
        assert spaced == want, right
    p = p.after_plain()
    p = p.after_verify(jnp.bool_(False), gaps, jnp.bool_(True))  # a probe finds the drafter right: drafting goes on
    assert int(p.gap) == 50 and int(p.idle) == 0
    assert int(p.after_verify(jnp.bool_(True), gaps, jnp.bool_(True)).gap) == 1  # until a verify ends the run
    due = Probing(jnp.int32(13), jnp.int32(13))
    assert bool(due.due(jnp.float32(13))) and not bool(due.due(jnp.float32(12.5)))
    # at best (full acceptance) 7 drafts make 8 tokens in 1.5 plain steps' time (3: 4 in 1.25): 13/16 of each saved
    seconds = jnp.asarray([1.0, 1.25, 1.5])
    assert float(probe_payback(seconds, (0, 3, 7), jnp.int32(16))) == pytest.approx(16 * (1 - 1.5 / 8))
    assert float(probe_payback(jnp.asarray([1.0, 9.0]), (0, 7), jnp.int32(100))) == 0.0  # never pays: no probe


@pytest.mark.parametrize("seconds,left,want", [
    ((1.0, 1.25, 1.3, 1.4), 31, 3),  # dense 8B (H100): 16 drafts cost 0.4 plain steps more, and end 31 in 2 steps
    ((1.0, 1.25, 1.3, 1.4), 127, 2),  # 7 drafts then 16s end 127 in as many steps, and cost less if never right
    ((1.0, 3.76, 4.29, 5.3), 31, 3),  # MoE hybrid, batch 1: 16 (never right: 0.88 of greedy; 3 drafts: 0.74 of fixed)
    ((1.0, 4.0, 6.0, 9.8), 31, 1),  # MoE hybrid, batch 8: 16 never right costs 0.78 of greedy, 3 drafts 0.83 of fixed
    ((1.0, 1.25, 1.3, 1.4), 1, 1),  # one token left: the cheapest verify
])
def test_the_first_verify_has_the_best_worse_case(seconds, left, want):
    """The first step, knowing nothing of the drafter, verifies the length whose worse case of never accepted (over
    greedy) and always accepted (over the fixed length) is best (`first_length`)."""
    assert int(first_length(jnp.asarray(seconds), LENGTHS, jnp.int32(left))) == want


@pytest.mark.parametrize("seconds", [(1.0, 1.25, 1.3, 1.45), (1.0, 1.4, 1.45, 1.55)])  # H200, 2k / 32k contexts
def test_a_probe_that_finds_the_drafter_right_turns_to_drafting(seconds):
    """The evidence of failed probes accumulates (ten of them: the memory's worth), yet one probe whose 3 drafts
    are all accepted turns the batch back to drafting (the accepted drafts bring the margin), where one more failed
    probe does not."""
    h, k = History.empty(1), jnp.ones((1, 16))
    live = jnp.ones(1, bool)
    for _ in range(20):
        h = h.update(jnp.asarray([3]), jnp.asarray([0]), k, live, 0.9)

    def plan(h):
        p = jnp.broadcast_to(h.rate(0.5)[:, None], (1, 16))
        return int(choose_length(p, LENGTHS, jnp.asarray(seconds), jnp.int32(100), jnp.ones(1), drafted=False,
                                 plain_margin=h.margin(0.1, live)))

    assert plan(h.update(jnp.asarray([3]), jnp.asarray([0]), k, live, 0.9)) == 0
    assert plan(h.update(jnp.asarray([3]), jnp.asarray([3]), k, live, 0.9)) > 0


@pytest.mark.parametrize("fields,says", [
    (dict(seconds=(1.0, -1.0)), r"StepCosts.seconds\[1\] = -1.0: each must be a finite number of seconds > 0"),
    (dict(seconds=(1.0, float("nan"))), r"StepCosts.seconds\[1\] = nan"),
    (dict(seconds=(1.0, 0.0)), r"StepCosts.seconds\[1\] = 0.0"),
    (dict(seconds=(1.0,)), "StepCosts.seconds must hold one time per draft length"),
    (dict(draft_lengths=(3, 3)), "StepCosts.draft_lengths must be strictly increasing"),
    (dict(draft_lengths=(0,), seconds=(1.0,)), "strictly increasing with one > 0"),
    (dict(draft_lengths=(-1, 3)), "StepCosts.draft_lengths must hold ints >= 0"),
    (dict(batch=0), "StepCosts.batch must be an int >= 1"),
    (dict(device=""), "StepCosts.device must be a device kind"),
])
def test_bad_cost_tables_are_refused(fields, says):
    with pytest.raises(ValueError, match=says):
        StepCosts(**{**dict(draft_lengths=(0, 3), seconds=(1.0, 1.5), batch=1, device="cpu"), **fields})


@pytest.mark.parametrize("fields,error,says", [
    (dict(memory=1.0), ValueError, r"Adaptive.memory must be a number in \(0, 1\)"),
    (dict(probe_share=float("nan")), ValueError, "Adaptive.probe_share"),
    (dict(probe_share=0.0), ValueError, r"Adaptive.probe_share must be a number in \(0, 1\)"),
    (dict(prior=0.0), ValueError, "Adaptive.prior"),
    (dict(margin=-0.1), ValueError, r"Adaptive.margin must be a number in \[0, 1\)"),
    (dict(focus=-1.0), ValueError, r"Adaptive.focus must be a number in \[0, 64\]"),
    (dict(focus=float("inf")), ValueError, "Adaptive.focus"),
    (dict(draft_lengths="037"), ValueError, "Adaptive.draft_lengths must be a non-empty sequence"),
    (dict(costs=(1.0, 2.0)), TypeError, "Adaptive.costs must be a dflash_jax.StepCosts"),
    (dict(draft_lengths=(0, 7), costs=StepCosts((0, 3), (1.0, 1.5), 1, "cpu")), ValueError,
     r"costs are for draft lengths \(0, 3\), the policy has \(0, 7\)"),
])
def test_bad_settings_are_refused(fields, error, says):
    with pytest.raises(error, match=says):
        Adaptive(**fields)


@pytest.fixture(scope="module")
def models():
    # seed 4: on the prompts below the target meets no eos within 64 tokens and the drafter is never accepted
    return random_qwen3("tiny-qwen3", seed=4, dtype=jnp.float32), random_drafter("tiny-dflash", dtype=jnp.float32)


def test_costs_for_another_setup_are_refused(models):
    target, drafter = models
    for costs, says in [(StepCosts((0, 7), (1.0, 2.0), 2, "cpu"), r"StepCosts.batch = 2 does not fit this run"),
                        (StepCosts((0, 7), (1.0, 2.0), 1, "NVIDIA H200"), "StepCosts.device = 'NVIDIA H200'"),
                        (StepCosts((0, 9), (1.0, 2.0), 1, "cpu"), r"draft_lengths \(0, 9\) go past the drafter's "
                                                                  "7 drafts")]:
        with pytest.raises(ValueError, match=says):
            speculative_generate(target, drafter, [1, 2], max_new_tokens=8, draft_length=Adaptive(costs=costs))


def test_costs_are_measured_once_per_setup_and_fall_back_to_the_predicted_costs(models):
    """A first run long enough (here `share` lets any run measure) measures the step costs on its own steps (their
    tokens are the output's), keeps them in the policy's calibration and reports them
    (`GenerationResult.step_costs`); a second run of the same policy and setup reuses them (its clock never read),
    and so does a run given them (as another process would be), measuring nothing; `reset()` forgets them. A clock
    that does not move gives no usable costs: a warning, and the predicted costs from there on, with the same
    tokens. A run whose measurement would cost more than `share` of it measures nothing: its clock is never read."""
    target, drafter = models
    prompts, steps = [[5, 17, 99], [4]], 2
    expected = greedy_generate(target, prompts, max_new_tokens=40).tokens
    reads = []

    def clock() -> float:
        reads.append(1)
        return time.perf_counter()

    calibration = Calibration(steps=steps, clock=clock, share=10.0)  # the mechanism, in few of the 40 tokens
    policy = Adaptive(draft_lengths=(0, 7), calibration=calibration)
    result = speculative_generate(target, drafter, prompts, max_new_tokens=40, draft_length=policy)
    assert result.tokens == expected
    (costs,) = calibration.measured.values()
    assert costs.draft_lengths == (0, 7) and costs.batch == 2 and costs.device == "cpu"
    assert all(t > 0 for t in costs.seconds) and result.step_costs is costs

    reads.clear()
    again = speculative_generate(target, drafter, prompts, max_new_tokens=40, draft_length=policy)
    assert again.tokens == expected and again.step_costs is costs
    assert reads == [] and len(calibration.measured) == 1
    fresh = Calibration(clock=clock)  # a fresh process, given what the first one measured
    given = speculative_generate(target, drafter, prompts, max_new_tokens=40, draft_length=Adaptive(
        draft_lengths=(0, 7), costs=result.step_costs, calibration=fresh))
    assert given.tokens == expected and given.step_costs == costs and reads == [] and fresh.measured == {}
    fixed = speculative_generate(target, drafter, prompts, max_new_tokens=40, draft_length="fixed")
    assert fixed.step_costs is None and greedy_generate(target, prompts, max_new_tokens=40).step_costs is None
    calibration.reset()
    assert calibration.measured == {} and calibration.unfinished == {}

    stuck_calibration = Calibration(steps=steps, clock=lambda: 0.0, share=10.0)
    with pytest.warns(RuntimeWarning, match="step costs could not be measured.*choosing by the predicted costs"):
        stuck = speculative_generate(target, drafter, prompts, max_new_tokens=40, draft_length=Adaptive(
            draft_lengths=(0, 7), calibration=stuck_calibration))
    assert stuck.tokens == expected and stuck_calibration.measured == {}
    assert stuck.step_costs is not None and stuck.step_costs.seconds[1] > stuck.step_costs.seconds[0]  # predicted
    reads.clear()
    unmeasured = Calibration(steps=steps, clock=clock)  # the default share: 40 tokens are too few to measure in
    short = speculative_generate(target, drafter, prompts, max_new_tokens=40, draft_length=Adaptive(
        draft_lengths=(0, 7), calibration=unmeasured))
    assert short.tokens == expected and reads == [] and unmeasured.unfinished == {}
    assert short.step_costs == stuck.step_costs


def test_a_calibration_times_only_calls_the_run_surely_lasts_and_goes_on_in_the_next_run(models):
    """A timed call of n steps starts only where the decode lasts n steps even if every draft is accepted (7 drafts: 8
    tokens a step), so a run too short for the next one forces no more steps: it decodes the rest by the predicted
    costs and keeps its progress, and a longer run of the setup measures only the rest, then adapts. Here n = 2 and
    2n = 4 steps, twice each; the drafter is never accepted (one token a step). A run of 20 tokens (19 after the
    prefill's) has 3 sure steps of 7 drafts: the untimed one and one call of 2; then 16 tokens are 2 sure steps, too few
    for 4, so it stops there, no plain step forced. A run of 40 tokens measures the other three calls at 7 drafts,
    then plain steps (1 untimed + 12). The kept time of the first run is set to -1 s before the second: it is that
    time, not a new measurement, that the costs are made of, and it makes 7 drafts look half a second dearer than a
    plain step, so that the policy takes plain steps for certain once it has the costs. Meanwhile (the first run's
    rest) the policy chooses by the predicted costs."""
    target, drafter = models
    calibration = Calibration(steps=2, repeats=2, share=10.0)
    policy, prompts = Adaptive(draft_lengths=(0, 7), calibration=calibration), [[5, 17, 99], [4]]
    first = speculative_generate(target, drafter, prompts, max_new_tokens=20, draft_length=policy)
    assert first.tokens == greedy_generate(target, prompts, max_new_tokens=20).tokens
    assert calibration.measured == {} and first.step_costs is not None  # the predicted costs
    (progress,) = calibration.unfinished.values()
    assert progress.warmed == {1} and list(progress.seconds) == [(1, 2)] and len(progress.seconds[1, 2]) == 1
    progress.seconds[1, 2] = [-1.0]
    second = speculative_generate(target, drafter, prompts, max_new_tokens=40, draft_length=policy)
    assert second.tokens == greedy_generate(target, prompts, max_new_tokens=40).tokens
    assert progress.warmed == {0, 1} and progress.seconds == {}
    assert second.step_costs is not None and second.step_costs.seconds[1] > 0.5
    assert second.plain_tokens[0] > 13  # the plain steps measured (13), then the policy's own


def test_a_key_reproduces_its_sampled_tokens_by_default():
    """At temperature > 0 the default draft length is the fixed one, whatever step times the run measures: the
    tokens a key draws depend on the verify lengths, so a default that adapted to a clock would not reproduce them.
    The default measures nothing (no step costs, no plain step), and its tokens are those of `draft_length="fixed"`,
    while an adaptive policy given costs that make it choose plain steps draws others."""
    target = random_qwen3("tiny-qwen3", dtype=jnp.float32)
    drafter = random_drafter("tiny-dflash", dtype=jnp.float32)

    def run(**kw):
        return speculative_generate(target, drafter, [[5, 17, 99]], max_new_tokens=10, temperature=1.0,
                                    key=jax.random.key(3), stop_token_ids=(), **kw)

    default, fixed = run(), run(draft_length="fixed")
    assert default.tokens == fixed.tokens and default.plain_tokens == [0] and default.step_costs is None
    K = drafter.config.num_draft_tokens  # two lengths, plain steps and every draft: a branch less to compile
    adapted = run(draft_length=Adaptive(draft_lengths=(0, K), costs=StepCosts((0, K), (0.1, 1.0), 1, "cpu")))
    assert adapted.plain_tokens[0] > 0


def test_a_drafter_never_right_leaves_drafting_even_where_probes_are_cheap(models):
    """A random drafter that is never right (on these prompts: no draft accepted at the fixed length either) where
    a verify of 7 drafts costs 1.1 plain steps: the policy turns to plain steps once the prior's optimism is spent
    (no margin: no draft was ever accepted), then probes after 6 and 12 plain steps (a probe costs 0.1 plain steps,
    1.1 / 1.0 - 1 in float32 a hair more; a drafter never right starts at the first gap, where probes may take 2%
    of the plain steps' time: 6, and doubles up to 21, 0.5%), and no third: the 16 tokens left after 21 more plain
    steps could not repay it. 64 tokens: the prefill's, the first verify, five more while the prior fades, two
    probes, 55 plain steps. (A policy whose margin held every verify never left: 63 verifies.) The output is the
    target's."""
    target, drafter = models
    prompts = [[5, 17, 99], [90, 91, 92]]
    cheap = Adaptive(draft_lengths=(0, 7), costs=StepCosts((0, 7), (1.0, 1.1), 2, "cpu"))
    result = speculative_generate(target, drafter, prompts, max_new_tokens=64, draft_length=cheap)
    assert result.tokens == greedy_generate(target, prompts, max_new_tokens=64).tokens
    assert result.acceptance_lengths == [[1] * 8, [1] * 8]
    assert result.plain_tokens == [55, 55]


def test_in_the_loop_a_never_accepted_sequence_holds_the_batch_to_plain_steps():
    """The weights inside the decode loop (greedy, costs given): a successor target, and a DSpark drafter walking a
    map that agrees with it along sequence 1's continuation and nowhere along sequence 0's. Sequence 0 will need a
    step per token whatever is verified, so once the first verify has shown it, the default focus takes plain steps
    for both (the cheapest), verifying only to probe; the summed tokens per second (focus 0) keeps verifying for
    sequence 1 until it is done, and the batch takes as many steps. Both outputs are the target's greedy tokens."""
    V, span = 128, 48
    order = np.random.default_rng(0).permutation(V)
    successor = np.empty(V, np.int64)
    successor[order] = np.roll(order, -1)  # one cycle through the vocabulary
    drafted = successor.copy()
    wrong = order[:span]  # sequence 0 walks order[0 ..], sequence 1 order[64 ..]
    drafted[wrong] = successor[np.roll(wrong, -1)]
    target = successor_target(random_qwen3("tiny-qwen3", seed=1, dtype=jnp.float32), successor)
    base = random_drafter("tiny-dspark", dtype=jnp.float32).attach(embed=target.embed, lm_head=target.lm_head)
    drafter = successor_drafter(base, drafted)
    prompts = [[5, 9, int(order[0])], [7, 3, int(order[64])]]
    K = drafter.config.num_draft_tokens
    lengths = Adaptive().lengths(K)
    costs = StepCosts(lengths, (1.0, 1.6, 1.8)[:len(lengths)], 2, "cpu")
    expected = greedy_generate(target, prompts, max_new_tokens=32, stop_token_ids=()).tokens  # the walk passes eos
    runs, programs = {}, []
    for focus in (8.0, 0.0):
        runs[focus] = speculative_generate(target, drafter, prompts, max_new_tokens=32, stop_token_ids=(),
                                           draft_length=Adaptive(costs=costs, focus=focus))
        programs.append(generate_module._spec_decode._cache_size())
    assert programs[1] == programs[0]  # another setting runs the same program (the settings are traced)
    assert all(r.tokens == expected for r in runs.values())
    assert all(set(r.acceptance_lengths[0]) == {1} for r in runs.values())  # sequence 0's drafts never accepted
    weighted, summed = runs[8.0], runs[0.0]
    assert summed.plain_tokens[1] == 0 and set(summed.acceptance_lengths[1]) == {K + 1}  # never waits for 0
    assert weighted.plain_tokens[1] > 0  # held to plain steps with sequence 0
    # sequence 0 sets the batch's end: one step per token either way
    steps = [len(r.acceptance_lengths[0]) + r.plain_tokens[0] for r in (weighted, summed)]
    assert steps == [31, 31]


def test_costs_kept_in_a_store_spare_the_next_process_its_measurement(models, tmp_path):
    """A run that finishes its measurement keeps the costs in a `CostStore`; a new policy reading that store (as the
    next process would) decodes with them from its first step: its clock is never read, and the tokens are greedy's."""
    target, drafter = models
    prompts = [[5, 17, 99], [4]]
    first = speculative_generate(target, drafter, prompts, max_new_tokens=40, draft_length=Adaptive(
        draft_lengths=(0, 7), calibration=Calibration(steps=1, repeats=1, share=10.0, store=CostStore(tmp_path))))
    assert first.step_costs is not None and len(list(tmp_path.glob("*.json"))) == 1

    def unread() -> float:
        raise AssertionError("measured again: the stored costs were not used")

    policy = Adaptive(draft_lengths=(0, 7), calibration=Calibration(clock=unread, store=CostStore(tmp_path)))
    second = speculative_generate(target, drafter, prompts, max_new_tokens=12, draft_length=policy)
    assert second.step_costs == first.step_costs
    assert second.tokens == greedy_generate(target, prompts, max_new_tokens=12).tokens

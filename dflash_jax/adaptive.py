"""Adaptive draft length: per step, how many drafts to verify, from a cost model and the expected acceptance.

A speculative step that verifies `l` drafts commits `E_i(l)` tokens of sequence i in expectation and costs
`seconds(l)`: the drafting step that makes the proposal plus the target on `l + 1` rows (`l = 0`: a plain target
step, one token, no drafting). The policy picks, from a few static lengths (so that the loop compiles once), the one
with the most progress per second, each sequence's progress counted as the share of its remaining budget `R_i` the
step makes and weighted by how likely the sequence is to be the one the batch waits for:

    rate(l) = sum over running i of w_i * E_i(l) / R_i / seconds(l),   E_i(l) = sum_{j=0..l} prod_{k<=j} p_ik
    w_i = (S_i / max_j S_j) ** Adaptive.focus,   S_i = R_i / E_i(K) at the sequence's long-run acceptance

where `p_ik` is the probability that draft k of sequence i is accepted given drafts 1..k-1 were (`p_i0 = 1`: the
bonus token), `E_i(l)` counts only tokens within the budget, and `S_i` is the steps sequence i still needs at the
longest length, from its acceptance over the whole call so far (`History.run_rate`). The sequences of a batch run
in lockstep, one verify shape per step, and the call returns when the last one is done: tokens of a sequence that
will finish well before the others do not bring the end nearer, so they count for little (focus 8: a sequence
expected to need 10% fewer steps than the slowest counts 43%, 20% fewer 17%, half 0.4%). Two objectives this
replaces fail where the other succeeds (benchmarks/adaptive_model.py, docs/benchmarks.md): the batch's summed
tokens per second (focus 0: what an engine that refills finished slots maximises) kept a batch with never-accepted
sequences verifying every step, each dearer than a plain one, while those sequences still needed a step per token;
the time to finish if the current acceptance held (a max over the sequences' current estimates) took plain steps
for the whole batch whenever one sequence was in a stretch of low acceptance, though its acceptance would recover
and the others' progress would be needed then. The long-run weights tell the two cases apart. For one sequence the
weight is 1 and the choice is the most expected tokens per second.

Where `p_ik` comes from (`History`, per sequence, running means that forget old verifies):
- before drafting (whether to draft at all): only the history is known, so `p_ik = alpha_i`, the sequence's
  observed acceptance per tried draft position (accepted drafts / positions tried; a geometric model), with a
  prior of one pseudo-trial at `Adaptive.prior`. Only verifies change it (each keeps `Adaptive.memory` of the
  old evidence): plain steps leave it as it is, and when to measure again is the probing schedule's (below).
- after drafting, at temperature 0: the drafter's own per-draft confidence `c_ik` (DSpark's confidence head, or
  the drafter's probability of its draft, `Proposal.draft_prob`) times a per-sequence calibration `s_i` =
  accepted drafts / predicted (the sum of `c` over the tried positions), so that a confident but wrong drafter
  is discounted and an uninformative confidence reduces to the history.
- after drafting, at T > 0: the history only. A length chosen from the drafts' confidences would bias the output:
  the rejection rule is exact only when the decision to verify draft k does not depend on draft k itself, and
  the confidences of later drafts do (they see draft k as their predecessor). A length chosen before drafting
  (and the DSpark cut, which stops at the first low confidence: draft k's depends on drafts before k only) keeps
  the target's distribution.

Probing (`Probing`): on plain steps the policy no longer sees the drafter, and re-measuring it costs: a probe (a
drafting step and the shortest verify `l_1`) that finds the drafts still rejected commits the one token a plain
step would, in `seconds(l_1)` instead of `seconds(0)`, so it costs `c = seconds(l_1) / seconds(0) - 1` plain
steps. The value of re-measuring is the drafter found again sooner, likeliest soon after it was last right. So
the batch probes after `gap` plain steps, `gap` starting at 1 when a run of verifies ends and doubling after each
probe that finds drafting still not paying, up to `G = c / Adaptive.probe_share`, where probes cost that share
(0.5%) of the plain steps' time. A drafter that is never right then costs about `log2(G) + N / G` probes in `N`
plain steps, and one that becomes right again is measured within `G` plain steps. The evidence of failed probes
accumulates (it is not faded on plain steps), so one failed probe is enough to return to plain steps. A short
first gap is for a drafter that has been right (accepted drafts on record): `c` plain steps (1 where probes cost
less than a plain step), so that a probe costs at most the plain steps before it. One that has not been right has
no moment when a change is likeliest, and its gaps start at `c / Adaptive.early_probe_share` (2%: a probe costing
2 plain steps waits 100, where gaps from 1 spent 7 probes, 14 plain steps' time, in a 128-token run). And a probe
is taken only where the most it could win back, the tokens left at the best saving of a drafter always right
(`probe_payback`: nothing where even full acceptance would not beat plain steps), is at least the gap: a probe that
cannot repay its cost before the budget ends is not worth taking (`probe_gaps`, `Probing.due`).

The first step (`first_length`): nothing is known of the drafter, and the verify length must serve both extremes
in a short run: a never-accepted drafter loses `seconds(l) / seconds(0) - 1` plain steps on it, and an
always-accepted one needs more steps than the fixed length's if it verifies fewer than K drafts (31 tokens are two
17-token steps). The length taken is the one whose worse ratio (to greedy's speed if never accepted, to the fixed
length's if always) is best: K where verifies are cheap (dense targets), shorter where a K-draft verify costs many
plain steps (a MoE target at batch 8).

Stopping drafting costs the policy its view of the drafter until the next probe, so a sequence that verified
drafts at its last step turns to plain steps only when their rate beats drafting's by `Adaptive.margin` (10%),
counted in proportion to the accepted drafts on record (in full from one on, over the running sequences): near
the break-even point the two differ little in speed, and a drafter that starts to be right again is seen at
once; a drafter with no accepted draft on record has nothing to keep, and leaves at once (otherwise the prior's
floor on `alpha` would keep a never-accepted drafter verifying wherever probes are cheap).

Once a proposal is drafted, the policy verifies at least the shortest nonzero length: the drafting is paid for, a
few more target rows cost little, and a verify is what updates the history (a policy that drafted and then verified
nothing would learn nothing and draft again).

Costs (`StepCosts`): seconds of a whole decode step at each length for this target, drafter, batch, cache and
device: given by the user; else measured earlier and kept by the policy's `Calibration` (or its `CostStore`);
else predicted before the first step from what a step reads and computes at the device's rates
(`step_cost_model`: only their ratios matter to the choice), and measured on the run (a few real decode steps at
each length, timed; their tokens are part of the output) where the measurement's forced steps cost at most
`Calibration.share` (2%) of the run (`Calibration.worth`): runs of a few hundred tokens choose by the prediction
throughout, from the first step.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Protocol

import jax
import jax.numpy as jnp

__all__ = ["Adaptive", "StepCosts", "History", "Probing", "DEFAULT_LENGTHS", "choose_length", "expected_tokens",
           "probe_gaps", "probe_payback", "first_length"]

DEFAULT_LENGTHS = (0, 3, 7)  # and the drafter's K: verify rows 1, 4, 8, K + 1


def _fraction(name: str, value: object, low_open: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not (0 < value < 1 if low_open else 0 <= value < 1):
        interval = "(0, 1)" if low_open else "[0, 1)"
        raise ValueError(f"Adaptive.{name} must be a number in {interval}, got {value!r}")
    return float(value)


def check_lengths(where: str, lengths: object, num_draft_tokens: int | None = None) -> tuple[int, ...]:
    """Draft lengths: a strictly increasing tuple of ints >= 0 with one > 0, at most `num_draft_tokens` if given."""
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Sequence) or not lengths:
        raise ValueError(f"{where}.draft_lengths must be a non-empty sequence of ints, got {lengths!r}")
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in lengths):
        raise ValueError(f"{where}.draft_lengths must hold ints >= 0, got {lengths!r}")
    if any(b <= a for a, b in zip(lengths, lengths[1:])) or lengths[-1] == 0:
        raise ValueError(f"{where}.draft_lengths must be strictly increasing with one > 0, got {lengths!r}")
    if num_draft_tokens is not None and lengths[-1] > num_draft_tokens:
        raise ValueError(f"{where}.draft_lengths {tuple(lengths)} go past the drafter's {num_draft_tokens} drafts "
                         "per step")
    return tuple(lengths)


@dataclasses.dataclass(frozen=True)
class StepCosts:
    """Seconds of one decode step at each draft length, for one target, drafter, batch size and device.

    `seconds[i]`: a step verifying `draft_lengths[i]` drafts and drafting the next proposal; for a length 0, a
    plain target step (one token, no drafting). `device`: the device kind the times were taken on
    (`jax.devices()[0].device_kind`). Predicted by `speculative_generate` from the models and the device
    (`step_cost_model`), measured on a run long enough (`Adaptive(costs=None)`, `Calibration.worth`), or given by
    hand for a known setup. Times taken at one context length stand for the whole run.
    """

    draft_lengths: tuple[int, ...]
    seconds: tuple[float, ...]
    batch: int
    device: str

    def __post_init__(self):
        check_lengths("StepCosts", self.draft_lengths)
        if isinstance(self.seconds, (str, bytes)) or not isinstance(self.seconds, Sequence) \
                or len(self.seconds) != len(self.draft_lengths):
            raise ValueError(f"StepCosts.seconds must hold one time per draft length ({len(self.draft_lengths)}), "
                             f"got {self.seconds!r}")
        for i, t in enumerate(self.seconds):
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not (math.isfinite(t) and t > 0):
                raise ValueError(f"StepCosts.seconds[{i}] = {t!r}: each must be a finite number of seconds > 0")
        if isinstance(self.batch, bool) or not isinstance(self.batch, int) or self.batch < 1:
            raise ValueError(f"StepCosts.batch must be an int >= 1, got {self.batch!r}")
        if not isinstance(self.device, str) or not self.device:
            raise ValueError(f"StepCosts.device must be a device kind (jax.devices()[0].device_kind), got "
                             f"{self.device!r}")
        object.__setattr__(self, "draft_lengths", tuple(self.draft_lengths))
        object.__setattr__(self, "seconds", tuple(float(t) for t in self.seconds))

    def fits(self, lengths: tuple[int, ...], batch: int, device: str) -> bool:
        """Whether these costs were taken for `lengths`, `batch` and `device`."""
        return (self.draft_lengths, self.batch, self.device) == (lengths, batch, device)

    def check_fits(self, where: str, lengths: tuple[int, ...], batch: int, device: str) -> None:
        """Refuse (ValueError) costs taken for other draft lengths, another batch size or another device."""
        for field, have, want in (("draft_lengths", self.draft_lengths, lengths), ("batch", self.batch, batch),
                                  ("device", self.device, device)):
            if have != want:
                raise ValueError(f"{where}: StepCosts.{field} = {have!r} does not fit this run ({field} {want!r}): "
                                 "the costs were taken for another setup")


@dataclasses.dataclass
class Measurement:
    """A setup's measurement so far, kept across its calls (`draft_policy.calibrate`): the length indices that ran
    their untimed step, and the seconds of each timed call by (length index, steps)."""

    warmed: set[int] = dataclasses.field(default_factory=set)
    seconds: dict[tuple[int, int], list[float]] = dataclasses.field(default_factory=dict)


class CostKeeper(Protocol):
    """Where a `Calibration` keeps costs beyond its process (`cost_store.CostStore`): by setup key."""

    def get(self, setup: Hashable) -> StepCosts | None: ...

    def put(self, setup: Hashable, costs: StepCosts) -> None: ...


@dataclasses.dataclass(eq=False)
class Calibration:
    """Where an `Adaptive` policy keeps the step costs it measured, by setup (`measured`: what a step's cost depends
    on -> `StepCosts`), and the measurements that runs too short to finish them left (`unfinished`): a policy passed
    to several calls measures once per setup; `reset()` forgets both. How it measures: at each length, calls of
    `steps` steps and of twice as many, `repeats` times each, timed by `clock` (seconds); the difference of the
    fastest of each is the steps' own time, without what a call of the decode program costs on its own. Measured
    on an H200 (docs/benchmarks.md): 3 steps once gave K-draft steps cheaper than plain ones (one slow call early
    in the run); 6 steps, fastest of 2, stay within 5% of the steps' times in the decode. When: only in a run whose
    measurement would cost at most `share` of its time (`worth`); the others choose by the predicted costs
    (`step_cost_model`) throughout."""

    steps: int = 6
    repeats: int = 2
    share: float = 0.02
    clock: Callable[[], float] = time.perf_counter
    measured: dict[Hashable, StepCosts] = dataclasses.field(default_factory=dict)
    unfinished: dict[Hashable, Measurement] = dataclasses.field(default_factory=dict)
    store: CostKeeper | None = None  # costs kept for the next process (`cost_store.CostStore`); None: this one only

    def __post_init__(self):
        for name in ("steps", "repeats"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Calibration.{name} must be an int >= 1, got {value!r}")
        if not callable(self.clock):
            raise TypeError(f"Calibration.clock must be a function returning seconds, got {self.clock!r}")
        if isinstance(self.share, bool) or not isinstance(self.share, (int, float)) \
                or not (math.isfinite(self.share) and self.share > 0):
            raise ValueError(f"Calibration.share must be a number > 0, got {self.share!r}")

    def worth(self, predicted: StepCosts, tokens: int) -> bool:
        """Whether a run of `tokens` new tokens measures: the steps it forces (at each length one untimed step,
        then `repeats` calls of `steps` and of twice as many) cost, if no draft were accepted, at most `share` of
        the run's time at plain steps (`predicted`: the costs the run chooses by otherwise). On an H100 with the
        Qwen3-8B shapes (17-draft steps 1.4 plain ones, docs/benchmarks.md; 3 and 7 drafts if 1.25 and 1.3) a run
        of about 1800 tokens measures."""
        forced = 1 + 3 * self.steps * self.repeats
        plain = predicted.seconds[0]
        extra = sum(forced * (t / plain - 1) for n, t in zip(predicted.draft_lengths, predicted.seconds) if n > 0)
        return extra <= self.share * tokens

    def reset(self) -> None:
        """Forget every measured cost and unfinished measurement: the next call measures anew (or reads `store`,
        which `store.clear()` empties)."""
        self.measured.clear()
        self.unfinished.clear()

    def known(self, setup: Hashable, lengths: tuple[int, ...], batch: int, device: str) -> StepCosts | None:
        """The costs of `setup`: measured in this process, else read from `store` (a record for other lengths, batch
        or device is not used)."""
        costs = self.measured.get(setup)
        if costs is None and self.store is not None:
            stored = self.store.get(setup)
            if stored is not None and stored.fits(lengths, batch, device):
                costs = self.measured[setup] = stored
        return costs

    def keep(self, setup: Hashable, costs: StepCosts) -> None:
        """Remember the costs measured for `setup`, in `store` too."""
        self.measured[setup] = costs
        if self.store is not None:
            self.store.put(setup, costs)


@dataclasses.dataclass(frozen=True)
class Adaptive:
    """The adaptive draft-length policy of `speculative_generate(..., draft_length=Adaptive(...))` (module doc).

    draft_lengths: the static lengths to choose from (None: 0, 3, 7 and the drafter's K, those up to K); 0 is a
    plain target step. costs: a `StepCosts` for them, or None to predict them (`step_cost_model`) and, in a run
    long enough (`Calibration.worth`), measure them and keep them in `calibration` (a `Calibration` of this policy's
    own unless given: hold the policy, or the calibration, to measure once for many calls; `"adaptive"` is a new
    `Adaptive()` each call). memory:
    how much of a sequence's acceptance history a verify keeps (the rest is the new step's); prior: the acceptance
    rate assumed without evidence (one pseudo-trial); margin: after a verify, plain steps are taken only if they are
    that much faster than drafting, in proportion to the accepted drafts on record; probe_share: the share of the
    plain steps' time that probes of a drafter that keeps failing may cost, which sets the longest gap between them;
    early_probe_share: the share probes soon after a verify may cost, which sets the first gap and the budget's
    rest a probe needs (module doc, `probe_gaps`); focus: how much the choice serves the sequences the batch will
    wait for, the exponent of their weights (module doc: 0 counts every sequence's tokens alike, 8 by default, large
    values serve only the slowest).
    """

    draft_lengths: tuple[int, ...] | None = None
    costs: StepCosts | None = None
    memory: float = 0.9
    prior: float = 0.5
    margin: float = 0.1
    probe_share: float = 0.005
    early_probe_share: float = 0.02
    focus: float = 8.0
    calibration: Calibration = dataclasses.field(default_factory=Calibration, compare=False, repr=False)

    def __post_init__(self):
        if self.draft_lengths is not None:
            object.__setattr__(self, "draft_lengths", check_lengths("Adaptive", self.draft_lengths))
        if self.costs is not None and not isinstance(self.costs, StepCosts):
            raise TypeError(f"Adaptive.costs must be a dflash_jax.StepCosts or None, got {type(self.costs).__name__}")
        if self.costs is not None and self.draft_lengths is not None and self.costs.draft_lengths != self.draft_lengths:
            raise ValueError(f"Adaptive.costs are for draft lengths {self.costs.draft_lengths}, the policy has "
                             f"{self.draft_lengths}")
        _fraction("memory", self.memory, True)
        _fraction("prior", self.prior, True)
        _fraction("margin", self.margin, False)
        _fraction("probe_share", self.probe_share, True)
        _fraction("early_probe_share", self.early_probe_share, True)
        if isinstance(self.focus, bool) or not isinstance(self.focus, (int, float)) \
                or not (math.isfinite(self.focus) and 0 <= self.focus <= 64):
            raise ValueError(f"Adaptive.focus must be a number in [0, 64], got {self.focus!r}")
        if not isinstance(self.calibration, Calibration):
            raise TypeError(f"Adaptive.calibration must be a dflash_jax.Calibration, got "
                            f"{type(self.calibration).__name__}")
        object.__setattr__(self, "focus", float(self.focus))

    def lengths(self, num_draft_tokens: int) -> tuple[int, ...]:
        """The draft lengths for a drafter of `num_draft_tokens` drafts per step."""
        if self.draft_lengths is not None:
            return check_lengths("Adaptive", self.draft_lengths, num_draft_tokens)
        if self.costs is not None:
            return check_lengths("Adaptive", self.costs.draft_lengths, num_draft_tokens)
        return tuple(sorted({n for n in DEFAULT_LENGTHS if n < num_draft_tokens} | {num_draft_tokens}))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class History:
    """Per-sequence running sums of past verifies (each `[batch]` float32), forgetting old verifies geometrically."""

    hits: jax.Array  # accepted drafts
    tries: jax.Array  # draft positions tried: accepted + the first rejected, up to the verified length
    predicted: jax.Array  # the drafter's confidences summed over the tried positions
    run_hits: jax.Array  # accepted drafts over the whole call, nothing forgotten
    run_tries: jax.Array  # positions tried over the whole call

    @staticmethod
    def empty(batch: int) -> History:
        zeros = jnp.zeros((batch,), jnp.float32)
        return History(zeros, zeros, zeros, zeros, zeros)

    def rate(self, prior: float | jax.Array) -> jax.Array:
        """`[batch]` recent acceptance per tried position, with one pseudo-trial at `prior`."""
        return (self.hits + prior) / (self.tries + 1)

    def run_rate(self, prior: float | jax.Array) -> jax.Array:
        """`[batch]` acceptance per tried position over the whole call, with one pseudo-trial at `prior`: what sets
        how long a sequence will take (`weights`), where `rate` follows its recent stretch."""
        return (self.run_hits + prior) / (self.run_tries + 1)

    def scale(self, prior: float | jax.Array) -> jax.Array:
        """`[batch]` accepted / predicted: what the drafter's confidences are multiplied by."""
        return (self.hits + prior) / (self.predicted + prior)

    def update(self, verified: jax.Array, accepted: jax.Array, confidence: jax.Array, live: jax.Array,
               memory: float | jax.Array) -> History:
        """After a verify of `verified` `[batch]` of the drafts whose confidences are `confidence` `[batch, K]`,
        `accepted` `[batch]` of them accepted: each running sequence that verified drafts keeps `memory` of its
        evidence and adds the step's (one that verified none, after a DSpark cut, keeps its evidence as it is)."""
        tried = jnp.minimum(accepted + 1, verified)  # [batch]
        positions = jnp.arange(confidence.shape[1]) < tried[:, None]  # [batch, K]
        hits, tries = accepted.astype(jnp.float32), tried.astype(jnp.float32)
        predicted = jnp.where(positions, confidence, 0.0).sum(1)
        counts = live & (verified > 0)  # [batch]

        def mix(old, step, keep=memory):
            return jnp.where(counts, keep * old + step, old)

        return History(mix(self.hits, hits), mix(self.tries, tries), mix(self.predicted, predicted),
                       mix(self.run_hits, hits, 1.0), mix(self.run_tries, tries, 1.0))

    def right(self, live: jax.Array) -> jax.Array:
        """`[]` float32: the accepted drafts on record of the `live` `[batch]` sequences, up to 1."""
        return jnp.minimum(jnp.where(live, self.hits, 0.0).sum(), 1.0)

    def margin(self, margin: float | jax.Array, live: jax.Array) -> jax.Array:
        """`[]` `Adaptive.margin` in proportion to the accepted drafts on record of the `live` `[batch]` sequences,
        in full from one on: no hysteresis for a drafter that has not been right (module doc)."""
        return margin * self.right(live)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Probing:
    """When a batch on plain steps drafts again (module doc): after `gap` plain steps (each `[]` int32), if the
    budget's rest can repay a probe."""

    gap: jax.Array  # plain steps from the last verify to the next probe
    idle: jax.Array  # plain steps since the last verify

    @staticmethod
    def start() -> Probing:
        return Probing(jnp.ones((), jnp.int32), jnp.zeros((), jnp.int32))

    def due(self, payback: jax.Array) -> jax.Array:
        """`[]` bool: the next step drafts: the gap is over and `payback` (`[]`: the most plain steps' time a probe
        that finds the drafter right could still save, `probe_payback`) is at least the gap: a probe costs no more
        of the time it can save than of the plain steps' time before it."""
        return (self.idle >= self.gap) & (payback >= self.gap.astype(jnp.float32))

    def after_plain(self) -> Probing:
        return Probing(self.gap, self.idle + 1)

    def after_verify(self, plain_next: jax.Array, gaps: tuple[jax.Array, jax.Array, jax.Array], right: jax.Array
                     ) -> Probing:
        """After a verify followed by plain steps (`plain_next`, `[]` bool) the gap doubles, up to the longest, if
        the verify was a probe (plain steps before it), and starts again if it ended a run of verifies: at the
        first gap of a drafter that has been `right` (`[]` bool: accepted drafts on record) or of one that has not
        (`gaps`: those two and the longest, `probe_gaps`)."""
        soon, first, longest = gaps
        probe = self.idle > 0
        doubled = jnp.minimum(2 * self.gap, longest)
        gap = jnp.where(plain_next, jnp.where(probe, doubled, jnp.where(right, soon, first)), self.gap)
        return Probing(gap.astype(jnp.int32), jnp.zeros_like(self.idle))


def probe_gaps(seconds: jax.Array, share: float | jax.Array, early_share: float | jax.Array
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`([], [], [])` int32: the plain steps before the first probe after a drafter that has been right, before the
    first after one that has not, and the most between probes: `c`, `c / early_share` and `c / share` for a probe
    costing `c = seconds[1] / seconds[0] - 1` plain steps (`seconds`: `StepCosts.seconds` of lengths starting 0,
    l_1). A probe soon after the drafter was right costs at most the plain steps before it (1 where probes cost
    less than a plain step); one of a drafter never right at most `early_share` of their time, and one of a drafter
    that keeps failing at most `share`. Each at least 1, the longest at most 2**20, the others at most the
    longest."""
    extra = seconds[1] / seconds[0] - 1.0
    longest = jnp.clip(jnp.ceil(extra / share), 1.0, 2.0**20)
    soon, first = (jnp.clip(jnp.ceil(extra / s), 1.0, longest) for s in (1.0, early_share))
    return soon.astype(jnp.int32), first.astype(jnp.int32), longest.astype(jnp.int32)


def probe_payback(seconds: jax.Array, lengths: tuple[int, ...], left: jax.Array) -> jax.Array:
    """`[]` float32: the most plain steps' time drafting could save on `left` (`[]`) tokens, at full acceptance
    at the best length: `left (1 - min_l seconds(l) / ((l + 1) seconds(0)))`, at least 0 (`seconds`:
    `StepCosts.seconds` of `lengths`, starting at 0). What a probe that finds the drafter right can win back at
    most: nothing where even a drafter always right would not beat plain steps (a MoE verify of 8 sequences)."""
    rows = jnp.asarray([n + 1 for n in lengths], jnp.float32)
    ratio = jnp.where(jnp.asarray(lengths) > 0, seconds / (rows * seconds[0]), jnp.inf).min()
    return left.astype(jnp.float32) * jnp.maximum(1.0 - ratio, 0.0)


def first_length(seconds: jax.Array, lengths: tuple[int, ...], left: jax.Array) -> jax.Array:
    """`[]` int32: the index into `lengths` (nonzero; `lengths[-1]` the drafter's K) of the first step's verify,
    with `left` (`[]`) tokens to make and nothing known of the drafter: the one whose worse case is best (module
    doc, "The first step"). Never accepted, a step of l drafts costs `seconds(l)` for one token where greedy
    decoding's costs `seconds(0)`: `left / (left - 1 + seconds(l) / seconds(0))` of greedy's speed. Always
    accepted, it makes l + 1 tokens and K-draft steps the rest: the fixed length's time over this, at most 1.
    (`seconds[0]`: the plain step's; for lengths without 0, the shortest verify's stands in for it.)"""
    tokens = jnp.maximum(left, 1).astype(jnp.float32)
    longest, K = seconds[-1], lengths[-1]
    fixed = jnp.ceil(tokens / (K + 1)) * longest
    rows = []
    for i, n in enumerate(lengths):
        never = tokens / (tokens - 1 + seconds[i] / seconds[0])
        always = fixed / (seconds[i] + jnp.ceil(jnp.maximum(tokens - n - 1, 0) / (K + 1)) * longest)
        rows.append(jnp.where(n > 0, jnp.minimum(never, jnp.minimum(always, 1.0)), -jnp.inf))
    return jnp.argmax(jnp.stack(rows)).astype(jnp.int32)


def expected_tokens(p: jax.Array, lengths: tuple[int, ...], remaining: jax.Array) -> jax.Array:
    """`[batch, len(lengths)]` expected tokens a step commits per sequence when it verifies each length.

    p: `[batch, K]` probability that draft k is accepted given the drafts before it were; remaining: `[batch]` the
    tokens left in each sequence's budget (or one `[]` for all; tokens past it count nothing).
    """
    batch = p.shape[0]
    reach = jnp.concatenate([jnp.ones((batch, 1), jnp.float32), jnp.cumprod(p.astype(jnp.float32), axis=1)], 1)
    remaining = jnp.broadcast_to(remaining, (batch,))
    reach = jnp.where(jnp.arange(reach.shape[1]) < remaining[:, None], reach, 0.0)  # [batch, K + 1]
    return jnp.cumsum(reach, axis=1)[:, jnp.asarray(lengths)]


def weights(run_rate: jax.Array, num_draft_tokens: int, remaining: jax.Array, live: jax.Array,
            focus: float | jax.Array) -> jax.Array:
    """`[batch]` how much each sequence's progress counts (module doc, `w_i`): `(S_i / max S) ** focus` over the
    `live` sequences (0 for the others), `S_i` the steps sequence i still needs at `num_draft_tokens` drafts a step
    at its `run_rate` `[batch]` (`History.run_rate`), `remaining` `[batch]` tokens left in its budget."""
    p = jnp.broadcast_to(run_rate[:, None], (run_rate.shape[0], num_draft_tokens))
    remaining = jnp.maximum(jnp.broadcast_to(remaining, live.shape), 1)  # [batch]
    steps = remaining.astype(jnp.float32) / expected_tokens(p, (num_draft_tokens,), remaining)[:, 0]  # [batch]
    slowest = jnp.where(live, steps, 0.0).max()
    return jnp.where(live, (steps / slowest) ** focus, 0.0)


def choose_length(p: jax.Array, lengths: tuple[int, ...], seconds: jax.Array, remaining: jax.Array,
                  weight: jax.Array, drafted: bool, plain_margin: float | jax.Array = 0.0) -> jax.Array:
    """The index into `lengths` with the most weighted progress per second (`[]` int32; module doc, `rate(l)`).

    p, remaining: as `expected_tokens`; seconds: `[len(lengths)]` `StepCosts.seconds`; weight: `[batch]` each
    sequence's weight (`weights`; 0 for sequences no longer running); drafted: a proposal is made, so only nonzero
    lengths are chosen (module doc); plain_margin: the rate of a plain step (length 0) counts `1 - plain_margin`
    times (`Adaptive.margin`).
    """
    remaining = jnp.maximum(jnp.broadcast_to(remaining, weight.shape), 1)  # [batch]
    progress = expected_tokens(p, lengths, remaining) / remaining.astype(jnp.float32)[:, None]  # [batch, lengths]
    rate = (weight[:, None] * progress).sum(0) / seconds  # [len(lengths)]
    rate = jnp.where(jnp.asarray(lengths) > 0, rate, -jnp.inf if drafted else rate * (1 - plain_margin))
    return jnp.argmax(rate).astype(jnp.int32)

"""How many drafts a step verifies: `speculative_generate`'s `draft_length` as what the compiled loop knows of it
(`Policy`, static; `Settings`, traced), and the measurement of the step costs the adaptive policy chooses by
(`calibrate`, on the run's own steps).

    resolve_draft_length(draft_length, K)  -> (Policy, Settings, the Adaptive or None)
    Policy.choose(...)                     the index of a step's length, inside the loop
    setup_key(target, drafter, ...)        what a step's cost depends on: the key of `Calibration.measured`
    predicted_costs(target, drafter, ...)  the costs predicted from the models and the device (`step_cost_model`)
    calibrate(run, state, ...)             the costs measured on the decode itself, or None while unfinished

`draft_length`: "fixed" (every step verifies all K drafts), an int n (every step verifies n drafts, 1 <= n <= K),
"adaptive" (a new `Adaptive()`, which predicts the costs, and measures them in a run long enough) or an
`Adaptive` (which keeps what it measures in its `Calibration` for the calls it is passed to next).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Hashable
from typing import Any, Literal, Protocol, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from .adaptive import Adaptive, Calibration, History, Measurement, StepCosts, choose_length, weights
from .drafter import Drafter
from .drafting import Proposal
from .model import AttentionOptions
from .platform import platform_of
from .step_cost_model import model_reads, predict_costs
from .target import Target
from .tuning import CPU_RATES

__all__ = ["resolve_draft_length", "calibrate", "Policy", "Settings"]

DraftLength = int | Literal["adaptive", "fixed"] | Adaptive
DRAFT_LENGTH: Literal["adaptive", "fixed"] = "adaptive"  # the default draft_length at temperature 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Settings:
    """`Adaptive`'s numbers as the loop's traced input (`[]` float32 each): another setting runs the same program."""

    memory: jax.Array
    prior: jax.Array
    margin: jax.Array
    probe_share: jax.Array
    early_probe_share: jax.Array
    focus: jax.Array

    @classmethod
    def of(cls, adaptive: Adaptive | None) -> Settings:
        adaptive = adaptive or Adaptive()  # a fixed length reads none of them
        return cls(*(jnp.float32(getattr(adaptive, f.name)) for f in dataclasses.fields(cls)))


@dataclasses.dataclass(frozen=True)
class Policy:
    """What the compiled loop knows of the draft-length policy (static): the lengths it chooses from, and whether
    it chooses (`adaptive`; its settings are a traced `Settings`); if not, every step verifies `lengths[0]`."""

    lengths: tuple[int, ...]
    adaptive: bool

    @property
    def plain(self) -> bool:
        """Plain target steps are among the lengths (`lengths[0]` is 0)."""
        return self.lengths[0] == 0

    def choose(self, settings: Settings, proposal: Proposal | None, history: History, seconds: jax.Array,
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


def resolve_draft_length(draft_length: DraftLength, num_draft_tokens: int) -> tuple[Policy, Settings, Adaptive | None]:
    """`speculative_generate`'s `draft_length` as the loop's `Policy`, its settings and the adaptive policy (None at
    a fixed length), refusing anything else (TypeError / ValueError naming `draft_length`)."""
    if isinstance(draft_length, str) and draft_length == "fixed":
        draft_length = num_draft_tokens
    if isinstance(draft_length, int) and not isinstance(draft_length, bool):
        if not 1 <= draft_length <= num_draft_tokens:
            raise ValueError(f"speculative_generate: draft_length={draft_length} is outside [1, {num_draft_tokens}]"
                             f" (the drafter's {num_draft_tokens} drafts per step)")
        return Policy((draft_length,), False), Settings.of(None), None
    if isinstance(draft_length, str) and draft_length == "adaptive":
        draft_length = Adaptive()
    if not isinstance(draft_length, Adaptive):
        raise TypeError(f"speculative_generate: draft_length must be 'adaptive', 'fixed', an int or a "
                        f"dflash_jax.Adaptive, got {draft_length!r}")
    return Policy(draft_length.lengths(num_draft_tokens), True), Settings.of(draft_length), draft_length


def device_kind(tree: Any) -> tuple[str, int]:
    """The kind of device the first array of `tree` lives on, and on how many devices it lives."""
    devices = jax.tree_util.tree_leaves(tree)[0].devices()
    return next(iter(devices)).device_kind, len(devices)


def setup_key(target: Target, drafter: Drafter, batch: int, capacity: int, policy: Policy, sampling: bool,
              attention: AttentionOptions) -> Hashable:
    """What a step's cost depends on: the devices, both models' configs and dtypes, the shapes, the lengths."""
    dtypes = tuple(str(jax.tree_util.tree_leaves(m)[0].dtype) for m in (target, drafter))
    return (device_kind(target), type(target).__name__, repr(getattr(target, "config", None)),
            repr(drafter.config), dtypes, batch, capacity, policy.lengths, sampling, attention)


def predicted_costs(target: Target, drafter: Drafter, target_cache: Any, draft_cache: Any, batch: int,
                    policy: Policy) -> StepCosts:
    """The step costs of `policy.lengths` predicted from both models' weights and empty caches (`target_cache`,
    `draft_cache`, as the run allocates them) at the rates of the target's device (`step_cost_model`)."""
    platform = platform_of(target)
    rates = platform.tuning.step_rates if platform.compute_capability else CPU_RATES
    config = getattr(target, "config", None)
    experts = int(getattr(config, "num_experts", 0) or 0)
    gathered = platform.tuning.moe_gather_max_rows if platform.tuning.moe_few_rows in ("gather", "reduce") else 0
    target_reads = model_reads(target, target_cache, target.num_layers, experts,
                               int(getattr(config, "num_experts_per_tok", 0) or 0), pairs_read_up_to=gathered)
    markov = drafter.params.get("markov_head", {}).get("markov_w2", {}).get("weight")  # DSpark: walked K times
    drafter_reads = model_reads(drafter.params, draft_cache, drafter.config.num_hidden_layers,
                                extra=(drafter.lm_head,),  # the target's LM head, if attached
                                walk=markov, walk_steps=drafter.config.num_draft_tokens - 1)
    return predict_costs(target_reads, drafter_reads, policy.lengths, drafter.config.num_draft_tokens, batch,
                         device_kind(target)[0], rates)


class DecodeState(Protocol):
    """What `calibrate` reads of the loop's carry (`generate._State`)."""

    step: jax.Array
    n_out: jax.Array
    done: jax.Array
    budget: jax.Array


S = TypeVar("S", bound=DecodeState)


def sure_steps(state: DecodeState, drafts: int) -> int:
    """Steps of `drafts` drafts the decode from `state` runs for certain (short of a stop token): a step makes at
    most drafts + 1 tokens a sequence, and the batch runs while any sequence has budget left."""
    n_out, done = jax.device_get((state.n_out, state.done))
    left = np.where(done, 0, int(state.budget) - n_out)  # [batch]
    return int(np.max(-(-left // (drafts + 1))))


def calibrate(run: Callable[[S, jax.Array, jax.Array, jax.Array], S], state: S, policy: Policy, batch: int,
              device: str, calibration: Calibration, setup: Hashable) -> tuple[S, StepCosts | None]:
    """Measure the step costs on the run itself, going on from what `calibration` holds of `setup` (which it
    updates), longest length first: at each length, calls of n = `calibration.steps` steps and of 2n,
    `calibration.repeats` times each, timed from the host, after one untimed step the first time the calibration
    runs that length (the first call at a length is slower); a step costs the difference of the fastest call of
    each count over n. A call of the decode program has a cost of its own (on an H200, 4-20 ms: dispatch, the loops'
    start, the host sync), which a plain average over a few steps would add to every step: it made plain steps look
    45% dearer than greedy decoding's; and a call early in a run can be slower than the rest (docs/benchmarks.md).
    The plain steps' time includes appending their context rows to the drafter's cache (`generate._Loop.flush`,
    once at the end of each call). `run(state, seconds, force, until)` decodes from `state` with every step forced
    to length index `force`, until step `until`.

    A timed call starts only where the decode surely lasts its steps even if every draft is accepted
    (`sure_steps`): a run too short for the next one forces no step to another length from there, and
    a run that ends first keeps its progress for the next run of the setup. Returns the state and the costs (also
    kept in `calibration.measured`), or None (the caller chooses by the predicted costs) while the measurement is
    unfinished or its times are not usable (with a warning)."""
    progress = calibration.unfinished.setdefault(setup, Measurement())
    placeholder = jnp.ones(len(policy.lengths), jnp.float32)
    n, clock = calibration.steps, calibration.clock
    for i in reversed(range(len(policy.lengths))):
        for count in (n, 2 * n) * calibration.repeats:
            if len(progress.seconds.get((i, count), ())) >= calibration.repeats:  # timed in an earlier call
                continue
            warm = i not in progress.warmed
            if sure_steps(state, policy.lengths[i]) < count + warm:
                return state, None
            if warm:  # the first call at each length (the first of all compiles) is slower
                state = run(state, placeholder, jnp.int32(i), jnp.int32(int(state.step) + 1))
                progress.warmed.add(i)
            first = int(state.step)
            start = clock()
            state = run(state, placeholder, jnp.int32(i), jnp.int32(first + count))
            if int(state.step) - first < count:  # (a host sync: the steps are done) a stop token ended the decode
                return state, None
            progress.seconds.setdefault((i, count), []).append(clock() - start)
    measured = []
    for i in range(len(policy.lengths)):
        once, twice = (min(progress.seconds[i, count]) for count in (n, 2 * n))
        measured.append((twice - once) / n if twice > once else twice / (2 * n))  # else a clock too coarse for it
    if jax.process_count() > 1:  # every process must choose the same lengths (one program): process 0's clock decides
        from jax.experimental import multihost_utils

        measured = [float(t) for t in multihost_utils.broadcast_one_to_all(np.asarray(measured, np.float32))]
    progress.seconds.clear()  # measured: a setup that cannot use these times measures anew
    try:
        costs = StepCosts(policy.lengths, tuple(measured), batch, device)
    except ValueError as e:  # a clock that did not move: no costs to trust, so the longest length from here on
        warnings.warn(f"speculative_generate: the step costs could not be measured ({e}); choosing by the "
                      "predicted costs instead", RuntimeWarning, stacklevel=3)
        return state, None
    calibration.keep(setup, costs)
    return state, costs

"""`draft_length` as the loop's policy (`dflash_jax.draft_policy.resolve`): "fixed" and an int are one verify length,
"adaptive" a new `Adaptive` (a new calibration each call), an `Adaptive` passed is the one kept, anything else is
refused naming the argument; a calibration's settings, and which runs it measures in. The loop under each:
tests/test_generate.py, tests/test_adaptive.py."""

from __future__ import annotations

import pytest

from dflash_jax import Adaptive, Calibration, StepCosts
from dflash_jax.draft_policy import Policy
from dflash_jax.draft_policy import resolve_draft_length as resolve


def test_fixed_lengths():
    assert resolve("fixed", 7)[0] == Policy((7,), False) and resolve("fixed", 7)[2] is None
    assert resolve(3, 7)[0] == Policy((3,), False)
    for bad in (0, 8, -1):
        with pytest.raises(ValueError, match=rf"draft_length={bad} is outside \[1, 7\]"):
            resolve(bad, 7)


def test_adaptive_policies():
    first, second = resolve("adaptive", 7)[2], resolve("adaptive", 7)[2]
    assert resolve("adaptive", 7)[0] == Policy((0, 3, 7), True)
    assert first.calibration is not second.calibration  # nothing learned carries over from call to call
    held = Adaptive(draft_lengths=(0, 5), calibration=Calibration(steps=1))
    policy, _, adaptive = resolve(held, 7)
    assert policy == Policy((0, 5), True) and adaptive is held


def test_a_run_measures_only_where_the_measurement_costs_little_of_it():
    """The forced steps (37 a length at the defaults: one untimed, then 6 and 12 steps twice) priced at the
    predicted costs as if no draft were accepted: 37 x (0.25 + 0.3 + 0.4) = 35 plain steps' time, at most 2% of
    the run's: 1758 tokens and more measure. Dearer verifies need longer runs."""
    costs = StepCosts((0, 3, 7, 16), (1.0, 1.25, 1.3, 1.4), 1, "cpu")
    assert Calibration().worth(costs, 1758) and not Calibration().worth(costs, 1700)
    assert Calibration(share=1.0).worth(costs, 40)
    dear = StepCosts((0, 3, 7, 16), (1.0, 3.8, 4.3, 5.3), 1, "cpu")
    assert not Calibration().worth(dear, 10_000)


@pytest.mark.parametrize("bad", [True, 2.0, "greedy", None])
def test_other_values_are_refused(bad):
    with pytest.raises(TypeError, match="draft_length must be 'adaptive', 'fixed', an int or a dflash_jax.Adaptive"):
        resolve(bad, 7)


def test_a_calibration_is_checked():
    with pytest.raises(ValueError, match="Calibration.steps must be an int >= 1"):
        Calibration(steps=0)
    with pytest.raises(ValueError, match="Calibration.share must be a number > 0"):
        Calibration(share=0.0)
    with pytest.raises(TypeError, match="Adaptive.calibration must be a dflash_jax.Calibration"):
        Adaptive(calibration={})  # type: ignore[arg-type]

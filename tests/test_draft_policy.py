"""`draft_length` as the loop's policy (`dflash_jax.draft_policy.resolve`): "fixed" and an int are one verify length,
"adaptive" a new `Adaptive` (a new calibration each call), an `Adaptive` passed is the one kept, anything else is
refused naming the argument. The loop under each: tests/test_generate.py, tests/test_adaptive.py."""

from __future__ import annotations

import pytest

from dflash_jax import Adaptive, Calibration
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


@pytest.mark.parametrize("bad", [True, 2.0, "greedy", None])
def test_other_values_are_refused(bad):
    with pytest.raises(TypeError, match="draft_length must be 'adaptive', 'fixed', an int or a dflash_jax.Adaptive"):
        resolve(bad, 7)


def test_a_calibration_is_checked():
    with pytest.raises(ValueError, match="Calibration.steps must be an int >= 1"):
        Calibration(steps=0)
    with pytest.raises(TypeError, match="Adaptive.calibration must be a dflash_jax.Calibration"):
        Adaptive(calibration={})  # type: ignore[arg-type]

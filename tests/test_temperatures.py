"""Every temperature a user can pass samples as the target does (`dflash_jax.sampling`, issue 55).

At a small temperature T, logits / T overflows and its softmax was NaN: every draft was rejected and the NaN
residual drew id 0. On the 16-token target of tests/test_generate_sampling.py, from float32's smallest subnormal to
1e3 (and a float64 below float32's range): where the target's top logit margin on its greedy path makes sampling
certain (margin / T > 100: a runner-up has probability below e^-100 at each step), every sampled sequence is the
greedy one; elsewhere the tokens follow the target's exact distribution (the chi-square bound of the distribution
tests, on fewer samples). A temperature below float32's normal range is 0, greedy (`sampling_controls`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dflash_jax import load_drafter, speculative_generate
from dflash_jax._qwen3_testing import QWEN3_TINY_CONFIGS, random_qwen3
from dflash_jax.generate import PROMPT_BUCKET, _attach
from dflash_jax.testing import write_checkpoint

from .test_generate_sampling import PROMPT, V, _chi2_z, _distribution, _small_vocab

SAMPLES = 128
CERTAIN = 100.0  # margin / T beyond which the greedy token is the only one drawn


@pytest.fixture(scope="module")
def target():
    return random_qwen3({**QWEN3_TINY_CONFIGS["tiny-qwen3"], "vocab_size": V}, seed=5, dtype=jnp.float32)


@pytest.fixture(scope="module")
def logits(target):
    """The target's logits on PROMPT + every (x1, x2): [V*V, 6, V]."""
    seqs = np.array([PROMPT + [a, b] for a in range(V) for b in range(V)], np.int32)
    return target(jnp.asarray(seqs), target.init_cache(len(seqs), 8), jnp.zeros(len(seqs), jnp.int32)).logits


@pytest.fixture(scope="module")
def drafter(tmp_path_factory, target):
    path = tmp_path_factory.mktemp("drafter")
    write_checkpoint(path, _small_vocab("tiny-dflash"), seed=12)
    return _attach(target, load_drafter(path, dtype=jnp.float32))


def _greedy_path(logits) -> tuple[list[int], float]:
    """The target's greedy (x1, x2, x3) after PROMPT, and the smallest margin between the top two logits on it."""
    logits, tokens, margins = np.asarray(logits), [], []
    for i in range(3):
        row = logits[tokens[0] * V + tokens[1] if i == 2 else (tokens[0] * V if i == 1 else 0), len(PROMPT) - 1 + i]
        top = np.sort(row)[::-1]
        tokens.append(int(row.argmax()))
        margins.append(float(top[0] - top[1]))
    return tokens, min(margins)


def _z(counts: np.ndarray, expected: np.ndarray) -> float:
    """`_chi2_z`, for a distribution with one possible token too (chi-square has no degree of freedom there)."""
    if np.count_nonzero(expected) == 1:
        return 0.0 if counts[expected > 0].sum() == counts.sum() else float("inf")
    return _chi2_z(counts, expected)


@settings(max_examples=8, deadline=None, derandomize=True, database=None)
@given(exponent=st.floats(-45.0, 3.0))  # T from 1e-45 (float32's smallest subnormal) to 1e3
@example(exponent=-300.0).via("a float64 below float32's range")
@example(exponent=-38.0).via("subnormal in float32")
@example(exponent=-12.0).via("issue 55's CLI run")
@example(exponent=3.0)
def test_every_temperature_samples_as_the_target(target, logits, drafter, exponent):
    temperature = 10.0**exponent
    greedy, margin = _greedy_path(logits)
    result = speculative_generate(target, drafter, [PROMPT] * SAMPLES, max_new_tokens=3, temperature=temperature,
                                  key=jax.random.key(1), prefill_chunk=SAMPLES * PROMPT_BUCKET, draft_length="fixed",
                                  stop_token_ids=())
    tokens = np.array(result.tokens)  # [SAMPLES, 3]: every sample, its eos draws included
    if margin / temperature > CERTAIN:
        assert (tokens == greedy).all(), (temperature, margin, tokens[(tokens != greedy).any(1)][:4])
        return
    exact = _distribution(logits, temperature)  # [x1, x2, x3], float64
    for i, marginal in enumerate((exact.sum((1, 2)), exact.sum((0, 2)), exact.sum((0, 1)))):
        assert _z(np.bincount(tokens[:, i], minlength=V), SAMPLES * marginal) < 4, (temperature, i)

"""Speculative decoding with a target whose state is recurrent (the Qwen3.5 hybrid: Gated DeltaNet layers): the loop
commits only the accepted rows of each verify (`Target.commit`), so greedy output is the target's own, for every
drafter family, with partial acceptance at every step, ragged prompts longer than a prefill chunk and than the
drafters' windows, and any number of drafts verified (the adaptive policy's plain steps and short verifies); at
T > 0 the output follows the target's distribution."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import Adaptive, StepCosts, greedy_generate, speculative_generate
from dflash_jax.generate import _attach
from dflash_jax.testing import (
    QWEN3_5_TINY_CONFIGS,
    preset_dict,
    random_drafter,
    random_qwen3_5,
    successor_drafter,
    successor_qwen3_5,
)

from .test_generate_sampling import PROMPT, SAMPLES, WHOLE_BATCH, T, V, _chi2_z, _distribution, _small_vocab

MAX_NEW = 20
CHUNK = 16  # prefill chunk: the 40-token prompt takes three, the drafters' append two
PROMPTS = [np.random.default_rng(3).integers(0, 128, n).tolist() for n in (40, 9, 23)]
SUCCESSOR = np.random.default_rng(0).permutation(128)


@pytest.fixture(scope="module")
def target():
    """A hybrid (a delta-net layer, then an attention one) nudged towards a token map: an oracle drafter walking the
    map is accepted often, but not always (the layers' own outputs sometimes change the winner)."""
    return successor_qwen3_5(random_qwen3_5("tiny-qwen3_5", seed=1, dtype=jnp.float32), SUCCESSOR, layer_scale=1.5)


@pytest.fixture(scope="module")
def greedy(target):
    return greedy_generate(target, PROMPTS, max_new_tokens=MAX_NEW, prefill_chunk=CHUNK).tokens


@pytest.fixture(scope="module")
def oracle(target):
    return successor_drafter(_attach(target, random_drafter("tiny-dspark", seed=2, dtype=jnp.float32)), SUCCESSOR)


def test_greedy_with_an_oracle_commits_partial_blocks(target, greedy, oracle):
    """At the fixed draft length (the oracle is always accepted: the lengths the default adaptive policy takes too,
    but for its first verify), in a decode program of one length's branch, not three."""
    result = speculative_generate(target, oracle, PROMPTS, max_new_tokens=MAX_NEW, prefill_chunk=CHUNK,
                                  draft_length="fixed")
    assert result.tokens == greedy
    steps = [a for seq in result.acceptance_lengths for a in seq]
    K = oracle.config.num_draft_tokens
    assert any(1 < a < K + 1 for a in steps), steps  # blocks cut short: the state rolled back mid-block


@pytest.mark.parametrize("family", ["tiny-dflash", "tiny-dflash2"])
def test_greedy_for_every_family(target, greedy, family):
    """Random drafters (DFlash2's sliding window of 8 rows is shorter than the prompts): DFlash at the fixed
    length; DFlash2 under the adaptive policy with step costs that soon favour plain steps (one row, kept) over
    its rejected verifies of 3 drafts (4 rows, one kept)."""
    drafter = random_drafter(family, seed=4, dtype=jnp.float32)
    adaptive = Adaptive(costs=StepCosts((0, 3, 7), (1.0, 1.3, 2.0), batch=len(PROMPTS), device="cpu"))
    draft_length = adaptive if family == "tiny-dflash2" else "fixed"
    result = speculative_generate(target, drafter, PROMPTS, max_new_tokens=MAX_NEW, prefill_chunk=CHUNK,
                                  draft_length=draft_length)
    assert result.tokens == greedy
    assert (sum(result.plain_tokens) > 0) == (draft_length is adaptive)


def test_sampling_follows_the_targets_distribution():
    """As tests/test_generate_sampling.py, with the hybrid target: x2 and x3 come out of verify steps whose rejected
    rows the recurrent state must forget."""
    small = random_qwen3_5({**QWEN3_5_TINY_CONFIGS["tiny-qwen3_5"], "vocab_size": V}, seed=5, dtype=jnp.float32)
    drafter = _attach(small, random_drafter(_small_vocab("tiny-dspark"), seed=11, dtype=jnp.float32))
    seqs = np.array([PROMPT + [a, b] for a in range(V) for b in range(V)], np.int32)
    logits = small(jnp.asarray(seqs), small.init_cache(len(seqs), 8), jnp.zeros(len(seqs), jnp.int32)).logits
    exact = _distribution(np.asarray(logits), T)

    result = speculative_generate(small, drafter, [PROMPT] * SAMPLES, max_new_tokens=3, temperature=T, seed=1,
                                  prefill_chunk=WHOLE_BATCH, stop_token_ids=())
    tokens = np.array(result.tokens)  # [SAMPLES, 3]: every sample, its eos draws included
    first_steps = [steps[0] for steps in result.acceptance_lengths]
    assert first_steps.count(1) > SAMPLES // 10 and sum(a > 1 for a in first_steps) > SAMPLES // 10
    joint12 = np.zeros((V, V))
    np.add.at(joint12, (tokens[:, 0], tokens[:, 1]), 1)
    assert _chi2_z(joint12, SAMPLES * exact.sum(2)) < 4
    assert _chi2_z(np.bincount(tokens[:, 2], minlength=V), SAMPLES * exact.sum((0, 1))) < 4


def test_a_drafter_for_another_hybrid_is_refused(target):
    from dflash_jax import IncompatiblePairError

    wrong = random_drafter({**preset_dict("tiny-dflash"), "num_target_layers": 40}, dtype=jnp.float32)
    with pytest.raises(IncompatiblePairError, match="40-layer target"):
        speculative_generate(target, wrong, PROMPTS, max_new_tokens=MAX_NEW)

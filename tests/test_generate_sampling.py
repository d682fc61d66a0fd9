"""speculative_generate at temperature > 0: the rejection rule makes the output distributed as the target's.

On a 16-token vocabulary, a thousand sequences (one batch, fixed seed) of three new tokens each: the empirical
distribution of (x1, x2) and of x3 is compared with the target's exact distribution, computed by running the
target on every continuation. x1 comes from the prefill; x2 and x3 come out of verify steps (accepted drafts,
residual samples after a rejection, bonus tokens), so the rule itself is on trial. The drafters' own q is far
from the target's p, so both accepts and rejects happen often. DFlash2 draws from top-K candidates only
(q is zero elsewhere), which exercises the residual norm(max(p - q, 0)) where q has holes; DSpark's q has full
support (DFlash's softmax plus a Markov bias; the rule does not depend on the family, and each family's q is
checked against the NumPy reference in tests/test_drafting.py), and its confidence cut ends proposals early.
Every run but the Nemotron drafter's has the adaptive draft-length policy on; its first step verifies the length
whose worse case of never and always accepted is best (`adaptive.first_length`; nothing is known yet). With given
step costs: DFlash2's make plain target steps cheap, so x3 comes from a plain step wherever the first verify made
only x2 (a plain step samples from the target, and when to take one depends on earlier steps only); DFlash's make 3
drafts the best buy (drafts past the chosen length are not proposed, as past the DSpark cut); DSpark's are
predicted from the models (three tokens are too few to measure them in).

Each run has one of the sampling controls on (top-p, min-p, top-k; `dflash_jax.sampling`), with the drafts drawn
under it too: the expected distribution is the target's after transformers' warpers, computed by the NumPy reference
(`_numpy_reference.warped_distribution`, written from transformers' definitions), and a sample in a cell the control
cuts fails at once. The plain temperature-only rule is on trial in tests/test_generate_hybrid.py. NVIDIA's Nemotron
DSpark drafter drafts for its own target family, a Nemotron-H hybrid (Mamba-2, MoE, attention): x3 then also puts
`commit`'s choice of the Mamba states after a partial acceptance on trial. Each control's power is checked too:
samples of the uncut distribution fail the same test. """

from __future__ import annotations

import copy
import itertools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import Adaptive, StepCosts, load_drafter
from dflash_jax._qwen3_testing import QWEN3_TINY_CONFIGS, random_qwen3
from dflash_jax.generate import PROMPT_BUCKET, _attach, speculative_generate
from dflash_jax.target.nemotron_h_config import parse_nemotron_h_config
from dflash_jax.testing import preset_dict, random_nemotron_h, write_checkpoint

from ._numpy_reference import warped_distribution

V, MASK, T = 16, 15, 1.0
PROMPT = [3, 9, 4, 1]
SAMPLES = 1000  # test_the_bound_has_power: a distribution this close is still refused (z about 7.5 > 4)
# 1000 prompts prefilled in one step (each padded to PROMPT_BUCKET tokens) rather than 2048-row chunks of 2 tokens
# a prompt: the chunked prefill is tested on long prompts (test_generate); here it tripled the prefill's time
WHOLE_BATCH = SAMPLES * PROMPT_BUCKET


def _small_vocab(preset: str) -> dict:
    config = copy.deepcopy(preset_dict(preset))
    config["vocab_size"] = V
    for block in ("dflash_config", "dspark_config"):
        if block in config:
            config[block]["mask_token_id"] = MASK
    if "mask_token_id" in config:
        config["mask_token_id"] = MASK
    return config


@pytest.fixture(scope="module")
def target():
    return random_qwen3({**QWEN3_TINY_CONFIGS["tiny-qwen3"], "vocab_size": V}, seed=5, dtype=jnp.float32)


def _distribution(logits: np.ndarray, temperature: float, **controls) -> np.ndarray:
    """The target's distribution of (x1, x2, x3) after PROMPT, [V, V, V], from the logits of every continuation,
    sampled at `temperature` under the `controls` (top_k, top_p, min_p)."""
    p = warped_distribution(np.asarray(logits), temperature, **controls)  # [V*V, 6, V]
    p1 = p[0, len(PROMPT) - 1]  # [V]
    p2 = p[::V, len(PROMPT)]  # [V (x1), V]
    p3 = p[:, len(PROMPT) + 1].reshape(V, V, V)  # [x1, x2, V]
    return p1[:, None, None] * p2[:, :, None] * p3


@pytest.fixture(scope="module")
def nemotron_target():
    """The tiny Nemotron-H of tests/data/nemotron_h/moe on the 16-token vocabulary, its first three blocks (Mamba-2,
    MoE, attention: every kind) for the drafter's taps [-1, 0, 1], random weights."""
    with open(os.path.join(os.path.dirname(__file__), "data", "nemotron_h", "moe", "config.json")) as f:
        raw = json.load(f)
    raw |= {"vocab_size": V, "num_hidden_layers": 3, "layers_block_type": raw["layers_block_type"][:3]}
    return random_nemotron_h(parse_nemotron_h_config(raw, source="nemotron_target"), seed=5, dtype=jnp.float32)


def _all_continuations(target) -> jax.Array:
    """The target's logits on PROMPT + every (x1, x2): [V*V, 6, V]."""
    seqs = np.array([PROMPT + list(c) for c in itertools.product(range(V), repeat=2)], np.int32)
    return target(jnp.asarray(seqs), target.init_cache(len(seqs), 8), jnp.zeros(len(seqs), jnp.int32)).logits


@pytest.fixture(scope="module")
def logits(target):
    return _all_continuations(target)


@pytest.fixture(scope="module")
def nemotron_logits(nemotron_target):
    return _all_continuations(nemotron_target)


@pytest.fixture(scope="module")
def exact(logits):
    return _distribution(logits, T)


def _chi2_z(counts: np.ndarray, expected: np.ndarray) -> float:
    """Chi-square statistic of counts vs expected (cells with expected < 5 pooled), as a Wilson-Hilferty z score:
    about N(0, 1) when the counts follow the expected distribution. A count in a cell of probability 0 (a token a
    sampling control cuts) is infinitely unlikely: inf."""
    counts, expected = counts.ravel().astype(float), expected.ravel()
    impossible = expected <= 0
    if counts[impossible].any():
        return float("inf")
    counts, expected = counts[~impossible], expected[~impossible]
    small = expected < 5
    if small.any():
        counts = np.append(counts[~small], counts[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    stat, k = ((counts - expected) ** 2 / expected).sum(), len(expected) - 1
    return ((stat / k) ** (1 / 3) - (1 - 2 / (9 * k))) / np.sqrt(2 / (9 * k))


def _costs(*seconds: float) -> Adaptive:
    return Adaptive(costs=StepCosts((0, 3, 7), seconds, batch=SAMPLES, device="cpu"))


@pytest.mark.parametrize(
    "preset, threshold, draft_length, controls",  # DSpark with its confidence cut: drafts past it never accepted
    [("tiny-dflash2", 0.0, _costs(1.0, 10.0, 20.0), dict(top_p=0.9)),  # x3 from a plain step or step 1
     ("tiny-dspark", 0.5, "adaptive", dict(min_p=0.2)),
     ("tiny-dflash", 0.0, _costs(1.0, 1.0, 100.0), dict(top_k=5)),
     ("tiny-nemotron-dspark", 0.0, "fixed", dict(top_p=0.9))],  # sinks, window, bonus anchor, Markov walk
)
def test_output_distribution_is_the_targets(request, tmp_path, preset, threshold, draft_length, controls):
    family = "nemotron_" if "nemotron" in preset else ""  # the Nemotron drafter on its own target family
    target, logits = (request.getfixturevalue(family + name) for name in ("target", "logits"))
    exact = _distribution(logits, T, **controls)
    uncut = _distribution(logits, T).sum(2).ravel()  # the control's power: samples of T alone are refused
    cells = np.random.default_rng(0).choice(V * V, SAMPLES, p=uncut / uncut.sum())
    assert _chi2_z(np.bincount(cells, minlength=V * V), SAMPLES * exact.sum(2)) > 4
    write_checkpoint(tmp_path, _small_vocab(preset), seed=12)  # first verifies take both paths often
    drafter = _attach(target, load_drafter(tmp_path, dtype=jnp.float32))

    result = speculative_generate(target, drafter, [PROMPT] * SAMPLES, max_new_tokens=3, temperature=T,
                                  key=jax.random.key(1), confidence_threshold=threshold,
                                  draft_length=draft_length, prefill_chunk=WHOLE_BATCH, stop_token_ids=(),
                                  **controls)
    tokens = np.array(result.tokens)  # [SAMPLES, 3]: every sample, its eos draws included
    first_steps = [steps[0] for steps in result.acceptance_lengths]  # both paths of the rule, often
    assert first_steps.count(1) > SAMPLES // 10 and sum(a > 1 for a in first_steps) > SAMPLES // 10
    if preset == "tiny-dflash2":  # the sequences whose first verify made only x2 made x3 in a plain step
        assert np.asarray(result.plain_tokens).sum() == first_steps.count(1)

    joint12 = np.zeros((V, V))
    np.add.at(joint12, (tokens[:, 0], tokens[:, 1]), 1)
    assert _chi2_z(joint12, SAMPLES * exact.sum(2)) < 4
    assert _chi2_z(np.bincount(tokens[:, 2], minlength=V), SAMPLES * exact.sum((0, 1))) < 4


def test_the_bound_has_power(logits, exact):
    """Samples from a slightly wrong distribution (the target at T=1.5) fail the same bound, so passing means
    something."""
    wrong = _distribution(logits, 1.5).sum(2).ravel()
    cells = np.random.default_rng(0).choice(V * V, SAMPLES, p=wrong / wrong.sum())
    assert _chi2_z(np.bincount(cells, minlength=V * V), SAMPLES * exact.sum(2)) > 4

"""The Gemma 4 DSpark drafter against DeepSpec's own code: the outputs in tests/data/golden/gemma4-dspark-tiny-*
(README there, "Gemma 4 DSpark") of `Gemma4DSparkModel` on tiny random drafters, for the uncached forward, the
softcapped Markov walk and confidence head, and `propose` from an empty cache.

Tolerances are about 3x the error measured on a CPU in float32 and 1.5x in bf16 (figures beside them); a change
of semantics moves the hidden states by 0.4 to 4 (the README's "plausible mistakes"), exact GELU instead of
GELU-tanh by 7e-4 / 1.7e-3."""

from __future__ import annotations

import functools
import os

import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.drafter import Drafter
from dflash_jax.drafting import init_cache, propose, sample_drafts
from dflash_jax.layers import lm_logits
from dflash_jax.loader import load_drafter
from dflash_jax.model import draft_hidden

from ._drafters import GOLDEN
from ._golden import check_bfloat16_outputs, check_markov_walk
from ._io import load_file

CASES = ("gemma4-dspark-tiny-a", "gemma4-dspark-tiny-b")
# max abs error on (hidden, plain logits), float32, measured: a 6.6e-6 / 1.3e-5, b 2.7e-5 / 5.5e-5
FLOAT32_ATOL = {"gemma4-dspark-tiny-a": (2e-5, 4e-5), "gemma4-dspark-tiny-b": (8e-5, 1.6e-4)}
# bf16 weights and activations, measured: a 0.060 / 0.108, b 0.228 / 0.586 (the reference's own bf16 run, hidden /
# capped logits: a 0.065 / 0.118, b 0.134 / 0.290; README)
BFLOAT16_ATOL = {"gemma4-dspark-tiny-a": (0.09, 0.16), "gemma4-dspark-tiny-b": (0.34, 0.88)}
# the confidences, float32: measured a 3.0e-7, b 1.8e-6; the sampled q rows at T = 0.5: a 1.7e-6, b 8.5e-6
CONFIDENCE_ATOL = {"gemma4-dspark-tiny-a": 1e-6, "gemma4-dspark-tiny-b": 6e-6}
Q_ATOL = {"gemma4-dspark-tiny-a": 6e-6, "gemma4-dspark-tiny-b": 3e-5}


@functools.cache
def golden(case: str, dtype=jnp.float32) -> tuple[Drafter, dict[str, np.ndarray]]:
    """(the drafter as DeepSpec saved it, with its own embedding and LM head; the io tensors)."""
    directory = os.path.join(GOLDEN, case)
    return load_drafter(directory, dtype=dtype), load_file(os.path.join(directory, "io.safetensors"))


@functools.cache
def _hidden(case: str, dtype=jnp.float32) -> np.ndarray:
    """The drafter's final hidden states for the golden block, float32 `[1, B, H]`."""
    drafter, io = golden(case, dtype)
    hidden = draft_hidden(drafter, io["target_hidden"], io["block_ids"], context_positions=io["context_positions"],
                          block_positions=io["block_positions"])
    return np.asarray(hidden, np.float32)


@pytest.mark.parametrize("case", CASES)
def test_forward_float32(case):
    """Float32 with full-precision matmuls: hidden states and plain LM-head logits of every block row (all B
    draft: DSpark's shifted rows)."""
    drafter, io = golden(case)
    hidden = _hidden(case)
    logits = np.asarray(lm_logits(jnp.asarray(hidden), drafter.output_head))
    hidden_atol, logits_atol = FLOAT32_ATOL[case]
    np.testing.assert_allclose(hidden, io["expected_hidden"], rtol=0, atol=hidden_atol)
    np.testing.assert_allclose(logits, io["expected_logits"], rtol=0, atol=logits_atol)


@pytest.mark.parametrize("case", CASES)
def test_forward_bfloat16(case):
    """bf16 weights as stored and bf16 activations: hidden states, logits, and the drafts and cut."""
    drafter, io = golden(case, jnp.bfloat16)
    hidden = _hidden(case, jnp.bfloat16)
    check_bfloat16_outputs(drafter, io, hidden, *BFLOAT16_ATOL[case])
    proposal = sample_drafts(drafter, jnp.asarray(hidden, jnp.bfloat16), jnp.asarray(io["block_ids"][:, 0]),
                             confidence_threshold=float(io["confidence_threshold"][0]))
    np.testing.assert_array_equal(np.asarray(proposal.tokens), io["expected_draft_tokens"])
    np.testing.assert_array_equal(np.asarray(proposal.num_tokens), io["expected_num_tokens"])


@pytest.mark.parametrize("case", CASES)
def test_softcapped_markov_walk_and_confidence(case):
    """Greedy: the walk over the softcapped logits plus the Markov bias (DeepSpec's `compute_logits`, then
    `sample_draft_tokens`), the confidences and the cut at the stored threshold. Sampled at T = 0.5 over 64 copies:
    wherever a copy's earlier drafts are the reference's walk, its q row is `softmax(corrected logits / T)` of the
    reference, which pins the softcap itself (it moves case a's logits by up to 2.0), not only its argmax."""
    drafter, io = golden(case)
    rows, anchors = jnp.asarray(_hidden(case)), jnp.asarray(io["block_ids"][:, 0])
    check_markov_walk(drafter, io, rows, anchors, confidence_atol=CONFIDENCE_ATOL[case], q_atol=Q_ATOL[case])


@pytest.mark.parametrize("case", CASES)
def test_propose_from_an_empty_cache(case):
    """`propose` with the golden context as its first step: the reference's drafts, confidences (measured 1.8e-7 /
    8.9e-7) and cut. Its context starts at position 0, not at the golden's (3 in case b): RoPE is relative."""
    drafter, io = golden(case)
    target_hidden = io["target_hidden"]
    S = target_hidden.shape[1]
    proposal, _ = propose(drafter, init_cache(drafter, 1, S + 8), target_hidden, np.array([S]),
                          io["block_ids"][:, 0].astype(np.int32),
                          confidence_threshold=float(io["confidence_threshold"][0]))
    np.testing.assert_array_equal(np.asarray(proposal.tokens), io["expected_draft_tokens"])
    np.testing.assert_allclose(np.asarray(proposal.confidence), io["expected_confidence"], rtol=0,
                               atol=CONFIDENCE_ATOL[case])
    np.testing.assert_array_equal(np.asarray(proposal.num_tokens), io["expected_num_tokens"])

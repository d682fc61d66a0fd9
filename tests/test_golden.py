"""Every family against its authors' PyTorch code: the outputs in tests/data/golden (README there) of z-lab DFlash,
DeepSpec DSpark and SpecForge DFlash2 on tiny random drafters, for the uncached forward, the drafting heads
(DSpark's Markov walk and confidence head, DFlash2's candidate selector) and `propose` from an empty cache.

Tolerances are about 3x the error measured on a CPU in float32 and 1.5x in bf16 (each golden's figures beside
it): a change of semantics moves these outputs by 0.9 to 5 (the README's "plausible mistakes")."""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import load_drafter, nvfp4
from dflash_jax.config import replace
from dflash_jax.drafting import init_cache, propose, sample_drafts
from dflash_jax.layers import lm_logits
from dflash_jax.model import AttentionOptions, draft_hidden

from ._drafters import GOLDEN
from ._golden import CASES, check_bfloat16_outputs, check_markov_walk, golden

# max abs error on (hidden, logits), float32, measured:  1.4e-6 / 3.1e-6, 9.6e-6 / 1.6e-5, 2.0e-6 / 3.6e-6,
# 3.8e-6 / 7.0e-6, 5.1e-6 / 8.0e-6, 1.3e-5 / 2.8e-5, 1.3e-5 / 2.1e-5 (in CASES' order)
FLOAT32_ATOL = {
    "dflash-tiny-a": (5e-6, 1e-5), "dflash-tiny-b": (3e-5, 5e-5), "dspark-tiny-a": (6e-6, 1.1e-5),
    "dspark-tiny-b": (1.2e-5, 2.1e-5), "dflash2-tiny-a": (1.5e-5, 2.4e-5), "dflash2-tiny-b": (4e-5, 8.5e-5),
    "dflash2-tiny-b-masked": (4e-5, 6.5e-5), "nemotron-dflash-tiny": (1.2e-5, 1.5e-5),
    "nemotron-dspark-tiny": (7e-6, 8e-6),  # measured 3.8e-6 / 4.7e-6, 2.1e-6 / 2.6e-6
}
# bf16 weights and activations, measured: 0.041 / 0.090, 0.053 / 0.115, 0.041 / 0.094, 0.098 / 0.165,
# 0.132 / 0.242, 0.187 / 0.354, 0.149 / 0.389 (the reference's own bf16 run is as far: README)
BFLOAT16_ATOL = {
    "dflash-tiny-a": (0.06, 0.135), "dflash-tiny-b": (0.08, 0.17), "dspark-tiny-a": (0.06, 0.14),
    "dspark-tiny-b": (0.15, 0.25), "dflash2-tiny-a": (0.2, 0.36), "dflash2-tiny-b": (0.28, 0.53),
    "dflash2-tiny-b-masked": (0.22, 0.58), "nemotron-dflash-tiny": (0.11, 0.13),
    "nemotron-dspark-tiny": (0.055, 0.056),  # measured 0.074 / 0.084, 0.036 / 0.037
}


@functools.cache
def _hidden(case: str, dtype=jnp.float32) -> np.ndarray:
    """The drafter's final hidden states for the golden block, float32 `[1, B, H]`."""
    drafter, io = golden(case, dtype)
    hidden = draft_hidden(drafter, io["target_hidden"], io["block_ids"], context_positions=io["context_positions"],
                          block_positions=io["block_positions"], attention=CASES[case][2])
    return np.asarray(hidden, np.float32)


def _draft_rows(case: str) -> tuple[jax.Array, jax.Array]:
    """(the draft rows' hidden states `[1, n, H]` (rows 1..B-1, or all B for DSpark), the anchors `[1]`)."""
    drafter, io = golden(case)
    return jnp.asarray(_hidden(case)[:, -drafter.config.num_draft_tokens:]), jnp.asarray(io["block_ids"][:, 0])


def _expected_drafts(case: str) -> np.ndarray:
    _, io = golden(case)
    return io["expected_draft_tokens"] if "expected_draft_tokens" in io else io["expected_logits"][:, 1:].argmax(-1)


@pytest.mark.parametrize("case", CASES)
def test_forward_float32(case):
    """Float32 with full-precision matmuls: hidden states and plain LM-head logits of every block row."""
    drafter, io = golden(case)
    hidden = _hidden(case)
    logits = np.asarray(lm_logits(jnp.asarray(hidden), drafter.output_head))
    assert hidden.shape == io["expected_hidden"].shape
    hidden_atol, logits_atol = FLOAT32_ATOL[case]
    np.testing.assert_allclose(hidden, io["expected_hidden"], rtol=0, atol=hidden_atol)
    np.testing.assert_allclose(logits, io["expected_logits"], rtol=0, atol=logits_atol)


@pytest.mark.parametrize("case", CASES)
def test_forward_bfloat16(case):
    """bf16 weights as stored and bf16 activations. Drafts are compared for DFlash and DSpark (margins of 0.18 or
    more); DFlash2's selector margins are below bf16 noise (the reference's own bf16 run keeps 1 of 7 in
    dflash2-tiny-a), so its drafts are compared in float32 only."""
    drafter, io = golden(case, jnp.bfloat16)
    hidden = _hidden(case, jnp.bfloat16)
    check_bfloat16_outputs(drafter, io, hidden, *BFLOAT16_ATOL[case])
    if drafter.config.family == "dflash2":
        return
    n = drafter.config.num_draft_tokens
    proposal = sample_drafts(drafter, jnp.asarray(hidden[:, -n:], jnp.bfloat16), jnp.asarray(io["block_ids"][:, 0]),
                             confidence_threshold=float(io.get("confidence_threshold", [0.0])[0]))
    np.testing.assert_array_equal(np.asarray(proposal.tokens), _expected_drafts(case))
    if "expected_num_tokens" in io:  # measured 0.004 / 0.010 on the confidences: the cut (0.039 / 0.119 away) holds
        np.testing.assert_array_equal(np.asarray(proposal.num_tokens), io["expected_num_tokens"])


@pytest.mark.parametrize("case", ["dspark-tiny-a", "dspark-tiny-b"])
def test_dspark_markov_walk_and_confidence(case):
    """Greedy: the Markov walk's drafts, the confidences (measured 1.2e-7 / 9.2e-7) and the cut at the stored
    threshold. Sampled at T = 0.5 over a batch of 64 copies: wherever a sequence's earlier drafts are the
    reference's walk, its q row is `softmax(markov_logits / T)` of the reference (measured 4.8e-7 / 1.5e-6)."""
    drafter, io = golden(case)
    rows, anchors = _draft_rows(case)
    check_markov_walk(drafter, io, rows, anchors, confidence_atol={"dspark-tiny-a": 4e-7, "dspark-tiny-b": 3e-6}[case],
                      q_atol=5e-6)


@pytest.mark.parametrize("case", ["dflash2-tiny-a", "dflash2-tiny-b", "dflash2-tiny-b-masked"])
def test_dflash2_selector(case):
    """Greedy: the selector walk's drafts. Sampled at T = 1 over 16 copies: q of every row lives on the reference's
    top-K candidates, and is the softmax of the reference's scores given the predecessor drawn (the anchor's
    scores for row 0; the lattice row of the candidate drawn, or the greedy walk's scores where the masked
    outputs, which have no lattice, followed it): measured 7.9e-7 / 2.9e-6 / 9.2e-7."""
    drafter, io = golden(case)
    rows, anchors = _draft_rows(case)
    greedy = jax.jit(sample_drafts)(drafter, rows, anchors)  # one program each, not op by op
    drafts = io["expected_draft_tokens"][0]
    np.testing.assert_array_equal(np.asarray(greedy.tokens[0]), drafts)

    copies = 16
    sampled = jax.jit(functools.partial(sample_drafts, temperature=1.0))(
        drafter, jnp.repeat(rows, copies, 0), jnp.repeat(anchors, copies, 0), key=jax.random.key(0))
    tokens, q = np.asarray(sampled.tokens), np.asarray(sampled.probs)  # [copies, n], [copies, n, V]
    candidates = io["expected_candidate_ids"][0]  # [n, K]
    checked = np.zeros(len(drafts), bool)
    for b in range(copies):
        for j in range(len(drafts)):
            assert set(np.flatnonzero(q[b, j])) == set(candidates[j]), f"row {j}: q off the reference's candidates"
            if j == 0 or ("expected_lattice" not in io and tokens[b, j - 1] == drafts[j - 1]):
                scores = io["expected_selector_scores"][0, j]
            elif "expected_lattice" in io:  # the lattice row of the predecessor candidate this walk drew
                (pred,) = np.flatnonzero(candidates[j - 1] == tokens[b, j - 1])
                scores = io["expected_lattice"][0, j, pred]
            else:
                continue
            expected = np.exp(scores - scores.max())
            np.testing.assert_allclose(q[b, j, candidates[j]], expected / expected.sum(), rtol=0, atol=9e-6,
                                       err_msg=f"copy {b}, row {j}")
            checked[j] = True
    assert checked.all(), "some row never checked: a larger batch is needed"
    assert (tokens != drafts).any(), "sampling drew greedily everywhere: proves nothing about q off the walk"


@pytest.mark.parametrize("case", ["dspark-tiny-a", "dspark-tiny-b", "dflash2-tiny-b", "dflash2-tiny-b-masked",
                                  "nemotron-dflash-tiny", "nemotron-dspark-tiny"])
def test_propose_from_an_empty_cache(case):
    """`propose` with the golden context as its first step: the reference's drafts, and DSpark's confidences
    (measured 1.2e-7 / 1.5e-6) and cut. (z-lab's `propose` equals its uncached forward:
    test_drafting.py.) Its context starts at position 0, not the golden's (RoPE is relative: the same function)."""
    drafter, io = golden(case)
    attention = CASES[case][2]
    target_hidden = io["target_hidden"]
    S = target_hidden.shape[1]
    cache = init_cache(drafter, 1, S + 8, attention=attention)
    proposal, cache = propose(drafter, cache, target_hidden, np.array([S]), io["block_ids"][:, 0].astype(np.int32),
                              confidence_threshold=float(io.get("confidence_threshold", [0.0])[0]),
                              attention=attention)
    np.testing.assert_array_equal(np.asarray(proposal.tokens), _expected_drafts(case))
    if proposal.confidence is not None:
        np.testing.assert_allclose(np.asarray(proposal.confidence), io["expected_confidence"], rtol=0, atol=5e-6)
        np.testing.assert_array_equal(np.asarray(proposal.num_tokens), io["expected_num_tokens"])


def test_nemotron_dspark_markov_walk():
    """NVIDIA's bonus-anchor layout: rows 1..7 draft, the walk starts from the anchor (ModelOpt's `markov_step` on
    the reference's rows). Greedy: its drafts. Sampled at T = 0.5 over 64 copies: wherever a copy's earlier drafts
    are the reference's, its q row is `softmax(expected_markov_logits / T)` (measured 1.2e-7)."""
    drafter, io = golden("nemotron-dspark-tiny")
    rows, anchors = _draft_rows("nemotron-dspark-tiny")
    assert rows.shape[1] == 7  # the anchor's row is not a draft
    greedy = sample_drafts(drafter, rows, anchors)
    np.testing.assert_array_equal(np.asarray(greedy.tokens), io["expected_draft_tokens"])
    T, copies = 0.5, 64
    sampled = sample_drafts(drafter, jnp.repeat(rows, copies, 0), jnp.repeat(anchors, copies, 0),
                            key=jax.random.key(0), temperature=T)
    tokens, q = np.asarray(sampled.tokens), np.asarray(sampled.probs)
    drafts = io["expected_draft_tokens"][0]
    on_walk = np.concatenate([np.ones((copies, 1), bool), np.cumprod(tokens == drafts, axis=1)[:, :-1] > 0], 1)
    assert on_walk.any(axis=0).all(), "some row never on the reference's walk: a larger batch is needed"
    scaled = io["expected_markov_logits"][0] / T
    expected = np.exp(scaled - scaled.max(-1, keepdims=True))
    expected /= expected.sum(-1, keepdims=True)
    for b, k in zip(*np.nonzero(on_walk)):
        np.testing.assert_allclose(q[b, k], expected[k], rtol=0, atol=1e-6, err_msg=f"copy {b}, row {k}")


def _without_sinks(drafter):
    """The drafter with every sink logit at -1e30: exp() of it is 0, the softmax without the column."""
    layers = [{**layer, "self_attn": {**layer["self_attn"], "attention_sink_bias":
                                      jnp.full_like(layer["self_attn"]["attention_sink_bias"], -1e30)}}
              for layer in drafter.params["layers"]]
    return dataclasses.replace(drafter, params={**drafter.params, "layers": layers})


@pytest.mark.parametrize("change", ["no sinks", "bidirectional", "no window", "anchor row drafts", "plain rope",
                                    "causal"])
def test_each_part_of_the_nemotron_layouts_matters(change):
    """Each part the layouts add, dropped or changed, fails the goldens by far more than their tolerance (the
    DSpark's sinks, block-causal mask, context window and bonus anchor; the DFlash's YaRN and bidirectional mask)."""
    case = "nemotron-dflash-tiny" if change in ("plain rope", "causal") else "nemotron-dspark-tiny"
    drafter, io = golden(case)
    attention = {"bidirectional": AttentionOptions(causal=False), "no window": AttentionOptions(sliding_window=False),
                 "causal": AttentionOptions(causal=True)}.get(change, AttentionOptions())
    if change == "no sinks":
        drafter = _without_sinks(drafter)
    if change == "plain rope":
        drafter = dataclasses.replace(drafter, config=replace(drafter.config, rope_scaling=None))
    hidden = np.asarray(draft_hidden(drafter, io["target_hidden"], io["block_ids"],
                                     context_positions=io["context_positions"],
                                     block_positions=io["block_positions"], attention=attention))
    if change == "anchor row drafts":  # rows 0..6 read as drafts, the shifted layout's walk
        greedy = sample_drafts(drafter, jnp.asarray(hidden[:, :-1]), jnp.asarray(io["block_ids"][:, 0]))
        assert (np.asarray(greedy.tokens) != io["expected_draft_tokens"]).sum() >= 3
        return
    assert np.abs(hidden - io["expected_hidden"]).max() > 100 * FLOAT32_ATOL[case][0]


@pytest.mark.parametrize("case", ["nemotron-dflash-tiny", "nemotron-dspark-tiny"])
def test_nemotron_packed_weights(case):
    """The NVFP4 weights kept packed (`weights="packed"`; on a CPU the dequantize-then-dot product) give the
    float32 forward of the dequantized ones, within the same tolerance."""
    _, io = golden(case)
    packed = load_drafter(os.path.join(GOLDEN, case), dtype=jnp.float32, weights="packed")
    assert isinstance(packed.params["fc"]["weight"], nvfp4.Packed)
    packed = packed.attach(lm_head=jnp.asarray(io["lm_head"]))
    hidden = draft_hidden(packed, io["target_hidden"], io["block_ids"], context_positions=io["context_positions"],
                          block_positions=io["block_positions"])
    np.testing.assert_allclose(np.asarray(hidden), io["expected_hidden"], rtol=0, atol=FLOAT32_ATOL[case][0])

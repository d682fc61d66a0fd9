"""The PyTorch goldens of tests/data/golden (README there), as the tests read them."""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.drafter import Drafter
from dflash_jax.drafting import sample_drafts
from dflash_jax.layers import lm_logits
from dflash_jax.loader import load_drafter
from dflash_jax.model import AttentionOptions

from ._drafters import GOLDEN
from ._io import load_file

# The reference's generate helper runs DFlash2's sliding layers unwindowed and bidirectional (z-lab's rule);
# `*_masked` outputs are SpecForge's training masks, dflash_jax's default rule for `is_causal: false`.
UNWINDOWED = AttentionOptions(causal=False, sliding_window=False)
CASES = {  # case: (golden directory, io suffix, attention)
    "dflash-tiny-a": ("dflash-tiny-a", "", AttentionOptions()),
    "dflash-tiny-b": ("dflash-tiny-b", "", AttentionOptions()),
    "dspark-tiny-a": ("dspark-tiny-a", "", AttentionOptions()),
    "dspark-tiny-b": ("dspark-tiny-b", "", AttentionOptions()),
    "dflash2-tiny-a": ("dflash2-tiny-a", "", UNWINDOWED),
    "dflash2-tiny-b": ("dflash2-tiny-b", "", UNWINDOWED),
    "dflash2-tiny-b-masked": ("dflash2-tiny-b", "_masked", AttentionOptions()),
    "nemotron-dflash-tiny": ("nemotron-dflash-tiny", "", AttentionOptions()),
    "nemotron-dspark-tiny": ("nemotron-dspark-tiny", "", AttentionOptions()),
}


@functools.cache
def golden(case: str, dtype=jnp.float32) -> tuple[Drafter, dict[str, np.ndarray]]:
    """(the drafter, with the golden embedding and LM head attached unless it ships its own; the io tensors with
    the case's suffix dropped from its `expected_*` names)."""
    directory, suffix, _ = CASES[case]
    io = load_file(os.path.join(GOLDEN, directory, "io.safetensors"))
    if suffix:  # the lattice is stored for the unmasked rule only
        io = {k: v for k, v in io.items() if k != "expected_lattice"}
        io.update({k.removesuffix(suffix): v for k, v in io.items() if k.endswith(suffix)})
    drafter = load_drafter(os.path.join(GOLDEN, directory), dtype=dtype)
    if "embed_tokens" not in drafter.params:  # z-lab and DFlash2 drafters use the target's
        drafter = drafter.attach(embed=jnp.asarray(io["embed"]), lm_head=jnp.asarray(io["lm_head"]))
    elif "lm_head" not in drafter.params:  # Nemotron's: their own embedding, the target's head
        drafter = drafter.attach(lm_head=jnp.asarray(io["lm_head"]))
    return drafter, io


def check_markov_walk(drafter: Drafter, io: dict[str, np.ndarray], rows: jax.Array, anchors: jax.Array, *,
                      confidence_atol: float, q_atol: float) -> None:
    """A DSpark drafter's walk against the golden's: greedy, the drafts, the confidences and the cut at the stored
    threshold; sampled at T = 0.5 over 64 copies, wherever a copy's earlier drafts are the reference's walk (row k's
    predecessor is then the reference's), its q row is `softmax(expected_markov_logits / T)` of the reference.
    rows: `[1, n, H]` the draft rows' final hidden states, anchors `[1]`."""
    greedy = sample_drafts(drafter, rows, anchors, confidence_threshold=float(io["confidence_threshold"][0]))
    np.testing.assert_array_equal(np.asarray(greedy.tokens), io["expected_draft_tokens"])
    np.testing.assert_allclose(np.asarray(greedy.confidence), io["expected_confidence"], rtol=0, atol=confidence_atol)
    np.testing.assert_array_equal(np.asarray(greedy.num_tokens), io["expected_num_tokens"])

    T, copies = 0.5, 64
    sampled = sample_drafts(drafter, jnp.repeat(rows, copies, 0), jnp.repeat(anchors, copies, 0),
                            key=jax.random.key(0), temperature=T)
    tokens, q = np.asarray(sampled.tokens), np.asarray(sampled.probs)  # [copies, n], [copies, n, V]
    drafts = io["expected_draft_tokens"][0]
    on_walk = np.concatenate([np.ones((copies, 1), bool), np.cumprod(tokens == drafts, axis=1)[:, :-1] > 0], 1)
    assert on_walk.any(axis=0).all(), "some row never on the reference's walk: a larger batch is needed"
    scaled = io["expected_markov_logits"][0] / T
    expected_q = np.exp(scaled - scaled.max(-1, keepdims=True))
    expected_q /= expected_q.sum(-1, keepdims=True)  # [n, V]
    for b, k in zip(*np.nonzero(on_walk)):
        np.testing.assert_allclose(q[b, k], expected_q[k], rtol=0, atol=q_atol, err_msg=f"copy {b}, row {k}")


def check_bfloat16_outputs(drafter: Drafter, io: dict[str, np.ndarray], hidden: np.ndarray, hidden_atol: float,
                           logits_atol: float) -> None:
    """A bf16 drafter's final hidden states `[1, B, H]` and the logits its output head makes of them, against the
    golden's float32 outputs."""
    logits = np.asarray(lm_logits(jnp.asarray(hidden, jnp.bfloat16), drafter.output_head))
    np.testing.assert_allclose(hidden, io["expected_hidden"], rtol=0, atol=hidden_atol)
    np.testing.assert_allclose(logits, io["expected_logits"], rtol=0, atol=logits_atol)

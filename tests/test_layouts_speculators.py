"""vLLM speculators DSpark exports with a reduced draft vocabulary: the Markov head of speculators' `MarkovHead`
(`markov_w1` an embedding of the *verifier's* vocabulary `[V, r]`, `markov_w2` a projection onto the draft
vocabulary `[Vd, r]`) loads and drafts as a NumPy walk over target ids; a head keyed by draft ids is refused by
the tensor."""

from __future__ import annotations

import json
import os
import warnings

import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import CheckpointError, load_drafter
from dflash_jax.drafting import init_cache, propose
from dflash_jax.layouts import fold
from dflash_jax.testing import write_checkpoint

from . import _numpy_reference as ref
from ._drafters import block, features
from ._io import load_file, rewrite_tensors

DATA = os.path.join(os.path.dirname(__file__), "data", "layouts")
V, VD, RANK, H = 256, 48, 16, 64


def reduced_export() -> dict:
    """The published speculators DSpark config (tests/data/layouts), scaled down, with a reduced draft vocabulary."""
    with open(os.path.join(DATA, "speculators-dspark-config.json")) as f:
        raw = json.load(f)
    raw["transformer_layer_config"].update(vocab_size=V, hidden_size=H, intermediate_size=128, num_attention_heads=4,
                                           num_key_value_heads=2, head_dim=16)
    return {**raw, "mask_token_id": V - 1, "draft_vocab_size": VD, "markov_rank": RANK}


def sharpened(tensors: dict) -> None:
    """Markov codes scaled up (bias std about 3) so that the walk's predecessor decides some drafts, and a t2d
    beside d2t, as speculators saves it (vLLM ignores it; so does the loader)."""
    tensors["markov_head.markov_w1.weight"] = tensors["markov_head.markov_w1.weight"] * 12
    tensors["t2d"] = np.isin(np.arange(V), np.arange(VD) + tensors["d2t"])


def walk(params: dict, logits: np.ndarray, anchor: int) -> tuple[np.ndarray, np.ndarray]:
    """speculators' DSpark head at inference, in float64: row k's draft id `argmax(logits_k + w2 @ w1[prev_k])`,
    prev_0 the anchor and prev_k the target id `draft + d2t[draft]` of draft k-1; the confidence
    `sigmoid(proj([h_k ; w1[prev_k]]))` is the caller's. Returns (target ids, prev target ids)."""
    w1, w2, d2t = (params["markov_head"]["markov_w1"]["weight"], params["markov_head"]["markov_w2"]["weight"],
                   params["d2t"])
    targets, prevs, prev = [], [], anchor
    for row in logits:
        prevs.append(prev)
        draft = int(np.argmax(row + w2 @ w1[prev]))
        prev = draft + int(d2t[draft])
        targets.append(prev)
    return np.array(targets), np.array(prevs)


def test_reduced_vocabulary_markov_head_drafts_over_target_ids(tmp_path):
    """Written under speculators' names and shapes (markov_w1 [V, r], markov_w2 / lm_head [Vd, ...], d2t, t2d,
    confidence over [h ; w1[prev]]), loaded without a warning; one greedy `propose` gives the reference walk's
    target ids and its confidences (measured max |diff| 2.4e-7 in float32). A walk that forgets to map its drafts
    to target ids before keying w1 differs from it in some rows."""
    write_checkpoint(tmp_path, reduced_export(), seed=3, own_embeddings=True)
    rewrite_tensors(tmp_path, sharpened)
    shapes = {n: t.shape for n, t in load_file(os.path.join(tmp_path, "model.safetensors")).items()}
    assert (shapes["markov_head.markov_w1.weight"], shapes["markov_head.markov_w2.weight"]) == ((V, RANK), (VD, RANK))
    assert (shapes["lm_head.weight"], shapes["d2t"], shapes["confidence_head.proj.weight"]) == ((VD, H), (VD,),
                                                                                               (1, H + RANK))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        drafter = load_drafter(tmp_path, dtype=jnp.float32)
    c, S, anchor = drafter.config, 10, 200  # an anchor outside the draft vocabulary's range of ids
    th = features(drafter, 1, S)
    proposal, _ = propose(drafter, init_cache(drafter, 1, 64), th, np.array([S], np.int32),
                          np.array([anchor], np.int32))
    with open(os.path.join(tmp_path, "config.json")) as f:
        raw = fold(json.load(f), "config.json")
    params = ref.to_numpy(drafter.params)
    hidden = ref.hidden_states(params, raw, th[0].astype(np.float64), block(drafter, [anchor])[0], np.arange(S),
                               S + np.arange(c.effective_block_size), params["embed_tokens"]["weight"],
                               ref.layer_rules(raw))
    logits = hidden @ params["lm_head"]["weight"].T  # [B, Vd]
    targets, prevs = walk(params, logits, anchor)
    np.testing.assert_array_equal(np.asarray(proposal.tokens[0]), targets)
    proj = params["confidence_head"]["proj"]
    features_ = np.concatenate([hidden, params["markov_head"]["markov_w1"]["weight"][prevs]], axis=-1)
    confidence = 1 / (1 + np.exp(-(features_ @ proj["weight"][0] + proj["bias"][0])))
    np.testing.assert_allclose(np.asarray(proposal.confidence[0]), confidence, rtol=0, atol=1e-6)
    w1, w2 = params["markov_head"]["markov_w1"]["weight"], params["markov_head"]["markov_w2"]["weight"]
    drafts, prev = [], anchor
    for row in logits:  # prev_k = draft id k-1, unmapped
        prev = int(np.argmax(row + w2 @ w1[prev]))
        drafts.append(prev + int(params["d2t"][prev]))
    assert (np.array(drafts) != targets).any()


def test_markov_head_keyed_by_draft_ids_is_refused(tmp_path):
    """A reduced-vocabulary Markov head whose `markov_w1` has the draft vocabulary's rows would need the anchor in
    draft ids (a t2d map vLLM does not read): refused by the tensor, its file, shape and expected shape named."""
    write_checkpoint(tmp_path, reduced_export(), seed=3, own_embeddings=True)
    file = rewrite_tensors(tmp_path, lambda t: t.update(
        {"markov_head.markov_w1.weight": t["markov_head.markov_w1.weight"][:VD]}))
    with pytest.raises(CheckpointError) as err:
        load_drafter(tmp_path)
    for word in (file, "'markov_head.markov_w1.weight'", f"[{VD}, {RANK}]", f"[{V}, {RANK}]"):
        assert word in str(err.value)


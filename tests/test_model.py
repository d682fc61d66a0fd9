"""The uncached forward (`draft_hidden` / `draft_logits`) against the NumPy reference (the PyTorch goldens:
test_golden.py)."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dflash_jax.config import parse_config
from dflash_jax.loader import load_drafter
from dflash_jax.model import AttentionOptions, LayerRule, attention_rules, draft_hidden, draft_logits
from dflash_jax.rope import rope_frequencies
from dflash_jax.testing import preset_dict, write_checkpoint

from . import _numpy_reference as ref
from ._drafters import block, features, tiny_drafter


def _against_reference(preset, *, context_start, S, causal=None, sliding_window=True, atol=1e-4):
    """Batch of 2 through `draft_hidden` vs the NumPy reference one sequence at a time (its rules derived from the
    preset's config.json)."""
    drafter = tiny_drafter(preset)
    c = drafter.config
    B = c.effective_block_size
    th = features(drafter, 2, S)
    ids = block(drafter, [3, 17])
    ctx_pos = np.broadcast_to(context_start + np.arange(S), (2, S))
    blk_pos = np.broadcast_to(context_start + S + np.arange(B), (2, B))
    attention = AttentionOptions(causal=causal, sliding_window=sliding_window)
    hidden = draft_hidden(drafter, th, ids, context_positions=ctx_pos, block_positions=blk_pos, attention=attention)
    params = ref.to_numpy(drafter.params)
    rules = ref.layer_rules(preset_dict(preset), causal, sliding_window)
    for b in range(2):
        expected = ref.hidden_states(params, preset_dict(preset), th[b].astype(np.float64), ids[b], ctx_pos[b],
                                     blk_pos[b], ref.to_numpy(drafter.embedding), rules)
        np.testing.assert_allclose(np.asarray(hidden[b]), expected, rtol=0, atol=atol)


@pytest.mark.parametrize(
    "causal, sliding_window", [(None, True), (None, False), (True, True)], ids=str
)
def test_dflash2_matches_reference(causal, sliding_window):
    """Grouped dynamic convs, a sliding layer (window 8 < context) and the causal / window variants."""
    assert "attention_conv" in tiny_drafter("tiny-dflash2").params["layers"][0]
    _against_reference("tiny-dflash2", context_start=0, S=12, causal=causal, sliding_window=sliding_window)


def test_dspark_yarn_matches_reference():
    """DSpark backbone with YaRN RoPE at positions past `original_max_position_embeddings` (64)."""
    assert tiny_drafter("tiny-dspark").config.rope_type == "yarn"
    _against_reference("tiny-dspark", context_start=290, S=9)


def test_dflash_causal_matches_reference():
    _against_reference("tiny-dflash", context_start=40, S=6, causal=True)


def test_attention_biases_match_reference(tmp_path):
    """q/k/v/o biases (`attention_bias: true`), drawn 25x their initialiser's 0.02 so that they matter (dropping
    them moves the hidden states by over 0.05): the NumPy reference's hidden states."""
    raw = {**preset_dict("tiny-dflash"), "attention_bias": True}
    write_checkpoint(tmp_path, raw, seed=2)
    drafter = load_drafter(tmp_path, dtype=jnp.float32)
    biased = jax.tree_util.tree_map_with_path(
        lambda path, x: x * 25 if jax.tree_util.keystr(path).endswith("['bias']") else x, drafter.params)
    assert all("bias" in layer["self_attn"][p] for layer in biased["layers"] for p in ("q_proj", "k_proj", "o_proj"))
    embed = jnp.asarray(np.random.default_rng(3).standard_normal((raw["vocab_size"], raw["hidden_size"])), jnp.float32)
    drafter = dataclasses.replace(drafter, params=biased).attach(embed=embed, lm_head=embed)
    S, B = 6, drafter.config.effective_block_size
    th, ids = features(drafter, 1, S), block(drafter, [3])
    ctx_pos, blk_pos = np.arange(S), S + np.arange(B)
    hidden = draft_hidden(drafter, th, ids, context_positions=ctx_pos[None], block_positions=blk_pos[None])
    params = ref.to_numpy(drafter.params)
    inputs = (th[0].astype(np.float64), ids[0], ctx_pos, blk_pos, ref.to_numpy(embed), ref.layer_rules(raw))
    expected = ref.hidden_states(params, raw, *inputs)
    np.testing.assert_allclose(np.asarray(hidden[0]), expected, rtol=0, atol=2e-6)  # measured 6.9e-7
    for layer in params["layers"]:
        for p in layer["self_attn"].values():
            p.pop("bias", None)
    assert np.abs(ref.hidden_states(params, raw, *inputs) - expected).max() > 0.05


@pytest.mark.parametrize("config", ["tiny-dspark", "radixark-qwen3.8-27b-dspark", "zlab-qwen3-8b-dflash-b16"])
def test_rope_frequencies_match_reference(config):
    c = parse_config(preset_dict(config))
    freq, scale = rope_frequencies(c)
    expected, expected_scale = ref.inv_freq(preset_dict(config))  # config.json as written
    assert freq.dtype == np.float32
    np.testing.assert_allclose(freq, expected, rtol=2e-7)
    assert scale == pytest.approx(expected_scale)
    if c.rope_type == "yarn":
        assert scale == pytest.approx(0.1 * math.log(c.rope_scaling.factor) + 1.0)
        assert freq[0] == pytest.approx(1.0) and freq[-1] < expected[-1] * 1.0001  # fast dims kept, slow scaled


def test_attention_rules_follow_the_config():
    full = LayerRule(causal=False, window=None)
    tf5 = parse_config(preset_dict("zlab-qwen3.6-35b-a3b-dflash-tf5"))
    assert attention_rules(tf5) == (LayerRule(True, 4096),) * 5 + (full,)  # no is_causal: sliding => causal
    assert attention_rules(tf5, AttentionOptions(sliding_window=False))[0] == LayerRule(True, None)
    assert attention_rules(tf5, AttentionOptions(causal=False))[0] == LayerRule(False, 4096)
    glimmer = parse_config(preset_dict("muse-glimmer-dflash2"))
    assert attention_rules(glimmer) == (LayerRule(False, 2048),) * 5  # explicit is_causal: false
    zlab = preset_dict("zlab-qwen3-8b-dflash-b16")
    assert attention_rules(parse_config(zlab)) == (full,) * 5
    forced = {**zlab, "dflash_config": {**zlab["dflash_config"], "causal": True}}
    assert attention_rules(parse_config(forced)) == (LayerRule(True, None),) * 5


def test_replicated_on_a_mesh_under_jit(cpu_mesh):
    """Params replicated over every device under jit: same logits as on one device, with the inputs
    replicated too (`cpu_mesh`) and with the batch split across devices (a mesh of Auto axes, where XLA
    propagates the batch sharding through the gathers)."""
    drafter = tiny_drafter("tiny-dflash")
    n = len(jax.devices())
    B, S = drafter.config.effective_block_size, 5
    inputs = (features(drafter, n, S), block(drafter, np.arange(n)))
    positions = dict(context_positions=np.broadcast_to(np.arange(S), (n, S)),
                     block_positions=np.broadcast_to(S + np.arange(B), (n, B)))
    expected = np.asarray(draft_logits(drafter, *inputs, **positions))

    step = jax.jit(lambda d, th, ids, pos: draft_logits(d, th, ids, **pos))
    auto = jax.make_mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    for mesh, batch_spec in ((cpu_mesh, P()), (auto, P("data"))):
        put = functools.partial(jax.device_put, device=NamedSharding(mesh, batch_spec))
        replicated = jax.device_put(drafter, NamedSharding(mesh, P()))
        logits = step(replicated, *map(put, inputs), jax.tree.map(put, positions))
        np.testing.assert_allclose(np.asarray(logits), expected, rtol=1e-5, atol=1e-4)  # float32 reassociation


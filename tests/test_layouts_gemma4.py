"""DeepSpec's Gemma 4 DSpark drafter (`Gemma4DSparkModel`): its config read as DeepSpec's layers read it, its
checkpoint planned under DeepSpec's names, refused by the field where DeepSpec's layer would differ, and run:
`propose` and speculative decoding with a tiny target. Its forward against DeepSpec's own code:
tests/test_golden_gemma4.py."""

from __future__ import annotations

import copy
import json
import os
import re
import warnings

import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import Adaptive, ConfigError, load_drafter
from dflash_jax._qwen3_testing import random_qwen3, successor_drafter, successor_target
from dflash_jax.config import parse_config
from dflash_jax.generate import speculative_generate
from dflash_jax.plan import full_plan
from dflash_jax.rope import rope_frequencies
from dflash_jax.testing import TINY_CONFIGS, write_checkpoint

from ._drafters import GOLDEN
from ._io import load_file

GEMMA4 = TINY_CONFIGS["tiny-gemma4-dspark"]


def deepspec_names(layers: int, k_eq_v: bool) -> set[str]:
    """The state-dict keys of DeepSpec's `Gemma4DSparkModel` (modules as its modeling.py declares them: no `model.`
    prefix, `v_proj` only without `attention_k_eq_v`, `v_norm` without a gain, `layer_scalar` a saved buffer)."""
    per_layer = ["input_layernorm.weight", "post_attention_layernorm.weight", "pre_feedforward_layernorm.weight",
                 "post_feedforward_layernorm.weight", "layer_scalar", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                 "mlp.down_proj.weight"]
    per_layer += [f"self_attn.{p}.weight" for p in ("q_proj", "k_proj", "o_proj", "q_norm", "k_norm")]
    per_layer += [] if k_eq_v else ["self_attn.v_proj.weight"]
    return {f"layers.{i}.{n}" for i in range(layers) for n in per_layer} | {
        "embed_tokens.weight", "fc.weight", "hidden_norm.weight", "norm.weight", "lm_head.weight",
        "markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight",
        "confidence_head.proj.bias"}


def test_config_reads_the_global_layers():
    """Every drafter layer is a Gemma 4 global layer: head dim `global_head_dim` (32, not `head_dim` 16), KV heads
    `num_global_key_value_heads` under `attention_k_eq_v` (1, not 2), RoPE `rope_parameters.full_attention`
    (proportional over a quarter of the head, theta 1e6); DSpark rows (B drafts); the embedding scale sqrt(H) and
    the softcap 30 applied, without the warning other families give for a stated softcap. The preset states the
    fields DeepSpec's config.json states (the golden's, written by DeepSpec)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c = parse_config(GEMMA4)
    assert (c.variant, c.family, c.head_dim, c.num_key_value_heads, c.num_attention_heads) == ("gemma4", "dspark", 32,
                                                                                              1, 4)
    assert (c.rope_type, c.rope_theta, c.rope_scaling.partial_rotary_factor) == ("proportional", 1e6, 0.25)
    assert (c.num_draft_tokens, c.mask_token_id, c.target_layer_ids) == (7, 4, (1, 3))
    assert c.logit_transform == (None, 30.0) and c.input_embedding_scale == 8.0
    separate_v = parse_config({**GEMMA4, "attention_k_eq_v": False})
    assert (separate_v.head_dim, separate_v.num_key_value_heads) == (32, 2)  # the global head dim all the same
    with open(os.path.join(GOLDEN, "gemma4-dspark-tiny-a", "config.json")) as f:  # written by DeepSpec
        deepspec = json.load(f)
    assert set(GEMMA4) == set(deepspec) and set(GEMMA4["rope_parameters"]) == set(deepspec["rope_parameters"])


def test_proportional_rope_rotates_the_stated_share():
    """transformers' `proportional` RoPE: the first `int(0.25 * 32 // 2)` = 4 of 16 frequencies are the full head's
    `theta ** (-2i / 32)` (not those of an 8-dim rotary head), the other 12 are 0."""
    inv_freq, scaling = rope_frequencies(parse_config(GEMMA4))
    expected = np.concatenate([1e6 ** (-np.arange(0, 8, 2) / 32), np.zeros(12)])
    np.testing.assert_allclose(inv_freq, expected, rtol=1e-6, atol=0)
    assert scaling == 1.0


def test_plan_is_deepspecs_state_dict(tmp_path):
    """The tensors planned, and written by `write_checkpoint`, are exactly DeepSpec's (those its `save_pretrained`
    wrote in the goldens), at the global layers' shapes; a separate V projection is planned when K is not V."""
    for case, layers, k_eq_v in (("gemma4-dspark-tiny-a", 2, True), ("gemma4-dspark-tiny-b", 3, False)):
        assert set(load_file(os.path.join(GOLDEN, case, "model.safetensors"))) == deepspec_names(layers, k_eq_v)
    c = write_checkpoint(tmp_path, "tiny-gemma4-dspark", own_embeddings=True)
    written = {n: t.shape for n, t in load_file(str(tmp_path / "model.safetensors")).items()}
    assert set(written) == deepspec_names(2, k_eq_v=True) == {t.name for t in full_plan(c, own_embeddings=True)}
    assert written["layers.0.self_attn.q_proj.weight"] == (4 * 32, 64)
    assert written["layers.0.self_attn.k_proj.weight"] == (1 * 32, 64)
    assert written["layers.1.self_attn.k_norm.weight"] == (32,) and written["layers.1.layer_scalar"] == (1,)
    separate_v = parse_config({**GEMMA4, "attention_k_eq_v": False})
    assert {t.name for t in full_plan(separate_v, own_embeddings=True)} == deepspec_names(2, k_eq_v=False)


@pytest.mark.parametrize("change, says", [
    (lambda r: r.update(hidden_activation="silu"), "`hidden_activation` 'silu'"),
    (lambda r: r.update(enable_moe_block=True), "`enable_moe_block` True (a mixture-of-experts block"),
    (lambda r: r.update(hidden_size_per_layer_input=256), "`hidden_size_per_layer_input` 256 (per-layer input"),
    (lambda r: r.update(use_double_wide_mlp=True, num_kv_shared_layers=1), "doubles the MLP of layers 1..1"),
    (lambda r: r.update(layer_types=["sliding_attention", "full_attention"]), "`layer_types`"),
    (lambda r: r.pop("num_global_key_value_heads"), "without `num_global_key_value_heads`"),
    (lambda r: r.update(global_head_dim="32"), "`global_head_dim` is '32'; expected a positive integer"),
    (lambda r: r.update(rope_parameters={"rope_type": "default", "rope_theta": 1e4}), "with `full_attention`"),
], ids=["activation", "moe", "ple", "double-wide", "sliding", "no-global-kv", "head-dim-type", "flat-rope"])
def test_refused_by_field(change, says):
    """What DeepSpec's layer would not build (MoE, per-layer inputs) or this package would run differently is
    refused naming the file and the field."""
    raw = copy.deepcopy(GEMMA4)
    change(raw)
    with pytest.raises(ConfigError) as err:
        parse_config(raw, source="gemma/config.json")
    for word in ("gemma/config.json", "Gemma4DSparkModel config", says):
        assert word in str(err.value)


@pytest.mark.parametrize("change, says", [
    (lambda r: r.update(global_head_dim=33), "global_head_dim=33 is odd"),
    (lambda r: r.update(global_head_dim=2**31), "$.global_head_dim"),
    (lambda r: r.update(num_global_key_value_heads=3), "not a multiple of num_global_key_value_heads=3"),
    (lambda r: r.update(num_global_key_value_heads=2**31), "$.num_global_key_value_heads"),
], ids=["odd", "past-int32", "not-dividing", "kv-past-int32"])
def test_errors_about_the_global_fields_name_them(change, says):
    """`global_head_dim` and `num_global_key_value_heads` are folded into `head_dim` and `num_key_value_heads`:
    the checks after the fold name the fields of the file (they named the folded ones)."""
    raw = copy.deepcopy(GEMMA4)
    change(raw)
    with pytest.raises(ConfigError) as err:
        parse_config(raw, source="gemma/config.json")
    assert str(err.value).startswith("gemma/config.json: ") and says in str(err.value)
    assert not re.search(r"(?<!global_)(head_dim|num_key_value_heads)\b", str(err.value))


def test_double_wide_mlp_outside_the_drafters_layers_is_no_reason_to_refuse():
    """transformers doubles the MLP of layers >= num_hidden_layers - num_kv_shared_layers > 0: with the target's
    count of shared layers (here 20, more than the drafter's 2 layers) no drafter layer is double wide."""
    assert parse_config({**GEMMA4, "use_double_wide_mlp": True, "num_kv_shared_layers": 20}).intermediate_size == 128


def test_speculative_decoding_returns_the_greedy_tokens(tmp_path, quick_calibration):
    """A Gemma 4 drafter whose Markov head walks a tiny target's successor map (`successor_drafter`: a bias of 100,
    above the backbone's logits, which the softcap bounds to 30) in the speculative loop: the tokens are the
    target's greedy ones, whole blocks of all B = 7 drafting rows accepted where the adaptive policy verifies them
    all (its lengths: plain steps or all 7 drafts, a branch less to compile than the default three; its first steps
    measure both, in calls of 1 and 2 steps here so that 64 tokens hold them; a plain step appends context rows
    alone: that path read `v_proj`, which a K = V drafter lacks, until it took the variant's keys and values). The
    target is
    `successor_target` with its layers' outputs scaled to 0, so that its greedy continuation is the successor walk
    itself (logit margin 10 over N(0, 1.25^2) others). The drafter reads the 2-layer tiny target's taps."""
    raw = {**copy.deepcopy(GEMMA4), "markov_rank": 128, "num_target_layers": 2, "target_layer_ids": [0, 1]}
    write_checkpoint(tmp_path, raw, seed=1, own_embeddings=True)
    successor = np.random.default_rng(0).permutation(128)
    drafter = successor_drafter(load_drafter(tmp_path, dtype=jnp.float32), successor)
    target = successor_target(random_qwen3("tiny-qwen3", seed=1, dtype=jnp.float32), successor, layer_scale=0.0)
    prompts, walks = [[5, 9, 2], [100, 3, 3, 7, 1]], []
    for prompt in prompts:
        walks.append([int(successor[prompt[-1]])])
        while len(walks[-1]) < 64:
            walks[-1].append(int(successor[walks[-1][-1]]))
    result = speculative_generate(target, drafter, prompts, max_new_tokens=64, stop_token_ids=(),  # the walk passes eos
                                  draft_length=Adaptive(draft_lengths=(0, 7), calibration=quick_calibration))
    assert result.tokens == walks
    assert drafter.config.num_draft_tokens == 7 and all(8 in steps for steps in result.acceptance_lengths)
    assert all(plain > 0 for plain in result.plain_tokens)  # the plain step ran

"""NVIDIA's Nemotron 3.5 Lightning DFlash and DSpark drafters: their configs, tensors, sinks and layout.

The published configs (configs/nvidia-nemotron-3.5-lightning-*-nvfp4.json) decode to what SGLang's and vLLM's
loaders read; a drifted copy of a twice-stated field is refused by name; the learned sink logit joins the softmax
exactly as the appended column of ModelOpt's `_sink_attention_impl` (checked here against NumPy); the forward
against ModelOpt's own modules is tests/test_golden.py's (the `nemotron-*` cases).
"""

from __future__ import annotations

import copy
import json
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import CheckpointError, ConfigError, load_config, load_drafter, parse_config
from dflash_jax.attention import KeyValues, LayerRule, Span, attend
from dflash_jax.cli import main
from dflash_jax.model import attention_rules
from dflash_jax.nvfp4.checkpoint import exclusion_matcher
from dflash_jax.plan import full_plan
from dflash_jax.spec import LINEAR
from dflash_jax.testing import TINY_CONFIGS, write_checkpoint

from ._io import rewrite_tensors
from ._pallas import needs_gpu

CONFIGS = pathlib.Path(__file__).parent.parent / "configs"
DSPARK, DFLASH = "nvidia-nemotron-3.5-lightning-dspark-nvfp4", "nvidia-nemotron-3.5-lightning-dflash-nvfp4"


def test_published_dspark_config():
    c = load_config(CONFIGS / f"{DSPARK}.json")
    assert (c.family, c.effective_block_size, c.num_draft_tokens, c.sample_from_anchor) == ("dspark", 8, 7, False)
    assert c.attention_sinks and c.markov_rank == 512 and c.mask_token_id == 990
    assert c.target_layer_ids == (1, 5, 19, 29, 41, 51) and c.has_embed_tokens
    assert attention_rules(c) == (LayerRule(True, 1024),) * 6  # block-causal, the context through a window


def test_published_dflash_config():
    c = load_config(CONFIGS / f"{DFLASH}.json")
    assert (c.family, c.num_draft_tokens, c.attention_sinks, c.markov_rank) == ("dflash", 7, False, 0)
    assert attention_rules(c) == (LayerRule(False, None),) * 6  # bidirectional, no window
    assert (c.rope_type, c.rope_theta, c.rope_scaling.factor) == ("yarn", 10000, 128.0)
    assert c.rope_scaling.original_max_position_embeddings == 8192


def test_the_dspark_keeps_twenty_nvfp4_weights():
    """The DSpark's fc, 18 MLP projections and `markov_w2` are NVFP4; its attention, embedding and `markov_w1`
    are excluded (`exclude_modules`), so a written export packs exactly those 20."""
    c = load_config(CONFIGS / f"{DSPARK}.json")
    excluded = exclusion_matcher(c.quantization_config.ignore)
    packed = [t.name for t in full_plan(c) if t.kind == LINEAR and not excluded(t.name.removesuffix(".weight"))]
    assert len(packed) == 20 and "markov_head.markov_w2.weight" in packed and "fc.weight" in packed
    assert {t.name for t in full_plan(c)} >= {"embed_tokens.weight", "layers.5.self_attn.attention_sink_bias"}
    assert "lm_head.weight" not in {t.name for t in full_plan(c)}  # logits through the target's head


def _drifted(change) -> dict:
    raw = copy.deepcopy(TINY_CONFIGS["tiny-nemotron-dspark"])
    change(raw)
    return raw


@pytest.mark.parametrize("change, says", [
    (lambda r: r.update(sample_from_anchor=True) or r["dflash_config"].pop("sample_from_anchor"),
     "dspark_bonus_anchor: true with sample_from_anchor: true"),
    (lambda r: r.update(target_layer_ids=[-1, 0, 2]), "dflash_config.target_layer_ids=[-1, 0, 1] but target_layer_ids"),
    (lambda r: r.update(eagle_aux_hidden_state_layer_ids=[-1, 0, 1]), "expected [0, 1, 2]"),
    (lambda r: r.update(dspark_markov_rank=16), "markov_rank=32 but dspark_markov_rank=16"),
    (lambda r: r.update(attention_sink_bias=False), "dflash_config.attention_sink_bias=True but attention_sink_bias"),
    (lambda r: r["dflash_config"].update(sample_from_anchor=True), "dflash_config.sample_from_anchor=True but"),
], ids=["anchor-both-ways", "taps", "eagle-aux", "markov-rank", "sinks", "sample-from-anchor"])
def test_drifted_configs_refused_naming_the_field(change, says):
    with pytest.raises(ConfigError) as err:
        parse_config(_drifted(change), source="drafter/config.json")
    assert "drafter/config.json" in str(err.value) and says in str(err.value)


def test_consistent_second_names_accepted():
    raw = _drifted(lambda r: r.update(eagle_aux_hidden_state_layer_ids=[0, 1, 2]))
    assert parse_config(raw).target_layer_ids == (-1, 0, 1)
    bonus_only = _drifted(lambda r: [r.pop("sample_from_anchor"), r["dflash_config"].pop("sample_from_anchor")])
    assert parse_config(bonus_only).num_draft_tokens == 7  # the bonus anchor alone sets the layout
    assert parse_config(_drifted(lambda r: r.update(dspark_bonus_anchor=False) or r.pop("sample_from_anchor")
                                 or r["dflash_config"].pop("sample_from_anchor"))).num_draft_tokens == 8


def test_sinks_declared_but_absent_refused(tmp_path):
    write_checkpoint(tmp_path, "tiny-nemotron-dspark")
    rewrite_tensors(tmp_path, lambda t: t.pop("layers.1.self_attn.attention_sink_bias"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'layers\.1\.self_attn\.attention_sink_bias'"):
        load_drafter(tmp_path)


def _reference_attention(q, k, v, allowed, sinks):
    """ModelOpt's `_sink_attention_impl` in float64 NumPy: scaled scores, the sink appended as a last column, the
    softmax, the column dropped; GQA repeats each KV head for its group. q [B, Sq, n_h, d], k/v [B, n_kv, Sk, d]."""
    n_h, n_kv = q.shape[2], k.shape[1]
    k, v = np.repeat(k, n_h // n_kv, axis=1), np.repeat(v, n_h // n_kv, axis=1)  # [B, n_h, Sk, d]
    s = np.einsum("bqhd,bhkd->bhqk", q, k) * q.shape[-1] ** -0.5
    s = np.where(allowed[:, None], s, -np.inf)
    column = np.broadcast_to(sinks[None, :, None, None], (*s.shape[:3], 1))
    s = np.concatenate([s, column], axis=-1)
    p = np.exp(s - s.max(-1, keepdims=True))
    p = (p / p.sum(-1, keepdims=True))[..., :-1]
    return np.einsum("bhqk,bhkd->bqhd", p, v)


def test_sink_logits_are_an_appended_softmax_column():
    """`attend` with `sink_logits` against the NumPy reference, over a dense masked source and a cache span read by
    the blocked loop at once (the kernels' partials merge with the sink's); without the sinks it differs."""
    rng = np.random.default_rng(0)
    batch, Sq, n_h, n_kv, d, cap = 2, 5, 4, 2, 16, 24
    q = rng.standard_normal((batch, Sq, n_h, d)) * 2
    kd, vd = (rng.standard_normal((batch, n_kv, Sq, d)) for _ in "kv")
    kc, vc = (rng.standard_normal((batch, n_kv, cap, d)) for _ in "kv")
    sinks = rng.standard_normal(n_h) * 3
    q_pos = np.tile(np.arange(20, 20 + Sq), (batch, 1))
    start, stop = np.array([0, 3]), np.array([20, 17])  # the span: cache slots [start, stop), positions = slots
    rule = LayerRule(True, None)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    out = attend(f32(q), jnp.asarray(q_pos), rule, (KeyValues(f32(kd), f32(vd), jnp.asarray(q_pos),
                                                              jnp.ones((batch, Sq), bool)),),
                 (Span(f32(kc), f32(vc), jnp.asarray(start), jnp.asarray(stop)),), block=8, sink_logits=f32(sinks))
    slots = np.arange(cap)
    allowed_cache = (slots >= start[:, None]) & (slots < stop[:, None])  # [batch, cap]
    allowed = np.concatenate([np.broadcast_to(allowed_cache[:, None], (batch, Sq, cap)),
                              np.broadcast_to(np.tril(np.ones((Sq, Sq), bool)), (batch, Sq, Sq))], axis=-1)
    k, v = np.concatenate([kc, kd], axis=2), np.concatenate([vc, vd], axis=2)
    expected = _reference_attention(q, k, v, allowed, sinks)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=0, atol=2e-6)
    without = _reference_attention(q, k, v, allowed, np.full(n_h, -np.inf))
    assert np.abs(np.asarray(out) - without).max() > 1e-2


def test_inspect_names_the_layout(tmp_path, capsys):
    write_checkpoint(tmp_path, "tiny-nemotron-dspark", nvfp4=True)
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "dspark drafter, NVFP4: 8 packed linear weights" in out  # fc, the MLPs, markov_w2
    for line in ("attention              layers 0-1: causal, window 6", "attention_sinks        True",
                 "draft_rows             1..7 (row 0: the anchor, apart)", "embedding              own (embed_tokens)",
                 "lm_head                the target's"):
        assert line in out
    assert re.search(r"layers\.0\.self_attn\.q_proj\.weight +BF16", out) and "input_scale" not in out
    assert main(["inspect", "--json", str(tmp_path)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["nvfp4_tensors"] == ["fc.weight", *[f"layers.{i}.mlp.{p}_proj.weight" for i in (0, 1)
                                                      for p in ("gate", "up", "down")],
                                       "markov_head.markov_w2.weight"]


def test_own_embedding_with_the_targets_head(tmp_path):
    """The drafter embeds the block with its own `embed_tokens` and needs the target's LM head attached."""
    write_checkpoint(tmp_path, "tiny-nemotron-dflash")
    drafter = load_drafter(tmp_path, dtype=jnp.float32)
    assert drafter.embedding is drafter.params["embed_tokens"]["weight"]
    with pytest.raises(ValueError, match="attach the target's with drafter.attach"):
        _ = drafter.output_head
    head = jax.random.normal(jax.random.key(0), (128, 64))
    assert drafter.attach(lm_head=head).output_head is head


@pytest.mark.gpu
@needs_gpu
def test_gpu_span_kernel_takes_the_sinks():
    """The sink partial merges with the Mosaic GPU span kernel's as with the XLA loop's (bf16, ragged spans, one
    empty: its queries see the sink alone, so zeros)."""
    rng = np.random.default_rng(1)
    batch, Sq, n_h, n_kv, d, cap = 3, 8, 32, 2, 128, 4096
    q = jnp.asarray(rng.standard_normal((batch, Sq, n_h, d)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((batch, n_kv, cap, d)), jnp.bfloat16) for _ in "kv")
    span = Span(k, v, jnp.asarray([0, 100, 7]), jnp.asarray([4096, 3000, 7]))
    sinks = jnp.asarray(rng.standard_normal(n_h) * 3, jnp.bfloat16)
    q_pos = jnp.zeros((batch, Sq), jnp.int32)
    ref = attend(q, q_pos, LayerRule(True, None), (), (span,), impl="xla", sink_logits=sinks)
    got = attend(q, q_pos, LayerRule(True, None), (), (span,), impl="pallas", sink_logits=sinks)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32), atol=2e-2, rtol=2e-2)
    assert np.all(np.asarray(got[2], np.float32) == 0)

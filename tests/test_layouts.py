"""Published drafter layouts (dflash_jax.layouts): each one loads and runs, checked against its published config
and safetensors header (tests/data/layouts, README there) and a NumPy reference, or is refused by name."""

from __future__ import annotations

import copy
import json
import os
import warnings

import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import CheckpointError, ConfigError, load_drafter
from dflash_jax.config import parse_config
from dflash_jax.drafting import init_cache, propose
from dflash_jax.layouts import fold
from dflash_jax.model import LayerRule, attention_rules, draft_hidden
from dflash_jax.plan import full_plan, plan_tensors
from dflash_jax.testing import TINY_CONFIGS, write_checkpoint

from . import _numpy_reference as ref
from ._drafters import block, features
from ._io import load_file, rewrite_tensors

DATA = os.path.join(os.path.dirname(__file__), "data", "layouts")


def fixture(name: str) -> dict:
    with open(os.path.join(DATA, name)) as f:
        return json.load(f)


def scaled(raw: dict, **sizes) -> dict:
    """`raw` with the decoder sizes of a tiny drafter (names, fields and layout kept), then `sizes`."""
    small = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 16}
    return {**copy.deepcopy(raw), **small, **sizes}


def written_names(directory) -> dict[str, tuple[int, ...]]:
    return {n: t.shape for n, t in load_file(os.path.join(directory, "model.safetensors")).items()}


def nested(tensors: dict[str, np.ndarray], renames: dict[str, str]) -> dict:
    """A parameter tree built from stored tensors the way a reference loader maps them (`renames`: stored -> tree
    name), float64: independent of the package's plan."""
    tree: dict = {"layers": []}
    for name, value in tensors.items():
        parts = renames.get(name, name).split(".")
        node = tree
        if parts[0] == "layers":
            while len(tree["layers"]) <= int(parts[1]):
                tree["layers"].append({})
            node, parts = tree["layers"][int(parts[1])], parts[2:]
        for key in parts[:-1]:
            node = node.setdefault(key, {})
        node[parts[-1]] = value if np.issubdtype(value.dtype, np.integer) else value.astype(np.float64)
    return tree


def attach_random(drafter, seed=5):
    rng = np.random.default_rng(seed)
    shape = (drafter.config.vocab_size, drafter.config.hidden_size)
    return drafter.attach(embed=jnp.asarray(rng.standard_normal(shape), jnp.float32),
                          lm_head=jnp.asarray(rng.standard_normal(shape), jnp.float32))


def folded(directory) -> dict:
    """The written config.json as the package reads it (`layouts.fold`), raw: what the NumPy reference reads."""
    with open(os.path.join(directory, "config.json")) as f:
        return fold(json.load(f), "config.json")


def forward_and_reference(drafter, tensors, renames, rules, raw, S=14):
    """The package's uncached hidden states and the NumPy reference's, for one block after S context rows."""
    c = drafter.config
    th, ids = features(drafter, 1, S), block(drafter, [7])
    ctx_pos, blk_pos = np.arange(S)[None], S + np.arange(c.effective_block_size)[None]
    got = draft_hidden(drafter, th, ids, context_positions=ctx_pos, block_positions=blk_pos)
    expected = ref.hidden_states(nested(tensors, renames), raw, th[0].astype(np.float64), ids[0], ctx_pos[0],
                                 blk_pos[0], ref.to_numpy(drafter.embedding), rules)
    return np.asarray(got[0]), expected


# --------------------------------------------------------------------------------------------------------------
# Muse-Glimmer-30B assistant
# --------------------------------------------------------------------------------------------------------------

ASSISTANT = fixture("assistant-config.json")
ASSISTANT_HEADER = {n: tuple(v["shape"]) for n, v in fixture("assistant-safetensors-header.json").items()
                    if n != "__metadata__"}
ENCODER_NAMES = {"encoder.fc.weight": "fc.weight", "encoder.output_norm_enc.weight": "hidden_norm.weight"}


def test_assistant_config_reads_as_its_loaders_read_it():
    """The published config: what z-lab's MLX loader test asserts of it (block 16, mask, target layers, the
    target's vocabulary 202048 though the file states none, not causal, window 2048, five sliding layers, theta
    5e5), read by the architecture: its model_type `muse_glimmer_assistant` is no reason to refuse it."""
    c = parse_config(ASSISTANT, source="assistant-config.json")
    assert (c.family, c.effective_block_size, c.num_draft_tokens) == ("dflash", 16, 15)
    assert (c.mask_token_id, c.target_layer_ids, c.vocab_size) == (201818, (1, 13, 25, 37, 49), 202048)
    assert (c.hidden_size, c.num_hidden_layers, c.sliding_window, c.rope_theta) == (6656, 5, 2048, 5e5)
    assert c.layer_types == ("sliding_attention",) * 5
    rules = attention_rules(c)
    assert rules == (LayerRule(False, 2048),) * 5
    assert [tuple(r) for r in rules] == ref.assistant_rules(ASSISTANT)


def test_assistant_plan_is_the_published_header():
    """The plan of the real config over the real header: every one of its 58 tensors, at its published shape,
    `encoder.*` placed as fc / hidden_norm; and the test writer writes exactly those names."""
    c = parse_config(ASSISTANT)
    plan = plan_tensors(c, ASSISTANT_HEADER.__contains__)
    assert {t.name: t.shape for t in plan} == ASSISTANT_HEADER
    paths = {t.name: t.path for t in plan}
    assert paths["encoder.fc.weight"] == ("fc", "weight")
    assert paths["encoder.output_norm_enc.weight"] == ("hidden_norm", "weight")
    assert {t.name: t.shape for t in full_plan(c)} == ASSISTANT_HEADER


ASSISTANT_SMALL = scaled(ASSISTANT, num_hidden_layers=2, layer_types=["sliding_attention"] * 2, sliding_window=8,
                         vocab_size=256, mask_token_id=255, target_layer_ids=[1, 3])


def test_assistant_scaled_down_loads_and_matches_the_reference(tmp_path):
    """A scaled-down assistant written under the published names loads (fc / hidden_norm from `encoder.*`) and its
    forward matches the NumPy reference of transformers' assistant (bidirectional, window 8 < 14 context rows)
    with the tensors mapped as z-lab's loader maps them. Measured max |diff| 1.3e-6 in float32; the causal rule's
    hidden states differ by 1.9."""
    write_checkpoint(tmp_path, ASSISTANT_SMALL, seed=2)
    names = written_names(tmp_path)
    assert {"encoder.fc.weight", "encoder.output_norm_enc.weight"} <= names.keys()
    assert not {"fc.weight", "hidden_norm.weight"} & names.keys()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no tensor left over, nothing unsaid
        drafter = attach_random(load_drafter(tmp_path, dtype=jnp.float32))
    tensors = load_file(os.path.join(tmp_path, "model.safetensors"))
    got, expected = forward_and_reference(drafter, tensors, ENCODER_NAMES, ref.assistant_rules(ASSISTANT_SMALL),
                                          folded(tmp_path))
    np.testing.assert_allclose(got, expected, rtol=0, atol=2e-5)
    _, causal = forward_and_reference(drafter, tensors, ENCODER_NAMES, ref.layer_rules(ASSISTANT_SMALL),
                                      folded(tmp_path))
    assert np.abs(causal - got).max() > 1e-2  # the assistant's rule is not the default one: it was tested


@pytest.mark.parametrize("change, says", [
    (lambda t: t.pop("encoder.output_norm_enc.weight"), ("missing tensor 'encoder.output_norm_enc.weight'",
                                                         "'encoder.fc.weight'")),
    (lambda t: t.pop("encoder.fc.weight"), ("missing tensor 'encoder.fc.weight'",)),
    (lambda t: t.update({"encoder.proj.weight": np.zeros((4, 4), np.float32)}),
     ("tensor 'encoder.proj.weight' is not part of", "encoder.fc.weight")),
    (lambda t: t.update({"hidden_norm.weight": t["encoder.output_norm_enc.weight"]}),
     ("tensor 'hidden_norm.weight' beside", "half one layout and half the other")),
], ids=["no-norm", "no-fc", "extra", "mixed"])
def test_assistant_encoder_set_whole_or_refused(tmp_path, change, says):
    """An `encoder.*` set missing one tensor, holding another, or beside fc / hidden_norm: a CheckpointError naming
    the file's directory and the tensor, raised while planning (before anything is placed)."""
    write_checkpoint(tmp_path, ASSISTANT_SMALL)
    rewrite_tensors(tmp_path, change)
    with pytest.raises(CheckpointError) as err:
        load_drafter(tmp_path)
    for word in (str(tmp_path), *says):
        assert word in str(err.value)


# --------------------------------------------------------------------------------------------------------------
# model_type: the architecture decides
# --------------------------------------------------------------------------------------------------------------


def test_a_drafter_carrying_its_targets_model_type_loads(tmp_path):
    """A DFlashDraftModel whose model_type names its MiniMax target is the same Qwen3-style drafter: it loads,
    without a word, and runs as the same network as under `qwen3`."""
    write_checkpoint(tmp_path / "minimax", {**TINY_CONFIGS["tiny-dflash"], "model_type": "minimax_m2"}, seed=1)
    write_checkpoint(tmp_path / "qwen3", TINY_CONFIGS["tiny-dflash"], seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        minimax = load_drafter(tmp_path / "minimax", dtype=jnp.float32)
    qwen3 = load_drafter(tmp_path / "qwen3", dtype=jnp.float32)
    assert minimax.config.family == "dflash"
    for a, b in zip(*(np.asarray(x) for x in (minimax.params["fc"]["weight"], qwen3.params["fc"]["weight"]))):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("model_type, refused", [("minimax_m2", False), ("llama", False), ("gemma4_text", True),
                                                 ("laguna", True), ("nemotron_h", True)])
def test_model_type_alone_refuses_only_another_drafter_network(model_type, refused):
    """Without `architectures`, a model_type naming another drafter network (Gemma, Laguna, Nemotron, ...) is
    refused, naming it; any other (a target's) is not a reason to refuse."""
    raw = {k: v for k, v in TINY_CONFIGS["tiny-dflash"].items() if k != "architectures"}
    raw["model_type"] = model_type
    if not refused:
        assert parse_config(raw).family == "dflash"
        return
    with pytest.raises(ConfigError, match=f"model_type '{model_type}'"):
        parse_config(raw, source="cfg.json")


# --------------------------------------------------------------------------------------------------------------
# vLLM speculators exports
# --------------------------------------------------------------------------------------------------------------

SPEC_DFLASH = fixture("speculators-dflash-config.json")
SPEC_DSPARK = fixture("speculators-dspark-config.json")


def test_speculators_configs_read_as_vllm_reads_them():
    """The nested decoder config unnested; target layers `aux_hidden_state_layer_ids - 1` (vLLM `update_dflash`);
    a reduced draft vocabulary; B-1 drafts for DFlash, B for DSpark (`sample_from_anchor`, as the proposal's
    `speculative_tokens` says); the DSpark head fields; sliding layers causal, full ones not (speculators' default
    `sliding_window_non_causal: false`)."""
    d = parse_config(SPEC_DFLASH)
    assert (d.family, d.architectures, d.hidden_size, d.num_hidden_layers) == ("dflash", ("DFlashDraftModel",), 4096, 3)
    assert (d.target_layer_ids, d.vocab_size, d.draft_vocab_size) == ((1, 9, 17, 25, 33), 151936, 32000)
    assert (d.effective_block_size, d.num_draft_tokens, d.mask_token_id) == (8, 7, 151669)
    assert d.num_draft_tokens == SPEC_DFLASH["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    assert attention_rules(d) == (LayerRule(True, 2048), LayerRule(True, 2048), LayerRule(False, None))
    s = parse_config(SPEC_DSPARK)
    assert (s.family, s.markov_rank, s.enable_confidence_head, s.confidence_head_with_markov) == ("dspark", 256,
                                                                                                 True, True)
    assert (s.target_layer_ids, s.num_draft_tokens) == ((1, 13, 25), 8)
    assert s.num_draft_tokens == SPEC_DSPARK["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    bidirectional = parse_config({**SPEC_DFLASH, "sliding_window_non_causal": True})
    assert attention_rules(bidirectional) == (LayerRule(False, 2048),) * 2 + (LayerRule(False, None),)


def speculators_small(raw: dict, **top) -> dict:
    layer = scaled(raw["transformer_layer_config"], vocab_size=256)
    return {**copy.deepcopy(raw), "transformer_layer_config": layer, "mask_token_id": 255, **top}


def test_speculators_dflash_export_loads_and_matches_the_reference(tmp_path):
    """A scaled-down speculators DFlash export as speculators saves it (embed_tokens [V, H], lm_head [Vd, H],
    d2t [Vd] int64, t2d [V] bool): every tensor planned but t2d (ignored, as vLLM ignores it), the drafter's own
    head preferred, the forward equal to the NumPy reference (sliding layers causal with window 8). Measured
    max |diff| 2.1e-6 in float32."""
    raw = speculators_small(SPEC_DFLASH, draft_vocab_size=48, aux_hidden_state_layer_ids=[2, 4, 6])
    raw["transformer_layer_config"]["sliding_window"] = 8
    c = write_checkpoint(tmp_path, raw, seed=3, own_embeddings=True)
    rewrite_tensors(tmp_path, lambda t: t.update({"t2d": np.isin(np.arange(256), np.arange(48) + t["d2t"])}))
    assert set(written_names(tmp_path)) == {t.name for t in full_plan(c, own_embeddings=True)} | {"t2d"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        drafter = load_drafter(tmp_path, dtype=jnp.float32)
    assert drafter.params["lm_head"]["weight"].shape == (48, 64) and drafter.params["d2t"].shape == (48,)
    tensors = load_file(os.path.join(tmp_path, "model.safetensors"))
    got, expected = forward_and_reference(drafter, tensors, {}, ref.layer_rules(raw["transformer_layer_config"]),
                                          folded(tmp_path))
    np.testing.assert_allclose(got, expected, rtol=0, atol=2e-5)


def test_speculators_dspark_export_drafts_every_row(tmp_path):
    """A scaled-down speculators DSpark export (Markov head, confidence head over [h ; markov_w1[prev]]): it loads
    every head and one `propose` drafts all B rows, the greedy Markov walk of the NumPy reference."""
    raw = speculators_small(SPEC_DSPARK, draft_vocab_size=256, markov_rank=16)
    write_checkpoint(tmp_path, raw, seed=4, own_embeddings=True)
    drafter = load_drafter(tmp_path, dtype=jnp.float32)
    assert {"markov_head", "confidence_head", "embed_tokens", "lm_head"} <= drafter.params.keys()
    proposal, tokens = _propose_once(drafter, folded(tmp_path))
    c = drafter.config
    assert proposal.tokens.shape == (1, c.effective_block_size) == (1, c.num_draft_tokens)
    np.testing.assert_array_equal(np.asarray(proposal.tokens[0]), tokens(rows=slice(0, None), markov=True))


def _propose_once(drafter, raw, S=10, anchor=7):
    """One greedy `propose` after S context rows, and a function giving the reference's greedy drafts over chosen
    block rows (the Markov walk when the drafter has the head)."""
    c = drafter.config
    th = features(drafter, 1, S)
    cache = init_cache(drafter, 1, 64)
    proposal, _ = propose(drafter, cache, th, np.array([S], np.int32), np.array([anchor], np.int32))
    ctx_pos, blk_pos = np.arange(S), S + np.arange(c.effective_block_size)
    params = ref.to_numpy(drafter.params)
    hidden = ref.hidden_states(params, raw, th[0].astype(np.float64), block(drafter, [anchor])[0], ctx_pos, blk_pos,
                               ref.to_numpy(drafter.embedding), ref.layer_rules(_raw_rules(c)))

    def tokens(rows, markov=False):
        logits = hidden[rows] @ ref.to_numpy(drafter.output_head).T
        return ref.markov_greedy(params, logits, anchor) if markov else logits.argmax(-1)

    return proposal, tokens


def _raw_rules(c):
    """A config.json-like dict of the attention fields of `c` (the tiny drafters here state them all)."""
    return {"num_hidden_layers": c.num_hidden_layers, "layer_types": list(c.layer_types) if c.layer_types else None,
            "sliding_window": c.sliding_window, "use_sliding_window": c.use_sliding_window, "is_causal": c.is_causal}


@pytest.mark.parametrize("preset, stated, drafts, rows", [
    ("tiny-dflash", True, 8, slice(0, None)),   # the anchor's row drafts too: B drafts
    ("tiny-dspark", False, 6, slice(1, None)),  # DSpark trained the DFlash way: B-1 drafts, walk from the anchor
])
def test_sample_from_anchor_decides_the_draft_rows(tmp_path, preset, stated, drafts, rows):
    """`sample_from_anchor` (speculators; `dflash_config.sample_from_anchor` as vLLM writes it) decides which block
    rows draft, whatever the family's default; the drafts are the NumPy reference's greedy ones over those rows."""
    raw = copy.deepcopy(TINY_CONFIGS[preset])
    raw.setdefault("dflash_config", {})["sample_from_anchor"] = stated
    write_checkpoint(tmp_path, raw, seed=6)
    drafter = attach_random(load_drafter(tmp_path, dtype=jnp.float32))
    assert drafter.config.sample_from_anchor is stated and drafter.config.num_draft_tokens == drafts
    proposal, tokens = _propose_once(drafter, folded(tmp_path))
    assert proposal.tokens.shape == (1, drafts)
    expected = tokens(rows, markov="markov_head" in drafter.params)
    np.testing.assert_array_equal(np.asarray(proposal.tokens[0]), expected)


@pytest.mark.parametrize("change, says", [
    (lambda r: r.update(speculators_model_type="eagle3"), ("speculators_model_type", "eagle3")),
    (lambda r: r.update(speculators_model_type=["dflash"]), ("speculators_model_type", "['dflash']")),
    (lambda r: r.pop("transformer_layer_config"), ("transformer_layer_config", "missing")),
    (lambda r: r.pop("aux_hidden_state_layer_ids"), ("aux_hidden_state_layer_ids",)),
    (lambda r: r.update(target_hidden_size=2048), ("target_hidden_size", "2048", "4096")),
    (lambda r: r["transformer_layer_config"].update(hidden_act="gelu"), ("hidden_act", "gelu")),
], ids=["eagle3", "unhashable", "no-layer-config", "no-aux-ids", "target-hidden", "activation"])
def test_speculators_exports_refused_by_field(change, says):
    raw = copy.deepcopy(SPEC_DFLASH)
    change(raw)
    with pytest.raises(ConfigError) as err:
        parse_config(raw, source="spec/config.json")
    for word in ("spec/config.json", *says):
        assert word in str(err.value)


@pytest.mark.parametrize("change, says", [
    (lambda r: r.update(aux_hidden_state_layer_ids=[]), "`aux_hidden_state_layer_ids` is empty"),
    (lambda r: r.update(aux_hidden_state_layer_ids=[2, -1]), "[2, -1] has [-1] outside [0, 2147483647]"),
    (lambda r: r.update(aux_hidden_state_layer_ids=[2**31 + 5]), "has [2147483653] outside [0, 2147483647]"),
    (lambda r: (r.update(aux_hidden_state_layer_ids=[2, 9]), r["transformer_layer_config"].update(
        num_target_layers=4)), "[2, 9] has [9] past the 5 hidden states of num_target_layers=4"),
], ids=["empty", "negative", "past-int32", "past-the-target"])
def test_bad_aux_hidden_state_layer_ids_are_refused_by_their_name(change, says):
    """A speculators export's layer ids are folded into `target_layer_ids` (less one): an error names the field
    and the values of the file, not the folded ones."""
    raw = copy.deepcopy(SPEC_DFLASH)
    change(raw)
    with pytest.raises(ConfigError) as err:
        parse_config(raw, source="spec/config.json")
    assert str(err.value).startswith("spec/config.json: ") and says in str(err.value)
    assert "target_layer_ids" not in str(err.value).replace("aux_hidden_state_layer_ids", "")


def test_sample_from_anchor_refused_where_the_family_cannot():
    """DFlash2's selector walks rows 1..B-1: refused naming the field."""
    with pytest.raises(ConfigError, match="sample_from_anchor: true with a DFlash2"):
        parse_config({**TINY_CONFIGS["tiny-dflash2"], "sample_from_anchor": True}, source="cfg.json")


# --------------------------------------------------------------------------------------------------------------
# Laguna, Nemotron, MLA, MoE (and Gemma 4's parts outside a Gemma 4 drafter): refused by the field or tensor
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("change, says", [
    (lambda r: r.update(architectures=["DFlashLagunaForCausalLM"], model_type="laguna"),
     ("DFlashLagunaForCausalLM", "g_proj", "aux_hidden_norms")),
    (lambda r: r.update(gating="per-head"), ("`gating` 'per-head'", "softplus")),
    (lambda r: r.update(attention_k_eq_v=True), ("attention_k_eq_v",)),
    (lambda r: r.update(block_pattern=["mamba", "attention"]), ("block_pattern", "Mamba")),
    (lambda r: r["dflash_config"].update(attention_mode="mla"),
     ("attention_mode` 'mla'", "lacks kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim")),
    (lambda r: r.update(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128),
     ("`kv_lora_rank` (multi-head latent attention)",)),
    (lambda r: r.update(architectures=["K3DSparkModel"]), ("K3DSparkModel", "Kimi-K3")),
    (lambda r: r.update(n_routed_experts=64), ("`n_routed_experts` 64", "mixture-of-experts")),
    (lambda r: r.update(add_swa_attention_sink_bias=True), ("add_swa_attention_sink_bias", "sliding layers only")),
], ids=["laguna", "gate", "k-eq-v", "nemotron-hybrid", "mla-no-ranks", "mla", "kimi-k3", "moe", "mimo-swa-sinks"])
def test_other_networks_refused_by_name(change, says):
    raw = copy.deepcopy(TINY_CONFIGS["tiny-dflash"])
    change(raw)
    with pytest.raises(ConfigError) as err:
        parse_config(raw, source="drafter/config.json")
    for word in ("drafter/config.json", "not implemented", *says):
        assert word in str(err.value)


@pytest.mark.parametrize("name, shape, says", [
    ("layers.0.self_attn.g_proj.weight", (4, 64), "softplus gate"),
    ("aux_hidden_norms.0.weight", (64,), "per-feature norms"),
    ("layers.0.self_attn.qkv_proj.weight", (128, 64), "fused QKV"),
    ("layers.1.self_attn.sinks", (4,), "attention sink"),
    ("layers.1.self_attn.attention_sink_bias", (4,), "the config does not declare"),
    ("layers.0.self_attn.kv_a_proj_with_mqa.weight", (80, 64), "multi-head latent attention"),
    ("layers.0.mlp.experts.0.up_proj.weight", (32, 64), "mixture-of-experts"),
    ("layers.0.pre_feedforward_layernorm.weight", (64,), "sandwich norms"),
])
def test_other_networks_tensors_refused_by_name(tmp_path, name, shape, says):
    """A config that looks Qwen3-style over the tensors of another network: refused by the tensor, its file named."""
    write_checkpoint(tmp_path, "tiny-dflash")
    file = rewrite_tensors(tmp_path, lambda t: t.update({name: np.zeros(shape, np.float32)}))
    with pytest.raises(CheckpointError) as err:
        load_drafter(tmp_path)
    for word in (file, repr(name), says):
        assert word in str(err.value)


@pytest.mark.parametrize("preset, change, says", [
    ("tiny-dflash2", lambda r: r.update(markov_rank=8),
     "dflash_config.conv_kernel_size and dflash_config.selector_rank"),
    ("tiny-dspark", lambda r: r.update(architectures=["DSparkDraftModel", "DFlash2DraftModel"]),
     "architectures 'DFlash2DraftModel'"),
], ids=["dflash2-with-markov", "two-architectures"])
def test_half_one_family_refused(preset, change, says):
    """A config that is half DFlash2 and half DSpark runs neither network: refused naming the fields of both."""
    raw = copy.deepcopy(TINY_CONFIGS[preset])
    change(raw)
    with pytest.raises(ConfigError) as err:
        parse_config(raw, source="drafter/config.json")
    for word in ("drafter/config.json", says, "half one family and half another"):
        assert word in str(err.value)

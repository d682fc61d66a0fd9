"""Where the references disagree (docs/references.md): the attention rule of sliding layers against each
reference's rule, written independently in NumPy (tests/_numpy_reference.py), refused architectures and
extensions, and DFlash2's logit transform kept to DFlash2."""

from __future__ import annotations

import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import CheckpointError, ConfigError, load_drafter
from dflash_jax.config import parse_config
from dflash_jax.drafting import sample_drafts
from dflash_jax.model import AttentionOptions, LayerRule, attention_rules, draft_hidden
from dflash_jax.testing import TINY_CONFIGS, preset_dict, write_checkpoint

from . import _numpy_reference as ref
from ._drafters import block, features
from ._io import rewrite_tensors

# The z-lab Qwen3.6 tf5 layout in small: sliding layers then a full one, a window shorter than the context,
# and no `is_causal` anywhere, the case where the references disagree.
TINY_TF5 = {
    **TINY_CONFIGS["tiny-dflash"],
    "num_hidden_layers": 3,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
    "sliding_window": 8,
    "use_sliding_window": True,
}


def _load(tmp_path, raw, *, sharpen=3.0):
    """A float32 drafter of `raw` with a random target embedding / LM head attached; q/k norm gains sharpened so
    that attention is peaked and the rules' differences show."""
    write_checkpoint(tmp_path, raw, seed=4)
    drafter = load_drafter(tmp_path, dtype=jnp.float32)
    for layer in drafter.params["layers"]:
        for norm in ("q_norm", "k_norm"):
            layer["self_attn"][norm]["weight"] = layer["self_attn"][norm]["weight"] * sharpen
    rng = np.random.default_rng(5)
    shape = (drafter.config.vocab_size, drafter.config.hidden_size)
    return drafter.attach(embed=jnp.asarray(rng.standard_normal(shape), jnp.float32),
                          lm_head=jnp.asarray(rng.standard_normal(shape), jnp.float32))


def _forward(drafter, S=14, attention=AttentionOptions()):
    c = drafter.config
    th, ids = features(drafter, 1, S), block(drafter, [7])
    ctx_pos, blk_pos = np.arange(S)[None], S + np.arange(c.effective_block_size)[None]
    hidden = draft_hidden(drafter, th, ids, context_positions=ctx_pos, block_positions=blk_pos, attention=attention)
    inputs = (th[0].astype(np.float64), ids[0], ctx_pos[0], blk_pos[0], ref.to_numpy(drafter.embedding))
    return np.asarray(hidden[0]), inputs


def test_zlab_rule_is_causal_false_without_windows(tmp_path):
    """z-lab's transformers model (every layer bidirectional, window ignored) is `AttentionOptions(causal=False,
    sliding_window=False)`: same hidden states as the NumPy transcription of it, far from the default rule's."""
    drafter = _load(tmp_path, TINY_TF5)
    c = drafter.config
    zlab_options = AttentionOptions(causal=False, sliding_window=False)
    assert attention_rules(c, zlab_options) == (LayerRule(False, None),) * 3
    zlab, inputs = _forward(drafter, attention=zlab_options)
    expected = ref.hidden_states(ref.to_numpy(drafter.params), TINY_TF5, *inputs, ref.zlab_rules(TINY_TF5))
    np.testing.assert_allclose(zlab, expected, rtol=0, atol=1e-4)
    default, _ = _forward(drafter)
    assert np.linalg.norm(default - zlab) / np.linalg.norm(zlab) > 0.05  # the choice matters on this layout


def test_vllm_v1_single_flag_is_causal_false():
    """vLLM's v1 proposer (one flag, non-causal as soon as a layer is; windows per layer) is `causal=False`."""
    for name in ("zlab-qwen3.6-35b-a3b-dflash-tf5", "muse-glimmer-dflash2", "zlab-qwen3-8b-dflash-b16"):
        c = parse_config(preset_dict(name))
        assert [tuple(r) for r in attention_rules(c, AttentionOptions(causal=False))] == ref.vllm_v1_rules(
            preset_dict(name)), name


@pytest.mark.parametrize("anchor, window, B", [(20, 8, 8), (5000, 4096, 16), (3, 8, 8)])
def test_default_rule_is_specforge_training_mask(anchor, window, B):
    """The default (`sliding_attention` => causal, windowed; full layers bidirectional) sees exactly the keys
    SpecForge's training mask shows a block, context at positions < anchor then the block."""
    raw = {**TINY_TF5, "sliding_window": window, "block_size": B}
    rules = attention_rules(parse_config(raw))
    seq_len = anchor + 5  # training sequences go on past the anchor; the mask must hide that part
    blk_pos = anchor + np.arange(B)
    key_pos = np.concatenate([np.arange(anchor), blk_pos])
    for rule, kind in zip(rules, raw["layer_types"]):
        trained = ref.specforge_block_mask(anchor, seq_len, B, window if kind == "sliding_attention" else None)
        assert not trained[:, anchor:seq_len].any()
        trained = np.concatenate([trained[:, :anchor], trained[:, seq_len:]], axis=1)
        np.testing.assert_array_equal(ref.allowed(blk_pos, key_pos, rule.causal, rule.window), trained)


def test_use_swa_reads_as_vllm():
    """MiMo-style `dflash_config.use_swa` / `swa_window_size`: every layer a non-causal window; a window size
    also replaces `sliding_window` on declared sliding layers; `use_swa` without any window is refused."""
    mimo = {**TINY_CONFIGS["tiny-dflash"], "dflash_config": {**TINY_CONFIGS["tiny-dflash"]["dflash_config"],
                                                            "use_swa": True, "swa_window_size": 6}}
    assert attention_rules(parse_config(mimo)) == (LayerRule(False, 6),) * 2
    causal = {**mimo, "dflash_config": {**mimo["dflash_config"], "causal": True}}
    assert attention_rules(parse_config(causal)) == (LayerRule(True, 6),) * 2
    sized = {**TINY_TF5, "dflash_config": {**TINY_TF5["dflash_config"], "swa_window_size": 5}}
    assert attention_rules(parse_config(sized)) == (LayerRule(True, 5),) * 2 + (LayerRule(False, None),)
    bare = {**mimo, "dflash_config": {**TINY_CONFIGS["tiny-dflash"]["dflash_config"], "use_swa": True}}
    with pytest.raises(ConfigError, match="use_swa"):
        parse_config(bare, source="mimo/config.json")


def _sub(raw, **fields):
    return {**raw, "dflash_config": {**raw["dflash_config"], **fields}}


RULE_CONFIGS = {
    **{name: preset_dict(name) for name in ("tiny-dflash", "tiny-dflash2", "tiny-dspark", "muse-glimmer-dflash2",
                                            "zlab-qwen3.6-35b-a3b-dflash-tf5", "radixark-qwen3.8-27b-dspark")},
    "tf5-no-window": {**TINY_TF5, "use_sliding_window": False},
    "tf5-causal-stated": _sub(TINY_TF5, causal=False),
    "mimo": _sub(TINY_CONFIGS["tiny-dflash"], use_swa=True, swa_window_size=6),
    "mimo-causal": _sub(TINY_CONFIGS["tiny-dflash"], use_swa=True, swa_window_size=6, causal=True),
    "tf5-swa-size": _sub(TINY_TF5, swa_window_size=5),
}


@pytest.mark.parametrize("name", sorted(RULE_CONFIGS))
@pytest.mark.parametrize("attention", [AttentionOptions(), AttentionOptions(causal=True, sliding_window=False),
                                       AttentionOptions(causal=False, draft_window=5, draft_sinks=2)], ids=str)
def test_attention_rules_equal_the_rules_read_from_config_json(name, attention):
    """`attention_rules` (over the package's resolved config) gives per layer what the NumPy reference reads from
    config.json as written (layer types, windows, causality; tests/_numpy_reference.py `layer_rules`)."""
    raw = RULE_CONFIGS[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # configs without a rope_theta
        rules = attention_rules(parse_config(raw), attention)
    expected = ref.layer_rules(raw, attention.causal, attention.sliding_window, attention.draft_window,
                               attention.draft_sinks)
    assert [tuple(r) for r in rules] == expected


def _rewrite_config(directory, change):
    path = directory / "config.json"
    raw = json.loads(path.read_text())
    change(raw)
    path.write_text(json.dumps(raw))
    return str(path)


@pytest.mark.parametrize(
    "change, says",
    [
        (lambda r: r.update(architectures=["LlamaDFlashModel"]), ("LlamaDFlashModel", "DFlashDraftModel")),
        (lambda r: r.update(hidden_act="gelu"), ("hidden_act", "gelu")),
        (lambda r: r["dflash_config"].update(projector_type="domino"), ("projector_type", "domino")),
        (lambda r: r["dflash_config"].update(attention_mode="mla"), ("attention_mode", "mla")),
        (lambda r: r.update(add_swa_attention_sink_bias=True), ("add_swa_attention_sink_bias",)),
        (lambda r: r.update(is_neox_style=False), ("is_neox_style", "interleaved")),
        (lambda r: r.update(markov_head_type="gated"), ("markov_head_type='gated'", "rnn")),
    ],
    ids=["architecture", "activation", "domino", "mla", "swa-sink", "neox", "gated"],
)
def test_unimplemented_configs_refused_by_name(tmp_path, change, says):
    write_checkpoint(tmp_path, "tiny-dflash")
    file = _rewrite_config(tmp_path, change)
    with pytest.raises(ConfigError) as err:
        load_drafter(tmp_path)
    for word in (file, *says):
        assert word in str(err.value)


def test_implemented_extensions_load_silently(tmp_path):
    """What is implemented is accepted without a word: neox RoPE stated, MHA mode, a vanilla head."""
    raw = {**TINY_CONFIGS["tiny-dspark"], "is_neox_style": True, "hidden_act": "silu",
           "dflash_config": {"projector_type": "dspark", "attention_mode": "gqa"}}
    write_checkpoint(tmp_path, raw)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_drafter(tmp_path).config.family == "dspark"


@pytest.mark.parametrize(
    "preset, name, shape, says",
    [
        ("tiny-dflash", "layers.1.self_attn.attention_sink_bias", (4,), "the config does not declare"),
        ("tiny-dspark", "markov_head.gate_proj.weight", (32, 96), "gated Markov head"),
        ("tiny-dspark", "markov_head.joint_proj.weight", (96, 128), "RNN Markov head"),
        ("tiny-dflash", "mask_embedding", (64,), "mask embedding"),
    ],
)
def test_unimplemented_tensors_refused_by_name(tmp_path, preset, name, shape, says):
    write_checkpoint(tmp_path, preset)
    file = rewrite_tensors(tmp_path, lambda t: t.update({name: np.zeros(shape, np.float32)}))
    with pytest.raises(CheckpointError) as err:
        load_drafter(tmp_path)
    for word in (str(file), repr(name), says):
        assert word in str(err.value)


def test_mask_embedding_file_refused(tmp_path):
    write_checkpoint(tmp_path, "tiny-dflash")
    (tmp_path / "mask_embedding.pt").write_bytes(b"\x80\x02}q\x00.")  # what vLLM would torch.load
    with pytest.raises(CheckpointError, match="mask_embedding.pt.*mask embedding"):
        load_drafter(tmp_path)


@pytest.mark.parametrize("where", ["top", "nested"])
def test_logit_transform_only_for_dflash2(tmp_path, where):
    """A DFlash drafter carrying DFlash2's fields is warned about and samples from the plain LM-head logits."""
    fields = {"final_logit_softcapping": 0.5, "output_multiplier": 3.0}
    raw = dict(TINY_CONFIGS["tiny-dflash"])
    if where == "top":
        raw.update(fields)
    else:
        raw["dflash_config"] = {**raw["dflash_config"], **fields}
    with pytest.warns(UserWarning, match="final_logit_softcapping=0.5.*not applied.*DFlash2") as record:
        drafter = _load(tmp_path, raw)
    assert all("not applied" in str(w.message) for w in record)  # written, then loaded: one warning each
    assert drafter.config.logit_transform == (None, None)
    hidden = jnp.asarray(np.random.default_rng(0).standard_normal((2, 7, drafter.config.hidden_size)), jnp.float32)
    proposal = sample_drafts(drafter, hidden, jnp.array([3, 4]), key=jax.random.key(0), temperature=0.7)
    plain = ref.to_numpy(hidden) @ ref.to_numpy(drafter.lm_head).T / 0.7
    expected = np.exp(plain - plain.max(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(proposal.probs), expected / expected.sum(-1, keepdims=True), atol=1e-5)


def test_dflash2_transform_from_dflash_config_only():
    """DFlash2 takes the values in `dflash_config` (SpecForge, vLLM); top-level copies are warned, not applied."""
    dflash2 = TINY_CONFIGS["tiny-dflash2"]
    assert parse_config(dflash2).logit_transform == (0.5, 20.0)
    dropped = ("final_logit_softcapping", "output_multiplier")
    sub = {k: v for k, v in dflash2["dflash_config"].items() if k not in dropped}
    with pytest.warns(UserWarning, match="final_logit_softcapping=30.0 not applied"):
        top = parse_config({**dflash2, "dflash_config": sub, "final_logit_softcapping": 30.0})
    assert top.logit_transform == (None, None)

"""The Qwen3.5 hybrid target (`target.qwen3_5`): parity with transformers, chunked prefill, verify + commit.

Reference: `tests/data/qwen3_5/` (made by `make_reference.py` with transformers 5.24.0, float32, eager attention):
a tiny random `Qwen3_5ForCausalLM` (3 Gated DeltaNet layers + 1 gated attention layer) and, for 48 tokens, its
logits and hidden states of one uncached forward. Everything here runs in float32.
"""

from __future__ import annotations

import json
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import msgspec
import numpy as np
import pytest

from dflash_jax import CheckpointError, ConfigError, load_target
from dflash_jax.safetensors import Checkpoint, write_tensors
from dflash_jax.target.delta_net import STORED
from dflash_jax.target.qwen3_5 import HybridCache, Qwen3_5Target
from dflash_jax.target.qwen3_5_config import parse_qwen3_5_config
from dflash_jax.testing import QWEN3_5_TINY_CONFIGS, random_qwen3_5, write_checkpoint, write_qwen3_5_checkpoint

from ._feature_maps import numpy_squash, squash
from .conftest import DATA

REFERENCE = f"{DATA}/qwen3_5"
# Float32 rounding moves this model's deep features and logits by up to a few 1e-4: it is that sensitive to the
# delta-net keys (scaling them by 1 + 2^-21, 4 ulp, moved the deepest features 6.4e-5 -> 1.6e-4 from
# transformers'), and the q/k/v parts computed as three products round the keys' l2 norm differently from one
# fused product (3e-8), which took the deepest features from 8.4e-5 to 4.1e-4 and a prompt's last logits from
# 1.8e-5 to 2.6e-4; the one input product of all six (`target.delta_net`) brought them back to 1.4e-4 and 9e-5.
# Our float32 forward is 1.3e-4 to 2.0e-4 from a float64 run of itself (transformers' 7e-5).
FEATURES_ATOL, LOGITS_ATOL = 6e-4, 4e-4
PROMPT = 40  # prompt rows of the reference's 48 tokens
CHUNK, DELTA_CHUNK = 16, 8  # prefill chunks of 16 rows (40 = 16 + 16 + 8), the delta rule's of 8 within
LAYER_IDS = (-1, 0, 2, 3)  # the embedding, two delta-net layers' outputs, the last layer after the final norm
MORE = [7, 99, 3, 64, 12]  # tokens after the reference's 48, for the verify blocks
PROJECT, PROJECTION = squash(len(LAYER_IDS) * 64, 48)  # a row-wise map the chunked prefill applies to its features


@pytest.fixture(scope="module")
def ref():
    with Checkpoint(f"{REFERENCE}/reference.safetensors") as c:
        arrays = {name: c.array(name) for name in c}
    tokens = np.concatenate([arrays["tokens"][0], MORE]).astype(np.int32)
    target = Qwen3_5Target.from_pretrained(REFERENCE, dtype=jnp.float32)
    return target, tokens, arrays


@pytest.fixture(scope="module")
def decoded(ref):
    """The prompt prefilled in chunks, its features through `PROJECT` a chunk at a time, then every further token
    decoded alone (`__call__` + `commit(kept=1)`): per step its logits `[V]` and the committed cache before it."""
    target, tokens, _ = ref
    with jax.default_matmul_precision("float32"):
        out = target.prefill(jnp.asarray(tokens[None, :PROMPT]), target.init_cache(1, 64), jnp.array([PROMPT]),
                             layer_ids=LAYER_IDS, chunk=CHUNK, delta_chunk=DELTA_CHUNK, project=PROJECT)
        caches, logits = [out.cache], []
        for t in range(PROMPT, len(tokens)):
            step = target(jnp.asarray(tokens[None, t:t + 1]), caches[-1], jnp.array([t]))
            logits.append(np.asarray(step.logits[0, 0]))
            caches.append(target.commit(step.cache, jnp.array([1])))
    return out, caches, np.stack(logits)


def test_parity_with_transformers(ref):
    """One prefill chunk over all 48 tokens: features at LAYER_IDS and the last logits, against transformers."""
    target, tokens, arrays = ref
    n = len(arrays["tokens"][0])
    with jax.default_matmul_precision("float32"):
        out = target.prefill(jnp.asarray(tokens[None, :n]), target.init_cache(1, 64), jnp.array([n]),
                             layer_ids=LAYER_IDS, chunk=64, delta_chunk=DELTA_CHUNK)
    features = np.asarray(out.features).reshape(1, n, len(LAYER_IDS), -1)
    for j, layer in enumerate(LAYER_IDS):
        # measured: 0 (embedding), 3.9e-6, 1.4e-4, 9.4e-5 (|hidden| <= 5; errors grow through the layers; the
        # rounding note at the top). The delta rule in chunks of 8 rows (`target.delta_rule`)
        np.testing.assert_allclose(features[:, :, j], arrays["hidden_states"][layer + 1], atol=FEATURES_ATOL,
                                   rtol=0)
    # measured 1.1e-5 (|logits| <= 3.6)
    np.testing.assert_allclose(np.asarray(out.logits), arrays["logits"][:, n - 1], atol=2e-5, rtol=0)


def test_chunked_prefill_then_decode_equals_one_forward(ref, decoded):
    """The prompt in chunks of 16 (40 = 16 + 16 + 8), then token by token: the logits of transformers' one
    forward over all 48, and its hidden states for the prompt rows (through `PROJECT`, as the prefill maps them)."""
    _, _, arrays = ref
    out, _, logits = decoded
    n = len(arrays["tokens"][0])
    # measured 9e-5 (prefill), 4.7e-5 (decode; transformers' own decode against its forward: 3.2e-5); the
    # rounding note at the top
    np.testing.assert_allclose(np.asarray(out.logits), arrays["logits"][:, PROMPT - 1], atol=LOGITS_ATOL, rtol=0)
    np.testing.assert_allclose(logits[:n - PROMPT], arrays["logits"][0, PROMPT:], atol=LOGITS_ATOL, rtol=0)
    np.testing.assert_allclose(logits[:n - PROMPT], arrays["decode_logits"][0], atol=LOGITS_ATOL, rtol=0)
    features = np.concatenate([arrays["hidden_states"][layer + 1][0, :PROMPT] for layer in LAYER_IDS], axis=-1)
    # measured 1.1e-4 (|mapped| < 1; the features' own errors up to 4.1e-4, averaged by the map's unit columns)
    np.testing.assert_allclose(np.asarray(out.features[0]), numpy_squash(PROJECTION, features), atol=2e-4, rtol=0)


def _assert_caches_close(a: HybridCache, b: HybridCache, length: int, atol: float) -> None:
    """Conv and recurrent states, and the K/V of the first `length` slots, within `atol` (0: bit for bit)."""
    pairs = list(zip(jax.tree.leaves((a.conv, a.state)), jax.tree.leaves((b.conv, b.state))))
    pairs += [(x[:, :, :length], y[:, :, :length]) for x, y in zip(a.k + a.v, b.k + b.v)]
    for x, y in pairs:
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, rtol=0)


@pytest.mark.parametrize("start", [PROMPT, 46], ids=["after-prompt", "straddling-48"])
def test_verify_then_commit_equals_decoding_the_kept_tokens(ref, decoded, start):
    """A block of S = 4 tokens verified at once, then `commit(kept=k)` for every k in 0..S: the cache (conv and
    recurrent states, committed K/V) and the next token's logits are those of decoding the k tokens alone, and
    the rejected rows leave no trace (a block with other tokens after row k commits bit for bit the same
    cache). One block follows the chunked prompt, one straddles the prefill's chunk grid (positions 46..49)."""
    target, tokens, _ = ref
    _, caches, logits = decoded
    S, i = 4, start - PROMPT  # caches[i]: committed before position `start`
    with jax.default_matmul_precision("float32"):
        block = target(jnp.asarray(tokens[None, start:start + S]), caches[i], jnp.array([start]))
        # The block's rows are the decoded ones up to rounding: a [1, 4, H] product sums in another order than a
        # [1, 1, H] one, and the layers carry it (measured: 2.8e-5 on the block's logits, 1.1e-5 on the next
        # token's, 3.1e-5 on the committed caches (layer 3's keys); 0 between the two blocks).
        np.testing.assert_allclose(np.asarray(block.logits[0]), logits[i:i + S], atol=1e-4, rtol=0)
        for kept in range(S + 1):
            committed = target.commit(block.cache, jnp.array([kept]))
            _assert_caches_close(committed, caches[i + kept], start + kept, atol=1e-4)
            other = np.where(np.arange(S) < kept, tokens[start:start + S], (tokens[start:start + S] + 1) % 128)
            rejected = target(jnp.asarray(other[None]), caches[i], jnp.array([start]))
            _assert_caches_close(target.commit(rejected.cache, jnp.array([kept])), committed, start + kept, atol=0)
            nxt = target(jnp.asarray(tokens[None, start + kept:start + kept + 1]), committed, jnp.array([start + kept]))
            np.testing.assert_allclose(np.asarray(nxt.logits[0, 0]), logits[i + kept], atol=1e-4, rtol=0)


def test_ragged_batch(ref):
    """Two prompts of 40 and 27 tokens, right-padded (with token 0) in one batch: each prompt's last logits and
    the next decoded token's are transformers' (the padding rows never touch the delta-net states)."""
    target, tokens, arrays = ref
    lengths = np.array([PROMPT, 27])
    prompts = np.stack([tokens[:PROMPT], np.where(np.arange(PROMPT) < 27, tokens[:PROMPT], 0)])
    with jax.default_matmul_precision("float32"):
        out = target.prefill(jnp.asarray(prompts), target.init_cache(2, 64), jnp.asarray(lengths), chunk=CHUNK,
                             delta_chunk=DELTA_CHUNK)
        step = target(jnp.asarray(tokens[lengths][:, None]), out.cache, jnp.asarray(lengths))
    expected = arrays["logits"][0]
    # measured 2.6e-4, 1.5e-4 (the rounding note at the top)
    np.testing.assert_allclose(np.asarray(out.logits), expected[lengths - 1], atol=LOGITS_ATOL, rtol=0)
    np.testing.assert_allclose(np.asarray(step.logits[:, 0]), expected[lengths], atol=LOGITS_ATOL, rtol=0)


@pytest.mark.parametrize("changes, tp, named", [
    ({}, 8, "linear_num_key_heads=4"),  # 8 value heads divide, their 4 key heads do not
    ({"linear_num_key_heads": 8}, 8, None),  # one key head per value head: divides
    ({"linear_num_value_heads": 12, "linear_num_key_heads": 4}, 8, "linear_num_value_heads=12, linear_num_key_heads=4"),
    ({"num_attention_heads": 12}, 8, "num_attention_heads=12"),
    ({"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 6, "shared_expert_intermediate_size": 32,
      "model_type": "qwen3_5_moe_text", "architectures": ["Qwen3_5MoeForCausalLM"]}, 4, "moe_intermediate_size=6"),
])
def test_a_tensor_axis_must_divide_the_split_fields(tmp_path, changes, tp, named):
    """The tensor axis against every field it splits: a ConfigError naming each field that does not divide, raised
    before the checkpoint is opened (the directory holds only config.json)."""
    (tmp_path / "config.json").write_text(json.dumps({**QWEN3_5_TINY_CONFIGS["tiny-qwen3_5-tp"], **changes}))
    mesh = jax.make_mesh((8 // tp, tp), ("data", "model"))
    if named is None:  # past the layout: the missing weights are what is refused
        with pytest.raises(CheckpointError, match="no such file|safetensors"):
            Qwen3_5Target.from_pretrained(tmp_path, mesh=mesh, dtype=jnp.float32)
        return
    with pytest.raises(ConfigError, match=rf"tensor axis 'model' has {tp} devices, which does not divide {named}"):
        Qwen3_5Target.from_pretrained(tmp_path, mesh=mesh, dtype=jnp.float32)


def test_a_drafter_directory_is_refused_as_a_target(tmp_path):
    """A DFlash drafter's directory given as a hybrid target: named as a drafter, before any tensor is read."""
    write_checkpoint(tmp_path, "tiny-dflash")
    with pytest.raises(ConfigError, match=r"a DFlash-family drafter \(load it with load_drafter\).*Qwen3_5ForCausalLM"):
        Qwen3_5Target.from_pretrained(tmp_path, dtype=jnp.float32)


def test_multimodal_checkpoint_loads_the_text_model(tmp_path):
    """A `Qwen3_5ForConditionalGeneration` checkpoint: its `model.language_model.*` tensors are the text
    model's (the same draws as the text checkpoint), `model.visual.*` and `mtp.*` are skipped."""
    write_qwen3_5_checkpoint(tmp_path / "vl", "tiny-qwen3_5-vl", seed=1, dtype="float32")
    write_qwen3_5_checkpoint(tmp_path / "text", "tiny-qwen3_5", seed=1, dtype="float32")
    with Checkpoint(tmp_path / "vl") as c:
        assert {"model.visual.patch_embed.proj.weight", "mtp.fc.weight"} <= set(c)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the vision tower and the MTP head are not the text model: no warning
        vl = load_target(tmp_path / "vl", dtype=jnp.float32)
    text = load_target(tmp_path / "text", dtype=jnp.float32)
    assert msgspec.structs.replace(vl.config, architectures=text.config.architectures) == text.config
    jax.tree.map(np.testing.assert_array_equal, vl.params, text.params)


def test_tensors_the_text_model_does_not_use_are_warned_about(tmp_path):
    """Beside the skipped `model.visual.*` / `mtp.*`, any other tensor the plan does not use is named in a warning
    (a checkpoint of another configuration would otherwise load its matching part silently)."""
    write_qwen3_5_checkpoint(tmp_path, "tiny-qwen3_5-vl", seed=1, dtype="float32")
    extra = "model.language_model.layers.0.self_attn.q_proj.weight"  # layer 0 is a delta-net layer
    with Checkpoint(tmp_path) as c:
        arrays = {name: np.array(c.array(name)) for name in c}
    write_tensors(tmp_path, {**arrays, extra: np.ones((4, 4), np.float32)})
    with pytest.warns(UserWarning, match=r"1 unexpected tensors ignored: \['model.language_model.layers.0.self_attn"):
        load_target(tmp_path, dtype=jnp.float32)


def test_random_bf16_target_verifies_and_commits():
    """A random bf16 target (tied embeddings), the production dtype: a ragged prefill, a verify block of S = 3
    and a commit; the pending cache holds S + 1 states and K - 1 + S conv rows, the committed one the shapes of
    an empty cache (whatever S: a while_loop carry)."""
    target = random_qwen3_5("tiny-qwen3_5-tied", dtype=jnp.bfloat16)
    assert target.lm_head is target.embed and target.num_layers == 2 and target.hidden_size == 64
    assert target.config.layer_types == ("linear_attention", "full_attention")
    empty = target.init_cache(2, 16)
    out = target.prefill(jnp.array([[3, 4, 5, 6], [7, 8, 0, 0]]), empty, jnp.array([4, 2]), layer_ids=(0, 1))
    block = target(jnp.array([[9, 10, 11], [12, 13, 14]]), out.cache, jnp.array([4, 2]), layer_ids=(0, 1))
    assert block.logits.shape == (2, 3, 128) and block.features.shape == (2, 3, 128)
    assert block.cache.state[0].shape == (2, 4, 4, 16, 16)
    assert block.cache.conv[0].shape == (2, 6, 128)  # the q, k, v channels, one array
    committed = target.commit(block.cache, jnp.array([3, 1]))
    assert jax.tree.map(lambda a: (a.shape, a.dtype), committed) == jax.tree.map(lambda a: (a.shape, a.dtype), empty)
    assert committed.state[0].dtype == jnp.float32 and committed.conv[0].dtype == jnp.bfloat16
    assert np.isfinite(np.asarray(block.logits)).all()


@pytest.mark.parametrize("change, field", [
    ({"layer_types": ["linear_attention", "sliding_attention"] * 3}, r"layer_types\[1\] is 'sliding_attention'"),
    ({"layer_types": ["full_attention"] * 5}, "layer_types has 5 entries for num_hidden_layers=2"),
    ({"num_key_value_heads": 3}, "num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    ({"linear_num_key_heads": 3}, "linear_num_value_heads=4 is not a multiple of linear_num_key_heads=3"),
    ({"attn_output_gate": False}, "attn_output_gate"),
    ({"architectures": ["Qwen3_5MoeForCausalLM"]}, "disagree with model_type 'qwen3_5_text'"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "rope type 'yarn'"),
    ({"partial_rotary_factor": 0.5}, r"partial_rotary_factor \(0.5\) disagrees"),
    ({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.1}}, "gives 1 rotary dimensions"),
])
def test_bad_configs_are_refused_by_field(change, field):
    with pytest.raises(ConfigError, match=field):
        parse_qwen3_5_config({**QWEN3_5_TINY_CONFIGS["tiny-qwen3_5"], **change}, source="cfg")


def test_a_missing_text_config_is_refused():
    vl = QWEN3_5_TINY_CONFIGS["tiny-qwen3_5-vl"]
    with pytest.raises(ConfigError, match="text_config"):
        parse_qwen3_5_config({k: v for k, v in vl.items() if k != "text_config"})


@pytest.mark.parametrize("name, change, message", [
    ("model.layers.0.linear_attn.A_log", None, "missing tensor 'model.layers.0.linear_attn.A_log'"),
    ("model.layers.0.linear_attn.in_proj_qkv.weight", None,
     r"missing tensor 'model.layers.0.linear_attn.in_proj_qkv.weight' \(the delta net's fused q, k, v projection, "
     r"expected shape \[128, 64\]\)"),
    ("model.layers.0.linear_attn.conv1d.weight", lambda a: a[:-16],  # the v channels of one head short
     r"'model.layers.0.linear_attn.conv1d.weight' has shape \[112, 1, 4\], expected \[128, 1, 4\]"),
    ("model.layers.0.linear_attn.in_proj_z.weight", None,
     r"missing tensor 'model.layers.0.linear_attn.in_proj_z.weight' \(the delta net's z \(gate\) projection, "
     r"expected shape \[64, 64\]\)"),
    ("model.layers.0.linear_attn.in_proj_b.weight", lambda a: a.astype(ml_dtypes.float8_e4m3fn),  # FP8: not merged
     r"'model.layers.0.linear_attn.in_proj_b.weight' \(the delta net's beta projection\) has dtype F8_E4M3, "
     r"expected one of BF16, F16, F32, F64"),
])
def test_a_missing_or_misshapen_delta_net_tensor_is_refused_by_name(tmp_path, name, change, message):
    """Also the four stored tensors the tree reads as one (`delta_net.STORED`): named as stored. They are read as
    stored, float only (a quantized one, whose scale is its own, is refused: `in_proj_qkv` always had to be)."""
    write_qwen3_5_checkpoint(tmp_path, "tiny-qwen3_5", dtype="float32")
    with Checkpoint(tmp_path) as c:
        arrays = {n: np.array(c.array(n)) for n in c}
    if change is None:
        del arrays[name]
    else:
        arrays[name] = change(arrays[name])
    (tmp_path / "model.safetensors").unlink()
    write_tensors(tmp_path, arrays)
    with pytest.raises(CheckpointError, match=message):
        Qwen3_5Target.from_pretrained(tmp_path, dtype=jnp.float32)


def test_a_delta_net_in_proj_beside_its_stored_parts_is_refused(tmp_path):
    """An `in_proj` (the tree's one input projection) stored beside the `in_proj_qkv` / z / b / a it concatenates
    (with other values): refused naming both, where one of them would load and the other be ignored."""
    write_qwen3_5_checkpoint(tmp_path, "tiny-qwen3_5", dtype="float32")
    with Checkpoint(tmp_path) as c:
        arrays = {n: np.array(c.array(n)) for n in c}
    layer = "model.layers.0.linear_attn."
    arrays[layer + "in_proj.weight"] = -np.concatenate([arrays[layer + name] for name in STORED])
    (tmp_path / "model.safetensors").unlink()
    write_tensors(tmp_path, arrays)
    with pytest.raises(CheckpointError, match=rf"model.safetensors: tensor '{layer}in_proj.weight' is stored "
                                              rf"beside '{layer}in_proj_qkv.weight'.*expected one of them"):
        Qwen3_5Target.from_pretrained(tmp_path, dtype=jnp.float32)


def test_the_dense_targets_load_guards_hold(tmp_path):
    """An integer dtype (all-zero weights) and a NaN norm gain are refused before anything is placed, as
    `DecoderTarget.from_pretrained` refuses them."""
    write_qwen3_5_checkpoint(tmp_path, "tiny-qwen3_5", seed=1, dtype="float32")
    with pytest.raises(ValueError, match="dtype=int8"):
        Qwen3_5Target.from_pretrained(tmp_path, dtype=jnp.int8)
    broken = "model.layers.1.input_layernorm.weight"
    with Checkpoint(tmp_path) as c:
        arrays = {name: np.array(c.array(name)) for name in c}
    arrays[broken][1] = np.nan
    for f in tmp_path.glob("*.safetensors"):
        f.unlink()
    write_tensors(tmp_path, arrays)
    with pytest.raises(CheckpointError, match=broken):
        load_target(tmp_path, dtype=jnp.float32)


@pytest.mark.parametrize("argument, value, error", [("chunk", 0, ValueError), ("delta_chunk", 0, ValueError),
                                                    ("chunk", 64.0, TypeError), ("delta_chunk", True, TypeError)])
def test_bad_prefill_chunks_are_refused_by_name(argument, value, error):
    """Before anything is traced (the target's weights are shapes only)."""
    target = jax.eval_shape(random_qwen3_5)
    with pytest.raises(error, match=f"prefill: {argument}"):
        target.prefill(jnp.zeros((1, 8), jnp.int32), None, jnp.array([8]), **{argument: value})

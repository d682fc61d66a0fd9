"""Tensor-parallel targets (Qwen3, Llama 3) on a mesh, the drafter replicated beside them; `load_target`.

On the 8 simulated CPU devices: for meshes (1, 8), (4, 2), (8, 1) over ("data", "model"), speculative tokens
(and on (4, 2) greedy ones) equal the single-device run's and every leaf (and the cache) has its planned sharding; on
(2, 4), the vocabulary-sharded embedding and LM head are used without being gathered; the Llama target equals the NumPy
reference in both config layouts; the fused prefill run a sequence at a time on a mesh equals the unsharded one; bad
tensor axes and unknown architectures are refused by name.
"""

from __future__ import annotations

import json
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from dflash_jax import ConfigError, DecoderTarget, load_drafter, load_target
from dflash_jax._qwen3_testing import QWEN3_TINY_CONFIGS, write_qwen3_checkpoint
from dflash_jax.generate import greedy_generate, speculative_generate
from dflash_jax.layers import lm_logits
from dflash_jax.target.config import LlamaConfig, Qwen3Config, parse_decoder_config
from dflash_jax.target.dense import Qwen3Target, plan_decoder, prefill_fused
from dflash_jax.target.layout import CACHE_AXES, make_layout
from dflash_jax.testing import write_checkpoint

from . import _io
from ._numpy_reference import numpy_decoder

# Speculative runs here use the fixed draft length: one verify shape to compile per pair (the adaptive default
# compiles four); its losslessness is test_generate.py's and test_adaptive.py's.

MESHES = [(1, 8), (4, 2), (8, 1)]  # tensor only, KV heads replicated; both, KV heads split; data only
# 8 prompts, so every data axis up to 8 splits the batch
PROMPTS = [[5, 17, 99, 3], [120, 4], [9, 9, 9], [1, 2, 3, 4, 5], [7], [8, 8, 60], [100, 101], [3, 3, 3, 3, 3, 3]]
MAX_NEW = 6


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny tensor-parallel Qwen3 target (8 heads, 2 KV heads; float32) and a tiny DFlash drafter, with the
    single-device greedy and speculative tokens."""
    root = tmp_path_factory.mktemp("tp")
    write_qwen3_checkpoint(root / "target", "tiny-qwen3-tp", seed=5, dtype="float32")
    write_checkpoint(root / "drafter", "tiny-dflash", seed=2)
    target = load_target(root / "target", dtype=jnp.float32)
    drafter = load_drafter(root / "drafter", dtype=jnp.float32)
    greedy = greedy_generate(target, PROMPTS, max_new_tokens=MAX_NEW).tokens
    spec = speculative_generate(target, drafter, PROMPTS, max_new_tokens=MAX_NEW, draft_length="fixed").tokens
    assert spec == greedy
    return root, greedy


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_sharded_generation_equals_single_device(pair, shape):
    root, expected = pair
    mesh = jax.make_mesh(shape, ("data", "model"))
    target = load_target(root / "target", mesh=mesh, dtype=jnp.float32)
    drafter = load_drafter(root / "drafter", mesh=mesh, dtype=jnp.float32)
    data, tp = shape
    kv = "model" if tp <= 2 else None  # 2 KV heads: split over 2 devices, replicated over 4 or 8
    planned = {  # by hand, from the Megatron recipe
        "model.embed_tokens.weight": P("model", None), "lm_head.weight": P("model", None), "model.norm.weight": P(None),
        "model.layers.3.self_attn.q_proj.weight": P("model", None),
        "model.layers.3.self_attn.k_proj.weight": P(kv, None), "model.layers.3.self_attn.v_proj.weight": P(kv, None),
        "model.layers.3.self_attn.o_proj.weight": P(None, "model"),
        "model.layers.3.mlp.gate_proj.weight": P("model", None), "model.layers.3.mlp.up_proj.weight": P("model", None),
        "model.layers.3.mlp.down_proj.weight": P(None, "model"),
        "model.layers.3.self_attn.k_norm.weight": P(None), "model.layers.3.input_layernorm.weight": P(None),
    }
    plan = plan_decoder(target.config)
    assert len(jax.tree.leaves(target.params)) == len(plan)
    for t in plan:
        leaf = _io.leaf(target.params, t.path)
        assert leaf.sharding == target.layout.sharding(t.axes), t.name
        if t.name in planned:
            assert leaf.sharding.spec == planned[t.name], t.name
        shard = leaf.addressable_shards[0].data.shape  # each device holds only its part
        assert math.prod(shard) == math.prod(t.shape) // math.prod(
            tp for axis in leaf.sharding.spec if axis == "model")
    for leaf in jax.tree.leaves(drafter.params):
        assert leaf.sharding.mesh == target.layout.mesh and leaf.sharding.is_fully_replicated

    planned_cache = target.layout.sharding(CACHE_AXES, len(PROMPTS))
    assert planned_cache.spec == P(("data",), kv, None, None)
    for k in target.init_cache(len(PROMPTS), 32).k:
        assert k.sharding == planned_cache
    if kv == "model" and data > 1:  # the plain greedy loop on the mesh that splits everything (suite time)
        assert greedy_generate(target, PROMPTS, max_new_tokens=MAX_NEW).tokens == expected
    assert speculative_generate(target, drafter, PROMPTS, max_new_tokens=MAX_NEW,
                                draft_length="fixed").tokens == expected


def _all_gathers(hlo: str) -> list[int]:
    """Element counts of the results of every all-gather (sync or async) in an optimised HLO module."""
    sizes = []
    for line in hlo.splitlines():
        lhs, found, _ = line.partition(" all-gather")
        if found and "=" in lhs:
            for dims in re.findall(r"\[([\d,]*)\]", lhs.split("=", 1)[1]):
                sizes.append(math.prod(int(d) for d in dims.split(",") if d))
    return sizes


def test_vocab_sharded_head_is_never_gathered(pair):
    """The drafter's uses of the target's embedding and LM head, sharded over the vocabulary: a lookup, logits
    and their argmax equal the unsharded ones, and no all-gather in the program is as large as the table."""
    root, _ = pair
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    target = load_target(root / "target", mesh=mesh, dtype=jnp.float32)
    head, embed = target.lm_head, target.embed  # [V, H], P("model", None)
    assert head.sharding.spec == P("model", None) and embed.sharding.spec == P("model", None)
    ids = jnp.asarray([[1, 64, 127, 5], [33, 2, 90, 126]], jnp.int32)

    def use(embed, head, ids):
        hidden = jnp.take(embed, ids, axis=0) * 2.0  # [batch, S, H]
        logits = lm_logits(hidden, head)  # [batch, S, V]
        return logits, jnp.argmax(logits, axis=-1)

    run = jax.jit(use)
    logits, best = run(embed, head, ids)
    e, h = np.asarray(embed, np.float64), np.asarray(head, np.float64)
    want = (e[np.asarray(ids)] * 2.0) @ h.T
    np.testing.assert_allclose(np.asarray(logits), want, rtol=0, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(best), want.argmax(-1))
    gathered = _all_gathers(run.lower(embed, head, ids).compile().as_text())
    V, H = head.shape
    assert all(n < V * H // 4 for n in gathered), gathered  # at most per-shard maxima and indices


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-llama-v5", "tiny-llama-tied"])
def test_llama_matches_numpy_reference(tmp_path, preset):
    """Llama 3 (no q/k norm, `llama3` RoPE in the transformers-4 and -5 layouts, tied or not) against the NumPy
    decoder, on one device and tensor-parallel over 4."""
    write_qwen3_checkpoint(tmp_path, preset, seed=7, dtype="float32")
    config = load_target(tmp_path, dtype=jnp.float32).config
    assert isinstance(config, LlamaConfig) and config.rope_type == "llama3" and config.head_dim == 8
    prompt = [5, 17, 99, 3, 64, 2, 88, 41, 7, 120, 33]
    logits, states = numpy_decoder(str(tmp_path), prompt)
    for mesh in (None, jax.make_mesh((2, 4), ("data", "model"))):
        target = load_target(tmp_path, mesh=mesh, dtype=jnp.float32)
        assert "q_norm" not in target.params["layers"][0]["self_attn"]
        out = target(jnp.asarray([prompt, prompt]), target.init_cache(2, 16), jnp.zeros(2, jnp.int32),
                     layer_ids=(-1, 0, 1))
        np.testing.assert_allclose(np.asarray(out.logits[1]), logits, rtol=0, atol=2e-4)
        np.testing.assert_allclose(np.asarray(out.features[0, :, 64:128]), states[1], rtol=0, atol=2e-4)
        if mesh is not None:  # what comes out of a forward keeps the cache's planned layout (KV heads replicated)
            planned = target.layout.sharding(CACHE_AXES, 2)
            assert planned.spec == P(("data",), None, None, None)
            assert all(k.sharding.is_equivalent_to(planned, 4) for k in out.cache.k + out.cache.v)


def test_llama3_rope_layouts_agree():
    """The transformers-4 (`rope_theta` + `rope_scaling`) and -5 (`rope_parameters`) layouts: one config."""
    a = parse_decoder_config(QWEN3_TINY_CONFIGS["tiny-llama"], LlamaConfig)
    b = parse_decoder_config(QWEN3_TINY_CONFIGS["tiny-llama-v5"], LlamaConfig)
    assert (a.rope_theta, a.rope_type, a.rope_scaling.factor, a.rope_scaling.low_freq_factor) == (
        b.rope_theta, b.rope_type, b.rope_scaling.factor, b.rope_scaling.low_freq_factor) == (500000.0, "llama3", 8, 1)
    bad = {**QWEN3_TINY_CONFIGS["tiny-llama"], "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
    with pytest.raises(ConfigError, match="low_freq_factor, high_freq_factor, original_max_position_embeddings"):
        parse_decoder_config(bad, LlamaConfig)


@pytest.mark.parametrize("changes, mesh, named", [
    ({"num_attention_heads": 4}, (1, 8), "num_attention_heads=4"),
    ({"vocab_size": 102}, (2, 4), "vocab_size=102"),
    ({"intermediate_size": 132}, (1, 8), "intermediate_size=132"),
    ({"num_attention_heads": 12, "num_key_value_heads": 3}, (4, 2), "num_key_value_heads=3"),  # 2 devices, 3 heads
    ({"num_attention_heads": 12, "num_key_value_heads": 3}, (2, 4), "num_key_value_heads=3"),  # 4 devices
])
def test_tensor_axis_must_divide(changes, mesh, named):
    """A tensor axis that does not divide a split dimension: a ConfigError naming the dimension."""
    config = parse_decoder_config({**QWEN3_TINY_CONFIGS["tiny-qwen3-tp"], **changes}, Qwen3Config)
    with pytest.raises(ConfigError, match=rf"cfg: tensor axis 'model' has {mesh[1]} devices.*{named}"):
        make_layout(config, jax.make_mesh(mesh, ("data", "model")), "model", "cfg")


def test_load_target_refuses(tmp_path):
    write_qwen3_checkpoint(tmp_path / "qwen", "tiny-qwen3", seed=1)  # 4 heads
    with pytest.raises(ConfigError, match=r"qwen: tensor axis 'model' has 8 devices.*num_attention_heads=4"):
        load_target(tmp_path / "qwen", mesh=jax.make_mesh((1, 8), ("data", "model")))
    assert isinstance(load_target(tmp_path / "qwen"), DecoderTarget)
    config = json.loads((tmp_path / "qwen" / "config.json").read_text())
    (tmp_path / "qwen" / "config.json").write_text(json.dumps({**config, "architectures": ["MistralForCausalLM"]}))
    refused = r"architectures \['MistralForCausalLM'\].*Qwen3ForCausalLM, LlamaForCausalLM"
    with pytest.raises(ConfigError, match=refused):
        load_target(tmp_path / "qwen")
    write_qwen3_checkpoint(tmp_path / "llama", "tiny-llama", seed=1)
    with pytest.raises(ConfigError, match=r"model_type is 'llama', expected 'qwen3': the directory holds a 'llama' "
                                          r"checkpoint \(LlamaForCausalLM\); load it with dflash_jax.load_target"):
        Qwen3Target.from_pretrained(tmp_path / "llama")
    assert os.path.isfile(tmp_path / "llama" / "model.safetensors")


def test_shard_places_as_from_pretrained(pair):
    """`DecoderTarget.shard(mesh)` of a target loaded on one device: every leaf the value and sharding that
    loading onto the mesh gives, a forward equal to the NumPy reference's; a tensor axis that does not divide
    the heads is refused by name, as at load."""
    root, _ = pair
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    sharded = load_target(root / "target", dtype=jnp.float32).shard(mesh)
    loaded = load_target(root / "target", mesh=mesh, dtype=jnp.float32)
    assert sharded.layout == loaded.layout
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(sharded.params)[0], jax.tree.leaves(loaded.params)):
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim), jax.tree_util.keystr(path)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))
    q = sharded.params["layers"][0]["self_attn"]["q_proj"]["weight"]
    assert q.sharding.spec[0] == "model" and q.addressable_shards[0].data.shape[0] == q.shape[0] // 2
    prompt = PROMPTS[0]
    out = sharded(jnp.asarray([prompt] * 4), sharded.init_cache(4, 8), jnp.zeros(4, jnp.int32))
    logits, _ = numpy_decoder(str(root / "target"), prompt)
    np.testing.assert_allclose(np.asarray(out.logits[0]), logits, rtol=0, atol=2e-4)
    three = jax.make_mesh((1, 3), ("data", "model"), devices=jax.devices()[:3])
    with pytest.raises(ConfigError, match=r"shard: tensor axis 'model' has 3 devices.*num_attention_heads=8"):
        load_target(root / "target", dtype=jnp.float32).shard(three)


@pytest.mark.parametrize("shape", [(1, 8), (2, 4)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_fused_prefill_by_sequence_on_a_mesh(pair, shape):
    """The fused prefill (XLA's twin of its cuDNN kernel) at most one prompt's rows a step: on a tensor-only mesh
    one sequence a step is written at its batch offset of the head-split cache; where the data axis splits the
    batch, the whole batch is one step. Both equal the single-device prefill of all sequences at once."""
    root, _ = pair
    width = max(map(len, PROMPTS))
    tokens = jnp.asarray([p + [0] * (width - len(p)) for p in PROMPTS], jnp.int32)
    lengths = jnp.asarray([len(p) for p in PROMPTS], jnp.int32)
    run = jax.jit(prefill_fused, static_argnums=(4, 5, 6))
    single = load_target(root / "target", dtype=jnp.float32)
    expected = run(single, tokens, single.init_cache(len(PROMPTS), 16), lengths, (0, 1), "xla", 1 << 16)
    target = load_target(root / "target", mesh=jax.make_mesh(shape, ("data", "model")), dtype=jnp.float32)
    out = run(target, tokens, target.init_cache(len(PROMPTS), 16), lengths, (0, 1), "xla", width)
    np.testing.assert_allclose(np.asarray(out.logits), np.asarray(expected.logits), rtol=1e-5, atol=1e-5)
    out, expected = jax.tree.map(np.asarray, (out, expected))  # sliced on the host, not by per-row device programs
    for b, n in enumerate(np.asarray(lengths)):
        np.testing.assert_allclose(out.features[b, :n], expected.features[b, :n], rtol=1e-5, atol=1e-5)
        for a, e in zip(out.cache.k + out.cache.v, expected.cache.k + expected.cache.v):
            np.testing.assert_allclose(a[b, :, :n], e[b, :, :n], rtol=1e-5, atol=1e-5)

"""Qwen3Target: against an independent NumPy forward, the feature convention, the KV cache, loading and errors."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import CheckpointError, ConfigError
from dflash_jax._qwen3_testing import QWEN3_TINY_CONFIGS, random_qwen3, write_qwen3_checkpoint
from dflash_jax.placement import auto_mesh
from dflash_jax.target import Target
from dflash_jax.target.dense import Qwen3Target, plan_decoder, prefill_fused

from . import _numpy_reference as ref
from ._feature_maps import numpy_squash, squash
from ._io import leaf, load_file, save_file
from ._numpy_reference import numpy_decoder
from ._pallas import needs_gpu

TOL = dict(rtol=0, atol=2e-4)  # float32 vs float64 on outputs of size ~5


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("tiny-qwen3"))
    write_qwen3_checkpoint(directory, "tiny-qwen3", seed=3)
    return directory, Qwen3Target.from_pretrained(directory, dtype=jnp.float32)


PROMPTS = [[5, 17, 99, 3, 64, 2, 88, 41, 7], [120, 4, 33], [9, 9, 9, 9, 1, 2]]
LAYER_IDS = (-1, 0, 1)  # embedding, the inner layer, and the last layer (after the final norm)


def _features(states, ids):
    return np.concatenate([states[l + 1] for l in ids], axis=-1)


def test_matches_numpy_reference_incrementally(tiny):
    """Right-padded prefill of a batch, then chunks of 1 and 3 tokens with a rewind in between: every logit
    and feature row equals the uncached NumPy forward over the whole sequence so far."""
    directory, target = tiny
    assert isinstance(target, Target)
    batch, width = len(PROMPTS), max(map(len, PROMPTS))
    tokens = np.zeros((batch, width), np.int32)
    for row, p in zip(tokens, PROMPTS):
        row[: len(p)] = p
    cache = target.init_cache(batch, 32)
    lengths = np.zeros(batch, np.int32)
    out = target(jnp.asarray(tokens), cache, jnp.asarray(lengths), layer_ids=LAYER_IDS)
    assert out.logits.shape == (batch, width, 128) and out.logits.dtype == jnp.float32
    assert out.features.shape == (batch, width, len(LAYER_IDS) * 64)
    sequences = [list(p) for p in PROMPTS]
    for b, seq in enumerate(sequences):
        logits, states = numpy_decoder(directory, seq)
        np.testing.assert_allclose(np.asarray(out.logits[b, : len(seq)]), logits, **TOL)
        np.testing.assert_allclose(np.asarray(out.features[b, : len(seq)]), _features(states, LAYER_IDS), **TOL)

    cache, lengths = out.cache, np.array([len(p) for p in PROMPTS], np.int32)
    rng = np.random.default_rng(0)
    for chunk, keep in [(1, 1), (3, 3), (3, 1), (1, 1), (3, 2)]:  # keep < chunk: the rest is rejected
        new = rng.integers(0, 128, (batch, chunk)).astype(np.int32)
        out = target(jnp.asarray(new), cache, jnp.asarray(lengths), layer_ids=LAYER_IDS)
        for b, seq in enumerate(sequences):
            logits, states = numpy_decoder(directory, seq + new[b].tolist())
            np.testing.assert_allclose(np.asarray(out.logits[b]), logits[-chunk:], **TOL)
            np.testing.assert_allclose(np.asarray(out.features[b]), _features(states, LAYER_IDS)[-chunk:], **TOL)
            seq.extend(new[b, :keep].tolist())
        cache, lengths = out.cache, lengths + keep


@pytest.mark.parametrize("preset, biases", [("tiny-qwen3", dict(attention_bias=True)),
                                            ("tiny-llama", dict(attention_bias=True, mlp_bias=True))])
def test_projection_biases_match_numpy_reference(preset, biases):
    """Attention (q/k/v/o) and MLP (gate/up/down) biases, drawn 25x their initialiser's 0.02 so that they matter
    (dropping them moves the logits by over 0.1): logits and features equal the NumPy forward's."""
    raw = {**QWEN3_TINY_CONFIGS[preset], **biases}
    target = random_qwen3(raw, seed=5, dtype=jnp.float32)
    scaled = jax.tree_util.tree_map_with_path(
        lambda path, x: x * 25 if jax.tree_util.keystr(path).endswith("['bias']") else x, target.params)
    target = dataclasses.replace(target, params=scaled)
    names = [t.name for t in plan_decoder(target.config)]
    assert sum(n.endswith(".bias") for n in names) == target.config.num_hidden_layers * (4 + 3 * ("mlp_bias" in biases))
    weights = {t.name: leaf(target.params, t.path) for t in plan_decoder(target.config)}
    prompt = PROMPTS[0]
    out = target(jnp.asarray([prompt]), target.init_cache(1, 16), jnp.zeros(1, jnp.int32), layer_ids=LAYER_IDS)
    logits, states = ref.decoder(raw, weights, prompt)
    # measured 1.6e-6 / 1.0e-6 on the logits, 4.4e-6 / 2.8e-6 on the features (|values| <= 3)
    np.testing.assert_allclose(np.asarray(out.logits[0]), logits, rtol=0, atol=5e-6)
    np.testing.assert_allclose(np.asarray(out.features[0]), _features(states, LAYER_IDS), rtol=0, atol=1.5e-5)
    unbiased, _ = ref.decoder(raw, {k: v for k, v in weights.items() if not k.endswith(".bias")}, prompt)
    assert np.abs(unbiased - logits).max() > 0.1


def test_last_layer_feature_is_after_final_norm(tiny):
    """Feature N-1 is hidden_states[N] (normed), not the raw output of the last layer (transformers'
    `output_hidden_states` convention; `dflash_jax.target`'s module docstring)."""
    directory, target = tiny
    prompt = jnp.asarray([PROMPTS[0]], jnp.int32)
    out = target(prompt, target.init_cache(1, 32), jnp.zeros(1, jnp.int32), layer_ids=(1, 0))
    _, states = numpy_decoder(directory, PROMPTS[0])
    last, before = np.asarray(out.features[0, :, :64]), np.asarray(out.features[0, :, 64:])
    np.testing.assert_allclose(last, states[2], **TOL)
    np.testing.assert_allclose(before, states[1], **TOL)
    rms = np.sqrt(np.mean(last**2, axis=-1))
    assert not np.allclose(rms, np.sqrt(np.mean(np.asarray(before) ** 2, axis=-1)), rtol=0.05)


def test_stale_cache_slots_never_read(tiny):
    """Garbage beyond `lengths` (rejected drafts) changes nothing: trimming is passing a smaller length."""
    _, target = tiny
    prompt = jnp.asarray([PROMPTS[0]], jnp.int32)
    clean = target(prompt, target.init_cache(1, 32), jnp.zeros(1, jnp.int32), layer_ids=(0,))
    # per layer [b, n_kv, T, d]
    dirty_cache = jax.tree.map(lambda a: a.at[:, :, len(PROMPTS[0]):].set(7.0), clean.cache)
    nxt = jnp.asarray([[11, 12]], jnp.int32)
    length = jnp.asarray([len(PROMPTS[0])], jnp.int32)
    assert not np.array_equal(np.asarray(dirty_cache.k), np.asarray(clean.cache.k))  # before the calls donate them
    a = target(nxt, clean.cache, length, layer_ids=(0,))
    b = target(nxt, dirty_cache, length, layer_ids=(0,))
    np.testing.assert_array_equal(np.asarray(a.logits), np.asarray(b.logits))
    np.testing.assert_array_equal(np.asarray(a.features), np.asarray(b.features))


def test_sharded_tied_bf16_and_mesh(tmp_path, cpu_mesh):
    """A sharded, tied checkpoint: bf16 by default, `lm_head` is the embedding, replicated over a mesh,
    same logits as the NumPy forward within bf16 tolerance."""
    directory = str(tmp_path)
    write_qwen3_checkpoint(directory, "tiny-qwen3-tied", seed=7, num_shards=3)
    assert os.path.exists(os.path.join(directory, "model.safetensors.index.json"))
    target = Qwen3Target.from_pretrained(directory, mesh=cpu_mesh, tensor_axis=None)
    assert target.embed.dtype == jnp.bfloat16 and target.lm_head is target.embed
    assert "lm_head" not in target.params
    assert len(target.params["layers"]) == 2  # one buffer per layer's weight, as placed
    assert target.params["layers"][1]["self_attn"]["q_proj"]["weight"].shape == (64, 64)
    for x in jax.tree.leaves(target.params):  # no tensor axis: every leaf replicated, on the mesh's Auto twin
        assert x.sharding.mesh == auto_mesh(cpu_mesh) and x.sharding.is_fully_replicated
    # merge the shards for the NumPy reader
    merged = {}
    for f in sorted(os.listdir(directory)):
        if f.endswith(".safetensors"):
            merged.update(load_file(os.path.join(directory, f)))
    ref_dir = str(tmp_path / "merged")
    os.makedirs(ref_dir)
    save_file(merged, os.path.join(ref_dir, "model.safetensors"))
    with open(os.path.join(directory, "config.json")) as f, open(os.path.join(ref_dir, "config.json"), "w") as g:
        g.write(f.read())
    logits, _ = numpy_decoder(ref_dir, PROMPTS[1])
    out = target(jnp.asarray([PROMPTS[1]]), target.init_cache(1, 16), jnp.zeros(1, jnp.int32))
    got = np.asarray(out.logits[0], np.float32)
    for row in range(len(PROMPTS[1])):  # measured 0.022, 0.025, 0.019 (|logits| <= 3.1)
        np.testing.assert_allclose(got[row], logits[row], rtol=0, atol=0.045, err_msg=f"row {row}")
        top2 = np.sort(logits[row])[-2:]
        assert top2[1] - top2[0] > 2 * 0.045, "the argmax must not be decided by bf16 noise"  # 0.43, 0.50, 0.31
        assert got[row].argmax() == logits[row].argmax(), f"row {row}"


def test_rope_parameters_layout(tmp_path):
    """transformers 5 writes `rope_parameters` instead of `rope_theta`: same model."""
    raw = {k: v for k, v in QWEN3_TINY_CONFIGS["tiny-qwen3"].items() if k not in ("rope_theta", "rope_scaling")}
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": 5000.0}
    write_qwen3_checkpoint(tmp_path, raw)
    target = Qwen3Target.from_pretrained(tmp_path, dtype=jnp.float32)
    assert target.config.rope_theta == 5000.0 and target.config.rope_type == "default"


def test_errors(tmp_path, tiny):
    directory, _ = tiny
    with pytest.raises(ConfigError, match="config.json"):
        Qwen3Target.from_pretrained(tmp_path)
    tensors = load_file(os.path.join(directory, "model.safetensors"))
    config = json.load(open(os.path.join(directory, "config.json")))

    def write(where, tensors, **changes):
        os.makedirs(where, exist_ok=True)
        save_file(tensors, os.path.join(where, "model.safetensors"))
        json.dump({**config, **changes}, open(os.path.join(where, "config.json"), "w"))
        return where

    missing = {k: v for k, v in tensors.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        Qwen3Target.from_pretrained(write(str(tmp_path / "missing"), missing))
    with pytest.raises(CheckpointError, match=r"shape \[128, 64\], expected \[256, 64\]"):
        Qwen3Target.from_pretrained(write(str(tmp_path / "shape"), tensors, vocab_size=256))
    with pytest.raises(ConfigError, match="model_type"):
        Qwen3Target.from_pretrained(write(str(tmp_path / "llama"), tensors, model_type="llama"))
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        Qwen3Target.from_pretrained(write(str(tmp_path / "gqa"), tensors, num_key_value_heads=3))
    _, target = tiny
    with pytest.raises(ValueError, match="outside"):
        target(jnp.zeros((1, 2), jnp.int32), target.init_cache(1, 8), jnp.zeros(1, jnp.int32), layer_ids=(6,))


@pytest.mark.gpu
@needs_gpu
def test_fused_prefill_equals_the_chunked_one():
    """On a GPU the prompt is prefilled at once with cuDNN's flash kernel: the same cache, features and last
    logits (bf16 tolerance) as the chunked XLA path, ragged prompts longer than a chunk; one sequence a step
    (`max_rows` one prompt's) as all at once."""
    from dflash_jax.testing import random_qwen3

    # 4 layers, as this comparison was measured on a GPU (the CPU suite skips it: it costs the suite nothing)
    target = random_qwen3({**QWEN3_TINY_CONFIGS["tiny-qwen3"], "head_dim": 64, "num_attention_heads": 4,
                           "num_hidden_layers": 4}, seed=3)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 128, (2, 640)), jnp.int32)
    lengths = jnp.asarray([640, 333], jnp.int32)
    runs = [target.prefill(tokens, target.init_cache(2, 768), lengths, layer_ids=(1, 3), chunk=256, impl=impl)
            for impl in ("cudnn", "xla")]
    fused, chunked = runs
    by_sequence = prefill_fused(target, tokens, target.init_cache(2, 768), lengths, (1, 3), "cudnn", max_rows=640)

    def close(a, b):  # bf16 roundings differ between the kernels (4 random layers): each row against its norm
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)  # [..., rows, width]
        error = np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)
        # XLA's twin of the fused path in bf16 on a CPU: at most 1.7% (logits), 3.0% (features), 3.7% (cache rows)
        assert error.max() <= 0.06, f"row {np.unravel_index(error.argmax(), error.shape)}: {error.max():.3f}"

    close(fused.logits, chunked.logits)
    for row, n in enumerate(np.asarray(lengths)):
        close(fused.features[row, :n], chunked.features[row, :n])
        for a, b in zip(fused.cache.k + fused.cache.v, chunked.cache.k + chunked.cache.v):
            close(a[row, :, :n], b[row, :, :n])
    close(by_sequence.logits, fused.logits)  # one sequence a step, written at its batch offset
    for row, n in enumerate(np.asarray(lengths)):
        close(by_sequence.features[row, :n], fused.features[row, :n])
        for a, b in zip(by_sequence.cache.k + by_sequence.cache.v, fused.cache.k + fused.cache.v):
            close(a[row, :, :n], b[row, :, :n])


@pytest.mark.parametrize("fused, mapped", [(None, True), (1 << 16, False), (9, True)],
                         ids=["chunked-mapped", "fused-twin", "fused-twin-by-sequence-mapped"])
def test_prefill_matches_numpy_reference(tiny, fused, mapped):
    """`prefill` in chunks of 4, and the fused (cuDNN) branch run with XLA's twin of its kernel (its causal mask
    over right-padded rows and its last-row gather, on a CPU), all sequences in one step or (at most 9 rows a
    step) one sequence a step written at its batch offset: for ragged prompts of 9, 3 and 6 tokens every
    feature row of each prompt and the last token's logits equal the uncached NumPy forward; the cache then
    continues as one filled at once. `mapped`: the features come through a `FeatureMap` applied a step at a time
    (as the speculative prefill's drafter projection): each row is the map of the NumPy forward's."""
    directory, target = tiny
    batch, width = len(PROMPTS), max(map(len, PROMPTS))
    tokens = np.zeros((batch, width), np.int32)
    for row, p in zip(tokens, PROMPTS):
        row[: len(p)] = p
    lengths = jnp.asarray([len(p) for p in PROMPTS], jnp.int32)
    cache = target.init_cache(batch, 32)
    project, w = squash(len(LAYER_IDS) * 64, 48) if mapped else (None, None)
    if fused:
        out = jax.jit(prefill_fused, static_argnums=(4, 5, 6))(target, jnp.asarray(tokens), cache, lengths,
                                                                LAYER_IDS, "xla", fused, project)
    else:
        out = target.prefill(jnp.asarray(tokens), cache, lengths, layer_ids=LAYER_IDS, chunk=4, project=project)
    assert out.logits.shape == (batch, 128)
    assert out.features.shape == (batch, width, 48 if mapped else len(LAYER_IDS) * 64)
    for b, seq in enumerate(PROMPTS):
        logits, states = numpy_decoder(directory, seq)
        np.testing.assert_allclose(np.asarray(out.logits[b]), logits[-1], **TOL)
        features = _features(states, LAYER_IDS)
        np.testing.assert_allclose(np.asarray(out.features[b, : len(seq)]),
                                   numpy_squash(w, features) if mapped else features, **TOL)
    nxt = jnp.asarray([[11], [12], [13]], jnp.int32)
    step = target(nxt, out.cache, lengths, layer_ids=())
    for b, seq in enumerate(PROMPTS):
        logits, _ = numpy_decoder(directory, seq + [int(nxt[b, 0])])
        np.testing.assert_allclose(np.asarray(step.logits[b, 0]), logits[-1], **TOL)

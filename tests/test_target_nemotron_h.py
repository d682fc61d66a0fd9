"""The Nemotron-H target as a family (`target.nemotron_h_target`): loaded from a Hugging Face checkpoint by
`load_target`, against transformers' outputs (tests/data/nemotron_h, README there), and as the target of NVIDIA's
Nemotron 3.5 Lightning drafters in the compiled loop. The maths alone: tests/test_nemotron_h.py."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

import dflash_jax
from dflash_jax import CheckpointError, greedy_generate, load_drafter, load_target, speculative_generate
from dflash_jax.layers import static_fp8_input
from dflash_jax.target import nemotron_h
from dflash_jax.target.nemotron_h_target import NemotronHTarget
from dflash_jax.testing import successor_nemotron_h, write_checkpoint, write_nemotron_h_checkpoint

from ._io import load_file, rewrite_tensors
from .test_nvfp4 import E2M1

DATA = os.path.join(os.path.dirname(__file__), "data", "nemotron_h")


@pytest.fixture(scope="module")
def moe():
    return load_target(os.path.join(DATA, "moe"), dtype=jnp.float32), load_file(os.path.join(DATA, "moe",
                                                                                             "io.safetensors"))


def test_load_target_runs_transformers_forward(moe):
    """The registry picks the family; the forward's logits and features are transformers' (measured 3.2e-6 on the
    logits, 1.1e-5 on the deepest features: the maths' own tests' figures)."""
    target, io = moe
    assert isinstance(target, NemotronHTarget) and target.num_layers == 8 and target.max_positions == 4096
    tokens = jnp.asarray(io["input_ids"], jnp.int32)
    out = target(tokens, target.init_cache(2, 16), jnp.zeros(2, jnp.int32), layer_ids=(0, 3, 7))
    np.testing.assert_allclose(np.asarray(out.logits), io["logits"], rtol=0, atol=1e-5)
    features = np.concatenate([io["hidden_states"][i + 1] for i in (0, 3, 7)], axis=-1)  # the last after norm_f
    np.testing.assert_allclose(np.asarray(out.features), features, rtol=0, atol=3e-5)


def test_greedy_and_speculative_decoding_are_transformers_greedy(moe, tmp_path):
    """`greedy_generate` gives transformers' greedy tokens; speculative decoding with each Nemotron 3.5 drafter
    (the DSpark's bonus anchor, sinks and window; the DFlash's own embedding) gives exactly them, the drafts
    through this target's LM head, its Mamba states rolled back inside the loop."""
    target, io = moe
    prompt = [int(t) for t in io["input_ids"][0, :5]]
    expected = [int(t) for t in io["greedy_tokens"][0]]
    assert greedy_generate(target, prompt, max_new_tokens=12).tokens == [expected]
    for preset in ("tiny-nemotron-dspark", "tiny-nemotron-dflash"):
        write_checkpoint(tmp_path / preset, preset)
        drafter = load_drafter(tmp_path / preset, dtype=jnp.float32)
        result = speculative_generate(target, drafter, prompt, max_new_tokens=12, draft_length="fixed")
        assert result.tokens == [expected], preset


def test_rollback_with_a_drafter_that_is_sometimes_right(moe):
    """Commits of every length: drafts that copy the target's greedy continuation up to a varying point (then
    wrong), verified in one compiled step each; the Mamba states and the output stay the target's own."""
    target, io = moe
    tokens = jnp.asarray(io["input_ids"][:, :6], jnp.int32)
    cache = target.init_cache(2, 32)
    out = target.prefill(tokens, cache, jnp.full(2, 6, jnp.int32))
    reference = greedy_generate(target, [[int(t) for t in row] for row in io["input_ids"][:, :6]],
                                max_new_tokens=8).tokens
    cache, lengths = out.cache, jnp.full(2, 6, jnp.int32)
    for kept in ((1, 4), (3, 2)):  # rows of a 5-row verify the drafts get right, per sequence
        block = np.array([[row[int(lengths[b]) - 6 + j] if j < kept[b] else 0 for j in range(5)]
                          for b, row in enumerate(reference)], np.int32)
        verify = target(jnp.asarray(block), cache, lengths)
        cache = target.commit(verify.cache, jnp.asarray(kept, jnp.int32))
        lengths = lengths + jnp.asarray(kept, jnp.int32)
    next_logits = target(jnp.asarray([[row[int(lengths[b]) - 6]] for b, row in enumerate(reference)], jnp.int32),
                         cache, lengths).logits
    # the state after the committed rows continues the greedy sequence exactly where a plain decode would
    assert [int(t) for t in np.asarray(next_logits[:, 0].argmax(-1))] == [
        row[int(lengths[b]) - 5] for b, row in enumerate(reference)]


def test_missing_expert_tensor_named(tmp_path):
    shutil.copytree(os.path.join(DATA, "moe"), tmp_path / "moe")
    rewrite_tensors(tmp_path / "moe", lambda t: t.pop("backbone.layers.1.mixer.experts.5.down_proj.weight"))
    with pytest.raises(CheckpointError, match=r"backbone\.layers\.1\.mixer\.experts\.5\.down_proj\.weight"):
        load_target(tmp_path / "moe")


def test_a_correction_bias_of_another_length_is_named(tmp_path):
    """The router's `e_score_correction_bias` holds one value per routed expert: one short is refused, naming it and
    the length the config declares, before anything is placed."""
    name = "backbone.layers.1.mixer.gate.e_score_correction_bias"
    shutil.copytree(os.path.join(DATA, "moe"), tmp_path / "moe")
    rewrite_tensors(tmp_path / "moe", lambda t: t.update({name: t[name][:-1]}))
    expected = f"tensor {name!r} has shape [7], expected [8] from the config"
    with pytest.raises(CheckpointError, match=re.escape(expected)):
        load_target(tmp_path / "moe")


def test_the_router_stays_float32_in_a_bfloat16_load(tmp_path):
    """The router's weight and correction bias load as float32 whatever the dtype, as transformers and vLLM keep
    them: a bias whose values differ below bfloat16's resolution (8 + k / 1024: 1/16 apart there) still orders
    the experts, and rounded to bfloat16 it would choose others."""
    shutil.copytree(os.path.join(DATA, "moe"), tmp_path / "moe")
    bias = (8 + np.random.default_rng(1).permutation(8) / 1024).astype(np.float32)
    name = "backbone.layers.1.mixer.gate.e_score_correction_bias"
    rewrite_tensors(tmp_path / "moe", lambda t: t.update({name: bias}))
    target = load_target(tmp_path / "moe", dtype=jnp.bfloat16)
    gate = target.params["layers"][1]["mixer"]["gate"]
    assert gate["weight"].dtype == gate["e_score_correction_bias"].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(gate["e_score_correction_bias"]), bias)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((64, target.hidden_size)) * 1e-3, jnp.float32)
    rounded = {**gate, "e_score_correction_bias": gate["e_score_correction_bias"].astype(jnp.bfloat16)}
    chosen = nemotron_h.route({"gate": gate}, target.config, x)[1]
    assert not np.array_equal(chosen, nemotron_h.route({"gate": rounded}, target.config, x)[1])


def test_sharded_equals_unsharded(moe, cpu_mesh):
    """On a 2 x 4 mesh (the batch over 2, the heads and expert widths over 4): the same greedy tokens."""
    target, io = moe
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    sharded = target.shard(mesh)
    prompts = [[int(t) for t in row[:5]] for row in io["input_ids"]]
    assert greedy_generate(sharded, prompts, max_new_tokens=6).tokens == greedy_generate(
        target, prompts, max_new_tokens=6).tokens


def test_is_exported():
    assert dflash_jax.load_target is load_target


def test_successor_target_follows_its_map(moe):
    """`successor_nemotron_h` (the benchmarks' target): its greedy tokens walk the map it was built from."""
    target, _ = moe
    successor = np.random.default_rng(0).permutation(target.vocab_size)
    follower = successor_nemotron_h(target, successor, layer_scale=0.2)
    (tokens,) = greedy_generate(follower, [5], max_new_tokens=8).tokens
    walked = [int(successor[5])]
    for _ in range(7):
        walked.append(int(successor[walked[-1]]))
    assert tokens == walked


def test_a_prefill_chunk_does_not_copy_the_experts_of_each_token(moe):
    """The routed experts run on `target.moe`'s tiles in a prefill, not the maths' per-token gather, which copies
    `[T, k, I, H]` of weights: 114 GiB for one 2048-token chunk at the Lightning shapes (the benchmark's OOM on an
    H100). Read from the program: no value holds an expert matrix for each of the chunk's (token, expert) pairs."""
    target, _ = moe
    c, T = target.config, 256
    I, H = c.moe_intermediate_size, c.hidden_size
    jaxpr = jax.make_jaxpr(lambda t, cache: t.prefill(jnp.ones((1, T), jnp.int32), cache, jnp.array([T], jnp.int32),
                                                      chunk=T))(target, target.init_cache(1, T))
    copies = [v.aval.shape for v in _values(jaxpr.jaxpr)
              if v.aval.shape[-2:] in ((I, H), (H, I)) and np.prod(v.aval.shape[:-2]) >= T * c.num_experts_per_tok]
    assert not copies, copies


def _values(jaxpr):
    """Every value a jaxpr and the jaxprs inside it compute."""
    for eqn in jaxpr.eqns:
        yield from (v for v in eqn.outvars if hasattr(v.aval, "shape"))
        for param in eqn.params.values():
            for inner in param if isinstance(param, tuple) else (param,):  # cond's branches: a tuple
                inner = getattr(inner, "jaxpr", inner)  # a ClosedJaxpr's
                if hasattr(inner, "eqns"):
                    yield from _values(inner)


# --- the ModelOpt mixed-precision export (the released NVFP4 target's layout) ---------------------------------

def _numpy_dequantized(tensors: dict) -> dict:
    """The float weights a mixed checkpoint stores, dequantized in NumPy from the format's definition: FP8
    `e4m3 * weight_scale`; NVFP4 two E2M1 codes a byte (low nibble first), each 16 times `weight_scale (E4M3) *
    weight_scale_2`. Companions dropped, `input_scale` kept aside (it is no weight)."""
    out = {}
    for name, value in tensors.items():
        stem = name.removesuffix(".weight")
        if name.endswith((".weight_scale", ".weight_scale_2", ".input_scale")):
            continue
        if value.dtype == np.uint8:
            codes = np.stack([value & 0xF, value >> 4], axis=-1).reshape(*value.shape[:-1], -1)  # [out, K]
            scale = tensors[stem + ".weight_scale"].astype(np.float32) * tensors[stem + ".weight_scale_2"]
            value = (E2M1[codes].reshape(*codes.shape[:-1], -1, 16) * scale[..., None]).reshape(codes.shape)
        elif str(value.dtype) == "float8_e4m3fn":
            value = value.astype(np.float32) * tensors[stem + ".weight_scale"]
        out[name] = value.astype(np.float32)
    return out


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """A tiny mixed checkpoint (the shared expert 64 wide: NVFP4 packs K in multiples of 32) and the same model
    dequantized in NumPy, written as a float checkpoint."""
    with open(os.path.join(DATA, "moe", "config.json")) as f:
        raw = json.load(f) | {"moe_shared_expert_intermediate_size": 64}
    directory = tmp_path_factory.mktemp("mixed")
    tensors = write_nemotron_h_checkpoint(directory / "nvfp4", raw, seed=3, quantized=True)
    float_dir = directory / "dequantized"
    float_dir.mkdir()
    save_file(_numpy_dequantized(tensors), str(float_dir / "model.safetensors"))
    shutil.copy(directory / "nvfp4" / "config.json", float_dir / "config.json")
    return (directory / "nvfp4", load_target(directory / "nvfp4", dtype=jnp.float32),
            load_target(float_dir, dtype=jnp.float32), tensors)


def _logits(target, tokens):
    return np.asarray(target(tokens, target.init_cache(2, 16), jnp.zeros(2, jnp.int32)).logits)


def test_the_mixed_export_loads_as_its_numpy_dequantization_with_w8a8_inputs(mixed):
    """The mixed checkpoint's weights are the NumPy dequantization's (bit for bit), the experts stacked as the
    block runs them, and its Mamba projections read their inputs as FP8 W8A8 kernels do (`input_scale`): the
    model equals the dequantized one given the same scales (float32, measured 0); without them the logits move by
    3.3 (of logits up to 3.8, the writer's uncalibrated input_scale 0.05): the scales are applied, not dropped."""
    _, quantized, dequantized, tensors = mixed
    mamba = quantized.params["layers"][0]["mixer"]
    assert mamba["in_proj"]["input_scale"].dtype == jnp.float32 and "input_scale" in mamba["out_proj"]
    experts = quantized.params["layers"][1]["mixer"]["experts"]
    np.testing.assert_array_equal(np.asarray(experts["up_proj"]), np.stack(
        [_numpy_dequantized(tensors)[f"backbone.layers.1.mixer.experts.{e}.up_proj.weight"] for e in range(8)]))
    np.testing.assert_array_equal(np.asarray(quantized.lm_head), _numpy_dequantized(tensors)["lm_head.weight"])

    scales = {i: {proj: float(tensors[f"backbone.layers.{i}.mixer.{proj}.input_scale"]) for proj in
                  ("in_proj", "out_proj")} for i in quantized.config.blocks("linear_attention")}
    layers = list(dequantized.params["layers"])
    for i, by_proj in scales.items():
        mixer = dict(layers[i]["mixer"])
        for proj, s in by_proj.items():
            mixer[proj] = {**mixer[proj], "input_scale": jnp.float32(s)}
        layers[i] = {**layers[i], "mixer": mixer}
    with_scales = dataclasses.replace(dequantized, params={**dequantized.params, "layers": tuple(layers)})
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 12)), jnp.int32)
    got = _logits(quantized, tokens)
    np.testing.assert_allclose(got, _logits(with_scales, tokens), rtol=0, atol=1e-6)
    assert np.abs(got - _logits(dequantized, tokens)).max() > 0.1


def test_static_fp8_input_rounds_as_e4m3():
    """`layers.static_fp8_input` against ml_dtypes' E4M3 rounding, saturating at 448."""
    x = np.array([[0.0, 1e-4, 0.0123, -0.7, 3.3, 30.0, -1e3]], np.float32)
    s = np.float32(0.05)
    want = np.clip(x / s, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * s
    got = static_fp8_input(jnp.asarray(x), {"input_scale": jnp.asarray(s)})
    np.testing.assert_array_equal(np.asarray(got), want)
    np.testing.assert_array_equal(np.asarray(static_fp8_input(jnp.asarray(x), {})), x)  # no scale: x itself


def test_the_mixed_export_on_a_mesh_gives_the_same_tokens(mixed, cpu_mesh):
    """Quantized tensors placed replicated, dequantized, then moved onto their shards: the greedy tokens of one
    device on a 2 x 4 mesh."""
    directory, quantized, _, _ = mixed
    sharded = load_target(directory, dtype=jnp.float32, mesh=jax.make_mesh((2, 4), ("data", "model")))
    experts = sharded.params["layers"][1]["mixer"]["experts"]["up_proj"]
    assert experts.sharding.spec == jax.sharding.PartitionSpec(None, "model", None)
    prompts = [[3, 14, 15, 92, 65], [35, 89, 79, 32, 38]]
    assert greedy_generate(sharded, prompts, max_new_tokens=6).tokens == greedy_generate(
        quantized, prompts, max_new_tokens=6).tokens


def test_a_quantized_expert_with_scales_of_another_shape_is_named(mixed, tmp_path):
    directory, *_ = mixed
    shutil.copytree(directory, tmp_path / "bad")
    name = "backbone.layers.4.mixer.experts.6.down_proj.weight_scale"
    rewrite_tensors(tmp_path / "bad", lambda t: t.update({name: t[name][:, :1]}))
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        load_target(tmp_path / "bad")

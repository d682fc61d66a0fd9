"""The Nemotron-H target as a family (`target.nemotron_h_target`): loaded from a Hugging Face checkpoint by
`load_target`, against transformers' outputs (tests/data/nemotron_h, README there), and as the target of NVIDIA's
Nemotron 3.5 Lightning drafters in the compiled loop. The maths alone: tests/test_nemotron_h.py."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import msgspec
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors.numpy import save_file

import dflash_jax
from dflash_jax import (
    CheckpointError,
    ConfigError,
    greedy_generate,
    load_drafter,
    load_target,
    nvfp4,
    speculative_generate,
)
from dflash_jax.layers import static_fp8_input
from dflash_jax.safetensors import Checkpoint
from dflash_jax.target import nemotron_h
from dflash_jax.target.mamba2 import in_proj_order
from dflash_jax.target.nemotron_h_spec import ROOT
from dflash_jax.target.nemotron_h_target import NemotronHTarget, _forward
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


@pytest.mark.parametrize("name", ["backbone.layers.1.mixer.experts.5.down_proj.weight",
                                  "backbone.layers.3.mixer.in_proj.weight", "backbone.layers.5.mixer.conv1d.bias"])
def test_missing_expert_or_mamba_tensor_named(tmp_path, name):
    """Loaded onto a tensor axis of 2, where the Mamba `in_proj` and conv are read in the sharded row order."""
    shutil.copytree(os.path.join(DATA, "moe"), tmp_path / "moe")
    rewrite_tensors(tmp_path / "moe", lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=re.escape(f"missing tensor {name!r}")):
        load_target(tmp_path / "moe", mesh=jax.make_mesh((4, 2), ("data", "model")))


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


def _shard_rows(sections: tuple[int, ...], tp: int, d: int) -> list[int]:
    """The stored rows device d of `tp` holds of a tensor of consecutive `sections`: the d-th block of each."""
    starts = np.cumsum((0, *sections[:-1]))
    return [r for start, size in zip(starts, sections) for r in range(start + d * size // tp,
                                                                       start + (d + 1) * size // tp)]


def _mamba_sections(config) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The stored sections of `in_proj`'s rows (z, x, B, C, dt) and of the conv's channels (x, B, C)."""
    d_inner, bc = config.mamba_num_heads * config.mamba_head_dim, config.n_groups * config.ssm_state_size
    return (d_inner, d_inner, bc, bc, config.mamba_num_heads), (d_inner, bc, bc)


@pytest.fixture(scope="module")
def split(request):
    """The moe checkpoint loaded onto a tensor axis of `request.param` devices, the batch over the rest."""
    tp = request.param
    mesh = jax.make_mesh((8 // tp, tp), ("data", "model"))
    return load_target(os.path.join(DATA, "moe"), dtype=jnp.float32, mesh=mesh), mesh


@pytest.mark.parametrize("split", [2, 4], indirect=True, ids=["tp2", "tp4"])
def test_sharded_equals_transformers(moe, split, tmp_path):
    """On a tensor axis of 2 (B and C split by group: n_groups = 2) and of 4 (more devices than groups: a group's
    B / C rows over its 2 devices): each Mamba block's ONE `in_proj` and conv live split over "model", device d's
    shard the stored rows of its sections `[z_d | x_d | B_d | C_d | dt_d]` (conv `[x_d | B_d | C_d]`, asserted
    against the one-device arrays), the per-head tensors and `out_proj`'s input by head; `shard` places the same
    rows as the load. A 9-token prefill and a 4-row verify give transformers' logits and Mamba states as one device
    does (measured at most 3.7e-6 on the logits, up to 3.6, and 3.5e-6 on the states; one device 3.3e-6 and
    3.7e-6), the conv state in the sharded order; the committed states keep their split. On tp2, speculative
    decoding with a drafter replicated beside the target gives transformers' greedy tokens."""
    single, io = moe
    sharded, mesh = split
    tp = sharded.layout.tensor_size
    rows, channels = _mamba_sections(sharded.config)
    moved = single.shard(mesh)
    for i, layer in enumerate(sharded.params["layers"]):
        if sharded.config.layers_block_type[i] != "linear_attention":
            continue
        mixer, one = layer["mixer"], single.params["layers"][i]["mixer"]
        for name, leaf in [("in_proj", mixer["in_proj"]["weight"]), ("conv1d", mixer["conv1d"]["weight"]),
                           ("conv1d", mixer["conv1d"]["bias"])]:
            assert leaf.sharding.spec[0] == "model", (i, name)
            whole = np.asarray(one[name]["weight" if leaf.ndim > 1 else "bias"])
            for shard in leaf.addressable_shards:
                d = shard.index[0].start // shard.data.shape[0]
                assert shard.data.shape[0] == whole.shape[0] // tp
                np.testing.assert_array_equal(shard.data, whole[_shard_rows(rows if name == "in_proj" else channels,
                                                                              tp, d)])
        chex.assert_trees_all_equal(moved.params["layers"][i]["mixer"], mixer)
        for name in ("dt_bias", "A_log", "D"):
            assert mixer[name].sharding.spec == P("model"), name
        assert mixer["norm"]["weight"].sharding.spec == P("model")
        assert mixer["out_proj"]["weight"].sharding.spec == P(None, "model")  # by input, an all-reduce after it

    tokens = jnp.asarray(io["input_ids"], jnp.int32)
    nine = jnp.full(2, 9, jnp.int32)
    out = sharded.prefill(tokens[:, :9], sharded.init_cache(2, 16), nine, chunk=8)
    chex.assert_trees_all_close(np.asarray(out.logits), io["logits"][:, 8], rtol=0, atol=1e-5)
    order = np.concatenate([_shard_rows(channels, tp, d) for d in range(tp)])
    for state, i in zip(out.cache.mamba, sharded.config.blocks("linear_attention")):
        chex.assert_trees_all_close(np.asarray(state.conv), io[f"prefill9_conv_state_{i}"][:, order, 1:], rtol=0,
                                    atol=1e-5)
        chex.assert_trees_all_close(np.asarray(state.ssm), io[f"prefill9_ssm_state_{i}"], rtol=0, atol=1e-5)
    block = sharded(tokens[:, 9:], out.cache, nine)
    chex.assert_trees_all_close(np.asarray(block.logits), io["logits"][:, 9:], rtol=0, atol=1e-5)
    committed = sharded.commit(block.cache, jnp.asarray([1, 3], jnp.int32)).mamba[0]
    batch = "data" if sharded.layout.splits_batch(2) else None
    assert committed.conv.sharding.is_equivalent_to(NamedSharding(mesh, P(batch, "model")), 3)
    assert committed.ssm.sharding.is_equivalent_to(NamedSharding(mesh, P(batch, "model")), 4)

    if tp == 2:
        write_checkpoint(tmp_path, "tiny-nemotron-dspark")
        drafter = load_drafter(tmp_path, dtype=jnp.float32, mesh=mesh)
        prompts = [[int(t) for t in row[:5]] for row in io["input_ids"]]
        assert speculative_generate(sharded, drafter, prompts, max_new_tokens=8, draft_length="fixed").tokens == [
            [int(t) for t in row] for row in io["greedy_tokens"][:, :8]]


@pytest.mark.parametrize("split", [2], indirect=True, ids=["tp2"])
def test_without_the_row_order_the_split_mixer_is_wrong(moe, split):
    """The sharded order matters, for each of the two tensors: the tp2 target's 9-token prefill with every Mamba
    block's `in_proj` rows, or its conv's channels (weight and bias), placed in the stored order (same sharding)
    is far from transformers' logits (measured 3.9 and 3.4, of logits up to 3.6; the order kept: 3.7e-6)."""
    single, io = moe
    sharded, _ = split

    def stored_order(module: str) -> NemotronHTarget:
        layers = list(sharded.params["layers"])
        for i in sharded.config.blocks("linear_attention"):
            mixer = layers[i]["mixer"]
            stored = {key: jax.device_put(single.params["layers"][i]["mixer"][module][key], leaf.sharding)
                      for key, leaf in mixer[module].items()}
            layers[i] = {**layers[i], "mixer": {**mixer, module: stored}}
        return dataclasses.replace(sharded, params={**sharded.params, "layers": tuple(layers)})

    tokens = jnp.asarray(io["input_ids"][:, :9], jnp.int32)
    nine = jnp.full(2, 9, jnp.int32)
    for module in ("in_proj", "conv1d"):
        target = stored_order(module)
        logits = np.asarray(target.prefill(tokens, target.init_cache(2, 16), nine, chunk=8).logits)
        assert np.abs(logits - io["logits"][:, 8]).max() > 0.1, module


def test_a_shard_of_the_reordered_in_proj_reads_only_its_rows(moe, monkeypatch):
    """On a tensor axis of 2, device 1's shard of a Mamba `in_proj` (rows 100..199 of the sharded order) is read as
    its five runs of stored rows (its halves of z, x, B, C and dt), 100 rows in all: no byte of device 0's."""
    single, _ = moe
    layout = NemotronHTarget.layout_for(single.config, jax.make_mesh((4, 2), ("data", "model")), "model", "test")
    name = "backbone.layers.0.mixer.in_proj.weight"
    rows = _mamba_sections(single.config)[0]
    with Checkpoint(os.path.join(DATA, "moe")) as stored:
        reads: list[slice] = []  # the rows of each read of the stored in_proj
        read = stored.read

        def spy(tensor: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
            if tensor == name:
                reads.append(index[0])
            return read(tensor, index)

        monkeypatch.setattr(stored, "read", spy)
        views = NemotronHTarget.views(stored, single.config, ROOT, layout)
        shard = views.read(name, (slice(100, 200), slice(0, 64)))
        want = _shard_rows(rows, 2, 1)
        np.testing.assert_array_equal(shard, read(name)[want])
    assert [(r.start, r.stop) for r in reads] == [(32, 64), (96, 128), (144, 160), (176, 192), (196, 200)]


def _decode_hlo(target: NemotronHTarget) -> str:
    """The compiled decode step (`_forward` over one row of a batch of 2): its optimised HLO."""
    cache = target.init_cache(2, 16)
    return _forward.lower(target, jnp.ones((2, 1), jnp.int32), (cache.k, cache.v), cache.mamba,
                          jnp.full(2, 5, jnp.int32), ()).compile().as_text()


@pytest.mark.parametrize("split", [2, 4], indirect=True, ids=["tp2", "tp4"])
def test_one_in_proj_product_per_mamba_block_and_device(moe, split):
    """The decode step compiled on one device and on a tensor axis of 2 or 4: each Mamba block runs ONE `in_proj`
    product (an output of all its rows: 200 on one device, the shard's 100 or 50 on each device), no convolution op
    (the conv is multiply-adds), and nothing of `in_proj`'s size (its weight or its product) is all-gathered. On
    one device and on 2 the programs hold as many dot ops, 36 (the one-device program is 072cb3b's, op for op;
    five products a block would make it 48). On 4 (more devices than the 2 groups) the only Mamba values gathered
    are each block's B and C activations, `[batch, 1, 1, N]` each (a group's rows spread over its 2 devices)."""
    single, _ = moe
    sharded, _ = split
    c = single.config
    rows = sum(_mamba_sections(c)[0])
    mamba = len(c.blocks("linear_attention"))
    tp = sharded.layout.tensor_size
    for target, devices in ((single, 1), (sharded, tp)):
        hlo = _decode_hlo(target)
        dots = re.findall(r"= f32\[([\d,]*)\]\{[\d,]*\} dot\(", hlo)
        assert sum(shape.split(",")[-1] == str(rows // devices) for shape in dots) == mamba, (devices, dots)
        assert " convolution(" not in hlo
        gathered = re.findall(r"= \w+\[([\d,]*)\]\S* all-gather\(", hlo)
        assert not [g for g in gathered if {str(rows), str(rows // devices)} & set(g.split(","))], gathered
        if devices <= 2:
            assert len(dots) == 36, devices
        else:
            batch = 2 // sharded.layout.batch_devices  # each device's rows of the batch of 2
            assert gathered.count(f"{batch},1,1,{c.ssm_state_size}") == 2 * mamba, gathered


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
    """Quantized tensors placed replicated, dequantized, then moved onto their shards (the FP8 Mamba `in_proj` read
    in the sharded row order: its per-tensor scales hold for any order of its rows, the loaded rows are the
    one-device load's permuted, bit for bit): the greedy tokens of one device on a 2 x 4 mesh."""
    directory, quantized, _, _ = mixed
    sharded = load_target(directory, dtype=jnp.float32, mesh=jax.make_mesh((2, 4), ("data", "model")))
    experts = sharded.params["layers"][1]["mixer"]["experts"]["up_proj"]
    assert experts.sharding.spec == P(None, "model", None)
    mamba, one = sharded.params["layers"][0]["mixer"], quantized.params["layers"][0]["mixer"]
    assert mamba["in_proj"]["weight"].sharding.spec == P("model", None) and "input_scale" in mamba["in_proj"]
    assert mamba["out_proj"]["weight"].sharding.spec == P(None, "model")
    order = in_proj_order(sharded.config.mamba_dims._replace(shards=4))
    np.testing.assert_array_equal(np.asarray(mamba["in_proj"]["weight"]), np.asarray(one["in_proj"]["weight"])[order])
    prompts = [[3, 14, 15, 92, 65], [35, 89, 79, 32, 38]]
    assert greedy_generate(sharded, prompts, max_new_tokens=6).tokens == greedy_generate(
        quantized, prompts, max_new_tokens=6).tokens


def test_an_nvfp4_in_proj_loads_in_the_sharded_row_order(moe, tmp_path):
    """A Mamba `in_proj` stored NVFP4 (packed codes and block scales by row, a per-tensor second scale) is read with
    its codes' and block scales' rows in the same sharded order: on a tensor axis of 2 it is the one-device load's
    rows permuted, bit for bit (and not the stored order)."""
    shutil.copytree(os.path.join(DATA, "moe"), tmp_path / "moe")
    stem = "backbone.layers.3.mixer.in_proj"

    def quantized(tensors: dict) -> None:
        packed, block_scale, scale_2 = nvfp4.quantize(tensors[stem + ".weight"])
        tensors |= {stem + ".weight": packed, stem + ".weight_scale": block_scale,
                    stem + ".weight_scale_2": np.asarray(scale_2, np.float32)}

    rewrite_tensors(tmp_path / "moe", quantized)
    single = load_target(tmp_path / "moe", dtype=jnp.float32)
    sharded = load_target(tmp_path / "moe", dtype=jnp.float32, mesh=jax.make_mesh((4, 2), ("data", "model")))
    one, split = (np.asarray(t.params["layers"][3]["mixer"]["in_proj"]["weight"]) for t in (single, sharded))
    rows = _mamba_sections(single.config)[0]
    np.testing.assert_array_equal(split, one[_shard_rows(rows, 2, 0) + _shard_rows(rows, 2, 1)])
    assert not np.array_equal(split, one)


@pytest.mark.parametrize("changes, field", [
    ({"mamba_num_heads": 6}, r"does not divide mamba_num_heads=6"),
    ({"mamba_num_heads": 12, "n_groups": 3}, r"and n_groups=3 .*: expected one to divide the other"),
    ({"ssm_state_size": 3}, r"to divide the B / C rows n_groups \* ssm_state_size=6"),
    ({"moe_shared_expert_intermediate_size": 50}, r"does not divide moe_shared_expert_intermediate_size=50"),
])
def test_a_tensor_axis_that_does_not_split_the_mamba_heads_groups_or_experts_is_named(moe, changes, field):
    """A tensor axis of 4 with Mamba heads, groups (or their B / C rows) or MoE widths it does not split: a
    `ConfigError` naming the field before anything is placed."""
    target, _ = moe
    odd = dataclasses.replace(target, config=msgspec.structs.replace(target.config, **changes))
    with pytest.raises(ConfigError, match=rf"^NemotronHTarget.shard: tensor axis .model. has 4 devices.*{field}"):
        odd.shard(jax.make_mesh((2, 4), ("data", "model")))


@pytest.mark.parametrize("name", ["backbone.layers.4.mixer.experts.6.down_proj.weight_scale",
                                  "backbone.layers.3.mixer.in_proj.weight_scale"])
def test_a_quantized_tensor_with_scales_of_another_shape_is_named(mixed, tmp_path, name):
    """An expert's NVFP4 block scales, or the FP8 scale of a Mamba `in_proj` read in the sharded row order (a
    tensor axis of 2), of the wrong shape."""
    directory, *_ = mixed
    shutil.copytree(directory, tmp_path / "bad")
    rewrite_tensors(tmp_path / "bad", lambda t: t.update({name: t[name][:, :1] if t[name].ndim else t[name][None]
                                                          .repeat(2)}))
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        load_target(tmp_path / "bad", mesh=jax.make_mesh((4, 2), ("data", "model")))


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu" or jax.device_count() < 2, reason="needs 2+ CUDA GPUs")
def test_mamba_split_over_every_gpu(tmp_path):
    """Tensor-parallel over all the GPUs (2, 4 or 8: every one a divisor of the 8 groups, B and C split by group;
    float32, so that greedy tokens are exact): each GPU holds 1/n of every Mamba block's one `in_proj`, prefill and
    a verify agree with one GPU, the verify program gathers no Mamba weight nor `in_proj`'s product (each GPU
    reads only its own rows, in one product), and speculative decoding on the mesh returns the mesh's own greedy
    tokens."""
    from dflash_jax.target.nemotron_h_config import parse_nemotron_h_config
    from dflash_jax.target.nemotron_h_target import random_nemotron_h

    with open(os.path.join(DATA, "moe", "config.json")) as f:  # 16 Mamba heads of 5, 8 groups of state 12
        raw = json.load(f) | {"num_attention_heads": 8, "mamba_num_heads": 16, "mamba_head_dim": 5, "n_groups": 8,
                              "ssm_state_size": 12}
    single = random_nemotron_h(parse_nemotron_h_config(raw, source="gpu test"), seed=1, dtype=jnp.float32)
    n = jax.device_count()
    mesh = jax.make_mesh((1, n), ("data", "model"))
    target = single.shard(mesh)
    rows = sum(_mamba_sections(single.config)[0])  # 2 * 80 + 2 * 96 + 16 = 368
    mixer = target.params["layers"][0]["mixer"]
    assert mixer["in_proj"]["weight"].addressable_shards[0].data.shape[0] == rows // n
    assert mixer["conv1d"]["weight"].addressable_shards[0].data.shape[0] == (80 + 2 * 96) // n
    prompts = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 40)), jnp.int32)
    lengths = jnp.asarray([40, 23], jnp.int32)
    outs = []
    for t in (single, target):
        out = t.prefill(prompts, t.init_cache(2, 64), lengths, chunk=16)
        block = t(prompts[:, :5], out.cache, lengths)
        outs.append([out.logits, block.logits])
    for a, b in zip(*outs):  # sums in another order across devices (4e-6 on the CPU, the mesh test above)
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=2e-3, rtol=0)
    cache = target.init_cache(2, 64)
    hlo = _forward.lower(target, prompts[:, :5], (cache.k, cache.v), cache.mamba, lengths, ()).compile().as_text()
    H = target.config.hidden_size
    whole = (f"[{rows},{H}]", f"[{H},80]", f",{rows}]")  # in_proj's and out_proj's weights, in_proj's product
    gathered = [line for line in hlo.splitlines() if " all-gather" in line and any(w in line for w in whole)]
    assert not gathered, gathered[:3]
    write_checkpoint(tmp_path, "tiny-nemotron-dspark")
    drafter = load_drafter(tmp_path, mesh=mesh, dtype=jnp.float32)
    sequences = [prompts[0].tolist(), prompts[1, :23].tolist()]
    greedy = greedy_generate(target, sequences, max_new_tokens=8).tokens
    assert speculative_generate(target, drafter, sequences, max_new_tokens=8).tokens == greedy

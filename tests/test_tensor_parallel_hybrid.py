"""The Qwen3.5 hybrid target (dense and MoE) tensor-parallel on the 8 simulated CPU devices (`conftest`).

On meshes (4, 2) and (2, 4) of ("data", "model") (a tensor axis of 2, which also splits the 2 KV heads, and of 4,
which replicates them; the batch split over "data"), a tiny random checkpoint loaded with `load_target` (the dense
target on both meshes, the MoE one on (4, 2) here and (2, 4) in the speculative test; suite time):
- every leaf has its planned sharding, and the delta-net (its one input projection and conv, out), attention and
  expert leaves are split over "model" as written here by hand (each device holding 1/tp); each device's block of
  the delta net's `in_proj` and conv holds its heads' rows, as `shard` of the one-device target places them;
- prefill, a verify block, commit (a different kept count per sequence) and the decode step after it give the
  unsharded logits, features and committed states, and the committed cache keeps its planned sharding;
- the decode step runs one delta-net input product a layer and device, and gathers no weight; without the row
  order the split delta net is wrong; a device's shard of `in_proj` reads only its rows of the stored tensors;
- greedy speculative decoding (a DFlash drafter replicated beside the target) returns the unsharded target's greedy
  tokens: the dense target on (4, 2), the MoE one on (2, 4) (each loop compiles for a while; suite time).
"""

from __future__ import annotations

import dataclasses
import math
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dflash_jax import Adaptive, greedy_generate, load_drafter, load_target, speculative_generate
from dflash_jax.safetensors import Checkpoint
from dflash_jax.target.delta_net import CONV_AXES, STORED, conv_sizes, in_proj_sizes
from dflash_jax.target.qwen3_5 import Qwen3_5Target, _forward, plan_qwen3_5
from dflash_jax.target.sections import section_order
from dflash_jax.testing import write_checkpoint, write_qwen3_5_checkpoint

from . import _io

PROMPTS = np.array([[5, 17, 99, 3, 8, 1, 4], [120, 4, 9, 0, 0, 0, 0], [7, 7, 2, 50, 0, 0, 0], [64, 0, 0, 0, 0, 0, 0]])
LENGTHS = np.array([7, 3, 4, 1])
BLOCK = np.array([[7, 8, 9], [10, 11, 12], [1, 2, 3], [90, 91, 92]])
KEPT = np.array([2, 0, 3, 1])  # every count from "none of the block" to "all of it"
LAYER_IDS = (0, 1)
MAX_NEW = 8


def _run(target: Qwen3_5Target) -> tuple[list[jax.Array], object]:
    """Prefill, verify a block, commit `KEPT`, decode one token: the outputs to compare, and the committed cache."""
    with jax.default_matmul_precision("float32"):
        out = target.prefill(jnp.asarray(PROMPTS), target.init_cache(4, 16), jnp.asarray(LENGTHS),
                             layer_ids=LAYER_IDS, chunk=4)
        block = target(jnp.asarray(BLOCK), out.cache, jnp.asarray(LENGTHS), layer_ids=LAYER_IDS)
        committed = target.commit(block.cache, jnp.asarray(KEPT))
        after = LENGTHS + KEPT
        step = target(jnp.asarray(BLOCK[:, :1] + 1), committed, jnp.asarray(after), layer_ids=LAYER_IDS)
    return [out.logits, out.features, block.logits, block.features, step.logits, step.features,
            *committed.state], committed


@pytest.fixture(scope="module")
def model(request, tmp_path_factory):
    """A checkpoint of the preset (float32), a drafter for it, and the target loaded on one device."""
    root = tmp_path_factory.mktemp(request.param)
    write_qwen3_5_checkpoint(root / "target", request.param, seed=3, dtype="float32")
    write_checkpoint(root / "drafter", "tiny-dflash", seed=2)
    return root, load_target(root / "target", dtype=jnp.float32)


def _planned(moe: bool) -> dict[str, P]:
    """Shardings by hand (layer 0 delta net, layer 1 gated attention), from the Megatron recipe: output-split
    projections (the delta net's one input projection, its conv and per-head vectors), input-split out / o / down."""
    delta, attn, mlp = "layers.0.linear_attn.", "layers.1.self_attn.", "layers.0.mlp."
    split = {delta + "in_proj.weight": P("model", None), delta + "conv1d.weight": P("model", None, None),
             delta + "A_log": P("model"), delta + "dt_bias": P("model"), delta + "out_proj.weight": P(None, "model"),
              attn + "q_proj.weight": P("model", None), attn + "o_proj.weight": P(None, "model"),
              "embed_tokens.weight": P("model", None), "lm_head.weight": P("model", None)}
    if moe:  # each expert's width split; the shared expert as a dense MLP
        split |= {mlp + "experts.gate_proj": P(None, "model", None), mlp + "experts.up_proj": P(None, "model", None),
                  mlp + "experts.down_proj": P(None, None, "model"),
                  mlp + "shared_expert.gate_proj.weight": P("model", None),
                  mlp + "shared_expert.down_proj.weight": P(None, "model")}
    else:
        split |= {mlp + "gate_proj.weight": P("model", None), mlp + "down_proj.weight": P(None, "model")}
    return split


@pytest.mark.parametrize("model, shape", [("tiny-qwen3_5-tp", (4, 2)), ("tiny-qwen3_5-tp", (2, 4)),
                                          ("tiny-qwen3_5-moe-tp", (4, 2))],
                         indirect=["model"], ids=["dense-4x2", "dense-2x4", "moe-4x2"])
def test_sharded_equals_unsharded(model, shape):
    root, unsharded = model
    mesh = jax.make_mesh(shape, ("data", "model"))
    target = load_target(root / "target", mesh=mesh, dtype=jnp.float32)
    assert isinstance(target, Qwen3_5Target) and target.layout is not None
    tp = shape[1]
    by_hand = _planned(target.config.is_moe)
    by_hand |= {"layers.1.self_attn.k_proj.weight": P("model" if tp == 2 else None, None)}  # 2 KV heads
    plan = plan_qwen3_5(target.config)
    assert len(jax.tree.leaves(target.params)) == len(plan)
    seen = set()
    for t in plan:
        leaf = _io.leaf(target.params, t.path)
        name = t.name.removeprefix("model.")
        assert leaf.sharding == target.layout.sharding(t.axes), name
        if name in by_hand:
            seen.add(name)
            assert leaf.sharding.spec == by_hand[name], name
        splits = sum(axis == "model" for axis in leaf.sharding.spec)
        assert math.prod(leaf.addressable_shards[0].data.shape) == math.prod(t.shape) // tp**splits, name
    assert seen == set(by_hand)
    c = target.config
    rows, channels = section_order(in_proj_sizes(c), tp), section_order(conv_sizes(c), tp)
    for name, order in (("in_proj", rows), ("conv1d", channels)):  # each device's block: its heads' sections
        whole = np.asarray(unsharded.params["layers"][0]["linear_attn"][name]["weight"])[order]
        for shard in target.params["layers"][0]["linear_attn"][name]["weight"].addressable_shards:
            np.testing.assert_array_equal(shard.data, whole[shard.index[0]])
    chex.assert_trees_all_equal(unsharded.shard(mesh).params, target.params)

    (expected, one), (results, committed) = _run(unsharded), _run(target)
    for conv, whole in zip(committed.conv, one.conv):  # by head, in the conv weight's order
        assert conv.sharding.is_equivalent_to(NamedSharding(mesh, P("data", None, "model")), 3)
        np.testing.assert_allclose(np.asarray(conv), np.asarray(whole)[..., channels], atol=3e-4, rtol=0)
    assert target.layout.spec(CONV_AXES, 4) == P(("data",), None, "model")
    for state in committed.state:
        assert state.sharding.is_equivalent_to(NamedSharding(mesh, P("data", "model")), 4)
    # The tensor-parallel sums (out_proj, o_proj, down_proj, the experts' down projections) add in another order:
    # measured 9.5e-6 and 1.2e-5 at most (dense; |values| <= 4.2) and 2.1e-5 (MoE) on these 2-layer models. The
    # bounds are those of the same presets with 4 layers (3 delta-net + 1 attention), which measured 8.5e-5 to
    # 1.8e-4 (dense; the second on an AMD EPYC, whose XLA:CPU kernels vectorise the sums otherwise) and 7.2e-4 (MoE:
    # the one-token sequence, whose first delta-net output `(q.k) beta v` is small and divided by its size in the
    # gated RMSNorm, amplifying rounding)
    for a, b in zip(expected, results, strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-3 if target.config.is_moe else 3e-4,
                                   rtol=0)


@pytest.mark.parametrize("model, shape", [("tiny-qwen3_5-tp", (4, 2)), ("tiny-qwen3_5-moe-tp", (2, 4))],
                         indirect=["model"], ids=["dense-4x2", "moe-2x4"])
def test_speculative_tokens_equal_unsharded_greedy(model, shape):
    """The MoE target at the fixed draft length, the dense one under the adaptive policy choosing between plain
    steps and verifies of every draft on the mesh (two lengths: each length is one more branch to compile, and a
    branch of the MoE target compiles for twice as long as the dense one's)."""
    root, unsharded = model
    prompts = [p[:n].tolist() for p, n in zip(PROMPTS, LENGTHS)]
    greedy = greedy_generate(unsharded, prompts, max_new_tokens=MAX_NEW).tokens
    mesh = jax.make_mesh(shape, ("data", "model"))
    target = load_target(root / "target", mesh=mesh, dtype=jnp.float32)
    drafter = load_drafter(root / "drafter", mesh=mesh, dtype=jnp.float32)
    K = drafter.config.num_draft_tokens
    draft_length = "fixed" if target.config.is_moe else Adaptive(draft_lengths=(0, K))
    assert speculative_generate(target, drafter, prompts, max_new_tokens=MAX_NEW,
                                draft_length=draft_length).tokens == greedy


def _decode_hlo(target: Qwen3_5Target) -> str:
    """The compiled decode step (`_forward` over one row of a batch of 2): its optimised HLO."""
    cache = target.init_cache(2, 16)
    return _forward.lower(target, jnp.ones((2, 1), jnp.int32), cache, jnp.full(2, 5, jnp.int32), ()).compile().as_text()


@pytest.mark.parametrize("model", ["tiny-qwen3_5-tp"], indirect=True)
def test_one_input_product_per_delta_net_layer_and_device(model):
    """The decode step compiled on one device and on a tensor axis of 2: each delta-net layer runs ONE input product
    (an output of all its 208 rows on one device, of the shard's 104 on each of 2), no convolution op (the conv is
    multiply-adds), and nothing of the input weight's size is all-gathered. 17 dot ops in all on both for the 2-layer
    preset (one delta-net layer; six input products a layer made five more a layer: 44 against 29 with the 4-layer
    preset at 63cae51)."""
    root, unsharded = model
    c = unsharded.config
    rows, delta = sum(in_proj_sizes(c)), c.layer_types.count("linear_attention")
    sharded = load_target(root / "target", mesh=jax.make_mesh((4, 2), ("data", "model")), dtype=jnp.float32)
    for target, devices in ((unsharded, 1), (sharded, 2)):
        hlo = _decode_hlo(target)
        dots = re.findall(r"= f32\[([\d,]*)\]\{[\d,]*\} dot\(", hlo)
        assert sum(shape.split(",")[-1] == str(rows // devices) for shape in dots) == delta, (devices, dots)
        assert len(dots) == 17, (devices, dots)
        assert " convolution(" not in hlo
        gathered = re.findall(r"= \w+\[([\d,]*)\]\S* all-gather\(", hlo)
        assert not [g for g in gathered if {str(rows), str(rows // devices)} & set(g.split(","))], gathered


@pytest.mark.parametrize("model", ["tiny-qwen3_5-tp"], indirect=True)
def test_without_the_row_order_the_split_delta_net_is_wrong(model):
    """The sharded order matters, for each of the two tensors: the tp2 target's prefill with every delta-net layer's
    `in_proj` rows, or its conv's channels, placed in the stored order (same sharding) is far from the one-device
    logits (measured 4.4 and 3.6, of logits up to 3.9; the order kept: 3e-4 at most, as the test above checks)."""
    root, unsharded = model
    sharded = load_target(root / "target", mesh=jax.make_mesh((4, 2), ("data", "model")), dtype=jnp.float32)

    def stored_order(module: str) -> Qwen3_5Target:
        layers = list(sharded.params["layers"])
        for i, layer in enumerate(layers):
            if "linear_attn" in layer:
                p = layer["linear_attn"]
                stored = unsharded.params["layers"][i]["linear_attn"][module]["weight"]
                layers[i] = {**layer, "linear_attn": {**p, module: {"weight": jax.device_put(
                    stored, p[module]["weight"].sharding)}}}
        return dataclasses.replace(sharded, params={**sharded.params, "layers": tuple(layers)})

    def logits(target: Qwen3_5Target) -> np.ndarray:
        return np.asarray(target.prefill(jnp.asarray(PROMPTS), target.init_cache(4, 16), jnp.asarray(LENGTHS),
                                         chunk=4).logits)

    expected = logits(unsharded)
    for module in ("in_proj", "conv1d"):
        assert np.abs(logits(stored_order(module)) - expected).max() > 0.1, module


@pytest.mark.parametrize("model", ["tiny-qwen3_5-tp"], indirect=True)
def test_a_shard_of_the_delta_net_in_proj_reads_only_its_rows(model, monkeypatch):
    """On a tensor axis of 2, device 1's shard of a delta-net `in_proj` (rows 104..207 of the sharded order) is read
    as its six runs of the four stored tensors (its halves of q, k and v in `in_proj_qkv`, of z, b and a), 104 rows
    in all: no byte of device 0's."""
    root, unsharded = model
    c = unsharded.config
    layout = Qwen3_5Target.layout_for(c, jax.make_mesh((4, 2), ("data", "model")), "model", "test")
    layer = "model.layers.0.linear_attn."
    with Checkpoint(root / "target") as stored:
        reads: list[tuple[str, int, int]] = []  # the rows of each read of a stored delta-net input tensor
        read = stored.read

        def spy(tensor: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
            if tensor.startswith(layer + "in_proj_"):
                reads.append((tensor.removeprefix(layer), index[0].start, index[0].stop))
            return read(tensor, index)

        monkeypatch.setattr(stored, "read", spy)
        views = Qwen3_5Target.views(stored, c, "model.", layout)
        shard = views.read(layer + "in_proj.weight", (slice(104, 208), slice(0, 64)))
        whole = np.concatenate([read(layer + name) for name in STORED])
        np.testing.assert_array_equal(shard, whole[section_order(in_proj_sizes(c), 2)[104:]])
    assert reads == [("in_proj_qkv.weight", 16, 32), ("in_proj_qkv.weight", 48, 64), ("in_proj_qkv.weight", 96, 128),
                     ("in_proj_z.weight", 32, 64), ("in_proj_b.weight", 4, 8), ("in_proj_a.weight", 4, 8)]


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu" or jax.device_count() < 2, reason="needs 2+ CUDA GPUs")
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_hybrid_split_over_every_gpu(tmp_path, moe):
    """Tensor-parallel over all the GPUs (2, 4 or 8; float32, so that greedy tokens are exact): prefill and a verify
    block agree with one GPU, the verify program gathers no delta-net input weight (each GPU reads only its heads), and
    speculative decoding on the mesh returns the mesh's own greedy tokens."""
    from dflash_jax.testing import QWEN3_5_TINY_CONFIGS, random_qwen3_5

    n = jax.device_count()
    raw = {**QWEN3_5_TINY_CONFIGS["tiny-qwen3_5-moe-tp" if moe else "tiny-qwen3_5-tp"], "linear_num_key_heads": 8,
           "linear_num_value_heads": 16, "linear_key_head_dim": 32, "linear_value_head_dim": 32}
    single = random_qwen3_5(raw, seed=1, dtype=jnp.float32)
    mesh = jax.make_mesh((1, n), ("data", "model"))
    target = single.shard(mesh)
    prompts = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 40)), jnp.int32)
    lengths = jnp.asarray([40, 23], jnp.int32)
    outs = []
    for t in (single, target):
        out = t.prefill(prompts, t.init_cache(2, 64), lengths, layer_ids=(0, 1), chunk=16)
        block = t(prompts[:, :5], out.cache, lengths, layer_ids=(0, 1))
        outs.append([out.logits, block.logits, block.features])
    for a, b in zip(*outs):  # sums in another order across devices (1e-4 on the CPU, this file's test above)
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=2e-3, rtol=0)
    hlo = _forward.lower(target, prompts[:, :5], target.init_cache(2, 64), lengths, (0, 1)).compile().as_text()
    c = target.config
    whole = (f"[{sum(in_proj_sizes(c))},{c.hidden_size}]",)  # the delta net's input weight, gathered
    gathered = [line for line in hlo.splitlines() if " all-gather" in line and any(w in line for w in whole)]
    assert not gathered, gathered[:3]
    write_checkpoint(tmp_path, "tiny-dflash", seed=2)
    drafter = load_drafter(tmp_path, mesh=mesh, dtype=jnp.float32)
    rows = [prompts[0].tolist(), prompts[1, :23].tolist()]
    greedy = greedy_generate(target, rows, max_new_tokens=MAX_NEW).tokens
    assert speculative_generate(target, drafter, rows, max_new_tokens=MAX_NEW).tokens == greedy

"""The Qwen3.5-MoE sparse block (`target.moe`) against transformers, its grouped matmuls against a dense form,
and the expert stacks read from both disk layouts (`target.experts`), errors included.

Reference data: `tests/data/qwen3_5_moe/block` (transformers 5.24.0 `Qwen3_5MoeSparseMoeBlock`, float32; written
by `make_reference.py` there).
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from dflash_jax import CheckpointError, ConfigError
from dflash_jax.layers import linear
from dflash_jax.placement import auto_mesh, place_all
from dflash_jax.plan import build_tree, check_tensors, planned
from dflash_jax.platform import process_platform
from dflash_jax.safetensors import Checkpoint, write_tensors
from dflash_jax.spec import EXPERT_MLP, EXPERTS, expand
from dflash_jax.target.experts import add_expert_stacks
from dflash_jax.target.moe import MoeDims, moe_block, moe_parameter_spec, route, routed_experts
from dflash_jax.target.views import TensorViews

from ._io import load_file
from .conftest import DATA

BLOCK = os.path.join(DATA, "qwen3_5_moe", "block")
PREFIX = "model.layers.{i}.mlp."


@pytest.fixture(scope="module")
def dims() -> MoeDims:
    with open(os.path.join(BLOCK, "config.json")) as f:
        raw = json.load(f)
    return MoeDims(**{k: raw[k] for k in ("hidden_size", "num_experts", "num_experts_per_tok",
                                          "moe_intermediate_size", "shared_expert_intermediate_size")})


@pytest.fixture(scope="module")
def io() -> dict[str, np.ndarray]:
    return load_file(os.path.join(BLOCK, "io.safetensors"))


def load_blocks(directory: str, c: MoeDims, layers: int = 1, shardings=None, prefix: str = PREFIX) -> list:
    """The MoE blocks of a checkpoint as the loader reads them: plan from the spec, check, place, nest."""
    root = prefix.partition("layers.")[0]
    plan = [planned(s, s.name, root=root) for s in expand(moe_parameter_spec(c, prefix), layers)]
    with Checkpoint(directory) as base:
        checkpoint = _stacks(base, [prefix.format(i=i) for i in range(layers)], c)
        check_tensors(plan, checkpoint, directory)
        leaves = place_all(plan, checkpoint, set(), mesh=None, dtype=jnp.float32, progress=False,
                           shardings=None if shardings is None else [shardings(t) for t in plan])
    return [layer["mlp"] for layer in build_tree(plan, leaves)["layers"]]


def _stacks(base: Checkpoint, prefixes: list[str], c: MoeDims) -> TensorViews:
    views = TensorViews(base)
    for prefix in prefixes:
        add_expert_stacks(views, prefix, c)
    return views


@pytest.fixture(scope="module")
def block(dims):
    return load_blocks(BLOCK, dims)[0]


def dense_block(p, c: MoeDims, x: jax.Array) -> jax.Array:
    """The block with every expert run on every token and combined by one-hot routing weights: `tokens * E` rows
    (the ragged form computes `tokens * k`). Same router; the expert arithmetic is independent of `_grouped`."""
    batch, S, H = x.shape
    xt = x.reshape(-1, H)
    weights, experts = route(p, c, xt)  # [T, k]
    combine = jnp.einsum("tke,tk->te", jax.nn.one_hot(experts, c.num_experts, dtype=jnp.float32), weights)
    e, hi = p["experts"], jax.lax.Precision.HIGHEST
    h = jax.nn.silu(jnp.einsum("th,eih->tei", xt, e["gate_proj"], precision=hi)) * jnp.einsum(
        "th,eih->tei", xt, e["up_proj"], precision=hi)  # [T, E, I]
    routed = jnp.einsum("tei,ehi,te->th", h, e["down_proj"], combine, precision=hi)
    s = p["shared_expert"]
    shared = linear(jax.nn.silu(linear(xt, s["gate_proj"])) * linear(xt, s["up_proj"]), s["down_proj"])
    return (routed + jax.nn.sigmoid(linear(xt, p["shared_expert_gate"])) * shared).reshape(batch, S, H)


_block = jax.jit(moe_block, static_argnums=(1, 3))
IMPLS = ("gather", "reduce", "slots", "tiled", "grouped", "ragged_dot")  # how the routed experts run (`moe._routed`)


@pytest.mark.parametrize("impl", IMPLS)
def test_matches_transformers(block, dims, io, impl):
    """Float32 against transformers' block: measured max error 7.2e-7 on outputs up to 3.2 (3 ulp; 1.4x margin)."""
    y = np.asarray(_block(block, dims, jnp.asarray(io["x"]), impl))
    assert np.abs(y - io["y"]).max() < 1e-6


def test_router_choices_equal_transformers(block, dims, io):
    """The same experts in the same order (descending weight), and their renormalised weights (measured 1.2e-7)."""
    x = jnp.asarray(io["x"])
    np.testing.assert_array_equal(np.asarray(routed_experts(block, dims, x)), io["experts"])
    weights, _ = route(block, dims, x.reshape(-1, dims.hidden_size))
    np.testing.assert_allclose(np.asarray(weights).reshape(io["weights"].shape), io["weights"], rtol=0, atol=2e-7)
    assert np.asarray(routed_experts(block, dims, x)).dtype == np.int32


def test_renormalised_routing_normalises_only_the_top_k(block, dims):
    """Renormalised, the weights are the softmax of the k largest logits: no exponential over all E experts (one
    kernel fewer a block on the GPU), the weights as transformers' (above)."""
    x = jnp.zeros((5, dims.hidden_size), jnp.float32)
    exps = [e for e in jax.make_jaxpr(lambda x: route(block, dims, x))(x).eqns if e.primitive.name == "exp"]
    assert exps and all(e.outvars[0].aval.shape == (5, dims.num_experts_per_tok) for e in exps)


@pytest.mark.parametrize("impl", IMPLS)
def test_grouped_matmuls_equal_the_dense_form(block, dims, impl):
    """Uneven groups: one token repeated 10 times (its two experts get 10+ rows each), 3 others, so that some
    experts get none. Measured max error 3.6e-7 on values up to 1.6."""
    rng = np.random.default_rng(5)
    rows = np.concatenate([np.repeat(rng.standard_normal((1, dims.hidden_size)), 10, 0),
                           rng.standard_normal((3, dims.hidden_size))])
    x = jnp.asarray(rows.astype(np.float32).reshape(1, 13, dims.hidden_size))
    counts = np.bincount(np.asarray(routed_experts(block, dims, x)).ravel(), minlength=dims.num_experts)
    assert counts.min() == 0 and counts.max() >= 10
    np.testing.assert_allclose(np.asarray(_block(block, dims, x, impl)), np.asarray(dense_block(block, dims, x)),
                               rtol=0, atol=1e-6)


@pytest.mark.parametrize("tile", [1, 4, 7])
def test_tiles_of_few_rows_equal_the_dense_form(block, dims, tile):
    """Experts whose runs span several tiles and end mid-tile (the uneven groups above, tiles of 1, 4 and 7 rows):
    each pair's row lands in its expert's tile and comes back to its token. Measured max error 3.6e-7."""
    import dflash_jax.target.moe as moe

    here = process_platform()
    tiles = dataclasses.replace(here, tuning=dataclasses.replace(here.tuning, moe_tile_rows=tile))
    rng = np.random.default_rng(6)
    rows = np.concatenate([np.repeat(rng.standard_normal((1, dims.hidden_size)), 10, 0),
                           rng.standard_normal((5, dims.hidden_size))])
    x = jnp.asarray(rows.astype(np.float32).reshape(1, 15, dims.hidden_size))
    tiled = jax.jit(lambda block, x: moe.moe_block(block, dims, x, "tiled", tiles))  # one program (with this tile)
    np.testing.assert_allclose(np.asarray(tiled(block, x)), np.asarray(dense_block(block, dims, x)), rtol=0,
                               atol=1e-6)


def test_auto_gathers_few_rows_and_tiles_many(block, dims, monkeypatch):
    """The platform's `moe_gather_max_rows` and `moe_few_rows` (`tuning`) decide; a typo in impl is refused."""
    import dflash_jax.target.moe as moe

    calls = []
    for name in ("_gathered", "_gathered_in_place", "_tiled"):
        real = getattr(moe, name)
        monkeypatch.setattr(moe, name, lambda *a, real=real, name=name, **kw: calls.append(name) or real(*a, **kw))
    x = jnp.zeros((1, 3, dims.hidden_size), jnp.float32)  # 3 tokens x top-2: 6 pairs
    here = process_platform()

    def block_traced(**tuned):  # the choice is made while tracing: nothing compiles
        platform = dataclasses.replace(here, tuning=dataclasses.replace(here.tuning, **tuned))
        jax.eval_shape(lambda: moe.moe_block(block, dims, x, platform=platform))

    block_traced(moe_few_rows="gather")
    block_traced(moe_few_rows="reduce")
    block_traced(moe_gather_max_rows=5)
    assert calls == ["_gathered", "_gathered_in_place", "_tiled"]
    with pytest.raises(ValueError, match="moe impl"):
        moe.moe_block(block, dims, x, "ragged")


def test_jit_with_two_lengths(block, dims, io):
    """One jitted function, two row counts (a decode step, a verify block): each row as transformers'."""
    for S in (1, 5):
        x = jnp.asarray(io["x"][:, :S])
        np.testing.assert_allclose(np.asarray(_block(block, dims, x)), io["y"][:, :S], rtol=0, atol=1e-6)


@pytest.mark.parametrize("impl", ["auto", "reduce"])
def test_bfloat16_runs_in_bfloat16(block, dims, io, impl):
    """bf16 weights and rows give bf16 out, near the float32 result (measured 1.5e-2 on values up to 3.2)."""
    low = jax.tree.map(lambda a: a.astype(jnp.bfloat16), block)
    y = _block(low, dims, jnp.asarray(io["x"], jnp.bfloat16), impl)
    assert y.dtype == jnp.bfloat16
    assert np.abs(np.asarray(y, np.float32) - io["y"]).max() < 3e-2


# --------------------------------------------------------------------------------------------------------------
# Loading: the released fused layout and the per-expert one
# --------------------------------------------------------------------------------------------------------------


def per_expert(tensors: dict[str, np.ndarray], c: MoeDims) -> dict[str, np.ndarray]:
    """The fused expert tensors of `tensors` split into transformers 4's one tensor per expert."""
    out = {}
    for name, array in tensors.items():
        head, _, tail = name.rpartition("experts.")
        if tail == "gate_up_proj":
            for j in range(c.num_experts):
                out[f"{head}experts.{j}.gate_proj.weight"] = array[j, : c.moe_intermediate_size]
                out[f"{head}experts.{j}.up_proj.weight"] = array[j, c.moe_intermediate_size :]
        elif tail == "down_proj":
            out.update({f"{head}experts.{j}.down_proj.weight": array[j] for j in range(c.num_experts)})
        else:
            out[name] = array
    return out


@pytest.fixture(scope="module")
def per_expert_dir(tmp_path_factory, dims) -> str:
    """The reference block as a two-layer, two-shard per-expert checkpoint (layer 1: the weights negated)."""
    fused = load_file(os.path.join(BLOCK, "model.safetensors"))
    second = {n.replace("layers.0.", "layers.1."): -a for n, a in fused.items()}
    directory = str(tmp_path_factory.mktemp("moe-per-expert"))
    write_tensors(directory, per_expert(fused | second, dims), num_shards=2)
    return directory


def test_fused_stacks_are_the_released_tensor_split(block, dims):
    fused = load_file(os.path.join(BLOCK, "model.safetensors"))
    gate_up = fused["model.layers.0.mlp.experts.gate_up_proj"]
    I = dims.moe_intermediate_size
    np.testing.assert_array_equal(np.asarray(block["experts"]["gate_proj"]), gate_up[:, :I])
    np.testing.assert_array_equal(np.asarray(block["experts"]["up_proj"]), gate_up[:, I:])
    np.testing.assert_array_equal(np.asarray(block["experts"]["down_proj"]),
                                  fused["model.layers.0.mlp.experts.down_proj"])


def test_per_expert_layout_loads_the_same_stacks(block, dims, per_expert_dir):
    first, second = load_blocks(per_expert_dir, dims, layers=2)
    for a, b, c in zip(jax.tree.leaves(block), jax.tree.leaves(first), jax.tree.leaves(second)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_array_equal(np.asarray(a), -np.asarray(c))
    with Checkpoint(per_expert_dir) as base:
        names = set(_stacks(base, [PREFIX.format(i=0)], dims))
    assert "model.layers.0.mlp.experts.up_proj" in names and "model.layers.0.mlp.experts.3.up_proj.weight" not in names


def test_released_model_layout_loads(dims):
    """The tiny whole model (BF16, `model.language_model.` prefix, fused experts, as released): every layer's
    block loads, cast to float32 exactly."""
    directory = os.path.join(DATA, "qwen3_5_moe", "model")
    blocks = load_blocks(directory, dims, layers=4, prefix="model.language_model.layers.{i}.mlp.")
    fused = load_file(os.path.join(directory, "model.safetensors"))
    for i, p in enumerate(blocks):
        gate_up = fused[f"model.language_model.layers.{i}.mlp.experts.gate_up_proj"].astype(np.float32)
        np.testing.assert_array_equal(np.asarray(p["experts"]["up_proj"]), gate_up[:, dims.moe_intermediate_size:])
        assert p["experts"]["gate_proj"].dtype == jnp.float32


@pytest.mark.parametrize("axis", [EXPERTS, EXPERT_MLP])
def test_stacks_load_sharded(block, dims, per_expert_dir, axis):
    """Placed in parts (one expert, or a quarter of each expert's width, per device): each part read from its
    sources' own rows gives the same leaves; the block runs on them and agrees (measured 3.6e-7, 0 by experts)."""
    mesh = auto_mesh(jax.make_mesh((8,), ("model",)))

    def sharding(t):
        return NamedSharding(mesh, PartitionSpec(*("model" if a == axis else None for a in t.axes)))

    for directory in (BLOCK, per_expert_dir):
        sharded = load_blocks(directory, dims, shardings=sharding)[0]
        assert sharded["experts"]["up_proj"].sharding.shard_shape((8, 32, 64)) == (
            (1, 32, 64) if axis == EXPERTS else (8, 4, 64))
        for a, b in zip(jax.tree.leaves(block), jax.tree.leaves(sharded)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    x = jnp.asarray(np.random.default_rng(6).standard_normal((2, 3, dims.hidden_size)).astype(np.float32))
    np.testing.assert_allclose(np.asarray(_block(sharded, dims, x)), np.asarray(_block(block, dims, x)),
                               rtol=0, atol=1e-6)


# --------------------------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------------------------


def _rewritten(tmp_path, dims, change) -> str:
    tensors = per_expert(load_file(os.path.join(BLOCK, "model.safetensors")), dims)
    change(tensors)
    write_tensors(str(tmp_path), tensors)
    return str(tmp_path)


def test_a_missing_expert_is_named(tmp_path, dims):
    directory = _rewritten(tmp_path, dims, lambda t: t.pop("model.layers.0.mlp.experts.5.down_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.0\.mlp\.experts\.5\.down_proj\.weight'"):
        load_blocks(directory, dims)


def test_an_expert_of_the_wrong_shape_is_named(tmp_path, dims):
    def change(t):
        t["model.layers.0.mlp.experts.2.up_proj.weight"] = t["model.layers.0.mlp.experts.2.up_proj.weight"][:-1]

    directory = _rewritten(tmp_path, dims, change)
    with pytest.raises(CheckpointError, match=r"'model\.layers\.0\.mlp\.experts\.2\.up_proj\.weight' .*has shape "
                                              r"\[31, 64\], expected \[32, 64\]"):
        load_blocks(directory, dims)


def test_experts_of_mixed_dtypes_are_named(tmp_path, dims):
    def change(t):
        name = "model.layers.0.mlp.experts.4.gate_proj.weight"
        t[name] = t[name].astype(np.float16)

    with pytest.raises(CheckpointError, match=r"experts\.4\.gate_proj\.weight' has dtype F16"):
        load_blocks(_rewritten(tmp_path, dims, change), dims)


def test_a_fused_stack_of_the_wrong_shape_is_named(tmp_path, dims):
    fused = load_file(os.path.join(BLOCK, "model.safetensors"))
    fused["model.layers.0.mlp.experts.gate_up_proj"] = fused["model.layers.0.mlp.experts.gate_up_proj"][:4]
    write_tensors(str(tmp_path), fused)
    with pytest.raises(CheckpointError,
                       match=r"experts\.gate_up_proj' .*has shape \[4, 64, 64\], expected \[8, 64, 64\]"):
        load_blocks(str(tmp_path), dims)


L0 = "model.layers.0.mlp.experts."


@pytest.mark.parametrize("layout, extra, named", [
    ("per expert", "down_proj", ("down_proj'", "0.down_proj.weight'")),  # the issue's: a stacked copy, other values
    ("fused", "3.up_proj.weight", ("3.up_proj.weight'", "gate_up_proj'")),  # one per-expert tensor beside
    ("fused", "up_proj", ("up_proj'", "gate_up_proj'")),  # a stacked part of the fused tensor beside it
])
def test_experts_stored_in_two_forms_are_refused_naming_both(tmp_path, dims, layout, extra, named):
    """A layer whose experts are stored in one form and (in part) in another: one copy would load and the other
    be ignored (the per-expert stack shadowed the stored `experts.down_proj`)."""
    fused = load_file(os.path.join(BLOCK, "model.safetensors"))
    split = per_expert(fused, dims)
    tensors = dict(split if layout == "per expert" else fused)
    both = {**fused, **split, L0 + "up_proj": split[L0 + "0.up_proj.weight"][None].repeat(dims.num_experts, 0)}
    tensors[L0 + extra] = -both[L0 + extra]
    write_tensors(str(tmp_path), tensors)
    with pytest.raises(CheckpointError, match=rf"model.safetensors: tensor '{L0}{named[0]} is stored beside "
                       rf"'{L0}{named[1]}.*expected one of them"):
        load_blocks(str(tmp_path), dims)


@pytest.mark.parametrize("layout, stored", [("fused", "gate_up_proj"), ("per expert", "0.gate_proj.weight")])
def test_an_integer_expert_tensor_is_named_as_stored(tmp_path, dims, layout, stored):
    """An I32 expert weight is refused naming the tensor the file holds, not the stack read from it
    (`experts.gate_proj`)."""
    fused = load_file(os.path.join(BLOCK, "model.safetensors"))
    tensors = dict(fused if layout == "fused" else per_expert(fused, dims))
    tensors = {n: a.astype(np.int32) if "gate_" in n else a for n, a in tensors.items()}
    write_tensors(str(tmp_path), tensors)
    with pytest.raises(CheckpointError, match=rf"model.safetensors: tensor '{L0}{stored}' .*has dtype I32, expected "
                                              "one of BF16, F16, F32, F64"):
        load_blocks(str(tmp_path), dims)


def test_no_experts_at_all_is_named(tmp_path, dims):
    directory = _rewritten(tmp_path, dims, lambda t: [t.pop(n) for n in list(t) if ".experts." in n])
    with pytest.raises(CheckpointError, match=r"no expert weights under 'model\.layers\.0\.mlp\.'"):
        load_blocks(directory, dims)


@pytest.mark.parametrize("field, value, message", [
    ("num_experts_per_tok", 9, "num_experts_per_tok=9 exceeds num_experts=8"),
    ("num_experts", 0, "num_experts=0; expected a positive integer"),
])
def test_bad_sizes_are_config_errors(field, value, message):
    sizes = dict(hidden_size=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                 shared_expert_intermediate_size=48)
    with pytest.raises(ConfigError, match=message):
        MoeDims(**(sizes | {field: value}))

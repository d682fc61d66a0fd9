"""`dflash_jax.nnx.DFlashDrafter`: the loaded arrays as nnx.Params (no copy, shardings kept), logits and drafts
of the PyTorch goldens, the NNX transforms (split / merge / jit / eval_shape) and its random initialisation."""

from __future__ import annotations

import inspect
import logging

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dflash_jax import load_drafter
from dflash_jax.config import parse_config
from dflash_jax.nnx import DFlashDrafter, TargetWeight
from dflash_jax.testing import preset_dict, write_checkpoint

from ._drafters import block, features, tiny_drafter
from ._golden import CASES, golden


def inputs(drafter, batch=2, rows=6):
    c = drafter.config
    B = c.effective_block_size
    return (jnp.asarray(features(drafter, batch, rows)), jnp.asarray(block(drafter, [5, 9][:batch])),
            dict(context_positions=jnp.tile(jnp.arange(rows), (batch, 1)),
                 block_positions=jnp.tile(rows + jnp.arange(B), (batch, 1))))


def leaves_of(module, kind=nnx.Param):
    return jax.tree.leaves(nnx.state(module, kind))


def test_logits_match_the_golden_logits():
    """The module over a loaded DFlash2 golden (a windowed sliding layer, so the attention options count): the
    PyTorch reference's logits under both of its rules (test_golden.py's tolerance; measured 2.8e-5 / 2.1e-5)."""
    drafter, io = golden("dflash2-tiny-b")
    module = DFlashDrafter.from_drafter(drafter)
    positions = dict(context_positions=io["context_positions"], block_positions=io["block_positions"])
    for case, expected, atol in (("dflash2-tiny-b", io["expected_logits"], 8.5e-5),
                                 ("dflash2-tiny-b-masked", io["expected_logits_masked"], 6.5e-5)):
        logits = module(io["target_hidden"], io["block_ids"], **positions, attention=CASES[case][2])
        np.testing.assert_allclose(np.asarray(logits), expected, rtol=0, atol=atol, err_msg=case)


def test_propose_matches_the_golden_drafts():
    """DSpark (a Markov walk and a confidence head with its Markov input), the golden block as a first step, a
    key and per-sequence temperatures: the greedy sequence has the reference's drafts, confidences (measured
    1.2e-7) and cut at its threshold; the sampled one's first q row is the reference's `softmax(markov_logits /
    T)` (its predecessor is the anchor whatever is drawn)."""
    drafter, io = golden("dspark-tiny-a")
    module = DFlashDrafter.from_drafter(drafter)
    S, T = io["target_hidden"].shape[1], 0.7
    proposal, cache = module.propose(
        module.init_cache(2, 16), np.repeat(io["target_hidden"], 2, 0), np.full(2, S),
        np.repeat(io["block_ids"][:, 0].astype(np.int32), 2), key=jax.random.key(0),
        temperature=jnp.asarray([T, 0.0]), confidence_threshold=float(io["confidence_threshold"][0]))
    np.testing.assert_array_equal(np.asarray(proposal.tokens[1]), io["expected_draft_tokens"][0])
    np.testing.assert_allclose(np.asarray(proposal.confidence[1]), io["expected_confidence"][0], rtol=0, atol=5e-7)
    assert int(proposal.num_tokens[1]) == int(io["expected_num_tokens"][0])
    np.testing.assert_array_equal(np.asarray(cache.lengths), [S, S])
    scaled = io["expected_markov_logits"][0, 0] / T
    q = np.exp(scaled - scaled.max())
    np.testing.assert_allclose(np.asarray(proposal.probs[0, 0]), q / q.sum(), rtol=0, atol=5e-6)


def test_state_holds_the_loaded_arrays_without_copies(tmp_path, cpu_mesh):
    write_checkpoint(tmp_path, "tiny-dspark")
    drafter = load_drafter(tmp_path, mesh=cpu_mesh, dtype=jnp.float32)
    module = DFlashDrafter.from_drafter(drafter)
    assert all(a is b for a, b in zip(leaves_of(module), jax.tree.leaves(drafter.params)))
    assert module.params["layers"][1]["mlp"]["up_proj"]["weight"].get_value() is \
        drafter.params["layers"][1]["mlp"]["up_proj"]["weight"]
    replicated = jax.sharding.NamedSharding(cpu_mesh, jax.sharding.PartitionSpec())
    assert all(leaf.sharding.is_equivalent_to(replicated, leaf.ndim)
               for leaf in leaves_of(module))
    loaded = DFlashDrafter.from_pretrained(tmp_path, mesh=cpu_mesh, dtype=jnp.float32)
    chex.assert_trees_all_equal(loaded.drafter.params, drafter.params)
    # the target's embedding / LM head are attached variables of their own kind, not the drafter's Params
    V, H = drafter.config.vocab_size, drafter.config.hidden_size
    embed = jnp.ones((V, H), jnp.float32)
    attached = DFlashDrafter.from_drafter(drafter.attach(embed=embed, lm_head=embed))
    assert leaves_of(attached, TargetWeight) == [embed, embed] and len(leaves_of(attached)) == len(leaves_of(module))


def test_split_merge_jit_eval_shape():
    drafter = tiny_drafter("tiny-dflash2")
    module = DFlashDrafter.from_drafter(drafter)
    hidden, ids, positions = inputs(drafter)
    expected = module(hidden, ids, **positions)  # the transforms below leave it unchanged

    graphdef, state = nnx.split(module)
    merged = nnx.merge(graphdef, state)
    np.testing.assert_array_equal(merged(hidden, ids, **positions), expected)
    assert all(a is b for a, b in zip(leaves_of(merged), leaves_of(module)))

    def forward(m, hidden, ids):
        return m(hidden, ids, **positions)

    np.testing.assert_array_equal(nnx.jit(forward)(module, hidden, ids), expected)
    # jit over the split state (or, flax >= 0.12.6, graph_updates=False) leaves the weights the same arrays
    graphdef, state = nnx.split(module)
    before = leaves_of(module)
    over_state = jax.jit(lambda state, hidden, ids: forward(nnx.merge(graphdef, state), hidden, ids))
    np.testing.assert_array_equal(over_state(state, hidden, ids), expected)
    if "graph_updates" in inspect.signature(nnx.jit).parameters:
        np.testing.assert_array_equal(nnx.jit(forward, graph_updates=False)(module, hidden, ids), expected)
    assert all(a is b for a, b in zip(leaves_of(module), before))

    # an abstract module of the config: the loader's tree, shapes and dtypes, nothing allocated
    abstract = nnx.eval_shape(lambda: DFlashDrafter.init(drafter.config, rngs=nnx.Rngs(0), dtype=jnp.float32))
    assert all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in leaves_of(abstract))
    chex.assert_trees_all_equal_shapes_and_dtypes(nnx.state(abstract, nnx.Param), nnx.state(module, nnx.Param))
    assert jax.tree.structure(nnx.state(abstract, nnx.Param)) == jax.tree.structure(nnx.state(module, nnx.Param))


@pytest.mark.parametrize("preset", ["tiny-dspark", "tiny-dflash2"])
def test_init_draws_a_trainable_tree(preset):
    """The loader's tree (its shapes, from a written checkpoint), bf16, drawn as the spec's initialisers say
    (`spec.Gain`, `Bias`, `ConvIdentity`; linear weights, codebooks and embeddings N(0, 1/fan_in)), each leaf its own
    draw. The same key draws the same tree, another key another."""
    config = parse_config(preset_dict(preset))
    module = DFlashDrafter.init(config, rngs=nnx.Rngs(1), own_embeddings=True)
    params = module.drafter.params
    loaded = tiny_drafter(preset).params
    chex.assert_trees_all_equal_shapes({k: v for k, v in params.items() if k not in ("embed_tokens", "lm_head")},
                                       loaded)
    assert params["embed_tokens"]["weight"].shape == params["lm_head"]["weight"].shape == (config.vocab_size,
                                                                                          config.hidden_size)

    def normal(z, mean, std, name):  # mean and std within four standard errors (at least 5% of the std)
        bound = 4 / np.sqrt(z.size)
        assert abs(z.std() / std - 1) < max(bound, 0.05) and abs(z.mean() - mean) < 4 * bound * std, (name, z.std())

    draws = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        name, x = jax.tree_util.keystr(path), np.asarray(leaf, np.float32)
        assert leaf.dtype == jnp.bfloat16, name
        if "base_kernel" in name:  # [2, taps, H]: the identity first tap plus N(0, 0.1^2)
            normal(x - (np.arange(x.shape[1]) == 0)[None, :, None], 0, 0.1, name)
        elif "bias" in name:
            normal(x, 0, 0.02, name)
        elif x.ndim == 1:  # RMSNorm gains
            normal(x, 1, 0.1, name)
        else:  # N(0, 1/fan_in), fan_in the last axis
            normal(x * np.sqrt(x.shape[-1]), 0, 1, name)
        draws.append(x.ravel()[:16])
    assert len({d.tobytes() for d in draws}) == len(draws), "two leaves share a draw"
    again = DFlashDrafter.init(config, rngs=nnx.Rngs(1), own_embeddings=True).drafter.params
    other = DFlashDrafter.init(config, rngs=nnx.Rngs(2), own_embeddings=True).drafter.params
    chex.assert_trees_all_equal(again, params)
    assert not np.array_equal(other["fc"]["weight"], params["fc"]["weight"])


def _compiles(caplog, name: str) -> int:
    return sum(f"Compiling {name}" in r.getMessage() for r in caplog.records)


def test_nnx_jit_without_graph_updates_compiles_once(caplog):
    """`nnx.jit(f, graph_updates=False)` over a loaded module compiles once, and the module's own call is not
    recompiled by it (README: the default graph-updates mode writes every weight back, respelled)."""
    if "graph_updates" not in inspect.signature(nnx.jit).parameters:
        pytest.skip("flax < 0.12.6: no graph_updates")
    drafter = tiny_drafter("tiny-dflash")
    module = DFlashDrafter.from_drafter(drafter)
    hidden, ids, positions = inputs(drafter)

    def step(m, hidden, ids):
        return m(hidden, ids, **positions)

    jitted = nnx.jit(step, graph_updates=False)
    module(hidden, ids, **positions)  # the module's own program, compiled here
    with jax.log_compiles(True), caplog.at_level(logging.WARNING):
        for _ in range(3):
            jitted(module, hidden, ids)
        module(hidden, ids, **positions)
    assert _compiles(caplog, "jit(step)") == 1 and _compiles(caplog, "jit(_draft_logits)") == 0, [
        r.getMessage()[:80] for r in caplog.records]


def test_orbax_round_trip_of_the_drafters_own_weights(tmp_path):
    """The state to save is `nnx.state(module, nnx.Param)`, the drafter's own weights (an attached target
    embedding / LM head is a `TargetWeight`, which `init` has not); it restores into the abstract module of the
    config, `nnx.eval_shape` of `DFlashDrafter.init`."""
    ocp = pytest.importorskip("orbax.checkpoint")
    drafter = tiny_drafter("tiny-dflash")
    module = DFlashDrafter.from_drafter(drafter)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "state", nnx.state(module, nnx.Param))
        abstract = nnx.eval_shape(lambda: DFlashDrafter.init(drafter.config, rngs=nnx.Rngs(0), dtype=jnp.float32))
        graphdef, target = nnx.split(abstract, nnx.Param)
        restored = nnx.merge(graphdef, checkpointer.restore(tmp_path / "state", target))
    chex.assert_trees_all_equal(nnx.state(restored, nnx.Param), nnx.state(module, nnx.Param))

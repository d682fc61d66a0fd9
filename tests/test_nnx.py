"""`dflash_jax.nnx.DFlashDrafter`: the loaded arrays as nnx.Params (no copy, shardings kept), logits and drafts
equal to `draft_logits` / `propose`, and the NNX transforms (split / merge / jit / eval_shape)."""

from __future__ import annotations

import inspect
import logging

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dflash_jax import AttentionOptions, draft_logits, init_cache, load_drafter, propose
from dflash_jax.config import parse_config
from dflash_jax.linen import init_params
from dflash_jax.nnx import DFlashDrafter, TargetWeight
from dflash_jax.testing import preset_dict, write_checkpoint

from ._drafters import block, features, tiny_drafter


def inputs(drafter, batch=2, rows=6):
    c = drafter.config
    B = c.effective_block_size
    return (jnp.asarray(features(drafter, batch, rows)), jnp.asarray(block(drafter, [5, 9][:batch])),
            dict(context_positions=jnp.tile(jnp.arange(rows), (batch, 1)),
                 block_positions=jnp.tile(rows + jnp.arange(B), (batch, 1))))


def leaves_of(module, kind=nnx.Param):
    return jax.tree.leaves(nnx.state(module, kind))


def test_logits_equal_draft_logits():
    """A pass-through: one family shows it (dflash2, whose sliding layer makes the attention options count)."""
    drafter = tiny_drafter("tiny-dflash2")
    module = DFlashDrafter.from_drafter(drafter)
    hidden, ids, positions = inputs(drafter)
    np.testing.assert_array_equal(module(hidden, ids, **positions), draft_logits(drafter, hidden, ids, **positions))
    attention = AttentionOptions(causal=True, sliding_window=False)
    np.testing.assert_array_equal(module(hidden, ids, **positions, attention=attention),
                                  draft_logits(drafter, hidden, ids, **positions, attention=attention))


def test_propose_equals_propose():
    """DSpark, sampled: every option reaches `dflash_jax.propose` (the Markov walk, the confidence head)."""
    drafter = tiny_drafter("tiny-dspark")
    module = DFlashDrafter.from_drafter(drafter)
    hidden, _, _ = inputs(drafter)
    mine, theirs = module.init_cache(2, 32), init_cache(drafter, 2, 32)
    args = (hidden, jnp.asarray([6, 4]), jnp.asarray([5, 9]))
    options = dict(key=jax.random.key(0), temperature=jnp.asarray([0.7, 0.0]), confidence_threshold=0.3)
    (p1, mine), (p2, theirs) = module.propose(mine, *args, **options), propose(drafter, theirs, *args, **options)
    chex.assert_trees_all_equal((p1, mine), (p2, theirs))


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
    expected = draft_logits(drafter, hidden, ids, **positions)

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


def test_init_draws_a_trainable_tree():
    config = parse_config(preset_dict("tiny-dspark"))
    module = DFlashDrafter.init(config, rngs=nnx.Rngs(1), own_embeddings=True)
    params = module.drafter.params
    chex.assert_trees_all_equal(params, init_params(config, nnx.Rngs(1).params(), own_embeddings=True))
    gain = params["norm"]["weight"].astype(jnp.float32)  # the spec's `Gain`, as every random drafter draws it
    assert params["norm"]["weight"].dtype == jnp.bfloat16 and 0.05 < float(jnp.std(gain)) < 0.2
    assert abs(float(jnp.mean(gain)) - 1) < 0.05
    fc = params["fc"]["weight"].astype(jnp.float32)
    assert 0.5 < float(jnp.std(fc)) * np.sqrt(fc.shape[1]) < 2  # N(0, 1/fan_in)
    assert params["embed_tokens"]["weight"].shape == (config.vocab_size, config.hidden_size)


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

"""`dflash_jax.linen.DrafterModule`: `init` declares the loader's tree (alone, as a submodule, through
`nnx.bridge`), a loaded checkpoint drops into it, and `apply` computes the NumPy reference's and the PyTorch
golden logits."""

from __future__ import annotations

import os

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from dflash_jax import DrafterModule, load_drafter
from dflash_jax.linen import init_params
from dflash_jax.testing import preset_dict, write_checkpoint

from . import _numpy_reference as ref
from ._drafters import GOLDEN, block, features


def example(drafter, rows=5):
    c = drafter.config
    hidden, ids = jnp.asarray(features(drafter, 1, rows)), jnp.asarray(block(drafter, [3]))
    positions = dict(context_positions=jnp.arange(rows)[None],
                     block_positions=rows + jnp.arange(c.effective_block_size)[None])
    return hidden, ids, positions


@pytest.mark.parametrize("preset, draft_vocab", [("tiny-dflash2", None), ("tiny-dspark", 32)])  # dflash: below
def test_init_declares_the_loaders_tree(tmp_path, preset, draft_vocab):
    raw = {**preset_dict(preset), **({"draft_vocab_size": draft_vocab} if draft_vocab else {})}
    own = draft_vocab is not None  # a reduced vocabulary ships its own embedding and LM head (DeepSpec style)
    write_checkpoint(tmp_path, raw, own_embeddings=own)
    loaded = load_drafter(tmp_path, dtype=jnp.float32)
    c = loaded.config
    table = jax.random.normal(jax.random.key(1), (c.vocab_size, c.hidden_size))  # the target's embedding, tied
    heads = {} if own else dict(embed=table, lm_head=table)
    hidden, ids, positions = example(loaded)
    module = DrafterModule(c, own_embeddings=own, param_dtype=jnp.float32)
    variables = module.init(jax.random.key(0), hidden, ids, **positions, **heads)
    assert list(variables) == ["params"]
    chex.assert_trees_all_equal_shapes_and_dtypes(variables["params"], loaded.params)
    assert jax.tree.structure(variables["params"]) == jax.tree.structure(loaded.params)
    chex.assert_trees_all_equal_shapes_and_dtypes(init_params(c, jax.random.key(0), dtype=jnp.float32,
                                                              own_embeddings=own), loaded.params)
    # the checkpoint goes into the initialised tree; apply then computes the NumPy reference's logits
    logits = module.apply({"params": loaded.params}, hidden, ids, **positions, **heads)
    params = ref.to_numpy(loaded.params)
    embed, lm_head = ((params["embed_tokens"]["weight"], params["lm_head"]["weight"]) if own else
                      (ref.to_numpy(table), ref.to_numpy(table)))
    expected = ref.hidden_states(params, raw, np.asarray(hidden[0], np.float64), np.asarray(ids[0]),
                                 np.asarray(positions["context_positions"][0]),
                                 np.asarray(positions["block_positions"][0]), embed, ref.layer_rules(raw)) @ lm_head.T
    # float32 against float64: measured 1.6e-6 (dflash2, |logits| <= 26) and 7e-7 (dspark) of the largest logit
    np.testing.assert_allclose(np.asarray(logits[0]), expected, rtol=0, atol=5e-6 * np.abs(expected).max())


def test_init_inside_a_parent_and_through_nnx_bridge(tmp_path):
    write_checkpoint(tmp_path, "tiny-dflash")
    loaded = load_drafter(tmp_path, dtype=jnp.bfloat16)
    c = loaded.config
    embed = jax.random.normal(jax.random.key(1), (c.vocab_size, c.hidden_size), jnp.bfloat16)
    hidden, ids, positions = example(loaded)

    class Pipeline(nn.Module):  # a user's model holding the drafter as one of its layers
        @nn.compact
        def __call__(self, hidden, ids):
            hidden = nn.Dense(hidden.shape[-1], name="adapter")(hidden)
            return DrafterModule(c, name="drafter")(hidden, ids, **positions, embed=embed, lm_head=embed).argmax(-1)

    params = Pipeline().init(jax.random.key(0), hidden, ids)["params"]
    assert set(params) == {"adapter", "drafter"}
    chex.assert_trees_all_equal_shapes_and_dtypes(params["drafter"], loaded.params)
    params = {**params, "drafter": loaded.params}
    assert jax.jit(Pipeline().apply)({"params": params}, hidden, ids).shape == (1, c.effective_block_size)

    bridged = nnx.bridge.ToNNX(DrafterModule(c), rngs=nnx.Rngs(0))
    nnx.bridge.lazy_init(bridged, hidden, ids, **positions, embed=embed, lm_head=embed)
    state = nnx.to_pure_dict(nnx.state(bridged, nnx.Param))
    chex.assert_trees_all_equal_shapes_and_dtypes(jax.tree.map(jnp.asarray, state), loaded.params)


def test_apply_matches_the_golden_logits():
    """Over the loader's tree, unchanged: the PyTorch reference's logits (tests/data/golden)."""
    directory = os.path.join(GOLDEN, "dflash-tiny-b")
    io = load_file(os.path.join(directory, "io.safetensors"))
    drafter = load_drafter(directory, dtype=jnp.float32)
    heads = dict(embed=jnp.asarray(io["embed"]), lm_head=jnp.asarray(io["lm_head"]))
    positions = dict(context_positions=io["context_positions"], block_positions=io["block_positions"])
    logits = DrafterModule(drafter.config).apply({"params": drafter.params}, io["target_hidden"], io["block_ids"],
                                                 **positions, **heads)
    np.testing.assert_allclose(np.asarray(logits), io["expected_logits"], rtol=0, atol=5e-5)  # measured 1.6e-5

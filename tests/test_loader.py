"""load_drafter: every family and layout, values bit-exact, replication, optional heads, errors."""

import json
import logging
import os

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from dflash_jax import CheckpointError, Drafter, draft_to_target_ids, load_drafter
from dflash_jax.config import replace
from dflash_jax.testing import write_checkpoint

from ._io import leaf, load_file, rewrite_tensors, save_file
from .conftest import GOLDEN

FAMILIES = ["tiny-dflash", "tiny-dflash2", "tiny-dspark"]
LAYER_KEYS = {"input_layernorm", "post_attention_layernorm", "self_attn", "mlp"}


def written(directory):
    tensors = {}
    for file in os.listdir(directory):
        if file.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(directory, file)))
    return tensors


@pytest.mark.parametrize("preset", FAMILIES)
@pytest.mark.parametrize("prefix,shards", [("", 1), ("model.", 3)])
def test_every_family_and_layout_loads_bit_exactly(tmp_path, preset, prefix, shards):
    config = write_checkpoint(tmp_path, preset, prefix=prefix, num_shards=shards, seed=3)
    drafter = load_drafter(tmp_path)
    stated = config.confidence_head_with_markov  # tiny-dspark states none: read off the projection, [1, H + r]
    assert drafter.config == replace(config, confidence_head_with_markov=stated or
                                     (True if config.family == "dspark" else None))
    tensors = written(tmp_path)
    assert len(jax.tree.leaves(drafter.params)) == len(tensors)
    for name, value in tensors.items():
        got = leaf(drafter.params, name.removeprefix(prefix))
        assert got.dtype == jnp.bfloat16 and got.shape == value.shape
        np.testing.assert_array_equal(np.asarray(got).view(np.uint16), value.view(np.uint16))
    layer = drafter.params["layers"][0]
    assert LAYER_KEYS <= set(layer)
    assert ("attention_conv" in layer) == ("mlp_conv" in layer) == (config.family == "dflash2")
    assert ("candidate_selector" in drafter.params) == (config.family == "dflash2")
    assert ("markov_head" in drafter.params) == ("confidence_head" in drafter.params) == (config.family == "dspark")


def test_tree_shapes_match_documented_layout(tmp_path):
    c = write_checkpoint(tmp_path, "tiny-dflash2")
    p = load_drafter(tmp_path, dtype=jnp.float32).params
    H, I, d = c.hidden_size, c.intermediate_size, c.head_dim
    chex.assert_shape(p["fc"]["weight"], (H, len(c.target_layer_ids) * H))
    layer = p["layers"][1]
    chex.assert_shape(layer["self_attn"]["q_proj"]["weight"], (c.num_attention_heads * d, H))
    chex.assert_shape(layer["self_attn"]["k_proj"]["weight"], (c.num_key_value_heads * d, H))
    chex.assert_shape(layer["mlp"]["down_proj"]["weight"], (H, I))
    chex.assert_shape(layer["attention_conv"]["base_kernel"], (2, 2, H))
    chex.assert_shape(layer["mlp_conv"]["kernel_projection"]["weight"], (2 * 2 * H // 16, H))
    chex.assert_shape(p["candidate_selector"]["predecessor_codebook"], (c.vocab_size, 16))
    chex.assert_tree_all_finite(p)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(p))


def test_replicated_over_a_mesh(tmp_path, cpu_mesh):
    write_checkpoint(tmp_path, "tiny-dspark")
    drafter = load_drafter(tmp_path, mesh=cpu_mesh)
    expected = NamedSharding(cpu_mesh, PartitionSpec())
    for x in jax.tree.leaves(drafter.params):
        assert x.sharding.is_equivalent_to(expected, x.ndim)
        assert len(x.addressable_shards) == len(cpu_mesh.devices.flat)
        first = np.asarray(x.addressable_shards[0].data)
        for shard in x.addressable_shards[1:]:
            np.testing.assert_array_equal(np.asarray(shard.data), first)
    total = jax.jit(lambda d: sum(jnp.sum(x.astype(jnp.float32)) for x in jax.tree.leaves(d.params)))(drafter)
    assert total.sharding.is_fully_replicated


def test_golden_checkpoint_loads_as_released(tmp_path):
    drafter = load_drafter(os.path.join(GOLDEN, "dflash-tiny-b"), dtype=jnp.float32)
    assert drafter.config.family == "dflash" and len(drafter.params["layers"]) == 3
    assert len(jax.tree.leaves(drafter.params)) == 36


def test_d2t_own_embeddings_and_attach(tmp_path):
    from dflash_jax.testing import preset_dict

    raw = {**preset_dict("tiny-dspark"), "draft_vocab_size": 32}
    config = write_checkpoint(tmp_path, raw, own_embeddings=True)
    drafter = load_drafter(tmp_path)
    d2t = drafter.params["d2t"]
    assert d2t.dtype == jnp.int32 and d2t.shape == (32,)
    chex.assert_shape(drafter.params["lm_head"]["weight"], (32, config.hidden_size))
    chex.assert_shape(drafter.embedding, (config.vocab_size, config.hidden_size))
    targets = draft_to_target_ids(jnp.arange(32), d2t)
    assert len(set(np.asarray(targets).tolist())) == 32 and int(targets.max()) < config.vocab_size
    assert np.all(np.diff(np.asarray(targets)) > 0)


def test_attach_target_embeddings(tmp_path):
    config = write_checkpoint(tmp_path, "tiny-dflash")
    drafter = load_drafter(tmp_path)
    with pytest.raises(ValueError, match="attach"):
        _ = drafter.output_head
    embed = jnp.ones((config.vocab_size, config.hidden_size), jnp.bfloat16)
    attached = drafter.attach(embed=embed, lm_head=embed * 2)
    assert attached.embedding is embed and attached.output_head.shape == embed.shape
    with pytest.raises(ValueError, match="expected"):
        drafter.attach(embed=jnp.ones((4, 3)))
    out = jax.jit(lambda d: d.output_head.sum())(attached)  # the whole Drafter is a pytree
    assert float(out) == 2 * embed.size
    assert isinstance(jax.tree.unflatten(jax.tree.structure(attached), jax.tree.leaves(attached)), Drafter)


def test_summary_line(tmp_path, caplog):
    write_checkpoint(tmp_path, "tiny-dflash2")
    with caplog.at_level(logging.INFO, logger="dflash_jax"):
        load_drafter(tmp_path)
    (line,) = [r.getMessage() for r in caplog.records]
    for part in ("dflash2", "2 layers", "hidden=64", "vocab=128", "block=8", "target_layers=[0, 1]", "convs"):
        assert part in line


def test_declared_heads_missing_warn(tmp_path):
    write_checkpoint(tmp_path, "tiny-dspark")
    tensors = load_file(tmp_path / "model.safetensors")
    kept = {k: v for k, v in tensors.items() if not k.startswith(("markov_head", "confidence_head"))}
    save_file(kept, tmp_path / "model.safetensors")
    with pytest.warns(UserWarning) as record:
        drafter = load_drafter(tmp_path)
    messages = " ".join(str(w.message) for w in record)
    assert "markov_rank=32" in messages and "confidence head" in messages
    assert "markov_head" not in drafter.params


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda t: t.pop("layers.1.mlp.up_proj.weight"), "missing tensor 'layers.1.mlp.up_proj.weight'"),
        (lambda t: t.update({"norm.weight": t["norm.weight"][:10]}),
         "'norm.weight' has shape \\[10\\], expected \\[64\\]"),
        (lambda t: t.update({"fc.weight": t["fc.weight"].astype(np.int32)}), "'fc.weight' has dtype I32"),
        (lambda t: t.pop("fc.weight"), "no `fc.weight`"),
    ],
)
def test_checkpoint_errors_name_tensor_and_file(tmp_path, change, message):
    write_checkpoint(tmp_path, "tiny-dflash")
    rewrite_tensors(tmp_path, change)
    with pytest.raises(CheckpointError, match=message) as err:
        load_drafter(tmp_path)
    assert str(tmp_path) in str(err.value)


def test_unexpected_tensors_warn(tmp_path):
    write_checkpoint(tmp_path, "tiny-dflash")
    rewrite_tensors(tmp_path, lambda t: t.update({"extra.weight": np.zeros(3, ml_dtypes.bfloat16)}))
    with pytest.warns(UserWarning, match="extra.weight"):
        load_drafter(tmp_path)


def test_confidence_head_read_off_its_width(tmp_path):
    """A SpecForge DSpark export without `confidence_head_with_markov` (SpecForge's default: false) and a [1, H]
    projection loads as a hidden-only head; DeepSpec's [1, H + r] as the Markov-conditioned one."""
    from dflash_jax.testing import preset_dict

    for stated, width in ((False, 64), (True, 64 + 32)):
        directory = tmp_path / str(stated)
        write_checkpoint(directory, {**preset_dict("tiny-dspark"), "confidence_head_with_markov": stated})
        raw = json.loads((directory / "config.json").read_text())
        del raw["confidence_head_with_markov"]
        (directory / "config.json").write_text(json.dumps(raw))
        drafter = load_drafter(directory)
        assert drafter.config.confidence_head_with_markov is stated
        chex.assert_shape(drafter.params["confidence_head"]["proj"]["weight"], (1, width))


def test_confidence_head_of_another_width_names_tensor_and_widths(tmp_path):
    write_checkpoint(tmp_path, "tiny-dspark")
    bad_head = np.zeros((1, 70), ml_dtypes.bfloat16)
    path = rewrite_tensors(tmp_path, lambda t: t.update({"confidence_head.proj.weight": bad_head}))
    with pytest.raises(CheckpointError) as err:
        load_drafter(tmp_path)
    for part in (path, "'confidence_head.proj.weight'", "[1, 70]", "confidence_head_with_markov", "[1, 64]", "[1, 96]"):
        assert part in str(err.value)

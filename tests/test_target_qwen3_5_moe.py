"""The MoE Qwen3.5 hybrid target (`qwen3_5_moe`): parity with transformers, verify + commit, refusals (on a mesh:
tests/test_tensor_parallel_hybrid.py).

Reference: `tests/data/qwen3_5_moe/model/` (transformers 5.24.0, float32 forward of BF16 weights in the released
layout: the text model under `model.language_model.`, fused experts). Everything here runs in float32.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import CheckpointError, ConfigError, load_target
from dflash_jax.safetensors import Checkpoint, write_tensors
from dflash_jax.target.qwen3_5 import Qwen3_5Target
from dflash_jax.testing import QWEN3_5_TINY_CONFIGS, random_qwen3_5, write_qwen3_5_checkpoint

from .conftest import DATA
from .test_target_moe import per_expert

REFERENCE = f"{DATA}/qwen3_5_moe/model"


@pytest.fixture(scope="module")
def ref():
    with Checkpoint(f"{REFERENCE}/io.safetensors") as c:
        arrays = {name: c.array(name) for name in c}
    return load_target(REFERENCE, dtype=jnp.float32), arrays


def test_parity_with_transformers(ref):
    target, arrays = ref
    assert isinstance(target, Qwen3_5Target) and target.config.is_moe
    tokens = jnp.asarray(arrays["input_ids"])
    n = tokens.shape[1]
    with jax.default_matmul_precision("float32"):
        out = target.prefill(tokens, target.init_cache(1, 32), jnp.array([n]), layer_ids=(-1, 0, 1, 2, 3), chunk=32,
                             delta_chunk=8)
    features = np.asarray(out.features).reshape(1, n, 5, -1)
    for j in range(5):  # measured 0, 2.2e-6, 1.2e-5, 2.0e-5, 2.1e-5 (|hidden| <= 5.6)
        np.testing.assert_allclose(features[:, :, j], arrays["hidden_states"][j], atol=5e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(out.logits), arrays["logits"][:, n - 1], atol=5e-5, rtol=0)  # 1.7e-5


def test_verify_then_commit_equals_decoding(ref):
    """A block of 3 tokens verified at once, committed with k = 2 and k = 0: the next token's logits are those
    of decoding the k tokens one by one."""
    target, arrays = ref
    tokens = jnp.asarray(arrays["input_ids"])
    with jax.default_matmul_precision("float32"):
        out = target.prefill(tokens[:, :20], target.init_cache(1, 32), jnp.array([20]), chunk=32)
        block = target(tokens[:, 20:23], out.cache, jnp.array([20]))
        cache = out.cache
        for t in (20, 21):
            cache = target.commit(target(tokens[:, t:t + 1], cache, jnp.array([t])).cache, jnp.array([1]))
        for kept, alone in ((2, cache), (0, out.cache)):
            committed = target.commit(block.cache, jnp.array([kept]))
            a = target(tokens[:, 20 + kept:21 + kept], committed, jnp.array([20 + kept])).logits
            b = target(tokens[:, 20 + kept:21 + kept], alone, jnp.array([20 + kept])).logits
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, rtol=0)
    np.testing.assert_allclose(np.asarray(block.logits[0]), arrays["logits"][0, 20:23], atol=1e-4, rtol=0)


def test_a_missing_expert_tensor_is_refused(tmp_path):
    write_qwen3_5_checkpoint(tmp_path, "tiny-qwen3_5-moe", dtype="float32")
    missing = "model.layers.1.mlp.experts.gate_up_proj"
    with Checkpoint(tmp_path) as c:
        arrays = {name: np.array(c.array(name)) for name in c if name != missing}
    (tmp_path / "model.safetensors").unlink()
    write_tensors(tmp_path, arrays)
    with pytest.raises(CheckpointError, match="model.layers.1.mlp."):
        load_target(tmp_path, dtype=jnp.float32)


def test_a_stacked_copy_beside_per_expert_tensors_is_refused(tmp_path):
    """The per-expert layout with the stacked `experts.down_proj` stored too, with other values: refused naming
    both (the per-expert stack loaded and the stored stack was never mentioned)."""
    config = write_qwen3_5_checkpoint(tmp_path, "tiny-qwen3_5-moe", dtype="float32")
    with Checkpoint(tmp_path) as c:
        arrays = {name: np.array(c.array(name)) for name in c}
    arrays = per_expert(arrays, config) | {"model.layers.1.mlp.experts.down_proj":
                                           -arrays["model.layers.1.mlp.experts.down_proj"]}
    (tmp_path / "model.safetensors").unlink()
    write_tensors(tmp_path, arrays)
    with pytest.raises(CheckpointError, match=r"tensor 'model.layers.1.mlp.experts.down_proj' is stored beside "
                                              r"'model.layers.1.mlp.experts.0.down_proj.weight'"):
        load_target(tmp_path, dtype=jnp.float32)


def test_a_tensor_axis_not_dividing_the_expert_width_is_refused():
    target = random_qwen3_5({**QWEN3_5_TINY_CONFIGS[
                             "tiny-qwen3_5-moe"], "moe_intermediate_size": 6}, dtype=jnp.float32)
    with pytest.raises(ConfigError, match="moe_intermediate_size=6"):
        target.shard(jax.make_mesh((2, 4), ("data", "model")))


def _largest_array(jaxpr) -> int:
    """Bytes of the largest array an equation of `jaxpr`, or of a jaxpr inside it (the prefill's scan body, jitted
    calls), produces."""
    largest = 0
    for eqn in jaxpr.eqns:
        largest = max([largest, *(math.prod(v.aval.shape) * v.aval.dtype.itemsize for v in eqn.outvars
                                  if hasattr(v.aval, "shape"))])
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    largest = max(largest, _largest_array(sub))
    return largest


def test_a_batch_prefills_in_the_memory_of_one_sequence():
    """`chunk` bounds a prefill step's token rows over the whole batch: 8 prompts of 256 tokens with a 256-row
    chunk make no array larger than one prompt does (8 x 32 rows a step, not 8 x 256; the largest, the attention
    scores [batch, n_kv, group, rows, slots], 2 MiB either way). Traced, not run (shapes only)."""
    target = jax.eval_shape(lambda: random_qwen3_5("tiny-qwen3_5-moe", seed=0))
    P = 256

    def largest(batch: int) -> int:
        cache = jax.eval_shape(lambda: target.init_cache(batch, P + 8))
        prefill = lambda t, c: t.prefill(jnp.zeros((batch, P), jnp.int32), c, jnp.full((batch,), P),  # noqa: E731
                                         layer_ids=(0, 1), chunk=256)
        return _largest_array(jax.make_jaxpr(prefill)(target, cache).jaxpr)

    assert largest(8) == largest(1) == 2 * 2**20

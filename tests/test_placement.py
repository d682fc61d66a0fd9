"""place_all: the in-flight bound on host pages, plan order, replication (NVFP4 and cast conversions included)."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from dflash_jax import placement
from dflash_jax.loader import load_config
from dflash_jax.plan import open_checked
from dflash_jax.safetensors import Checkpoint
from dflash_jax.testing import write_checkpoint

_OPEN = contextlib.ExitStack()  # the tests' checkpoints stay open until the session ends


def planned(path):
    checkpoint, _, plan, packed = _OPEN.enter_context(open_checked(str(path), load_config(path)))
    return plan, checkpoint, packed


@pytest.mark.parametrize("nvfp4", [False, True])
@pytest.mark.parametrize("budget", [0, 20_000, 10**9])
def test_host_pages_in_flight_stay_within_the_budget(tmp_path, monkeypatch, nvfp4, budget):
    """Every tensor read counts until its pages are released; never more than the budget plus one tensor."""
    write_checkpoint(tmp_path, "tiny-dflash", nvfp4=nvfp4)
    plan, checkpoint, packed = planned(tmp_path)
    sizes = [sum(checkpoint[n].nbytes for n in placement._sources(t, packed, checkpoint)) for t in plan]
    held, peak = {}, [0]
    read, release = placement._host_array, checkpoint.release

    def reading(ckpt, name, kind, index):
        held[name] = ckpt[name].nbytes
        peak[0] = max(peak[0], sum(held.values()))
        return read(ckpt, name, kind, index)

    def releasing(name):
        held.pop(name)
        release(name)

    monkeypatch.setattr(placement, "_host_array", reading)
    monkeypatch.setattr(checkpoint, "release", releasing)
    with checkpoint:
        leaves = placement.place_all(plan, checkpoint, packed, mesh=None, dtype=jnp.float32, progress=False,
                                     inflight_bytes=budget)
    assert not held  # every page released at the end
    assert peak[0] <= min(budget, sum(sizes)) + max(sizes)
    assert budget < sum(sizes) or peak[0] == sum(sizes)  # a budget above the checkpoint holds it all
    assert [leaf.shape for leaf in leaves] == [t.shape for t in plan]  # plan order
    assert all(leaf.dtype == (jnp.int32 if t.kind == "int" else jnp.float32) for t, leaf in zip(plan, leaves))


def test_replicated_leaves_equal_the_single_device_ones(tmp_path, cpu_mesh):
    write_checkpoint(tmp_path, "tiny-dflash2", nvfp4=True)
    plan, checkpoint, packed = planned(tmp_path)
    with checkpoint:
        single = placement.place_all(plan, checkpoint, packed, mesh=None, dtype=jnp.bfloat16, progress=False)
        replicated = placement.place_all(plan, checkpoint, packed, mesh=cpu_mesh, dtype=jnp.bfloat16,
                                         progress=False, inflight_bytes=0)
    for a, b in zip(single, replicated):
        assert b.sharding.is_fully_replicated and len(b.addressable_shards) == len(jax.devices())
        for shard in b.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data).view(np.uint8), np.asarray(a).view(np.uint8))


def test_sharded_leaves_hold_their_slices_cast_on_device(tmp_path):
    """Tensor-parallel leaves over ("data", "model") = (2, 4): each device holds exactly its slice of the bf16
    checkpoint tensor (row blocks, column blocks, replicated norms), cast to float32 on the device it was put on,
    and only the bytes of the distinct parts were counted as read."""
    from dflash_jax._qwen3_testing import QWEN3_TINY_CONFIGS, write_qwen3_checkpoint
    from dflash_jax.target.dense import plan_decoder
    from dflash_jax.target.layout import make_layout

    config = write_qwen3_checkpoint(tmp_path, {**QWEN3_TINY_CONFIGS["tiny-qwen3-tp"], "num_hidden_layers": 1})
    layout = make_layout(config, jax.make_mesh((2, 4), ("data", "model")), "model", str(tmp_path))
    plan = plan_decoder(config)
    shardings = [layout.sharding(t.axes) for t in plan]
    counted = []
    with Checkpoint(tmp_path) as checkpoint:
        leaves = placement.place_all(plan, checkpoint, set(), mesh=None, dtype=jnp.float32, progress=False,
                                     shardings=shardings, inflight_bytes=0)
        for t, sharding, leaf in zip(plan, shardings, leaves):
            full = checkpoint.array(t.name).astype(np.float32)
            assert leaf.sharding == sharding and leaf.dtype == jnp.float32
            for shard in leaf.addressable_shards:
                np.testing.assert_array_equal(np.asarray(shard.data), full[shard.index])
            counted.append(placement._read_bytes(checkpoint, t, [t.name], placement.pieces(sharding, t.shape)))
            assert counted[-1] == checkpoint[t.name].nbytes  # one process: every part once, replicas not again
    o_proj = next(s for t, s in zip(plan, shardings) if t.name.endswith("o_proj.weight"))
    assert o_proj.spec == PartitionSpec(None, "model")  # a column block per device: one byte range per row
    assert [len(p.devices) for p in placement.pieces(o_proj, (64, 64))] == [2, 2, 2, 2]  # data replicas share reads

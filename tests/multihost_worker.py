"""One process of the two-process load test (tests/test_multihost.py): load onto a global mesh, check it.

Run as: python multihost_worker.py PROCESS_ID PORT DRAFTER_DIR TARGET_DIR PROMPTS_JSON MAX_NEW_TOKENS TEMPERATURE
        TOP_K SEED

The drafter is replicated over a 4-device mesh; the target is tensor-parallel over ("data", "model") = (1, 4),
and every read of tensor data this process makes is recorded (the byte ranges of the views `Checkpoint.read`
hands out, from their addresses in the map) and compared with the ranges of its own devices' shards, worked
out here from the planned shardings by row-major arithmetic. Then both processes decode the same prompts with
the target split across them, sampled with one key, and print the tokens; then greedy under the adaptive policy,
measuring its step costs, and print the tokens and the costs.
"""

import json
import os
import sys

os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2"  # + conftest's
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

process_id, port, checkpoint, target_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id,
                           initialization_timeout=60)

from dflash_jax import load_drafter, load_target, speculative_generate  # noqa: E402
from dflash_jax.placement import auto_mesh  # noqa: E402
from dflash_jax.safetensors import Checkpoint  # noqa: E402
from dflash_jax.target.dense import plan_decoder  # noqa: E402

assert jax.process_count() == 2 and len(jax.devices()) == 4 and len(jax.local_devices()) == 2
mesh = jax.make_mesh((4,), ("replica",), devices=jax.devices())
drafter = load_drafter(checkpoint, mesh=mesh)
replicated = NamedSharding(auto_mesh(mesh), PartitionSpec())
with Checkpoint(checkpoint) as ckpt:
    expected = ckpt.array("model.layers.1.mlp.down_proj.weight")
    leaf = drafter.params["layers"][1]["mlp"]["down_proj"]["weight"]
    assert leaf.sharding == replicated and leaf.shape == expected.shape and not leaf.is_fully_addressable
    assert {s.device for s in leaf.addressable_shards} == set(jax.local_devices())
    for shard in leaf.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data).view(np.uint16), expected.view(np.uint16))
for x in jax.tree.leaves(drafter.params):
    assert x.sharding == replicated and len(x.addressable_shards) == 2
print(f"process {process_id}: ok, {len(jax.tree.leaves(drafter.params))} global replicated arrays")


def spanned(ckpt: Checkpoint, name: str, view: np.ndarray) -> list[tuple[int, int]]:
    """File byte ranges a view of the map covers: one per row unless the rows are contiguous."""
    base = ckpt._map(ckpt[name].file).__array_interface__["data"][0]
    offset = view.__array_interface__["data"][0] - base
    if view.flags.c_contiguous:
        return [(offset, offset + view.nbytes)]
    assert view.ndim == 2 and view.strides[1] == view.itemsize
    row = view.shape[1] * view.itemsize
    return [(offset + r * view.strides[0], offset + r * view.strides[0] + row) for r in range(view.shape[0])]


def planned(info, index) -> list[tuple[int, int]]:
    """Byte ranges of `index` (slices) of a row-major tensor starting at `info.start`."""
    size = np.dtype(info.np_dtype).itemsize
    if len(info.shape) == 1:
        (rows,) = index
        return [(info.start + rows.start * size, info.start + rows.stop * size)]
    (r0, r1), (c0, c1) = ((s.start, s.stop) for s in index)
    width = info.shape[1]
    if (c0, c1) == (0, width):
        return [(info.start + r0 * width * size, info.start + r1 * width * size)]
    return [(info.start + (r * width + c0) * size, info.start + (r * width + c1) * size) for r in range(r0, r1)]


def merged(ranges) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for a, b in sorted(set(ranges)):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [tuple(r) for r in out]


reads: dict[str, list[tuple[int, int]]] = {}
original = Checkpoint.read


def recording(self, name, index=None):
    view = original(self, name, index)
    reads.setdefault(name, []).extend(spanned(self, name, view))
    return view


Checkpoint.read = recording
target = load_target(target_dir, mesh=jax.make_mesh((1, 4), ("data", "model"), devices=jax.devices()),
                     dtype=jnp.float32)
Checkpoint.read = original
plan, layout = plan_decoder(target.config), target.layout
read_bytes = total_bytes = 0
with Checkpoint(target_dir) as ckpt:
    for t in plan:
        info, sharding = ckpt[t.name], layout.sharding(t.axes)
        local = [tuple(slice(s.start or 0, n if s.stop is None else s.stop) for s, n in zip(index, t.shape))
                 for index in sharding.addressable_devices_indices_map(t.shape).values()]
        expected_ranges = merged(r for index in local for r in planned(info, index))
        assert merged(reads.pop(t.name)) == expected_ranges, t.name
        read_bytes += sum(b - a for a, b in expected_ranges)
        total_bytes += info.nbytes
        leaf = target.params
        for key in t.path:
            leaf = leaf[key]
        assert leaf.sharding == sharding, (t.name, leaf.sharding)
        for shard in leaf.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), ckpt.array(t.name)[shard.index])
    q = ckpt["model.layers.0.self_attn.q_proj.weight"]
    assert sum(b - a for a, b in planned(q, (slice(0, q.shape[0] // 2), slice(0, q.shape[1])))) * 2 == q.nbytes
assert not reads, f"tensors read outside the plan: {sorted(reads)}"
print(f"process {process_id}: target ok, read {read_bytes} of {total_bytes} bytes")

# Speculative decoding across the processes: the target split over both processes' devices, the drafter replicated
# on the same mesh; every process passes the same prompts and arguments and gets every prompt's tokens. Sampled with
# the same key in every process: every draw is a global computation, so the processes agree.
paired = load_drafter(checkpoint, mesh=target.layout.mesh, dtype=jnp.float32)
prompts, max_new = json.loads(sys.argv[5]), int(sys.argv[6])
sampled = speculative_generate(target, paired, prompts, max_new_tokens=max_new, temperature=float(sys.argv[7]),
                               top_k=int(sys.argv[8]), key=jax.random.key(int(sys.argv[9])), draft_length="fixed")
print(f"process {process_id}: sampled {json.dumps(sampled.tokens)}")
# Greedy under the adaptive policy, its step costs measured on the run in calls of 1 and 2 steps (so that 40 tokens
# hold the measurement, which `share` lets so short a run take): each process times its own calls and process 0's
# times decide, so the processes must report the same costs (and choose the same lengths: one program).
from dflash_jax import Adaptive, Calibration  # noqa: E402

adaptive = speculative_generate(target, paired, prompts, max_new_tokens=40,
                                draft_length=Adaptive(calibration=Calibration(steps=1, repeats=1, share=10.0)))
costs = adaptive.step_costs.seconds if adaptive.step_costs is not None else None
print(f"process {process_id}: adaptive {json.dumps([adaptive.tokens, costs])}")
jax.distributed.shutdown()

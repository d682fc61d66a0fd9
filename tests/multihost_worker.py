"""One process of the two-process load test (tests/test_multihost.py): load onto a global mesh, check it.

Run as: python multihost_worker.py PROCESS_ID PORT CHECKPOINT_DIR
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

process_id, port, checkpoint = int(sys.argv[1]), sys.argv[2], sys.argv[3]
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id,
                           initialization_timeout=60)

from dflash_jax import load_drafter  # noqa: E402
from dflash_jax.safetensors import Checkpoint  # noqa: E402

assert jax.process_count() == 2 and len(jax.devices()) == 4 and len(jax.local_devices()) == 2
mesh = jax.make_mesh((4,), ("replica",), devices=jax.devices())
drafter = load_drafter(checkpoint, mesh=mesh)
replicated = NamedSharding(mesh, PartitionSpec())
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
jax.distributed.shutdown()

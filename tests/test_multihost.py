"""Two JAX processes on this machine (CPU devices, loopback coordinator) load a drafter replicated and a target
tensor-parallel onto a global 2-process mesh; each reads and places only its own devices' copies and shards
(the audit of the byte ranges each process read: tests/multihost_worker.py). Then both decode the same prompts
with the target split across them and the drafter replicated, and get the tokens one process gets."""

import json
import os
import re
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp

from dflash_jax import load_drafter, load_target, speculative_generate
from dflash_jax._qwen3_testing import write_qwen3_checkpoint
from dflash_jax.testing import preset_dict, write_checkpoint

WORKER = os.path.join(os.path.dirname(__file__), "multihost_worker.py")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS, MAX_NEW = [[5, 17, 99, 3], [120, 4], [9, 9, 9]], 6
TEMPERATURE, TOP_K, SEED = 1.5, 40, 11  # hot enough that the sampled tokens differ from the greedy ones


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_process_load(tmp_path):
    # trained on a 4-layer target (the tp target's), so that the two pair for decoding
    write_checkpoint(tmp_path, {**preset_dict("tiny-dflash2"), "num_target_layers": 4}, prefix="model.", num_shards=2)
    target = tmp_path / "target"
    write_qwen3_checkpoint(target, "tiny-qwen3-tp", num_shards=2, dtype="float32")
    port = str(free_port())
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}  # XLA_FLAGS: the conftest's compile flags
    env["PYTHONPATH"] = ROOT  # this checkout's package, whatever is installed
    procs = [
        subprocess.Popen([sys.executable, WORKER, str(i), port, str(tmp_path), str(target), json.dumps(PROMPTS),
                          str(MAX_NEW), str(TEMPERATURE), str(TOP_K), str(SEED)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(2)
    ]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=300)[0])
    finally:
        for proc in procs:
            proc.kill()
    for i, (proc, out) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"process {i} failed:\n{out[-3000:]}"
        assert f"process {i}: ok, 36 global replicated arrays" in out
        read, total = map(int, re.search(rf"process {i}: target ok, read (\d+) of (\d+) bytes", out).groups())
        assert read < 0.6 * total  # 4-way split over 2 processes: half of each split tensor, the norms whole
    one_target = load_target(target, dtype=jnp.float32)
    one_drafter = load_drafter(tmp_path, dtype=jnp.float32)
    expected = speculative_generate(one_target, one_drafter, PROMPTS, max_new_tokens=MAX_NEW).tokens
    sampled = speculative_generate(one_target, one_drafter, PROMPTS, max_new_tokens=MAX_NEW, temperature=TEMPERATURE,
                                   top_k=TOP_K, key=jax.random.key(SEED)).tokens
    assert sampled != expected
    for i, out in enumerate(outputs):
        assert json.loads(re.search(rf"process {i}: tokens (.*)", out).group(1)) == expected, f"process {i}"
        assert json.loads(re.search(rf"process {i}: sampled (.*)", out).group(1)) == sampled, f"process {i}"

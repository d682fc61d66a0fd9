"""Two JAX processes on this machine (CPU devices, loopback coordinator) load a drafter replicated and a target
tensor-parallel onto a global 2-process mesh; each reads and places only its own devices' copies and shards
(the audit of the byte ranges each process read: tests/multihost_worker.py)."""

import os
import re
import socket
import subprocess
import sys

from dflash_jax._qwen3_testing import write_qwen3_checkpoint
from dflash_jax.testing import write_checkpoint

WORKER = os.path.join(os.path.dirname(__file__), "multihost_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_process_load(tmp_path):
    write_checkpoint(tmp_path, "tiny-dflash2", prefix="model.", num_shards=2)
    target = tmp_path / "target"
    write_qwen3_checkpoint(target, "tiny-qwen3-tp", num_shards=2, dtype="float32")
    port = str(free_port())
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}  # XLA_FLAGS: the conftest's compile flags
    procs = [
        subprocess.Popen([sys.executable, WORKER, str(i), port, str(tmp_path), str(target)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(2)
    ]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=120)[0])
    finally:
        for proc in procs:
            proc.kill()
    for i, (proc, out) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"process {i} failed:\n{out[-3000:]}"
        assert f"process {i}: ok, 36 global replicated arrays" in out
        read, total = map(int, re.search(rf"process {i}: target ok, read (\d+) of (\d+) bytes", out).groups())
        assert read < 0.6 * total  # 4-way split over 2 processes: half of each split tensor, the norms whole

"""Two JAX processes on this machine (CPU devices, loopback coordinator) load a drafter replicated and a target
tensor-parallel onto a global 2-process mesh; each reads and places only its own devices' copies and shards
(the audit of the byte ranges each process read: tests/multihost_worker.py). Then both decode the same prompts
with the target split across them and the drafter replicated, sampled with one key, and get the tokens one process
gets, and greedily under the adaptive policy with the step costs of process 0's clock in both; `dflash-jax generate
--distributed` decodes greedily across two processes from the shell."""

import json
import os
import re
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import greedy_generate, load_drafter, load_target, speculative_generate
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


def launch(commands: list[list[str]], env: dict[str, str] | None = None) -> list[tuple[int, str, str]]:
    """Run one process per command at once, this checkout's package first on the path: `(status, stdout, stderr)`
    of each."""
    env = {**{k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}, **(env or {})}  # XLA_FLAGS: the
    env["PYTHONPATH"] = ROOT  # conftest's compile flags; this checkout's package, whatever is installed
    procs = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for command in commands]
    try:
        outputs = [proc.communicate(timeout=300) for proc in procs]
        return [(proc.returncode, out, err) for proc, (out, err) in zip(procs, outputs)]
    finally:
        for proc in procs:
            proc.kill()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[str, str]:
    """`(drafter, target)`: a DFlash2 drafter trained on a 4-layer target (the tp target's), so that the two pair."""
    root = tmp_path_factory.mktemp("multihost")
    write_checkpoint(root / "drafter", {**preset_dict("tiny-dflash2"), "num_target_layers": 4}, prefix="model.",
                     num_shards=2)
    write_qwen3_checkpoint(root / "target", "tiny-qwen3-tp", num_shards=2, dtype="float32")
    return str(root / "drafter"), str(root / "target")


@pytest.fixture(scope="module")
def one_target(checkpoints):
    """The target loaded in this process, on one device: the reference of the runs across processes."""
    return load_target(checkpoints[1], dtype=jnp.float32)


@pytest.fixture(scope="module")
def greedy_tokens(one_target) -> list[list[int]]:
    """The target's own greedy tokens for PROMPTS in this process, 40 new (the adaptive run's budget): the shorter
    runs' are their prefixes (greedy decoding; both budgets run one compiled program)."""
    return greedy_generate(one_target, PROMPTS, max_new_tokens=40).tokens


def test_two_process_load(checkpoints, one_target, greedy_tokens):
    drafter, target = checkpoints
    port = str(free_port())
    runs = launch([[sys.executable, WORKER, str(i), port, drafter, target, json.dumps(PROMPTS), str(MAX_NEW),
                    str(TEMPERATURE), str(TOP_K), str(SEED)] for i in range(2)])
    outputs = [out + err for _, out, err in runs]
    for i, ((status, _, _), out) in enumerate(zip(runs, outputs)):
        assert status == 0, f"process {i} failed:\n{out[-3000:]}"
        assert f"process {i}: ok, 36 global replicated arrays" in out
        read, total = map(int, re.search(rf"process {i}: target ok, read (\d+) of (\d+) bytes", out).groups())
        assert read < 0.6 * total  # 4-way split over 2 processes: half of each split tensor, the norms whole
    one_drafter = load_drafter(drafter, dtype=jnp.float32)
    sampled = speculative_generate(one_target, one_drafter, PROMPTS, max_new_tokens=MAX_NEW, temperature=TEMPERATURE,
                                   top_k=TOP_K, key=jax.random.key(SEED), draft_length="fixed").tokens  # the workers'
    # draft length (greedy decoding across processes, under the adaptive policy: the CLI run below)
    assert sampled != [tokens[:MAX_NEW] for tokens in greedy_tokens]  # the temperature tells
    for i, out in enumerate(outputs):
        assert json.loads(re.search(rf"process {i}: sampled (.*)", out).group(1)) == sampled, f"process {i}"
    # greedy under the adaptive policy: the target's tokens, and step costs measured, the same in both processes
    adaptive = [json.loads(re.search(rf"process {i}: adaptive (.*)", out).group(1)) for i, out in enumerate(outputs)]
    assert adaptive[0] == adaptive[1] and adaptive[0][1] is not None and len(adaptive[0][1]) == 3
    assert adaptive[0][0] == greedy_tokens


def test_generate_across_two_processes(checkpoints, greedy_tokens):
    """`dflash-jax generate --distributed` in two processes of two CPU devices each: the target split over all
    four, process 0 prints the target's greedy tokens, process 1 prints nothing (on stdout: Gloo's connection lines go
    to stderr). Greedy, so the adaptive policy is on; 6 tokens are too few to time a call of steps, so both run the
    fixed length (the step costs measured across processes: `test_two_process_load`). The prompt is PROMPTS[0], so
    that the target's own tokens are those of `greedy_tokens` (no greedy program of a batch of one to compile)."""
    drafter, target = checkpoints
    flags = ["--prompt-ids", ",".join(map(str, PROMPTS[0])), "--max-new-tokens", "6", "--dtype", "float32",
             "--stop-token-ids", "127"]
    # two devices per process; compiled programs not cached (a test leaves nothing behind)
    env = {"JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": "",
           "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2"}
    port = str(free_port())
    (status0, out0, err0), (status1, out1, err1) = launch([
        [sys.executable, "-m", "dflash_jax", "generate", target, drafter, *flags,
         "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)] for i in range(2)], env)
    assert status0 == status1 == 0, err0[-3000:] + err1[-3000:]
    assert "mean acceptance length" in err0 and out1 == "" and "mean acceptance length" not in err1
    expected = greedy_tokens[0][:6]  # the target's own decoding, in one process: the stop token not among them
    assert out0 == ",".join(map(str, expected)) + "\n" and 127 not in expected



def test_processes_given_different_prompts_are_refused(monkeypatch):
    """`check_same_arguments` names the flag that differs, and lets paths differ. The all-gather is a stand-in (the
    run above gathers for real) that pairs this process's hashes with another process's."""
    from jax.experimental import multihost_utils

    from dflash_jax.cli import argument_digests, check_same_arguments, parser

    def parsed(*flags: str):
        return parser().parse_args(["generate", "t", "d", "--prompt-ids", "5,17,99", *flags, "--distributed"])

    other = parsed()
    monkeypatch.setattr(multihost_utils, "process_allgather", lambda x: np.stack([x, argument_digests(other)]))
    check_same_arguments(parsed())
    other = parser().parse_args(["generate", "/mnt/t", "/mnt/d", "--prompt-ids", "5,17,99", "--distributed"])
    check_same_arguments(parsed())
    for flags, name in ((["--prompt-ids", "5,17,98"], "--prompt-ids"), (["--seed", "1"], "--seed"),
                        (["--draft-length", "fixed"], "--draft-length")):
        other = parsed(*flags)
        with pytest.raises(ValueError, match=f"{name} differs between this process and process 1: every process"):
            check_same_arguments(parsed())

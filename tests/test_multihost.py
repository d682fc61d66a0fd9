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
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import greedy_generate, load_drafter, load_target, speculative_generate
from dflash_jax._qwen3_testing import write_qwen3_checkpoint
from dflash_jax.testing import write_checkpoint

WORKER = os.path.join(os.path.dirname(__file__), "multihost_worker.py")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS, MAX_NEW = [[5, 17, 99, 3], [120, 4], [9, 9, 9]], 6
TEMPERATURE, TOP_K, SEED = 1.5, 40, 11  # hot enough that the sampled tokens differ from the greedy ones


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(commands: list[list[str]], env: dict[str, str] | None = None,
           timeout: float = 300) -> list[tuple[int, str, str]]:
    """Run one process per command at once, this checkout's package first on the path: `(status, stdout, stderr)`
    of each (subprocess.TimeoutExpired after `timeout` seconds)."""
    env = {**{k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}, **(env or {})}  # XLA_FLAGS: the
    env["PYTHONPATH"] = ROOT  # conftest's compile flags; this checkout's package, whatever is installed
    procs = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for command in commands]
    try:
        outputs = [proc.communicate(timeout=timeout) for proc in procs]
        return [(proc.returncode, out, err) for proc, (out, err) in zip(procs, outputs)]
    finally:
        for proc in procs:
            proc.kill()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[str, str]:
    """`(drafter, target)`: a DFlash2 drafter and the tensor-parallel tiny target it pairs with."""
    root = tmp_path_factory.mktemp("multihost")
    write_checkpoint(root / "drafter", "tiny-dflash2", prefix="model.", num_shards=2)
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
    to stderr). `--draft-length fixed`: a decode program of one length's branch, not three (the adaptive policy and its
    step costs measured across processes: `test_two_process_load`). The prompt is PROMPTS[0], so that the target's own
    tokens are those of `greedy_tokens` (no greedy program of a batch of one to compile)."""
    drafter, target = checkpoints
    flags = ["--prompt-ids", ",".join(map(str, PROMPTS[0])), "--max-new-tokens", "6", "--dtype", "float32",
             "--stop-token-ids", "127", "--draft-length", "fixed"]
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


CPU_ENV = {"JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": ""}


def error_lines(stderr: str) -> list[str]:
    assert "Traceback" not in stderr and "Check failure" not in stderr, stderr[-3000:]
    return [line for line in stderr.splitlines() if "error:" in line]


@pytest.mark.parametrize("address", [":1234", "http://127.0.0.1:1", "localhost", "127.0.0.1:notaport"])
def test_bad_coordinator_is_refused_before_anything_starts(address):
    """A --coordinator that is not HOST:PORT is argparse's error, naming the flag, before JAX starts (it used to
    be a traceback, or JAX's 300 s wait and a C++ abort)."""
    [(status, out, err)] = launch([[sys.executable, "-m", "dflash_jax", "generate", "t", "d", "--prompt-ids", "1",
                                    "--coordinator", address, "--num-processes", "2", "--process-id", "1"]],
                                  CPU_ENV, timeout=30)
    [line] = error_lines(err)
    assert status == 2 and out == "" and "argument --coordinator:" in line and repr(address) in line, err


def test_unreachable_coordinator_is_an_error_within_the_timeout():
    """Process 1 with nothing listening at the coordinator's address gives up after --coordinator-timeout (1 s)
    with one error line (JAX alone would abort the process with a C++ stack after its own 300 s)."""
    address = f"127.0.0.1:{free_port()}"  # a loopback port nothing listens on
    start = time.monotonic()
    [(status, out, err)] = launch([[sys.executable, "-m", "dflash_jax", "generate", "t", "d", "--prompt-ids", "1",
                                    "--coordinator", address, "--num-processes", "2", "--process-id", "1",
                                    "--coordinator-timeout", "1"]], CPU_ENV, timeout=30)
    elapsed = time.monotonic() - start
    [line] = error_lines(err)
    assert status == 2 and out == "" and elapsed < 15, (status, elapsed, err)
    assert line.startswith(f"error: --coordinator {address}: no coordinator answered within 1 s"), line
    assert f"process 1: waiting up to 1 s for the coordinator (process 0) at {address}" in err, err  # said first


@pytest.fixture(scope="module")
def other_target(tmp_path_factory) -> str:
    """The tp target's config with a smaller vocabulary: it loads, and the prompt below is outside it."""
    from dflash_jax._qwen3_testing import _TINY_QWEN3

    path = tmp_path_factory.mktemp("other") / "target"
    write_qwen3_checkpoint(path, {**_TINY_QWEN3, "num_attention_heads": 8, "head_dim": 8, "vocab_size": 64},
                           dtype="float32")
    return str(path)


def two_generates(drafter: str, targets: list[str]) -> list[tuple[int, str, str]]:
    """`dflash-jax generate` in two processes (one CPU device each) loading `targets[i]`; bounded: 45 s."""
    port = str(free_port())
    return launch([[sys.executable, "-m", "dflash_jax", "generate", target, drafter, "--prompt-ids", "5,17,99,3",
                    "--max-new-tokens", "2", "--dtype", "float32", "--coordinator", f"127.0.0.1:{port}",
                    "--num-processes", "2", "--process-id", str(i), "--coordinator-timeout", "20"]
                   for i, target in enumerate(targets)], CPU_ENV, timeout=45)


def test_processes_loading_different_models_all_stop(checkpoints, other_target):
    """Targets of different configs are refused in every process, each naming the mismatch (process 1 used to
    refuse the prompt alone, outside its vocabulary, and process 0 to wait for it for ever)."""
    drafter, target = checkpoints
    for i, (status, out, err) in enumerate(two_generates(drafter, [target, other_target])):
        [line] = error_lines(err)
        assert status == 2 and out == "", (i, status, err[-3000:])
        assert line == (f"error: the target's config differs between this process and process {1 - i}: every "
                        "process of a --distributed run must load the same target and drafter"), line


def test_a_process_that_cannot_load_stops_the_others(checkpoints, tmp_path):
    """Process 1's target path does not exist: it reports that, and process 0 stops too, with one error line."""
    drafter, target = checkpoints
    (status0, out0, err0), (status1, out1, err1) = two_generates(drafter, [target, str(tmp_path / "none")])
    [line0], [line1] = error_lines(err0), error_lines(err1)
    assert status0 == status1 == 2 and out0 == out1 == "", err0[-3000:] + err1[-3000:]
    assert line0.startswith("error: process 1 failed to load its models (its own error line says why)"), line0
    assert "no such file or directory" in line1 and "none" in line1, line1

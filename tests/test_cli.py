"""The dflash-jax command line: inspect (text and --json), load, demo, --version, `python -m`, the compilation
cache, and bad input reported as `error: ...` with status 2, never a traceback (convert-nvfp4 is tested with
the NVFP4 loading; generate in test_generate_cli.py)."""

import dataclasses
import json
import os
import subprocess
import sys
import tempfile

import jax
import numpy as np
import pytest

import dflash_jax
from dflash_jax import load_drafter
from dflash_jax._qwen3_5_testing import write_qwen3_5_checkpoint
from dflash_jax.cli import main, shown
from dflash_jax.platform import process_platform
from dflash_jax.testing import write_checkpoint
from dflash_jax.tuning import TUNING

from ._io import rewrite_tensors

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_inspect_reports_family_tensors_missing_and_unexpected(tmp_path, capsys):
    write_checkpoint(tmp_path, "tiny-dspark")
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "dspark drafter" in out and "markov_head.markov_w1.weight" in out and "missing or malformed: 0" in out
    assert "NVFP4" not in out

    def damage(tensors):
        tensors.pop("layers.0.mlp.up_proj.weight")
        tensors["stray.weight"] = np.zeros(2, np.float32)

    rewrite_tensors(tmp_path, damage)
    assert main(["inspect", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "missing tensor 'layers.0.mlp.up_proj.weight'" in out and "unexpected: 1\n    stray.weight" in out


def test_inspect_describes_a_target_checkpoint(tmp_path, capsys):
    """It read every directory as a drafter's and refused a target's config.json."""
    write_qwen3_5_checkpoint(tmp_path, "tiny-qwen3_5-moe", seed=1)
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "Qwen3_5Target (qwen3_5_moe_text) target" in out and "missing or malformed: 0" in out
    for row in ("layers                   2 (1 linear_attention, 1 full_attention)",
                "heads (q/kv x dim)       4/2 x 16", "experts                  8, 2 per token",
                "quantization             none declared; tensors: 36 BF16",
                "target_layer_ids in [-1, 1]"):
        assert row in out

    def damage(tensors):
        tensors.pop("model.norm.weight")

    rewrite_tensors(tmp_path, damage)
    assert main(["inspect", "--json", str(tmp_path)]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["kind"] == "target" and report["missing"] == ["model.norm.weight"]
    assert report["resolved"]["hidden_size"] == 64 and report["architectures"] == ["Qwen3_5MoeForCausalLM"]


def test_inspect_json_is_what_a_script_consumes(tmp_path, capsys, monkeypatch):
    write_checkpoint(tmp_path, "tiny-dflash", nvfp4=True)

    def damage(tensors):
        tensors.pop("norm.weight")
        tensors["layers.0.self_attn.q_norm.weight"] = np.zeros(3, np.float32)  # wrong shape
        tensors["stray.weight"] = np.zeros(2, np.float32)

    rewrite_tensors(tmp_path, damage)
    assert main(["inspect", "--json", str(tmp_path)]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["family"] == "dflash" and report["nvfp4"] is True and len(report["nvfp4_tensors"]) == 15
    assert report["resolved"]["num_draft_tokens"] == 7 and report["config"]["hidden_size"] == 64
    assert report["missing"] == ["norm.weight"] and report["unexpected"] == ["stray.weight"]
    assert len(report["malformed"]) == 1 and "q_norm" in report["malformed"][0]
    fc = next(t for t in report["tensors"] if t["name"] == "fc.weight")
    assert fc == {"name": "fc.weight", "dtype": "U8", "shape": [64, 64], "bytes": 4096, "file": "model.safetensors"}
    assert report["total_bytes"] == sum(t["bytes"] for t in report["tensors"])
    write_checkpoint(tmp_path / "q", "tiny-dspark", nvfp4=True)
    # what load_drafter's default places on this process's devices, by batch: here (whatever runs this) an H100's
    h100 = "NVIDIA H100 80GB HBM3"
    pretend = dataclasses.replace(process_platform(), kind=h100, tuning=TUNING[h100])
    monkeypatch.setattr(dflash_jax.platform, "process_platform", lambda: pretend)
    assert main(["inspect", str(tmp_path / "q")]) == 0
    out = capsys.readouterr().out
    assert "dspark drafter, NVFP4: 17 packed linear weights" in out
    assert f"  weights_auto           packed up to batch 1, dequantized beyond (the {h100} entry)\n" in out
    assert main(["inspect", "--json", str(tmp_path / "q")]) == 0
    assert json.loads(capsys.readouterr().out)["resolved"]["weights_auto"].startswith("packed up to batch 1, ")


def test_names_the_terminal_cannot_print_are_escaped(tmp_path, capsys):
    write_checkpoint(tmp_path, "tiny-dflash")
    rewrite_tensors(tmp_path, lambda t: t.update({"evil\x1b[2J\u202e.weight": np.zeros(2, np.float32)}))
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\u202e" not in out and "evil\\x1b[2J\\u202e.weight" in out
    assert shown("caf\u00e9 \ud800 \x07") == "caf\u00e9 \\ud800 \\x07"


def test_load_reports_speed_and_memory(tmp_path, capsys):
    write_checkpoint(tmp_path, "tiny-dflash")
    assert main(["load", str(tmp_path), "--devices", "2"]) == 0
    out = capsys.readouterr().out
    assert "loaded onto 2 x cpu" in out and "GB/s" in out and "peak host RSS" in out


def test_errors_are_reported_not_raised(tmp_path, capsys):
    assert main(["inspect", str(tmp_path)]) == 2
    assert "without config.json" in capsys.readouterr().err
    write_checkpoint(tmp_path / "d", "tiny-dflash")
    assert main(["load", str(tmp_path / "d"), "--devices", "100"]) == 2
    devices = len(jax.local_devices())
    assert capsys.readouterr().err == f"error: --devices 100: this process has {devices} local device(s)\n"
    assert main(["convert-nvfp4", str(tmp_path / "d"), "/proc/no-such-dir/x"]) == 2  # an OSError: not writable
    assert capsys.readouterr().err.startswith("error: ")


@pytest.mark.parametrize("argv, words", [
    (["load", "x", "--devices", "-1"], "-1 is not a positive integer"),
    (["load", "x", "--devices", "two"], "'two' is not an integer"),
    (["generate", "t", "d", "--prompt-ids", ""], "no token ids"),
    (["generate", "t", "d", "--prompt-ids", "1,,2"], "expected comma-separated non-negative integers"),
    (["generate", "t", "d", "--prompt-ids", "1,-2"], "expected comma-separated non-negative integers"),
    (["generate", "t", "d", "--prompt-ids", "1", "--max-new-tokens", "0"], "0 is not a positive integer"),
    (["generate", "t", "d", "--prompt-ids", "1", "--temperature", "-1"], "expected a finite temperature >= 0"),
    (["generate", "t", "d", "--prompt-ids", "1", "--temperature", "nan"], "expected a finite temperature >= 0"),
    # issue 26: values past int64 (or int32 token ids) were tracebacks (OverflowError) after loading both models
    (["generate", "t", "d", "--prompt-ids", "1", "--seed", str(2**70)], f"{2**70} is larger than {2**64 - 1}"),
    (["generate", "t", "d", "--prompt-ids", "1", "--max-new-tokens", str(2**64)], f"is larger than {2**63 - 1}"),
    (["generate", "t", "d", "--prompt-ids", f"1,{2**40}"], f"token id {2**40} is larger than {2**31 - 1}"),
    (["load", "x", "--devices", str(2**63)], f"{2**63} is larger than"),
])
def test_bad_arguments_exit_2_with_an_error_line(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "error: argument" in err and words in err and "Traceback" not in err


def test_demo_prints_its_own_lines_only_and_leaves_no_temporary_directory(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert main(["demo"]) == 0
    out, err = capsys.readouterr()
    for preset in ("tiny-dflash", "tiny-dflash2", "tiny-dspark"):
        assert f"{preset}:" in out
    assert f"replicated on {len(jax.local_devices())} device(s)" in out
    assert "dspark drafter, 2 layers" in out  # the loader's summary, from the package's logger
    assert err == "" and os.listdir(tmp_path) == []


def test_progress_bar_on_request(tmp_path, monkeypatch):
    """`progress=True` draws rich's bar even off a terminal: started, advanced once per tensor by its bytes up to
    the checkpoint's total, stopped."""
    from rich import progress as rp

    bars, stopped, real_update, real_stop = [], [], rp.Progress.update, rp.Progress.stop

    def update(self, task, **fields):
        bars.append((self, fields))
        real_update(self, task, **fields)

    def stop(self):
        stopped.append(self)
        real_stop(self)

    monkeypatch.setattr(rp.Progress, "update", update)
    monkeypatch.setattr(rp.Progress, "stop", stop)
    write_checkpoint(tmp_path, "tiny-dflash")
    drafter = load_drafter(tmp_path, progress=True)
    leaves = jax.tree.leaves(drafter.params)
    assert len(leaves) == 25 and len(bars) == 25 and len({id(bar) for bar, _ in bars}) == 1
    bar, last = bars[-1]
    assert last["tensors"] == "25/25 tensors" and stopped == [bar]  # stopped after the last tensor
    task = bar.tasks[0]
    assert task.finished and task.completed == task.total == sum(a.nbytes for a in leaves)  # bf16 on disk and here


def test_python_dash_m_and_version(tmp_path):
    """`python -m dflash_jax` and `python -m dflash_jax.cli` run the program; the program writes JAX's
    persistent cache (a second process of the same shapes compiles nothing)."""
    env = {**os.environ, "PYTHONPATH": ROOT, "XDG_CACHE_HOME": str(tmp_path), "JAX_PLATFORMS": "cpu",
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    env.pop("DFLASH_JAX_CACHE_DIR", None)  # the suite's executable cache may already hold the dequantizers
    for module in ("dflash_jax", "dflash_jax.cli"):
        done = subprocess.run([sys.executable, "-m", module, "--version"], env=env, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0 and done.stdout == f"dflash-jax {dflash_jax.__version__}\n", done.stderr
    write_checkpoint(tmp_path / "d", "tiny-dflash", nvfp4=True)  # loading compiles the dequantizers
    done = subprocess.run([sys.executable, "-m", "dflash_jax", "load", str(tmp_path / "d"), "--dtype", "float32"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert os.listdir(tmp_path / "dflash_jax" / "jax-compilation-cache")


def test_help_and_argument_errors_need_no_jax():
    """`--help` and an argument error answer before JAX is imported (it takes seconds to import)."""
    probe = ("import runpy, sys\n"
             "sys.argv = ['dflash_jax', *sys.argv[1:]]\n"
             "try:\n    runpy.run_module('dflash_jax', run_name='__main__')\n"
             "except SystemExit as e:\n    print('status', e.code, 'jax' in sys.modules, file=sys.stderr)\n")
    env = {**os.environ, "PYTHONPATH": ROOT}
    for args, status in ((["--help"], 0), (["generate", "--help"], 0), (["generate", "t", "d"], 2),
                         (["generate", "t", "d", "--prompt-ids", "1", "--top-p", "0"], 2)):
        done = subprocess.run([sys.executable, "-c", probe, *args], env=env, capture_output=True, text=True,
                              timeout=60, cwd=ROOT)
        assert done.stderr.splitlines()[-1] == f"status {status} False", (args, done.stderr)
    assert "--top-p" in subprocess.run([sys.executable, "-m", "dflash_jax", "generate", "--help"], env=env,
                                       capture_output=True, text=True, timeout=60, cwd=ROOT).stdout


def test_a_closed_pipe_ends_the_program_quietly(tmp_path):
    """`dflash-jax inspect --json x | head -1`: the reader goes away first; the program ends with SIGPIPE's status
    (141) and says nothing (no "Broken pipe" error line, no traceback at exit)."""
    write_checkpoint(tmp_path, "tiny-dspark")
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
    process = subprocess.Popen([sys.executable, "-m", "dflash_jax", "inspect", "--json", str(tmp_path)], env=env,
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert process.stdout is not None
    process.stdout.close()  # before the program has written anything (it takes a second to start)
    _, err = process.communicate(timeout=120)
    assert (process.returncode, err.decode()) == (141, "")


def test_the_demo_log_handler_ends_on_a_closed_pipe():
    """The demo prints the load summaries through logging, which would report a closed pipe as a traceback and
    carry on: its handler passes the error to `main` instead."""
    import logging

    from dflash_jax.cli import _Lines

    class Closed:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            pass

    log = logging.getLogger("dflash_jax.test_closed")
    handler = _Lines(Closed())
    log.addHandler(handler)
    try:
        with pytest.raises(BrokenPipeError):
            log.warning("a line")
    finally:
        log.removeHandler(handler)

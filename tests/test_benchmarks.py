"""The benchmarks' `--small` modes run end to end on a CPU (so the scripts cannot rot); the GPU-only ones
(pallas_tiles.py) in a small form marked `gpu`. Each script's `main()` runs in this process (a subprocess would
spend seconds importing JAX again) with the suite's settings (strict dtype promotion: the scripts have no
implicit promotions either)."""

import importlib.util
import json
import os
import subprocess
import sys

import jax
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.join(ROOT, "benchmarks")


def run_script(monkeypatch, name: str, *argv: str) -> None:
    """`python benchmarks/{name}.py *argv`, in this process: the script's `main()` with `sys.argv` set and
    benchmarks/ on `sys.path` (the scripts import `timing` and each other from there), both restored after."""
    monkeypatch.setattr(sys, "path", [BENCHMARKS, *sys.path])
    monkeypatch.setattr(sys, "argv", [os.path.join(BENCHMARKS, f"{name}.py"), *argv])
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", sys.argv[0])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main()


def test_long_context_small(monkeypatch, tmp_path):
    out = tmp_path / "out.json"
    runs = ["full acceptance + adaptive", "zero acceptance + adaptive"]  # each drafter; the fixed length: the same code
    run_script(monkeypatch, "long_context", "--small", "--runs", *runs, "--json", str(out))
    rows = json.loads(out.read_text())["rows"]
    propose = [r for r in rows if r["part"] == "propose"]
    decode = [r for r in rows if r["part"] == "decode"]
    assert propose and all(r["ms"] > 0 and r["floor_ms"] > 0 for r in propose)
    assert {r["run"] for r in decode} == {"greedy", *runs}
    assert all(r["same_as_greedy"] for r in decode)
    by_run = {r["run"]: r for r in decode}
    full, zero = by_run["full acceptance + adaptive"], by_run["zero acceptance + adaptive"]
    assert full["mean_acceptance"] > 10  # the successor drafter is accepted: the script measures what it says
    assert zero["mean_acceptance"] == 1  # the other never is
    assert zero["plain_tokens"] > 0  # the adaptive policy turns to plain steps (and measures them, full too)


def test_moe_block_small(monkeypatch, tmp_path):
    """Every impl runs and agrees with XLA's `ragged_dot` (bf16: the sums' order differs)."""
    out = tmp_path / "out.json"
    run_script(monkeypatch, "moe_block", "--small", "--tokens", "1", "17", "--iters", "2", "--layers", "2",
               "--json", str(out))
    rows = json.loads(out.read_text())["rows"]
    impls = ("ragged_dot", "gather", "reduce", "tiled", "grouped")
    assert {(r["tokens"], r["variant"]) for r in rows} == {(t, v) for t in (1, 17) for v in impls}
    assert all(r["us"] > 0 and r["floor_us"] > 0 for r in rows)
    assert all(r["max_diff"] < 1e-2 for r in rows), rows  # one block, measured 5.5e-3: bf16 rounding of `h`
    assert all(1 <= r["distinct_experts"] <= 16 for r in rows)


def test_hybrid_decode_small(monkeypatch, tmp_path):
    """The hybrid target's script: the step timings and every run, lossless, the oracle drafter fully accepted."""
    out = tmp_path / "out.json"
    run_script(monkeypatch, "hybrid_decode", "--small", "--targets", "27B", "--json", str(out))
    rows = json.loads(out.read_text())["rows"]
    step = next(r for r in rows if r["part"] == "step")
    assert 0 < step["commit"] and 0 < step["greedy step"] < step["verify 17 + commit"]
    decode = {r["run"]: r for r in rows if r["part"] == "decode"}
    assert set(decode) == {"greedy", "full acceptance", "zero acceptance"}
    assert all(r["same_as_greedy"] and r["greedy_floor_tps"] > 0 for r in decode.values())
    assert decode["full acceptance"]["mean_acceptance"] == 8  # a 7-draft DSpark block, every draft accepted
    assert decode["zero acceptance"]["mean_acceptance"] == 1


def test_packed_gemm_small(monkeypatch, tmp_path):
    """Every variant runs beside its floor; XLA's bf16 GEMM of the dequantized weight is the packed XLA path bit for
    bit; the Mosaic kernel (interpreted on a CPU) agrees with it to bf16 rounding (measured 3.2e-3 of the max)."""
    out = tmp_path / "out.json"
    run_script(monkeypatch, "packed_gemm", "--small", "--iters", "1", "--json", str(out))
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"xla packed", "xla bf16", "mosaic"}
    assert all(r["us"] > 0 and r["floor_us"] > 0 and r["bytes"] > 0 for r in rows.values())
    assert rows["xla bf16"]["identical_to_xla_packed"] == 1.0
    assert rows["mosaic"]["max_diff"] < 2.0**-6


def test_spec_decode_small(monkeypatch, tmp_path):
    """Greedy and three drafters on tiny shapes: lossless, the right successor map accepted, the wrong one not."""
    out = tmp_path / "out.json"
    run_script(monkeypatch, "spec_decode", "--small", "--prompt-len", "8", "--max-new", "16", "--repeats", "1",
               "--json", str(out))
    rows = {r["name"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"greedy", "dspark-b16, right map", "dspark-b16, wrong map", "dflash-b16, random"}
    assert all(r["tokens_per_s"] > 0 for r in rows.values())
    assert all(r["same_tokens"] for name, r in rows.items() if name != "greedy")
    assert rows["dspark-b16, right map"]["mean_acceptance"] > rows["dspark-b16, wrong map"]["mean_acceptance"]


def test_tp_target_small(monkeypatch, tmp_path):
    """A step of the unsharded target and of the same target `shard`ed onto a 1-device mesh, and both loaders."""
    out = tmp_path / "out.json"
    run_script(monkeypatch, "tp_target", "--small", "--batch", "1", "--rows", "1", "--repeats", "1",
               "--dir", str(tmp_path / "ckpt"), "--json", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [r["part"] for r in rows] == ["step", "load"]
    assert rows[0]["unsharded_ms"] > 0 and rows[0]["mesh_ms"] > 0
    assert rows[1]["target_gbps"] > 0 and rows[1]["drafter_gbps"] > 0


def test_draft_step_small(monkeypatch, tmp_path):
    """`propose` timed at the tiny preset (the PyTorch comparison needs the reference file and a GPU)."""
    out = tmp_path / "out.json"
    run_script(monkeypatch, "draft_step", "--small", "--json", str(out))
    results = json.loads(out.read_text())
    assert results["preset"] == "tiny-dflash" and [r["batch"] for r in results["rows"]] == [1]
    assert all(r["ours_ms"] > 0 and r["ours_back_to_back_ms"] > 0 for r in results["rows"])


def test_load_small(monkeypatch, capsys, tmp_path):
    """Our loader and the naive one, each in its own process, on tiny BF16 and NVFP4 checkpoints."""
    run_script(monkeypatch, "load", "--small", "--dir", str(tmp_path), "--methods", "ours", "naive")
    stdout = capsys.readouterr().out
    rows = [line.split() for line in stdout.splitlines()[1:] if line.split()[:1] in (["ours"], ["naive"])]
    assert sorted((r[0], r[1]) for r in rows) == [("naive", "bf16"), ("ours", "bf16"), ("ours", "nvfp4")], stdout
    assert all(float(r[3]) > 0 and float(r[4]) >= 0 for r in rows)  # seconds, GB/s (0.00 for a tiny checkpoint)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
def test_pallas_tiles_small():
    """The GPU kernel's tuning sweep on one short span and one setting per knob."""
    run = subprocess.run([sys.executable, "-W", "ignore", os.path.join(ROOT, "benchmarks", "pallas_tiles.py"),
                          "--spans", "4096", "--rows", "4"], check=True, timeout=600, capture_output=True, text=True)
    assert "4096" in run.stdout, run.stdout


def _plot_module():
    spec = importlib.util.spec_from_file_location("plot", os.path.join(ROOT, "benchmarks", "plot.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The three scripts' JSON layouts (long_context.py, hybrid_decode.py, spec_decode.py), two rows of each kind.
SYNTHETIC = [
    {"device": "NVIDIA H200", "rows": [
        {"part": "propose", "drafter": "d", "batch": 1, "context": 8192, "impl": "auto", "ms": 1.2, "floor_ms": 1.1},
        {"part": "propose", "drafter": "d", "batch": 1, "context": 2048, "impl": "auto", "ms": 1.0, "floor_ms": 0.9},
        {"part": "propose", "drafter": "d", "batch": 1, "context": 2048, "impl": "xla", "ms": 9.0, "floor_ms": 0.9},
        {"part": "decode", "run": "greedy", "prompt": 8192, "batch": 1, "tokens_per_s": 180.0},
        {"part": "decode", "run": "full acceptance", "prompt": 8192, "batch": 1, "tokens_per_s": 1900.0,
         "mean_acceptance": 17.0},
        {"part": "decode", "run": "zero acceptance", "prompt": 8192, "batch": 1, "tokens_per_s": 120.0,
         "mean_acceptance": 1.0}]},
    {"device": "NVIDIA H200", "rows": [
        {"part": "step", "target": "27B", "greedy step": 15.0},
        {"part": "decode", "target": "27B", "run": "greedy", "prompt": 8192, "batch": 1, "tokens_per_s": 63.5},
        {"part": "decode", "target": "27B", "run": "full acceptance", "prompt": 8192, "batch": 1,
         "tokens_per_s": 400.8, "mean_acceptance": 8.0}]},
    {"device": "NVIDIA H200", "args": {"prompt_len": 128}, "rows": [
        {"batch": 1, "name": "greedy", "tokens_per_s": 192.5, "follows_map": 1.0},
        {"batch": 1, "name": "dspark-b16, right map", "tokens_per_s": 2162.4, "speedup": 11.2,
         "mean_acceptance": 17.0, "same_tokens": True}]},
]


def test_plot_reads_every_benchmark_layout():
    """plot.py's series: propose rows by drafter and batch (the `auto` path only, sorted by context), decode rows
    by target, prompt and batch, greedy apart; each of the three JSON layouts."""
    plot = _plot_module()
    assert plot.draft_step_series(SYNTHETIC) == {"d, batch 1": [(2048, 1.0, 0.9), (8192, 1.2, 1.1)]}
    runs, greedy = plot.decode_series(SYNTHETIC)
    assert runs == {"Qwen3-8B shapes, prompt 8192, batch 1": [(1.0, 120.0), (17.0, 1900.0)],
                    "27B, prompt 8192, batch 1": [(8.0, 400.8)],
                    "Qwen3-8B shapes, prompt 128, batch 1": [(17.0, 2162.4)]}
    assert greedy == {"Qwen3-8B shapes, prompt 8192, batch 1": 180.0, "27B, prompt 8192, batch 1": 63.5,
                      "Qwen3-8B shapes, prompt 128, batch 1": 192.5}


def test_plot_writes_the_figures(tmp_path):
    """The command writes both PNGs from JSON files (skipped without the `plots` extra)."""
    pytest.importorskip("matplotlib")
    paths = []
    for i, doc in enumerate(SYNTHETIC):
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps(doc))
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "plot.py"), *map(str, paths), "--out",
                    str(tmp_path / "docs")], check=True, timeout=120, capture_output=True)
    for name in ("draft_step_vs_context.png", "decode_vs_acceptance.png"):
        assert (tmp_path / "docs" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_adaptive_small(monkeypatch, tmp_path):
    """benchmarks/adaptive.py end to end on tiny shapes: greedy, the fixed length and the adaptive policy side by
    side, both outputs greedy's, the dialled acceptance what the drafter's map says."""
    out = tmp_path / "out.json"
    run_script(monkeypatch, "adaptive", "--small", "--prompts", "16", "--batch", "2", "--max-new", "8", "--workloads",
               "acceptance 0", "acceptance 1", "--json", str(out))
    rows = {r["workload"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"acceptance 0", "acceptance 1"}
    assert all(r["same_as_greedy"] and r["greedy_tps"] > 0 and r["adaptive_tps"] > 0 for r in rows.values())
    assert rows["acceptance 0"]["acceptance"] == 0 and rows["acceptance 1"]["acceptance"] == 1

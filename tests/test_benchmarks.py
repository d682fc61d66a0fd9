"""The benchmarks' `--small` modes run end to end on a CPU (so the scripts cannot rot); the GPU-only ones
(pallas_tiles.py) in a small form marked `gpu`. Each script's `main()` runs in this process (a subprocess would
spend seconds importing JAX again) with the suite's settings (strict dtype promotion: the scripts have no
implicit promotions either). plot.py draws the JSON of long_context.py's and adaptive.py's `--small` runs
(marked `plots`: skipped without matplotlib)."""

import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from ._pallas import needs_gpu

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


LONG_CONTEXT_RUNS = ["full acceptance + adaptive", "zero acceptance + adaptive"]  # each drafter; fixed: same code
ADAPTIVE_WORKLOADS = ["acceptance 0", "acceptance 1"]


@pytest.fixture(scope="module")
def long_context_json(tmp_path_factory) -> pathlib.Path:
    """`long_context.py --small --json` (both parts), run once: its test and plot.py's read the file."""
    out = tmp_path_factory.mktemp("long_context") / "long_context.json"
    with pytest.MonkeyPatch.context() as monkeypatch:
        run_script(monkeypatch, "long_context", "--small", "--runs", *LONG_CONTEXT_RUNS, "--drafter-weights", "nvfp4",
                   "--json", str(out))
    return out


@pytest.fixture(scope="module")
def adaptive_json(tmp_path_factory) -> pathlib.Path:
    """`adaptive.py --small --json` at one prompt length and batch, run once: its test and plot.py's read the file."""
    out = tmp_path_factory.mktemp("adaptive") / "adaptive.json"
    with pytest.MonkeyPatch.context() as monkeypatch:
        run_script(monkeypatch, "adaptive", "--small", "--prompts", "16", "--batch", "2", "--max-new", "8",
                   "--repeats", "2", "--workloads", *ADAPTIVE_WORKLOADS, "--json", str(out))
    return out


def test_long_context_small(long_context_json):
    """Both parts: every floor at the one read rate measured in the run; the decode runs lossless, the dialled
    drafters accepted as they say, the adaptive policy's plain steps counted."""
    rows = json.loads(long_context_json.read_text())["rows"]
    propose = [r for r in rows if r["part"] == "propose"]
    decode = [r for r in rows if r["part"] == "decode"]
    assert propose and all(r["ms"] > 0 and r["floor_ms"] > 0 for r in propose)
    assert len({r["read_rate"] for r in rows}) == 1 and rows[0]["read_rate"] > 0
    assert all(r["matmul_rate"] > 0 and r["greedy_floor_tps"] > 0 for r in decode)
    # the drafters' layers packed (the bf16 form runs the same code on the weights as drawn, one compile less of
    # each decode program): their heads stay bf16 and still walk the maps
    assert {r["run"] for r in decode} == {"greedy", *(f"{r}, nvfp4" for r in LONG_CONTEXT_RUNS)}
    assert all(r["same_as_greedy"] for r in decode)
    by_run = {r["run"]: r for r in decode}
    full, zero = by_run["full acceptance + adaptive, nvfp4"], by_run["zero acceptance + adaptive, nvfp4"]
    assert full["mean_acceptance"] > 10  # the successor drafter is accepted: the script measures what it says
    assert zero["mean_acceptance"] == 1  # the other never is
    assert zero["plain_tokens"] > 0  # the adaptive policy turns to plain steps (and measures them, full too)


def test_moe_block_small(monkeypatch, tmp_path):
    """Every impl runs and agrees with XLA's `ragged_dot` (bf16: the sums' order differs)."""
    out = tmp_path / "out.json"
    impls = ("ragged_dot", "gather", "reduce", "tiled", "sliced", "grouped")
    run_script(monkeypatch, "moe_block", "--small", "--tokens", "1", "17", "--iters", "2", "--layers", "1",
               "--variants", *impls, "--json", str(out))
    rows = json.loads(out.read_text())["rows"]
    # "sliced" unrolls a product per (token, expert) pair: 1 token x 4 experts, not 17 x 4
    assert {(r["tokens"], r["variant"]) for r in rows} == {(t, v) for t in (1, 17) for v in impls} - {(17, "sliced")}
    assert all(r["us"] > 0 and r["floor_us"] > 0 for r in rows)
    assert all(r["max_diff"] < 1e-2 for r in rows), rows  # one block, measured 5.5e-3: bf16 rounding of `h`
    assert all(1 <= r["distinct_experts"] <= 16 for r in rows)
    # --profile: each program traced once (on a CPU the trace holds no GPU kernels: the figures are zero)
    run_script(monkeypatch, "moe_block", "--small", "--tokens", "1", "--layers", "1", "--variants", "reduce",
               "--profile", str(tmp_path / "traces"), "--json", str(out))
    (row,) = json.loads(out.read_text())["rows"]
    assert (row["tokens"], row["variant"], row["steps"]) == (1, "reduce", 1) and row["wall_ms"] > 0
    assert list(tmp_path.glob("traces/reduce-1/plugins/profile/*/perfetto_trace.json.gz"))


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
    """Every variant (FP8 too) runs beside its floor, traced too (no GPU times on a CPU); XLA's bf16 GEMM of the
    dequantized weight is the packed XLA path bit for bit; the Mosaic kernel (interpreted on a CPU) agrees with it
    to bf16 rounding (measured 3.2e-3 of the max)."""
    out = tmp_path / "out.json"
    run_script(monkeypatch, "packed_gemm", "--small", "--iters", "1", "--trace", "--json", str(out))
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert all(r["kernel_us"] is None for r in rows.values())  # a CPU's trace holds no device events
    fp8_stored = ("nvfp4 fp8", "nvfp4 fp8 repeat", "nvfp4 fp8 blocked")
    assert set(rows) == {"xla packed", "xla bf16", "mosaic", "xla f4", *fp8_stored, "fp8 scaled", "fp8 xla"}
    for name in fp8_stored:  # the FP8-stored codes: the same weight, the same dot
        assert rows[name]["identical_to_xla_packed"] == 1.0
    assert rows["xla packed"]["bytes"] < rows["nvfp4 fp8"]["bytes"] < rows["xla bf16"]["bytes"]
    assert rows["xla f4"]["max_diff"] < 2.0**-6  # it rounds the weight nowhere, the XLA packed path once
    assert all(r["us"] > 0 and r["floor_us"] > 0 and r["bytes"] > 0 for r in rows.values())
    assert rows["xla bf16"]["identical_to_xla_packed"] == 1.0
    assert rows["mosaic"]["max_diff"] < 2.0**-6
    assert rows["fp8 scaled"]["bytes"] < rows["xla bf16"]["bytes"]  # 1 byte a weight, not 2


def test_spec_decode_small(monkeypatch, tmp_path):
    """Greedy and three drafters on tiny shapes: lossless, the right successor map accepted, the wrong one not."""
    out = tmp_path / "out.json"
    run_script(monkeypatch, "spec_decode", "--small", "--prompt-len", "16", "--batch", "2", "--max-new", "8",
               "--repeats", "1", "--json", str(out))  # adaptive_json's shapes: its greedy and DSpark programs
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


def test_draft_step_small_nemotron(monkeypatch, tmp_path):
    """The Nemotron DSpark layout with its NVFP4 forms (packed, and the codes as FP8 bytes): the quantized rows pack
    the target's head and `markov_w2` too, and the floor reads the embedding's block rows only (a step reads less
    than the drafter holds)."""
    out = tmp_path / "out.json"
    run_script(monkeypatch, "draft_step", "--small", "--preset", "tiny-nemotron-dspark", "--weights", "bf16",
               "nvfp4", "nvfp4-fp8", "--head", "nvfp4", "--json", str(out))
    results = json.loads(out.read_text())
    bf16, packed, fp8_stored = results["rows"]
    assert results["head"] == "nvfp4" and fp8_stored["weights"] == "nvfp4-fp8"
    for quantized in (packed, fp8_stored):  # (the packed codes padded to the kernel's K: 4x at these tiny widths)
        assert quantized["drafter_weight_bytes"] < bf16["drafter_weight_bytes"]
        assert quantized["bytes_read"] < bf16["bytes_read"]
    monkeypatch.setattr(sys, "path", [BENCHMARKS, *sys.path])
    from draft_step import weight_bytes_read  # benchmarks/

    from dflash_jax.testing import random_drafter
    drafter = random_drafter("tiny-nemotron-dspark")  # bf16: embed_tokens [128, 64], markov_w1 [128, 32]
    table_bytes = 2 * (128 * 64 - 8 * 64) + 2 * (128 * 32 - 7 * 32)  # all rows but the 8 / 7 a step looks up
    assert weight_bytes_read(drafter) == drafter.param_bytes + drafter.lm_head.nbytes - table_bytes


def test_load_small(monkeypatch, capsys, tmp_path):
    """Our loader and the naive one, each in its own process, on tiny BF16 and NVFP4 checkpoints."""
    run_script(monkeypatch, "load", "--small", "--dir", str(tmp_path), "--methods", "ours", "naive")
    stdout = capsys.readouterr().out
    rows = [line.split() for line in stdout.splitlines()[1:] if line.split()[:1] in (["ours"], ["naive"])]
    assert sorted((r[0], r[1]) for r in rows) == [("naive", "bf16"), ("ours", "bf16"), ("ours", "nvfp4")], stdout
    assert all(float(r[3]) > 0 and float(r[4]) >= 0 for r in rows)  # seconds, GB/s (0.00 for a tiny checkpoint)


@pytest.mark.gpu
@needs_gpu
def test_pallas_tiles_small():
    """The GPU kernel's tuning sweep on one short span and one setting per knob."""
    run = subprocess.run([sys.executable, "-W", "ignore", os.path.join(ROOT, "benchmarks", "pallas_tiles.py"),
                          "--spans", "4096", "--rows", "4"], check=True, timeout=600, capture_output=True, text=True)
    assert "4096" in run.stdout, run.stdout


def test_adaptive_small(adaptive_json):
    """benchmarks/adaptive.py end to end on tiny shapes: greedy, the fixed length and the adaptive policy side by
    side, both outputs greedy's, the dialled acceptance what the drafter's map says."""
    rows = {r["workload"]: r for r in json.loads(adaptive_json.read_text())["rows"]}
    assert set(rows) == set(ADAPTIVE_WORKLOADS)
    assert all(r["same_as_greedy"] and r["greedy_tps"] > 0 and r["adaptive_tps"] > 0 for r in rows.values())
    assert all(r["step_costs_ms"] for r in rows.values())  # predicted: 8 tokens are too few to measure them in
    assert rows["acceptance 0"]["acceptance"] == 0 and rows["acceptance 1"]["acceptance"] == 1


def test_adaptive_model_small(monkeypatch, tmp_path):
    """The policy under a cost model: the decisions run, and on a batch whose sequences are accepted at 0 to 1 the
    default focus serves the never-accepted ones (close to greedy's time) where the batch's summed tokens per second
    (focus 0) keeps verifying for the others (fails if the weights stop counting)."""
    out = tmp_path / "out.json"
    run_script(monkeypatch, "adaptive_model", "--small", "--batch", "8", "--focus", "0", "8",
               "--workloads", "mixed batch", "acceptance 1", "--json", str(out))
    rows = {r["workload"]: r["x_greedy"] for r in json.loads(out.read_text())["rows"]}
    assert rows["mixed batch"]["focus 8"] > max(rows["mixed batch"]["focus 0"], rows["mixed batch"]["fixed"]) + 0.1
    assert rows["acceptance 1"]["focus 8"] == pytest.approx(rows["acceptance 1"]["fixed"], rel=0.05)


def _plot_module():
    spec = importlib.util.spec_from_file_location("plot", os.path.join(ROOT, "benchmarks", "plot.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# long_context.py's and adaptive.py's JSON layouts, with the rows plot.py must leave out (another kernel choice,
# the decode part).
SYNTHETIC = [
    {"device": "NVIDIA H200", "rows": [
        {"part": "propose", "drafter": "d", "batch": 1, "context": 8192, "impl": "auto", "ms": 1.2, "floor_ms": 1.1,
         "read_rate": 3.8e12},
        {"part": "propose", "drafter": "d", "batch": 1, "context": 2048, "impl": "auto", "ms": 1.0, "floor_ms": 0.9,
         "read_rate": 3.8e12},
        {"part": "propose", "drafter": "d", "batch": 1, "context": 2048, "impl": "xla", "ms": 9.0, "floor_ms": 0.9,
         "read_rate": 3.8e12},
        {"part": "decode", "run": "greedy", "prompt": 8192, "batch": 1, "tokens_per_s": 180.0}]},
    {"device": "NVIDIA H200", "rows": [
        {"prompt": 2048, "batch": 1, "workload": "acceptance 1", "acceptance": 1.0, "greedy_tps": 200.0,
         "fixed_tps": 2200.0, "adaptive_tps": 2000.0},
        {"prompt": 2048, "batch": 1, "workload": "acceptance 0", "acceptance": 0.0, "greedy_tps": 200.0,
         "fixed_tps": 140.0, "adaptive_tps": 190.0},
        {"prompt": 2048, "batch": 1, "workload": "mixed", "acceptance": 0.7, "greedy_tps": 200.0,
         "fixed_tps": 400.0, "adaptive_tps": 420.0}]},
]


def test_plot_series():
    """plot.py's series: propose rows by drafter and batch (the `auto` path only, sorted by context); adaptive.py's
    rows as x greedy against acceptance per draft, fixed and adaptive apart, the mixed workloads apart."""
    plot = _plot_module()
    assert plot.draft_step_series(SYNTHETIC) == {"d, batch 1": [(2048, 1.0, 0.9), (8192, 1.2, 1.1)]}
    dialled, mixed = plot.speedup_series(SYNTHETIC)
    assert dialled == {"prompt 2048, batch 1, fixed": [(0.0, 0.7), (1.0, 11.0)],
                       "prompt 2048, batch 1, adaptive": [(0.0, 0.95), (1.0, 10.0)]}
    assert mixed == {"prompt 2048, batch 1, fixed": [(0.7, 2.0)], "prompt 2048, batch 1, adaptive": [(0.7, 2.1)]}


def test_plot_reads_the_scripts_json(long_context_json, adaptive_json):
    """What the two scripts write is what plot.py reads (without matplotlib: the series only)."""
    plot = _plot_module()
    docs = [json.loads(path.read_text()) for path in (long_context_json, adaptive_json)]
    steps = plot.draft_step_series(docs)
    assert list(steps) == ["Qwen3.6-35B-A3B tf5, batch 2"]
    assert [(context, ms > 0, floor > 0) for context, ms, floor in steps["Qwen3.6-35B-A3B tf5, batch 2"]] == [
        (200, True, True)]
    dialled, mixed = plot.speedup_series(docs)
    assert {k: [a for a, _ in v] for k, v in dialled.items()} == {
        "prompt 16, batch 2, fixed": [0.0, 1.0], "prompt 16, batch 2, adaptive": [0.0, 1.0]}
    assert not mixed


def test_loop_copies_small(monkeypatch, tmp_path):
    """The adaptive decode program copies no buffer of the drafter's context cache (a step choosing between drafting
    and appending with `lax.cond` copied it twice on a CPU), and the script finds copies where there are some (of
    the target's KV cache, on a CPU, where a layer's attention reads it in a loop beside its in-place write)."""
    out = tmp_path / "out.json"
    run_script(monkeypatch, "loop_copies", "--small", "--prompt-len", "16", "--max-new", "8", "--programs",
               "adaptive", "--json", str(out))
    rows = {r["buffer"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["drafter context"]["copies"] == 0
    assert rows["target KV"]["copies"] > 0


@pytest.mark.plots
def test_plot_writes_the_figures(monkeypatch, long_context_json, adaptive_json, tmp_path):
    """The command writes both PNGs from the scripts' JSON."""
    pytest.importorskip("matplotlib", reason="needs pip install -e '.[plots]' (matplotlib)")
    out = tmp_path / "figures"
    run_script(monkeypatch, "plot", str(long_context_json), str(adaptive_json), "--out", str(out))
    for name in ("draft_step_vs_context.png", "speedup_vs_acceptance.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- docs/benchmarks.md and the README's table: every figure names its device -------------------------------------

DEVICES = ("H100", "H200", "2-core CPU")


def _sections_with_tables(text: str) -> list[tuple[str, str]]:
    """(heading, section text) of each `##` / `###` section of `text` that holds a table."""
    parts = re.split(r"^(#{2,3} .*)$", text, flags=re.M)
    return [(heading, body) for heading, body in zip(parts[1::2], parts[2::2]) if re.search(r"^\|", body, re.M)]


def test_every_benchmark_table_names_its_run():
    """Each section of docs/benchmarks.md that holds tables says, once, what ran where: one run line naming one
    device (an H100, an H200 or the 2-core CPU), a date and the commit (or that none was recorded), beside its
    command and its floor; so no table mixes devices."""
    with open(os.path.join(ROOT, "docs", "benchmarks.md")) as f:
        sections = _sections_with_tables(f.read())
    assert len(sections) >= 15
    for heading, body in sections:
        runs = re.findall(r"^- Run: (.*(?:\n  .*)*)", body, re.M)
        assert len(runs) == 1, f"{heading}: {len(runs)} run lines"
        run = " ".join(runs[0].split())
        assert sum(device in run for device in DEVICES) == 1, f"{heading}: the run names no one device: {run}"
        assert re.search(r"\b2026-\d\d-\d\d\b", run), f"{heading}: no date: {run}"
        assert re.search(r"\b[0-9a-f]{7}\b", run) or "no commit recorded" in run, f"{heading}: no commit: {run}"
        assert re.search(r"^- Commands?\b", body, re.M) and re.search(r"^- Floor:", body, re.M), heading


def test_readme_benchmarks_name_their_device():
    """The README's benchmark table has a device column, an H100 or an H200 on every row."""
    with open(os.path.join(ROOT, "README.md")) as f:
        section = f.read().split("## Benchmarks", 1)[1].split("\n## ", 1)[0]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in section.splitlines()
            if line.startswith("|")]
    assert rows[0][1] == "device" and len(rows) > 5
    assert all(row[1] in ("H100", "H200") for row in rows[2:]), rows

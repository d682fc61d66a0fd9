"""The benchmarks' `--small` modes run end to end on a CPU (so the scripts cannot rot)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_long_context_small(tmp_path):
    out = tmp_path / "out.json"
    runs = ["full acceptance + backoff", "zero acceptance + backoff"]  # each drafter; without a backoff: the same code
    subprocess.run([sys.executable, "-W", "ignore", os.path.join(ROOT, "benchmarks", "long_context.py"), "--small",
                    "--runs", *runs, "--json", str(out)], check=True, timeout=600, capture_output=True)
    rows = json.loads(out.read_text())["rows"]
    propose = [r for r in rows if r["part"] == "propose"]
    decode = [r for r in rows if r["part"] == "decode"]
    assert propose and all(r["ms"] > 0 and r["floor_ms"] > 0 for r in propose)
    assert {r["run"] for r in decode} == {"greedy", *runs}
    assert all(r["same_as_greedy"] for r in decode)
    by_run = {r["run"]: r for r in decode}
    full, zero = by_run["full acceptance + backoff"], by_run["zero acceptance + backoff"]
    assert full["mean_acceptance"] > 10  # the successor drafter is accepted: the script measures what it says
    assert zero["mean_acceptance"] == 1  # the other never is
    assert full["plain_tokens"] == 0 < zero["plain_tokens"]  # `Backoff()`: never on a drafter that is always right


def test_moe_block_small(tmp_path):
    """Every impl runs and agrees with XLA's `ragged_dot` (bf16: the sums' order differs)."""
    out = tmp_path / "out.json"
    subprocess.run([sys.executable, "-W", "ignore", os.path.join(ROOT, "benchmarks", "moe_block.py"), "--small",
                    "--tokens", "1", "17", "--iters", "2", "--layers", "2", "--json", str(out)],
                   check=True, timeout=300, capture_output=True)
    rows = json.loads(out.read_text())["rows"]
    impls = ("ragged_dot", "gather", "tiled", "grouped")
    assert {(r["tokens"], r["variant"]) for r in rows} == {(t, v) for t in (1, 17) for v in impls}
    assert all(r["us"] > 0 and r["floor_us"] > 0 for r in rows)
    assert all(r["max_diff"] < 1e-2 for r in rows), rows  # one block, measured 5.5e-3: bf16 rounding of `h`
    assert all(1 <= r["distinct_experts"] <= 16 for r in rows)


def test_hybrid_decode_small(tmp_path):
    """The hybrid target's script: the step timings and every run, lossless, the oracle drafter fully accepted."""
    out = tmp_path / "out.json"
    subprocess.run([sys.executable, "-W", "ignore", os.path.join(ROOT, "benchmarks", "hybrid_decode.py"), "--small",
                    "--targets", "27B", "--json", str(out)], check=True, timeout=600, capture_output=True)
    rows = json.loads(out.read_text())["rows"]
    step = next(r for r in rows if r["part"] == "step")
    assert 0 < step["commit"] and 0 < step["greedy step"] < step["verify 17 + commit"]
    decode = {r["run"]: r for r in rows if r["part"] == "decode"}
    assert set(decode) == {"greedy", "full acceptance", "zero acceptance"}
    assert all(r["same_as_greedy"] and r["greedy_floor_tps"] > 0 for r in decode.values())
    assert decode["full acceptance"]["mean_acceptance"] == 8  # a 7-draft DSpark block, every draft accepted
    assert decode["zero acceptance"]["mean_acceptance"] == 1


def test_packed_gemm_small(tmp_path):
    """Every variant runs beside its floor; XLA's bf16 GEMM of the dequantized weight is the packed XLA path bit for
    bit; the Mosaic kernel (interpreted on a CPU) agrees with it to bf16 rounding (measured 3.2e-3 of the max)."""
    out = tmp_path / "out.json"
    subprocess.run([sys.executable, "-W", "ignore", os.path.join(ROOT, "benchmarks", "packed_gemm.py"), "--small",
                    "--iters", "1", "--json", str(out)], check=True, timeout=300, capture_output=True)
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"xla packed", "xla bf16", "mosaic"}
    assert all(r["us"] > 0 and r["floor_us"] > 0 and r["bytes"] > 0 for r in rows.values())
    assert rows["xla bf16"]["identical_to_xla_packed"] == 1.0
    assert rows["mosaic"]["max_diff"] < 2.0**-6

"""Figures for docs/ from the benchmarks' JSON output (`--json` of long_context.py, hybrid_decode.py, spec_decode.py).

    pip install -e '.[plots]'      # matplotlib
    python benchmarks/plot.py long_context.json hybrid_decode.json spec_decode.json --out docs/

Writes, for what the files hold:

- `draft_step_vs_context.png`: the drafting step (`long_context.py --parts propose` rows): ms per step against
  the cached context, one line per drafter and batch, its floor (the bytes the step reads at the run's measured
  rate) dashed in the same colour.
- `decode_vs_acceptance.png`: speculative decoding (decode rows of all three scripts): decode tokens/s against
  the mean acceptance length (tokens committed per verify step), one line per target, prompt and batch from its
  zero-acceptance to its full-acceptance run, greedy decoding of the same configuration as a dotted level. The
  line between the two bounds is drawn, not measured: a real drafter sits on it only as far as a step's cost
  does not depend on how many drafts it accepts.
"""

from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict
from typing import Any

Series = dict[str, list[tuple[float, ...]]]


def draft_step_series(docs: list[dict[str, Any]]) -> Series:
    """`"drafter, batch b"` -> sorted `(context, ms, floor_ms)` of every propose row (the `auto` kernel choice)."""
    series: Series = defaultdict(list)
    for doc in docs:
        for r in doc.get("rows", []):
            if r.get("part") == "propose" and r.get("impl", "auto") == "auto":
                series[f"{r['drafter']}, batch {r['batch']}"].append((r["context"], r["ms"], r["floor_ms"]))
    return {k: sorted(v) for k, v in series.items()}


def decode_series(docs: list[dict[str, Any]]) -> tuple[Series, dict[str, float]]:
    """(`"target, prompt P, batch b"` -> sorted `(mean acceptance, tokens/s)` of its speculative runs,
    the same key -> greedy tokens/s). long_context.py and hybrid_decode.py name a run `run`, spec_decode.py `name`;
    spec_decode.py's rows carry no prompt length (its `args` do)."""
    series: Series = defaultdict(list)
    greedy: dict[str, float] = {}
    for doc in docs:
        args = doc.get("args", {})
        for r in doc.get("rows", []):
            if r.get("part", "decode") != "decode" or "tokens_per_s" not in r:
                continue
            target = r.get("target", "Qwen3-8B shapes")
            key = f"{target}, prompt {r.get('prompt', args.get('prompt_len', '?'))}, batch {r['batch']}"
            run = r.get("run", r.get("name"))
            if run == "greedy":
                greedy[key] = r["tokens_per_s"]
            elif r.get("mean_acceptance") is not None:
                series[key].append((r["mean_acceptance"], r["tokens_per_s"]))
    return {k: sorted(v) for k, v in series.items()}, greedy


def plot(docs: list[dict[str, Any]], out: str) -> list[str]:
    """Write the figures the documents have data for into `out`; their paths."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    os.makedirs(out, exist_ok=True)
    device = ", ".join(sorted({d["device"] for d in docs if "device" in d}))
    written = []
    steps = draft_step_series(docs)
    if steps:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for label, points in steps.items():
            ctx, ms, floor = zip(*points)
            (line,) = ax.plot(ctx, ms, marker="o", label=label)
            ax.plot(ctx, floor, linestyle="--", color=line.get_color(), alpha=0.6)
        ax.set(xscale="log", xlabel="cached context (rows)", ylabel="ms per drafting step",
               title=f"Drafting step against context ({device}; dashed: floor)")
        contexts = sorted({c for points in steps.values() for c, *_ in points})
        ax.set_xticks(contexts, [f"{c / 1024:g}k" if c >= 1024 else str(c) for c in contexts])
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
        written.append(_save(fig, os.path.join(out, "draft_step_vs_context.png")))
    runs, greedy = decode_series(docs)
    if runs:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for label, points in runs.items():
            acceptance, tps = zip(*points)
            (line,) = ax.plot(acceptance, tps, marker="o", label=label)
            if label in greedy:
                ax.axhline(greedy[label], linestyle=":", color=line.get_color(), alpha=0.8)
        ax.set(xlabel="mean acceptance length (tokens per verify step)", ylabel="decode tokens/s",
               title=f"Speculative decoding against acceptance ({device}; dotted: greedy)")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
        written.append(_save(fig, os.path.join(out, "decode_vs_acceptance.png")))
    return written


def _save(fig, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    fig.clf()
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json", nargs="+", help="files written by the benchmarks' --json")
    parser.add_argument("--out", default="docs", help="directory for the PNGs")
    args = parser.parse_args()
    docs = []
    for path in args.json:
        with open(path) as f:
            docs.append(json.load(f))
    for path in plot(docs, args.out):
        print(path)


if __name__ == "__main__":
    main()

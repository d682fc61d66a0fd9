"""Figures for docs/ from the benchmarks' JSON output (`--json` of long_context.py and adaptive.py).

    pip install -e '.[plots]'      # matplotlib
    python benchmarks/plot.py long_context.json adaptive.json --out docs/figures

Writes into `--out`, for what the files hold:

- `draft_step_vs_context.png`: the drafting step (`long_context.py --parts propose` rows, the `auto` kernel
  choice): ms per step against the cached context, one line per drafter and batch, its floor (the bytes the step
  reads at the read rate measured in the same run, `jnp.sum` over 4 GiB) dashed in the same colour.
- `speedup_vs_acceptance.png`: speculative decoding (`adaptive.py` rows): decode tokens/s over greedy decoding's
  in the same run, against the acceptance per draft position measured on the fixed-length run; one colour per
  prompt length and batch, the fixed draft length solid and the adaptive policy dashed through the dialled
  workloads (`acceptance f`), the mixed workloads as unconnected stars, greedy (1.0) a dotted level.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

Series = dict[str, list[tuple[float, ...]]]
MODES = {"fixed": "-", "adaptive": "--"}  # adaptive.py's runs beside greedy, and their line styles


def propose_rows(docs: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """long_context.py's drafting-step rows of the `auto` kernel choice."""
    for doc in docs:
        for r in doc.get("rows", []):
            if r.get("part") == "propose" and r.get("impl", "auto") == "auto":
                yield r


def draft_step_series(docs: list[dict[str, Any]]) -> Series:
    """`"drafter, batch b"` -> sorted `(context, ms, floor_ms)` of every propose row."""
    series: Series = defaultdict(list)
    for r in propose_rows(docs):
        series[f"{r['drafter']}, batch {r['batch']}"].append((r["context"], r["ms"], r["floor_ms"]))
    return {k: sorted(v) for k, v in series.items()}


def speedup_series(docs: list[dict[str, Any]]) -> tuple[Series, Series]:
    """adaptive.py's rows as (`"prompt P, batch b, fixed|adaptive"` -> sorted `(acceptance per draft, x greedy)` of
    the dialled workloads (`acceptance f`), the same keys -> those of the mixed workloads); keys in the rows'
    order."""
    dialled: Series = defaultdict(list)
    mixed: Series = defaultdict(list)
    for doc in docs:
        for r in doc.get("rows", []):
            if "workload" not in r:
                continue
            series = dialled if r["workload"].startswith("acceptance") else mixed
            for mode in MODES:
                series[f"prompt {r['prompt']}, batch {r['batch']}, {mode}"].append(
                    (r["acceptance"], r[f"{mode}_tps"] / r["greedy_tps"]))
    return {k: sorted(v) for k, v in dialled.items()}, {k: sorted(v) for k, v in mixed.items()}


def plot(docs: list[dict[str, Any]], out: str) -> list[str]:
    """Write the figures the documents have data for into the directory `out`; their paths."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    os.makedirs(out, exist_ok=True)
    device = ", ".join(sorted({d["device"] for d in docs if "device" in d}))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    written = []
    steps = draft_step_series(docs)
    if steps:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for label, points in steps.items():
            ctx, ms, floor = zip(*points)
            (line,) = ax.plot(ctx, ms, marker="o", label=label)
            ax.plot(ctx, floor, linestyle="--", color=line.get_color(), alpha=0.6)
        rates = sorted({round(r["read_rate"] / 1e12, 2) for r in propose_rows(docs)})  # TB/s, one per run
        rate = f"{rates[0]:.2f}" + (f"-{rates[-1]:.2f}" if len(rates) > 1 else "")
        ax.set(xscale="log", xlabel="cached context (rows)", ylabel="ms per drafting step",
               title=f"Drafting step against context ({device})\ndashed: floor at the read rate ({rate} TB/s)")
        contexts = sorted({c for points in steps.values() for c, *_ in points})
        ax.set_xticks(contexts, [f"{c / 1024:g}k" if c >= 1024 else str(c) for c in contexts])
        ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
        written.append(_save(fig, os.path.join(out, "draft_step_vs_context.png")))
    dialled, mixed = speedup_series(docs)
    if dialled or mixed:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        shapes = list(dict.fromkeys(key.rsplit(", ", 1)[0] for key in (*dialled, *mixed)))  # "prompt P, batch b"
        for (i, shape), mode in itertools.product(enumerate(shapes), MODES):
            key, colour = f"{shape}, {mode}", colours[i % len(colours)]
            if key in dialled:
                acceptance, speedup = zip(*dialled[key])
                ax.plot(acceptance, speedup, linestyle=MODES[mode], marker="o", color=colour, label=key)
            if key in mixed:
                acceptance, speedup = zip(*mixed[key])
                ax.plot(acceptance, speedup, linestyle="none", marker="*", markersize=10, color=colour,
                        markerfacecolor=colour if mode == "fixed" else "none")
        ax.axhline(1.0, linestyle=":", color="black", alpha=0.8)
        ax.set(yscale="log", xlabel="acceptance per draft position (fixed length)",
               ylabel="decode tokens/s, x greedy",
               title=f"Speculative decoding against acceptance ({device})\nsolid: fixed length, dashed: adaptive, "
                     "stars: mixed workloads, dotted: greedy")
        ax.minorticks_off()
        low, high = ax.get_ylim()
        low, high = ax.set_ylim(min(low, 0.5), max(high, 2))  # a labelled tick either side of greedy
        ticks = [t for t in (0.125, 0.25, 0.5, 1, 2, 4, 8, 16, 32) if low <= t <= high]
        ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
        ax.legend(fontsize=8)
        written.append(_save(fig, os.path.join(out, "speedup_vs_acceptance.png")))
    return written


def _save(fig, path: str) -> str:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json", nargs="+", help="files written by the benchmarks' --json")
    parser.add_argument("--out", default="docs/figures", help="directory for the PNGs")
    args = parser.parse_args()
    docs = []
    for path in args.json:
        with open(path) as f:
            docs.append(json.load(f))
    for path in plot(docs, args.out):
        print(path)


if __name__ == "__main__":
    main()

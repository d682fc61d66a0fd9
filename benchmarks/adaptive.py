"""Tokens/s of greedy decoding, the fixed draft length and the adaptive policy, side by side, at dialled acceptance.

Target: Qwen3-8B shapes, random bf16 weights rebuilt by `successor_target` (as `spec_decode.py`) around a
successor map that is one cycle through the whole vocabulary, so each sequence's greedy continuation walks its
own stretch of the cycle. Drafter: the 16-draft DSpark drafter of `spec_decode.py` (no confidence head) whose
Markov head walks a second permutation that agrees with the target's map on a chosen set of tokens: a draft is
accepted where the token before it is in the set. Workloads (each row: one prompt length and batch size):

- `acceptance f`: every token in the set with probability f (0, 0.3, 0.6, 0.9, 1);
- `mixed`: along each sequence's stretch, f switches between 0.9 and 0.3 every `--switch-every` tokens;
- `mixed batch` (batch > 1): each sequence has its own f (0, 0.3, 0.6, 0.9, 1, ...).

Each row runs greedy (once per prompt length, batch and budget), `draft_length="fixed"` and `"adaptive"` in the
same process; the first run of each program compiles, then `--repeats` timed runs each, interleaved (greedy, fixed,
adaptive, greedy, ...). The adaptive runs share one `Adaptive` (step costs predicted, measured by a run long
enough to and then kept), or with `--fresh` each run has a new `Adaptive()`, no costs held and no store: what a
fresh process's first call does (its compile run is a throwaway call of the same shapes). Figures: the median
decode tokens/s (`decode_tokens_per_second`) of each, the range of adaptive / fixed over the repeats, the fixed run's
measured acceptance per draft position (accepted drafts / positions tried), both runs' mean tokens per verify,
the adaptive run's plain tokens, and whether both outputs equal greedy's; after the table, the step costs the
policy chose by for each shape (`GenerationResult.step_costs`: predicted, or measured).

    XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -W ignore benchmarks/adaptive.py --budget-s 330 --json adaptive.json
    XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -W ignore benchmarks/adaptive.py --fresh --prompts 2048 \
        --max-new 32 128 --workloads "acceptance 0" "acceptance 1" mixed "mixed batch" --json fresh.json  # short runs
    python3 benchmarks/adaptive.py --prompts 2048 --batch 1 --lengths 16    # the policy's bookkeeping, no switch
    python benchmarks/adaptive.py --small      # tiny shapes, for a CPU check of the script
    python benchmarks/adaptive.py --small --fresh --prompts 16 --batch 2 --max-new 96 --workloads "acceptance 0"
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time

import jax
import numpy as np

from dflash_jax import Adaptive
from dflash_jax.config import parse_config
from dflash_jax.generate import greedy_generate, speculative_generate
from dflash_jax.testing import random_drafter, random_qwen3, successor_drafter, successor_target

sys.path.insert(0, __file__.rsplit("/", 1)[0])  # benchmarks/: share spec_decode's shapes and drafters
from spec_decode import QWEN3_8B, SMALL, add_run_arguments, drafter_configs  # noqa: E402
from timing import write_rows  # noqa: E402

RATES = (0.0, 0.3, 0.6, 0.9, 1.0)
BATCH_RATES = (0.0, 0.3, 0.6, 0.9, 1.0, 0.3, 0.9, 0.0)  # the mixed batch: sequence i has BATCH_RATES[i % 8]


def one_cycle(V: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """`(successor, order)`: a permutation that is one cycle through all V tokens, `successor[order[i]] =
    order[i + 1]`."""
    order = rng.permutation(V)
    successor = np.empty(V, np.int64)
    successor[order] = np.roll(order, -1)
    return successor, order


def agreeing_map(successor: np.ndarray, agree: np.ndarray) -> np.ndarray:
    """A permutation equal to `successor` on the tokens where `agree` is True and different from it elsewhere
    (the other tokens take each other's successors, shifted by one)."""
    drafted = successor.copy()
    others = np.flatnonzero(~agree)
    if len(others) > 1:
        drafted[others] = successor[np.roll(others, -1)]
    return drafted


def workloads(successor: np.ndarray, order: np.ndarray, starts: np.ndarray, span: int, switch: int,
              rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Drafter maps by workload name: uniform rates; the mixed rate along each sequence's stretch of the cycle
    (positions `starts[b] .. starts[b] + span`); the per-sequence rates of a mixed batch."""
    V = len(successor)
    maps = {f"acceptance {f:g}": agreeing_map(successor, rng.uniform(size=V) < f) for f in RATES}
    stretch = [(order[(s + np.arange(span)) % V], np.arange(span)) for s in starts]  # tokens, their offsets
    agree = rng.uniform(size=V) < 0.3
    for tokens, offsets in stretch:
        high = (offsets // switch) % 2 == 0  # 0.9 first, then 0.3, ...
        agree[tokens] = np.where(high, rng.uniform(size=span) < 0.9, rng.uniform(size=span) < 0.3)
    maps["mixed"] = agreeing_map(successor, agree)
    if len(starts) > 1:
        agree = rng.uniform(size=V) < 0.3
        for b, (tokens, _) in enumerate(stretch):
            agree[tokens] = rng.uniform(size=span) < BATCH_RATES[b % len(BATCH_RATES)]
        maps["mixed batch"] = agreeing_map(successor, agree)
    return maps


def draft_acceptance(result, K: int) -> float:
    """Accepted drafts / draft positions tried (a verify with a accepted tried min(a + 1, K))."""
    steps = np.array([a for seq in result.acceptance_lengths for a in seq]) - 1
    return float(steps.sum() / max(np.minimum(steps + 1, K).sum(), 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, nargs="+", default=[2048, 32768])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-new", type=int, nargs="+", default=[384], help="new tokens a sequence (each a row)")
    parser.add_argument("--fresh", action="store_true",
                        help="a new Adaptive() for each adaptive run: no step costs held from an earlier run")
    parser.add_argument("--switch-every", type=int, default=128, help="the mixed workload's phase, in tokens")
    parser.add_argument("--workloads", nargs="+", default=None, help="names to run (default: all)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each decoding, interleaved")
    parser.add_argument("--lengths", type=int, nargs="+", default=None,
                        help="the adaptive policy's draft lengths (default: Adaptive's, 0 3 7 K); e.g. K alone runs "
                             "its bookkeeping without plain steps or a choice of verify length")
    add_run_arguments(parser)
    args = parser.parse_args()
    start = time.perf_counter()
    config = SMALL if args.small else QWEN3_8B
    V = config["vocab_size"]
    rng = np.random.default_rng(0)
    successor, order = one_cycle(V, rng)
    target = successor_target(random_qwen3(config, seed=0), successor, layer_scale=args.layer_scale)
    raw = drafter_configs(config, args.small)["dspark"]  # --small: spec_decode.py's, so both share programs
    base = random_drafter(parse_config(raw), seed=1).attach(embed=target.embed, lm_head=target.lm_head)
    K = base.config.num_draft_tokens
    lengths = None if args.lengths is None else tuple(args.lengths)
    held = Adaptive(draft_lengths=lengths)  # one policy for the script: it keeps the costs a long run measures

    def adaptive_length() -> Adaptive:
        return Adaptive(draft_lengths=lengths) if args.fresh else held

    span = max(args.max_new) + 2 * K + 2
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; K = {K}, {args.max_new} new tokens"
          f"{', a fresh Adaptive() each run' if args.fresh else ''}; weights made in "
          f"{time.perf_counter() - start:.1f} s", flush=True)
    print("| prompt | batch | new tokens | workload | acceptance (fixed) | greedy tok/s | fixed tok/s | "
          "adaptive tok/s | adaptive / fixed (range) | adaptive / greedy | tokens per verify fixed, adaptive | "
          "plain tokens | same |", flush=True)
    print("|---:|---:|---:|---|---:|---:|---:|---:|---|---:|---|---:|---|", flush=True)

    rows, measured = [], []
    for prompt_len, batch, max_new in itertools.product(args.prompts, args.batch, args.max_new):
        starts = np.arange(batch) * (V // max(batch, 1) // 2)  # each sequence on its own stretch of the cycle
        prompts = rng.integers(0, V, (batch, prompt_len))
        prompts[:, -1] = order[starts]  # the continuation walks the cycle from here
        prompts = prompts.tolist()
        maps = workloads(successor, order, starts, span, args.switch_every, rng)
        names = [n for n in maps if args.workloads is None or n in args.workloads]
        label = f"| {prompt_len} | {batch} | {max_new} |"

        def run(drafter=None, draft_length="fixed", prompts=prompts, max_new=max_new):
            if drafter is None:
                return greedy_generate(target, prompts, max_new_tokens=max_new, stop_token_ids=())
            return speculative_generate(target, drafter, prompts, max_new_tokens=max_new,
                                        draft_length=draft_length, stop_token_ids=())  # the walk passes eos

        if args.budget_s is not None and time.perf_counter() - start > args.budget_s:
            print(f"{label} skipped: over the time budget | | | | | | | | | |", flush=True)
            continue
        run()  # compiles
        drafters = {name: successor_drafter(base, maps[name]) for name in names}
        for name in names[:1]:
            run(drafters[name], "fixed")  # compiles
            costs = run(drafters[name], adaptive_length()).step_costs  # compiles (and may measure the step costs)
            step_ms = dict(zip(costs.draft_lengths, [t * 1e3 for t in costs.seconds])) if costs else None
            measured.append((prompt_len, batch, max_new, step_ms))
        timed: dict[str, list] = {"greedy": []}
        for _ in range(args.repeats):
            timed["greedy"].append(run())
            for name in names:
                if args.budget_s is not None and time.perf_counter() - start > args.budget_s:
                    continue
                timed.setdefault((name, "fixed"), []).append(run(drafters[name], "fixed"))
                timed.setdefault((name, "adaptive"), []).append(run(drafters[name], adaptive_length()))
        greedy = timed["greedy"]
        g = float(np.median([r.decode_tokens_per_second for r in greedy]))
        for name in names:
            fixed, adaptive = timed.get((name, "fixed"), []), timed.get((name, "adaptive"), [])
            if len(adaptive) < args.repeats:
                print(f"{label} {name}: skipped, over the time budget | | | | | | | | | |", flush=True)
                continue
            f_runs = [r.decode_tokens_per_second for r in fixed]
            a_runs = [r.decode_tokens_per_second for r in adaptive]
            ratios = [a / f for a, f in zip(a_runs, f_runs)]
            f, a = float(np.median(f_runs)), float(np.median(a_runs))
            same = all(r.tokens == greedy[0].tokens for r in greedy + fixed + adaptive)
            row = dict(prompt=prompt_len, batch=batch, max_new=max_new, workload=name,
                       acceptance=draft_acceptance(fixed[0], K),
                       greedy_tps=g, fixed_tps=f, adaptive_tps=a, greedy_tps_runs=[r.decode_tokens_per_second
                       for r in greedy], fixed_tps_runs=f_runs, adaptive_tps_runs=a_runs,
                       fixed_tokens_per_verify=fixed[0].mean_acceptance_length,
                       adaptive_tokens_per_verify=adaptive[0].mean_acceptance_length,
                       adaptive_plain_tokens=int(np.sum(adaptive[0].plain_tokens)), same_as_greedy=same,
                       step_costs_ms=step_ms)
            rows.append(row)
            print(f"{label} {name} | {row['acceptance']:.2f} | {g:.1f} | {f:.1f} | {a:.1f} | "
                  f"{a / f:.2f} ({min(ratios):.2f}-{max(ratios):.2f}) | {a / g:.2f} | "
                  f"{fixed[0].mean_acceptance_length:.2f}, {adaptive[0].mean_acceptance_length:.2f} | "
                  f"{row['adaptive_plain_tokens']} | {'yes' if same else 'NO'} |", flush=True)
    for prompt_len, batch, max_new, step_ms in measured:  # what the policy chose by (adaptive_model.py --seconds)
        times = ", ".join(f"{n}: {t:.2f}" for n, t in step_ms.items()) if step_ms else "none"
        print(f"step costs at prompt {prompt_len}, batch {batch}, {max_new} new tokens (drafts: ms): {times}",
              flush=True)
    print(f"total {time.perf_counter() - start:.1f} s", flush=True)
    write_rows(args.json, args, rows)


if __name__ == "__main__":
    main()

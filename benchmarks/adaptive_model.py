"""The adaptive policy's choices under a step-cost model: decode time over greedy's, per workload and policy.

No model runs: each step's outcome is drawn from the workload (does the token at each output position agree with the
drafter's map, as in adaptive.py's dialled drafters) and its time taken from a cost table, while the decisions are
the package's own (`draft_policy.Policy.choose`, over `dflash_jax.adaptive`'s `weights` and `choose_length`; `History`,
`Probing`, `probe_gaps`, `first_length`), taken in the order `generate._Loop` takes them: the first step verifies
the length `first_length` picks; after each verify the history decides whether the next step drafts; a drafting
step's verify length comes from the drafts' confidences (here 1: an uninformative drafter, so its calibration is the
history) times the calibration; plain steps run until a probe is due (and the budget's rest can repay one). What
this leaves out: the step costs are fixed and known from the first step (a fresh process's predicted costs, were
the prediction exact), the context rows' buffer is flushed for free, and a sequence's budget is its only stop.

Workloads (as adaptive.py's, one agreement draw per output position): `acceptance f`, `mixed` (0.9 and 0.3 in
stretches of `--switch-every` tokens), `mixed batch` (sequence i at 0, 0.3, 0.6, 0.9, 1, 0.3, 0.9, 0). Policies:
`fixed` (every draft, every step), and `Adaptive(focus=f)` for each `--focus` (0: the batch's summed tokens per
second; 8: the default). Figures: greedy's time over the policy's (x greedy, the mean of `--seeds` draws).

Costs: `--seconds` (one table, `--lengths` its draft lengths) at each `--batch`, or `--setups`: the cost ratios of
the measured GPU setups (`SETUPS`: plain step 1), each at its own batch, at each `--max-new` budget.

    python benchmarks/adaptive_model.py --batch 8 --seconds 5.9 8.5 9.3 11.5
    python benchmarks/adaptive_model.py --setups all --max-new 32 128 --focus 8 --seeds 20   # short runs
    python benchmarks/adaptive_model.py --small      # a short check of the script
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.adaptive import Adaptive, History, Probing, first_length, probe_gaps, probe_payback
from dflash_jax.draft_policy import Policy, Settings, resolve_draft_length

sys.path.insert(0, __file__.rsplit("/", 1)[0])  # benchmarks/: adaptive.py's workload rates
from adaptive import BATCH_RATES, RATES  # noqa: E402
from timing import write_rows  # noqa: E402

LENGTHS = (0, 3, 7, 16)  # Adaptive's default lengths for a 16-draft drafter
# Step costs of measured setups over a plain step's, by name: (batch, draft lengths, seconds). Measured: the plain
# step and the longest length's step at zero acceptance (greedy's tokens/s over the fixed length's); the shorter
# lengths' are assumed (dense: between; MoE: a verify's cost linear in the distinct experts its rows route to,
# E (1 - (1 - k/E)^rows), through the two measured points). docs/benchmarks.md has the runs.
SETUPS = {
    "dense 8B, b1": (1, LENGTHS, (1.0, 1.25, 1.3, 1.40)),  # H100, 2k: 151.5 / 108.2 tok/s
    "dense 8B, b8": (8, LENGTHS, (1.0, 1.45, 1.55, 1.78)),  # H100, 2k: 1067.4 / 598.4
    "MoE hybrid 35B-A3B, b1": (1, LENGTHS, (1.0, 3.76, 4.29, 5.3)),  # H200, 8k: 0.19x greedy at 16 drafts
    "MoE hybrid 35B-A3B, b8": (8, LENGTHS, (1.0, 4.0, 6.0, 9.8)),  # H200, 8k: 17 x 8 tokens at 1527 tok/s, greedy 876
    "Nemotron-H 26 layers, b1": (1, (0, 3, 7), (1.0, 2.5, 3.57)),  # H100, 8k: 7 drafts at 0.28x greedy
    "Nemotron-H 26 layers, b8": (8, (0, 3, 7), (1.0, 6.0, 7.7)),  # H100, 8k: 0.13x
}


def workloads(batch: int, span: int, switch: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """`[batch, span]` bool by workload: whether the token at each output position agrees with the drafter's map
    (the draft after it is then accepted)."""
    draws = lambda rate: rng.uniform(size=(batch, span)) < rate  # noqa: E731
    out = {f"acceptance {f:g}": draws(f) for f in RATES}
    out["mixed"] = draws(np.where((np.arange(span) // switch) % 2 == 0, 0.9, 0.3)[None])
    if batch > 1:
        out["mixed batch"] = draws(np.asarray([BATCH_RATES[i % len(BATCH_RATES)] for i in range(batch)])[:, None])
    return out


class _UninformativeProposal:
    """What `Policy.choose` reads of a proposal: all K drafts proposed, each with confidence 1."""

    def __init__(self, batch: int, K: int):
        self.K = K
        self.num_tokens = jnp.full((batch,), K, jnp.int32)

    def predicted_acceptance(self) -> jax.Array:
        return jnp.ones(self.num_tokens.shape + (self.K,), jnp.float32)


@functools.partial(jax.jit, static_argnames=("policy", "drafted"))
def _choose(policy: Policy, settings: Settings, history: History, seconds, remaining, live, drafted: bool):
    """The loop's choice (`Policy.choose`): after a verify, whether the next step drafts (the history alone, with
    the margin); in a drafting step, its verify length (the proposal's confidences times the calibration)."""
    if drafted:
        return policy.choose(settings, _UninformativeProposal(live.shape[0], policy.lengths[-1]), history, seconds,
                             remaining, live, False)
    return policy.choose(settings, None, history, seconds, remaining, live, False,
                         plain_margin=history.margin(settings.margin, live))


def decode_seconds(agree: np.ndarray, budget: int, seconds: np.ndarray, policy: Adaptive | None,
                   lengths: tuple[int, ...] = LENGTHS) -> float:
    """Model seconds of a decode of `budget` tokens a sequence (the first from the prefill) under `policy` (None:
    the fixed length), `seconds` the step costs of `lengths` (the last the drafter's K)."""
    batch = agree.shape[0]
    K = lengths[-1]
    n_out = np.ones(batch, np.int64)
    history, probing = History.empty(batch), Probing.start()
    secs = jnp.asarray(seconds, jnp.float32)
    gaps = probe_gaps(secs, policy.probe_share, policy.early_probe_share) if policy else None
    policy = policy and dataclasses.replace(policy, draft_lengths=lengths)
    loop_policy, settings, _ = resolve_draft_length(policy or "fixed", K)  # what the compiled loop knows
    draft, step, total = True, 0, 0.0
    while (n_out < budget).any():
        live = n_out < budget
        remaining = jnp.asarray(budget - n_out, jnp.int32)
        if not draft:  # a plain step: one token each
            n_out = np.where(live, n_out + 1, n_out)
            total += seconds[0]
            probing = probing.after_plain()
            left = jnp.asarray(np.where(n_out < budget, budget - n_out, 0).max())
            draft = bool(probing.due(probe_payback(secs, lengths, left)))
            step += 1
            continue
        if policy is None:
            index = len(lengths) - 1
        elif step == 0:
            index = int(first_length(secs, lengths, jnp.asarray(budget - 1)))
        else:
            index = int(_choose(loop_policy, settings, history, secs, remaining, jnp.asarray(live), drafted=True))
        n = lengths[index]
        accepted = np.zeros(batch, np.int64)
        for b in range(batch):  # drafts accepted while the tokens before them agree
            while accepted[b] < n and agree[b, n_out[b] + accepted[b]]:
                accepted[b] += 1
        total += seconds[index]
        step += 1
        if policy is not None:
            history = history.update(jnp.full((batch,), n), jnp.asarray(accepted), jnp.ones((batch, K)),
                                     jnp.asarray(live), policy.memory)
        n_out = np.where(live, np.minimum(n_out + accepted + 1, budget), n_out)
        running = n_out < budget
        if policy is None or not running.any():
            continue
        plan = _choose(loop_policy, settings, history, secs, jnp.asarray(budget - n_out, jnp.int32),
                       jnp.asarray(running), drafted=False)
        draft = lengths[int(plan)] > 0
        probing = probing.after_verify(jnp.asarray(not draft), gaps, history.right(jnp.asarray(running)) >= 1)
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--seconds", type=float, nargs="+", default=[5.9, 8.5, 9.3, 11.5],
                        help="seconds (any unit) of a step verifying each of --lengths drafts")
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    parser.add_argument("--setups", nargs="+", default=None,
                        help=f"measured setups' costs instead of --seconds, --batch: 'all' or some of {list(SETUPS)}")
    parser.add_argument("--max-new", type=int, nargs="+", default=[384])
    parser.add_argument("--switch-every", type=int, default=128)
    parser.add_argument("--focus", type=float, nargs="+", default=[0.0, 2.0, 8.0, 64.0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--workloads", nargs="+", default=None)
    parser.add_argument("--small", action="store_true", help="a short check: 64 tokens, one seed")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.small:
        args.max_new, args.seeds, args.switch_every = [64], 1, 16
    if len(args.seconds) != len(args.lengths):
        parser.error(f"--seconds gives {len(args.seconds)} costs for {len(args.lengths)} --lengths")
    start = time.perf_counter()
    if args.setups is None:
        setups = {f"batch {b}": (b, tuple(args.lengths), tuple(args.seconds)) for b in args.batch}
        print(f"step costs {args.seconds} ({', '.join(map(str, args.lengths))} drafts), {args.seeds} seeds")
    else:
        setups = {name: SETUPS[name] for name in (SETUPS if args.setups == ["all"] else args.setups)}
        print(f"step costs over a plain step's (SETUPS), {args.seeds} seeds")
    policies = {"fixed": None, **{f"focus {f:g}": Adaptive(focus=f) for f in args.focus}}
    print("| setup | new tokens | workload | " + " | ".join(policies) + " |")
    print("|---|---:|---|" + "---:|" * len(policies), flush=True)
    rows = []
    for label, (batch, lengths, costs) in setups.items():
        seconds = np.asarray(costs)
        for budget in args.max_new:
            span = budget + lengths[-1] + 2
            names = list(workloads(batch, span, args.switch_every, np.random.default_rng(0)))
            for name in names if args.workloads is None else [n for n in names if n in args.workloads]:
                times: dict[str, list[float]] = {p: [] for p in policies}
                for seed in range(args.seeds):
                    agree = workloads(batch, span, args.switch_every, np.random.default_rng(seed))[name]
                    for key, policy in policies.items():
                        times[key].append(decode_seconds(agree, budget, seconds, policy, lengths))
                greedy = (budget - 1) * seconds[0]
                x = {key: greedy / float(np.mean(t)) for key, t in times.items()}
                rows.append(dict(setup=label, batch=batch, lengths=list(lengths), step_seconds=list(costs),
                                 max_new=budget, workload=name, x_greedy=x))
                print(f"| {label} | {budget} | {name} | " + " | ".join(f"{v:.3f}" for v in x.values()) + " |",
                      flush=True)
    print(f"total {time.perf_counter() - start:.1f} s")
    write_rows(args.json, args, rows)


if __name__ == "__main__":
    main()

"""Tokens/s of plain greedy decoding vs speculative decoding on a Qwen3-8B-shaped target: the two bounds.

Target: Qwen3-8B shapes (36 layers, hidden 4096, 32/8 heads x 128, intermediate 12288, vocab 151936, untied),
random bf16 weights drawn on the device, then rebuilt by `successor_target` so that its greedy next token is a
fixed successor map of the last token (every decoder layer still runs at full size: the timing is the
target's). Drafters, block 16, random bf16 weights at z-lab Qwen3-8B-DFlash-b16 shapes (5 layers):

- `dspark-b16, right map`: a DSpark drafter whose Markov head walks the target's map: every one of its 16 drafts
  is accepted, 17 tokens per verify step: the upper bound of the speedup at this drafter cost.
- `dspark-b16, wrong map`: the same drafter walking another map: every draft rejected, 1 token per step:
  the lower bound at the same cost.
- `dflash-b16, random`: a z-lab-shaped DFlash drafter with random weights (acceptance ~0): the lower bound at
  the cost of the DFlash drafter people deploy.

Each configuration runs once to compile, then `--repeats` times timed; the figure is the median decode
tokens/s (`GenerationResult.decode_tokens_per_second`: tokens after the first, over the decode loop's wall
time, which ends with the tokens copied to the host). Speculative outputs are checked against greedy's.

    XLA_PYTHON_CLIENT_PREALLOCATE=false python3 benchmarks/spec_decode.py --batch 1 4 --json out.json
    python benchmarks/spec_decode.py --small      # the same on tiny shapes, for a CPU check of the script
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import jax
import numpy as np
from timing import write_rows

from dflash_jax import Adaptive
from dflash_jax.config import parse_config
from dflash_jax.generate import greedy_generate, speculative_generate
from dflash_jax.testing import preset_dict, random_drafter, random_qwen3, successor_drafter, successor_target

QWEN3_8B = {
    "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "rope_theta": 1000000.0, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
}
SMALL = {**QWEN3_8B, "vocab_size": 1024, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}  # 2 layers: compiling 36 takes minutes


def drafter_configs(target_config: dict, small: bool = False) -> dict[str, dict]:
    """DFlash-b16 (z-lab Qwen3-8B shapes) and the same backbone as a DSpark drafter with a rank-256 Markov head;
    `small`: one layer reading `target_config`'s first two (SMALL's)."""
    dflash = copy.deepcopy(preset_dict("zlab-qwen3-8b-dflash-b16"))
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "head_dim"):
        dflash[key] = target_config[key]
    if small:
        dflash |= {"num_hidden_layers": 1, "num_target_layers": target_config["num_hidden_layers"]}
        dflash["dflash_config"]["target_layer_ids"] = [0, 1]
    dflash["dflash_config"]["mask_token_id"] = target_config["vocab_size"] - 1
    dspark = {**copy.deepcopy(dflash), "architectures": ["DSparkDraftModel"], "markov_rank": 256,
              "markov_head_type": "vanilla"}
    return {"dflash": dflash, "dspark": dspark}


def timed(run, repeats: int):
    """(median decode tokens/s, last result) over `repeats` runs after one compiling run."""
    run()
    results = [run() for _ in range(repeats)]
    return statistics.median(r.decode_tokens_per_second for r in results), results[-1]


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The options this script shares with adaptive.py: the successor target's scale, the time budget, the tiny
    form and the JSON output."""
    parser.add_argument("--layer-scale", type=float, default=0.2, help="successor_target's scale on layer outputs")
    parser.add_argument("--budget-s", type=float, default=None, help="skip what would start after this many seconds")
    parser.add_argument("--small", action="store_true", help="tiny shapes (CPU check of the script)")
    parser.add_argument("--json", default=None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-new", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    add_run_arguments(parser)
    args = parser.parse_args()
    start = time.perf_counter()
    config = SMALL if args.small else QWEN3_8B
    V = config["vocab_size"]
    rng = np.random.default_rng(0)
    successor, other = rng.permutation(V), rng.permutation(V)

    target = successor_target(random_qwen3(config, seed=0), successor, layer_scale=args.layer_scale)
    drafters = {}
    for family, raw in drafter_configs(config, args.small).items():
        drafter = random_drafter(parse_config(raw), seed=1)
        drafters[family] = drafter.attach(embed=target.embed, lm_head=target.lm_head)
    runs = {
        "dspark-b16, right map": successor_drafter(drafters["dspark"], successor),
        "dspark-b16, wrong map": successor_drafter(drafters["dspark"], other),
        "dflash-b16, random": drafters["dflash"],
    }
    jax.block_until_ready((target, runs))
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; weights made in "
          f"{time.perf_counter() - start:.1f} s; prompt {args.prompt_len}, {args.max_new} new tokens", flush=True)
    print("| batch | decoding | tokens/s | speedup | mean acceptance | same tokens as greedy |", flush=True)
    print("|---:|---|---:|---:|---:|---|", flush=True)

    rows = []
    for batch in args.batch:
        prompts = rng.integers(0, V, (batch, args.prompt_len)).tolist()
        base, greedy = timed(lambda: greedy_generate(target, prompts, max_new_tokens=args.max_new,  # noqa: B023
                                                     stop_token_ids=()), args.repeats)  # (run here; past any eos)
        follows = np.mean([t[j + 1] == successor[t[j]] for t in greedy.tokens for j in range(len(t) - 1)])
        rows.append(dict(batch=batch, name="greedy", tokens_per_s=base, follows_map=float(follows)))
        print(f"| {batch} | greedy (target follows its map {follows:.0%}) | {base:.1f} | 1.00 | | |", flush=True)
        for name, drafter in runs.items():
            if args.budget_s is not None and time.perf_counter() - start > args.budget_s:
                print(f"| {batch} | {name} | skipped: over the time budget | | | |", flush=True)
                continue
            policy = Adaptive()  # predicts the step costs (a long compiling run measures them, kept for the repeats)
            speed, result = timed(
                lambda: speculative_generate(target, drafter, prompts, max_new_tokens=args.max_new,  # noqa: B023
                                             stop_token_ids=(), draft_length=policy),  # noqa: B023
                args.repeats,
            )  # the lambda runs here, inside the loop
            same = result.tokens == greedy.tokens
            rows.append(dict(batch=batch, name=name, tokens_per_s=speed, speedup=speed / base,
                             mean_acceptance=result.mean_acceptance_length, same_tokens=same))
            print(f"| {batch} | {name} | {speed:.1f} | {speed / base:.2f} | {result.mean_acceptance_length:.2f} "
                  f"| {'yes' if same else 'NO'} |", flush=True)
    print(f"total {time.perf_counter() - start:.1f} s", flush=True)
    write_rows(args.json, args, rows)


if __name__ == "__main__":
    main()

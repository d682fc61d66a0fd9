"""Long contexts on one GPU: the drafting step against the cached context, and speculative decoding on long prompts.

Part `propose`: one drafting step (`dflash_jax.propose`, 16 new context rows, back to back with the cache
donated, mean of `--iters` steps after 3 warm-up steps) with `ctx` context rows already cached, at
Qwen3-8B-DFlash-b16, Qwen3.6-35B-A3B tf5 (5 sliding layers of window 4096 + 1 full) and Muse-Glimmer DFlash2
(5 sliding, 2048) shapes, random bf16 weights. Each row has its floor: the bytes the step must read (drafter
weights, the LM head it applies to the draft rows, and the cache rows its layers attend to: the window's ring on
sliding layers, all `ctx` rows on full ones) at the read rate measured in the same run (`timing.read_rate`: a
`jnp.sum` over 4 GiB).

Part `decode`: `speculative_generate` and `greedy_generate` on a Qwen3-8B-shaped target (YaRN to 131072
positions, as Qwen3 documents for long contexts) made by `successor_target` (so acceptance can be dialled), with
the full-acceptance and zero-acceptance drafters of `benchmarks/spec_decode.py`, each at the fixed draft length
and with the adaptive policy (`draft_length="adaptive"`: as many drafts per step as pay, plain target steps
while drafts are rarely accepted): prefill seconds, decode tokens/s, peak device memory. `--drafter-weights`
adds the same runs with the drafters' layer weights packed (`weight_forms.py`: "nvfp4", "nvfp4-xla", "fp8";
their heads stay bf16, so the maps are still walked), named "<run>, <form>". Floors: greedy decoding
reads the weights and the KV cache each token, at the same read rate; a prefill does `2 x params x tokens` plus
causal attention `2 x 2 x layers x heads x d_h x P^2 / 2` FLOPs, compared with the bf16 matmul rate measured in
the same run (an 8192^3 GEMM).

`--json FILE` writes the rows (`timing.write_rows`), each with the rates its floors used (`read_rate` in bytes/s,
`matmul_rate` in FLOP/s); `benchmarks/plot.py` draws the propose rows.

    XLA_PYTHON_CLIENT_PREALLOCATE=false python3 benchmarks/long_context.py --json long_context.json
    python benchmarks/long_context.py --small     # tiny shapes, a CPU check of the script (tests run it)
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import itertools
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])  # benchmarks/: share spec_decode's shapes and drafters

from spec_decode import QWEN3_8B, SMALL, drafter_configs  # noqa: E402
from timing import matmul_rate, print_row, read_rate, write_rows  # noqa: E402
from weight_forms import WEIGHTS, packed_backend, quantized  # noqa: E402

from dflash_jax import Adaptive, Calibration  # noqa: E402
from dflash_jax.config import parse_config  # noqa: E402
from dflash_jax.drafting import init_cache, propose  # noqa: E402
from dflash_jax.generate import greedy_generate, speculative_generate  # noqa: E402
from dflash_jax.model import attention_rules  # noqa: E402
from dflash_jax.testing import (  # noqa: E402
    full_plan,
    preset_dict,
    random_drafter,
    random_qwen3,
    successor_drafter,
    successor_target,
)

DRAFTERS = {
    "Qwen3-8B-DFlash-b16": "zlab-qwen3-8b-dflash-b16",
    "Qwen3.6-35B-A3B tf5": "zlab-qwen3.6-35b-a3b-dflash-tf5",
    "Muse-Glimmer DFlash2": "muse-glimmer-dflash2",
}
LONG_QWEN3_8B = {**QWEN3_8B, "max_position_embeddings": 131072,
                 "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
NEW_ROWS = 16
DECODE_RUNS = ("greedy", "full acceptance", "zero acceptance", "full acceptance + adaptive",
               "zero acceptance + adaptive")


def nbytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def propose_rows(name: str, preset: str, contexts, batches, iters: int, rate: float, impls, small: bool) -> list[dict]:
    """One row per batch, context and impl: ms per drafting step beside its floor at the read rate `rate` (bytes/s)."""
    raw = copy.deepcopy(preset_dict(preset))
    if small:  # tiny: the preset's two kinds of layer (its last two) at small widths and vocabulary
        raw |= dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16, num_hidden_layers=2, vocab_size=1024)
        raw["dflash_config"]["mask_token_id"] = raw["vocab_size"] - 1
        if raw.get("layer_types"):
            raw["layer_types"] = raw["layer_types"][-2:]
        if raw.get("sliding_window"):
            raw["sliding_window"] = 32
    drafter = random_drafter(parse_config(raw), seed=1)
    c = drafter.config
    rules = attention_rules(c)
    weights = nbytes(drafter.params) + drafter.output_head.nbytes  # every weight once, the LM head for the drafts
    windowed = sum(r.window is not None for r in rules)
    kinds = f"{windowed} sliding + {len(rules) - windowed} full"
    rows = []
    for batch in batches:
        for ctx in contexts:
            for impl in impls:
                cache = init_cache(drafter, batch, ctx + NEW_ROWS * (iters + 10))
                # as if ctx rows had been appended; committed where the cache is, as `propose` returns it (an
                # uncommitted array would make the second step compile another program)
                lengths = jax.device_put(jnp.full((batch,), ctx, jnp.int32), cache.lengths.sharding)
                cache = dataclasses.replace(cache, lengths=lengths)
                feats = jnp.ones((batch, NEW_ROWS, len(c.target_layer_ids) * c.hidden_size), jnp.bfloat16)
                num_new, anchors = jnp.full((batch,), NEW_ROWS, jnp.int32), jnp.zeros((batch,), jnp.int32)
                for _ in range(3):  # compile, warm up
                    proposal, cache = propose(drafter, cache, feats, num_new, anchors, impl=impl)
                jax.block_until_ready(proposal)
                start = time.perf_counter()
                for _ in range(iters):
                    proposal, cache = propose(drafter, cache, feats, num_new, anchors, impl=impl)
                jax.block_until_ready(proposal)
                ms = (time.perf_counter() - start) / iters * 1e3
                row_bytes = 2 * c.num_key_value_heads * c.head_dim * 2 * batch  # K and V, bf16, per attended row
                attended = sum(min(ctx, k.shape[2]) for k in cache.keys)
                floor = (weights + row_bytes * attended) / rate * 1e3
                rows.append(dict(part="propose", drafter=name, batch=batch, context=ctx, impl=impl, ms=ms,
                                 floor_ms=floor, read_rate=rate, cache_gb=nbytes(cache) / 1e9))
                print(f"| {name} ({kinds}) | {batch} | {ctx} | {impl} | {ms:.3f} | {floor:.3f} | {ms / floor:.2f} "
                      f"| {nbytes(cache) / 1e9:.2f} |", flush=True)
                del cache
    return rows


def peak_gb() -> float:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use", 0) / 1e9


def decode_rows(prompt_lens, batches, max_new: int, repeats: int, rate: float, flops: float, small: bool,
                chunk: int, wanted, forms=("bf16",)) -> list[dict]:
    """One row per prompt, batch and run: prefill (beside the GEMM rate `flops`), decode tokens/s (beside greedy's
    floor at the read rate `rate`, bytes/s), x greedy, acceptance."""
    config = {**SMALL, "max_position_embeddings": 4096} if small else LONG_QWEN3_8B
    V = config["vocab_size"]
    rng = np.random.default_rng(0)
    successor, other = rng.permutation(V), rng.permutation(V)
    target = successor_target(random_qwen3(config, seed=0), successor, layer_scale=0.2)
    raw = drafter_configs(config, small)["dspark"]
    dspark_config = parse_config(raw)
    dspark = random_drafter(dspark_config, seed=1).attach(embed=target.embed, lm_head=target.lm_head)
    walking = {"full acceptance": successor_drafter(dspark, successor),
               "zero acceptance": successor_drafter(dspark, other)}
    plan = full_plan(dspark_config)
    # each form of the drafters' linear weights (`weight_forms`): runs named "<run>, <form>" beyond bf16
    drafters = {(name, form): quantized(d, plan, form) for form in forms for name, d in walking.items()}
    # one adaptive policy: it measures each setup's step costs once (--small: in calls of 1 and 2 steps, so that its
    # 40 tokens finish the measurement) and keeps them for the repeats
    calibration = Calibration(steps=1, repeats=1) if small else Calibration()
    policies = {"": "fixed", " + adaptive": Adaptive(calibration=calibration)}
    c = target.config
    params = sum(x.size for x in jax.tree.leaves(target.params)) - c.vocab_size * c.hidden_size  # embedding: a gather
    weight_bytes = nbytes(target.params) - c.vocab_size * c.hidden_size * 2
    kv_row = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 2  # K and V bytes per position
    rows = []
    for P in prompt_lens:
        for batch in batches:
            if batch > 1 and P > min(prompt_lens):
                continue  # batch > 1 at the shortest prompt only
            prompts = rng.integers(0, V, (batch, P)).tolist()
            beyond = P + max_new > c.max_position_embeddings  # a 131072-token prompt fills YaRN's whole range
            runs = {"greedy": ("bf16", lambda p=prompts, b=beyond: greedy_generate(  # name: (drafter form, run)
                target, p, max_new_tokens=max_new, prefill_chunk=chunk, beyond_max_positions=b, stop_token_ids=()))}
            for ((name, form), d), (suffix, policy) in itertools.product(drafters.items(), policies.items()):
                if name + suffix not in wanted:
                    continue
                named = name + suffix + ("" if form == "bf16" else f", {form}")  # e.g. "full acceptance, nvfp4"
                runs[named] = form, lambda d=d, p=prompts, b=beyond, po=policy: speculative_generate(
                    target, d, p, max_new_tokens=max_new, prefill_chunk=chunk, beyond_max_positions=b,
                    draft_length=po, stop_token_ids=())  # random weights: the budget, past any eos id
            base, greedy_tokens = None, None
            for name, (form, run) in runs.items():
                with packed_backend(form):
                    if not small:  # --small checks the script, not the speed: its one run includes compiling
                        run()
                    results = [run() for _ in range(repeats)]
                tps = statistics.median(r.decode_tokens_per_second for r in results)
                prefill = min(r.prefill_seconds for r in results)
                tokens = results[-1].tokens
                base, greedy_tokens = (tps, tokens) if name == "greedy" else (base, greedy_tokens)
                attention_flops = 2 * 2 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * P * P / 2
                prefill_flops = batch * (2 * params * P + attention_flops)
                mean_len = P + max_new / 2
                floor_tps = batch / ((weight_bytes + batch * kv_row * mean_len) / rate)
                row = dict(part="decode", run=name, drafter_weights=form, prompt=P, batch=batch,
                           prefill_s=prefill,
                           prefill_mfu=prefill_flops / prefill / flops, tokens_per_s=tps, speedup=tps / base,
                           greedy_floor_tps=floor_tps, read_rate=rate, matmul_rate=flops,
                           same_as_greedy=tokens == greedy_tokens, peak_gb=peak_gb(),
                           mean_acceptance=results[-1].mean_acceptance_length,
                           plain_tokens=np.sum(results[-1].plain_tokens).item())
                rows.append(row)
                print_row(P, batch, name, f"{prefill:.2f}", f"{row['prefill_mfu']:.0%}", f"{tps:.1f}",
                          f"{tps / base:.2f}", f"{floor_tps:.1f}", f"{row['mean_acceptance']:.2f}",
                          row["plain_tokens"], "yes" if row["same_as_greedy"] else "NO", f"{row['peak_gb']:.1f}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", default=["propose", "decode"])
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192, 32768, 131072])
    parser.add_argument("--propose-batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--impls", nargs="+", default=["auto"], help="attention implementations to compare")
    parser.add_argument("--drafters", nargs="+", default=list(DRAFTERS))
    parser.add_argument("--prompts", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--decode-batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--max-new", type=int, default=256)
    parser.add_argument("--runs", nargs="+", default=list(DECODE_RUNS), choices=DECODE_RUNS,
                        help="decode runs (greedy always runs: the others are compared with it)")
    parser.add_argument("--drafter-weights", nargs="+", default=["bf16"], choices=WEIGHTS,
                        help="forms of the decode drafters' linear weights (weight_forms.py; runs beyond bf16 are "
                        "named '<run>, <form>')")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--chunk", type=int, default=2048, help="prefill chunk")
    parser.add_argument("--small", action="store_true", help="tiny shapes (CPU check of the script)")
    parser.add_argument("--json", default=None, help="write the rows here (for benchmarks/plot.py)")
    args = parser.parse_args()
    if args.small:
        args.contexts, args.prompts, args.propose_batch, args.decode_batch = [200], [200], [2], [1]
        args.drafters = ["Qwen3.6-35B-A3B tf5"]  # both kinds of layer
        args.iters, args.max_new, args.chunk = 2, 40, 64  # 40 tokens: the step costs measured at zero acceptance
    start = time.perf_counter()
    rate = read_rate(0.0625 if args.small else 4)
    flops = matmul_rate(512 if args.small else 8192)
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; read rate (jnp.sum) {rate / 1e12:.2f} TB/s, bf16 "
          f"matmul {flops / 1e12:.0f} TFLOP/s", flush=True)
    rows = []
    if "propose" in args.parts:
        print("| drafter | batch | context | impl | ms | read floor ms | x read floor | cache GB |\n"
              "|---|---:|---:|---|---:|---:|---:|---:|", flush=True)
        for name in args.drafters:
            rows += propose_rows(name, DRAFTERS[name], args.contexts, args.propose_batch, args.iters, rate,
                                 args.impls, args.small)
    if "decode" in args.parts:
        print("| prompt | batch | run | prefill s | prefill MFU | tokens/s | x greedy | greedy read floor tok/s | "
              "acceptance | plain tokens | same as greedy | peak GB |\n"
              "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---:|",
              flush=True)
        rows += decode_rows(args.prompts, args.decode_batch, args.max_new, args.repeats, rate, flops,
                            args.small, args.chunk, args.runs, args.drafter_weights)
    print(f"total {time.perf_counter() - start:.1f} s", flush=True)
    write_rows(args.json, args, rows)


if __name__ == "__main__":
    main()

"""Speculative decoding with a hybrid target on one GPU: Qwen3.5/3.6 (Gated DeltaNet + gated attention, dense or
MoE) and NVIDIA Nemotron-H (Mamba-2 + MoE + attention).

Targets, random bf16 weights at the real shapes, rebuilt (`successor_qwen3_5`, `successor_nemotron_h`) so that
their greedy next token follows a fixed map of the last token (every layer still runs at full size):

- `35B-A3B`: Qwen3.5/3.6-35B-A3B (40 layers, 30 Gated DeltaNet + 10 gated attention, hidden 2048, 256 experts,
  8 per token, a gated shared expert; about 70 GB), with z-lab Qwen3.6-35B-A3B-DFlash (tf5) drafter shapes;
- `27B`: the dense hybrid Qwen3.5/3.6-27B (64 layers, hidden 5120; about 54 GB), with RadixArk Qwen3.8-27B-DSpark
  drafter shapes;
- `nemotron-3.5-lightning`: NVIDIA-Nemotron-3.5-Lightning-30B-A3B (52 blocks: 23 Mamba-2, 23 MoE with 128 relu^2
  experts, 6 per token, and a shared expert, 6 attention; hidden 2688; about 62 GB), with the shapes of NVIDIA's
  Nemotron 3.5 Lightning DSpark drafter (its BF16 form).

`--layers N` keeps the first N layers (blocks) of the target: the per-layer costs and the floor ratio at a size
that fits the GPU at hand (the tables say so).

Runs: `greedy` (the target alone), `full acceptance` (a DSpark drafter of the pairing's backbone whose Markov
head walks the target's map: every draft accepted) and `zero acceptance` (walking another map: none), every draft
verified, or under the adaptive draft-length policy (`--runs "zero acceptance + adaptive"`). Reported:
prefill seconds, decode tokens/s, the speedup over greedy, peak device memory; every speculative output is
checked against greedy's. Floors, from the bytes a greedy step must read at the read rate of a `jnp.sum` over
4 GiB measured in the same run: the non-expert weights, the routed experts (distinct experts of the batch's
tokens under uniform routing, which random router weights give: `E (1 - (1 - k/E)^batch)` a layer), the KV rows
of the attention layers and the recurrent states (delta-net or Mamba-2 conv and SSM states, read and written).
Part `step` times, at batch 1 and the shortest prompt, a greedy step, a 17-row verify, and `commit` alone:
rollback against verify.

    XLA_PYTHON_CLIENT_PREALLOCATE=false python3 benchmarks/hybrid_decode.py --targets 35B-A3B --json out.json
    python benchmarks/hybrid_decode.py --small      # tiny shapes, a CPU check of the script (tests run it)

`--profile DIR` runs only the part `step` programs, each once under `jax.profiler.trace` (traces under DIR), and
reports from the trace (`gpu_trace.py`): kernels a step, GPU busy time against the step's wall time, the top
kernels, the time of each model scope (embed, gated_attention, delta_net/{inputs,rule,out}, moe/{router,routed,
shared}, lm_head, commit). `--moe-few-rows gather|reduce|slots` overrides the device's tuning entry for the MoE
block's decode and verify rows.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])  # benchmarks/: the timing loop, the rates, the trace reader

import gpu_trace  # noqa: E402
from timing import call_seconds, print_row, read_rate  # noqa: E402

from dflash_jax import Adaptive  # noqa: E402
from dflash_jax.config import parse_config  # noqa: E402
from dflash_jax.generate import greedy_generate, speculative_generate  # noqa: E402
from dflash_jax.platform import process_platform  # noqa: E402
from dflash_jax.target import moe, qwen3_5  # noqa: E402
from dflash_jax.target.nemotron_h_config import parse_nemotron_h_config  # noqa: E402
from dflash_jax.testing import (  # noqa: E402
    preset_dict,
    random_drafter,
    random_nemotron_h,
    random_qwen3_5,
    successor_drafter,
    successor_nemotron_h,
    successor_qwen3_5,
)

_HYBRID = {"model_type": "qwen3_5_text", "architectures": ["Qwen3_5ForCausalLM"], "vocab_size": 248320,
           "head_dim": 256, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
           "linear_num_key_heads": 16, "full_attention_interval": 4, "max_position_embeddings": 262144,
           "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attn_output_gate": True,
           "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                               "mrope_section": [11, 11, 10], "mrope_interleaved": True}}
TARGETS = {
    "35B-A3B": ({**_HYBRID, "model_type": "qwen3_5_moe_text", "architectures": ["Qwen3_5MoeForCausalLM"],
                 "hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16, "num_key_value_heads": 2,
                 "linear_num_value_heads": 32, "num_experts": 256, "num_experts_per_tok": 8,
                 "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512},
                "zlab-qwen3.6-35b-a3b-dflash-tf5"),
    "27B": ({**_HYBRID, "hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 64,
             "num_attention_heads": 24, "num_key_value_heads": 4, "linear_num_value_heads": 48},
            "radixark-qwen3.8-27b-dspark"),
    # the released config.json's fields that shape the model (tests/data/nemotron_h holds all of it)
    "nemotron-3.5-lightning": ({"model_type": "nemotron_h", "architectures": ["NemotronHForCausalLM"],
                                "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
                                "num_hidden_layers": 52, "vocab_size": 131072, "hidden_size": 2688,
                                "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128,
                                "mamba_num_heads": 64, "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8,
                                "conv_kernel": 4, "expand": 2, "chunk_size": 128, "n_routed_experts": 128,
                                "num_experts_per_tok": 6, "moe_intermediate_size": 1856,
                                "moe_shared_expert_intermediate_size": 3712, "routed_scaling_factor": 2.5,
                                "intermediate_size": 1856, "max_position_embeddings": 1048576,
                                "tie_word_embeddings": False, "mamba_ssm_cache_dtype": "float32"},
                               "nvidia-nemotron-3.5-lightning-dspark-nvfp4"),
}
NEMOTRON_SMALL = {"hybrid_override_pattern": "ME*M", "num_hidden_layers": 4, "vocab_size": 256, "hidden_size": 64,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "mamba_num_heads": 8,
                  "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": 2, "chunk_size": 16, "n_routed_experts": 8,
                  "num_experts_per_tok": 2, "moe_intermediate_size": 32, "moe_shared_expert_intermediate_size": 32,
                  "max_position_embeddings": 4096}
SMALL = {"hidden_size": 64, "num_hidden_layers": 2, "full_attention_interval": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
         "linear_num_key_heads": 2, "linear_num_value_heads": 4, "vocab_size": 256, "intermediate_size": 128,
         "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
         "max_position_embeddings": 4096}


def peak_gb() -> float:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use", 0) / 1e9


def nbytes(tree) -> int:
    """Bytes of every array (or `ShapeDtypeStruct`) in `tree`."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def is_nemotron(raw: dict) -> bool:
    return raw["model_type"] == "nemotron_h"


def target_config(name: str, small: bool, layers: int | None) -> dict:
    """The target's config: `small` for tiny shapes, `layers` to keep only its first layers."""
    raw = copy.deepcopy(TARGETS[name][0])
    if small:
        raw |= NEMOTRON_SMALL if is_nemotron(raw) else {
            k: v for k, v in SMALL.items() if "expert" not in k or "num_experts" in raw}  # MoE sizes: MoE only
    if layers is not None:
        raw["num_hidden_layers"] = layers
        if is_nemotron(raw):
            raw["hybrid_override_pattern"] = raw["hybrid_override_pattern"][:layers]
    return raw


def make_target(raw: dict, successor, small: bool):
    """Random weights, rebuilt to follow `successor`. --small: one compiled program draws every weight (eager,
    each shape's ops compile apart: seconds on a CPU)."""
    if is_nemotron(raw):
        draw = functools.partial(random_nemotron_h, parse_nemotron_h_config(raw, source="hybrid_decode"), seed=0)
        rebuild = successor_nemotron_h
    else:
        draw, rebuild = functools.partial(random_qwen3_5, raw, seed=0), successor_qwen3_5
    return rebuild((jax.jit(draw) if small else draw)(), successor, layer_scale=0.2)


def drafters(name: str, raw_target: dict, target, successor, other, small: bool) -> dict:
    """The pairing's drafter backbone as a DSpark drafter (its own Markov head, else one of rank 256) walking the
    target's map, and walking another map."""
    raw = copy.deepcopy(preset_dict(TARGETS[name][1]))
    raw.pop("quantization_config", None)  # the BF16 form of a quantized preset
    raw |= {k: raw_target[k] for k in ("vocab_size", "hidden_size")}
    raw["num_target_layers"] = raw_target["num_hidden_layers"]
    if small:
        raw |= dict(intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    num_hidden_layers=1, layer_types=None, sliding_window=None, use_sliding_window=False)
    ids = sorted({1, raw_target["num_hidden_layers"] - 2})  # --small: 2 layers, [0, 1]
    for block in ("dflash_config", "dspark_config"):
        if raw.get(block):
            raw[block] = {**raw[block], "mask_token_id": raw_target["vocab_size"] - 1, "target_layer_ids": ids}
    raw |= {"mask_token_id": raw_target["vocab_size"] - 1, "target_layer_ids": ids}
    if "eagle_aux_hidden_state_layer_ids" in raw:
        raw["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in ids]
    if "markov_rank" not in raw:  # a DFlash backbone: made a DSpark drafter
        raw |= {"architectures": ["DSparkDraftModel"], "markov_rank": 256, "markov_head_type": "vanilla"}
    draw = functools.partial(random_drafter, parse_config(raw), seed=1)  # --small: compiled as one program
    dspark = (jax.jit(draw) if small else draw)().attach(embed=target.embed, lm_head=target.lm_head)
    return {"full acceptance": successor_drafter(dspark, successor),
            "zero acceptance": successor_drafter(dspark, other)}


def greedy_floor(target, batch: int, context: int, rate: float) -> float:
    """Seconds a greedy step of `batch` sequences must take: the bytes it reads at `rate`. Weights: all but the
    embedding (a gather), the routed experts only as the distinct experts the batch's tokens route to; the K/V
    rows of `context` positions; each recurrent state (every cache array but K/V) read and written."""
    c = target.config
    weights = nbytes(target.params) - nbytes(target.embed)
    mixer = "mixer" if "mixer" in target.params["layers"][0] else "mlp"
    experts = sum(nbytes(layer[mixer]["experts"]) for layer in target.params["layers"]
                  if "experts" in layer.get(mixer, {}))
    E = getattr(c, "n_routed_experts", None) or getattr(c, "num_experts", 0)
    k = getattr(c, "num_experts_per_tok", 0)
    routed = experts * (1 - (1 - k / E) ** batch) if E else 0.0
    cache = jax.eval_shape(lambda: target.init_cache(batch, context))  # shapes only: nothing allocated
    kv = nbytes((cache.k, cache.v))
    states = nbytes(cache) - kv
    kv *= context / cache.k[0].shape[2]  # the rows written so far, not the capacity
    return (weights - experts + routed + kv + 2 * states) / rate


def prefilled(target, P: int):
    """A batch-1 cache after a `P`-token prefill (room for 64 more), its lengths and the feature layers."""
    layer_ids = (1, target.num_layers - 2)
    cache = target.init_cache(1, P + 64)
    lengths = jnp.array([P], jnp.int32)
    return target.prefill(jnp.ones((1, P), jnp.int32), cache, lengths, layer_ids=layer_ids).cache, lengths, layer_ids


def stepping(rows: int, iters: int, lengths, layer_ids):
    """`iters` forwards of `rows` rows with their commits in one compiled loop, `(target, cache) -> cache` (the
    cache carried and donated, as in the decode loop; no host dispatch per step). Each step's tokens are the
    argmax of the last step's logits, so that the LM head runs as in decoding (unused logits would be dropped)."""

    def loop(t, c):  # the target is an argument: closed over, its weights would become constants
        def body(i, carry):
            c, tokens = carry
            out = t(tokens, c, lengths, layer_ids=layer_ids)
            return t.commit(out.cache, (i % rows + 1)[None]), jnp.argmax(out.logits, axis=-1).astype(jnp.int32)
        return jax.lax.fori_loop(0, iters, body, (c, jnp.ones((1, rows), jnp.int32)))[0]

    return jax.jit(loop, donate_argnums=1)


STEPS = (("greedy step", 1), ("verify 17 + commit", 17))


def step_rows(target, P: int, iters: int) -> dict:
    """Milliseconds a step, at batch 1 after a `P`-token prefill, each inside one compiled loop of `iters` steps
    (`stepping`): a greedy step (one row, committed, its argmax the next token), a 17-row verify with its commit,
    and `commit` alone (picking a row's state out of one pending cache, the rollback)."""
    cache, lengths, layer_ids = prefilled(target, P)
    copy = jax.tree.map(jnp.copy, cache)  # a target may donate the cache it is called with
    pending = target(jnp.ones((1, 17), jnp.int32), copy, lengths, layer_ids=layer_ids).cache

    @jax.jit
    def commits(t, p):  # each iteration commits another row; a sum of the states keeps every commit alive
        def body(i, total):
            committed = t.commit(p, (i % 18)[None])
            return total + sum(s.reshape(-1)[0].astype(jnp.float32) for s in jax.tree.leaves(committed))
        return jax.lax.fori_loop(0, iters, body, jnp.float32(0))

    ms = {}
    for name, rows in STEPS:
        run = stepping(rows, iters, lengths, layer_ids)
        cache = run(target, cache)  # compile
        begin = time.perf_counter()
        cache = jax.block_until_ready(run(target, cache))
        ms[name] = (time.perf_counter() - begin) / iters * 1e3
    ms["commit"] = statistics.median(call_seconds(lambda: commits(target, pending), 3)) / iters * 1e3
    return ms


def profile_rows(name: str, target, P: int, iters: int, directory: str) -> list[dict]:
    """Each of `STEPS` at batch 1 after a `P`-token prefill, `iters` of them in one compiled loop (`stepping`),
    run once under `jax.profiler.trace` into `directory/<target>-<rows>`: `gpu_trace.summarize`'s figures a step
    (kernels, GPU busy against wall, the top kernels, the time of each model scope), printed and returned."""
    cache, lengths, layer_ids = prefilled(target, P)
    rows_out = []
    for step, rows in STEPS:
        compiled = stepping(rows, iters, lengths, layer_ids).lower(target, cache).compile()
        cache = jax.block_until_ready(compiled(target, cache))  # warm
        summary, cache = gpu_trace.traced(lambda: compiled(target, cache), f"{directory}/{name}-{rows}", iters,  # noqa: B023
                                          compiled.as_text())
        gpu_trace.print_summary(f"{name}, {step}, {P} cached", summary)
        rows_out.append(dict(part="profile", target=name, prompt=P, step=step, **summary))
    return rows_out


def decode_rows(name: str, target, runs: dict, rng, rate: float, args, start: float) -> list[dict]:
    """Greedy and each speculative run at each prompt length (batch > 1 at the shortest only), until
    `args.budget_s` seconds after `start`."""
    print("| target | prompt | batch | run | prefill s | tokens/s | x greedy | greedy floor tok/s | acceptance "
          "| same as greedy | peak GB |\n|---|---:|---:|---|---:|---:|---:|---:|---:|---|---:|", flush=True)
    rows = []
    for P in args.prompts:
        for batch in args.batch:
            if batch > 1 and P > min(args.prompts):
                continue
            if args.budget_s is not None and time.perf_counter() - start > args.budget_s:
                print(f"| {name} | {P} | {batch} | skipped: past the time budget | | | | | | | |", flush=True)
                continue
            prompts = rng.integers(0, target.vocab_size, (batch, P)).tolist()
            greedy, policy = None, Adaptive()  # predicted costs (a run long enough measures them, kept for the next)
            for run in ["greedy", *args.runs]:
                def go(run=run, prompts=prompts, policy=policy):
                    if run == "greedy":
                        return greedy_generate(target, prompts, max_new_tokens=args.max_new, prefill_chunk=args.chunk,
                                               stop_token_ids=())
                    drafter, adaptive = runs[run.removesuffix(" + adaptive")], run.endswith(" + adaptive")
                    return speculative_generate(target, drafter, prompts, max_new_tokens=args.max_new,
                                                prefill_chunk=args.chunk, draft_length=policy if adaptive else "fixed",
                                                stop_token_ids=())  # random weights: the budget, past any eos id

                if not args.small:
                    go()  # compile
                result = go()
                greedy = result if greedy is None else greedy
                floor = batch / greedy_floor(target, batch, P + args.max_new // 2, rate)
                row = dict(part="decode", target=name, prompt=P, batch=batch, run=run,
                           prefill_s=result.prefill_seconds, tokens_per_s=result.decode_tokens_per_second,
                           speedup=result.decode_tokens_per_second / greedy.decode_tokens_per_second,
                           greedy_floor_tps=floor, mean_acceptance=result.mean_acceptance_length,
                           same_as_greedy=result.tokens == greedy.tokens, peak_gb=peak_gb())
                rows.append(row)
                print_row(name, P, batch, run, f"{row['prefill_s']:.2f}", f"{row['tokens_per_s']:.1f}",
                          f"{row['speedup']:.2f}", f"{floor:.1f}", f"{row['mean_acceptance']:.2f}",
                          "yes" if row["same_as_greedy"] else "NO", f"{row['peak_gb']:.1f}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--targets", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    parser.add_argument("--prompts", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="batch > 1 at the shortest prompt")
    parser.add_argument("--max-new", type=int, default=256)
    parser.add_argument("--runs", nargs="+", default=["full acceptance", "zero acceptance"],
                        choices=[f"{a} acceptance{p}" for a in ("full", "zero") for p in ("", " + adaptive")],
                        help="the drafter's draft length: fixed, or the adaptive policy (' + adaptive')")
    parser.add_argument("--layers", type=int, default=None,
                        help="keep the target's first N layers (blocks): per-layer costs on a smaller GPU")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--chunk", type=int, default=2048, help="prefill chunk")
    parser.add_argument("--budget-s", type=float, default=None, help="start no prompt length after this many seconds")
    parser.add_argument("--no-steps", action="store_true", help="skip part `step`")
    parser.add_argument("--profile", default=None, metavar="DIR",
                        help="only profile the greedy step and the verify (traces under DIR; gpu_trace.py)")
    parser.add_argument("--moe-few-rows", choices=["gather", "reduce", "slots"], default=None,
                        help="how the MoE block runs decode and verify rows (default: the device's tuning entry)")
    parser.add_argument("--small", action="store_true", help="tiny shapes (CPU check of the script)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.small:
        args.prompts, args.batch, args.max_new, args.chunk, args.iters = [100], [1], 8, 32, 2
        # a CPU check: compiling is most of its time, and XLA's lowest backend optimisation level halves that
        # (read when the backend starts, at the first JAX call below)
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
    if args.moe_few_rows:  # the target's MoE blocks given this platform with another choice (a script's own patch)
        here = process_platform()
        chosen = dataclasses.replace(here, tuning=dataclasses.replace(here.tuning, moe_few_rows=args.moe_few_rows))
        qwen3_5.moe_block = functools.partial(moe.moe_block, platform=chosen)
    start = time.perf_counter()
    rate = read_rate(0.0625 if args.small else 4)
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; read rate {rate / 1e12:.2f} TB/s (jnp.sum)",
          flush=True)
    rows = []
    for name in args.targets:
        raw = target_config(name, args.small, args.layers)
        V = raw["vocab_size"]
        rng = np.random.default_rng(0)
        successor, other = rng.permutation(V), rng.permutation(V)
        target = jax.block_until_ready(make_target(raw, successor, args.small))
        print(f"{name}: target {nbytes(target.params) / 1e9:.1f} GB, made in {time.perf_counter() - start:.0f} s",
              flush=True)
        if args.profile:
            rows += profile_rows(name, target, min(args.prompts), args.iters, args.profile)
            continue
        runs = drafters(name, raw, target, successor, other, args.small)
        if not args.no_steps:
            steps = step_rows(target, min(args.prompts), args.iters)
            rows.append(dict(part="step", target=name, prompt=min(args.prompts), **steps))
            print(f"batch 1, {min(args.prompts)} cached: " + ", ".join(f"{k} {v:.3f} ms" for k, v in steps.items())
                  + f"; commit / verify {steps['commit'] / steps['verify 17 + commit']:.1%}; "
                  f"peak {peak_gb():.1f} GB", flush=True)
        rows += decode_rows(name, target, runs, rng, rate, args, start)
    print(f"total {time.perf_counter() - start:.1f} s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, args=vars(args),
                           read_rate=rate, rows=rows, time=time.strftime("%Y-%m-%d %H:%M")), f, indent=2)


if __name__ == "__main__":
    main()

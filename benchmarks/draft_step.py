"""One drafting step at Qwen3-8B-DFlash-b16 shapes: `dflash_jax.propose` vs the PyTorch z-lab reference.

The step (issue 4): 2048 context rows already cached, 7 new context rows (the anchor and accepted drafts of the
last step) projected and appended, the block [anchor, MASK x 15] through 5 layers, the LM head over the 15
draft rows, argmax. Ours is one jit-compiled program (`propose` with the cache donated); the reference is
z-lab `dflash/model.py` with a transformers `DynamicCache`, sdpa attention, bf16, driven as `dflash_generate`
drives it (`crop` back after the block). Random bf16 weights; the same values in both models.

Each step is timed alone, host-synchronised (what a decoding loop waits for), median over `--iters`.
Before timing, an uncached forward of both on identical weights and inputs checks they compute the same thing.

`--weights` adds rows with the linear weights kept quantized (`load_drafter(weights="packed")`'s and
`weights="fp8"`'s leaves, made on the device by `weight_forms.quantized`: timing only): `nvfp4`, `nvfp4-xla`,
`nvfp4-fp8` (the NVFP4 codes as FP8 bytes, `nvfp4.Fp8Codes`), `fp8` (`weight_forms.py`). Each
row states the drafter's own weight bytes and a floor: the bytes a step must read (the drafter's weights, the
LM head, the cached context's keys and values) at the read rate of a `jnp.sum` over 4 GiB measured in the run.
`--contexts` sets the cached context rows (2048; the issue's long-context row is 131072). `--head nvfp4` puts the
drafts through the target's NVFP4 head in the NVFP4 rows, in the row's form (the Nemotron 3.5 targets'); the floor
counts of the token-indexed tables (an own `embed_tokens`, `markov_w1`) only the rows a step looks up.

    python benchmarks/draft_step.py --reference .ref/dflash_model.py --batch 1 32 --json out.json
    python benchmarks/draft_step.py --weights bf16 nvfp4 nvfp4-xla fp8 --batch 1 8 32 --contexts 2048 131072
    python benchmarks/draft_step.py --preset nvidia-nemotron-3.5-lightning-dspark-nvfp4 --head nvfp4 \
        --weights bf16 nvfp4 nvfp4-fp8 --batch 1 8 32 --contexts 2048 32768
    python benchmarks/draft_step.py --small       # tiny shapes, a CPU check of the script (tests run it)

The reference file is z-lab's `dflash/model.py` (not part of this repository). Needs a CUDA GPU for the
reference; ours runs on whatever JAX backend is present.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # this checkout's package
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/: the read rate
from timing import read_rate  # noqa: E402
from weight_forms import WEIGHTS, packed_backend, quantized, quantized_weight  # noqa: E402

from dflash_jax.config import DflashConfig, parse_config  # noqa: E402
from dflash_jax.drafter import Drafter  # noqa: E402
from dflash_jax.drafting import ContextCache, init_cache, propose  # noqa: E402
from dflash_jax.model import draft_logits  # noqa: E402
from dflash_jax.testing import full_plan, preset_dict, random_drafter  # noqa: E402

CONTEXT, NEW_ROWS = 2048, 7


def timed(fn, iters: int, warmup: int = 5) -> float:
    """Median wall time of `fn()` in ms, each call synchronised on its own."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def kernel_profile(fn, steps: int = 10) -> dict:
    """GPU kernels per call of `fn` (CUPTI through torch.profiler, which sees XLA's kernels too):
    count, summed kernel time, and the five costliest kernels."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
    kernels = sorted(
        (e for e in prof.key_averages() if e.device_type.name == "CUDA"), key=lambda e: -e.device_time_total
    )
    return {
        "kernels_per_step": sum(e.count for e in kernels) / steps,
        "kernel_ms_per_step": sum(e.device_time_total for e in kernels) / steps / 1e3,
        "top": [(e.key[:60], e.count // steps, round(e.device_time_total / steps / 1e3, 4)) for e in kernels[:12]],
    }


@functools.partial(jax.jit, donate_argnames="cache")
def _step(drafter: Drafter, cache: ContextCache, new, num_new, anchors, lengths):
    """`propose` from a cache holding `lengths` rows (reset each call, so every timed step is the same)."""
    proposal, cache = propose(drafter, dataclasses.replace(cache, lengths=lengths), new, num_new, anchors)
    return proposal.tokens, cache


def bench_ours(drafter: Drafter, batch: int, iters: int, profile: bool, context: int = CONTEXT) -> dict:
    """Synchronised step time (ms), back-to-back step time, the bytes a step reads (weights, LM head, cached
    keys and values), and optionally a kernel profile."""
    c = drafter.config
    keys = jax.random.split(jax.random.key(batch), 4)
    max_context = context + 8  # room for the 7 new rows; the attention reads all of it every step
    cache = init_cache(drafter, batch, max_context)
    shape = cache.keys[0].shape
    cache = dataclasses.replace(
        cache,
        keys=tuple(jax.random.normal(k, shape, jnp.bfloat16) for k in jax.random.split(keys[0], len(cache.keys))),
        values=tuple(jax.random.normal(k, shape, jnp.bfloat16) for k in jax.random.split(keys[1], len(cache.keys))),
    )
    lengths = jnp.full((batch,), context, jnp.int32)
    # a layer's cache is max_context slots, or a window's ring (read whole once the context fills it)
    cache_read = sum(int(a.nbytes) * min(context + NEW_ROWS, a.shape[2]) // a.shape[2]
                     for a in (*cache.keys, *cache.values))
    new = jax.random.normal(keys[2], (batch, NEW_ROWS, len(c.target_layer_ids) * c.hidden_size), jnp.bfloat16)
    num_new = jnp.full((batch,), NEW_ROWS, jnp.int32)
    anchors = jax.random.randint(keys[3], (batch,), 0, c.vocab_size, jnp.int32)
    state = {"cache": cache}

    def step():
        tokens, state["cache"] = _step(drafter, state["cache"], new, num_new, anchors, lengths)
        return tokens

    def steps(n: int):
        for _ in range(n):
            tokens = step()
        tokens.block_until_ready()

    start = time.perf_counter()
    steps(1)
    print(f"  ours: compiled + first step in {time.perf_counter() - start:.1f} s", flush=True)
    result = {"ours_ms": timed(lambda: steps(1), iters), "ours_back_to_back_ms": timed(lambda: steps(10), 5) / 10,
              "bytes_read": weight_bytes_read(drafter) + cache_read}
    if profile:
        try:
            result["ours_kernels"] = kernel_profile(lambda: steps(1))
        except Exception as e:  # diagnostic only: never lose the timings to it
            result["ours_kernels"] = f"profile failed: {e!r}"
    return result


def weight_bytes_read(drafter: Drafter) -> int:
    """The weight bytes a step must read: every parameter and the LM head once, but of the tables indexed by token
    (the drafter's own `embed_tokens`, a Markov head's `markov_w1`) only the rows a step looks up (a block's B, one
    a draft row): a 131072-row embedding is not read by a step."""
    c = drafter.config
    tables = {("embed_tokens", "weight"): c.effective_block_size, ("markov_head", "markov_w1", "weight"):
              c.num_draft_tokens}
    total = sum(int(x.nbytes) for x in jax.tree.leaves((drafter.params, drafter.lm_head)))
    for path, rows in tables.items():
        node = drafter.params
        for key in path:
            node = node.get(key) if isinstance(node, dict) else None
        if node is not None:
            total -= int(node.nbytes) - rows * int(node.nbytes) // node.shape[0]
    return total


def load_reference(path: str):
    spec = importlib.util.spec_from_file_location("zlab_dflash_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reference_model(module, config: DflashConfig, num_target_layers: int, drafter: Drafter, plan):
    """z-lab `DFlashDraftModel` in bf16 with sdpa attention, holding our random weights (copied on the GPU)."""
    import inspect

    import torch
    from transformers import Qwen3Config

    fields = dict(
        hidden_size=config.hidden_size, num_hidden_layers=config.num_hidden_layers,
        intermediate_size=config.intermediate_size, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim, vocab_size=config.vocab_size,
        rms_norm_eps=config.rms_norm_eps, max_position_embeddings=40960, attn_implementation="sdpa",
    )
    rope = {"rope_type": "default", "rope_theta": config.rope_theta}
    if "rope_parameters" in inspect.signature(Qwen3Config.__init__).parameters:
        fields["rope_parameters"] = rope
    else:
        fields["rope_theta"] = config.rope_theta
    hf = Qwen3Config(**fields)
    hf.block_size = config.effective_block_size
    hf.num_target_layers = num_target_layers
    hf.dflash_config = {"mask_token_id": config.mask_token_id, "target_layer_ids": list(config.target_layer_ids)}
    with torch.device("cuda"):
        model = module.DFlashDraftModel(hf).to(torch.bfloat16).eval()
    state = model.state_dict()
    with torch.no_grad():
        for t in plan:
            leaf = functools.reduce(lambda node, key: node[key], t.path, drafter.params)
            state[t.name].copy_(torch.from_dlpack(leaf))
    print(f"  reference: attention {model.config._attn_implementation}, rope theta {config.rope_theta:g}", flush=True)
    return model


def parity(model, drafter: Drafter) -> dict:
    """Uncached forward of both at batch 1 on identical inputs: logits difference and draft agreement."""
    import torch

    c = drafter.config
    B, S = c.effective_block_size, 64
    feats = jax.random.normal(jax.random.key(7), (1, S, len(c.target_layer_ids) * c.hidden_size), jnp.bfloat16)
    block = jnp.asarray([[1234] + [c.mask_token_id] * (B - 1)], jnp.int32)
    ours = draft_logits(
        drafter, feats, block, context_positions=jnp.arange(S)[None], block_positions=(S + jnp.arange(B))[None]
    )
    with torch.no_grad():
        embed, head = torch.from_dlpack(drafter.embed), torch.from_dlpack(drafter.lm_head)
        hidden = model(
            target_hidden=torch.from_dlpack(feats), noise_embedding=embed[torch.from_dlpack(block).long()],
            position_ids=torch.arange(S + B, device="cuda")[None], use_cache=False, is_causal=False,
        )
        theirs = (hidden[:, 1 - B :] @ head.T).float()
    ours = np.asarray(ours[:, 1:])
    theirs = theirs.cpu().numpy()
    return {
        "max_abs_logit_diff": float(np.abs(ours - theirs).max()),
        "max_abs_logit": float(np.abs(theirs).max()),
        "draft_agreement": f"{int((ours.argmax(-1) == theirs.argmax(-1)).sum())}/{B - 1}",
    }


def bench_reference(model, drafter: Drafter, batch: int, iters: int) -> float:
    import torch
    from transformers import DynamicCache

    c = drafter.config
    B, width = c.effective_block_size, len(c.target_layer_ids) * c.hidden_size
    gen = torch.Generator(device="cuda").manual_seed(batch)
    embed, head = torch.from_dlpack(drafter.embed), torch.from_dlpack(drafter.lm_head)
    positions = torch.arange(CONTEXT + NEW_ROWS + B, device="cuda")[None].expand(batch, -1)
    block = torch.full((batch, B), c.mask_token_id, device="cuda")
    block[:, 0] = torch.randint(0, c.vocab_size, (batch,), device="cuda", generator=gen)
    cache = DynamicCache()
    with torch.no_grad():  # prefill the draft cache with the 2048 context rows, as the first step does
        context = torch.randn(batch, CONTEXT, width, device="cuda", dtype=torch.bfloat16, generator=gen)
        model(target_hidden=context, noise_embedding=embed[block], position_ids=positions[:, : CONTEXT + B],
              past_key_values=cache, use_cache=True, is_causal=False)
        cache.crop(CONTEXT)
    new = torch.randn(batch, NEW_ROWS, width, device="cuda", dtype=torch.bfloat16, generator=gen)

    @torch.inference_mode()
    def run():
        hidden = model(target_hidden=new, noise_embedding=embed[block], position_ids=positions[:, CONTEXT:],
                       past_key_values=cache, use_cache=True, is_causal=False)
        cache.crop(CONTEXT)  # dflash_generate crops to `start` after each block; back to 2048 keeps steps equal
        (hidden[:, 1 - B :] @ head.T).argmax(-1)
        torch.cuda.synchronize()

    return timed(run, iters)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="zlab-qwen3-8b-dflash-b16", help="a dflash_jax.testing preset")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--reference", help="path to z-lab dflash/model.py (omit to time ours only)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--weights", nargs="+", default=["bf16"], choices=WEIGHTS,
                        help="forms of the linear weights to time (see above)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[CONTEXT], help="cached context rows")
    parser.add_argument("--read-gib", type=float, default=4.0, help="GiB the read rate's jnp.sum reads")
    parser.add_argument("--profile", action="store_true", help="the kernels of a step (torch.profiler: CUPTI)")
    parser.add_argument("--head", choices=("bf16", "nvfp4"), default="bf16",
                        help="the target LM head the drafts go through: bf16, or NVFP4 in the form of the nvfp4 "
                             "weight forms (NVIDIA's Nemotron 3.5 targets ship theirs NVFP4)")
    parser.add_argument("--small", action="store_true", help="a tiny preset (tiny-dflash unless --preset names "
                        "another), batch 1, one timed step, a 64 MiB read rate (a CPU check of the script)")
    args = parser.parse_args()
    if args.small:
        args.batch, args.iters, args.read_gib = [1], 1, 1 / 16
        args.preset = args.preset if args.preset.startswith("tiny-") else "tiny-dflash"

    raw = preset_dict(args.preset)
    config = parse_config(raw)
    print(f"{args.preset}: {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    drafter, plan = random_drafter(config), full_plan(config)
    results = {"preset": args.preset, "device": jax.devices()[0].device_kind, "jax": jax.__version__,
               "iters": args.iters, "head": args.head, "rows": []}
    model = None
    if args.reference:
        import torch

        model = reference_model(load_reference(args.reference), config, raw["num_target_layers"], drafter, plan)
        results["parity"] = parity(model, drafter)
        results["torch"] = torch.__version__
        print(f"  parity (bf16, batch 1, uncached): {results['parity']}", flush=True)
    rate = read_rate(args.read_gib)
    print(f"  read rate {rate / 1e12:.2f} TB/s (jnp.sum over 4 GiB)", flush=True)
    for weights in args.weights:
        form = quantized(drafter, plan, weights)
        if args.head == "nvfp4" and weights.startswith("nvfp4"):  # the target's NVFP4 head, packed like the rest
            form = dataclasses.replace(form, lm_head=quantized_weight(drafter.lm_head, weights, len(plan)))
        with packed_backend(weights):
            for context in args.contexts:
                for batch in args.batch:
                    row = {"weights": weights, "context": context, "batch": batch,
                           "drafter_weight_bytes": form.param_bytes,
                           **bench_ours(form, batch, args.iters, profile=args.profile or model is not None,
                                        context=context)}
                    row["floor_ms"] = row["bytes_read"] / rate * 1e3
                    if model is not None and weights == "bf16" and context == CONTEXT:
                        row["reference_ms"] = bench_reference(model, drafter, batch, args.iters)
                        row["ratio"] = row["ours_ms"] / row["reference_ms"]
                    results["rows"].append(row)
                    print(f"  {weights}, context {context}, batch {batch}: {row}", flush=True)
    results["read_rate"] = rate

    print("\n| weights | context | batch | drafter weights (GB) | ours (ms) | reference (ms) | ours / reference "
          "| ours back to back (ms) | floor (ms) | bytes / back to back |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in results["rows"]:
        ref = f"{row['reference_ms']:.3f} | {row['ratio']:.2f}" if "ratio" in row else "- | -"
        print(f"| {row['weights']} | {row['context']} | {row['batch']} | {row['drafter_weight_bytes'] / 1e9:.3f} "
              f"| {row['ours_ms']:.3f} | {ref} | {row['ours_back_to_back_ms']:.3f} | {row['floor_ms']:.3f} "
              f"| {row['bytes_read'] / row['ours_back_to_back_ms'] / 1e9:.2f} TB/s |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()

"""The sharded target's costs on one device: decode-step time on a 1-device mesh, and `load_target`'s bytes/s.

Two goals of issue 16 (H200, Qwen3-8B shapes):
1. Decode step: the target on a 1-device ("data", "model") mesh (`DecoderTarget.shard`: the tensor-parallel
   layout, attention under `shard_map`, sharding constraints) at most 1.05x the unsharded target per step. Timed:
   target forwards over `--rows` new tokens per sequence (1: plain greedy decoding; 16: a DFlash-b16
   verify) after `--context` cached positions, median of `--repeats` after a warm-up, bf16 random weights.
2. Loading: `load_target(path, mesh=<1-device mesh>)` of a Qwen3-8B-shaped bf16 checkpoint (written once under
   `--dir`) against `load_drafter` of a z-lab Qwen3-8B-DFlash-b16-shaped one, bytes/s of checkpoint, page cache
   warm, each load in this process after one untimed load of the same checkpoint (nothing left to compile).

    XLA_PYTHON_CLIENT_PREALLOCATE=false python benchmarks/tp_target.py --dir /tmp/tp_bench --json tp.json
    python benchmarks/tp_target.py --small     # tiny shapes on a CPU, a check of the script
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from timing import call_seconds  # benchmarks/timing.py (the script's directory is on sys.path)

from dflash_jax import load_drafter, load_target
from dflash_jax._qwen3_testing import random_qwen3
from dflash_jax.safetensors import write_tensors
from dflash_jax.target.config import parse_qwen3_config
from dflash_jax.target.dense import plan_decoder
from dflash_jax.testing import write_checkpoint

QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096,
    "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "rope_theta": 1000000.0, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
SMALL = {**QWEN3_8B, "vocab_size": 1024, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}
DRAFTER = "zlab-qwen3-8b-dflash-b16"
LOOP_STEPS = 10


def step_ms(target, batch: int, rows: int, context: int, repeats: int) -> float:
    """Median ms per forward over `rows` new tokens after `context` cached positions: `LOOP_STEPS` forwards in one
    jitted loop, the cache carried and donated and each step's argmax fed to the next, as in the decode loop (so
    neither dispatch nor a cache copy is timed)."""

    @functools.partial(jax.jit, donate_argnums=1)
    def run(target, cache, tokens, lengths):
        def step(_, carry):
            cache, tokens = carry
            out = target(tokens, cache, lengths)
            return out.cache, jnp.argmax(out.logits, axis=-1).astype(jnp.int32)  # [batch, rows]

        return jax.lax.fori_loop(0, LOOP_STEPS, step, (cache, tokens))

    box = [(target.init_cache(batch, context + rows), jnp.ones((batch, rows), jnp.int32))]  # the loop's carry
    lengths = jnp.full((batch,), context, jnp.int32)

    def call():
        box[0] = run(target, *box[0], lengths)
        return box[0]

    return statistics.median(call_seconds(call, repeats, warmup=2)) / LOOP_STEPS * 1e3


def write_target(directory: str, raw: dict) -> None:
    """A bf16 checkpoint of `raw`'s shapes (values tiled from one random block: only the bytes matter here)."""
    if os.path.exists(os.path.join(directory, "config.json")):
        return
    os.makedirs(directory, exist_ok=True)
    block = np.random.default_rng(0).standard_normal(1 << 20).astype(ml_dtypes.bfloat16) * 0.02
    tensors = {}
    for t in plan_decoder(parse_qwen3_config(raw)):
        n = int(np.prod(t.shape))
        tensors[t.name] = np.resize(block, n).reshape(t.shape)
    write_tensors(directory, tensors, num_shards=max(1, sum(a.nbytes for a in tensors.values()) >> 32))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({**raw, "torch_dtype": "bfloat16"}, f)


def load_gbps(load, path: str, repeats: int) -> float:
    """Checkpoint GB/s of `load(path)` (median of `repeats`, after one untimed load)."""
    nbytes = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
    return nbytes / statistics.median(call_seconds(lambda: jax.tree.leaves(load(path)), repeats)) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--parts", nargs="+", default=["step", "load"])
    parser.add_argument("--dir", default="/tmp/dflash_tp_bench")
    parser.add_argument("--small", action="store_true", help="tiny shapes (CPU check of the script)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    raw = SMALL if args.small else QWEN3_8B
    context = 64 if args.small else args.context
    mesh = jax.make_mesh((1, 1), ("data", "model"), devices=jax.devices()[:1])
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)

    rows_out = []
    if "step" in args.parts:
        plain = random_qwen3(parse_qwen3_config(raw), seed=0)
        sharded = plain.shard(mesh)
        print("| batch | new rows | unsharded ms | 1-device mesh ms | ratio |\n|---:|---:|---:|---:|---:|", flush=True)
        for batch in args.batch:
            for rows in args.rows:
                a = step_ms(plain, batch, rows, context, args.repeats)
                b = step_ms(sharded, batch, rows, context, args.repeats)
                rows_out.append(dict(part="step", batch=batch, rows=rows, context=context, unsharded_ms=a, mesh_ms=b))
                print(f"| {batch} | {rows} | {a:.3f} | {b:.3f} | {b / a:.3f} |", flush=True)
        del plain, sharded

    if "load" in args.parts:
        target_dir, drafter_dir = os.path.join(args.dir, "target"), os.path.join(args.dir, "drafter")
        write_target(target_dir, raw)
        if not os.path.exists(os.path.join(drafter_dir, "config.json")):
            write_checkpoint(drafter_dir, "tiny-dflash" if args.small else DRAFTER)
        repeats = 3
        target_gbps = load_gbps(lambda p: load_target(p, mesh=mesh).params, target_dir, repeats)
        drafter_gbps = load_gbps(lambda p: load_drafter(p, mesh=mesh).params, drafter_dir, repeats)
        rows_out.append(dict(part="load", target_gbps=target_gbps, drafter_gbps=drafter_gbps))
        print(f"load_target {target_gbps:.2f} GB/s, load_drafter {drafter_gbps:.2f} GB/s "
              f"(ratio {target_gbps / drafter_gbps:.2f})", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, args=vars(args),
                           rows=rows_out), f, indent=2)


if __name__ == "__main__":
    main()

"""The Qwen3.5-MoE block at decode and verify sizes: which way of running the routed experts reads only them.

`dflash_jax.target.moe.moe_block` at Qwen3.5-35B-A3B shapes (hidden 2048, 256 experts, 8 per token, expert
width 512, shared expert 512), random bf16 weights, for T tokens (batch x rows: 1 and 8 sequences, 1 row for a
greedy step and 17 for a 16-draft verify, 136 for a verify at batch 8, 2048 for a prefill chunk), each `impl` of
`moe._routed`:

- `gather`: each token's k experts' weights gathered (copied out), then batched matrix-vector products;
- `reduce`: the same products as a multiply and a float32 sum over the weights' last axis, which XLA fuses with the
  gather: each routed slice read in place, never copied;
- `slots`: each distinct routed expert read once, in place, by the package's Mosaic GPU kernel
  (`target._expert_gemm`; on a CPU, or at shapes it does not take, `reduce`), up to the few-row path's
  `tuning.Tuning.moe_gather_max_rows` (token, expert) pairs (its outputs are [slots, out, tokens]);
- `tiled`: the pairs sorted by expert into tiles of one expert each, batched matmuls over the tiles;
- `grouped`: the pairs sorted by expert, JAX's Pallas Mosaic GPU grouped matmul
  (`jax.experimental.pallas.ops.gpu.ragged_dot_mgpu`; XLA's `ragged_dot` off the GPU);
- `ragged_dot`: the same sorted pairs through XLA's `jax.lax.ragged_dot_general`;
- `sliced` (a candidate, here only): one `lax.dynamic_index_in_dim` and matrix-vector product per (token, expert)
  pair, unrolled (up to 16 pairs), which XLA may read in place.

`grouped` runs only where asked (`--variants`): inside a program of 8 blocks XLA's compilation of its Mosaic
custom call crashed on the H200 (jax 0.11.2).

The time is that of one block inside a compiled program that runs `--layers` blocks of distinct weights in a
row, unrolled, one buffer a weight (as the target's decode step runs its layers: no host dispatch, no loop, no
weights left in L2 by the previous call), median of `--iters`.
Each figure stands beside its floor: the bytes of the distinct experts the T tokens route to (gate, up, down),
the router and the shared expert, at the read rate of a `jnp.sum` over 4 GiB measured in the same run. Every
variant's output of one block is checked against `ragged_dot`'s.

    XLA_PYTHON_CLIENT_PREALLOCATE=false python3 benchmarks/moe_block.py --json out.json
    python3 benchmarks/moe_block.py --tokens 1 8 --variants reduce slots --profile /tmp/moe   # kernels a block
    python benchmarks/moe_block.py --small      # tiny shapes, a CPU check of the script (tests run it)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])  # benchmarks/: the timing loop

import gpu_trace  # noqa: E402
from timing import call_seconds, read_rate  # noqa: E402

from dflash_jax.platform import process_platform  # noqa: E402
from dflash_jax.target import moe  # noqa: E402

QWEN3_5_35B_A3B = moe.MoeDims()  # the defaults are its sizes
SMALL = moe.MoeDims(hidden_size=64, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32,
                    shared_expert_intermediate_size=32)
VARIANTS = ("ragged_dot", "gather", "reduce", "slots", "tiled", "sliced")
SLICED_MAX_PAIRS = 16


def sliced(p: dict, c: moe.MoeDims, x: jax.Array) -> jax.Array:
    """The block with each (token, expert) pair's weights taken by `lax.dynamic_index_in_dim`: `[1, T, H]`."""
    xt = x.reshape(-1, c.hidden_size)  # [T, H]
    weights, experts = moe.route(p, c, xt)  # [T, k]
    e, rows = p["experts"], []  # each [E, out, in]
    for t in range(xt.shape[0]):
        acc = jnp.zeros((c.hidden_size,), jnp.float32)
        for j in range(c.num_experts_per_tok):
            w = {n: jax.lax.dynamic_index_in_dim(e[n], experts[t, j], keepdims=False) for n in e}  # [out, in]
            h = jax.nn.silu(jnp.dot(w["gate_proj"], xt[t], preferred_element_type=jnp.float32)) \
                * jnp.dot(w["up_proj"], xt[t], preferred_element_type=jnp.float32)  # [I]
            acc = acc + weights[t, j] * jnp.dot(w["down_proj"], h.astype(x.dtype), preferred_element_type=jnp.float32)
        rows.append(acc)
    return (jnp.stack(rows) + moe.gated_shared_expert(p, xt)).astype(x.dtype).reshape(x.shape)


def block(p: dict, c: moe.MoeDims, x: jax.Array, impl: str) -> jax.Array:
    return sliced(p, c, x) if impl == "sliced" else moe.moe_block(p, c, x, impl)


def random_blocks(c: moe.MoeDims, layers: int, seed: int = 0) -> list[dict]:
    """`layers` blocks of random bf16 weights, each its own tree (as the target holds its layers: one buffer a
    weight, layers unrolled, so that no loop slices a stack)."""
    specs = moe.moe_parameter_spec(c, prefix="")
    blocks: list[dict] = [{} for _ in range(layers)]
    for key, spec in zip(jax.random.split(jax.random.key(seed), len(specs)), specs):
        *path, last = spec.name.split(".")
        for i, layer_key in enumerate(jax.random.split(key, layers)):
            leaf = jax.random.normal(layer_key, spec.shape, jnp.float32) / np.sqrt(spec.shape[-1])
            node = blocks[i]
            for part in path:
                node = node.setdefault(part, {})
            node[last] = leaf.astype(jnp.bfloat16)
    return blocks


def run_layers(blocks: list[dict], c: moe.MoeDims, x: jax.Array, impl: str) -> jax.Array:
    """The blocks one after another, unrolled (a residual stream through `layers` MoE blocks)."""
    for p in blocks:
        x = x + block(p, c, x, impl)
    return x


one_block = jax.jit(block, static_argnums=(1, 3))


def profile_row(f, blocks: list[dict], c: moe.MoeDims, x: jax.Array, impl: str, layers: int, directory: str) -> dict:
    """`f` (`run_layers`, jitted) traced once, warm: `gpu_trace.summarize`'s figures a block, printed."""
    compiled = f.lower(blocks, c, x, impl).compile()
    jax.block_until_ready(compiled(blocks, x))
    summary, _ = gpu_trace.traced(lambda: compiled(blocks, x), directory, layers, compiled.as_text())
    gpu_trace.print_summary(f"{x.shape[1]} tokens, {impl}, a block", summary)
    return dict(tokens=x.shape[1], variant=impl, **summary)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=None)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--small", action="store_true", help="tiny shapes (CPU check of the script)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--variants", nargs="+", default=VARIANTS, choices=(*VARIANTS, "grouped"))
    parser.add_argument("--profile", default=None, metavar="DIR",
                        help="only profile: each variant's program once under jax.profiler.trace (traces under DIR), "
                             "its kernels a block (gpu_trace.py)")
    args = parser.parse_args()
    c = SMALL if args.small else QWEN3_5_35B_A3B
    args.tokens = args.tokens or ([1, 17, 136] if args.small else [1, 8, 17, 136, 2048])
    rate = read_rate(0.05 if args.small else 4.0)
    blocks = random_blocks(c, args.layers)
    first = blocks[0]
    expert_bytes = 3 * c.moe_intermediate_size * c.hidden_size * 2
    fixed = sum(x.nbytes for x in jax.tree.leaves(first)) - c.num_experts * expert_bytes  # router + shared expert
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; read rate {rate / 1e12:.2f} TB/s (jnp.sum); "
          f"{args.layers} blocks a program")
    if not args.profile:
        print("| tokens | distinct experts | impl | us a block | floor us | x floor | one block's diff vs ragged_dot "
              "(of max) |")
        print("|---:|---:|---|---:|---:|---:|---:|")
    rows = []
    for T in args.tokens:
        x = jax.random.normal(jax.random.key(T), (1, T, c.hidden_size), jnp.float32).astype(jnp.bfloat16)
        distinct = len(np.unique(np.asarray(moe.routed_experts(first, c, x))))
        floor = (fixed + distinct * expert_bytes) / rate
        reference = None
        for impl in args.variants:
            if impl == "sliced" and T * c.num_experts_per_tok > SLICED_MAX_PAIRS:
                continue
            few_rows = process_platform().tuning.moe_gather_max_rows
            if impl == "slots" and T * c.num_experts_per_tok > few_rows:  # few rows only
                continue
            f = jax.jit(run_layers, static_argnums=(1, 3))
            if args.profile:
                rows.append(profile_row(f, blocks, c, x, impl, args.layers, f"{args.profile}/{impl}-{T}"))
                continue
            out = one_block(first, c, x, impl)  # one block: 8 in a row, unnormalised, would amplify the rounding
            reference = out if reference is None else reference
            scale = float(jnp.max(jnp.abs(reference.astype(jnp.float32))))
            diff = float(jnp.max(jnp.abs(out.astype(jnp.float32) - reference.astype(jnp.float32)))) / scale
            seconds = statistics.median(call_seconds(lambda: f(blocks, c, x, impl), args.iters)) / args.layers  # noqa: B023
            rows.append(dict(tokens=T, distinct_experts=distinct, variant=impl, us=seconds * 1e6,
                             floor_us=floor * 1e6, max_diff=diff))
            print(f"| {T} | {distinct} | {impl} | {seconds * 1e6:.1f} | {floor * 1e6:.1f} | {seconds / floor:.2f} "
                  f"| {diff:.2e} |", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, read_rate=rate, rows=rows,
                           layers=args.layers, time=time.strftime("%Y-%m-%d %H:%M")), fh, indent=2)


if __name__ == "__main__":
    main()

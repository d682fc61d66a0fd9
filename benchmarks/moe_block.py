"""The Qwen3.5-MoE block at decode and verify sizes: which grouped matmul reads only the routed experts.

`dflash_jax.target.moe.moe_block` at Qwen3.5-35B-A3B shapes (hidden 2048, 256 experts, 8 per token, expert
width 512, shared expert 512), random bf16 weights, for T tokens (batch x rows: 1 and 8 sequences, 1 row for a
greedy step and 17 for a 16-draft verify). Its routed experts run through one of:

- `ragged_dot`: the package's path, `jax.lax.ragged_dot_general` over the pairs sorted by expert (what XLA makes
  of it on the device decides whether it reads only the routed experts);
- `gather`: the k experts' weights gathered per token (`[T, k, I, H]`), then batched matrix-vector products;
- `mgpu`: JAX's Pallas Mosaic GPU grouped matmul (`jax.experimental.pallas.ops.gpu.ragged_dot_mgpu`; GPU only).

Each figure (median of `--iters` back-to-back calls) stands beside its floor: the bytes of the distinct experts
the T tokens route to (gate, up and down of each), the router and the shared expert, at the read rate of a
`jnp.sum` over 4 GiB measured in the same run. Outputs of every variant are checked against `ragged_dot`'s.

    python3 benchmarks/moe_block.py --json out.json
    python benchmarks/moe_block.py --small      # tiny shapes, a CPU check of the script (tests run it)
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])  # benchmarks/: the timing loop

from timing import call_seconds  # noqa: E402

from dflash_jax.model import linear  # noqa: E402
from dflash_jax.target import moe  # noqa: E402

QWEN3_5_35B_A3B = moe.MoeDims()  # the defaults are its sizes
SMALL = moe.MoeDims(hidden_size=64, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32,
                    shared_expert_intermediate_size=32)


def read_rate(gib: float) -> float:
    """Bytes/s of `jnp.sum` over a bf16 array of `gib` GiB (one read)."""
    x = jnp.ones((int(gib * 2**30) // 2,), jnp.bfloat16)
    f = jax.jit(lambda x: jnp.sum(x, dtype=jnp.float32))
    return x.nbytes / min(call_seconds(lambda: f(x), 5))


def random_block(c: moe.MoeDims, seed: int = 0):
    specs = moe.moe_parameter_spec(c, prefix="")
    keys = jax.random.split(jax.random.key(seed), len(specs))
    leaves = {s.name: (jax.random.normal(k, s.shape, jnp.float32) / np.sqrt(s.shape[-1])).astype(jnp.bfloat16)
              for k, s in zip(keys, specs)}
    tree: dict = {}
    for name, leaf in leaves.items():
        node = tree
        *path, last = name.split(".")
        for part in path:
            node = node.setdefault(part, {})
        node[last] = leaf
    return tree


def gathered(p, c, x, weights, experts):
    """Routed experts with each token's k experts' weights gathered: `[T, H]` float32."""
    e = p["experts"]
    gate, up, down = (jnp.take(e[n], experts, axis=0) for n in ("gate_proj", "up_proj", "down_proj"))  # [T, k, ...]
    h = jax.nn.silu(jnp.einsum("th,tkih->tki", x, gate)) * jnp.einsum("th,tkih->tki", x, up)  # [T, k, I]
    out = jnp.einsum("tki,tkhi->tkh", h, down, preferred_element_type=jnp.float32)  # [T, k, H]
    return jnp.einsum("tkh,tk->th", out, weights)


def mgpu_routed(p, c, x, weights, experts):
    """Routed experts through JAX's Mosaic GPU grouped matmul (rows sorted by expert, as the package's path)."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    T, k = experts.shape
    flat = experts.reshape(T * k)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=c.num_experts).astype(jnp.int32)
    rows = jnp.take(x, order // k, axis=0)  # [T * k, H]
    grouped = functools.partial(ragged_dot_mgpu.ragged_dot, group_sizes=sizes, block_m=64, block_n=128, block_k=64,
                                max_concurrent_steps=4, grid_block_n=1, transpose_rhs=True)
    e = p["experts"]
    h = (jax.nn.silu(grouped(rows, e["gate_proj"])) * grouped(rows, e["up_proj"])).astype(x.dtype)  # [T * k, I]
    out = grouped(h, e["down_proj"])  # [T * k, H]
    out = jnp.zeros_like(out).at[order].set(out, unique_indices=True)
    return jnp.einsum("tkh,tk->th", out.reshape(T, k, -1).astype(jnp.float32), weights)


def block_with(routed):
    """`moe_block` with another routed-experts function (same router, same shared expert)."""

    def block(p, c, x):
        batch, S, H = x.shape
        xt = x.reshape(batch * S, H)
        weights, experts = moe.route(p, c, xt)
        s = p["shared_expert"]
        shared = linear(jax.nn.silu(linear(xt, s["gate_proj"])) * linear(xt, s["up_proj"]),
                            s["down_proj"])
        gate = jax.nn.sigmoid(linear(xt, p["shared_expert_gate"]).astype(jnp.float32))
        return (routed(p, c, xt, weights, experts) + gate * shared.astype(jnp.float32)).astype(x.dtype).reshape(
            batch, S, H)

    return block


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 17, 136])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--small", action="store_true", help="tiny shapes (CPU check of the script)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    c = SMALL if args.small else QWEN3_5_35B_A3B
    gpu = jax.default_backend() == "gpu"
    rate = read_rate(0.05 if args.small else 4.0)
    p = random_block(c)
    variants = {"ragged_dot": moe.moe_block, "gather": block_with(gathered)}
    if gpu:
        variants["mgpu"] = block_with(mgpu_routed)
    expert_bytes = 3 * c.moe_intermediate_size * c.hidden_size * 2
    fixed = sum(x.nbytes for x in jax.tree.leaves(p)) - c.num_experts * expert_bytes  # router + shared expert
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; read rate {rate / 1e12:.2f} TB/s (jnp.sum)")
    print("| tokens | distinct experts | variant | us | floor us | x floor | max diff vs ragged_dot |")
    print("|---:|---:|---|---:|---:|---:|---:|")
    rows = []
    for T in args.tokens:
        x = jax.random.normal(jax.random.key(T), (1, T, c.hidden_size), jnp.float32).astype(jnp.bfloat16)
        distinct = len(np.unique(np.asarray(moe.routed_experts(p, c, x))))
        floor = (fixed + distinct * expert_bytes) / rate
        reference = None
        for name, block in variants.items():
            f = jax.jit(block, static_argnums=1)
            try:
                out = f(p, c, x)
            except Exception as e:  # noqa: BLE001  (a variant that cannot run here is reported, not fatal)
                print(f"| {T} | {distinct} | {name} | failed: {type(e).__name__}: {str(e)[:80]} | | | |")
                continue
            reference = out if reference is None else reference
            diff = float(jnp.max(jnp.abs(out.astype(jnp.float32) - reference.astype(jnp.float32))))
            seconds = statistics.median(call_seconds(lambda: f(p, c, x), args.iters))  # noqa: B023
            rows.append(dict(tokens=T, distinct_experts=distinct, variant=name, us=seconds * 1e6,
                             floor_us=floor * 1e6, max_diff=diff))
            print(f"| {T} | {distinct} | {name} | {seconds * 1e6:.1f} | {floor * 1e6:.1f} | {seconds / floor:.2f} "
                  f"| {diff:.2e} |", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, read_rate=rate, rows=rows,
                           time=time.strftime("%Y-%m-%d %H:%M")), fh, indent=2)


if __name__ == "__main__":
    main()

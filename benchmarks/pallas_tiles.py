"""The GPU span kernel's tuning: key slots per step, warps and stages for each query tile (`tuning.Tuning.span_tiles`).

JAX's Pallas split-K decode kernel (`jax.experimental.pallas.ops.gpu.decode_attention.mqa`) over one layer's
cache, 8 KV heads of 128 at batch 1 (or `--batch`), for the query rows per KV head the package runs: 4 (a greedy
token, 4 query heads per KV head), 64 (a 16-token block) and 68 (a 17-token DSpark verify). Each configuration is timed
over `LOOP` calls inside one jitted loop (a call is ~0.05 ms: timed one by one, dispatch would dominate).
Floor: the K and V bytes at 4.0 TB/s.

    XLA_PYTHON_CLIENT_PREALLOCATE=false python benchmarks/pallas_tiles.py [--spans 131072 --rows 64]
"""

import argparse
import itertools
import time

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu import decode_attention

from dflash_jax.attention import pallas_tile, split_keys
from dflash_jax.tuning import tuning

LOOP = 20
KV_HEADS, HEAD_DIM = 8, 128


def loop_ms(attend, q, *args) -> float:
    """ms per call of `attend(q, *args)`, chained `LOOP` times in one jitted loop (each output feeds the next q)."""
    run = jax.jit(lambda q, *a: jax.lax.fori_loop(0, LOOP, lambda i, q: q + 1e-3 * attend(q, *a)[0].astype(q.dtype), q))
    jax.block_until_ready(run(q, *args))
    start = time.perf_counter()
    jax.block_until_ready(run(run(q, *args), *args))
    return (time.perf_counter() - start) / (2 * LOOP) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spans", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--rows", type=int, nargs="+", default=[4, 64, 68], help="query rows per KV head")
    parser.add_argument("--keys-per-split", type=int, nargs="+", default=[1024, 2048],
                        help="0: the package's (`attention.split_keys`)")
    parser.add_argument("--slots", type=int, nargs="+", default=[64, 128], help="key slots per step")
    parser.add_argument("--warps", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--stages", type=int, nargs="+", default=[2], help="software-pipelining stages")
    parser.add_argument("--batch", type=int, default=1, help="sequences (each with 8 KV heads)")
    args = parser.parse_args()
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}")
    print(f"batch {args.batch}\n| span | rows | tile | floor ms | fastest ms | key slots/step | warps | keys/split | "
          "stages | ms at the package's tuning |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for T, row_counts in ((T, args.rows) for T in args.spans):
        heads = args.batch * KV_HEADS  # the package flattens [batch, n_kv] for the kernel
        k = jax.random.normal(jax.random.key(0), (heads, T, HEAD_DIM), jnp.bfloat16)  # [batch * heads, T, d]
        v = jax.random.normal(jax.random.key(1), (heads, T, HEAD_DIM), jnp.bfloat16)
        stop = jnp.full((heads,), T - 200, jnp.int32)
        floor = 2 * k.nbytes / 4.0e12 * 1e3  # K and V
        for rows in row_counts:
            q = jax.random.normal(jax.random.key(2), (heads, rows, HEAD_DIM), jnp.bfloat16)
            tile = pallas_tile(rows)
            times = {}
            splits = [n or split_keys(T, tile) for n in args.keys_per_split]
            for block_k, warps, per_split, stages in itertools.product(args.slots, args.warps, splits, args.stages):
                if per_split > T:
                    continue
                def attend(q, k, v, stop, tile=tile, block_k=block_k, warps=warps, splits=T // per_split, st=stages):
                    return decode_attention.mqa(
                        q, k, v, start_idx=jnp.zeros_like(stop), kv_seq_len=stop, sm_scale=HEAD_DIM**-0.5,
                        block_h=tile, block_k=block_k, k_splits=splits, return_residuals=True, num_warps=warps,
                        num_stages=st)

                try:
                    times[block_k, warps, per_split, stages] = loop_ms(attend, q, k, v, stop)
                except jax.errors.JaxRuntimeError as e:  # more stages or slots than shared memory holds
                    if "Shared memory" not in str(e):
                        raise
            best = min(times, key=times.get)
            slots, warps, stages = tuning().span_tiles[tile]
            package = times.get((slots, warps, split_keys(T, tile), stages), float("nan"))
            print(f"| {T} | {rows} | {tile} | {floor:.4f} | {times[best]:.4f} | {' | '.join(map(str, best))} | "
                  f"{package:.4f} |", flush=True)


if __name__ == "__main__":
    main()

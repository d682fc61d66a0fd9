"""The GPU span kernel's tuning: key slots per step and warps for each query tile (`attention.PALLAS_TUNING`).

JAX's Pallas split-K decode kernel (`jax.experimental.pallas.ops.gpu.decode_attention.mqa`) over one layer's
cache, 8 KV heads of 128 at batch 1, for the query rows per KV head the package runs: 4 (a greedy token, 4
query heads per KV head), 64 (a 16-token block) and 68 (a 17-token DSpark verify). Each configuration is timed
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

from dflash_jax.attention import PALLAS_TUNING, pallas_tile, split_keys

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
    parser.add_argument("--keys-per-split", type=int, nargs="+", default=[1024, 2048])
    args = parser.parse_args()
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}")
    print("| span | rows | tile | floor ms | fastest ms | key slots/step | warps | keys/split | ms at the package's "
          "tuning |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for T, row_counts in ((T, args.rows) for T in args.spans):
        k = jax.random.normal(jax.random.key(0), (KV_HEADS, T, HEAD_DIM), jnp.bfloat16)  # [heads, T, d]
        v = jax.random.normal(jax.random.key(1), (KV_HEADS, T, HEAD_DIM), jnp.bfloat16)
        stop = jnp.full((KV_HEADS,), T - 200, jnp.int32)
        floor = 2 * k.nbytes / 4.0e12 * 1e3
        for rows in row_counts:
            q = jax.random.normal(jax.random.key(2), (KV_HEADS, rows, HEAD_DIM), jnp.bfloat16)
            tile = pallas_tile(rows)
            times = {}
            for block_k, warps, per_split in itertools.product((64, 128), (2, 4, 8), args.keys_per_split):
                if per_split > T:
                    continue
                def attend(q, k, v, stop, tile=tile, block_k=block_k, warps=warps, splits=T // per_split):
                    return decode_attention.mqa(
                        q, k, v, start_idx=jnp.zeros_like(stop), kv_seq_len=stop, sm_scale=HEAD_DIM**-0.5,
                        block_h=tile, block_k=block_k, k_splits=splits, return_residuals=True, num_warps=warps)

                times[block_k, warps, per_split] = loop_ms(attend, q, k, v, stop)
            best = min(times, key=times.get)
            print(f"| {T} | {rows} | {tile} | {floor:.4f} | {times[best]:.4f} | {best[0]} | {best[1]} | {best[2]} | "
                  f"{times.get((*PALLAS_TUNING[tile], split_keys(T, tile)), float('nan')):.4f} |", flush=True)


if __name__ == "__main__":
    main()

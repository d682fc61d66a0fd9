"""The GPU span kernel: the package's Pallas Mosaic GPU kernel (`_span_attention_mgpu.span_partials`) beside JAX's
Pallas Triton decode kernel that it replaced (`jax.experimental.pallas.ops.gpu.decode_attention.mqa`, at the tuning
the package used: `TRITON_TUNING`), each beside its floor, and the Mosaic kernel's tuning.

One layer's cache, 8 KV heads of 128 at batch 1 (or `--batch`), for the query rows per KV head the package runs: 4
(a greedy token, 4 query heads per KV head), 64 (a 16-token block) and 68 (a 17-token DSpark verify); each span
ends 200 slots before the capacity. Each configuration is timed over `LOOP` calls inside one jitted loop (a call is
~0.05 ms: timed one by one, dispatch would dominate); both kernels' times include their split merges. Floor: the
K and V bytes of the span at the read rate of a `jnp.sum` over 4 GiB of bf16 measured in the same run. Check: the
two kernels' normalised outputs differ by at most `max_diff` (both round P to bf16).

    XLA_PYTHON_CLIENT_PREALLOCATE=false python benchmarks/pallas_tiles.py [--spans 131072 --rows 64] [--sweep]
        [--json PATH]
"""

import argparse
import itertools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu import decode_attention  # Pallas Triton: the kernel compared against

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from dflash_jax._span_attention_mgpu import span_partials  # noqa: E402
from dflash_jax.attention import Span, _span_xla, kernel_keys_per_split, pallas_tile  # noqa: E402
from dflash_jax.platform import process_platform  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from timing import read_rate  # noqa: E402

LOOP = 20
KV_HEADS, HEAD_DIM = 8, 128
# The package's tuning of the Triton kernel before the port, by query tile rows: (key slots per step, warps,
# software-pipelining stages), measured on an H200 (docs/benchmarks.md).
TRITON_TUNING = {16: (128, 4, 2), 32: (128, 4, 2), 64: (64, 4, 3), 128: (64, 4, 2)}


def loop_ms(attend, q, *args) -> float:
    """ms per call of `attend(q, *args)`, chained `LOOP` times in one jitted loop (each output feeds the next q)."""
    run = jax.jit(lambda q, *a: jax.lax.fori_loop(0, LOOP, lambda i, q: q + 1e-3 * attend(q, *a).astype(q.dtype), q))
    jax.block_until_ready(run(q, *args))
    start = time.perf_counter()
    jax.block_until_ready(run(run(q, *args), *args))
    return (time.perf_counter() - start) / (2 * LOOP) * 1e3


def triton(q, k, v, stop, *, per_split):
    """[batch, n_kv, rows, d] -> the normalised output, through the Triton kernel at the package's former tuning."""
    batch, n_kv, rows, d = q.shape
    T = k.shape[2]
    tile = pallas_tile(rows)
    block_k, warps, stages = TRITON_TUNING[tile]
    heads = lambda a: a.reshape(batch * n_kv, *a.shape[2:])  # noqa: E731
    stop = jnp.repeat(stop, n_kv)
    with jax.numpy_dtype_promotion("standard"):
        out = decode_attention.mqa(heads(q), heads(k), heads(v), start_idx=jnp.zeros_like(stop), kv_seq_len=stop,
                                   sm_scale=d**-0.5, block_h=tile, block_k=block_k, k_splits=T // per_split,
                                   num_warps=warps, num_stages=stages)
    return out.reshape(q.shape)


def mosaic(q, k, v, stop, *, per_split, block_k=None, stages=None):
    """[batch, n_kv, rows, d] -> the normalised output, through the package's Mosaic GPU kernel (by default at this
    device's `span_block_k` and `span_stages`)."""
    tuning = process_platform().tuning
    block_k, stages = block_k or tuning.span_block_k, stages or tuning.span_stages
    acc, _, l = span_partials(q, k, v, jnp.zeros_like(stop), stop, keys_per_split=per_split, block_k=block_k,
                              stages=stages)
    return acc / jnp.where(l > 0, l, 1.0)[..., None]


def xla(q, k, v, stop):
    """[batch, n_kv, rows, d] -> the normalised output, through the package's XLA span loop (`span_block` keys a
    step): what `attention.attend` runs where the kernel does not apply."""
    p = _span_xla(q[:, :, :, None], Span(k, v, jnp.zeros_like(stop), stop),
                  process_platform().tuning.span_block)
    return (p.acc / jnp.where(p.l > 0, p.l, 1.0)[..., None])[:, :, :, 0].astype(q.dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spans", type=int, nargs="+", default=[2048, 32768, 131072])
    parser.add_argument("--rows", type=int, nargs="+", default=[4, 64, 68], help="query rows per KV head")
    parser.add_argument("--batch", type=int, default=1, help="sequences (each with --kv-heads KV heads)")
    parser.add_argument("--kv-heads", type=int, default=KV_HEADS)
    parser.add_argument("--head-dim", type=int, default=HEAD_DIM)
    parser.add_argument("--xla", action="store_true", help="also time the XLA span loop")
    parser.add_argument("--keys-per-split", type=int, nargs="+", default=None,
                        help="also time the Mosaic kernel at these split lengths (the package's is always timed)")
    parser.add_argument("--sweep", action="store_true",
                        help="also time the Mosaic kernel at other key slots per step, stages and split lengths")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    rate = read_rate(4)
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; read rate {rate / 1e12:.2f} TB/s (jnp.sum)")
    print(f"batch {args.batch}, {args.kv_heads} KV heads of {args.head_dim}\n"
          "| span | rows | floor ms | triton ms | mosaic ms | mosaic/triton | max diff |"
          "\n|---:|---:|---:|---:|---:|---:|---:|", flush=True)
    rows_out = []
    for T, rows in itertools.product(args.spans, args.rows):
        shape = (args.batch, args.kv_heads, T, args.head_dim)
        k = jax.random.normal(jax.random.key(0), shape, jnp.bfloat16)
        v = jax.random.normal(jax.random.key(1), shape, jnp.bfloat16)
        q = jax.random.normal(jax.random.key(2), (args.batch, args.kv_heads, rows, args.head_dim), jnp.bfloat16)
        stop = jnp.full((args.batch,), T - 200, jnp.int32)
        # the package's split length, which both kernels use (a `span_capacity` holds it whole)
        per_split = kernel_keys_per_split(T, rows, args.batch * args.kv_heads)
        floor = 2 * k.nbytes * (T - 200) / T / rate * 1e3  # the span's K and V, read once
        base = {"triton": lambda *a, p=per_split: triton(*a, per_split=p),
                "mosaic": lambda *a, p=per_split: mosaic(*a, per_split=p)}
        if pallas_tile(rows) not in TRITON_TUNING:  # the former package never ran Triton on tiles this tall
            base["triton"] = base["mosaic"]
        ms = {name: loop_ms(fn, q, k, v, stop) for name, fn in base.items()}
        diff = float(jnp.max(jnp.abs(base["triton"](q, k, v, stop).astype(jnp.float32)
                                     - base["mosaic"](q, k, v, stop).astype(jnp.float32))))
        print(f"| {T} | {rows} | {floor:.4f} | {ms['triton']:.4f} | {ms['mosaic']:.4f} | "
              f"{ms['mosaic'] / ms['triton']:.3f} | {diff:.2e} |", flush=True)
        row = {"span": T, "rows": rows, "batch": args.batch, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
               "keys_per_split": per_split, "floor_ms": floor, **{f"{name}_ms": t for name, t in ms.items()},
               "max_diff": diff}
        if args.xla:
            row["xla_ms"] = loop_ms(xla, q, k, v, stop)
            print(f"    xla span loop: {row['xla_ms']:.4f} ms", flush=True)
        for split in args.keys_per_split or ():
            if split != per_split and T % split == 0:
                row[f"mosaic_{split}_ms"] = loop_ms(lambda *a, p=split: mosaic(*a, per_split=p), q, k, v, stop)
                print(f"    mosaic, {split} keys a split: {row[f'mosaic_{split}_ms']:.4f} ms", flush=True)
        if args.sweep:
            sweep = {}
            splits = (per_split // 2, per_split, 2 * per_split)
            for block_k, stages, split in itertools.product((64, 128), (1, 2, 3), splits):
                if split < block_k or split > T:
                    continue
                try:
                    sweep[f"block_k {block_k} stages {stages} keys/split {split}"] = loop_ms(
                        lambda *a, b=block_k, s=stages, p=split: mosaic(*a, per_split=p, block_k=b, stages=s),
                        q, k, v, stop)
                except Exception as e:  # noqa: BLE001  more slots or stages than shared memory holds
                    print(f"    block_k {block_k} stages {stages} keys/split {split}: {type(e).__name__}")
            for label, t in sorted(sweep.items(), key=lambda kv: kv[1])[:5]:
                tuning = process_platform().tuning
                print(f"    {label}: {t:.4f} ms (default: {tuning.span_block_k}, {tuning.span_stages}, {per_split})")
            row["mosaic_sweep_ms"] = sweep
        rows_out.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"jax": jax.__version__, "device": jax.devices()[0].device_kind, "read_rate_bytes_per_s": rate,
                       "rows": rows_out, "time": time.strftime("%Y-%m-%d %H:%M")}, f, indent=1)
    assert all(r["max_diff"] < 2e-2 for r in rows_out), "the kernels disagree"


if __name__ == "__main__":
    main()

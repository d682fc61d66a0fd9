"""NVFP4 -> bf16 dequantization on the GPU: correctness first, then speed against a copy ceiling and the XLA path.

    PYTHONUNBUFFERED=1 python3 benchmarks/nvfp4_dequant.py [--sweep] [--out DIR]

1. Check: for every shape, fresh random bytes (scale bytes: all finite E4M3), the Pallas kernel == the XLA
   path bit for bit (+0 == -0), and the XLA path == a NumPy reference on the first and last 64 rows.
2. Time, per shape: (a) `jnp.copy` of a u32 buffer of 1.28125 B/element (the same bytes, read once and
   written once), (b) the XLA path, (c) the Pallas kernel (default tile; with --sweep, other tiles on a
   few shapes too). Each timed call runs one jitted program over S distinct input sets (S * bytes moved
   >= 2 GB, at most 64 sets: far more than the 60 MB L2, and a call long enough that its launch cost is
   small); the sets are chained through optimization barriers so XLA neither merges nor reorders them. Time per
   tensor = median wall time of a call / S; GB/s counts 2.5625 B/element.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from dflash_jax.nvfp4 import _pallas  # noqa: E402
from dflash_jax.nvfp4._reference import dequantize_xla  # noqa: E402
from dflash_jax.tuning import tuning

sys.path.insert(0, os.path.dirname(__file__))
from timing import call_seconds  # noqa: E402

BYTES_PER_ELEMENT = 2.5625  # 0.5 packed + 1/16 scale read, 2 written
SHAPES = {  # name: (N, K)
    "fc": (2048, 10240), "q_proj": (4096, 2048), "o_proj": (2048, 4096), "k/v_proj": (512, 2048),
    "gate/up": (6144, 2048), "down": (2048, 6144), "K=5376": (2048, 5376), "N=17408": (17408, 2048),
    "N=1": (1, 2048), "ragged": (4097, 2080), "8192^2": (8192, 8192), "32768x16384": (32768, 16384),
}
SWEEP_SHAPES = ("k/v_proj", "8192^2", "32768x16384")
SWEEP = [(128, 4), (256, 4), (512, 4), (1024, 4), (2048, 4), (1024, 8)]
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def random_inputs(key, n, k):
    """packed [N, K/2] u8 (any byte), scale bits [N, K/16] u8 (finite E4M3: no 0x7F/0xFF), made on the device."""
    k1, k2 = jax.random.split(key)
    packed = jax.random.bits(k1, (n, k // 2), jnp.uint8)
    scale = jax.random.bits(k2, (n, k // 16), jnp.uint8)
    scale = jnp.where((scale & 0x7F) == 0x7F, scale ^ 1, scale)
    return packed, scale


def numpy_reference(packed, scale, scale_2):
    codes = np.stack([packed & 15, packed >> 4], -1).reshape(packed.shape[0], -1)
    block = scale.view(ml_dtypes.float8_e4m3fn).astype(np.float32) * np.float32(scale_2)
    return (E2M1[codes] * np.repeat(block, 16, -1)).astype(ml_dtypes.bfloat16)


def xla_path(packed, scale, scale_2):
    return dequantize_xla(packed, lax.bitcast_convert_type(scale, jnp.float8_e4m3fn), scale_2, jnp.bfloat16)


def pallas_path(rows=None, warps=None):
    return lambda packed, scale, scale_2: _pallas.dequantize_pallas(
        packed, scale, scale_2, dtype=jnp.bfloat16, rows=rows, num_warps=warps)


@jax.jit
def mismatches(a, b):
    """Elements whose bf16 bits differ, +0 == -0."""
    a, b = lax.bitcast_convert_type(a, jnp.uint16), lax.bitcast_convert_type(b, jnp.uint16)
    same = (a == b) | (((a | b) & 0x7FFF) == 0)
    return jnp.sum(~same, dtype=jnp.int64 if jax.config.jax_enable_x64 else jnp.int32)


def check(name, n, k, key):
    packed, scale = random_inputs(key, n, k)
    scale_2 = jnp.float32(np.random.default_rng().uniform(1e-4, 1e-1))
    xla = xla_path(packed, scale, scale_2)
    bad = int(mismatches(_pallas.dequantize_pallas(packed, scale, scale_2, dtype=jnp.bfloat16), xla))
    rows = np.unique(np.r_[0:min(64, n), max(n - 64, 0):n])
    host = numpy_reference(np.asarray(packed[rows]), np.asarray(scale[rows]), np.float32(scale_2))
    xla_rows = np.asarray(xla[rows]).view(np.uint16)
    host_bits = host.view(np.uint16)
    bad_ref = int(np.count_nonzero((xla_rows != host_bits) & (((xla_rows | host_bits) & 0x7FFF) != 0)))
    print(f"check {name:12s} [{n}, {k}]: pallas != xla in {bad} of {n * k}; xla != numpy in {bad_ref} "
          f"of {rows.size * k} (rows 0-63 and last 64)", flush=True)
    return bad == 0 and bad_ref == 0


def time_per_tensor(fn, make_args, bytes_per_set, repeats):
    """Median seconds per call of `fn` over S chained argument sets (see the module docstring)."""
    n_sets = int(min(64, max(2, np.ceil(2e9 / bytes_per_set))))
    sets = [make_args(i) for i in range(n_sets)]

    @jax.jit
    def run(sets):
        outs, previous = [], None
        for args in sets:
            if previous is not None:
                args, _ = lax.optimization_barrier((args, previous))
            previous = fn(*args)
            outs.append(previous)
        return outs

    return statistics.median(call_seconds(lambda: run(sets), repeats, warmup=2)) / n_sets


def bench(name, n, k, key, sweep):
    moved = BYTES_PER_ELEMENT * n * k
    repeats = 10 if moved > 1e9 else 20
    scale_2 = jnp.float32(0.01)
    keys = jax.random.split(key, 64)
    inputs = lambda i: (*random_inputs(keys[i], n, k), scale_2)  # noqa: E731
    words = round(moved / 2 / 4)  # u32 words read once and written once
    t_copy = time_per_tensor(jnp.copy, lambda i: (jax.random.bits(keys[i], (words,), jnp.uint32),), moved, repeats)
    t_xla = time_per_tensor(xla_path, inputs, moved, repeats)
    results = {"copy": t_copy, "xla": t_xla}
    configs = [(None, None)] + (SWEEP if sweep and name in SWEEP_SHAPES else [])
    for rows, warps in configs:
        label = "pallas" if rows is None else f"pallas r{rows} w{warps}"
        results[label] = time_per_tensor(pallas_path(rows, warps), inputs, moved, repeats)
    print(f"\n{name} [{n}, {k}]  {moved / 1e6:.1f} MB moved  (default tile: {tuning().nvfp4_rows} blocks of 16, "
          f"{tuning().nvfp4_warps} warps)")
    for label, t in results.items():
        print(f"  {label:22s} {t * 1e6:9.1f} us {moved / t / 1e9:8.0f} GB/s  {t_copy / t:6.1%} of copy"
              f"  {t_xla / t:5.2f}x xla", flush=True)
    return {label: moved / t / 1e9 for label, t in results.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true", help="also time every tile size on a few shapes")
    parser.add_argument("--out", default=os.environ.get("OUT"), help="directory for results.json")
    args = parser.parse_args()
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}", flush=True)
    key = jax.random.key(int(time.time()))
    ok = all([check(name, n, k, jax.random.fold_in(key, i)) for i, (name, (n, k)) in enumerate(SHAPES.items())])
    print(f"bit-identical on every shape: {ok}", flush=True)
    if args.out:  # what XLA makes of both paths, for one shape
        packed, scale = random_inputs(key, 8192, 8192)
        for label, fn in (("xla", xla_path), ("pallas", pallas_path())):
            with open(os.path.join(args.out, f"hlo_{label}.txt"), "w") as f:
                f.write(jax.jit(fn).lower(packed, scale, jnp.float32(0.01)).compile().as_text())
    warm_up = jax.jit(lambda x: x + 1)  # bring the clocks up before the first timing
    x = jnp.zeros((2**28,), jnp.uint32)
    for _ in range(200):
        x = warm_up(x)
    x.block_until_ready()
    table = {name: bench(name, n, k, jax.random.fold_in(key, 100 + i), args.sweep)
             for i, (name, (n, k)) in enumerate(SHAPES.items())}
    print(f"\n{'shape':14s} {'copy GB/s':>10s} {'xla GB/s':>9s} {'pallas GB/s':>12s} {'of copy':>8s} {'vs xla':>7s}")
    for name, r in table.items():
        print(f"{name:14s} {r['copy']:10.0f} {r['xla']:9.0f} {r['pallas']:12.0f} {r['pallas'] / r['copy']:8.1%}"
              f" {r['pallas'] / r['xla']:6.2f}x")
    if args.out:
        with open(os.path.join(args.out, "nvfp4_dequant.json"), "w") as f:
            json.dump({"jax": jax.__version__, "device": jax.devices()[0].device_kind, "bit_identical": ok,
                       "gb_per_s": table}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

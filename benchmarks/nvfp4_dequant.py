"""NVFP4 -> bf16 dequantization on the GPU: the package's Pallas Mosaic GPU kernel beside the Pallas Triton kernel it
replaced (kept here, and only here, for this comparison) and the XLA path, each beside its floor.

    PYTHONUNBUFFERED=1 python3 benchmarks/nvfp4_dequant.py [--sweep] [--json PATH] [--hlo DIR]

1. Check: for every shape, fresh random bytes (scale bytes: all finite E4M3): Mosaic == Triton == XLA bit for bit
   (+0 == -0), and XLA == a NumPy reference on the first and last 64 rows.
2. Time, per shape: the XLA path, the Triton kernel, the Mosaic kernel (default tiles; with --sweep, other tiles
   on a few shapes too). Each timed call runs one jitted program over S distinct input sets (S * bytes moved
   >= 2 GB, at most 64 sets: far more than the 60 MB L2, and a call long enough that its launch cost is small);
   the sets are chained through optimization barriers so XLA neither merges nor reorders them. Time per tensor =
   median wall time of a call / S. Floor: the bytes read and written (2.5625 B per value: 0.5 packed + 1/16
   scale read, 2 written) at the read rate of a `jnp.sum` over 4 GiB of bf16 measured in the same run.

The Triton kernel is the package's former `nvfp4/_pallas.py` (jax 0.11 deprecates the Pallas Triton lowering):
one program per 128 blocks of 16 values, 4 warps, the blocks viewed [R, 2, 4] bytes with masked loads and stores
in the last program, decoding with jax ops (`decode` below: an f16 per code, f32 products, a bf16 per value), the
arithmetic the Mosaic kernel had before its decode became inline PTX.
"""

from __future__ import annotations

import argparse
import functools
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
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt  # deprecated in jax 0.11: the kernel compared against

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from dflash_jax.nvfp4 import _mosaic_gpu  # noqa: E402
from dflash_jax.nvfp4._reference import dequantize_xla  # noqa: E402
from dflash_jax.platform import process_platform  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from timing import call_seconds, read_rate  # noqa: E402

BYTES_PER_ELEMENT = 2.5625  # 0.5 packed + 1/16 scale read, 2 written
SHAPES = {  # name: (N, K)
    "fc": (2048, 10240), "q_proj": (4096, 2048), "o_proj": (2048, 4096), "k/v_proj": (512, 2048),
    "gate/up": (6144, 2048), "down": (2048, 6144), "K=5376": (2048, 5376), "N=17408": (17408, 2048),
    "N=1": (1, 2048), "ragged": (4097, 2080), "8192^2": (8192, 8192), "32768x16384": (32768, 16384),
}
SWEEP_SHAPES = ("k/v_proj", "8192^2", "32768x16384")
TRITON_SWEEP = [(256, 4), (512, 4), (1024, 4)]  # (blocks per program, warps); the default is (128, 4)
MOSAIC_SWEEP = [128, 512, 1024]  # blocks per CTA; the default is the device kind's `tuning.Tuning.nvfp4_tile`
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


# --- the Pallas Triton kernel the package used before (jax.experimental.pallas.triton) -----------------------------

def _f16_bits_to_f32(bits):
    """Low 16 bits of a u32 read as an f16, widened exactly to f32."""
    return lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.float16).astype(jnp.float32)


def _e2m1_to_f32(code):
    """E2M1 code (u32 in [0, 15]) -> f32 exactly: the magnitude bits under an f16 exponent are the value x 2^-14."""
    return _f16_bits_to_f32(((code & 7) << 9) | ((code & 8) << 12)) * 16384.0


def _to_bits(x, dtype):
    """f32 -> dtype (round to nearest even) -> its 16 bits in a u32."""
    return lax.bitcast_convert_type(x.astype(dtype), jnp.uint16).astype(jnp.uint32)


def decode(w, s, scale_2, dtype):
    """Packed bytes `w [R, ...]` u8 with their blocks' scale bytes `s [R]` u8 -> `[R, ...]` u32 output words (low
    half: element 2j, high half: 2j + 1)."""
    block_scale = _mosaic_gpu.e4m3_to_f32(s.astype(jnp.uint32)) * scale_2  # [R] f32
    block_scale = lax.broadcast_in_dim(block_scale, w.shape, (0,))  # [R, ...]
    w = w.astype(jnp.uint32)
    return (_to_bits(_e2m1_to_f32(w & 15) * block_scale, dtype)
            | (_to_bits(_e2m1_to_f32(w >> 4) * block_scale, dtype) << 16))


def _triton_kernel(w_ref, s_ref, g_ref, o_ref, *, n_blocks: int, dtype):
    # w_ref [R, 2, 4] u8 (8 packed bytes per block), s_ref [R] u8 (E4M3 bits), g_ref [1] f32, o_ref [R, 2, 4] u32
    rows = s_ref.shape[0]
    if n_blocks % rows:  # the last program runs past the end: mask its rows
        row = pl.program_id(0) * rows + lax.broadcasted_iota(jnp.int32, (rows,), 0)
        valid = row < n_blocks  # [R]
        valid_bytes = jnp.broadcast_to(valid[:, None, None], w_ref.shape)  # [R, 2, 4]
        s = plt.load(s_ref, mask=valid, other=0)
        w = plt.load(w_ref, mask=valid_bytes, other=0)
    else:
        s, w = s_ref[...], w_ref[...]
    words = decode(w, s, g_ref[0], dtype)  # [R, 2, 4] u32
    if n_blocks % rows:
        plt.store(o_ref, words, mask=valid_bytes)
    else:
        o_ref[...] = words


@functools.partial(jax.jit, static_argnames=("rows", "num_warps"))
def dequantize_triton(packed, scale_bits, scale_2, *, rows: int = 128, num_warps: int = 4):
    """packed [N, K/2] u8, scale_bits [N, K/16] u8, scale_2 f32 [] -> [N, K] bf16, through Pallas Triton."""
    *lead, half_k = packed.shape
    n_blocks = packed.size // 8
    words = pl.pallas_call(
        functools.partial(_triton_kernel, n_blocks=n_blocks, dtype=jnp.bfloat16),
        out_shape=jax.ShapeDtypeStruct((n_blocks, 2, 4), jnp.uint32),
        grid=(pl.cdiv(n_blocks, rows),),
        in_specs=[pl.BlockSpec((rows, 2, 4), lambda i: (i, 0, 0)), pl.BlockSpec((rows,), lambda i: (i,)),
                  pl.BlockSpec((1,), lambda i: (0,))],
        out_specs=pl.BlockSpec((rows, 2, 4), lambda i: (i, 0, 0)),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
    )(packed.reshape(n_blocks, 2, 4), scale_bits.reshape(n_blocks), scale_2.reshape(1))
    return lax.bitcast_convert_type(words, jnp.bfloat16).reshape(*lead, 2 * half_k)


# --- checks and timing ------------------------------------------------------------------------------------------------

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


def mosaic_path(tile=None):
    tile = tile or process_platform().tuning.nvfp4_tile  # this device kind's by default
    return lambda packed, scale, scale_2: _mosaic_gpu.dequantize_mosaic_gpu(packed, scale, scale_2, tile=tile)


def triton_path(rows=128, warps=4):
    return lambda packed, scale, scale_2: dequantize_triton(packed, scale, scale_2, rows=rows, num_warps=warps)


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
    bad = {label: int(mismatches(fn()(packed, scale, scale_2), xla))
           for label, fn in (("mosaic", mosaic_path), ("triton", triton_path))}
    rows = np.unique(np.r_[0:min(64, n), max(n - 64, 0):n])
    host = numpy_reference(np.asarray(packed[rows]), np.asarray(scale[rows]), np.float32(scale_2)).view(np.uint16)
    xla_rows = np.asarray(xla[rows]).view(np.uint16)
    bad["numpy"] = int(np.count_nonzero((xla_rows != host) & (((xla_rows | host) & 0x7FFF) != 0)))
    print(f"check {name:12s} [{n}, {k}]: != xla in mosaic {bad['mosaic']}, triton {bad['triton']} of {n * k}; "
          f"xla != numpy in {bad['numpy']} of {rows.size * k} (rows 0-63 and last 64)", flush=True)
    return not any(bad.values())


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


def bench(name, n, k, key, sweep, rate):
    moved = BYTES_PER_ELEMENT * n * k
    repeats = 10 if moved > 1e9 else 20
    keys = jax.random.split(key, 64)
    inputs = lambda i: (*random_inputs(keys[i], n, k), jnp.float32(0.01))  # noqa: E731
    paths = {"xla": xla_path, "triton": triton_path(), "mosaic": mosaic_path()}
    if sweep and name in SWEEP_SHAPES:
        paths.update({f"triton r{rows} w{warps}": triton_path(rows, warps) for rows, warps in TRITON_SWEEP})
        paths.update({f"mosaic t{tile}": mosaic_path(tile) for tile in MOSAIC_SWEEP})
    us = {label: time_per_tensor(fn, inputs, moved, repeats) * 1e6 for label, fn in paths.items()}
    floor_us = moved / rate * 1e6
    print(f"\n{name} [{n}, {k}]  {moved / 1e6:.1f} MB moved, floor {floor_us:.1f} us")
    for label, t in us.items():
        print(f"  {label:18s} {t:9.1f} us {moved / t / 1e3:8.0f} GB/s  {floor_us / t:6.1%} of floor"
              f"  {us['triton'] / t:5.2f}x triton", flush=True)
    return {"shape": name, "n": n, "k": k, "floor_us": floor_us, "us": us}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true", help="also time other tile sizes on a few shapes")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--hlo", help="directory for what XLA makes of each path, for one shape")
    args = parser.parse_args()
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}", flush=True)
    key = jax.random.key(int(time.time()))
    ok = all([check(name, n, k, jax.random.fold_in(key, i)) for i, (name, (n, k)) in enumerate(SHAPES.items())])
    print(f"bit-identical on every shape (mosaic == triton == xla == numpy): {ok}", flush=True)
    if args.hlo:
        packed, scale = random_inputs(key, 8192, 8192)
        for label, fn in (("xla", xla_path), ("triton", triton_path()), ("mosaic", mosaic_path())):
            with open(os.path.join(args.hlo, f"hlo_{label}.txt"), "w") as f:
                f.write(jax.jit(fn).lower(packed, scale, jnp.float32(0.01)).compile().as_text())
    rate = read_rate(4)
    print(f"read rate {rate / 1e12:.2f} TB/s (jnp.sum over 4 GiB of bf16)", flush=True)
    rows = [bench(name, n, k, jax.random.fold_in(key, 100 + i), args.sweep, rate)
            for i, (name, (n, k)) in enumerate(SHAPES.items())]
    print(f"\n{'shape':14s} {'floor us':>9s} {'xla us':>9s} {'triton us':>10s} {'mosaic us':>10s}"
          f" {'mosaic/triton':>14s}")
    for r in rows:
        us = r["us"]
        print(f"{r['shape']:14s} {r['floor_us']:9.1f} {us['xla']:9.1f} {us['triton']:10.1f} {us['mosaic']:10.1f}"
              f" {us['mosaic'] / us['triton']:14.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"jax": jax.__version__, "device": jax.devices()[0].device_kind, "bit_identical": ok,
                       "read_rate_bytes_per_s": rate, "bytes_per_element": BYTES_PER_ELEMENT, "rows": rows,
                       "time": time.strftime("%Y-%m-%d %H:%M")}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

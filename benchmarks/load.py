"""Load benchmark: our `load_drafter` against the naive path and the ceiling, each in a fresh process.

    python benchmarks/load.py [--dir /tmp/dflash_load_bench] [--devices 1 2] [--repeat 3]
    python benchmarks/load.py --small --methods ours naive   # a tiny checkpoint: a CPU check of the script

The workload is a checkpoint with the Qwen3.6-35B-A3B-DFlash shapes (preset
`zlab-qwen3.6-35b-a3b-dflash-v2`: 91 BF16 tensors, 948 MB) and its NVFP4 twin, written once by
`dflash_jax.testing.write_checkpoint`. Methods (each run in its own process, page cache warm):
- `ours`: `load_drafter(path, mesh=<first N local devices>, weights="dequantized")`, bf16, replicated (the NVFP4
  twin dequantized on the device, whatever `weights="auto"` would place); its cache of compiled
  conversions (`DFLASH_JAX_CACHE_DIR`) is an empty directory: a first load on a machine;
- `ours+cache`: `ours` with that cache written by an earlier process: every later load;
- `ours-again`: `ours`, timed at the second load of the same checkpoint in one process (nothing to compile);
- `compile`: only the compilation of the NVFP4 dequantizers the loader needs;
- `naive`: `safetensors.flax.load_file` then `jax.device_put` of each tensor onto the same sharding;
- `ceiling`: the checkpoint file read into one buffer and put on the first device in one copy (the time of
  the put alone is printed below it).
Reported: wall time (median of --repeat processes), GB/s of checkpoint bytes, and peak host RSS above
the process's baseline after JAX start-up (VmHWM reset through /proc/self/clear_refs).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from dflash_jax._executables import CACHE_ENV

PRESET = "zlab-qwen3.6-35b-a3b-dflash-v2"


def rss_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def measure(method: str, path: str, devices: int) -> dict:
    """Runs in the child process: one load, timed, with its peak RSS above the baseline."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    local = jax.local_devices()[:devices]
    mesh = jax.sharding.Mesh(local, ("replica",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    jax.block_until_ready(jax.device_put(np.zeros(4), sharding))  # backend start-up outside the timing
    from dflash_jax import load_drafter  # importing the package is not part of a load

    if method == "ours-again":  # a second load in the same process: everything compiled, nothing else differs
        jax.block_until_ready(load_drafter(path, mesh=mesh, progress=False, weights="dequantized").params)
    files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
    nbytes = sum(os.path.getsize(f) for f in files)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
    except OSError:
        pass
    baseline = rss_mb("VmRSS")
    start = time.perf_counter()
    if method == "compile":  # the NVFP4 dequantizers of this checkpoint, compiled as the loader does
        out = compile_dequantizers(path, local[0])
    elif method.startswith("ours"):
        out = load_drafter(path, mesh=mesh, dtype=jnp.bfloat16, progress=False, weights="dequantized").params
    elif method == "naive":
        from safetensors.flax import load_file

        out = [jax.device_put(x, sharding) for f in files for x in load_file(f).values()]
    else:  # ceiling: one read into one buffer, one copy
        buffer = np.empty(nbytes, np.uint8)
        offset = 0
        for f in files:
            with open(f, "rb") as handle:
                offset += handle.readinto(memoryview(buffer)[offset:])
        read_done = time.perf_counter()
        out = jax.device_put(buffer, local[0])
    jax.block_until_ready(out)
    end = time.perf_counter()
    seconds = end - start
    put_seconds = end - read_done if method == "ceiling" else seconds
    return {"method": method, "devices": devices, "seconds": seconds, "gbps": nbytes / seconds / 1e9,
            "put_seconds": put_seconds,
            "peak_rss_mb": rss_mb("VmHWM") - baseline, "checkpoint_mb": nbytes / 1e6,
            "platform": local[0].platform}


def compile_dequantizers(path: str, device) -> list:
    """Compile one dequantizer per distinct packed shape, on a thread pool (the loader's strategy)."""
    import functools
    from concurrent.futures import ThreadPoolExecutor

    import jax
    import jax.numpy as jnp

    from dflash_jax.nvfp4 import dequantize
    from dflash_jax.safetensors import Checkpoint

    with Checkpoint(path) as ckpt:
        shapes = sorted({ckpt[n].shape for n in ckpt if ckpt[n].dtype == "U8"})
    sharding = jax.sharding.SingleDeviceSharding(device)

    def compile_one(shape):
        specs = [jax.ShapeDtypeStruct(shape, jnp.uint8, sharding=sharding),
                 jax.ShapeDtypeStruct((shape[0], shape[1] // 8), jnp.float8_e4m3fn, sharding=sharding),
                 jax.ShapeDtypeStruct((), jnp.float32, sharding=sharding)]
        fn = functools.partial(dequantize, dtype=jnp.bfloat16)
        return jax.jit(fn).lower(*specs).compile()

    with ThreadPoolExecutor(8) as pool:
        compiled = list(pool.map(compile_one, shapes))
    return [jnp.zeros(len(compiled))]


def run_child(method: str, path: str, devices: int) -> dict:
    """One measurement in a fresh process; its executable cache is empty unless the method is `ours+cache`."""
    with tempfile.TemporaryDirectory() as empty:
        kept = os.path.join(os.path.dirname(os.path.abspath(path)), "executable_cache")  # absolute, or no cache
        cache = kept if method == "ours+cache" else empty
        out = subprocess.run([sys.executable, __file__, "--child", method, path, str(devices)],
                             capture_output=True, text=True, check=True, env={**os.environ, CACHE_ENV: cache})
    return json.loads(out.stdout.strip().splitlines()[-1])


def warm_page_cache(path: str) -> None:
    for f in os.listdir(path):
        with open(os.path.join(path, f), "rb") as handle:
            while handle.read(1 << 24):
                pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="/tmp/dflash_load_bench")
    parser.add_argument("--devices", type=int, nargs="+", default=[1])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--methods", nargs="+", default=None, help="only these methods (default: all)")
    parser.add_argument("--child", nargs=3, metavar=("METHOD", "PATH", "DEVICES"), help=argparse.SUPPRESS)
    parser.add_argument("--small", action="store_true", help="a tiny-dflash checkpoint, one process per method (a CPU "
                        "check of the script)")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child[0], args.child[1], int(args.child[2]))))
        return
    from dflash_jax.testing import write_checkpoint

    preset = "tiny-dflash" if args.small else PRESET
    if args.small:
        args.dir, args.repeat = os.path.join(args.dir, "small"), 1
    bf16, nvfp4 = os.path.join(args.dir, "bf16"), os.path.join(args.dir, "nvfp4")
    for directory, quantized in ((bf16, False), (nvfp4, True)):
        if not os.path.isfile(os.path.join(directory, "config.json")):
            write_checkpoint(directory, preset, nvfp4=quantized)
        warm_page_cache(directory)
    runs = [("ceiling", bf16, 1), ("naive", bf16, 1), ("ours", bf16, 1), ("ours", nvfp4, 1),
            ("compile", nvfp4, 1)]
    runs += [("ours+cache", nvfp4, 1), ("ours-again", bf16, 1), ("ours-again", nvfp4, 1)]
    runs += [(m, bf16, n) for n in args.devices if n > 1 for m in ("naive", "ours")]
    runs += [(m, nvfp4, n) for n in args.devices if n > 1 for m in ("ours", "ours+cache")]
    runs = [r for r in runs if args.methods is None or r[0] in args.methods]
    if any(r[0] == "ours+cache" for r in runs):
        shutil.rmtree(os.path.join(args.dir, "executable_cache"), ignore_errors=True)
        run_child("ours+cache", nvfp4, 1)  # an earlier process writes the executable cache
    print(f"{'method':<14} {'checkpoint':<10} {'devices':>7} {'seconds':>8} {'GB/s':>6} {'peak RSS MB':>12}")
    for method, path, devices in runs:
        results = [run_child(method, path, devices) for _ in range(args.repeat)]
        best = sorted(results, key=lambda r: r["seconds"])[len(results) // 2]
        rss = statistics.median(r["peak_rss_mb"] for r in results)
        print(f"{method:<14} {os.path.basename(path):<10} {devices:>7} {best['seconds']:>8.3f} "
              f"{best['gbps']:>6.2f} {rss:>12.0f}   ({best['checkpoint_mb']:.0f} MB, {best['platform']})",
              flush=True)
        if method == "ceiling":
            put = statistics.median(r["put_seconds"] for r in results)
            print(f"{'  of which the one put':<41} {put:>8.3f} {best['checkpoint_mb'] / 1e3 / put:>6.2f}")


if __name__ == "__main__":
    main()

"""A drafter's linear weights in the forms `load_drafter(weights="packed")` keeps them, made on the device from a
random bf16 drafter (no checkpoint): for benchmarks at real sizes (`draft_step.py`, `long_context.py`).

Forms: "bf16" (as drawn), "nvfp4" (packed NVFP4: random codes, unit block scales, a `scale_2` that gives the bf16
weight's rms; products by `nvfp4.matmul`'s "auto": the Pallas Mosaic GPU kernel on Hopper), "nvfp4-xla" (the same
with XLA's dequantize-then-dot: `nvfp4.packed.AUTO_MOSAIC` cleared while its programs are traced, `packed_backend`),
"nvfp4-kernel" (packed only where the Mosaic kernel takes the weight's shape, `KERNEL_N` / `KERNEL_K`; the others
bf16, as a dequantized load places them), "nvfp4-fp8" (the same NVFP4 weight with its codes one E4M3 byte each,
`nvfp4.Fp8Codes`, as `load_drafter(weights="fp8")` places it: XLA's product, bit for bit the dequantized weight's),
"fp8" (the bf16 weight in ModelOpt's per-tensor FP8, another quantization). Heads that steer the
drafts (a DSpark Markov head, a confidence head) stay bf16, so a drafter built to walk a map
(`testing.successor_drafter`) still walks it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import fp8, nvfp4
from dflash_jax.drafter import Drafter
from dflash_jax.nvfp4.checkpoint import exclusion_matcher
from dflash_jax.plan import build_tree
from dflash_jax.spec import CONFIDENCE, LINEAR, MARKOV

WEIGHTS = ("bf16", "nvfp4", "nvfp4-xla", "nvfp4-kernel", "nvfp4-fp8", "fp8")
KERNEL_N, KERNEL_K = 64, 256  # the shapes the Mosaic GEMM tiles (`nvfp4._mosaic_gemm.check_shapes`)
E2M1_RMS = float(np.sqrt(np.mean(np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6]) ** 2)))  # of uniformly random codes
KEPT_HEADS = (MARKOV, CONFIDENCE)  # top-level params names left in bf16


def quantized(drafter: Drafter, plan, weights: str) -> Drafter:
    """`drafter` with its linear weights in the form `weights` (module doc): those its config's export declares
    quantized (`quantization_config` with `exclude_modules`, as NVIDIA's Nemotron drafters ship: their Markov
    `markov_w2` included), else every one outside `KEPT_HEADS`."""
    if weights == "bf16":
        return drafter
    declared = drafter.config.quantization_config
    excluded = exclusion_matcher(declared.ignore) if declared is not None and declared.ignore else None
    leaves = []
    for i, t in enumerate(plan):
        leaf = functools.reduce(lambda node, key: node[key], t.path, drafter.params)
        kept = t.path[0] in KEPT_HEADS if excluded is None else excluded(t.name.removesuffix(".weight"))
        leaves.append(leaf if t.kind != LINEAR or kept else quantized_weight(leaf, weights, i))
    return dataclasses.replace(drafter, params=build_tree(plan, leaves))


def quantized_weight(leaf: jax.Array, weights: str, seed: int):
    """One bf16 weight `[out, in]` in the form `weights` (module doc)."""
    n, k = leaf.shape
    if weights == "nvfp4-kernel" and (n % KERNEL_N or k % KERNEL_K):
        return leaf
    if weights.startswith("nvfp4"):
        n, k = leaf.shape
        codes = jax.random.bits(jax.random.key(seed), (n, k // 2), jnp.uint8)
        spread = jnp.sqrt(jnp.mean(jnp.square(leaf.astype(jnp.float32))))  # the bf16 weight's rms
        packed = nvfp4.Packed(codes, jnp.ones((n, k // 16), jnp.float8_e4m3fn), spread / E2M1_RMS)
        if weights == "nvfp4-fp8":
            return nvfp4.Fp8Codes.from_packed(packed)
        return packed if weights == "nvfp4-xla" else nvfp4.padded(packed, KERNEL_K)  # as a load on Hopper pads
    scale = jnp.max(jnp.abs(leaf.astype(jnp.float32))) / fp8.FP8_MAX
    return fp8.Fp8((leaf.astype(jnp.float32) / scale).astype(jnp.float8_e4m3fn), scale)


@contextlib.contextmanager
def packed_backend(weights: str) -> Iterator[None]:
    """Programs traced inside run the packed products of the form `weights` as they should: for "nvfp4-xla"
    `AUTO_MOSAIC` is cleared and the compiled programs are dropped on entry and exit (a program traced for the
    other backend has the same arguments and would be reused); any other form runs as is."""
    if weights != "nvfp4-xla":
        yield
        return
    previous, nvfp4.packed.AUTO_MOSAIC = nvfp4.packed.AUTO_MOSAIC, False
    jax.clear_caches()
    try:
        yield
    finally:
        nvfp4.packed.AUTO_MOSAIC = previous
        jax.clear_caches()

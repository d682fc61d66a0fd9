"""Quantized drafters kept quantized (`load_drafter(weights="packed")`): the packed GEMMs against NumPy, packed and
dequantized drafters compute the same, greedy speculative decoding, NNX / mesh / orbax keep the leaves packed,
FP8 checkpoints in both modes, parameter bytes, and bad input.

The NumPy references decode the formats from their specifications (README "NVFP4 drafters", ModelOpt's FP8
export: E4M3 = sign, 4 exponent bits of bias 7, 3 mantissa bits, no Inf, S.1111.111 NaN), not from the package.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import dflash_jax.loader
from dflash_jax import (
    CheckpointError, draft_hidden, fp8, greedy_generate, load_drafter, nvfp4, speculative_generate,
)
from dflash_jax._qwen3_testing import random_qwen3
from dflash_jax.linen import DrafterModule
from dflash_jax.model import dot, is_quantized
from dflash_jax.nnx import DFlashDrafter
from dflash_jax.testing import write_checkpoint

from ._drafters import features
from ._io import rewrite_tensors

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float64)
RNG = np.random.default_rng(24)


def e4m3(bits: np.ndarray) -> np.ndarray:
    """float8_e4m3fn bits -> float64, from the bit layout."""
    bits = np.asarray(bits).view(np.uint8).astype(np.int64)
    sign = np.where(bits & 0x80, -1.0, 1.0)
    exponent, mantissa = (bits >> 3) & 0xF, bits & 7
    value = np.where(exponent == 0, mantissa / 8 * 2.0**-6, (1 + mantissa / 8) * 2.0 ** (exponent - 7))
    return np.where((bits & 0x7F) == 0x7F, np.nan, sign * value)


def nvfp4_reference(codes, scale, scale_2, dtype) -> np.ndarray:
    """[N, K] in `dtype` (as float64): e2m1(code) * f32(f32(scale) * scale_2), rounded once to `dtype`."""
    codes = np.asarray(codes)
    nibbles = np.stack([codes & 0xF, codes >> 4], axis=-1).reshape(codes.shape[0], -1)  # [N, K], low nibble first
    values = np.where(nibbles & 8, -1.0, 1.0) * E2M1[nibbles & 7]
    block = (e4m3(scale) * float(np.float32(scale_2))).astype(np.float32).astype(np.float64)  # f32 product
    return (values * np.repeat(block, 16, axis=1)).astype(np.float32).astype(dtype).astype(np.float64)


def fp8_reference(weight, scale, dtype) -> np.ndarray:
    """[N, K] in `dtype` (as float64): e4m3(weight) * scale in float32, rounded once to `dtype`."""
    return (e4m3(weight) * float(np.float32(scale))).astype(np.float32).astype(dtype).astype(np.float64)


def random_packed(n: int, k: int, dtype=jnp.bfloat16) -> nvfp4.Packed:
    """Random codes (every one of the 16), block scales of a trained weight's range, a small global scale."""
    codes = RNG.integers(0, 256, (n, k // 2), dtype=np.uint8)
    scale = RNG.uniform(2.0, 448.0, (n, k // 16)).astype(ml_dtypes.float8_e4m3fn)
    return nvfp4.Packed(jnp.asarray(codes), jnp.asarray(scale), jnp.float32(RNG.uniform(1e-5, 1e-4)), dtype)


def random_fp8(n: int, k: int, dtype=jnp.bfloat16) -> fp8.Fp8:
    weight = np.clip(RNG.standard_normal((n, k)) * 100, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    return fp8.Fp8(jnp.asarray(weight), jnp.float32(RNG.uniform(1e-4, 1e-3)), dtype)


# Qwen3-8B-DFlash-b16's projections at 1/16 of its widths (H 4096 -> 256, I 12288 -> 768, KV 1024 -> 64, fc 5 H).
SHAPES = {"fc": (256, 1280), "q/o": (256, 256), "k/v": (64, 256), "gate/up": (768, 256), "down": (256, 768)}


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
def test_packed_gemm_against_numpy(fmt):
    """x @ W.T with W quantized, against float64 NumPy of the dequantized weight (rounded to bf16 as the leaf's
    dtype says), at M = 16, 32, 128, output float32. The weight then matches exactly; what remains is float32
    accumulation: |error| <= K * 2^-24 * (|x| @ |W|.T) (a forward-error bound for a length-K sum). Measured:
    at most 0.01x that bound on CPU. The bf16 output rounds once more (<= 2^-8 relative)."""
    worst = 0.0
    for name, (n, k) in SHAPES.items():
        w = random_packed(n, k) if fmt == "nvfp4" else random_fp8(n, k)
        ref_w = (nvfp4_reference(w.codes, w.scale, w.scale_2, ml_dtypes.bfloat16) if fmt == "nvfp4"
                 else fp8_reference(w.weight, w.scale, ml_dtypes.bfloat16))
        matmul = nvfp4.matmul if fmt == "nvfp4" else fp8.matmul
        for m in (16, 32, 128):
            x = RNG.standard_normal((m, k)).astype(ml_dtypes.bfloat16)
            got = np.asarray(jax.jit(matmul, static_argnames="out_dtype")(x, w, out_dtype=jnp.float32))
            x64 = x.astype(np.float64)
            ref, bound = x64 @ ref_w.T, k * 2.0**-24 * (np.abs(x64) @ np.abs(ref_w).T)
            assert got.shape == (m, n) and got.dtype == np.float32
            worst = max(worst, float(np.max(np.abs(got - ref) / bound)))
            assert np.all(np.abs(got - ref) <= bound), (name, m)
        bf16 = np.asarray(matmul(x[None], w)).astype(np.float64)  # [1, 128, n] in x's dtype
        np.testing.assert_allclose(bf16[0], ref, rtol=2.0**-8, atol=1e-6 * np.abs(ref).max())
    print("worst", worst)
    assert worst < 0.1  # the margin: measured <= 0.01 (XLA:CPU sums in float32 pairwise / blocked)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """NVFP4 and FP8 twins of tiny drafters, written once."""
    root = tmp_path_factory.mktemp("packed")
    write_checkpoint(root / "nvfp4", "tiny-dflash2", nvfp4=True, seed=3)
    write_checkpoint(root / "fp8", "tiny-dspark", fp8=True, seed=3, own_embeddings=True)
    write_checkpoint(root / "dflash", "tiny-dflash", nvfp4=True, seed=5)
    write_checkpoint(root / "bf16", "tiny-dflash", seed=5)
    return root


@pytest.mark.parametrize("fmt,kind", [("nvfp4", nvfp4.Packed), ("fp8", fp8.Fp8)])
def test_packed_drafter_hidden_states_equal_the_dequantized_ones(checkpoints, fmt, kind):
    """float32, same inputs: packed and dequantized drafters give the same hidden states. Both multiply the same
    float32 weight values with the same product (`_precision.weight_dot`), so the bound is 0 and is held
    exactly (XLA:CPU, measured: bit-identical). Every linear weight (fc, projections, DFlash2's kernel
    projections, DSpark's Markov factor and confidence head, its own LM head) is a packed leaf."""
    packed = load_drafter(checkpoints / fmt, dtype=jnp.float32, weights="packed")
    plain = load_drafter(checkpoints / fmt, dtype=jnp.float32)
    leaves = jax.tree_util.tree_flatten_with_path(packed.params, is_leaf=is_quantized)[0]
    quantized = [(path, w) for path, w in leaves if is_quantized(w)]
    assert len(quantized) > 1 + 7 * packed.config.num_hidden_layers  # fc, 7 per layer, and the heads'
    assert not any(is_quantized(x) for x in jax.tree.leaves(plain.params, is_leaf=is_quantized))
    for path, w in quantized:
        assert isinstance(w, kind) and w.dtype == jnp.float32
        dequantized = _at(plain.params, path)
        assert w.shape == dequantized.shape  # [N, K], answered as an array would
        np.testing.assert_array_equal(np.asarray(w.dequantize()), np.asarray(dequantized))
    rng = np.random.default_rng(0)
    embed = jnp.asarray(rng.standard_normal((128, 64)), jnp.float32)
    B = packed.config.effective_block_size
    args = (jnp.asarray(features(plain, 2, 5)), jnp.asarray(rng.integers(0, 127, (2, B)), jnp.int32))
    positions = dict(context_positions=jnp.tile(jnp.arange(5), (2, 1)), block_positions=jnp.tile(5 + jnp.arange(B),
                                                                                                  (2, 1)))
    got = draft_hidden(packed, *args, embed=embed, **positions)
    np.testing.assert_array_equal(got, draft_hidden(plain, *args, embed=embed, **positions))


def _at(params, path):
    node = params
    for key in path:
        node = node[key.idx if hasattr(key, "idx") else key.key]
    return node

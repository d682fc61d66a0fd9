"""Quantized drafters kept quantized (`load_drafter(weights="packed")`, `weights="fp8"`): the packed GEMMs against
NumPy, the FP8-stored NVFP4 form's product bit for bit the dequantized weight's, packed and dequantized drafters
compute the same, greedy speculative decoding, NNX / mesh / orbax keep the leaves packed, FP8 checkpoints in both
modes, parameter bytes, the form `weights="auto"` chooses, and bad input.

The NumPy references decode the formats from their specifications (docs/nvfp4.md, ModelOpt's FP8
export: E4M3 = sign, 4 exponent bits of bias 7, 3 mantissa bits, no Inf, S.1111.111 NaN), not from the package.
"""

from __future__ import annotations

import dataclasses
import functools
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
    CheckpointError,
    draft_hidden,
    fp8,
    greedy_generate,
    init_cache,
    load_drafter,
    nvfp4,
    propose,
    speculative_generate,
)
from dflash_jax._precision import weight_dot
from dflash_jax._qwen3_testing import random_qwen3
from dflash_jax.layers import QuantizedWeight, dot, is_quantized
from dflash_jax.linen import DrafterModule
from dflash_jax.nnx import DFlashDrafter
from dflash_jax.placement import auto_weights, describe_rules
from dflash_jax.platform import Platform
from dflash_jax.testing import write_checkpoint
from dflash_jax.tuning import TUNING

from ._drafters import features
from ._io import rewrite_tensors
from ._pallas import needs_gpu

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
    """[N, K] in `dtype` (as float64): e4m3(weight) * scale in float32, rounded once to `dtype`; float64: exact."""
    if dtype == np.float64:
        return e4m3(weight).astype(np.float64) * float(np.float32(scale))
    return (e4m3(weight) * float(np.float32(scale))).astype(np.float32).astype(dtype).astype(np.float64)


def random_packed(n: int, k: int, dtype=jnp.bfloat16) -> nvfp4.Packed:
    """Random codes (every one of the 16), block scales of a trained weight's range, a small global scale."""
    codes = RNG.integers(0, 256, (n, k // 2), dtype=np.uint8)
    scale = RNG.uniform(2.0, 448.0, (n, k // 16)).astype(ml_dtypes.float8_e4m3fn)
    return nvfp4.Packed(jnp.asarray(codes), jnp.asarray(scale), jnp.float32(RNG.uniform(1e-5, 1e-4)), dtype)


def random_fp8(n: int, k: int, dtype=jnp.bfloat16) -> fp8.Fp8:
    weight = np.clip(RNG.standard_normal((n, k)) * 100, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    return fp8.Fp8(jnp.asarray(weight), jnp.float32(RNG.uniform(1e-4, 1e-3)), dtype)


def test_both_leaves_are_one_quantized_weight():
    """`Packed`, `Fp8Codes` and `Fp8` satisfy every member of `layers.QuantizedWeight` (the protocol `dot` and the
    modules dispatch on), with the same meaning: an array's shape, dtype, ndim, sharding and bytes, the GEMM, the
    weight."""
    members = [n for n in dir(QuantizedWeight) if not n.startswith("_")]
    assert set(members) == {"shape", "dtype", "ndim", "nbytes", "apply", "dequantize"}
    x = jnp.asarray(RNG.standard_normal((3, 64)), jnp.float32)
    packed = random_packed(32, 64, jnp.float32)
    for w in (packed, nvfp4.Fp8Codes.from_packed(packed), random_fp8(32, 64, jnp.float32)):
        assert isinstance(w, QuantizedWeight) and is_quantized(w)
        weight = w.dequantize()
        assert (w.shape, w.ndim, w.dtype, w.sharding) == (weight.shape, 2, weight.dtype, weight.sharding)
        assert w.nbytes == sum(leaf.nbytes for leaf in jax.tree.leaves(w)) < weight.nbytes
        np.testing.assert_allclose(w.apply(x, jnp.float32), x @ weight.T, rtol=1e-5, atol=1e-5)


# Qwen3-8B-DFlash-b16's projections at 1/16 of its widths (H 4096 -> 256, I 12288 -> 768, KV 1024 -> 64, fc 5 H).
SHAPES = {"fc": (256, 1280), "q/o": (256, 256), "k/v": (64, 256), "gate/up": (768, 256), "down": (256, 768)}


@pytest.mark.parametrize("fmt,backend", [("nvfp4", "auto"), ("fp8", "xla"), ("fp8", "auto")])
def test_packed_gemm_against_numpy(fmt, backend):
    """x @ W.T with W quantized, against float64 NumPy, at M = 16, 32, 128, output float32. The dequantizing paths
    (NVFP4, FP8 "xla") against the weight dequantized as the leaf's dtype says (rounded to bf16): that weight then
    matches exactly, and what remains is float32 accumulation: |error| <= K * 2^-24 * (|x| @ |W|.T) (a
    forward-error bound for a length-K sum). FP8 "auto" (the scaled product) against the exact weight
    e4m3 * scale: the same bound plus one rounding of the scale's product (2^-24 |ref|). Measured: at most 0.015x
    the bound on CPU. The bf16 output rounds once more (<= 2^-8 relative)."""
    worst = 0.0
    for name, (n, k) in SHAPES.items():
        w = random_packed(n, k) if fmt == "nvfp4" else random_fp8(n, k)
        if fmt == "nvfp4":
            ref_w = nvfp4_reference(w.codes, w.scale, w.scale_2, ml_dtypes.bfloat16)
        else:
            ref_w = fp8_reference(w.weight, w.scale, ml_dtypes.bfloat16 if backend == "xla" else np.float64)
        matmul = functools.partial(nvfp4.matmul if fmt == "nvfp4" else fp8.matmul, backend=backend)
        for m in (16, 32, 128):
            x = RNG.standard_normal((m, k)).astype(ml_dtypes.bfloat16)
            got = np.asarray(jax.jit(matmul, static_argnames="out_dtype")(x, w, out_dtype=jnp.float32))
            x64 = x.astype(np.float64)
            ref = x64 @ ref_w.T
            bound = k * 2.0**-24 * (np.abs(x64) @ np.abs(ref_w).T) + (backend == "auto") * 2.0**-24 * np.abs(ref)
            assert got.shape == (m, n) and got.dtype == np.float32
            worst = max(worst, float(np.max(np.abs(got - ref) / bound)))
            assert np.all(np.abs(got - ref) <= bound), (name, m)
        bf16 = np.asarray(matmul(x[None], w)).astype(np.float64)  # [1, 128, n] in x's dtype
        np.testing.assert_allclose(bf16[0], ref, rtol=2.0**-8, atol=1e-6 * np.abs(ref).max())
    assert worst < 0.1  # the margin: measured <= 0.015 (XLA:CPU sums in float32 blocks)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_fp8_codes_give_the_dequantized_weights_products_bit_for_bit(dtype):
    """The FP8-stored form (`weights="fp8"`): its weight is the packed weight's dequantization bit for bit (every
    code, random block scales, a full-mantissa global scale), so `x @ W.T` is too, under jit as in a forward
    (`weight_dot` of the dequantized weight: the same dot precision), padded packed weights included; 1 byte a
    code. The parts matter: block scales broadcast along the wrong axis, or ModelOpt's association changed to
    `(code * scale) * scale_2`, give other bits."""
    for n, k in ((64, 256), (32, 1280)):
        w = random_packed(n, k, dtype)
        form = nvfp4.Fp8Codes.from_packed(w)
        assert form.codes.dtype == jnp.float8_e4m3fn and form.shape == w.shape == (n, k) and form.dtype == dtype
        assert form.nbytes == n * k + n * k // 16 + 4
        dequantized = w.dequantize()
        np.testing.assert_array_equal(np.asarray(form.dequantize()).view(np.uint8),
                                      np.asarray(dequantized).view(np.uint8))
        x = jnp.asarray(RNG.standard_normal((2, 16, k)), dtype)
        got = jax.jit(lambda x, w: dot("...i,oi->...o", x, w, dtype))(x, form)  # as `layers.linear` calls it
        want = jax.jit(weight_dot, static_argnums=2)(x, dequantized, dtype)
        np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))
        again = nvfp4.Fp8Codes.from_packed(nvfp4.padded(w, 512))  # a load on Hopper pads K for the kernel
        assert again.shape == (n, k) and jnp.array_equal(again.codes.view(jnp.uint8), form.codes.view(jnp.uint8))
    mirrored = nvfp4.Fp8Codes(form.codes, form.scale[:, ::-1], form.scale_2, dtype)  # block j's scale on block -j
    assert not np.array_equal(np.asarray(mirrored.apply(x, dtype)), np.asarray(got))
    # a global scale where the association shows (float32, found here): code 1.5, block scale 1.125
    code, block = np.float32(1.5), np.float32(1.125)
    scale_2 = next(g for g in np.float32(1e-3) + np.arange(1000, dtype=np.float32) * np.float32(2.0**-33)
                   if code * (block * g) != (code * block) * g)
    one = nvfp4.Fp8Codes(jnp.full((1, 16), code, jnp.float8_e4m3fn), jnp.full((1, 1), block, jnp.float8_e4m3fn),
                         jnp.float32(scale_2), jnp.float32)
    assert float(one.dequantize()[0, 0]) == code * (block * scale_2) != (code * block) * scale_2


@pytest.mark.gpu
@needs_gpu
def test_fp8_codes_products_on_the_gpu():
    """On the GPU, where XLA may fuse the weight's dequantization into its GEMM (and sum in another order than the
    dot of the dequantized weight): the products at a Nemotron drafter's fc shape, M = 16 and 128, float32 out,
    within the float32 accumulation bound of the dequantized weight's, |error| <= K * 2^-24 * (|x| @ |W|.T)."""
    w = random_packed(2688, 16128)
    form, weight = nvfp4.Fp8Codes.from_packed(w), w.dequantize()
    for m in (16, 128):
        x = jnp.asarray(RNG.standard_normal((m, 16128)), jnp.bfloat16)
        got = jax.jit(lambda x, w: w.apply(x, jnp.float32))(x, form)
        want = jax.jit(weight_dot, static_argnums=2)(x, weight, jnp.float32)
        x64, w64 = np.asarray(x, np.float64), np.asarray(weight, np.float64)
        bound = 16128 * 2.0**-24 * (np.abs(x64) @ np.abs(w64).T)
        assert np.all(np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64)) <= 2 * bound), m


def test_bad_fp8_codes_leaves_are_refused():
    codes, scale, scale_2 = jnp.zeros((4, 32), jnp.float8_e4m3fn), jnp.ones((4, 2), jnp.float8_e4m3fn), jnp.float32(1)
    with pytest.raises(ValueError, match=r"codes must be float8_e4m3fn \[N, K\], K a multiple of 16, got uint8"):
        nvfp4.Fp8Codes(codes.view(jnp.uint8), scale, scale_2)
    with pytest.raises(ValueError, match=r"scale must be float8_e4m3fn \[4, 2\] for codes \[4, 32\]"):
        nvfp4.Fp8Codes(codes, scale[:, :1], scale_2)
    with pytest.raises(ValueError, match="scale_2 must be a float32 scalar"):
        nvfp4.Fp8Codes(codes, scale, scale_2.reshape(1))
    with pytest.raises(ValueError, match="x has 16 features, the weight"):
        nvfp4.Fp8Codes(codes, scale, scale_2).apply(jnp.zeros((1, 16)), jnp.float32)
    assert repr(nvfp4.Fp8Codes(codes, scale, scale_2)) == "nvfp4.Fp8Codes([4, 32], bfloat16)"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """NVFP4 and FP8 twins of tiny drafters, written once."""
    root = tmp_path_factory.mktemp("packed")
    write_checkpoint(root / "nvfp4", "tiny-dspark", nvfp4=True, seed=3, own_embeddings=True)
    write_checkpoint(root / "fp8", "tiny-dflash2", fp8=True, seed=3)
    write_checkpoint(root / "dflash", "tiny-dflash", nvfp4=True, seed=5)
    write_checkpoint(root / "bf16", "tiny-dflash", seed=5)
    return root


@pytest.mark.parametrize("fmt,kind", [("nvfp4", nvfp4.Packed), ("fp8", fp8.Fp8)])
def test_packed_drafter_hidden_states_equal_the_dequantized_ones(checkpoints, fmt, kind):
    """float32, same inputs: packed and dequantized drafters give the same hidden states. NVFP4: both multiply the
    same float32 weight values with the same product (`_precision.weight_dot`), so the bound is 0 and is held
    exactly (XLA:CPU, measured: bit-identical); FP8 applies its scale after the product (`fp8.matmul`), to within
    float32 rounding. Every linear weight (fc, projections, DFlash2's kernel
    projections, DSpark's Markov factor and confidence head, its own LM head) is a packed leaf."""
    packed = load_drafter(checkpoints / fmt, dtype=jnp.float32, weights="packed")
    plain = load_drafter(checkpoints / fmt, dtype=jnp.float32, weights="dequantized")
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
    got = draft_hidden(packed.attach(embed=embed), *args, **positions)
    want = draft_hidden(plain.attach(embed=embed), *args, **positions)
    if fmt == "nvfp4":
        np.testing.assert_array_equal(got, want)
    else:  # FP8's scaled product never rounds `weight * scale`, the dequantized weight does: 7.4e-6 measured
        np.testing.assert_allclose(got, want, rtol=0, atol=3e-5)  # (|values| <= 4.7: float32 rounding)


def test_fp8_stored_drafter_drafts_as_the_dequantized_one(checkpoints):
    """bf16, the loader's own placement: the DSpark NVFP4 drafter (own LM head, Markov head, confidence head) loaded
    with `weights="fp8"` proposes the dequantized drafter's tokens, with the same confidences and probabilities."""
    fp8_stored = load_drafter(checkpoints / "nvfp4", weights="fp8")
    plain = load_drafter(checkpoints / "nvfp4", weights="dequantized")
    kept = [w for w in jax.tree.leaves(fp8_stored.params, is_leaf=is_quantized) if is_quantized(w)]
    assert len(kept) > 1 + 7 * plain.config.num_hidden_layers and {type(w) for w in kept} == {nvfp4.Fp8Codes}
    assert fp8_stored.weights == "fp8" and "weights fp8, " in repr(fp8_stored)
    new = jnp.asarray(features(plain, 3, 6), jnp.bfloat16)
    num_new = jnp.asarray([6, 2, 4], jnp.int32)
    anchors = jnp.asarray(np.random.default_rng(2).integers(0, 127, 3), jnp.int32)
    run = jax.jit(lambda d, cache: propose(d, cache, new, num_new, anchors)[0])
    got, want = (run(d, init_cache(d, 3, 16)) for d in (fp8_stored, plain))
    assert len(set(np.asarray(want.tokens).ravel().tolist())) > 3  # drafts that could differ
    for a, b in ((got.tokens, want.tokens), (got.confidence, want.confidence), (got.draft_prob, want.draft_prob)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _at(params, path):
    node = params
    for key in path:
        node = node[key.idx if hasattr(key, "idx") else key.key]
    return node


def test_greedy_speculative_decoding_with_packed_drafters(checkpoints):
    """Lossless: a packed drafter's greedy speculative decoding is the target's greedy decoding, token for token;
    and its drafts are the dequantized twin's (same acceptance, step for step). DSpark NVFP4 with its own LM head,
    Markov head and confidence head: every kind of product with a packed weight in the loop (FP8 leaves take the
    same `dot`; their forward is compared above)."""
    target = random_qwen3("tiny-qwen3", seed=1, dtype=jnp.float32)
    prompts = [RNG.integers(0, 127, n).tolist() for n in (3, 9)]
    greedy = greedy_generate(target, prompts, max_new_tokens=12)
    packed = load_drafter(checkpoints / "nvfp4", dtype=jnp.float32, weights="packed")
    assert isinstance(packed.params["lm_head"]["weight"], nvfp4.Packed)
    # the fixed draft length: the adaptive one chooses from measured times, which differ between the two runs
    result = speculative_generate(target, packed, prompts, max_new_tokens=12, draft_length="fixed")
    assert result.tokens == greedy.tokens
    plain = speculative_generate(target, load_drafter(checkpoints / "nvfp4", dtype=jnp.float32), prompts,
                                 max_new_tokens=12, draft_length="fixed")
    assert result.acceptance_lengths == plain.acceptance_lengths


def test_modules_mesh_and_jit_keep_packed_leaves_packed(checkpoints, cpu_mesh):
    """Replicated over the 8 simulated devices, every array of every packed leaf is on all of them; jax.jit,
    nnx.split/merge and linen's apply take the leaves whole and give them back packed."""
    drafter = load_drafter(checkpoints / "dflash", weights="packed", mesh=cpu_mesh)
    fc = drafter.params["fc"]["weight"]
    assert isinstance(fc, nvfp4.Packed) and fc.codes.dtype == jnp.uint8 and fc.scale.dtype == jnp.float8_e4m3fn
    for array in jax.tree.leaves(drafter.params):
        assert array.sharding.is_fully_replicated and len(array.addressable_shards) == len(jax.devices())
    assert fc.sharding == fc.codes.sharding
    fp8_stored = load_drafter(checkpoints / "dflash", weights="fp8", mesh=cpu_mesh)  # widened where they landed
    assert isinstance(fp8_stored.params["fc"]["weight"], nvfp4.Fp8Codes)
    assert all(a.sharding.is_fully_replicated and len(a.addressable_shards) == len(jax.devices())
               for a in jax.tree.leaves(fp8_stored.params))
    again = jax.jit(lambda d: d)(drafter)
    assert isinstance(again.params["fc"]["weight"], nvfp4.Packed)
    module = DFlashDrafter.from_drafter(drafter)
    assert isinstance(module.params["fc"]["weight"], nnx.Param)  # one Param per weight, holding the whole leaf
    graph, state = nnx.split(module)
    merged = nnx.merge(graph, state).drafter.params
    assert jax.tree.structure(merged) == jax.tree.structure(drafter.params)
    for a, b in zip(jax.tree.leaves(merged), jax.tree.leaves(drafter.params)):
        assert a is b  # nothing copied or dequantized
    target = random_qwen3("tiny-qwen3", seed=1)
    B = drafter.config.effective_block_size
    inputs = (jnp.zeros((1, 3, 2 * 64), jnp.bfloat16), jnp.zeros((1, B), jnp.int32))
    positions = dict(context_positions=jnp.arange(3)[None], block_positions=3 + jnp.arange(B)[None])
    linen = DrafterModule(drafter.config).apply({"params": drafter.params}, *inputs, embed=target.embed,
                                                lm_head=target.lm_head, **positions)
    assert linen.shape == (1, B, 128) and bool(jnp.isfinite(linen).all())


def test_orbax_round_trip_keeps_packed_leaves(checkpoints, tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint", reason="orbax is not a dependency")
    params = load_drafter(checkpoints / "dflash", weights="packed").params
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "ckpt", params)
        checkpointer.wait_until_finished()
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params)
        restored = checkpointer.restore(tmp_path / "ckpt", abstract)
    assert isinstance(restored["layers"][1]["mlp"]["down_proj"]["weight"], nvfp4.Packed)
    assert jax.tree.structure(restored) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(params)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.ravel(a).view(np.uint8), np.ravel(b).view(np.uint8))


def test_fp8_checkpoints_load_in_both_modes(checkpoints):
    """Dequantized: e4m3(weight) * scale rounded to bf16 (NumPy reference). Packed: the stored bytes."""
    from ._io import load_file

    tensors = load_file(checkpoints / "fp8" / "model.safetensors")
    plain = load_drafter(checkpoints / "fp8", weights="dequantized")
    packed = load_drafter(checkpoints / "fp8", weights="packed")
    for name in ("fc.weight", "layers.1.mlp.down_proj.weight", "layers.0.mlp_conv.kernel_projection.weight",
                 "candidate_selector.hidden_projection.weight"):
        path = [int(k) if k.isdigit() else k for k in name.split(".")]
        weight, scale = tensors[name], tensors[name.removesuffix("weight") + "weight_scale"]
        assert weight.dtype == ml_dtypes.float8_e4m3fn and scale.shape == ()
        got = np.asarray(_at_keys(plain.params, path)).astype(np.float64)
        np.testing.assert_array_equal(got, fp8_reference(weight, scale, ml_dtypes.bfloat16))
        leaf = _at_keys(packed.params, path)
        assert isinstance(leaf, fp8.Fp8) and leaf.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(leaf.weight).view(np.uint8), weight.view(np.uint8))
        assert float(leaf.scale) == float(scale)
    for drafter in (plain, packed):  # not a linear: BF16 as stored, in both modes
        assert drafter.params["candidate_selector"]["successor_codebook"].dtype == jnp.bfloat16


def _at_keys(params, keys):
    for key in keys:
        params = params[key]
    return params


def test_parameter_bytes(checkpoints):
    """`Drafter.param_bytes`: NVFP4 linears at 0.5625 bytes per weight plus 4, everything else at the dtype."""
    packed = load_drafter(checkpoints / "dflash", weights="packed")
    plain = load_drafter(checkpoints / "dflash", weights="dequantized")
    shapes = [x.shape for x in jax.tree.leaves(packed.params, is_leaf=is_quantized) if is_quantized(x)]
    linear = sum(math.prod(s) for s in shapes)
    others = sum(x.size for x in jax.tree.leaves(plain.params)) - linear
    assert plain.param_bytes == 2 * (linear + others)
    assert packed.param_bytes == linear // 2 + linear // 16 + 4 * len(shapes) + 2 * others
    assert packed.param_bytes < 0.3 * plain.param_bytes
    fp8_stored = load_drafter(checkpoints / "dflash", weights="fp8")  # one byte a code
    assert fp8_stored.param_bytes == linear + linear // 16 + 4 * len(shapes) + 2 * others


H100 = "NVIDIA H100 80GB HBM3"


def _platform(kind: str, **tuning) -> Platform:
    """A Hopper platform of device kind `kind` (its tuning entry, with `tuning` replaced), no CUDA in this process."""
    entry = dataclasses.replace(TUNING.get(kind, TUNING[H100]), **tuning)
    return Platform(kind=kind, compute_capability=9.0, sm_count=132, cuda=False, tuning=entry)


def test_auto_weights_follow_the_device_entry():
    """`weights="auto"` reads the measured kind's `Tuning.auto_weights` for bfloat16 loads: the first rule whose batch
    reaches the declared one (a batch between two rules takes the next rule's form); a kind never measured (a CPU)
    or another dtype: dequantized at every batch."""
    h100 = _platform(H100)
    assert [auto_weights(h100, jnp.bfloat16, b) for b in (1, 2, 8, 32)] == ["packed"] + ["dequantized"] * 3
    assert auto_weights(h100, jnp.float32, 1) == auto_weights(_platform("cpu"), jnp.bfloat16, 1) == "dequantized"
    rules = ((1, "fp8"), (8, "packed"), (float("inf"), "dequantized"))
    tuned = _platform(H100, auto_weights=rules)
    assert [auto_weights(tuned, jnp.bfloat16, b) for b in (1, 2, 8, 9)] == ["fp8", "packed", "packed", "dequantized"]
    assert describe_rules(rules) == "fp8 up to batch 1, packed up to batch 8, dequantized beyond"


def test_auto_is_the_default_and_says_what_it_placed(checkpoints, caplog, monkeypatch):
    """The default load of a quantized checkpoint is `weights="auto"` for batch 1: on a CPU dequantized; on an
    H100 (its entry, the placement as on this CPU) packed at batch 1 and dequantized at batch 8. The form and why
    are stated in the log line and the drafter's repr; a BF16 checkpoint states none."""
    caplog.set_level(logging.INFO, logger="dflash_jax")
    monkeypatch.setattr(dflash_jax.loader, "platform_of", lambda *where: _platform("cpu"))  # whatever runs this
    here = load_drafter(checkpoints / "dflash")
    assert here.weights == "dequantized (auto, batch 1)" and not any(map(is_quantized, jax.tree.leaves(here.params)))
    assert "15 quantized tensors placed dequantized (weights='auto' for batch 1: cpu has no measured entry)" in (
        caplog.records[-1].getMessage())
    assert load_drafter(checkpoints / "bf16").weights is None
    monkeypatch.setattr(dflash_jax.loader, "platform_of", lambda *where: _platform(H100))
    one, eight = load_drafter(checkpoints / "dflash"), load_drafter(checkpoints / "dflash", batch=8)
    assert isinstance(one.params["fc"]["weight"], nvfp4.Packed) and "weights packed (auto, batch 1), " in repr(one)
    assert not is_quantized(eight.params["fc"]["weight"]) and eight.weights == "dequantized (auto, batch 8)"
    assert f"(weights='auto' for batch 8: the {H100} entry)" in caplog.records[-1].getMessage()


# --- bad input ------------------------------------------------------------------------------------------------

def _leaf_arrays(n=64, k=128):
    codes = jnp.zeros((n, k // 2), jnp.uint8)
    return codes, jnp.ones((n, k // 16), jnp.float8_e4m3fn), jnp.float32(1.0)


@pytest.mark.parametrize("change,says", [
    (lambda c, s, g: (c, s[:, :-1], g), r"scale has shape \[64, 7\], expected \[64, 8\]"),
    (lambda c, s, g: (c, s.astype(jnp.float32), g), "scale must be float8_e4m3fn, got float32"),
    (lambda c, s, g: (c.astype(jnp.int8), s, g), "codes must be uint8"),
    (lambda c, s, g: (c[:, :8], s[:, :2], g), "K = 16"),
    (lambda c, s, g: (c, s, g.reshape(1)), r"scale_2 must be a float32 scalar \[\], got float32\[1\]"),
    (lambda c, s, g: (c, s, g.astype(jnp.bfloat16)), "scale_2 must be a float32 scalar"),
])
def test_inconsistent_packed_leaves_are_refused(change, says):
    with pytest.raises(ValueError, match=says):
        nvfp4.Packed(*change(*_leaf_arrays()))


def test_bad_quantized_leaves_and_products():
    with pytest.raises(ValueError, match="weight must be float8_e4m3fn"):
        fp8.Fp8(jnp.zeros((4, 32), jnp.bfloat16), jnp.float32(1))
    with pytest.raises(ValueError, match="scale must be a float32 scalar"):
        fp8.Fp8(jnp.zeros((4, 32), jnp.float8_e4m3fn), jnp.ones(4, jnp.float32))
    packed = nvfp4.Packed(*_leaf_arrays())
    with pytest.raises(ValueError, match="x has 64 features"):
        nvfp4.matmul(jnp.zeros((2, 64)), packed)
    with pytest.raises(ValueError, match="x @ W.T"):
        dot("bk,kn->bn", jnp.zeros((2, 128)), packed)  # a weight is [out, in]: never the `kn` operand
    with pytest.raises(TypeError, match="must be an nvfp4.Packed"):
        nvfp4.matmul(jnp.zeros((2, 128)), jnp.zeros((64, 128)))
    with pytest.raises(ValueError, match="dtype must be a float dtype to compute in, got int8"):
        nvfp4.Packed(*_leaf_arrays(), dtype=jnp.int8)
    assert repr(packed) == "nvfp4.Packed([64, 128], bfloat16)"  # a drafter's repr stays readable
    assert repr(fp8.Fp8(jnp.zeros((4, 32), jnp.float8_e4m3fn), jnp.float32(1))) == "fp8.Fp8([4, 32], bfloat16)"


@pytest.fixture
def placements(monkeypatch):
    """Calls of `place_all` from the loader: a refused checkpoint must never reach device placement."""
    calls = []
    real = dflash_jax.loader.place_all
    monkeypatch.setattr(dflash_jax.loader, "place_all", lambda plan, *a, **k: calls.append(plan) or real(plan, *a, **k))
    return calls


SCALE = "layers.0.self_attn.k_proj.weight_scale"


@pytest.mark.parametrize("value,says", [
    (0.0, "0.0 is not a finite number > 0"), (-0.5, "-0.5 is not a finite number > 0"),
    (np.nan, "nan is not"), (np.inf, "inf is not"), (1e-39, "1e-39 is subnormal"),
])
@pytest.mark.parametrize("weights", ["dequantized", "packed"])
def test_bad_fp8_scales_are_refused_before_placing(tmp_path, placements, value, says, weights):
    write_checkpoint(tmp_path, "tiny-dflash", fp8=True)
    rewrite_tensors(tmp_path, lambda t: t.update({SCALE: np.asarray(value, np.float32)}))
    with pytest.raises(CheckpointError, match=f"model.safetensors: {SCALE}: {says}"):
        load_drafter(tmp_path, weights=weights)
    assert not placements


@pytest.mark.parametrize("change,says", [
    (lambda t: t.pop(SCALE), f"its scale '{SCALE}' is missing"),
    (lambda t: t.update({SCALE: np.ones((32, 1), np.float32)}), r"has shape \[32, 1\]; expected a per-tensor"),
    (lambda t: t.update({SCALE: np.ones((32, 2), np.uint8)}), "E8M0 block scales of an MXFP8"),
    (lambda t: t.update({SCALE: np.ones((), np.int32)}), "has dtype I32, expected F32"),
])
def test_bad_fp8_tensors_are_refused(tmp_path, placements, change, says):
    write_checkpoint(tmp_path, "tiny-dflash", fp8=True)
    rewrite_tensors(tmp_path, change)
    with pytest.raises(CheckpointError, match=says):
        load_drafter(tmp_path, weights="packed")
    assert not placements


def test_fp8_scale_beyond_the_load_dtype_and_declared_algorithms(tmp_path, placements):
    """448 x scale must fit the load dtype (float16: 65504); MXFP8 declared is refused by name; an FP8 checkpoint
    declared NVFP4 disagrees with its tensors."""
    write_checkpoint(tmp_path, "tiny-dflash", fp8=True)
    rewrite_tensors(tmp_path, lambda t: t.update({SCALE: np.asarray(200.0, np.float32)}))
    with pytest.raises(CheckpointError, match="beyond float16's range"):
        load_drafter(tmp_path, dtype=jnp.float16)
    load_drafter(tmp_path, dtype=jnp.float32)  # 89600 fits float32
    quant = tmp_path / "hf_quant_config.json"
    for algo, says in (("MXFP8", "quant_algo 'MXFP8' is MXFP8 .E8M0 scales"), ("NVFP4", "quant_algo 'NVFP4' but")):
        quant.write_text(quant.read_text().replace('"FP8"', f'"{algo}"').replace('"MXFP8"', f'"{algo}"')
                         .replace('"NVFP4"', f'"{algo}"'))
        with pytest.raises(CheckpointError, match=f"hf_quant_config.json: {says}"):
            load_drafter(tmp_path, weights="packed")
    assert len(placements) == 1  # the float32 load only


@pytest.mark.parametrize("weights", ["dequantized", "packed"])
def test_scales_whose_products_underflow_are_refused(tmp_path, placements, weights):
    """Each scale normal, their product not: 1.2e-38 x block scales of 2**-9 (E4M3's smallest) is below float32's
    normal range, which XLA flushes to 0, so `fc` loaded as zeros in either form. An FP8 scale of 1.2e-38 passes
    the subnormal check alike, yet flushes the weight codes below 1. Refused naming the tensors, before anything
    is placed; the same global scale beside block scales of 448 (weights near 3e-36: normal) loads."""
    write_checkpoint(tmp_path / "nvfp4", "tiny-dflash", nvfp4=True)
    tiny = {"fc.weight_scale_2": np.asarray(1.2e-38, np.float32)}
    rewrite_tensors(tmp_path / "nvfp4", lambda t: t.update(
        tiny, **{"fc.weight_scale": np.full_like(t["fc.weight_scale"], 2.0**-9)}))
    with pytest.raises(CheckpointError, match=r"model.safetensors: fc.weight_scale: 512 of 512 block scales times "
                       r"fc.weight_scale_2 \(1.2e-38\) dequantize nonzero codes to 0"):
        load_drafter(tmp_path / "nvfp4", weights=weights)
    write_checkpoint(tmp_path / "fp8", "tiny-dflash", fp8=True)
    rewrite_tensors(tmp_path / "fp8", lambda t: t.update({SCALE: np.asarray(1.2e-38, np.float32)}))
    with pytest.raises(CheckpointError, match=f"model.safetensors: {SCALE}: 1.2e-38 dequantizes the weight's "
                       "nonzero codes below 0.98 to 0"):
        load_drafter(tmp_path / "fp8", weights=weights)
    assert not placements
    rewrite_tensors(tmp_path / "nvfp4", lambda t: t.update(
        tiny, **{"fc.weight_scale": np.full_like(t["fc.weight_scale"], 448.0)}))
    fc = load_drafter(tmp_path / "nvfp4", weights=weights, dtype=jnp.float32).params["fc"]["weight"]
    fc = fc.dequantize() if weights == "packed" else fc
    assert 0 < np.abs(np.asarray(fc)).max() <= 6 * 448 * np.float32(1.2e-38)


@pytest.mark.parametrize("code, dtype, edge", [(0x01, jnp.float32, 2.0**-117), (0x7E, jnp.float16, 2.0**-25 / 448)])
def test_fp8_scales_are_refused_exactly_where_xla_dequantizes_a_nonzero_code_to_zero(code, dtype, edge):
    """One float32 step of the scale apart: the smallest code (2**-9) x scale flushed in float32, the largest
    (448) x scale rounded to 0 in float16; `check_scale` refuses iff XLA's dequantization gives 0."""
    weight = np.full((1, 16), code, np.uint8).view(ml_dtypes.float8_e4m3fn)
    for scale in (np.nextafter(np.float32(edge), np.float32(0)), np.float32(edge), np.nextafter(np.float32(edge), 1)):
        zero = not np.asarray(fp8.dequantize(jnp.asarray(weight), jnp.float32(scale), dtype=dtype)).any()
        try:
            fp8.check_scale("w_scale", scale, dtype)
            refused = False
        except CheckpointError as e:
            assert str(e).startswith("w_scale: ") and ("to 0 in float16" in str(e) or "XLA flushes" in str(e))
            refused = True
        assert refused == zero, (scale, refused, zero)


def test_scales_whose_products_round_to_zero_in_float16_are_refused(tmp_path, placements):
    """Products float32 holds but float16 (smallest subnormal 6e-8) rounds to 0: refused for a float16 load only.
    FP8's codes span 2**-9 to 448, so only a scale that zeroes every weight is refused there."""
    write_checkpoint(tmp_path / "nvfp4", "tiny-dflash", nvfp4=True)
    rewrite_tensors(tmp_path / "nvfp4", lambda t: t.update({"fc.weight_scale_2": np.asarray(1e-10, np.float32)}))
    with pytest.raises(CheckpointError, match=r"fc.weight_scale: \d+ of 512 block scales .* to 0 in float16"):
        load_drafter(tmp_path / "nvfp4", dtype=jnp.float16)
    write_checkpoint(tmp_path / "fp8", "tiny-dflash", fp8=True)
    rewrite_tensors(tmp_path / "fp8", lambda t: t.update({SCALE: np.asarray(1e-11, np.float32)}))
    with pytest.raises(CheckpointError, match=f"{SCALE}: 1e-11 .* every weight to 0 in float16"):
        load_drafter(tmp_path / "fp8", dtype=jnp.float16)
    assert not placements
    for path in ("nvfp4", "fp8"):
        load_drafter(tmp_path / path, dtype=jnp.bfloat16)


def test_packed_nvfp4_with_bad_companions_is_refused(tmp_path, placements):
    write_checkpoint(tmp_path, "tiny-dflash", nvfp4=True)
    rewrite_tensors(tmp_path, lambda t: t.update({"fc.weight_scale": t["fc.weight_scale"][:, :4]}))
    with pytest.raises(CheckpointError, match="fc.weight_scale: shape"):
        load_drafter(tmp_path, weights="packed")
    assert not placements


def test_weights_argument(checkpoints, caplog, placements):
    """An unknown value, or a `batch` that is no positive int or comes with a form that chooses nothing, is a
    ValueError naming the argument, before anything is read; "packed" for a BF16 checkpoint loads it as it is, said
    in one info line."""
    with pytest.raises(ValueError, match="load_drafter: weights='bf16'; expected one of 'auto', 'dequantized', "
                       "'packed', 'fp8'"):
        load_drafter(checkpoints / "bf16", weights="bf16")
    for batch in (0, True, 2.0):
        with pytest.raises(ValueError, match=f"load_drafter: batch={batch!r}; expected a positive int"):
            load_drafter(checkpoints / "dflash", batch=batch)
    with pytest.raises(ValueError, match="batch=8; .* \\(weights='packed' chooses none\\)"):
        load_drafter(checkpoints / "dflash", weights="packed", batch=8)
    assert not placements
    with caplog.at_level(logging.INFO, logger="dflash_jax"):
        drafter = load_drafter(checkpoints / "bf16", weights="packed")
    said = [r.getMessage() for r in caplog.records if "weights='packed'" in r.getMessage()]
    assert len(said) == 1 and "no NVFP4 or FP8 weights; loaded as stored" in said[0]
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(drafter.params))
    assert drafter.param_bytes == load_drafter(checkpoints / "bf16").param_bytes


def test_cli_load_packed_reports_parameter_bytes(checkpoints, capsys):
    from dflash_jax.cli import main

    assert main(["load", str(checkpoints / "dflash"), "--weights", "packed", "--devices", "2"]) == 0
    expected = load_drafter(checkpoints / "dflash", weights="packed").param_bytes
    assert f"{expected / 1e6:.1f} MB of parameters per device, weights packed\n" in capsys.readouterr().out
    assert main(["load", str(checkpoints / "dflash"), "--batch", "8"]) == 0  # the default: auto
    assert capsys.readouterr().out.endswith(", weights dequantized (auto, batch 8)\n")
    assert main(["load", str(checkpoints / "dflash"), "--weights", "fp8", "--batch", "8"]) == 2
    assert "batch=8" in capsys.readouterr().err

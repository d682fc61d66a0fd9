"""The packed NVFP4 GEMM's Pallas Mosaic GPU kernel (`nvfp4._mosaic_gemm`, `nvfp4.matmul(backend="pallas")`) against
a NumPy float64 reference: on a CPU in Pallas's GPU interpret mode (small shapes), on a GPU (tests marked `gpu`)
every projection shape of the four released drafters at M = 16, 32, 128, 512.

The reference decodes the format from its definition (tests/test_nvfp4.py's `np_e4m3` and E2M1 table: OCP
Microscaling Formats v1.0, arXiv:2209.05433) and multiplies in float64: ref = (x @ (e2m1 * e4m3(scale)).T) *
scale_2. The kernel's bf16 weight tile e2m1 x scale is exact (at most 6 significant bits), so what remains is the
float32 accumulation and one rounding of acc x scale_2 to the output dtype:
    |got - ref| <= u_out * |ref| + K * 2^-22 * scale_2 * (|x| @ |e2m1 * scale|.T)
with u_out = 2^-8 for bf16 (2^-24 for float32) and K * 2^-22 four times the float32 forward-error bound of a
length-K sum (Hopper's tensor cores align the products before adding, which may truncate below float32).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dflash_jax import nvfp4
from dflash_jax.nvfp4 import _mosaic_gemm
from dflash_jax.nvfp4._mosaic_gemm import mosaic_matmul
from dflash_jax.platform import platform_of
from dflash_jax.tuning import FALLBACK
from dflash_jax.tuning import GemmTiling as Tiling

from ._pallas import HOPPER, needs_gpu, needs_mosaic_interpreter, on_gpu
from ._ptx import run_ptx
from .test_nvfp4 import E2M1, np_e4m3

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def random_weight(rng: np.random.Generator, n: int, k: int):
    """Every code; block scales over E4M3's finite range (subnormals included, no NaN bytes); a small scale_2."""
    codes = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    scale = rng.integers(0, 0x7F, (n, k // 16), dtype=np.uint8)  # positive, finite: 0 .. 448
    return codes, scale.view(ml_dtypes.float8_e4m3fn), np.float32(rng.uniform(1e-4, 1e-2))


def unscaled_weight(codes: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """e2m1(code) * e4m3(block scale), float64 [N, K] (exact; scale_2 applied after the product)."""
    nibbles = np.stack([codes & 15, codes >> 4], axis=-1).reshape(codes.shape[0], -1)  # [N, K], low nibble first
    return E2M1[nibbles].astype(np.float64) * np.repeat(np_e4m3(scale.view(np.uint8)), 16, axis=1)


def check(got, x, codes, scale, scale_2, rows=None, u_out=2.0**-8) -> float:
    """Assert the module docstring's bound on `got` [M, N] (or its columns `rows` of N); returns the worst
    |error| / bound (the margin)."""
    w = unscaled_weight(codes if rows is None else codes[rows], scale if rows is None else scale[rows])
    got = np.asarray(jnp.asarray(got).astype(jnp.float32)).astype(np.float64)
    if rows is not None:
        got = got[:, rows]
    x64 = np.asarray(x).astype(np.float64)
    ref = (x64 @ w.T) * float(scale_2)
    bound = u_out * np.abs(ref) + x.shape[1] * 2.0**-22 * float(scale_2) * (np.abs(x64) @ np.abs(w).T)
    err = np.abs(got - ref)
    assert np.all(err <= bound), f"worst |error| / bound {np.max(err / bound):.3g}"
    return float(np.max(err / bound))


# --- CPU: the kernel in Pallas's GPU interpret mode ----------------------------------------------------------

@needs_mosaic_interpreter
@pytest.mark.parametrize("m,n,k,tiling", [
    (16, 128, 512, Tiling(64, 256, 2)),  # 2 CTAs along N, 2 pipeline steps
    (8, 64, 1024, Tiling(64, 256, 2, split_k=2)),  # 2 CTAs along K, their float32 partial sums added
    (20, 128, 1024, Tiling(64, 512, 2)),  # M padded to 32, the larger K tile
])
def test_interpret_mode_against_numpy(m, n, k, tiling):
    """The kernel body as written (layouts aside: interpret mode runs the jaxpr, not the Mosaic lowering)."""
    rng = np.random.default_rng(m)
    codes, scale, scale_2 = random_weight(rng, n, k)
    x = rng.standard_normal((m, k)).astype(ml_dtypes.bfloat16)
    got = mosaic_matmul(jnp.asarray(x), jnp.asarray(codes), jnp.asarray(scale), jnp.asarray(scale_2),
                        tiling=tiling, interpret=True)
    assert got.shape == (m, n) and got.dtype == jnp.bfloat16
    check(got, x, codes, scale, scale_2)  # measured: up to 0.87 of the bound (the bf16 rounding reaches 1.0)


@needs_mosaic_interpreter
def test_matmul_backend_mosaic_keeps_leading_dims():
    """`nvfp4.matmul(..., backend="pallas")` on [batch, block, K] with a float32 output (interpret mode here)."""
    rng = np.random.default_rng(1)
    codes, scale, scale_2 = random_weight(rng, 64, 256)
    w = nvfp4.Packed(jnp.asarray(codes), jnp.asarray(scale), jnp.asarray(scale_2))
    x = rng.standard_normal((2, 8, 256)).astype(ml_dtypes.bfloat16)
    got = nvfp4.matmul(jnp.asarray(x), w, out_dtype=jnp.float32, backend="pallas")
    assert got.shape == (2, 8, 64) and got.dtype == jnp.float32
    assert check(got.reshape(16, 64), x.reshape(16, 256), codes, scale, scale_2, u_out=2.0**-24) < 0.1


@needs_mosaic_interpreter
def test_a_weight_padded_to_the_kernels_k_gives_the_same_products():
    """`nvfp4.padded`: a K of 96 (Nemotron's 2688 is not a multiple of 256 either) padded with zero codes to 256
    for the kernel's tile: the same shape, dequantization and XLA product, bit for bit; the kernel (interpret
    mode) takes it, x padded to match, within the kernel's bound; `mosaic_takes` says so, unpadded it did not."""
    rng = np.random.default_rng(5)
    codes, scale, scale_2 = random_weight(rng, 64, 96)
    w = nvfp4.Packed(jnp.asarray(codes), jnp.asarray(scale), jnp.asarray(scale_2))
    wide = nvfp4.padded(w, 256)
    assert (wide.shape, wide.stored_columns, nvfp4.padded(wide, 256) is wide) == ((64, 96), 256, True)
    np.testing.assert_array_equal(np.asarray(wide.dequantize()), np.asarray(w.dequantize()))
    x = rng.standard_normal((8, 96)).astype(ml_dtypes.bfloat16)
    xla = nvfp4.matmul(jnp.asarray(x), w, backend="xla")
    np.testing.assert_array_equal(np.asarray(nvfp4.matmul(jnp.asarray(x), wide, backend="xla")), np.asarray(xla))
    assert not nvfp4.packed.mosaic_takes(jnp.asarray(x), w, HOPPER) and nvfp4.packed.mosaic_takes(
        jnp.asarray(x), wide, HOPPER)
    got = nvfp4.matmul(jnp.asarray(x), wide, backend="pallas", platform=dataclasses.replace(HOPPER, cuda=False))
    check(got, x, codes, scale, scale_2)


@pytest.mark.parametrize("m,tiling", [(16, Tiling(split_k=2)), (512, FALLBACK.nvfp4_gemm)])
def test_lowers_for_hopper_on_a_cpu(m, tiling):
    """`jax.export` for CUDA runs Mosaic GPU's Python passes (layout inference, lowering of the Mosaic GPU dialect,
    shared-memory budget) for sm_90 without a GPU: the kernel lowers with the fallback tiling at the smallest
    (split along K, as on an H200) and the largest M; only PTX generation is left to the GPU machine. The custom
    call is Mosaic GPU's, not Triton's."""
    k, n = 512, 128
    args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((n, k // 2), jnp.uint8),
            jax.ShapeDtypeStruct((n, k // 16), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((), jnp.float32))
    exported = jax.export.export(jax.jit(functools.partial(mosaic_matmul, tiling=tiling)), platforms=["cuda"])(*args)
    text = exported.mlir_module()
    assert "mosaic_gpu" in text and "triton" not in text.lower()


def test_the_decode_ptx_gives_every_code_times_every_scale_exactly():
    """The kernel's PTX (`_ptx_pair`, run by the NumPy model of tests/_ptx.py) on every code at every nibble
    position, times every finite E4M3 scale as the kernel prepares it (x 2^117 in bf16): the pair of nibbles p and
    p + 4 of a word is e2m1 x scale x 2^-9 exactly, low half first. The E4M3 decode the expansion feeds is exact too."""
    finite = np.array([b for b in range(256) if b & 0x7F != 0x7F], np.int32)
    e4m3_x1024 = np.asarray(_mosaic_gemm._e4m3_x1024(jnp.asarray(finite)))
    np.testing.assert_array_equal(e4m3_x1024 / 1024, np_e4m3(finite.astype(np.uint8)))
    scale = np_e4m3(finite.astype(np.uint8))  # [S]
    scale_bf16 = (scale * 2.0**117).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(scale_bf16.astype(np.float64), scale * 2.0**117)  # 4 significant bits: exact
    scale_pair = scale_bf16.view(np.uint16).astype(np.uint32) * np.uint32(0x10001)  # [S]: (s, s)
    nibbles = np.arange(16, dtype=np.uint32)
    for p in range(4):
        word = (nibbles << np.uint32(4 * p)) | ((15 - nibbles) << np.uint32(4 * p + 16))  # nibble p: c, p + 4: 15 - c
        word |= np.uint32(0x5A5A5A5A) & ~(np.uint32(0xF000F) << np.uint32(4 * p))  # other nibbles: noise
        got = run_ptx(_mosaic_gemm._ptx_pair(p), word[:, None], scale_pair[None, :])  # [16, S]
        halves = np.stack([got & 0xFFFF, got >> 16], -1).astype(np.uint16).view(ml_dtypes.bfloat16)
        want = np.stack([E2M1[nibbles][:, None] * scale, E2M1[15 - nibbles][:, None] * scale], -1) * 2.0**-9
        np.testing.assert_array_equal(halves.astype(np.float64), want)
        np.testing.assert_array_equal(np.signbit(halves.astype(np.float64)),
                                      np.stack([nibbles >= 8, 15 - nibbles >= 8], -1)[:, None, :]
                                      ^ np.signbit(scale)[None, :, None])


def test_the_decoded_columns_and_x_rows_are_in_one_order():
    """`column_order` (the register mapping) is a permutation of K, and x's rows are laid out in it
    (`permute_x`), so the product sums each code with its own column of x."""
    order = _mosaic_gemm.column_order(256)
    # Column group 0: nibbles 0 and 4 of each lane's first word; lane t's word holds k 32 t .. 32 t + 7.
    assert sorted(order) == list(range(256)) and list(order[:8]) == [0, 4, 32, 36, 64, 68, 96, 100]
    x = np.random.default_rng(0).standard_normal((5, 256)).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(np.asarray(_mosaic_gemm.permute_x(jnp.asarray(x), 16))[:, :5], x[:, order].T)


def test_bad_shapes_and_dtypes_are_refused():
    x = jnp.zeros((4, 256), jnp.bfloat16)
    codes, scale, scale_2 = jnp.zeros((64, 128), jnp.uint8), jnp.ones((64, 16), jnp.float8_e4m3fn), jnp.float32(1)
    with pytest.raises(ValueError, match="x must be bfloat16"):
        mosaic_matmul(x.astype(jnp.float32), codes, scale, scale_2)
    with pytest.raises(ValueError, match="N = 32 is not a multiple of 64"):
        mosaic_matmul(x, codes[:32], scale[:32], scale_2)
    with pytest.raises(ValueError, match="K = 128 is not a multiple of 256"):
        mosaic_matmul(x[:, :128], codes[:, :64], scale[:, :8], scale_2)
    w = nvfp4.Packed(codes, scale, scale_2, jnp.float32)
    with pytest.raises(ValueError, match="computes in bfloat16"):
        nvfp4.matmul(x, w, backend="pallas")
    with pytest.raises(ValueError, match=r"backend=.triton. \(not a kernel choice\)"):
        nvfp4.matmul(x, w, backend="triton")  # type: ignore[arg-type]


def test_auto_takes_the_kernel_on_hopper_only(monkeypatch):
    """`backend="auto"` is decided in `_auto_backend` alone: the kernel on a Hopper GPU (where `AUTO_MOSAIC`, set
    since the kernel passed the GPU tests, allows it), XLA elsewhere and when cleared; `mosaic_takes` names the
    operands the kernel takes."""
    w = nvfp4.Packed(jnp.zeros((64, 256), jnp.uint8), jnp.ones((64, 32), jnp.float8_e4m3fn), jnp.float32(1))
    x = jnp.zeros((2, 4, 512), jnp.bfloat16)
    here = platform_of(w)
    assert nvfp4.packed._auto_backend(x, w, here) == ("pallas" if on_gpu and here.compute_capability == 9.0 else "xla")
    assert nvfp4.packed._auto_backend(x, w, HOPPER) == "pallas"
    assert nvfp4.packed._auto_backend(x, w, dataclasses.replace(HOPPER, compute_capability=10.0)) == "xla"  # no WGMMA
    monkeypatch.setattr(nvfp4.packed, "AUTO_MOSAIC", False)
    assert nvfp4.packed._auto_backend(x, w, HOPPER) == "xla"
    assert nvfp4.packed.mosaic_takes(x, w, HOPPER)
    assert not nvfp4.packed.mosaic_takes(x.astype(jnp.float32), w, HOPPER)  # x must be bf16
    assert not nvfp4.packed.mosaic_takes(x, nvfp4.Packed(w.codes, w.scale, w.scale_2, jnp.float32), HOPPER)
    narrow = nvfp4.Packed(w.codes[:32], w.scale[:32], w.scale_2)  # N = 32
    assert not nvfp4.packed.mosaic_takes(x, narrow, HOPPER)


# --- GPU: every released drafter's projection shapes ---------------------------------------------------------

def drafter_shapes() -> dict[tuple[int, int], list[str]]:
    """(N, K) -> the projections of the four released drafters (configs/*.json) with that shape."""
    shapes: dict[tuple[int, int], list[str]] = {}
    for name in ("zlab-qwen3-8b-dflash-b16", "zlab-qwen3.6-35b-a3b-dflash-tf5", "radixark-qwen3.8-27b-dspark",
                 "muse-glimmer-dflash2"):
        with open(os.path.join(ROOT, "configs", f"{name}.json")) as f:
            c = json.load(f)
        h, i, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
        q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
        block = c.get("dflash_config") or c.get("dspark_config") or {}
        n_fc = len(c.get("target_layer_ids") or block["target_layer_ids"])  # fc: [H, layers x H]
        for proj, nk in {"q": (q, h), "k/v": (kv, h), "o": (h, q), "gate/up": (i, h), "down": (h, i),
                         "fc": (h, n_fc * h)}.items():
            shapes.setdefault(nk, []).append(f"{name} {proj}")
    return shapes


@pytest.mark.gpu
@needs_gpu
def test_gpu_every_drafter_shape_against_numpy():
    """Each (N, K) at M = 16, 32, 128, 512; the NumPy reference on 192 of the N rows (the first and last 64, 64
    at random: every grid row-tile kind), all M columns."""
    rng = np.random.default_rng(24)
    worst = 0.0
    for (n, k), names in drafter_shapes().items():
        codes, scale, scale_2 = random_weight(rng, n, k)
        dev = jnp.asarray(codes), jnp.asarray(scale), jnp.asarray(scale_2)
        rows = np.unique(np.r_[0:64, n - 64:n, rng.integers(0, n, 64)])
        for m in (16, 32, 128, 512):
            x = rng.standard_normal((m, k)).astype(ml_dtypes.bfloat16)
            got = mosaic_matmul(jnp.asarray(x), *dev)
            assert got.shape == (m, n), names
            try:
                worst = max(worst, check(got, x, codes, scale, scale_2, rows))
            except AssertionError as e:
                raise AssertionError(f"{names} at M = {m}: {e}") from None
    print(f"worst |error| / bound: {worst:.3f}")
    assert worst <= 1.0  # the bf16 output rounding alone reaches 1.0 of its term


@pytest.mark.gpu
@needs_gpu
def test_gpu_agrees_with_the_xla_path():
    """Kernel vs `backend="xla"` (which rounds the weight to bf16 first): within 2 bf16 ulps of the larger output
    (each is within its own bound of the exact product), on the 8B-b16 q_proj at M = 16 and 128."""
    rng = np.random.default_rng(7)
    codes, scale, scale_2 = random_weight(rng, 4096, 4096)
    w = nvfp4.Packed(jnp.asarray(codes), jnp.asarray(scale), jnp.asarray(scale_2))
    for m in (16, 128):
        x = jnp.asarray(rng.standard_normal((m, 4096)).astype(ml_dtypes.bfloat16))
        a = np.asarray(nvfp4.matmul(x, w, backend="pallas").astype(jnp.float32))
        b = np.asarray(nvfp4.matmul(x, w, backend="xla").astype(jnp.float32))
        scale_of = np.abs(a).max()
        assert np.max(np.abs(a - b)) <= 2 * 2.0**-7 * scale_of, (m, np.max(np.abs(a - b)) / scale_of)

"""NVFP4: hand-computed vectors, dequantization (XLA's, on the CPU and in the tests marked `gpu` on a GPU) against an
independent NumPy decoding, ModelOpt's quantizer against an independent NumPy version, and bad
input. Every random generator is seeded.

The NumPy code here is written from the format's definition, not from the package: E2M1 codes (1 sign bit, 2
exponent bits, 1 mantissa bit: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6; OCP Microscaling Formats v1.0), one
float8 E4M3FN block scale per 16 consecutive values (Micikevicius et al. 2022, "FP8 Formats for Deep Learning",
arXiv:2209.05433), a per-tensor float32 `weight_scale_2`, element 2j in a byte's low nibble, and
`value = e2m1 * (f32(block scale) * scale_2)` in float32, rounded once (NVIDIA ModelOpt `NVFP4QTensor`,
modelopt/torch/quantization/qtensor/nvfp4_tensor.py). Bits are compared as 16-bit patterns with +0 == -0 (code 8
is -0; ModelOpt's quantizer never writes it).
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_jax import nvfp4
from dflash_jax.errors import CheckpointError

from ._pallas import needs_gpu

gpu = pytest.mark.gpu

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


# --- independent NumPy reference -------------------------------------------------------------------------------

def np_e4m3(bits: np.ndarray) -> np.ndarray:
    """float8 E4M3FN bytes -> float32: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is subnormal
    (`m/8 * 2**-6`), S.1111.111 is NaN, there are no infinities. Every value is exact in float32."""
    b = np.asarray(bits).astype(np.int64)
    exponent, mantissa = (b >> 3) & 15, b & 7
    magnitude = np.where(exponent == 0, mantissa / 8 * 2.0**-6, (1 + mantissa / 8) * 2.0 ** (exponent - 7))
    magnitude = np.where((exponent == 15) & (mantissa == 7), np.nan, magnitude)
    return np.where(b & 0x80, -magnitude, magnitude).astype(np.float32)


def test_numpy_e4m3_is_ml_dtypes_float8_e4m3fn():
    """The decoding above, byte for byte, against a third implementation (ml_dtypes), NaNs included."""
    every = np.arange(256, dtype=np.uint8)
    np.testing.assert_array_equal(np_e4m3(every), every.view(ml_dtypes.float8_e4m3fn).astype(np.float32))


def np_dequantize(packed, scale, scale_2, dtype=ml_dtypes.bfloat16):
    """Both nibbles of every byte (low first) through the E2M1 table, times `f32(block scale) * scale_2` per 16
    values, the product in float32, rounded once to `dtype`. `scale`: E4M3FN values or their bytes."""
    packed = np.asarray(packed)
    codes = np.stack([packed & 15, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)  # [..., K]
    block = np_e4m3(np.asarray(scale).view(np.uint8)) * np.float32(scale_2)  # [..., K/16] f32
    with np.errstate(over="ignore"):  # past the dtype's range: Inf, as the GPU rounds
        return (E2M1[codes] * np.repeat(block, 16, axis=-1)).astype(dtype)


def np_quantize(w):
    """ModelOpt's dynamic quantization (`scale_2 = amax / (6 * 448)`, block scale `amax_16 / (6 * scale_2)` cast
    to E4M3, codes `w / (block scale * scale_2)` cast to E2M1) with ml_dtypes' round-to-nearest-even casts."""
    w = np.asarray(w, np.float32)
    ws2 = np.float32(np.abs(w).max() / np.float32(2688.0))
    blocks = w.reshape(*w.shape[:-1], -1, 16)
    s = np.abs(blocks).max(-1) / (np.float32(6.0) * ws2)
    s = np.where(s == 0, np.float32(1), s)
    s = np.maximum(s, np.float32(2**-9)).astype(ml_dtypes.float8_e4m3fn)
    y = (blocks / (s.astype(np.float32) * ws2)[..., None]).reshape(w.shape)
    codes = y.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 15  # unpacked: one code per byte
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8), s, ws2


def bits16(x):
    """16-bit patterns, with -0 folded onto +0."""
    b = np.asarray(x).view(np.uint16)
    return np.where(b == 0x8000, np.uint16(0), b)


def random_nvfp4(rng, shape_nk, finite=True):
    n, k = shape_nk
    packed = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    scale = rng.integers(0, 256, (n, k // 16), dtype=np.uint8)
    if finite:
        scale = np.where((scale & 0x7F) == 0x7F, scale ^ 1, scale).astype(np.uint8)  # no NaN bytes
    return packed, scale


# --- hand-computed vectors -------------------------------------------------------------------------------------------

def deq(packed, scale, scale_2, dtype=jnp.bfloat16):
    return np.asarray(nvfp4.dequantize(packed, scale, scale_2, dtype=dtype))


def test_code_table():
    packed = np.array([[0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]], np.uint8)
    out = deq(packed, np.array([[0x40]], np.uint8), np.float32(0.25), dtype=jnp.float16)
    expected = [0, .25, .5, .75, 1, 1.5, 2, 3, -0.0, -.25, -.5, -.75, -1, -1.5, -2, -3]
    np.testing.assert_array_equal(out.astype(np.float32)[0], expected)
    assert np.signbit(out[0, 8])  # code 8 is -0 in a bit-level decode


def test_nibble_order():
    packed = np.array([[0x21, 0xF7, 0x8A, 0x10, 0, 0, 0, 0]], np.uint8)
    out = deq(packed, np.array([[0x38]], np.uint8), np.float32(1.0)).astype(np.float32)[0]
    np.testing.assert_array_equal(out[:8], [0.5, 1.0, 6, -6, -1, 0, 0, 0.5])


def test_e4m3_scale_bytes():
    table = {0x01: 2.0**-9, 0x08: 2.0**-6, 0x30: 0.5, 0x38: 1, 0x40: 2, 0x5C: 24, 0x63: 44, 0x7E: 448, 0xB8: -1}
    scale = np.array([[b] for b in [*table, 0x7F]], np.uint8)
    packed = np.full((len(scale), 8), 0x22, np.uint8)  # every code is 2 (= 1.0)
    out = deq(packed, scale, np.float32(1.0), dtype=jnp.float16).astype(np.float32)
    np.testing.assert_array_equal(out[:-1], np.repeat(np.array(list(table.values()), np.float32)[:, None], 16, 1))
    assert np.isnan(out[-1]).all()  # 0x7F is NaN


def test_quantize_end_to_end_vector():
    x = np.zeros((1, 32), np.float32)
    x[0, 0:4] = [3, -1.5, 0.75, 0.1]
    x[0, 16:20] = [0.3, -0.2, 0.05, 0.125]
    packed, scale, scale_2 = nvfp4.quantize(x)
    assert scale_2.dtype == np.float32 and scale_2.shape == () and scale_2 == np.float32(3) / np.float32(2688)
    assert scale.dtype == ml_dtypes.float8_e4m3fn
    np.testing.assert_array_equal(scale.view(np.uint8), [[0x7E, 0x63]])
    np.testing.assert_array_equal(packed[0], [0xD7, 3, 0, 0, 0, 0, 0, 0, 0xE7, 0x52, 0, 0, 0, 0, 0, 0])
    out = np.asarray(nvfp4.dequantize(packed, scale, scale_2, dtype=jnp.float32))[0]
    np.testing.assert_array_equal(out[0:4], [3, -1.5, 0.75, 0])
    np.testing.assert_allclose(out[16:20], [0.29464287, -0.19642858, 0.04910715, 0.14732143], rtol=1e-7)


# --- quantize ---------------------------------------------------------------------------------------------------

def test_quantize_ties_round_to_even():
    # amax 2.625 -> scale_2 = 2**-10 exactly; block amax 2.625 -> block scale 448, so y = w / 0.4375 exactly.
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
    w = np.concatenate([[6.0], ties, -ties, [0.0]]).astype(np.float32)[None] * np.float32(0.4375)
    packed, scale, scale_2 = nvfp4.quantize(w)
    assert scale_2 == 2.0**-10 and scale.view(np.uint8)[0, 0] == 0x7E
    codes = np.stack([packed & 15, packed >> 4], -1).reshape(-1)
    np.testing.assert_array_equal(codes, [7, 0, 2, 2, 4, 4, 6, 6, 8, 10, 10, 12, 12, 14, 14, 0])


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_quantize_matches_independent_numpy(dtype):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((24, 256)).astype(np.float32) * np.exp(rng.uniform(-6, 2, (24, 1))).astype(np.float32)
    w[3] = 0  # an all-zero row: unit block scales
    w[5, :16] = 1e-7  # a tiny block: scale clamped at 2**-9
    w = w.astype(dtype)
    got, expected = nvfp4.quantize(w), np_quantize(w)
    np.testing.assert_array_equal(got[0], expected[0])
    np.testing.assert_array_equal(got[1].view(np.uint8), expected[1].view(np.uint8))
    assert got[2] == expected[2]
    assert (got[1].view(np.uint8)[3] == 0x38).all() and got[1].view(np.uint8)[5, 0] == 0x01


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 4), st.integers(1, 6), st.floats(1e-6, 1e4), st.integers(0, 2**32 - 1))
def test_round_trip(n, k16, magnitude, seed):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, 16 * k16)) * magnitude).astype(np.float32)
    packed, scale, scale_2 = nvfp4.quantize(w)
    np.testing.assert_array_equal(packed, np_quantize(w)[0])
    out = np.asarray(nvfp4.dequantize(packed, scale, scale_2))
    np.testing.assert_array_equal(bits16(out), bits16(np_dequantize(packed, scale, scale_2)))
    # E2M1 steps are at most 2 (4 -> 6): each value is within one block-scale unit, plus bf16 rounding.
    unit = np.repeat(scale.astype(np.float32) * scale_2, 16, axis=-1)
    assert (np.abs(out.astype(np.float32) - w) <= unit * 1.01 + np.abs(w) * 2**-8).all()


def test_quantize_all_zero_and_bad_shapes():
    packed, scale, scale_2 = nvfp4.quantize(np.zeros((2, 32), np.float32))
    assert not packed.any() and (scale.astype(np.float32) == 1).all() and scale_2 == 1
    assert not np.asarray(nvfp4.dequantize(packed, scale, scale_2)).astype(np.float32).any()
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4.quantize(np.ones((2, 24), np.float32))
    with pytest.raises(ValueError, match="NaN"):
        nvfp4.quantize(np.full((1, 16), np.nan, np.float32))


# --- XLA == NumPy ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(1, 32), (3, 64), (37, 160), (2, 5376), (17, 96), (64, 256)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_dequantize_matches_numpy(shape, dtype):
    rng = np.random.default_rng(shape[0] * 1000 + shape[1])
    packed, scale = random_nvfp4(rng, shape)
    scale_2 = np.float32(rng.uniform(1e-4, 1e-2))
    xla = deq(packed, scale, scale_2, dtype=dtype)
    np.testing.assert_array_equal(bits16(xla), bits16(np_dequantize(packed, scale, scale_2, np.dtype(dtype))))


@pytest.mark.parametrize("scale_2", [7.0, 1e30])  # overflowing products (subnormal ones: the GPU test below)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_dequantize_extreme_scale_2(scale_2, dtype):
    rng = np.random.default_rng(7)
    packed, scale = random_nvfp4(rng, (4, 64))
    numpy = bits16(np_dequantize(packed, scale, np.float32(scale_2), np.dtype(dtype)))
    np.testing.assert_array_equal(bits16(deq(packed, scale, np.float32(scale_2), dtype)), numpy)


def test_nan_scale_gives_nan():
    packed = np.full((1, 16), 0x31, np.uint8)
    scale = np.array([[0x7F, 0xFF]], np.uint8)
    assert np.isnan(deq(packed, scale, np.float32(1)).astype(np.float32)).all()


# --- dequantize API ----------------------------------------------------------------------------------------------

def test_dequantize_accepts_scale_forms_and_leading_dims():
    rng = np.random.default_rng(3)
    packed, scale = random_nvfp4(rng, (6, 64))
    ref = np_dequantize(packed, scale, np.float32(0.5))
    np.testing.assert_array_equal(bits16(nvfp4.dequantize(packed, scale, np.float32(0.5))), bits16(ref))
    as_f8 = scale.view(ml_dtypes.float8_e4m3fn)
    for s2 in [np.float32(0.5), np.array([0.5], np.float32), jnp.bfloat16(0.5), np.array([0.5], np.float16)]:
        np.testing.assert_array_equal(bits16(nvfp4.dequantize(packed, as_f8, s2)), bits16(ref))
    stacked = nvfp4.dequantize(packed.reshape(2, 3, 32), scale.reshape(2, 3, 4), np.float32(0.5))
    assert stacked.shape == (2, 3, 64)
    np.testing.assert_array_equal(bits16(stacked).reshape(6, 64), bits16(ref))
    assert nvfp4.dequantize(packed, scale, np.float32(0.5), dtype=jnp.float32).dtype == jnp.float32


def test_dequantize_jit_does_not_recompile_per_scale_2():
    rng = np.random.default_rng(4)
    packed, scale = random_nvfp4(rng, (2, 32))
    f = jax.jit(lambda p, s, g: nvfp4.dequantize(p, s, g))
    for g in (0.5, 0.25):
        np.testing.assert_array_equal(bits16(f(packed, scale, jnp.float32(g))),
                                      bits16(np_dequantize(packed, scale, np.float32(g))))
    assert f._cache_size() == 1


def test_dequantize_bad_arguments():
    packed, scale = np.zeros((2, 16), np.uint8), np.zeros((2, 2), np.uint8)
    with pytest.raises(ValueError, match="scale shape"):
        nvfp4.dequantize(packed, scale[:, :1], np.float32(1))
    with pytest.raises(ValueError, match="uint8"):
        nvfp4.dequantize(packed.astype(np.int8), scale, np.float32(1))
    with pytest.raises(ValueError, match="scale_2"):
        nvfp4.dequantize(packed, scale, np.ones(2, np.float32))


# --- checkpoint checks ---------------------------------------------------------------------------------------------

def test_check_nvfp4_shapes():
    name = "layers.0.mlp.up_proj.weight"
    assert nvfp4.check_nvfp4_shapes(name, (64, 512), (64, 64), (), expected_nk=(64, 1024)) == (64, 1024)
    assert nvfp4.check_nvfp4_shapes(name, (64, 512), (64, 64), (1,)) == (64, 1024)
    bad = [
        (((64, 24), (64, 3), ()), "not a multiple of 32", name),
        (((64, 512), (64, 32), ()), r"expected \[64, 64\]", name + "_scale"),
        (((64, 512), (64, 64), (2,)), r"\[\] or \[1\]", name + "_scale_2"),
        (((512,), (32,), ()), "2-D", name),
    ]
    for args, message, named in bad:
        with pytest.raises(CheckpointError, match=message) as info:
            nvfp4.check_nvfp4_shapes(name, *args)
        assert named in str(info.value)
    with pytest.raises(CheckpointError, match="disagrees with the config") as info:
        nvfp4.check_nvfp4_shapes(name, (64, 512), (64, 64), (), expected_nk=(128, 512))
    assert name in str(info.value)


def test_check_scales():
    good = np.full((2, 4), 0x38, np.uint8)
    nvfp4.check_scales("w", good, np.float32(1))
    nvfp4.check_scales("w", good.view(ml_dtypes.float8_e4m3fn), np.array([1.0], ml_dtypes.bfloat16))
    nvfp4.check_scales("w", np.zeros((2, 4), np.uint8) | 0x80, np.float32(1))  # -0 block scales: zero, fine
    for bad_byte in (0x7F, 0xFF):
        bad = good.copy()
        bad[1, 2] = bad_byte
        with pytest.raises(CheckpointError, match="w_scale: 1 of 8"):
            nvfp4.check_scales("w", bad, np.float32(1))
        with pytest.raises(CheckpointError, match="w_scale"):
            nvfp4.check_scales("w", bad.view(ml_dtypes.float8_e4m3fn), np.float32(1))
    for s2 in (np.inf, np.nan):
        with pytest.raises(CheckpointError, match="w_scale_2"):
            nvfp4.check_scales("w", good, np.float32(s2))


@pytest.mark.parametrize("dtype", [None, jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("block", [0x01, 0x38])  # E4M3's smallest subnormal, 1
def test_scales_are_refused_exactly_where_xla_dequantizes_a_nonzero_code_to_zero(block, dtype):
    """At the edge (one float32 step of scale_2 apart), `check_scales` passes the scales iff XLA's dequantization
    of the smallest nonzero code (0.5) with them is nonzero in the load dtype (float32 without one)."""
    target = np.finfo(np.float32).tiny if dtype in (None, jnp.float32, jnp.bfloat16) else 2.0**-25
    edge = np.float32(target / (0.5 * float(np.uint8(block).view(ml_dtypes.float8_e4m3fn))))
    packed = np.full((1, 16), 0x11, np.uint8)  # every code 0.5
    scale = np.full((1, 2), block, np.uint8)
    for scale_2 in (np.nextafter(edge, np.float32(0)), edge, np.nextafter(edge, np.float32(1))):
        zero = not np.asarray(nvfp4.dequantize(packed, scale, scale_2, dtype=dtype or jnp.float32)).any()
        try:
            nvfp4.check_scales("w", scale, scale_2, dtype)
            refused = False
        except CheckpointError as e:
            assert "w_scale: 2 of 2 block scales times w_scale_2" in str(e)
            refused = True
        assert refused == zero, (scale_2, refused, zero)


@pytest.mark.parametrize("scale_2", [-0.5, 0.0, -0.0])
def test_a_global_scale_that_is_not_positive_is_refused(scale_2):
    with pytest.raises(CheckpointError, match="w_scale_2: .* not a finite number > 0"):
        nvfp4.check_scales("w", np.full((2, 4), 0x38, np.uint8), np.float32(scale_2))


def test_negative_block_scales_are_refused():
    scale = np.full((2, 4), 0x38, np.uint8)
    scale[0, 1] |= 0x80  # -1.0
    with pytest.raises(CheckpointError, match="w_scale: 1 of 8 block scales are negative"):
        nvfp4.check_scales("w", scale, np.float32(1))


@pytest.mark.parametrize("dtype,scale_2,refused", [
    (jnp.bfloat16, 3e38, True), (jnp.float32, 3e38, True), (jnp.float64, 3e38, True),
    (jnp.float16, 1.0, False),  # 6 x 448 = 2688: fits
    (jnp.float16, 100.0, True),  # 268800 > 65504
    (jnp.bfloat16, 1e35, False),
])
def test_scales_whose_product_overflows_the_load_dtype_are_refused(dtype, scale_2, refused):
    scale = np.full((2, 4), 0x38, np.uint8)
    scale[1, 3] = 0x7E  # 448, the largest E4M3
    if refused:
        with pytest.raises(CheckpointError, match=f"w_scale_2: .*beyond {jnp.dtype(dtype).name}"):
            nvfp4.check_scales("w", scale, np.float32(scale_2), dtype)
    else:
        nvfp4.check_scales("w", scale, np.float32(scale_2), dtype)
    nvfp4.check_scales("w", scale, np.float32(scale_2))  # without a dtype: not checked


# --- on the GPU -----------------------------------------------------------------------------------------------------

DRAFTER_SHAPES = [(2048, 10240), (4096, 2048), (2048, 4096), (512, 2048), (6144, 2048), (2048, 6144),
                  (2048, 5376), (17408, 2048), (1, 2048), (1, 5376), (3, 96), (4097, 2080)]


@gpu
@needs_gpu
@pytest.mark.parametrize("shape", DRAFTER_SHAPES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_gpu_dequantize_matches_numpy(shape, dtype):
    rng = np.random.default_rng(shape[0] * 100_000 + shape[1])
    packed, scale = random_nvfp4(rng, shape)
    scale_2 = np.float32(rng.uniform(1e-4, 1e-1))
    out = nvfp4.dequantize(packed, scale, scale_2, dtype=dtype)
    np.testing.assert_array_equal(bits16(out), bits16(np_dequantize(packed, scale, scale_2, np.dtype(dtype))))


@gpu
@needs_gpu
@pytest.mark.parametrize("scale_2", [1e-38, 3e-36, 1e30])  # subnormal and overflowing products
def test_gpu_dequantize_extreme_scale_2(scale_2):
    """NumPy's bits, but where the float32 product is subnormal, which a platform may flush to zero (XLA:CPU does)."""
    packed, scale = random_nvfp4(np.random.default_rng(8), (256, 2048))
    out = bits16(nvfp4.dequantize(packed, scale, np.float32(scale_2)))
    numpy = np_dequantize(packed, scale, np.float32(scale_2))
    subnormal = np.abs(numpy.astype(np.float32)) < np.finfo(np.float32).tiny
    np.testing.assert_array_equal(np.where(subnormal & (out == 0), bits16(numpy), out), bits16(numpy))

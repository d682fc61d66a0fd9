"""The packed NVFP4 weight-only GEMM on Hopper: a Pallas Mosaic GPU kernel (`jax.experimental.pallas.mosaic_gpu`).

    mosaic_matmul(x [M, K] bf16, codes [N, K/2] u8, scale [N, K/16] e4m3, scale_2 f32 []) -> x @ W.T  [M, N]

Why this shape of kernel (NVIDIA's PTX ISA, "Asynchronous Warpgroup Level Matrix Multiply-Accumulate"):
- WGMMA's left operand has 64-row tiles and its right operand 8..256 columns, so with M = batch x block rows
  (16-512) the weight must be the left operand: the kernel computes out^T [N, M] = W [N, K] @ x^T [K, M], and
  XLA transposes the small result back.
- The codes hold element 2j in the low nibble of byte j. Multiplying the low-nibble plane [N, K/2] by x's
  even columns and the high-nibble plane by x's odd columns sums the same products with no nibble interleave
  in registers: `xt` = x split and transposed by XLA into [2, K/2, M] (x is small beside the weight).
- Each 16-value block of a row has one E4M3 scale; in a nibble plane that block is 8 consecutive columns.
  Broadcasting one scale over 8 register columns has no Mosaic GPU op, so a small WGMMA expands the tile's
  scales: [tile_n, K_tile/16] @ E [K_tile/16, K_tile/2] with E[b, j] = (j // 8 == b) * 2^-8 gives every
  column its block's scale, exactly (one non-zero product per sum), in the layout the codes are read in.
- E2M1 and E4M3 are decoded with integer and float ops (Hopper has no E2M1 conversion instruction):
  `_e2m1_quarter` gives the E2M1 value / 4, `_e4m3_x1024` 1024 x the E4M3 value; E's 2^-8 undoes both.
  Code x scale has at most 6 significant bits, so the bf16 weight tile the WGMMA reads from shared memory is
  exact; the f32 accumulator is multiplied by scale_2 once at the end and rounded to the output dtype once.
  E4M3 NaN bytes (0x7F, 0xFF) decode as 480, not NaN: the loader refuses NaN scales (`check_scales`).
- One warpgroup per CTA, a grid over (N / tile_n, M_padded / tile_m, split_k), K pipelined by
  `plgpu.emit_pipeline` (TMA copies up to `max_concurrent_steps` ahead, fewer where shared memory runs out:
  `pipeline_depth`). Warpgroup lowering semantics: Mosaic infers register layouts and shared-memory tilings/swizzles.

Tile sizes come from `TILINGS`, keyed by `device.device_kind`, with `FALLBACK` for unmeasured devices.
Constraints: N % tile_n == 0 (tile_n 64 or 128), K % tile_k == 0 (tile_k 256 or 512: the scale block's TMA
row must be >= 16 bytes and the expansion WGMMA needs K_tile/16 % 16 == 0), x bf16; M is padded to tile_m.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._shapes import ceil_div, round_up
from ._reference import BLOCK


@dataclasses.dataclass(frozen=True)
class Tiling:
    """tile_n: weight rows per CTA (WGMMA M, 64 or 128); tile_k: K per pipeline step (256 or 512);
    max_concurrent_steps: pipeline depth (TMA copies in flight); split_k: CTAs sharing one output tile's K range
    (their float32 partial sums are added by XLA), 0 = enough to give every SM a CTA (`split_for`)."""

    tile_n: int = 64
    tile_k: int = 256
    max_concurrent_steps: int = 4
    split_k: int = 0


FALLBACK = Tiling()
TILINGS: dict[str, Tiling] = {}  # device_kind -> Tiling, filled from H200 measurements (benchmarks/packed_gemm.py)
# WGMMA N: x's rows per CTA; M above 128 spans several CTAs (a 256-row x tile leaves no room for 2 pipeline steps)
TILE_M = (16, 32, 64, 128)
SMEM_BYTES = 227 * 1024  # Hopper's shared memory per CTA (sm_90: 227 KiB usable)
_EXPAND = 2.0**-8  # undoes _e2m1_quarter's / 4 and _e4m3_x1024's x 1024
_SIGN = np.int32(-(2**31))  # float32's sign bit


def tiling_for(device: Any = None) -> Tiling:
    """The tiling measured for `device` (default: the first device), else `FALLBACK`."""
    kind = (device or jax.devices()[0]).device_kind
    return TILINGS.get(kind, FALLBACK)


def tile_m_for(m: int) -> int:
    """The WGMMA N (columns of x^T per CTA) for M rows: the smallest tile that holds M, at most 128."""
    return next((t for t in TILE_M if t >= m), TILE_M[-1])


def split_for(tiling: Tiling, n: int, m: int, k: int, sms: int) -> int:
    """How many CTAs share each output tile's K range: `tiling.split_k`, or (0) the fewest that give each of the
    `sms` SMs a CTA, among the splits that divide K's pipeline steps and leave each CTA 2 steps or more (a
    weight small in N leaves most SMs idle otherwise: 8B-b16's k_proj is 16 tiles of 64 rows)."""
    steps = k // tiling.tile_k
    if tiling.split_k:
        return tiling.split_k
    tiles = n // tiling.tile_n * ceil_div(m, tile_m_for(m))
    splits = [d for d in range(1, steps + 1) if steps % d == 0 and (d == 1 or steps // d >= 2)]
    return next((d for d in splits if tiles * d >= sms), splits[-1])


def pipeline_depth(tiling: Tiling, tile_m: int, out_dtype: Any) -> int:
    """Pipeline steps in flight: the tiling's, or fewer where a step's buffers (codes, scales, x's two planes)
    would not fit beside the fixed ones (the two bf16 planes, the scales, E, the output tile)."""
    tn, tk = tiling.tile_n, tiling.tile_k
    step = tn * tk // 2 + tn * tk // BLOCK + 2 * (tk // 2) * tile_m * 2
    fixed = 2 * tn * (tk // 2) * 2 + tn * (tk // BLOCK) * 2 + (tk // BLOCK) * (tk // 2) * 2 \
        + tn * tile_m * jnp.dtype(out_dtype).itemsize + 1024  # + barriers and alignment
    return max(0, min(tiling.max_concurrent_steps, (SMEM_BYTES - fixed) // step))


def check_shapes(m: int, n: int, k: int, x_dtype: Any, tiling: Tiling) -> None:
    """Raise ValueError naming the argument for a shape or dtype the kernel does not take."""
    if jnp.dtype(x_dtype) != jnp.bfloat16:
        raise ValueError(f"nvfp4 mosaic matmul: x must be bfloat16, got {jnp.dtype(x_dtype).name}")
    if tiling.tile_n not in (64, 128) or tiling.tile_k not in (256, 512):
        raise ValueError(f"nvfp4 mosaic matmul: tiling {tiling} (tile_n 64 or 128, tile_k 256 or 512)")
    if m < 1:
        raise ValueError(f"nvfp4 mosaic matmul: x has {m} rows")
    if n % tiling.tile_n:
        raise ValueError(f"nvfp4 mosaic matmul: the weight's N = {n} is not a multiple of {tiling.tile_n}")
    if k % tiling.tile_k:
        raise ValueError(f"nvfp4 mosaic matmul: the weight's K = {k} is not a multiple of {tiling.tile_k}")
    if tiling.split_k and (k // tiling.tile_k) % tiling.split_k:
        raise ValueError(f"nvfp4 mosaic matmul: split_k = {tiling.split_k} does not divide K's "
                         f"{k // tiling.tile_k} steps of {tiling.tile_k}")
    if pipeline_depth(tiling, tile_m_for(m), jnp.float32) < 1:
        raise ValueError(f"nvfp4 mosaic matmul: tiling {tiling} does not fit in shared memory at M = {m}")


def _e2m1_quarter(codes: jax.Array, high: bool) -> jax.Array:
    """int32 code bytes -> float32 E2M1 value / 4 of each byte's low (`high=False`) or high nibble.

    A nibble is sign s, exponent e (2 bits), mantissa m. Its e and m placed in a float32 of exponent 124 + e and
    mantissa m give b = 2^(e-3) (1 + m/2), which is value / 4 for e >= 1 (and b >= 1/4 there); for e = 0 (the
    codes 0 and 0.5) value / 4 = 2b - 1/4 (0 or 1/8), which is below b exactly then: min(b, 2b - 1/4) covers
    both without a compare. The sign bit is ORed in last. 9 integer and float operations, all exact.
    """
    shift = 4 if high else 0
    b = lax.bitcast_convert_type(((codes << (22 - shift)) & 0x01C00000) | 0x3E000000, jnp.float32)
    magnitude = jnp.minimum(b, b + b - 0.25)
    sign = (codes << (28 - shift)) & _SIGN
    return lax.bitcast_convert_type(lax.bitcast_convert_type(magnitude, jnp.int32) | sign, jnp.float32)


def _e4m3_x1024(byte: jax.Array) -> jax.Array:
    """int32 E4M3 bytes -> 1024 x their value, int32 (bias 7; the subnormals m * 2^-9 included)."""
    e = (byte >> 3) & 15
    magnitude = ((byte & 7) | (jnp.minimum(e, 1) << 3)) << jnp.maximum(e, 1)
    return jnp.where(byte >= 128, 0 - magnitude, magnitude)


def expansion_matrix(tile_k: int) -> np.ndarray:
    """E [tile_k/16, tile_k/2] bf16: E[b, j] = 2^-8 where plane column j lies in scale block b, else 0."""
    blocks = tile_k // BLOCK
    columns = np.arange(tile_k // 2) // (BLOCK // 2)
    return ((np.arange(blocks)[:, None] == columns[None, :]) * _EXPAND).astype(jnp.bfloat16)


def _gemm_kernel(codes_gmem, scale_gmem, xt_gmem, expand_gmem, scale_2_gmem, out_gmem,
                 w_smem, s_smem, expand_smem, out_smem, barrier, *, tiling: Tiling, tile_m: int, depth: int,
                 cast: Any):
    """One CTA: out^T[split, n tile, m tile] = sum over the split's K range of dequant(W tile) @ x^T tile,
    times scale_2."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    tn, tk = tiling.tile_n, tiling.tile_k
    ni, mi, si = lax.axis_index("n"), lax.axis_index("m"), lax.axis_index("s")
    k_steps = codes_gmem.shape[1] * 2 // tk // out_gmem.shape[0]  # this CTA's steps
    plgpu.copy_gmem_to_smem(expand_gmem, expand_smem, barrier)  # E, once per CTA
    plgpu.barrier_wait(barrier)

    def step(_, codes_smem, scale_smem, x_lo_smem, x_hi_smem, acc_ref):
        # Block scales -> bf16 [tn, tk/16] in shared memory (1024 x value: exact in bf16, <= 4 significant bits).
        scales = _e4m3_x1024(scale_smem[...].astype(jnp.int32))  # [tn, tk/16]
        s_smem[...] = cast(scales.astype(jnp.float32).astype(jnp.bfloat16))
        plgpu.commit_smem()

        def expand(acc_s):  # [tn, tk/16] @ E [tk/16, tk/2] -> each plane column's block scale, f32
            plgpu.wgmma(acc_s, s_smem, expand_smem)
            plgpu.wgmma_wait(0)
            return acc_s[...]

        scale = pl.run_scoped(expand, plgpu.ACC((tn, tk // 2), jnp.float32))  # [tn, tk/2]
        codes = codes_smem[...].astype(jnp.int32)  # [tn, tk/2], element 2j in the low nibble of byte j
        w_smem[0] = (_e2m1_quarter(codes, high=False) * scale).astype(jnp.bfloat16)  # even k
        w_smem[1] = (_e2m1_quarter(codes, high=True) * scale).astype(jnp.bfloat16)  # odd k
        plgpu.commit_smem()
        plgpu.wgmma(acc_ref, w_smem.at[0], x_lo_smem)  # [tn, tk/2] @ [tk/2, tile_m]
        plgpu.wgmma(acc_ref, w_smem.at[1], x_hi_smem)
        plgpu.wgmma_wait(0)  # w_smem is rewritten by the next step

    def accumulate(acc_ref):
        pipeline = plgpu.emit_pipeline(
            functools.partial(_with_acc, step, acc_ref),
            grid=(k_steps,),
            in_specs=[
                plgpu.BlockSpec((tn, tk // 2), lambda k: (ni, si * k_steps + k)),  # codes
                plgpu.BlockSpec((tn, tk // BLOCK), lambda k: (ni, si * k_steps + k)),  # scale bytes
                plgpu.BlockSpec((tk // 2, tile_m), lambda k: (si * k_steps + k, mi)),  # x^T, x's even columns
                plgpu.BlockSpec((tk // 2, tile_m), lambda k: (si * k_steps + k, mi)),  # x^T, x's odd columns
            ],
            max_concurrent_steps=min(depth, k_steps),
        )
        pipeline(codes_gmem, scale_gmem, xt_gmem.at[0], xt_gmem.at[1])
        return acc_ref[...]

    acc = pl.run_scoped(accumulate, plgpu.ACC((tn, tile_m), jnp.float32))  # [tn, tile_m]
    out_smem[...] = (acc * scale_2_gmem[0]).astype(out_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[si, pl.ds(ni * tn, tn), pl.ds(mi * tile_m, tile_m)])
    plgpu.wait_smem_to_gmem(0)


def _with_acc(step, acc_ref, indices, *refs):
    return step(indices, *refs, acc_ref)


def split_x(x: jax.Array, tile_m: int) -> jax.Array:
    """x [M, K] -> x^T planes [2, K/2, M padded to tile_m]: [0] the even columns of x, [1] the odd ones."""
    m, k = x.shape
    m_pad = round_up(m, tile_m)
    x = jnp.pad(x, ((0, m_pad - m), (0, 0)))
    return x.reshape(m_pad, k // 2, 2).transpose(2, 1, 0)


@functools.partial(jax.jit, static_argnames=("out_dtype", "tiling", "interpret"))
def mosaic_matmul(x: jax.Array, codes: jax.Array, scale: jax.Array, scale_2: jax.Array, *,
                  out_dtype: Any = jnp.bfloat16, tiling: Tiling | None = None, interpret: bool = False) -> jax.Array:
    """`x [M, K] bf16 @ W.T -> [M, N] out_dtype` for W packed NVFP4 (codes u8 [N, K/2], scale float8_e4m3fn or its
    uint8 bits [N, K/16], scale_2 f32 []). `interpret=True` runs Pallas's GPU interpreter (on a CPU)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    tiling = tiling or tiling_for()
    (m, k), n = x.shape, codes.shape[0]
    check_shapes(m, n, k, x.dtype, tiling)
    tile_m = tile_m_for(m)
    xt = split_x(x, tile_m)  # [2, K/2, M_pad]
    m_pad = xt.shape[2]
    if scale.dtype != jnp.uint8:
        scale = lax.bitcast_convert_type(scale, jnp.uint8)
    expand = jnp.asarray(expansion_matrix(tiling.tile_k))
    splits = split_for(tiling, n, m, k, getattr(jax.devices()[0], "core_count", 0) or 1)
    part_dtype = jnp.dtype(out_dtype) if splits == 1 else jnp.dtype(jnp.float32)  # partial sums stay f32
    params: dict[str, Any] = {}
    if interpret:
        params["interpret"] = _interpret_params()
    else:
        params["compiler_params"] = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)
    cast = (lambda a: a) if interpret else (lambda a: plgpu.layout_cast(a, plgpu.Layout.WGMMA))
    kernel = plgpu.kernel(
        functools.partial(_gemm_kernel, tiling=tiling, tile_m=tile_m, cast=cast,
                          depth=pipeline_depth(tiling, tile_m, part_dtype)),
        out_type=jax.ShapeDtypeStruct((splits, n, m_pad), part_dtype),
        grid=(n // tiling.tile_n, m_pad // tile_m, splits),
        grid_names=("n", "m", "s"),
        scratch_types=[
            plgpu.SMEM((2, tiling.tile_n, tiling.tile_k // 2), jnp.bfloat16),  # dequantized planes
            plgpu.SMEM((tiling.tile_n, tiling.tile_k // BLOCK), jnp.bfloat16),  # block scales
            plgpu.SMEM((tiling.tile_k // BLOCK, tiling.tile_k // 2), jnp.bfloat16),  # E
            plgpu.SMEM((tiling.tile_n, tile_m), part_dtype),  # the output tile
            plgpu.Barrier(num_arrivals=1),  # E's copy
        ],
        **params,
    )
    out_t = kernel(codes, scale, xt, expand, scale_2.astype(jnp.float32).reshape(1))  # [splits, N, M_pad]
    out_t = out_t[0] if splits == 1 else out_t.sum(0)  # [N, M_pad]
    return out_t[:, :m].T.astype(out_dtype)


def _interpret_params() -> Any:
    """Pallas's GPU interpret-mode parameters: `plgpu.InterpretGPUParams` where jax exports it, else its jax 0.10
    home (`jax._src.pallas.mosaic_gpu.interpret.params`)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    if hasattr(plgpu, "InterpretGPUParams"):
        return plgpu.InterpretGPUParams()
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()

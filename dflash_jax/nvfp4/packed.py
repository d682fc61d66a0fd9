"""NVFP4 weights kept packed on the device: the `Packed` leaf and its weight-only GEMM `matmul`.

`load_drafter(..., weights="packed")` leaves every NVFP4 linear weight as a `Packed`: the checkpoint's codes,
block scales and global scale, 0.5625 bytes per weight instead of bf16's 2. The forward's projections reach it
through `dflash_jax.layers.dot`, which sends a `Packed` operand to `matmul` (`Packed.apply`).

`Packed` is a registered dataclass (a pytree node of three arrays, the compute dtype static), so `jax.jit`,
`jax.tree`, `jax.device_put`, the NNX and linen modules and orbax carry it whole; it answers `.shape` (the
unpacked `[N, K]`), `.dtype` (what it dequantizes to), `.ndim`, `.sharding` and `.nbytes` as an array would, so
that code reading a weight's shape or dtype (`init_cache`, `attach`, pairing checks) needs no special case.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

import jax
import jax.numpy as jnp

from .._kernel_choice import kernel_choice
from .._precision import weight_dot
from .._weight_leaf import WeightLeaf
from ..platform import Platform, on_gpu, platform_of
from ._mosaic_gemm import check_shapes, mosaic_matmul
from ._reference import BLOCK, dequantize_xla

__all__ = ["Packed", "matmul", "padded", "MatmulBackend"]

MatmulBackend = Literal["auto", "xla", "pallas"]  # ("mosaic": "pallas" before 0.2, `_kernel_choice`)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, repr=False)
class Packed(WeightLeaf):
    """One NVFP4 linear weight `[N, K]` as ModelOpt stores it (docs/nvfp4.md).

    codes   uint8 [N, K/2]            two E2M1 codes per byte, element 2j in the low nibble
    scale   float8_e4m3fn [N, K/16]   one scale per 16 consecutive values of a row
    scale_2 float32 []                the global scale
    dtype   (static) the dtype it is computed in: `dequantize()` gives it, `matmul` multiplies in it
    columns (static) K when the codes hold more columns, zeros past it (`padded`); None: all of them

    Constructed from arrays, the shapes and dtypes are checked (ValueError); K must be a multiple of 32, as
    the loader requires of NVFP4 weights. `.nbytes`: 0.5625 per weight plus 4 (`WeightLeaf`).
    """

    LABEL = "nvfp4.Packed"

    codes: jax.Array
    scale: jax.Array
    scale_2: jax.Array
    dtype: Any = dataclasses.field(default=jnp.bfloat16, metadata=dict(static=True))
    columns: int | None = dataclasses.field(default=None, metadata=dict(static=True))

    def check_arrays(self, codes: Any, scale: Any, scale_2: Any) -> None:
        check_packed(codes, scale, scale_2)

    @property
    def shape(self) -> tuple[int, int]:
        """The unpacked weight's `(N, K)`."""
        n, half_k = self.codes.shape
        return n, 2 * half_k if self.columns is None else self.columns

    @property
    def stored_columns(self) -> int:
        """The columns the codes hold: K, or K padded (`padded`)."""
        return 2 * self.codes.shape[1]

    def dequantize(self) -> jax.Array:
        """The weight `[N, K]` in `self.dtype`, bit for bit what `load_drafter(weights="dequantized")` places."""
        return dequantize_xla(self.codes, self.scale, self.scale_2, self.dtype)[:, :self.shape[1]]

    def apply(self, x: jax.Array, out_dtype: Any) -> jax.Array:
        """`x [..., K] @ W.T` in `out_dtype` (`matmul`): what `layers.dot` calls for a `layers.QuantizedWeight`."""
        return matmul(x, self, out_dtype=out_dtype)


def padded(w: Packed, multiple: int) -> Packed:
    """`w` with its codes' columns padded to a multiple of `multiple` by zero codes (unit block scales): the K the
    Mosaic kernel's tiles take (`_mosaic_gemm.check_shapes`: a multiple of `tile_k`; Nemotron's hidden 2688 is
    not). A zero code is 0 whatever its scale, so every product and `dequantize()` stay what they were; `matmul`
    pads x to match (a copy of x, 5% wider at 2688 -> 2816, against the weight's dequantization each step)."""
    n, k = w.shape
    extra = -k % multiple
    if extra == 0 or w.stored_columns != k:
        return w
    codes = jnp.pad(w.codes, ((0, 0), (0, extra // 2)))  # [N, (K + extra) / 2]
    scale = jnp.concatenate([w.scale, jnp.ones((n, extra // BLOCK), w.scale.dtype)], axis=1)
    return Packed(codes, scale, w.scale_2, dtype=w.dtype, columns=k)


def check_packed(codes: Any, scale: Any, scale_2: Any) -> None:
    """Raise ValueError for three arrays that do not make a `Packed` (see its docstring for the layout)."""
    if codes.dtype != jnp.uint8 or len(codes.shape) != 2:
        raise ValueError(f"nvfp4.Packed: codes must be uint8 [N, K/2], got {jnp.dtype(codes.dtype).name}"
                         f"{list(codes.shape)}")
    n, k = codes.shape[0], 2 * codes.shape[1]
    if k % 32:
        raise ValueError(f"nvfp4.Packed: K = {k} (2 x {codes.shape[1]} bytes) is not a multiple of 32")
    if scale.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"nvfp4.Packed: scale must be float8_e4m3fn, got {jnp.dtype(scale.dtype).name}")
    if tuple(scale.shape) != (n, k // BLOCK):
        raise ValueError(f"nvfp4.Packed: scale has shape {list(scale.shape)}, expected [{n}, {k // BLOCK}] "
                         f"for codes {list(codes.shape)} (one scale per {BLOCK} values)")
    if scale_2.dtype != jnp.float32 or tuple(scale_2.shape) != ():
        raise ValueError(f"nvfp4.Packed: scale_2 must be a float32 scalar [], got "
                         f"{jnp.dtype(scale_2.dtype).name}{list(scale_2.shape)}")


def matmul(x: jax.Array, w: Packed, *, out_dtype: Any = None, backend: MatmulBackend = "auto",
           platform: Platform | None = None) -> jax.Array:
    """`x [..., K] @ W.T -> [..., N]` for a packed NVFP4 weight `W [N, K]`, in `out_dtype` (default x's).

    The weight-only GEMM of packed drafters. Backends: "xla" dequantizes to `w.dtype` and multiplies (the
    reference); "pallas" runs the Pallas Mosaic GPU kernel that dequantizes in registers and feeds WGMMA
    (`_mosaic_gemm`: Hopper, bf16 x and weight, N % 64 == 0, K % 256 == 0; on a CPU in Pallas's interpret
    mode, slowly); "auto" is what `_auto_backend` picks: the kernel on Hopper where it takes the operands, XLA
    elsewhere. `platform`: the device facts and tiling that choose (default: those of the devices holding the
    weight, `platform.platform_of`). Jit-compatible.
    """
    if not isinstance(w, Packed):
        raise TypeError(f"nvfp4.matmul: w must be an nvfp4.Packed, got {type(w).__name__}")
    if x.shape[-1] != w.shape[1]:
        raise ValueError(f"nvfp4.matmul: x has {x.shape[-1]} features, the weight [{w.shape[0]}, {w.shape[1]}] "
                         f"expects {w.shape[1]}")
    backend = kernel_choice("nvfp4.matmul", "backend", backend, ("auto", "xla", "pallas"))  # type: ignore[assignment]
    out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
    platform = platform or platform_of(w)
    if backend == "auto" and _auto_backend(x, w, platform) == "pallas":  # the kernel where lowered for a GPU
        return on_gpu(platform, lambda x, w: _mosaic(x, w, out_dtype, platform), lambda x, w: _xla(x, w, out_dtype),
                      x, w)
    if backend == "pallas":
        if w.dtype != jnp.bfloat16:
            raise ValueError(f"nvfp4.matmul: backend='pallas' computes in bfloat16; the weight's dtype is "
                             f"{w.dtype.name}")
        return _mosaic(x, w, out_dtype, platform)
    return _xla(x, w, out_dtype)


def _mosaic(x: jax.Array, w: Packed, out_dtype: Any, platform: Platform) -> jax.Array:
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, w.stored_columns - x.shape[-1])])  # to a padded weight's K
    *lead, k = x.shape
    # Pallas' interpreter where there is no GPU (its callbacks cannot sit in a `platform_dependent` branch)
    out = mosaic_matmul(x.reshape(-1, k), w.codes, w.scale, w.scale_2, out_dtype=out_dtype,
                        tiling=platform.tuning.nvfp4_gemm, sms=platform.sm_count,
                        interpret=not platform.cuda)  # [M, N]
    return out.reshape(*lead, w.shape[0])


def _xla(x: jax.Array, w: Packed, out_dtype: Any) -> jax.Array:
    return weight_dot(x, w.dequantize(), out_dtype)


# `backend="auto"` runs the Mosaic kernel on Hopper: it passed the GPU tests on every drafter shape and beats the
# dequantize-then-dot product at every M measured (docs/benchmarks.md, "Packed NVFP4 GEMM").
AUTO_MOSAIC = True


def _auto_backend(x: jax.Array, w: Packed, platform: Platform) -> MatmulBackend:
    """The one place `backend="auto"` is decided: "pallas" where `AUTO_MOSAIC` is set, the platform is a Hopper GPU
    and the kernel takes the operands at its tiling (`mosaic_takes`); XLA's dequantize-then-dot otherwise."""
    return "pallas" if AUTO_MOSAIC and platform.hopper and mosaic_takes(x, w, platform) else "xla"


def mosaic_takes(x: jax.Array, w: Packed, platform: Platform) -> bool:
    """Whether the Mosaic kernel takes `x @ w.T`: bf16 x and weight, and shapes the platform's tiling divides."""
    try:
        check_shapes(math.prod(x.shape[:-1]), w.shape[0], w.stored_columns, x.dtype, platform.tuning.nvfp4_gemm)
    except ValueError:
        return False
    return w.dtype == jnp.bfloat16

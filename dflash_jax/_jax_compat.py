"""Every private or unstable JAX API the package uses, in one place, behind a version fence.

The package runs on the jax versions in `SUPPORTED` (CI: 0.10.2; the GPU machines: 0.11.2). Outside that range,
importing this module raises `UnsupportedJaxError` naming the installed and the supported versions, rather
than failing later inside a kernel's lowering with an attribute error. What lives here and why it is private:
- MLIR builders (`jax._src.lib.mlir`: `ir` and the `arith`, `llvm`, `vector` dialects), for the inline PTX of the
  NVFP4 kernels: JAX exports no public home for them.
- `FragmentedArray(_registers=...)`: a Mosaic GPU register array built from MLIR values (`plgpu.inline_mgpu`
  hands registers in and expects a `FragmentedArray` back; its constructor's fields are private).
- The Mosaic GPU interpreter's parameters: `plgpu.InterpretGPUParams` from jax 0.11, before that only in
  `jax._src.pallas.mosaic_gpu.interpret.params`.
- `jaxlib.xla_client`: loading and running a serialised executable (`_executables`) and reading its signature.
- `jax._src.config`'s Pallas interpret-mode switch (the tests' interpreter of Triton-style kernels).
The heavy ones are imported when first called: importing Pallas costs ~50 ms that a load may not need.
"""

from __future__ import annotations

import re
from types import ModuleType
from typing import Any

import jax
import jaxlib.version
import jaxlib.xla_client as xla_client

# Inclusive lower bound, exclusive upper bound, (major, minor) of `jax.__version__`
SUPPORTED = ((0, 10), (0, 12))
JAXLIB_VERSION: str = jaxlib.version.__version__

__all__ = ["SUPPORTED", "JAXLIB_VERSION", "UnsupportedJaxError", "check_version", "xla_client", "mlir",
           "fragmented_array", "interpret_params", "pallas_interpret_switch"]


class UnsupportedJaxError(ImportError):
    """The installed jax is outside the range whose private APIs this package was written against."""


def check_version(version: str) -> None:
    """Raise `UnsupportedJaxError` unless jax `version` ("0.10.2", "0.11.0.dev20260101") is in `SUPPORTED`."""
    match = re.match(r"(\d+)\.(\d+)", version)
    low, high = SUPPORTED
    if match is None or not low <= (int(match[1]), int(match[2])) < high:
        raise UnsupportedJaxError(
            f"dflash_jax supports jax >= {low[0]}.{low[1]} and < {high[0]}.{high[1]} (it uses private JAX APIs "
            f"that change between versions: dflash_jax/_jax_compat.py); installed: jax {version}")


check_version(jax.__version__)


def mlir() -> tuple[ModuleType, ModuleType, ModuleType, ModuleType]:
    """JAX's MLIR builders `(ir, arith, llvm, vector)`, for Mosaic GPU lane-level code."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm, vector

    return ir, arith, llvm, vector


def fragmented_array(registers: Any, layout: Any, *, is_signed: bool | None) -> Any:
    """A Mosaic GPU `FragmentedArray` of MLIR `registers` (a numpy object array in `layout`'s register shape)."""
    from jax.experimental.mosaic import gpu as mgpu

    return mgpu.FragmentedArray(_registers=registers, _layout=layout, _is_signed=is_signed)


def interpret_params() -> Any:
    """Pallas's Mosaic GPU interpret-mode parameters (a kernel run on the CPU): `plgpu.InterpretGPUParams` where jax
    exports it, else its jax 0.10 home. ImportError where this jax has no Mosaic GPU interpreter."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    if hasattr(plgpu, "InterpretGPUParams"):
        return plgpu.InterpretGPUParams()
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()


def pallas_interpret_switch() -> Any:
    """The context-local switch behind Pallas's `force_*_interpret_mode` (its `swap_local`/`set_local` run every
    kernel traced meanwhile in an interpreter), or None where this jax has none: JAX has no public generic one."""
    from jax._src import config

    return getattr(config, "pallas_tpu_interpret_mode_context_manager", None)

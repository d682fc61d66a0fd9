"""Which GPU the package's Pallas kernels compile for, and how they run on a CPU."""

from typing import Any

import jax

from ._jax_compat import interpret_params


def _compute_capability() -> float:
    """The default device's CUDA compute capability (9.0 on a Hopper), 0 off a GPU."""
    device = jax.devices()[0]
    return float(getattr(device, "compute_capability", 0)) if device.platform == "gpu" else 0.0


def hopper_or_newer() -> bool:
    """Whether the default device is a GPU that Pallas Mosaic GPU compiles for (compute capability 9.0 or more)."""
    return _compute_capability() >= 9.0


def hopper() -> bool:
    """Whether the default device is a Hopper GPU (compute capability 9.0: WGMMA, which later GPUs do not have)."""
    return _compute_capability() == 9.0


def kernel_params(interpret: bool) -> dict[str, Any]:
    """`plgpu.kernel`'s keyword arguments for a Mosaic GPU kernel written with warpgroup semantics: its interpret
    mode's parameters (`interpret`: run on the CPU), else warpgroup lowering."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    if interpret:
        return {"interpret": interpret_params()}
    return {"compiler_params": plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)}


def sm_count() -> int:
    """The default device's streaming multiprocessors (1 where it does not say: a CPU)."""
    return getattr(jax.devices()[0], "core_count", 0) or 1


def k_splits(steps: int, tiles: int, sms: int) -> int:
    """How many CTAs share each output tile's K range of `steps` pipeline steps: the fewest that give each of the
    `sms` SMs a CTA (`tiles` output tiles x splits), among the splits that divide the steps and leave each CTA 2
    steps or more (a product narrow in its output leaves most SMs idle otherwise)."""
    splits = [d for d in range(1, steps + 1) if steps % d == 0 and (d == 1 or steps // d >= 2)]
    return next((d for d in splits if tiles * d >= sms), splits[-1])

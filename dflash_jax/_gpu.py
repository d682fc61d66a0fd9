"""How the package's Pallas Mosaic GPU kernels are compiled, run on a CPU, and split over a GPU's SMs (which GPU
they compile for: `platform`)."""

from typing import Any

from ._jax_compat import interpret_params


def kernel_params(interpret: bool) -> dict[str, Any]:
    """`plgpu.kernel`'s keyword arguments for a Mosaic GPU kernel written with warpgroup semantics: its interpret
    mode's parameters (`interpret`: run on the CPU), else warpgroup lowering."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    if interpret:
        return {"interpret": interpret_params()}
    return {"compiler_params": plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)}


def k_splits(steps: int, tiles: int, sms: int) -> int:
    """How many CTAs share each output tile's K range of `steps` pipeline steps: the fewest that give each of the
    `sms` SMs a CTA (`tiles` output tiles x splits), among the splits that divide the steps and leave each CTA 2
    steps or more (a product narrow in its output leaves most SMs idle otherwise)."""
    splits = [d for d in range(1, steps + 1) if steps % d == 0 and (d == 1 or steps // d >= 2)]
    return next((d for d in splits if tiles * d >= sms), splits[-1])

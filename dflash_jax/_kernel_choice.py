"""The one vocabulary of kernel choices, for every argument that picks how a product or an attention runs:
`propose(impl=)`, `attention.attend(impl=)`, a target's `prefill(impl=)`,
`nvfp4.matmul(backend=)`, `fp8.matmul(backend=)`. Each takes the values that apply to it (docs/nvfp4.md):

    "auto"    picked by where the program runs and the operands
    "xla"     XLA's own lowering (the reference path; every platform)
    "pallas"  the package's Pallas kernel, lowered with Mosaic GPU (Hopper)
    "cudnn"   cuDNN's fused attention (a target's prefill; GPU)
    "scaled"  FP8: the codes converted inside XLA's product, scaled once after

An old spelling (`RENAMED`: "mosaic", which `nvfp4.matmul` used for its Pallas kernel) is accepted for one release
with a `FutureWarning` naming the new one (a warning users see by default, unlike `DeprecationWarning`).
The MoE block's `impl` ("gather", "reduce", ...) chooses an algorithm, not a kernel: it is its own vocabulary.
"""

from __future__ import annotations

import warnings
from typing import Literal

Kernel = Literal["auto", "xla", "pallas", "cudnn", "scaled"]
KERNELS: tuple[Kernel, ...] = ("auto", "xla", "pallas", "cudnn", "scaled")
RENAMED = {"mosaic": "pallas"}  # old spelling -> the one spelling; accepted until the release after 0.1


def kernel_choice(where: str, name: str, value: object, allowed: tuple[Kernel, ...]) -> Kernel:
    """`value` of the argument `name` of `where` when it is one of `allowed` (an old spelling warned about and
    renamed), else a `ValueError` naming the argument and the accepted values."""
    if isinstance(value, str) and value in RENAMED:
        new = RENAMED[value]
        warnings.warn(f"{where}: {name}={value!r} is spelled {name}={new!r} now (one vocabulary for every kernel "
                      f"choice); {value!r} will be refused in the next release", FutureWarning, stacklevel=3)
        value = new
    if not isinstance(value, str) or value not in allowed:
        known = "" if value in KERNELS else " (not a kernel choice)"
        raise ValueError(f"{where}: {name}={value!r}{known}; expected one of {', '.join(map(repr, allowed))}")
    return value

"""Running the GPU kernels' Pallas code on a CPU, in interpret mode."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import jax
import pytest

from dflash_jax._gpu import interpret_params

on_gpu = jax.default_backend() == "gpu"
# The tests of a kernel on the device it was written for (a Hopper GPU); CI runs them with `pytest -m gpu` there.
needs_gpu = pytest.mark.skipif(not on_gpu, reason="needs a CUDA GPU")

T = TypeVar("T")


def interpreted(run: Callable[[], T]) -> T:
    """`run()` with every Pallas kernel it traces run in interpret mode on the CPU: JAX's generic interpreter
    (which runs Triton-style kernels such as the split-K decode kernel), else its Mosaic GPU interpreter (for
    kernels written with Mosaic GPU primitives). Skips, naming each interpreter's error, where none runs the
    kernel; `run` should only compute (check its results outside), so that a wrong result fails, never skips."""
    from jax._src import config  # the switch behind pallas' force_*_interpret_mode; JAX has no public generic one

    switch = getattr(config, "pallas_tpu_interpret_mode_context_manager", None)
    if switch is None:
        pytest.skip("this JAX has no Pallas interpret-mode switch (jax._src.config."
                    "pallas_tpu_interpret_mode_context_manager)")
    modes: list[object] = [True]
    try:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    except ImportError:
        pass
    else:
        modes.append(InterpretGPUParams())
    errors = []
    for mode in modes:
        previous = switch.swap_local(mode)
        try:
            return run()
        except Exception as e:  # noqa: BLE001 (a kernel this interpreter cannot run: try the next)
            errors.append(f"{type(mode).__name__}: {type(e).__name__}: {str(e)[:200]}")
        finally:
            switch.set_local(previous)
    pytest.skip("no Pallas interpreter runs the kernel on this CPU: " + "; ".join(errors))


def _mosaic_interpreter() -> bool:
    try:
        interpret_params()
    except ImportError:
        return False
    return True


# Kernels that take `interpret=True` (Pallas's Mosaic GPU interpreter: jax 0.10's private module, or jax 0.11's).
needs_mosaic_interpreter = pytest.mark.skipif(not _mosaic_interpreter(),
                                              reason="this jax has no Mosaic GPU interpret mode")

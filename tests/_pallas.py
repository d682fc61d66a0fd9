"""Running the GPU kernels' Pallas code on a CPU, in interpret mode."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import jax
import pytest

from dflash_jax._jax_compat import interpret_params, pallas_interpret_switch
from dflash_jax.platform import Platform
from dflash_jax.tuning import tuning_for

on_gpu = jax.default_backend() == "gpu"
# An H200's platform: what the kernel choices read on a Hopper GPU, for tracing their GPU branches on a CPU (lowered
# for CUDA by `jax.export`, which needs no GPU)
HOPPER = Platform(kind="NVIDIA H200", compute_capability=9.0, sm_count=132, cuda=True, tuning=tuning_for("NVIDIA H200"))
# The tests of a kernel on the device it was written for (a Hopper GPU); CI runs them with `pytest -m gpu` there.
needs_gpu = pytest.mark.skipif(not on_gpu, reason="needs a CUDA GPU")

T = TypeVar("T")


def interpreted(run: Callable[[], T]) -> T:
    """`run()` with every Pallas kernel it traces run in interpret mode on the CPU: JAX's generic interpreter
    (which runs Triton-style kernels such as the split-K decode kernel), else its Mosaic GPU interpreter (for
    kernels written with Mosaic GPU primitives). Skips, naming each interpreter's error, where none runs the
    kernel; `run` should only compute (check its results outside), so that a wrong result fails, never skips."""
    switch = pallas_interpret_switch()
    if switch is None:
        pytest.skip("this JAX has no Pallas interpret-mode switch (jax._src.config."
                    "pallas_tpu_interpret_mode_context_manager)")
    modes: list[object] = [True]
    try:
        modes.append(interpret_params())
    except ImportError:
        pass
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

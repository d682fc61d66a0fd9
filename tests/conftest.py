"""Test set-up: 8 simulated CPU devices (so replication over a mesh is exercised on any machine), strict dtype
promotion (an implicit promotion in the package is a bug: casts are written out), cheap CPU compilation, rarer
garbage collections, a private executable cache."""

import atexit
import gc
import importlib.util
import os
import shutil
import tempfile

# The suite's time on a CPU is XLA compiling hundreds of tiny programs, not running them. These flags make XLA:CPU's
# code generation cheaper (LLVM without its optimisation passes, the elemental emitters, one codegen split): on
# 2 cores a 6-layer speculative loop compiles in about 2.5 s instead of 6 s. Compiled code is slower, which tiny
# shapes do not notice; results are unchanged (every tolerance and token check of the suite holds). Off where a
# GPU plugin is installed, so that GPU tests run what users run. Subprocesses inherit them.
CPU_COMPILE_FLAGS = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                     "--xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1")
if not any(importlib.util.find_spec(p) for p in ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_plugins")):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {CPU_COMPILE_FLAGS}".strip()

import jax  # noqa: E402  (after XLA_FLAGS)
import pytest  # noqa: E402

# Before any backend is initialised. JAX's own option, not XLA_FLAGS, so subprocesses keep their one device.
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_dtype_promotion", "strict")
# Tracing and lowering allocate millions of objects, and at Python's default thresholds (700, 10, 10) the collector
# ran about 1200 times over test_golden and test_nemotron_h, walking the ever larger heap of compiled programs: those
# two modules ran 9% faster with these (12 collections, the same peak memory). Cycles are freed all the same.
gc.set_threshold(50_000, 20, 20)
# compiled conversions go to a cache of this run, not the user's (tests that need their own set it themselves)
os.environ["DFLASH_JAX_CACHE_DIR"] = tempfile.mkdtemp(prefix="dflash_jax-test-cache-")
atexit.register(shutil.rmtree, os.environ["DFLASH_JAX_CACHE_DIR"], ignore_errors=True)
os.environ["XDG_STATE_HOME"] = tempfile.mkdtemp(prefix="dflash_jax-test-state-")  # the cache's key: the run's own
atexit.register(shutil.rmtree, os.environ["XDG_STATE_HOME"], ignore_errors=True)

DATA = os.path.join(os.path.dirname(__file__), "data")
GOLDEN = os.path.join(DATA, "golden")  # copy of the shared PyTorch-reference outputs (README inside)


@pytest.fixture(scope="session")
def cpu_mesh():
    """A 1-D mesh over every local device (8 simulated CPU devices in the suite)."""
    return jax.make_mesh((len(jax.devices()),), ("data",))


@pytest.fixture
def quick_calibration():
    """A calibration for the adaptive policy (`Adaptive(calibration=...)`) that measures its step costs in calls of
    1 and 2 steps, once each, from nothing measured, in any run (`share` 10: its forced steps may cost ten times the
    run): so that a run of a few dozen tokens finishes the measurement and then takes the policy's own lengths."""
    from dflash_jax import Calibration

    return Calibration(steps=1, repeats=1, share=10.0)


# The modules that compile the most run first, longest first, so that parallel workers (pyproject's `-n 2 --dist
# loadfile`) finish together instead of one of them ending the run alone on a late heavy module. Order within a
# module is kept. The order: each module's test time in one run of the suite (2026-12-07), longest first.
_HEAVY_FIRST = ("test_benchmarks", "test_generate", "test_multihost", "test_target_nemotron_h", "test_docs",
                "test_generate_sampling", "test_fuzz", "test_tensor_parallel_hybrid", "test_golden", "test_packed",
                "test_tensor_parallel", "test_adaptive", "test_drafting", "test_generate_hybrid", "test_nemotron_h",
                "test_pairing", "test_generate_cli", "test_temperatures", "test_sampling", "test_examples")


def pytest_configure(config):
    # xdist hands out modules in the order above only without its own reordering (by number of tests, which sends a
    # one-test module that compiles for a minute, like test_multihost, last)
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(_HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.module.__name__.rsplit(".", 1)[-1], len(rank)))

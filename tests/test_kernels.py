"""Explicit kernel choice and device-side buffers: the `impl` vocabulary, the kernel tuning table, caches made on
their devices, and the target's forward and prefill donating the cache."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import attention, fp8, nvfp4
from dflash_jax.attention import LayerRule, Span, attend
from dflash_jax.drafting import init_cache, propose
from dflash_jax.platform import Platform, has_cuda, platform_of, process_platform
from dflash_jax.testing import QWEN3_TINY_CONFIGS, random_drafter, random_qwen3, random_qwen3_5
from dflash_jax.tuning import FALLBACK, TUNING, tuning_for

from ._pallas import HOPPER


@pytest.mark.parametrize("call, says", [
    (lambda: attend(jnp.ones((1, 1, 2, 64)), jnp.zeros((1, 1), jnp.int32), LayerRule(True, None),
                    spans=(Span(*[jnp.ones((1, 1, 8, 64))] * 2, jnp.zeros(1, jnp.int32), jnp.ones(1, jnp.int32)),),
                    impl="palas"),
     r"attend: impl='palas' \(not a kernel choice\); expected one of 'auto', 'xla', 'pallas'"),
    (lambda: random_qwen3("tiny-qwen3", dtype=jnp.float32).prefill(jnp.ones((1, 4), jnp.int32), None,
                                                                    jnp.array([4]), impl="pallas"),
     r"prefill: impl='pallas'; expected one of 'auto', 'xla', 'cudnn'"),
    (lambda: propose(random_drafter("tiny-dflash", dtype=jnp.float32), None, None, [1], [1], impl="XLA"),
     r"propose: impl='XLA' \(not a kernel choice\); expected one of 'auto', 'xla', 'pallas'"),
])
def test_a_kernel_choice_outside_the_vocabulary_is_refused(call, says):
    with pytest.raises(ValueError, match=says):
        call()


def test_one_vocabulary_names_the_pallas_kernels():
    """`nvfp4.matmul` called its Pallas kernel "mosaic" where `attend` and `propose` say "pallas": the old spelling
    still runs for one release, with a warning naming the new one; every kernel-choice argument refuses a value
    outside its choices in the same words."""
    w = nvfp4.Packed(jnp.zeros((64, 128), jnp.uint8), jnp.ones((64, 16), jnp.float8_e4m3fn), jnp.float32(1),
                     jnp.float32)
    x = jnp.zeros((2, 256), jnp.float32)
    renamed = r"nvfp4.matmul: backend='mosaic' is spelled backend='pallas' now .*refused in the next release"
    with pytest.warns(FutureWarning, match=renamed), pytest.raises(ValueError, match="backend='pallas' computes"):
        nvfp4.matmul(x, w, backend="mosaic")  # the kernel itself, as 'pallas', refuses a float32 weight
    for call, where in ((lambda b: nvfp4.matmul(x, w, backend=b), "nvfp4.matmul: backend"),
                        (lambda b: fp8.matmul(x[:, :64], fp8.Fp8(jnp.zeros((8, 64), jnp.float8_e4m3fn),
                                                                  jnp.float32(1)), backend=b), "fp8.matmul: backend")):
        with pytest.raises(ValueError, match=rf"{where}='triton' \(not a kernel choice\); expected one of 'auto'"):
            call("triton")


def test_the_span_kernel_is_chosen_by_where_the_program_runs():
    """"auto" takes the GPU span kernel in a program lowered for a CUDA GPU and XLA's loop in one lowered for the
    CPU, within one process (`platform.on_gpu`: `lax.platform_dependent`), not by the default backend. Lowered
    for the CPU (on a Hopper's platform, as if this process had a GPU too), the result equals the XLA path's
    exactly."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, 2, 4, 64)), jnp.bfloat16)  # 2 rows, 4 query heads
    k, v = (jnp.asarray(rng.standard_normal((1, 2, 256, 64)), jnp.bfloat16) for _ in range(2))  # 2 KV heads
    span = Span(k, v, jnp.zeros(1, jnp.int32), jnp.array([100], jnp.int32))
    run = jax.jit(lambda q, span, impl: attend(q, jnp.array([[100, 101]]), LayerRule(True, None), spans=(span,),
                                               impl=impl, platform=HOPPER), static_argnames="impl")
    np.testing.assert_array_equal(run(q, span, "auto"), run(q, span, "xla"))
    traced = run.trace(q, span, "auto")
    assert "mosaic_gpu" not in traced.lower().as_text()
    assert "mosaic_gpu" in traced.lower(lowering_platforms=("cuda",)).as_text()


def test_caches_are_made_on_their_devices_without_a_transfer():
    """A host array copied over would be a disallowed host-to-device transfer (and host memory the size of the
    cache); the caches are made by a compiled program where they live."""
    drafter = random_drafter("tiny-dflash", dtype=jnp.float32)
    dense, hybrid = random_qwen3("tiny-qwen3", dtype=jnp.float32), random_qwen3_5("tiny-qwen3_5", dtype=jnp.float32)
    with jax.transfer_guard_host_to_device("disallow"):
        caches = init_cache(drafter, 2, 40), dense.init_cache(2, 40), hybrid.init_cache(2, 40)
    assert not any(leaf.any() for leaf in jax.tree.leaves(caches))
    assert all(leaf.committed for leaf in jax.tree.leaves(caches[0]))  # where the drafter's params are


@pytest.mark.parametrize("family", ["dense", "hybrid"])
def test_the_targets_forward_and_prefill_donate_the_cache(family):
    """A user's own loop holds one cache, not two: the cache given to `prefill` and to the dense target's forward is
    donated (its buffers reused for the result). The hybrid forward returns a pending cache of other shapes
    (every row's delta-net state), which `commit` reduces; its K/V pass through."""
    target = (random_qwen3("tiny-qwen3", dtype=jnp.float32) if family == "dense"
              else random_qwen3_5("tiny-qwen3_5", dtype=jnp.float32))
    empty = target.init_cache(1, 16)
    out = target.prefill(jnp.array([[3, 4, 5, 6]]), empty, jnp.array([4]), chunk=4)
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(empty))
    if family == "dense":
        cache = out.cache
        target(jnp.array([[7]]), cache, jnp.array([4]))
        assert all(leaf.is_deleted() for leaf in jax.tree.leaves(cache))


def test_kernel_tuning_is_one_table_by_device_kind_with_a_fallback():
    """A measured kind gets its entry (the H100's holds the H200's values but those measured on it: the drafter
    forms `weights="auto"` chooses, the step rates), any other kind (and a process without a GPU) the fallback; the
    table is read-only, and an override is a value passed in."""
    assert tuning_for("NVIDIA H200") is TUNING["NVIDIA H200"]
    h100 = tuning_for("NVIDIA H100 80GB HBM3")
    assert h100 is TUNING["NVIDIA H100 80GB HBM3"] and h100.step_rates != TUNING["NVIDIA H200"].step_rates
    assert dataclasses.replace(h100, auto_weights=FALLBACK.auto_weights, step_rates=FALLBACK.step_rates) == FALLBACK
    assert tuning_for("a GPU never measured") is tuning_for(None) is FALLBACK
    with pytest.raises(TypeError):
        TUNING["NVIDIA H200"] = FALLBACK  # type: ignore[index]
    assert attention.span_capacity(17_000) == 17 * 1024  # the fallback's band up to 64k slots splits by 1024 keys
    other = dataclasses.replace(FALLBACK, span_splits=((float("inf"), 4096, 4096),))
    assert attention.span_capacity(17_000, other) == 5 * 4096 and attention.split_keys(17_000, 16, other) == 4096
    assert attention.span_capacity(17_000) == 17 * 1024  # nothing changed in place


def test_the_platform_is_read_from_the_devices_given():
    """One answer to "which device": the devices of arrays, meshes, shardings or devices given (a GPU among them
    decides), the process's GPU (else its CPU) where a traced program's arrays have none yet."""
    device = jax.devices()[0]
    here = Platform.of(device)
    assert here == process_platform() and here.tuning is FALLBACK  # a CPU: no GPU kind
    assert (here.hopper, here.hopper_or_newer, here.cuda, here.sm_count) == (False, False, has_cuda(), 1)
    mesh = jax.make_mesh((len(jax.devices()),), ("model",))
    assert platform_of(jnp.ones(3)) == platform_of(mesh) == platform_of(device) == platform_of({"w": [jnp.ones(2)]})
    seen = []
    jax.jit(lambda x: seen.append(platform_of(x)) or x)(jnp.ones(3))
    assert seen == [process_platform()]
    # a GPU as jax describes one (compute capability as a string): its kind's entry, its SMs
    h100 = Platform.of(SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3", compute_capability="9.0",
                                       core_count=132))
    assert (h100.hopper, h100.sm_count, h100.cuda) == (True, 132, has_cuda())
    assert h100.tuning is TUNING["NVIDIA H100 80GB HBM3"]


def test_init_cache_takes_the_tuning_it_is_given():
    """The drafter's cache reads its rows and ring spans from the platform of its devices, or the one passed."""
    drafter = random_drafter("tiny-dflash", dtype=jnp.float32)
    assert not init_cache(drafter, 2, 40).ring_spans  # the fallback reads rings as spans from 8 sequences
    eager = dataclasses.replace(process_platform(), tuning=dataclasses.replace(FALLBACK, ring_spans_min_batch=2))
    assert init_cache(drafter, 2, 40, platform=eager).ring_spans


def test_span_splits_shorten_where_few_programs_read_the_cache():
    """The tuned split length holds at the programs it was measured with (8: sequences x KV heads x 64-row query
    tiles) and above; fewer programs take proportionally shorter splits (a divisor of the capacity's blocks). The
    kernel takes up to 256 query rows per KV head (a 17-token verify with 8 query heads per KV head: 136)."""
    splits = attention._splits
    assert 8192 // splits(8192, 16) == 8192 // splits(8192, 16, 8) == 8192 // splits(8192, 16, 64) == 512
    assert 8192 // splits(8192, 16, 2) == 128 and 32768 // splits(32768, 16, 2) == 256  # 2 KV heads, batch 1
    assert 8192 // splits(8192, 16, 1) == 128  # never below one 128-slot block
    span = Span(jnp.zeros((1, 2, 256, 64), jnp.bfloat16), jnp.zeros((1, 2, 256, 64), jnp.bfloat16),
                jnp.zeros((1,), jnp.int32), jnp.ones((1,), jnp.int32))
    verify = jnp.zeros((1, 2, 8, 17, 64), jnp.bfloat16)  # [batch, n_kv, groups, Sq, d_h]
    assert attention.use_pallas(verify, span, HOPPER)
    assert not attention.use_pallas(jnp.zeros((1, 2, 8, 33, 64), jnp.bfloat16), span, HOPPER)
    assert not attention.use_pallas(verify, span, process_platform())  # no GPU here


def test_the_packed_gemm_kernel_is_chosen_by_where_the_program_runs():
    """`nvfp4.matmul(backend="auto")` on a Hopper's platform: the Mosaic GEMM in a program lowered for the GPU,
    XLA's dequantize-then-dot in one lowered for the CPU (a packed drafter placed on the host)."""
    w = nvfp4.Packed(jnp.zeros((64, 128), jnp.uint8), jnp.ones((64, 16), jnp.float8_e4m3fn), jnp.float32(1))
    traced = jax.jit(lambda x, w: nvfp4.matmul(x, w, platform=HOPPER)).trace(jnp.ones((2, 16, 256), jnp.bfloat16), w)
    assert "mosaic_gpu" not in traced.lower().as_text()
    assert "mosaic_gpu" in traced.lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.gpu
@pytest.mark.skipif(not has_cuda(), reason="needs a CUDA GPU")
def test_on_a_gpu_auto_lowers_the_kernels():
    """On a GPU, "auto" lowers cuDNN's fused prefill and the Pallas span kernel in the forward over the cache (the
    CPU twin above checks the choice; the kernels' numbers are tested in test_target / test_attention)."""
    target = random_qwen3({**QWEN3_TINY_CONFIGS["tiny-qwen3"], "head_dim": 64, "num_attention_heads": 4}, seed=3)
    tokens, lengths = jnp.ones((2, 32), jnp.int32), jnp.array([32, 20], jnp.int32)
    prefill = jax.jit(lambda t, c, n: target.prefill(t, c, n)).trace(tokens, target.init_cache(2, 64), lengths)
    assert "cudnn" in prefill.lower().as_text()
    step = jax.jit(lambda t, c, n: target(t, c, n)).trace(tokens[:, :1], target.init_cache(2, 64), lengths)
    assert "mosaic_gpu" in step.lower().as_text()

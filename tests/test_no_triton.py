"""No Pallas call of the package lowers through Pallas Triton (deprecated in jax 0.11, "will be removed").

On any machine, CPU included: each GPU kernel's entry point, taken the way the package takes it on a GPU (given a
Hopper's `platform.Platform`, whose CUDA backend makes `on_gpu` trace the GPU branch), is lowered for CUDA
(`jax.export` for "cuda" needs no GPU) and the StableHLO is read for its custom calls: a Pallas Triton kernel is
the custom call `__gpu$xla.gpu.triton`, a Mosaic GPU one `mosaic_gpu_v2` (or `mosaic_gpu`). Every entry point must
give Mosaic GPU calls and no Triton call. A scan of the sources keeps the list of entry points complete: every module
that names Pallas is one this file lowers, and none imports Pallas' Triton module or JAX's Triton-written ops.
"""

import ast
import os
import re

import jax
import jax.numpy as jnp
import pytest

import dflash_jax
from dflash_jax import attention, nvfp4
from dflash_jax.target import moe

from ._pallas import HOPPER

PACKAGE = os.path.dirname(dflash_jax.__file__)
TRITON_CALL = "__gpu$xla.gpu.triton"
MOSAIC_CALL = re.compile(r"mosaic_gpu(_v\d+)?")
# The modules that name Pallas, each covered by an entry point below.
PALLAS_MODULES = {"attention.py", "nvfp4/_mosaic_gemm.py", "target/moe.py",
                  "target/_expert_gemm.py", "_span_attention_mgpu.py", "_gpu.py",
                  "nvfp4/packed.py",  # its "pallas" backend: `nvfp4.matmul`, covered below
                  "drafting.py",  # names the "pallas" impl it passes on to `attend`
                  "_kernel_choice.py",  # the vocabulary of kernel choices, "pallas" among them
                  "_jax_compat.py"}  # the Mosaic GPU interpreter's parameters (for the kernels above)
# jax.experimental.pallas.ops.gpu modules written with Pallas Triton (the `*_mgpu` ones are Mosaic GPU).
TRITON_OPS = {"attention", "decode_attention", "layer_norm", "paged_attention", "rms_norm", "softmax"}


def custom_calls(fn, *args) -> list[str]:
    """The custom-call targets of `fn(*args)` lowered for CUDA."""
    text = jax.export.export(jax.jit(fn), platforms=["cuda"])(*args).mlir_module()
    return re.findall(r"custom_call @([\w$.]+)", text)


def assert_mosaic_only(calls: list[str]):
    assert TRITON_CALL not in calls, f"a Pallas call lowers through Triton: {calls}"
    assert any(MOSAIC_CALL.fullmatch(c) for c in calls), f"no Mosaic GPU kernel among {calls}: the test tests nothing"


def spec(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize("Sq", [1, 16, 17])  # a greedy token, a draft block, a verify block
def test_span_attention(Sq):
    """`attend` with a cache span and dense rows, impl "auto" (where the GPU kernel applies), the drafter's shapes."""
    batch, n_kv, n_h, d_h, capacity = 2, 8, 32, 128, 4096
    span = attention.Span(spec((batch, n_kv, capacity, d_h), jnp.bfloat16), spec((batch, n_kv, capacity, d_h),
                          jnp.bfloat16), spec((batch,), jnp.int32), spec((batch,), jnp.int32))
    dense = attention.KeyValues(spec((batch, n_kv, Sq, d_h), jnp.bfloat16), spec((batch, n_kv, Sq, d_h), jnp.bfloat16),
                                spec((batch, Sq), jnp.int32), spec((batch, Sq), jnp.bool_))

    def f(q, q_pos, kv, span):
        return attention.attend(q, q_pos, attention.LayerRule(True, None), (kv,), (span,), platform=HOPPER)

    assert_mosaic_only(custom_calls(f, spec((batch, Sq, n_h, d_h), jnp.bfloat16), spec((batch, Sq), jnp.int32),
                                    dense, span))


def test_packed_nvfp4_matmul():
    """`nvfp4.matmul` on its kernel (backend "pallas"), a drafter projection's shape at M = 16."""
    from dflash_jax.nvfp4 import Packed

    def f(x, codes, scale, scale_2):
        return nvfp4.matmul(x, Packed(codes, scale, scale_2), backend="pallas", platform=HOPPER)

    assert_mosaic_only(custom_calls(f, spec((16, 4096), jnp.bfloat16), spec((1024, 2048), jnp.uint8),
                                    spec((1024, 256), jnp.float8_e4m3fn), spec((), jnp.float32)))


def test_moe_grouped_matmul():
    """The MoE target's grouped matmul on its kernel branch (JAX's `ragged_dot_mgpu`)."""
    calls = custom_calls(lambda r, w, s: moe._grouped_matmul(r, w, s, True, HOPPER), spec((256, 512), jnp.bfloat16),
                         spec((8, 256, 512), jnp.bfloat16), spec((8,), jnp.int32))
    assert_mosaic_only(calls)


def test_moe_slots():
    """The MoE target's few-rows kernel (`target._expert_gemm`) as `moe_block(impl="slots")` takes it."""
    stack = spec((16, 128, 256), jnp.bfloat16)
    calls = custom_calls(lambda p, x, w, e: moe.weighted_experts(p, x, w, e, "slots", HOPPER),
                         {"experts": {"gate_proj": stack, "up_proj": stack, "down_proj": spec((16, 256, 128),
                                                                                              jnp.bfloat16)}},
                         spec((3, 256), jnp.bfloat16), spec((3, 4), jnp.float32), spec((3, 4), jnp.int32))
    assert_mosaic_only(calls)


def test_no_module_uses_pallas_triton():
    """Every module naming Pallas is covered above; none imports Pallas Triton or a Triton-written JAX op."""
    naming_pallas = set()
    for root, _, files in os.walk(PACKAGE):
        for file in files:
            if not file.endswith(".py"):
                continue
            path = os.path.join(root, file)
            with open(path) as f:
                source = f.read()
            relative = os.path.relpath(path, PACKAGE).replace(os.sep, "/")
            if "pallas" in source:
                naming_pallas.add(relative)
            for node in ast.walk(ast.parse(source)):
                if isinstance(node, ast.ImportFrom) and node.module:
                    names = [f"{node.module}.{alias.name}" for alias in node.names]
                elif isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                else:
                    continue
                for name in names:
                    assert not name.startswith("jax.experimental.pallas.triton"), f"{relative} imports {name}"
                    assert not name.startswith("jax._src.pallas.triton"), f"{relative} imports {name}"
                    op = name.removeprefix("jax.experimental.pallas.ops.gpu.")
                    assert op == name or op.split(".")[0] not in TRITON_OPS, f"{relative} imports {name} (Triton)"
    assert naming_pallas <= PALLAS_MODULES, f"not lowered by this file: {naming_pallas - PALLAS_MODULES}"

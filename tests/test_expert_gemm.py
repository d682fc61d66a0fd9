"""The routed experts' Mosaic GPU kernel (`target._expert_gemm`, `moe_block(impl="slots")`) against a NumPy float64
reference of the block's routed sum: on a CPU in Pallas's GPU interpret mode (small shapes), on a GPU (tests marked
`gpu`) at the Qwen3.5-35B-A3B shapes for the rows of decode and verify steps.

Reference: y[t] = sum_j w[t, j] * down_e(bf16(silu(gate_e x_t) * up_e x_t)), e = experts[t, j], in float64 from
the bf16 operands, h rounded to bf16 as the package rounds it. Tolerance: 2^-12 of the largest output. The kernel
sums in float32; where that tips an h element's bf16 rounding, the output moves by up to about 5e-5 of its largest
value (measured in interpret mode; XLA's `_gathered` path is off by the same)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dflash_jax.target import moe
from dflash_jax.target._expert_gemm import expert_matmul, slots_of, splits_for

from ._pallas import needs_gpu, needs_mosaic_interpreter


def random_block(rng: np.random.Generator, E: int, H: int, I: int, T: int, k: int):
    """bf16 expert stacks, bf16 tokens, k distinct experts a token (some shared between tokens), float32 weights."""
    bf = ml_dtypes.bfloat16
    stacks = {"gate_proj": rng.standard_normal((E, I, H)) * 0.05, "up_proj": rng.standard_normal((E, I, H)) * 0.05,
              "down_proj": rng.standard_normal((E, H, I)) * 0.05}
    stacks = {name: w.astype(bf) for name, w in stacks.items()}
    x = rng.standard_normal((T, H)).astype(bf)
    experts = np.argsort(rng.random((T, E)), axis=1)[:, :k].astype(np.int32)  # distinct within a token
    weights = rng.random((T, k)).astype(np.float32)
    return stacks, x, experts, weights / weights.sum(1, keepdims=True)


def reference(stacks, x, experts, weights) -> np.ndarray:
    """The routed sum in float64 (h rounded to bf16 between the products): [T, H]."""
    f = {name: w.astype(np.float64) for name, w in stacks.items()}
    x64 = x.astype(np.float64)
    out = np.zeros(x.shape)
    for t, j in np.ndindex(experts.shape):
        e = experts[t, j]
        g, u = f["gate_proj"][e] @ x64[t], f["up_proj"][e] @ x64[t]
        h = (g / (1 + np.exp(-g)) * u).astype(ml_dtypes.bfloat16).astype(np.float64)
        out[t] += weights[t, j] * (f["down_proj"][e] @ h)
    return out


def check(got, stacks, x, experts, weights) -> None:
    ref = reference(stacks, x, experts, weights)
    scale = np.max(np.abs(ref))
    np.testing.assert_allclose(np.asarray(got), ref, rtol=0, atol=2.0**-12 * scale)


def test_slots_hold_each_distinct_expert_once():
    flat = jnp.asarray([7, 3, 7, 1, 3, 9], jnp.int32)
    slot_expert, used, slot_of = slots_of(flat)
    assert int(used) == 4 and list(np.asarray(slot_expert)[:4]) == [1, 3, 7, 9]
    assert list(np.asarray(slot_expert)[np.asarray(slot_of)]) == list(np.asarray(flat))
    assert splits_for(8, 512, 2048, 132) == 4 and splits_for(136, 512, 2048, 132) == 1


@needs_mosaic_interpreter
@pytest.mark.parametrize("T,k", [(1, 4), (5, 4)])
def test_interpret_mode_against_numpy(T, k):
    """Shared experts between tokens included (5 tokens x 4 of 8 experts); K split in two at one token."""
    stacks, x, experts, weights = random_block(np.random.default_rng(T), E=8, H=256, I=128, T=T, k=k)
    p = {"experts": {name: jnp.asarray(w) for name, w in stacks.items()}}
    got = moe._slotted(p, jnp.asarray(x), jnp.asarray(weights), jnp.asarray(experts), interpret=True)
    check(got, stacks, x, experts, weights)


@needs_mosaic_interpreter
def test_slots_past_the_used_count_are_never_read():
    """A slot at or past `slots_used` exits at once: its output stays as the kernel found it (not the product)."""
    rng = np.random.default_rng(0)
    stack = jnp.asarray(rng.standard_normal((4, 64, 128)).astype(ml_dtypes.bfloat16))
    rhs = jnp.asarray(rng.standard_normal((128, 16)).astype(ml_dtypes.bfloat16))
    out = expert_matmul(rhs, stack, jnp.asarray([2, 0], jnp.int32), jnp.asarray(1), splits=1, interpret=True)
    want = np.asarray(stack[2], np.float64) @ np.asarray(rhs, np.float64)
    np.testing.assert_allclose(np.asarray(out[0, 0]), want, rtol=1e-5, atol=1e-4)
    assert not np.allclose(np.asarray(out[0, 1]), np.asarray(stack[0], np.float64) @ np.asarray(rhs, np.float64))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("T", [1, 8, 17, 32])
def test_gpu_35b_shapes_against_numpy(T):
    """Qwen3.5-35B-A3B's experts (256 of [512, 2048]), the rows of decode (1, 8 tokens) and verify (17, 32)."""
    stacks, x, experts, weights = random_block(np.random.default_rng(T), E=256, H=2048, I=512, T=T, k=8)
    p = {"experts": {name: jnp.asarray(w) for name, w in stacks.items()}}
    got = jax.jit(moe._slotted)(p, jnp.asarray(x), jnp.asarray(weights), jnp.asarray(experts))
    check(got, stacks, x, experts, weights)

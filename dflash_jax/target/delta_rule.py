"""The gated delta rule (Yang, Kautz, Hatamizadeh 2024, "Gated Delta Networks: Improving Mamba2 with Delta
Rule", arXiv:2412.06464), the token mixer of Qwen3.5's linear-attention layers, in its two forms:

    per head, state S [d_k, d_v] (float32):   S <- exp(g_t) S;   S += k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t

`recurrent_delta_rule` row by row (a `lax.scan`, keeping the state after every row: what a verify block
needs to commit any prefix of itself); `chunked_delta_rule` a chunk of rows at a time, the rows within a chunk
solved together by the UT transform (Yang et al. 2024, "Parallelizing Linear Transformers with the Delta Rule
over Sequence Length", arXiv:2406.06484), as transformers 5.24.0's `torch_chunk_gated_delta_rule`
(`models/qwen3_5/modeling_qwen3_5.py`) does: for prefill. Inputs `q, k [batch, S, h, d_k]` (l2-normed; q
scaled by d_k^-1/2), `v [batch, S, h, d_v]`, `g` (log decay, <= 0), `beta [batch, S, h]`, all float32.

Accuracy (float32): on random inputs both forms are within 2e-7 of a float64 run; in the tiny reference model
(tests/data/qwen3_5) a 48-row chunk put the deepest features 4e-4 from transformers' (chunks of 64) and the
recurrent form 4e-5: the model's gated norm amplifies the error of small outputs; chunks of 8 give 8e-5.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..model import dot


def l2_normed(x: jax.Array) -> jax.Array:
    """`x / sqrt(|x|^2 + 1e-6)` over the last axis, float32 (flash-linear-attention's and transformers' l2norm)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def recurrent_delta_rule(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                         state: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule row by row: `(out [batch, S, n_v, d_v], states [batch, S, n_v, d_k, d_v])`, the
    state after each row, from `state [batch, n_v, d_k, d_v]` (all float32)."""

    def step(s, row):
        q_t, k_t, v_t, g_t, b_t = row  # [batch, n_v, d] / [batch, n_v]
        s = s * jnp.exp(g_t)[..., None, None]
        delta = (v_t - dot("bhkv,bhk->bhv", s, k_t)) * b_t[..., None]  # [batch, n_v, d_v]
        s = s + k_t[..., :, None] * delta[..., None, :]
        return s, (dot("bhkv,bhk->bhv", s, q_t), s)

    _, (out, states) = jax.lax.scan(step, state, tuple(x.swapaxes(0, 1) for x in (q, k, v, g, beta)))
    return out.swapaxes(0, 1), states.swapaxes(0, 1)


def chunked_delta_rule(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, state: jax.Array,
                       size: int) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule `size` rows at a time (transformers' `torch_chunk_gated_delta_rule`, the UT transform
    of the DeltaNet papers): `(out [batch, S, n_v, d_v], final state [batch, n_v, d_k, d_v])`. Rows with
    beta = 0 and g = 0 (padding) leave the state as it is."""
    batch, S, h, d_k = k.shape
    n = -(-S // size)
    pad = lambda x: jnp.pad(x, [(0, 0), (0, n * size - S)] + [(0, 0)] * (x.ndim - 2))  # noqa: E731
    # [n, batch, h, size, ...]: chunk-major for the scan
    q, k, v, g, beta = (jnp.moveaxis(pad(x).reshape(batch, n, size, h, *x.shape[3:]), (1, 3), (0, 2))
                        for x in (q, k, v, g, beta))
    cum = jnp.cumsum(g, axis=-1)  # [n, batch, h, size] log decay from the chunk's start
    causal = jnp.tril(jnp.ones((size, size), bool))
    decay = jnp.exp(jnp.where(causal, cum[..., :, None] - cum[..., None, :], -jnp.inf))  # [.., i, j], j <= i
    k_beta = k * beta[..., None]
    # (I + strictly lower part of beta_i k_i.k_j decay_ij) [u | w] = [beta v | beta k exp(cum)]
    system = jnp.where(jnp.eye(size, dtype=bool), 0.0, dot("...ik,...jk->...ij", k_beta, k) * decay)
    rhs = jnp.concatenate([v * beta[..., None], k_beta * jnp.exp(cum)[..., None]], axis=-1)
    solved = jax.lax.linalg.triangular_solve(jnp.eye(size, dtype=rhs.dtype) + system, rhs, left_side=True, lower=True,
                                             unit_diagonal=True)
    u, w = solved[..., :v.shape[-1]], solved[..., v.shape[-1]:]
    intra = dot("...ik,...jk->...ij", q, k) * decay  # [.., size, size]
    q_decayed = q * jnp.exp(cum)[..., None]
    k_decayed = k * jnp.exp(cum[..., -1:] - cum)[..., None]

    def step(s, chunk):
        u_c, w_c, q_c, k_c, intra_c, last = chunk
        v_new = u_c - dot("...ik,...kv->...iv", w_c, s)  # [batch, h, size, d_v]
        out = dot("...ik,...kv->...iv", q_c, s) + dot("...ij,...jv->...iv", intra_c, v_new)
        s = s * jnp.exp(last)[..., None, None] + dot("...ik,...iv->...kv", k_c, v_new)
        return s, out

    state, out = jax.lax.scan(step, state, (u, w, q_decayed, k_decayed, intra, cum[..., -1]))
    out = jnp.moveaxis(out, (0, 2), (1, 3)).reshape(batch, n * size, h, -1)[:, :S]
    return out, state

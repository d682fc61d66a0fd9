"""The gated delta rule (Yang, Kautz, Hatamizadeh 2024, "Gated Delta Networks: Improving Mamba2 with Delta
Rule", arXiv:2412.06464), the token mixer of Qwen3.5's linear-attention layers, in its two forms:

    per head, state S [d_k, d_v] (float32):   S <- exp(g_t) S;   S += k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t

`block_delta_rule` all rows as one chunk, keeping the state after every row (what a verify block needs to
commit any prefix of itself); `chunked_delta_rule` a chunk of rows at a time, the rows within a chunk
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

from .._precision import dot
from .._shapes import chunked

__all__ = ["block_delta_rule", "chunked_delta_rule", "l2_normed"]


def l2_normed(x: jax.Array) -> jax.Array:
    """`x / sqrt(|x|^2 + 1e-6)` over the last axis, float32 (flash-linear-attention's and transformers' l2norm)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def _chunks(q, k, v, g, beta, size: int):
    """The UT transform of each `size`-row chunk (rows padded to a multiple of it), chunk-major for a scan:
    `(u, w, q, k, decay, cum)`, each `[n, batch, h, size, ...]`, with `u - w S` a chunk's new values for the
    state S at its start, `decay[.., i, j] = exp(cum_i - cum_j)` for j <= i (else 0), `cum` the cumulative log
    decay from the chunk's start."""
    # [n, batch, h, size, ...]: chunk-major for the scan
    q, k, v, g, beta = (chunked(x, size).swapaxes(2, 3) for x in (q, k, v, g, beta))
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
    return u, w, q, k, decay, cum


def _one_row(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
             state: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`block_delta_rule` of one row (a greedy step) as the recurrence's step itself: `S^T k` and `S^T q` in one
    product (one read of the state), the update in one more pass; no chunk system (cumulative decays, a 1 x 1
    triangular solve: a dozen tiny kernels a layer). `o = S_new^T q = exp(g) S^T q + (k . q) delta`."""
    q, k, v, g, beta = (x[:, 0] for x in (q, k, v, g, beta))  # [batch, h, ...]
    decay = jnp.exp(g)[..., None]  # [batch, h, 1]
    read = dot("bhkv,bhjk->bhjv", state, jnp.stack([k, q], axis=2))  # [batch, h, 2, d_v]: S^T k, S^T q
    delta = beta[..., None] * (v - decay * read[:, :, 0])  # [batch, h, d_v]
    new = decay[..., None] * state + k[..., :, None] * delta[..., None, :]  # [batch, h, d_k, d_v]
    out = decay * read[:, :, 1] + jnp.sum(k * q, axis=-1, keepdims=True) * delta  # [batch, h, d_v]
    return out[:, None], new[:, None]


def block_delta_rule(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                     state: jax.Array) -> tuple[jax.Array, jax.Array]:
    """All S rows as one chunk, keeping the state after every row (what a verify block needs to commit any prefix
    of itself): `(out [batch, S, n_v, d_v], states [batch, S, n_v, d_k, d_v])` from `state [batch, n_v, d_k,
    d_v]`, all float32. The state after row i is `exp(cum_i) S_0 + sum_{j <= i} exp(cum_i - cum_j) k_j v'_j^T`
    (v' the rows' new values): a few batched products, not S dependent steps of a recurrence (on the H200 a
    17-row verify of the 27B hybrid spent more in the row-by-row scan than in reading its weights). One row:
    `_one_row`."""
    if k.shape[1] == 1:
        return _one_row(q, k, v, g, beta, state)
    u, w, q, k, decay, cum = (x[0] for x in _chunks(q, k, v, g, beta, k.shape[1]))  # [batch, h, S, ...]
    v_new = u - dot("bhik,bhkv->bhiv", w, state)  # [batch, h, S, d_v]
    intra = dot("bhik,bhjk->bhij", q, k) * decay  # q_i.k_j exp(cum_i - cum_j), j <= i
    out = dot("bhik,bhkv->bhiv", q * jnp.exp(cum)[..., None], state) + dot("bhij,bhjv->bhiv", intra, v_new)
    states = jnp.exp(cum)[..., None, None] * state[:, :, None] + dot(
        "bhijk,bhjv->bhikv", decay[..., None] * k[:, :, None], v_new)  # [batch, h, S, d_k, d_v]
    return out.swapaxes(1, 2), states.swapaxes(1, 2)


def chunked_delta_rule(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, state: jax.Array,
                       size: int) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule `size` rows at a time (transformers' `torch_chunk_gated_delta_rule`, the UT transform
    of the DeltaNet papers): `(out [batch, S, n_v, d_v], final state [batch, n_v, d_k, d_v])`. Rows with
    beta = 0 and g = 0 (padding) leave the state as it is."""
    batch, S, h, _ = k.shape
    u, w, q, k, decay, cum = _chunks(q, k, v, g, beta, size)
    intra = dot("...ik,...jk->...ij", q, k) * decay  # [n, batch, h, size, size]
    q_decayed = q * jnp.exp(cum)[..., None]
    k_decayed = k * jnp.exp(cum[..., -1:] - cum)[..., None]

    def step(s, chunk):
        u_c, w_c, q_c, k_c, intra_c, last = chunk
        v_new = u_c - dot("...ik,...kv->...iv", w_c, s)  # [batch, h, size, d_v]
        out = dot("...ik,...kv->...iv", q_c, s) + dot("...ij,...jv->...iv", intra_c, v_new)
        s = s * jnp.exp(last)[..., None, None] + dot("...ik,...iv->...kv", k_c, v_new)
        return s, out

    state, out = jax.lax.scan(step, state, (u, w, q_decayed, k_decayed, intra, cum[..., -1]))
    out = jnp.moveaxis(out, (0, 2), (1, 3)).reshape(batch, -1, h, out.shape[-1])[:, :S]
    return out, state

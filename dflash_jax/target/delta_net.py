"""The Gated DeltaNet mixer of the Qwen3.5 / 3.6 hybrids' linear-attention layers (transformers 5.24.0
`models/qwen3_5/modeling_qwen3_5.py`, `Qwen3_5GatedDeltaNet`): its parameters, how they split over a tensor axis,
its conv and recurrent state, and its forward.

Yang, Kautz, Hatamizadeh 2024, "Gated Delta Networks", arXiv:2412.06464: `in_proj_qkv` then a depthwise causal
conv1d of `linear_conv_kernel_dim` taps (state: the last K - 1 inputs) and SiLU, split into q, k (l2-normed, q
scaled by d_k^-1/2; key head j serves the `n_v / n_k` consecutive value heads from `j n_v / n_k`) and v;
`beta = sigmoid(in_proj_b x)`, decay `g = -exp(A_log) softplus(in_proj_a x + dt_bias)`; per value head a float32
state `S [d_k, d_v]`: `S <- exp(g) S; S += k (beta (v - k^T S))^T; o = q^T S` (`target.delta_rule`); then the
gated RMSNorm `w * x_hat * silu(z)` (z = `in_proj_z x`) and `out_proj`.

Split by head. Checkpoints store `in_proj_qkv` `[2 n_k d_k + n_v d_v, H]` and `conv1d` `[same, 1, K]` with the
q, k and v channels of all heads one block after the other, so a contiguous split of their rows would not give a
device whole heads. They are read as three tensors each (`QKV`, `CONV`: `in_proj_{q,k,v}`, `conv1d_{q,k,v}`, row
ranges of the stored tensor, `views.TensorViews`), each split by head over the tensor axis: with
`linear_num_key_heads` and `linear_num_value_heads` both divisible by it, device d holds key heads
`[d n_k / tp, (d + 1) n_k / tp)` and exactly the value heads they serve. Likewise `in_proj_z` / `in_proj_b` /
`in_proj_a` / `dt_bias` / `A_log` split by output, `out_proj` by input (an all-reduce after it, as after an
attention `o_proj`), the conv state in three (`CONV_AXES`), the recurrence and its state by value head
(`STATE_AXES`); the gated norm's weight (per head dim) is replicated. No device computes another's heads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from ..layers import linear, rms_norm
from ..spec import BATCH, EMBED, HEADS, NORM, Gain, ParamSpec
from .delta_rule import block_delta_rule, chunked_delta_rule, l2_normed
from .layout import Layout
from .qwen3_5_config import Qwen3_5Config
from .views import Fused, TensorViews

__all__ = ["delta_net", "delta_net_spec", "conv_state"]

Params = dict[str, Any]
Conv = tuple[jax.Array, jax.Array, jax.Array]  # one layer's conv state (or window): its q, k and v channels
A = TypeVar("A")
B = TypeVar("B")

PARTS = ("q", "k", "v")
QKV = Fused("in_proj_qkv.weight", tuple(f"in_proj_{x}.weight" for x in PARTS), 0,
            "the delta net's fused q, k, v projection")
CONV = Fused("conv1d.weight", tuple(f"conv1d_{x}.weight" for x in PARTS), 0, "the delta net's fused q, k, v conv")
CONV_AXES = (BATCH, None, HEADS)  # [batch, K - 1 (+ S), channels] of one part: split by head
STATE_AXES = (BATCH, HEADS, None, None)  # [batch, n_v, d_k, d_v]: split by value head
HEAD_ROWS = (BATCH, None, HEADS, None)  # [batch, S, n_v, d]: the delta rule's inputs, split by value head


@dataclasses.dataclass(frozen=True)
class LogUniform:
    """`A_log = log(U(0.01, 16))`, transformers' initialisation of the delta-net decay rates."""

    def host(self, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        return np.log(rng.uniform(0.01, 16, shape)).astype(np.float32)

    def device(self, key: jax.Array, shape: tuple[int, ...], dtype: jnp.dtype) -> jax.Array:
        return jnp.log(jax.random.uniform(key, shape, dtype, 0.01, 16))


def part_dims(c: Qwen3_5Config) -> tuple[int, int, int]:
    """The channels of q, k and v (`QKV`, `CONV`, the conv state's parts)."""
    return c.key_dim, c.key_dim, c.value_dim


def delta_net_spec(c: Qwen3_5Config, prefix: str) -> list[ParamSpec]:
    """The tensors of one delta-net mixer under `prefix`, as the tree holds them (module docstring): the fused
    q/k/v projection and conv as their three parts, in the order they are stored."""
    H, n_v, K = c.hidden_size, c.linear_num_value_heads, c.linear_conv_kernel_dim
    dims = part_dims(c)
    return [
        *(ParamSpec(prefix + name, (n, H), axes=(HEADS, EMBED)) for name, n in zip(QKV.parts, dims)),
        ParamSpec(prefix + "in_proj_z.weight", (c.value_dim, H), axes=(HEADS, EMBED)),
        ParamSpec(prefix + "in_proj_b.weight", (n_v, H), axes=(HEADS, EMBED)),
        ParamSpec(prefix + "in_proj_a.weight", (n_v, H), axes=(HEADS, EMBED)),
        *(ParamSpec(prefix + name, (n, 1, K), axes=(HEADS, None, None)) for name, n in zip(CONV.parts, dims)),
        ParamSpec(prefix + "dt_bias", (n_v,), axes=(HEADS,), init=Gain()),
        ParamSpec(prefix + "A_log", (n_v,), axes=(HEADS,), init=LogUniform()),
        ParamSpec(prefix + "norm.weight", (c.linear_value_head_dim,), NORM, (None,), Gain()),  # plain w * x_hat
        ParamSpec(prefix + "out_proj.weight", (H, c.value_dim), axes=(EMBED, HEADS)),
    ]


def add_delta_net_views(views: TensorViews, prefix: str, c: Qwen3_5Config) -> None:
    """Declare the q/k/v parts of the stored `in_proj_qkv` and `conv1d` under `prefix` on `views`."""
    H, K = c.hidden_size, c.linear_conv_kernel_dim
    views.split(prefix, QKV, [(n, H) for n in part_dims(c)])
    views.split(prefix, CONV, [(n, 1, K) for n in part_dims(c)])


def map_parts(f: Callable[[A], B], parts: tuple[A, A, A]) -> tuple[B, B, B]:
    """`f` on each of the q, k and v parts (of one layer's conv state or window, `part_dims`)."""
    q, k, v = parts
    return f(q), f(k), f(v)


def conv_state(window: jax.Array, kept: jax.Array, taps: int) -> jax.Array:
    """The conv state after the first `kept[b]` rows of `window [batch, K - 1 + S, C]`: rows kept .. kept + K - 2."""
    rows = kept[:, None] + jnp.arange(taps - 1)  # [batch, K - 1]
    return jnp.take_along_axis(window, rows[:, :, None], axis=1)


def _conv(p: Params, part: str, xn: jax.Array, state: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One part's projection, causal conv and SiLU over `xn [batch, S, H]` after its conv state `[batch, K - 1,
    C]`: `(mixed [batch, S, C] float32, window [batch, K - 1 + S, C] xn's dtype)`."""
    S = xn.shape[1]
    window = jnp.concatenate([state.astype(xn.dtype), linear(xn, p[f"in_proj_{part}"])], axis=1)
    w = p[f"conv1d_{part}"]["weight"][:, 0].astype(jnp.float32)  # [C, K]; tap K - 1 multiplies the row itself
    mixed = sum(window[:, j:j + S].astype(jnp.float32) * w[:, j] for j in range(w.shape[-1]))  # [batch, S, C]
    return jax.nn.silu(mixed).astype(xn.dtype).astype(jnp.float32), window  # transformers rounds the conv's output


def _inputs(c: Qwen3_5Config, p: Params, xn: jax.Array, conv: Conv):
    """The delta rule's inputs for `xn [batch, S, H]` after the conv state `conv`: `(q, k [batch, S, n_v, d_k],
    v [batch, S, n_v, d_v], g, beta [batch, S, n_v], z [batch, S, n_v, d_v], windows)`, all float32 but z and
    the windows (`[batch, K - 1 + S, C]` per part, xn's dtype)."""
    batch, S, _ = xn.shape
    n_k, n_v, d_k, d_v = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, \
        c.linear_value_head_dim
    (q, wq), (k, wk), (v, wv) = (_conv(p, part, xn, state) for part, state in zip(PARTS, conv))
    group = n_v // n_k  # each key head serves `group` consecutive value heads
    q = jnp.repeat(l2_normed(q.reshape(batch, S, n_k, d_k)), group, axis=2) * d_k**-0.5
    k = jnp.repeat(l2_normed(k.reshape(batch, S, n_k, d_k)), group, axis=2)
    beta = jax.nn.sigmoid(linear(xn, p["in_proj_b"]).astype(jnp.float32))
    a = linear(xn, p["in_proj_a"]).astype(jnp.float32) + p["dt_bias"].astype(jnp.float32)
    g = -jnp.exp(p["A_log"].astype(jnp.float32)) * jax.nn.softplus(a)  # log decay, <= 0
    z = linear(xn, p["in_proj_z"]).reshape(batch, S, n_v, d_v)
    return q, k, v.reshape(batch, S, n_v, d_v), g, beta, z, (wq, wk, wv)


def delta_net(c: Qwen3_5Config, layout: Layout | None, p: Params, xn: jax.Array, conv: Conv, state: jax.Array,
              valid: jax.Array | None, delta_chunk: int) -> tuple[jax.Array, Conv, jax.Array]:
    """One delta-net layer's mixer over `xn [batch, S, H]`: `(out [batch, S, H], conv, state)`.

    `valid` None (a verify block): one chunk keeping every row's state (`block_delta_rule`); returns the pending
    windows (`[batch, K - 1 + S, C]` per part) and the states before and after each row `[batch, S + 1, n_v, d_k,
    d_v]`. Else (prefill, `valid [batch, S]` the real rows, a prefix of each sequence's): the chunked form with
    padding rows masked (beta = 0, decay 1); returns the committed conv state after the real rows and the final
    state.
    """
    batch, S, _ = xn.shape
    with jax.named_scope("inputs"):  # scopes: names in the HLO metadata, for profiles (benchmarks/gpu_trace.py)
        q, k, v, g, beta, z, windows = _inputs(c, p, xn, conv)
    if layout is not None:  # each device runs its own heads (a no-op where the projections' split carried through)
        q, k, v, z = (layout.constrain(x, HEAD_ROWS) for x in (q, k, v, z))
        g, beta = (layout.constrain(x, HEAD_ROWS[:3]) for x in (g, beta))
    if valid is None:
        with jax.named_scope("rule"):
            out, states = block_delta_rule(q, k, v, g, beta, state)
            conv, state = windows, jnp.concatenate([state[:, None], states], axis=1)
        pending_axes: tuple[str | None, ...] = (BATCH, None, *STATE_AXES[1:])  # [batch, S + 1, n_v, d_k, d_v]
    else:
        g, beta = jnp.where(valid[..., None], g, 0.0), jnp.where(valid[..., None], beta, 0.0)
        with jax.named_scope("rule"):
            out, state = chunked_delta_rule(q, k, v, g, beta, state, min(delta_chunk, S))
        kept = jnp.sum(valid, axis=1, dtype=jnp.int32)
        conv = map_parts(lambda w: conv_state(w, kept, c.linear_conv_kernel_dim), windows)
        pending_axes = STATE_AXES
    if layout is not None:
        state = layout.constrain(state, pending_axes)
        conv = map_parts(lambda w: layout.constrain(w, CONV_AXES), conv)
    with jax.named_scope("out"):
        out = rms_norm(out.astype(xn.dtype), p["norm"]["weight"], c.rms_norm_eps)  # gated: w * x_hat * silu(z)
        out = (out.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))).astype(xn.dtype)
        return linear(out.reshape(batch, S, c.value_dim), p["out_proj"]), conv, state

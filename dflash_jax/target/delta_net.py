"""The Gated DeltaNet mixer of the Qwen3.5 / 3.6 hybrids' linear-attention layers (transformers 5.24.0
`models/qwen3_5/modeling_qwen3_5.py`, `Qwen3_5GatedDeltaNet`): its parameters, how they split over a tensor axis,
its conv and recurrent state, and its forward.

Yang, Kautz, Hatamizadeh 2024, "Gated Delta Networks", arXiv:2412.06464: `in_proj_qkv` then a depthwise causal
conv1d of `linear_conv_kernel_dim` taps (state: the last K - 1 inputs) and SiLU, split into q, k (l2-normed, q
scaled by d_k^-1/2; key head j serves the `n_v / n_k` consecutive value heads from `j n_v / n_k`) and v;
`beta = sigmoid(in_proj_b x)`, decay `g = -exp(A_log) softplus(in_proj_a x + dt_bias)`; per value head a float32
state `S [d_k, d_v]`: `S <- exp(g) S; S += k (beta (v - k^T S))^T; o = q^T S` (`target.delta_rule`); then the
gated RMSNorm `w * x_hat * silu(z)` (z = `in_proj_z x`) and `out_proj`.

One input product. Checkpoints store `in_proj_qkv` `[2 n_k d_k + n_v d_v, H]` (the q, k and v rows of all heads,
one block after the other), `in_proj_z`, `in_proj_b`, `in_proj_a`, and `conv1d` `[2 n_k d_k + n_v d_v, 1, K]`. The
tree holds ONE input projection, `in_proj` (the four stored tensors' rows concatenated: `[q | k | v | z | b | a]`),
and one conv over the q, k and v channels; the mixer runs one product, one conv, and splits their outputs by
static section sizes (`target.sections`). The conv state is one array of those channels.

Split by head over the tensor axis of tp devices (`linear_num_key_heads` and `linear_num_value_heads` both
divisible by it): a contiguous split of the stored rows would not give a device whole heads, so a sharded
`in_proj` and conv (weight, state) hold their rows permuted (`sections.section_order`, read so by the load's views,
`add_delta_net_views`: each shard reads its own rows of the four stored tensors, run by run): device d's block is
`[q_d | k_d | v_d | z_d | b_d | a_d]` (conv: `[q_d | k_d | v_d]`), its key heads `[d n_k / tp, (d + 1) n_k / tp)`
and exactly the value heads they serve. With one shard the order is the stored one. `dt_bias` / `A_log` split by
head, `out_proj` by input (an all-reduce after it, as after an attention `o_proj`), the recurrence and its state by
value head (`STATE_AXES`); the gated norm's weight (per head dim) is replicated. No device computes another's
heads, and no weight is gathered.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..layers import linear, rms_norm
from ..spec import BATCH, EMBED, HEADS, NORM, Gain, ParamSpec
from .delta_rule import block_delta_rule, chunked_delta_rule, l2_normed
from .layout import Layout, tensor_shards
from .qwen3_5_config import Qwen3_5Config
from .sections import section_order, split_sections
from .views import TensorViews

__all__ = ["delta_net", "delta_net_spec", "conv_state", "add_delta_net_views", "stored_in_proj"]

Params = dict[str, Any]

STORED = ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight")  # `IN_PROJ`'s sources
STORED_WHAT = ("the delta net's fused q, k, v projection", "the delta net's z (gate) projection",
               "the delta net's beta projection", "the delta net's decay projection")
IN_PROJ, CONV1D = "in_proj.weight", "conv1d.weight"  # the tree's one input projection and conv (module docstring)
CONV_AXES = (BATCH, None, HEADS)  # [batch, K - 1 (+ S), conv channels]: split by head
STATE_AXES = (BATCH, HEADS, None, None)  # [batch, n_v, d_k, d_v]: split by value head
HEAD_ROWS = (BATCH, None, HEADS, None)  # [batch, S, n_v, d]: the delta rule's inputs, split by value head


@dataclasses.dataclass(frozen=True)
class LogUniform:
    """`A_log = log(U(0.01, 16))`, transformers' initialisation of the delta-net decay rates."""

    def host(self, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        return np.log(rng.uniform(0.01, 16, shape)).astype(np.float32)

    def device(self, key: jax.Array, shape: tuple[int, ...], dtype: jnp.dtype) -> jax.Array:
        return jnp.log(jax.random.uniform(key, shape, dtype, 0.01, 16))


def conv_sizes(c: Qwen3_5Config) -> tuple[int, int, int]:
    """The conv's sections: the channels of q, k and v (`in_proj_qkv`'s rows, as stored)."""
    return c.key_dim, c.key_dim, c.value_dim


def in_proj_sizes(c: Qwen3_5Config) -> tuple[int, ...]:
    """`IN_PROJ`'s sections: the rows of q, k, v, z, b and a (the `STORED` tensors' rows, one after the other)."""
    return (*conv_sizes(c), c.value_dim, c.linear_num_value_heads, c.linear_num_value_heads)


def delta_net_spec(c: Qwen3_5Config, prefix: str) -> list[ParamSpec]:
    """The tensors of one delta-net mixer under `prefix`, as the tree holds them (module docstring): the six input
    projections as one (`IN_PROJ`), the conv of q, k and v as one (`CONV1D`), both split by head."""
    H, n_v, K = c.hidden_size, c.linear_num_value_heads, c.linear_conv_kernel_dim
    return [
        ParamSpec(prefix + IN_PROJ, (sum(in_proj_sizes(c)), H), axes=(HEADS, EMBED)),
        ParamSpec(prefix + CONV1D, (sum(conv_sizes(c)), 1, K), axes=(HEADS, None, None)),
        ParamSpec(prefix + "dt_bias", (n_v,), axes=(HEADS,), init=Gain()),
        ParamSpec(prefix + "A_log", (n_v,), axes=(HEADS,), init=LogUniform()),
        ParamSpec(prefix + "norm.weight", (c.linear_value_head_dim,), NORM, (None,), Gain()),  # plain w * x_hat
        ParamSpec(prefix + "out_proj.weight", (H, c.value_dim), axes=(EMBED, HEADS)),
    ]


def add_delta_net_views(views: TensorViews, prefix: str, c: Qwen3_5Config, shards: int) -> None:
    """Declare `IN_PROJ` under `prefix` on `views`, the `STORED` tensors concatenated, and with `shards` > 1 read
    it and the stored conv with their rows in `shards` blocks (`sections.section_order`)."""
    H = c.hidden_size
    sources = [(prefix + name, (n, H), what)
               for name, n, what in zip(STORED, (sum(conv_sizes(c)), *in_proj_sizes(c)[3:]), STORED_WHAT)]
    views.merge(prefix + IN_PROJ, sources, section_order(in_proj_sizes(c), shards))
    if shards > 1:
        views.reorder(prefix + CONV1D, section_order(conv_sizes(c), shards))


def stored_in_proj(c: Qwen3_5Config, in_proj: np.ndarray) -> dict[str, np.ndarray]:
    """A one-device `IN_PROJ` as checkpoints store it, by `STORED` name (the inverse of the views' merge; for
    writing test checkpoints)."""
    sizes = (sum(conv_sizes(c)), *in_proj_sizes(c)[3:])
    return dict(zip(STORED, np.split(in_proj, np.cumsum(sizes[:-1]))))


def conv_state(window: jax.Array, kept: jax.Array, taps: int) -> jax.Array:
    """The conv state after the first `kept[b]` rows of `window [batch, K - 1 + S, C]`: rows kept .. kept + K - 2."""
    rows = kept[:, None] + jnp.arange(taps - 1)  # [batch, K - 1]
    return jnp.take_along_axis(window, rows[:, :, None], axis=1)


def _conv(p: Params, qkv: jax.Array, state: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The causal conv and SiLU of `qkv [batch, S, C]` (C: all q, k, v channels, in the conv's order) after its
    conv state `[batch, K - 1, C]`: `(mixed [batch, S, C] float32, window [batch, K - 1 + S, C] qkv's dtype)`."""
    S = qkv.shape[1]
    window = jnp.concatenate([state.astype(qkv.dtype), qkv], axis=1)
    w = p["conv1d"]["weight"][:, 0].astype(jnp.float32)  # [C, K]; tap K - 1 multiplies the row itself
    mixed = sum(window[:, j:j + S].astype(jnp.float32) * w[:, j] for j in range(w.shape[-1]))  # [batch, S, C]
    return jax.nn.silu(mixed).astype(qkv.dtype).astype(jnp.float32), window  # transformers rounds the conv's output


def _inputs(c: Qwen3_5Config, p: Params, xn: jax.Array, conv: jax.Array, shards: int):
    """The delta rule's inputs for `xn [batch, S, H]` after the conv state `conv`, from ONE product of `IN_PROJ`
    (its rows in `shards` blocks): `(q, k [batch, S, n_v, d_k], v [batch, S, n_v, d_v], g, beta [batch, S, n_v],
    z [batch, S, n_v, d_v], window [batch, K - 1 + S, C])`, all float32 but z and the window (xn's dtype)."""
    batch, S, _ = xn.shape
    n_k, n_v, d_k, d_v = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, \
        c.linear_value_head_dim
    per_shard = tuple(n // shards for n in in_proj_sizes(c))
    qkv, z, b, a = split_sections(linear(xn, p["in_proj"]), (sum(per_shard[:3]), *per_shard[3:]), shards)
    mixed, window = _conv(p, qkv, conv)
    q, k, v = split_sections(mixed, per_shard[:3], shards)  # [batch, S, C of q, k, v], heads in order
    group = n_v // n_k  # each key head serves `group` consecutive value heads
    q = jnp.repeat(l2_normed(q.reshape(batch, S, n_k, d_k)), group, axis=2) * d_k**-0.5
    k = jnp.repeat(l2_normed(k.reshape(batch, S, n_k, d_k)), group, axis=2)
    beta = jax.nn.sigmoid(b.astype(jnp.float32))
    g = -jnp.exp(p["A_log"].astype(jnp.float32)) * jax.nn.softplus(a.astype(jnp.float32) +
                                                                   p["dt_bias"].astype(jnp.float32))  # log decay <= 0
    return q, k, v.reshape(batch, S, n_v, d_v), g, beta, z.reshape(batch, S, n_v, d_v), window


def delta_net(c: Qwen3_5Config, layout: Layout | None, p: Params, xn: jax.Array, conv: jax.Array, state: jax.Array,
              valid: jax.Array | None, delta_chunk: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One delta-net layer's mixer over `xn [batch, S, H]`: `(out [batch, S, H], conv, state)`.

    `valid` None (a verify block): one chunk keeping every row's state (`block_delta_rule`); returns the pending
    window (`[batch, K - 1 + S, C]`) and the states before and after each row `[batch, S + 1, n_v, d_k,
    d_v]`. Else (prefill, `valid [batch, S]` the real rows, a prefix of each sequence's): the chunked form with
    padding rows masked (beta = 0, decay 1); returns the committed conv state after the real rows and the final
    state.
    """
    batch, S, _ = xn.shape
    with jax.named_scope("inputs"):  # scopes: names in the HLO metadata, for profiles (benchmarks/gpu_trace.py)
        q, k, v, g, beta, z, window = _inputs(c, p, xn, conv, tensor_shards(layout))
    if layout is not None:  # each device runs its own heads (a no-op where the projections' split carried through)
        q, k, v, z = (layout.constrain(x, HEAD_ROWS) for x in (q, k, v, z))
        g, beta = (layout.constrain(x, HEAD_ROWS[:3]) for x in (g, beta))
    if valid is None:
        with jax.named_scope("rule"):
            out, states = block_delta_rule(q, k, v, g, beta, state)
            conv, state = window, jnp.concatenate([state[:, None], states], axis=1)
        pending_axes: tuple[str | None, ...] = (BATCH, None, *STATE_AXES[1:])  # [batch, S + 1, n_v, d_k, d_v]
    else:
        g, beta = jnp.where(valid[..., None], g, 0.0), jnp.where(valid[..., None], beta, 0.0)
        with jax.named_scope("rule"):
            out, state = chunked_delta_rule(q, k, v, g, beta, state, min(delta_chunk, S))
        kept = jnp.sum(valid, axis=1, dtype=jnp.int32)
        conv = conv_state(window, kept, c.linear_conv_kernel_dim)
        pending_axes = STATE_AXES
    if layout is not None:
        state = layout.constrain(state, pending_axes)
        conv = layout.constrain(conv, CONV_AXES)
    with jax.named_scope("out"):
        out = rms_norm(out.astype(xn.dtype), p["norm"]["weight"], c.rms_norm_eps)  # gated: w * x_hat * silu(z)
        out = (out.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))).astype(xn.dtype)
        return linear(out.reshape(batch, S, c.value_dim), p["out_proj"]), conv, state

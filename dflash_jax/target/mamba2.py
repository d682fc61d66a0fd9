"""The Mamba-2 token mixer of NVIDIA's Nemotron-H / Nemotron 3 targets (transformers' `NemotronHMamba2Mixer`).

Per row t of a sequence, from the block's normed input `x_t [H]` (d_inner = nh hd, conv_dim = d_inner + 2 G N):

    z [d_inner], xBC [conv_dim], dt [nh] = in_proj x_t
    xBC_t = silu(bias + sum_k w_k xBC_{t-K+1+k})      depthwise causal conv over the last K rows
    x [nh, hd], B [G, N], C [G, N] = xBC_t              head h reads group h // (nh / G)
    dt = clip(softplus(dt + dt_bias), time_step_min, time_step_max),   A = -exp(A_log)
    s_t = exp(dt A) s_{t-1} + dt x B^T                  per head, s [hd, N] in float32
    y = s_t C + D x
    y = rmsnorm(y * silu(z)) * norm.weight              gate first, then RMS over G groups of d_inner / G channels
    out = out_proj y

The recurrence in three forms, one per use:
- one step (decode, one row): the update itself, no chunk machinery;
- chunked (prefill, verify), the SSD algorithm of Dao & Gu 2024 ("Transformers are SSMs", arXiv:2405.21060):
  within a chunk of T rows the output is a quadratic form (C_l . B_s) exp(dt_{s+1} A + .. + dt_l A) dt_s x_s, a
  causal attention with a decay mask; each chunk's inputs fold into one state at its end, a scan over the chunks
  carries the state across them, and each row adds C_l times its chunk's start state, decayed to it: matmuls
  instead of S dependent steps;
- every row's state (`keep_states`, a verify of a few rows): the state after row i is exp(sum_{k<=i} dt_k A) s_0 +
  sum_{j<=i} exp(sum_{j<k<=i} dt_k A) dt_j x_j B_j^T, a few batched products, kept for rollback to any accepted
  prefix (`select_state`).

Rows past a sequence's valid prefix, and the rows that pad S to a multiple of the chunk, get a zero input and
dt = 0: exp(0 A) = 1 and dt x B = 0, so the state passes through them unchanged.

Split by head over `shards` devices (`Mamba2Dims.shards`, 1 on one device): checkpoints store `in_proj`'s rows as
`[z | x | B | C | dt]` and the conv's channels as `[x | B | C]`, so a contiguous split of them would hand a device
rows of z and x only. A sharded mixer's `in_proj` and conv (weight, bias, state) hold their rows permuted instead
(`in_proj_order`, `conv_order`): shard d is `[z_d | x_d | B_d | C_d | dt_d]`, the d-th contiguous block of each
section, so that each device runs ONE projection of its own rows and one conv, and splits the result by static
section sizes (`target.sections`). Within a device the sections are whole heads (z, x, dt) and the B/C groups they
read where `shards` divides `groups`; where `groups` divides `shards`, a group's B/C rows are spread over the devices of
its heads, and its B/C activations (`[batch, S, G N]`, no weight) are gathered within the step. With one shard the
permutation is the identity: the checkpoint's tensors, one product, one conv.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._precision import dot, weight_dot
from .._shapes import ceil_div
from ..layers import static_fp8_input
from .sections import section_order, split_sections

__all__ = ["Mamba2Dims", "Mamba2State", "mixer", "empty_state", "in_proj_order", "conv_order"]

F32 = jnp.float32
IN_PROJ_SECTIONS = ("z", "x", "b", "c", "dt")  # `in_proj`'s row sections, in the order checkpoints store them
CONV_SECTIONS = ("x", "b", "c")  # the conv's channel sections, likewise


class Mamba2Dims(NamedTuple):
    """A Mamba-2 mixer's sizes (transformers' `NemotronHConfig`: mamba_num_heads, mamba_head_dim, n_groups,
    ssm_state_size, conv_kernel, chunk_size, layer_norm_epsilon). `time_step_min, time_step_max` are the config's
    `time_step_limit`, the clamp of dt, not its `time_step_min/max` (the range dt_bias was initialised from). The
    clamp applies to every row here; transformers 5.25 clamps in its multi-row path only, not in a cached
    one-row step. `shards`: the blocks `in_proj`'s rows and the conv's channels are in (module docstring; the
    tensor axis' size on a mesh), which must divide every section."""

    heads: int
    head_dim: int
    groups: int
    state: int
    conv_kernel: int
    chunk: int
    eps: float
    time_step_min: float = 0.0
    time_step_max: float = math.inf
    shards: int = 1

    @property
    def d_inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """The conv's channels: x, B and C."""
        return self.d_inner + 2 * self.groups * self.state

    def section_sizes(self, sections: tuple[str, ...]) -> tuple[int, ...]:
        """The rows (or channels) of each of `sections` (`IN_PROJ_SECTIONS`' names) in the checkpoint."""
        sizes = {"z": self.d_inner, "x": self.d_inner, "b": self.groups * self.state,
                 "c": self.groups * self.state, "dt": self.heads}
        return tuple(sizes[name] for name in sections)


def in_proj_order(dims: Mamba2Dims) -> np.ndarray:
    """`[in_proj rows]`: the checkpoint's row of each row of a sharded `in_proj` (the identity for one shard)."""
    return section_order(dims.section_sizes(IN_PROJ_SECTIONS), dims.shards)


def conv_order(dims: Mamba2Dims) -> np.ndarray:
    """`[conv_dim]`: the checkpoint's channel of each channel of a sharded conv (weight, bias, state)."""
    return section_order(dims.section_sizes(CONV_SECTIONS), dims.shards)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Mamba2State:
    """A mixer's carried state: `conv [batch, conv_dim, K-1]` the last K-1 conv inputs (oldest first, activation
    dtype; its channels in `conv_order`), `ssm [batch, nh, hd, N]` float32. From `mixer(.., keep_states=True)`
    each has an extra axis 1 of S+1: the state before row 0 and after each row."""

    conv: jax.Array
    ssm: jax.Array


def empty_state(dims: Mamba2Dims, batch: int, dtype: Any) -> Mamba2State:
    """The state before a sequence's first row: zeros."""
    return Mamba2State(conv=jnp.zeros((batch, dims.conv_dim, dims.conv_kernel - 1), dtype),
                       ssm=jnp.zeros((batch, dims.heads, dims.head_dim, dims.state), F32))


def select_state(states: Mamba2State, kept: jax.Array) -> Mamba2State:
    """From `mixer(.., keep_states=True)`'s states, the state after `kept [batch]` rows (0..S) of each sequence."""
    return jax.tree.map(lambda a: jax.vmap(lambda row, k: row[k])(a, kept), states)


def _segsum(a: jax.Array) -> jax.Array:
    """`a [..., T]` -> `[..., T, T]`: `sum_{s < k <= l} a_k` at `[l, s]` for s <= l, -inf above the diagonal.
    A cumulative sum of masked copies rather than a difference of cumulative sums, which would lose the small
    sums near the diagonal to the large ones."""
    size = a.shape[-1]
    seg = jnp.cumsum(jnp.where(jnp.tri(size, k=-1, dtype=bool), a[..., :, None], 0.0), axis=-2)  # [..., l, s]
    return jnp.where(jnp.tri(size, dtype=bool), seg, -jnp.inf)


def _one_step(s0: jax.Array, x: jax.Array, dt: jax.Array, a: jax.Array, b: jax.Array,
              c: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One row: `(y [batch, 1, G, P, hd], state [batch, G, P, hd, N])` from `s0 [batch, G, P, hd, N]`, `x [batch, 1,
    G, P, hd]`, `dt [batch, 1, G, P]`, `a [G, P]`, `b, c [batch, 1, G, N]` (P = heads per group)."""
    x, dt, b, c = x[:, 0], dt[:, 0], b[:, 0], c[:, 0]
    s = jnp.exp(dt * a)[..., None, None] * s0 + dot("bgpd,bgn->bgpdn", x * dt[..., None], b)  # [batch, G, P, hd, N]
    return dot("bgpdn,bgn->bgpd", s, c)[:, None], s


def _every_row(s0: jax.Array, x: jax.Array, dt: jax.Array, a: jax.Array, b: jax.Array,
               c: jax.Array) -> tuple[jax.Array, jax.Array]:
    """All S rows as one block, keeping every row's state: `(y [batch, S, G, P, hd], states [batch, S+1, G, P, hd,
    N])`, the states before row 0 and after each row; arguments as `_one_step`'s, S rows."""
    dt_t = jnp.moveaxis(dt, 1, -1)  # [batch, G, P, S]
    decay = jnp.exp(_segsum(dt_t * a[..., None]))  # [batch, G, P, i, j]: from after row j to after row i
    from_start = jnp.exp(jnp.cumsum(dt_t * a[..., None], axis=-1))  # [batch, G, P, i]: s0 to after row i
    xdt = jnp.moveaxis(x * dt[..., None], 1, 3)  # [batch, G, P, j, hd]
    inputs = dot("bgpijd,bjgn->bigpdn", decay[..., None] * xdt[:, :, :, None], b)  # [batch, i, G, P, hd, N]
    states = jnp.moveaxis(from_start, -1, 1)[..., None, None] * s0[:, None] + inputs  # [batch, S, G, P, hd, N]
    y = dot("bigpdn,bign->bigpd", states, c)  # [batch, S, G, P, hd]
    return y, jnp.concatenate([s0[:, None], states], axis=1)


def _chunked(s0: jax.Array, x: jax.Array, dt: jax.Array, a: jax.Array, b: jax.Array, c: jax.Array,
             size: int) -> tuple[jax.Array, jax.Array]:
    """The SSD algorithm in chunks of `size` rows: `(y [batch, S, G, P, hd], final state [batch, G, P, hd, N])`;
    arguments as `_one_step`'s, S rows. S is zero-padded to a multiple of `size` (dt = 0: inert rows). The largest
    temporary is the decay-masked scores, batch S nh size float32."""
    batch, rows = x.shape[:2]
    n = ceil_div(rows, size)

    def chunks(t: jax.Array) -> jax.Array:  # [batch, S, ...] -> [batch, n, size, ...]
        t = jnp.pad(t, [(0, 0), (0, n * size - rows)] + [(0, 0)] * (t.ndim - 2))
        return t.reshape(batch, n, size, *t.shape[2:])

    x, dt, b, c = chunks(x), chunks(dt), chunks(b), chunks(c)  # [batch, n, size, ...]
    log_decay = jnp.moveaxis(dt * a, 2, -1)  # [batch, n, G, P, size]
    decay = jnp.exp(_segsum(log_decay))  # [batch, n, G, P, l, s]: from after row s to after row l
    to_end = decay[..., -1, :]  # [batch, n, G, P, s]: from after row s to the chunk's end
    from_start = jnp.exp(jnp.cumsum(log_decay, axis=-1))  # [batch, n, G, P, l]: from the chunk's start to after row l
    xdt = x * dt[..., None]  # [batch, n, size, G, P, hd]

    # within each chunk: (C_l . B_s) decay_ls dt_s x_s
    scores = dot("bclgn,bcsgn->bcgls", c, b)[:, :, :, None] * decay  # [batch, n, G, P, l, s]
    y = dot("bcgpls,bcsgpd->bclgpd", scores, xdt)  # [batch, n, size, G, P, hd]
    # each chunk's inputs as a state at its end; then the scan across chunks: each chunk's start state
    ends = dot("bcsgpd,bcsgn->bcgpdn", xdt * jnp.moveaxis(to_end, -1, 2)[..., None], b)  # [batch, n, G, P, hd, N]

    def carry(s: jax.Array, chunk: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        total, end = chunk  # [batch, G, P], [batch, G, P, hd, N]
        return total[..., None, None] * s + end, s

    final, starts = jax.lax.scan(carry, s0, (jnp.moveaxis(from_start[..., -1], 1, 0), jnp.moveaxis(ends, 1, 0)))
    starts = jnp.moveaxis(starts, 0, 1)  # [batch, n, G, P, hd, N]
    # the start state's part, decayed to each row
    y = y + dot("bclgn,bcgpdn->bclgpd", c, starts) * jnp.moveaxis(from_start, -1, 2)[..., None]
    return y.reshape(batch, n * size, *y.shape[3:])[:, :rows], final


def _conv(p: Mapping[str, Any], state: jax.Array, xbc: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The depthwise causal conv and its SiLU: `(inputs [batch, K-1+S, conv_dim], out [batch, S, conv_dim])` from
    `state [batch, conv_dim, K-1]`, `xbc [batch, S, conv_dim]`; `inputs` the state's rows then the new ones."""
    rows, taps = xbc.shape[1], p["weight"].shape[-1]
    inputs = jnp.concatenate([state.swapaxes(1, 2), xbc], axis=1)  # [batch, K-1+S, conv_dim]
    w = p["weight"][:, 0].astype(F32)  # [conv_dim, K]
    out = sum((inputs[:, k:k + rows].astype(F32) * w[:, k] for k in range(taps)), start=p["bias"].astype(F32))
    return inputs, jax.nn.silu(out).astype(xbc.dtype)


def _conv_states(inputs: jax.Array, after: jax.Array, taps: int) -> jax.Array:
    """The conv states after `after [batch, R]` rows: `[batch, R, conv_dim, K-1]`, the K-1 inputs ending there."""
    index = after[..., None] + jnp.arange(taps - 1)  # [batch, R, K-1]
    return jax.vmap(lambda rows, i: rows[i])(inputs, index).swapaxes(-1, -2)


def mixer(p: Mapping[str, Any], dims: Mamba2Dims, x: jax.Array, state: Mamba2State, valid: jax.Array, *,
          keep_states: bool = False) -> tuple[jax.Array, Mamba2State]:
    """The mixer over S rows: `(y [batch, S, H] in x's dtype, state)` from `x [batch, S, H]` (the block's normed
    input), `p` the block's `mixer.` weights (transformers' names; `in_proj` and the conv in `dims.shards` blocks,
    module docstring), `valid [batch, S]` each sequence's valid prefix (right padding: the rows past it leave the
    state alone; their outputs are finite, and meaningless). The state is the one after the last valid row, or
    with `keep_states` every row's (`Mamba2State`, for `select_state`)."""
    batch, rows, _ = x.shape
    groups, per_group, hd, n = dims.groups, dims.heads // dims.groups, dims.head_dim, dims.state
    shards = dims.shards
    lengths = jnp.sum(valid, axis=1, dtype=jnp.int32)  # [batch]
    x = jnp.where(valid[..., None], x, 0)  # past the prefix: zeros, whatever was there

    proj = weight_dot(static_fp8_input(x, p["in_proj"]), p["in_proj"]["weight"], x.dtype)  # [batch, S, in_proj rows]
    z, xbc, dt = split_sections(proj, (dims.d_inner // shards, dims.conv_dim // shards, dims.heads // shards), shards)
    conv_inputs, xbc = _conv(p["conv1d"], state.conv, xbc)  # [batch, K-1+S, conv_dim], [batch, S, conv_dim]
    xs, b, c = split_sections(xbc.astype(F32), tuple(size // shards for size in dims.section_sizes(CONV_SECTIONS)),
                              shards)  # [batch, S, d_inner], [batch, S, G N] x 2, in the checkpoint's order
    xs = xs.reshape(batch, rows, groups, per_group, hd)  # head h = group h // P, P = per_group
    b, c = b.reshape(batch, rows, groups, n), c.reshape(batch, rows, groups, n)
    dt = jnp.clip(jax.nn.softplus(dt.astype(F32) + p["dt_bias"].astype(F32)), dims.time_step_min, dims.time_step_max)
    dt = jnp.where(valid[..., None], dt, 0.0).reshape(batch, rows, groups, per_group)  # dt = 0: inert rows
    a = -jnp.exp(p["A_log"].astype(F32)).reshape(groups, per_group)
    s0 = state.ssm.reshape(batch, groups, per_group, hd, n)

    if keep_states:
        y, ssm = _every_row(s0, xs, dt, a, b, c)  # [batch, S, G, P, hd], [batch, S+1, G, P, hd, N]
        after = jnp.minimum(jnp.arange(rows + 1), lengths[:, None])  # [batch, S+1]: past the prefix, its end
    elif rows == 1:
        y, ssm = _one_step(s0, xs, dt, a, b, c)
        after = lengths[:, None]  # [batch, 1]
    else:
        y, ssm = _chunked(s0, xs, dt, a, b, c, min(dims.chunk, rows))  # one chunk of S rows when S < chunk
        after = lengths[:, None]
    conv = _conv_states(conv_inputs, after, dims.conv_kernel)  # [batch, R, conv_dim, K-1]
    ssm = ssm.reshape(*ssm.shape[:-4], dims.heads, hd, n)  # [batch, (S+1,) nh, hd, N]
    new = Mamba2State(conv=conv, ssm=ssm) if keep_states else Mamba2State(conv=conv[:, 0], ssm=ssm)

    # D skip; gate then RMS norm per group (the norm's groups are the B/C groups' heads)
    y = y + p["D"].astype(F32).reshape(groups, per_group, 1) * xs  # [batch, S, G, P, hd]
    y = y.reshape(batch, rows, groups, per_group * hd) * jax.nn.silu(z.astype(F32)).reshape(batch, rows, groups, -1)
    y = y * jax.lax.rsqrt(jnp.mean(jnp.square(y), axis=-1, keepdims=True) + dims.eps)
    y = y.reshape(batch, rows, dims.d_inner) * p["norm"]["weight"].astype(F32)
    return weight_dot(static_fp8_input(y.astype(x.dtype), p["out_proj"]), p["out_proj"]["weight"], x.dtype), new

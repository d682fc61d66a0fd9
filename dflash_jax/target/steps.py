"""The forward pieces every target family shares: a layer's attention over its KV cache (under `shard_map` on a
mesh), the chunked prefill of right-padded prompts.

Pure model code over arrays and a `Layout` (where a mesh splits them): no checkpoint I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from .._shapes import chunked
from ..attention import KeyValues, LayerRule, Span, attend, causal_self_attention, write_slots
from ..spec import BATCH, HEADS
from . import FeatureMap, mapped
from .layout import CACHE_AXES, Layout

__all__ = ["cached_attention", "prefill_chunks"]

CAUSAL = LayerRule(causal=True, window=None)


def cached_attention(layout: Layout | None, num_heads: int, q: jax.Array, k: jax.Array, v: jax.Array, past_k: jax.Array,
               past_v: jax.Array, positions: jax.Array, start: jax.Array, fused: Literal["cudnn", "xla"] | None,
               first: jax.Array | int = 0):
    """One layer's attention and cache write: `(out [batch, S, n_h, d_h], past_k, past_v)` with the new rows'
    K/V (`k, v [batch, n_kv, S, d_h]`) written at `positions [batch, S]` of the cache `[sequences, n_kv, T, d_h]`
    (its sequences `first ..`: 0 but in a fused prefill's groups).

    The new rows attend to the cache's slots `[0, start)` (a span) and causally to themselves; `fused` ("cudnn",
    or "xla" for the CPU twin): the cache is empty and `causal_self_attention` runs the rows over themselves.

    On a mesh this runs under `shard_map`, each device on its own sequences and heads: attention needs no
    communication between heads, and the kernels it may use (the Pallas span kernel, cuDNN) are custom calls
    GSPMD cannot partition (it would gather their operands onto every device). Where the KV heads are
    replicated (a tensor axis larger than `num_key_value_heads`) a device's query heads all belong to one KV
    head, which it slices out of its full copy. `num_heads`: the target's query heads (all devices together).
    """

    def local(q, k, v, past_k, past_v, positions, start, first):
        n_kv = k.shape[1]
        new_k = write_slots(past_k, k.astype(past_k.dtype), positions, first)  # past the end: dropped
        new_v = write_slots(past_v, v.astype(past_v.dtype), positions, first)
        if layout is not None and layout.tensor_axis and not layout.split_kv:
            group = jax.lax.axis_index(layout.tensor_axis) * q.shape[2] // (num_heads // n_kv)
            k, v, past_k, past_v = (jax.lax.dynamic_slice_in_dim(a, group, 1, axis=1) for a in (k, v, past_k, past_v))
        if fused:
            return causal_self_attention(q, k, v, fused), new_k, new_v
        past = Span(past_k, past_v, jnp.zeros_like(start), start)
        out = attend(q, positions, CAUSAL, (KeyValues(k, v, positions, jnp.ones(positions.shape, bool)),), (past,))
        return out, new_k, new_v

    if layout is None:
        return local(q, k, v, past_k, past_v, positions, start, first)
    batch = q.shape[0]
    rows = layout.spec((BATCH, None), batch)
    q_spec = layout.spec((BATCH, None, HEADS, None), batch)  # [batch, S, n_h, d_h]
    kv_spec = layout.spec(CACHE_AXES, batch)  # [batch, n_kv, rows, d_h]
    cache_spec = layout.spec(CACHE_AXES, past_k.shape[0])  # [sequences, n_kv, T, d_h]
    return jax.shard_map(
        local, mesh=layout.mesh, in_specs=(q_spec, kv_spec, kv_spec, cache_spec, cache_spec, rows,
                                           PartitionSpec(rows[0]), PartitionSpec()),
        out_specs=(q_spec, cache_spec, cache_spec), check_vma=False,
    )(q, k, v, past_k, past_v, positions, start, first)


def prefill_chunks(run: Callable[[jax.Array, Any, jax.Array], tuple[jax.Array, jax.Array, Any]], tokens: jax.Array,
                   cache: Any, lengths: jax.Array, chunk: int, last_hidden: jax.Array,
                   project: FeatureMap | None = None) -> tuple[jax.Array, jax.Array, Any]:
    """Right-padded prompts `tokens [batch, P]` run `chunk` token rows at a time over the whole batch (`chunk // batch`
    of each sequence, at least one) through `run(piece [batch, rows], cache, start [batch]) -> (hidden [batch, rows, H],
    features [batch, rows, F], cache)` (a `lax.scan`; the last piece padded): `(hidden of each prompt's last real row
    [batch, H], features [batch, P, F] or `project`'s map of each step's, cache)`. `last_hidden`: zeros of the hidden
    states' shape and dtype. Shared by the targets' chunked prefills. A step's activations (MoE tiles, delta-rule
    chunks, attention scores) scale with batch x rows, so bounding that product by `chunk` keeps a batch's prefill
    within the memory one sequence's takes (a 2048-row chunk of 8 sequences of the 35B-A3B ran the H200 out of
    memory)."""
    batch, P = tokens.shape
    last = lengths.astype(jnp.int32) - 1  # [batch] each prompt's last row
    chunk = min(P, max(1, chunk // batch))  # rows of each sequence a step
    pieces = chunked(tokens, chunk)  # [n_chunks, batch, chunk]
    n_chunks = len(pieces)

    def step(carry, inputs):
        cache, last_hidden = carry
        c, piece = inputs  # piece: [batch, chunk]
        hidden, features, cache = run(piece, cache, jnp.full((batch,), c * chunk, jnp.int32))
        row = jnp.clip(last - c * chunk, 0, chunk - 1)
        here = ((last >= c * chunk) & (last < (c + 1) * chunk))[:, None]
        last_hidden = jnp.where(here, jnp.take_along_axis(hidden, row[:, None, None], axis=1)[:, 0], last_hidden)
        return (cache, last_hidden), mapped(project, features)

    (cache, last_hidden), features = jax.lax.scan(
        step, (cache, last_hidden), (jnp.arange(n_chunks), pieces)
    )  # features: [n_chunks, batch, chunk, Lf * H or D]
    return last_hidden, features.swapaxes(0, 1).reshape(batch, n_chunks * chunk, -1)[:, :P], cache

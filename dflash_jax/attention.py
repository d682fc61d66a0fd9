"""Attention for long inputs, shared by the drafter and the targets: blocked, online softmax, reads only what it needs.

A query block attends to keys from two kinds of source, merged through one float32 softmax:

- `Span`: a contiguous slot range `[start, stop)` (per sequence) of a static-shape cache, every key of which the
  rule lets every query see (earlier context, a target's committed prefix). Only the key blocks that intersect
  the range are read: a `lax.fori_loop` over blocks of `Tuning.span_block` slots with a dynamic trip count (the XLA
  path, also the reference), or on a Hopper GPU a split-K Pallas Mosaic GPU kernel (`_span_attention_mgpu`),
  which skips the blocks outside the range too. No `[rows, capacity]` score is formed.
- `KeyValues`: a few rows with positions and a validity mask (the block itself, new context rows, a sliding
  window's ring buffer), scored densely under the layer's `LayerRule` (causal, windowed, bidirectional).

Each source gives a partial softmax `(acc, max, sum)` in float32; `attend` merges them (the flash-attention
recurrence: Dao et al. 2022, "FlashAttention", arXiv:2205.14135). Scale `d_h ** -0.5`; GQA maps query head h
to KV head `h // (n_h / n_kv)`. Keys carry RoPE at their absolute positions (applied before caching), so a
window is never re-based.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

from ._kernel_choice import kernel_choice
from ._precision import dot
from ._shapes import ceil_div, round_up
from .platform import Platform, on_gpu, process_platform
from .tuning import Tuning

__all__ = ["attend", "causal_self_attention", "LayerRule", "KeyValues", "Span", "visible", "span_capacity",
           "SPAN_ALIGN", "Impl", "ATTEND_IMPLS", "PREFILL_IMPLS"]

_PALLAS_MAX_ROWS = 256  # query rows per KV head up to which the GPU kernel is used (it reads K/V once a 64-row tile)
SPAN_ALIGN = 128  # the GPU kernel reads caches whose capacity is a multiple of this (init_cache rounds up to it)
# The GPU kernel's splits and tiles and the XLA loop's block are tuned per device kind (`tuning.Tuning`: `span_*`).


# The kernel choice, one vocabulary for `attend`, `propose` and a target's `prefill` (each takes the values that
# apply to it, `check_impl`): "auto" picks by where the program runs (`platform.on_gpu`) and the operands; "xla" forces
# XLA's path; "pallas" the Pallas Mosaic GPU span kernel (attend, propose); "cudnn" cuDNN's fused prefill (prefill).
Impl = Literal["auto", "xla", "pallas", "cudnn"]
ATTEND_IMPLS: tuple[Impl, ...] = ("auto", "xla", "pallas")
PREFILL_IMPLS: tuple[Impl, ...] = ("auto", "xla", "cudnn")


def check_impl(where: str, impl: object, allowed: tuple[Impl, ...]) -> Impl:
    """`impl` when it is one of `allowed`, else a `ValueError` naming `where` and the accepted values
    (`_kernel_choice`: the one vocabulary, old spellings warned about)."""
    return kernel_choice(where, "impl", impl, allowed)  # type: ignore[return-value]  # one of `allowed`


# Pytree containers of arrays are registered frozen dataclasses (`KeyValues`, `Span`, ...; fields read by name,
# `dataclasses.replace` for updates); static hashable records that decide a program, like `LayerRule`, are
# NamedTuples.
class LayerRule(NamedTuple):
    """Which keys one layer's queries see: `causal` (key position <= query position) and a window."""

    causal: bool
    window: int | None  # |query - key| <= window - 1; None: unbounded
    sinks: int = 0  # with a window: keys at positions < sinks are visible too (attention sinks)


def visible(query_positions: jax.Array, key_positions: jax.Array, rule: LayerRule) -> jax.Array:
    """`[batch, Sq, Sk]` bool: which keys each query may attend to under `rule`."""
    distance = query_positions[:, :, None] - key_positions[:, None, :]  # [batch, Sq, Sk]
    ok = jnp.ones(distance.shape, bool)
    if rule.causal:
        ok &= distance >= 0
    if rule.window is not None:
        ok &= (jnp.abs(distance) < rule.window) | (key_positions[:, None, :] < rule.sinks)
    return ok


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KeyValues:
    """Keys/values of a few rows, scored densely: post k_norm + RoPE keys, values, positions, which rows are real."""

    k: jax.Array  # [batch, n_kv, rows, d_h]: heads-major, so the attention GEMMs read it without a transpose
    v: jax.Array  # [batch, n_kv, rows, d_h]
    positions: jax.Array  # [batch, rows] int32
    valid: jax.Array  # [batch, rows] bool


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Span:
    """Slots `[start, stop)` of a cache `[batch, n_kv, capacity, d_h]`, all visible to every query (no mask)."""

    k: jax.Array  # [batch, n_kv, capacity, d_h]
    v: jax.Array  # [batch, n_kv, capacity, d_h]
    start: jax.Array  # [batch] int32
    stop: jax.Array  # [batch] int32 (exclusive; an empty range contributes nothing)


def write_slots(cache: jax.Array, rows: jax.Array, slots: jax.Array, first: jax.Array | int = 0) -> jax.Array:
    """`cache [sequences, n_kv, capacity, d_h]` with `rows [batch, n_kv, n, d_h]` written at `slots [batch, n]`
    of sequences `first .. first + batch - 1` (per sequence; a slot >= capacity drops its row). In place when
    the cache is donated, in a loop too (a scatter: a `dynamic_update_slice` at a loop-varying batch offset made
    XLA:GPU copy the whole cache)."""
    seq = first + jnp.arange(rows.shape[0])[:, None, None]
    heads = jnp.arange(cache.shape[1])[None, :, None]
    return cache.at[seq, heads, slots[:, None, :]].set(rows, mode="drop")  # indices broadcast to [batch, n_kv, n]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Partial:
    """An unnormalised softmax over some keys: `acc = sum_k exp(s_k - m) v_k`, `m = max_k s_k`, `l = sum exp`."""

    acc: jax.Array  # [batch, n_kv, groups, Sq, d_h] f32
    m: jax.Array  # [batch, n_kv, groups, Sq] f32 (-inf: no key seen)
    l: jax.Array  # [batch, n_kv, groups, Sq] f32


def _empty(q: jax.Array) -> _Partial:
    shape = q.shape[:-1]
    return _Partial(jnp.zeros(q.shape, jnp.float32), jnp.full(shape, -jnp.inf), jnp.zeros(shape, jnp.float32))


def _update(p: _Partial, q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> _Partial:
    """Fold keys `k, v [batch, n_kv, rows, d_h]` into `p`; mask broadcasts to `[batch, n_kv, groups, Sq, rows]`."""
    s = dot("bhgqd,bhkd->bhgqk", q, k) * q.shape[-1] ** -0.5  # [batch, n_kv, groups, Sq, rows] f32
    s = jnp.where(mask, s, -jnp.inf)
    m = jnp.maximum(p.m, s.max(axis=-1))
    shift = jnp.where(jnp.isfinite(m), m, 0.0)  # no key seen yet: keep exp() finite
    w = jnp.exp(s - shift[..., None])
    carry = jnp.exp(p.m - shift)  # 0 where nothing was seen before
    acc = p.acc * carry[..., None] + dot("bhgqk,bhkd->bhgqd", w.astype(v.dtype), v)
    return _Partial(acc, m, p.l * carry + w.sum(axis=-1))


def _merge(a: _Partial, b: _Partial) -> _Partial:
    m = jnp.maximum(a.m, b.m)
    shift = jnp.where(jnp.isfinite(m), m, 0.0)
    ca, cb = jnp.exp(a.m - shift), jnp.exp(b.m - shift)
    return _Partial(a.acc * ca[..., None] + b.acc * cb[..., None], m, a.l * ca + b.l * cb)


def _sink(q: jax.Array, sink_logits: jax.Array) -> _Partial:
    """The partial of a sink logit per head `[n_h]` (query head h = KV head h // groups, group h % groups): the
    softmax's extra column with a zero value, `m` = the logit, `l` = exp(0) = 1."""
    m = sink_logits.astype(jnp.float32).reshape(1, q.shape[1], q.shape[2], 1)  # [1, n_kv, groups, 1]
    m = jnp.broadcast_to(m, q.shape[:-1])  # [batch, n_kv, groups, Sq]
    return _Partial(jnp.zeros(q.shape, jnp.float32), m, jnp.ones(m.shape, jnp.float32))


def _dense(q: jax.Array, q_positions: jax.Array, kv: KeyValues, rule: LayerRule) -> _Partial:
    mask = visible(q_positions, kv.positions, rule) & kv.valid[:, None, :]  # [batch, Sq, rows]
    return _update(_empty(q), q, kv.k, kv.v, mask[:, None, None])


def _span_xla(q: jax.Array, span: Span, block: int) -> _Partial:
    """Blocks of `block` slots from the first block holding a `start` to the last holding a `stop - 1`.

    The loop's bounds are the batch's: in a ragged batch a sequence's blocks outside its own range are read and
    masked (their values zeroed, so even non-finite garbage there cannot leak).
    """
    capacity = span.k.shape[2]
    block = min(block, capacity)
    first = jnp.min(span.start) // block
    last = ceil_div(jnp.max(span.stop), block)

    def body(i, p):
        at = jnp.minimum(i * block, capacity - block)  # a ragged last block is read shifted back ...
        idx = at + jnp.arange(block)  # [block]
        ok = (idx >= i * block) & (idx >= span.start[:, None]) & (idx < span.stop[:, None])  # ... its overlap masked
        k = jax.lax.dynamic_slice_in_dim(span.k, at, block, axis=2)  # [batch, n_kv, block, d_h]
        v = jax.lax.dynamic_slice_in_dim(span.v, at, block, axis=2)
        v = jnp.where(ok[:, None, :, None], v, 0)  # masked slots (another sequence's range) may hold anything
        return _update(p, q, k, v, ok[:, None, None, None, :])

    return jax.lax.fori_loop(first, jnp.maximum(first, last), body, _empty(q))


def _span_pallas(q: jax.Array, span: Span, tuning: Tuning) -> _Partial:
    """The split-K Mosaic GPU kernel over `[start, stop)` (key blocks outside the range are skipped, not masked)."""
    from ._span_attention_mgpu import span_partials

    batch, n_kv, groups, Sq, d_h = q.shape
    keys = kernel_keys_per_split(span.k.shape[2], groups * Sq, batch * n_kv, tuning)
    acc, m, l = span_partials(q.reshape(batch, n_kv, groups * Sq, d_h), span.k, span.v, span.start, span.stop,
                              keys_per_split=keys, block_k=tuning.span_block_k,
                              stages=tuning.span_stages)  # [batch, n_kv, rows(, d_h)]
    shape = (batch, n_kv, groups, Sq)
    return _Partial(acc.reshape(*shape, d_h), m.reshape(shape), l.reshape(shape))


def kernel_keys_per_split(capacity: int, rows: int, heads: int, tuning: Tuning | None = None) -> int:
    """Keys per split of the GPU kernel reading a cache of `capacity` slots with `rows` query rows per KV head, for
    `heads` (sequences x KV heads) at once: the kernel runs a program per head, 64-row query tile and split."""
    programs = heads * ceil_div(rows, 64)
    return capacity // _splits(capacity, pallas_tile(rows), programs, tuning)  # SPAN_ALIGN-aligned


def pallas_tile(rows: int) -> int:
    """The query tile by which `split_keys` picks a split size for `rows` query rows per KV head: the next power of
    two, at least 16 (the tiles of the former Triton kernel, which the split sizes were measured with)."""
    return max(16, 1 << (rows - 1).bit_length())


def split_keys(capacity: int, tile: int, tuning: Tuning | None = None) -> int:
    """Keys per split of the GPU kernel for a cache of `capacity` slots read by `tile`-row programs
    (`tuning.Tuning.span_splits`; default: `platform.process_platform()`'s entry)."""
    tuning = tuning or process_platform().tuning
    _, small, large = next(band for band in tuning.span_splits if capacity <= band[0])
    return large if tile >= 64 else small


def span_capacity(rows: int, tuning: Tuning | None = None) -> int:
    """The capacity of a cache for `rows` rows that the GPU kernel reads well: a multiple of `SPAN_ALIGN`, and of
    the longest split its band uses (`tuning.Tuning.span_splits`), since the kernel's splits must divide the
    capacity (128-slot alignment alone gives capacities of a prime number of blocks, read in splits of 128 keys).
    Rounding up never leaves the band."""
    align = SPAN_ALIGN if rows <= SPAN_ALIGN else max(split_keys(rows, 16, tuning), split_keys(rows, 128, tuning))
    return round_up(rows, align)


def _splits(capacity: int, tile: int, programs: int | None = None, tuning: Tuning | None = None) -> int:
    """Split-K count: a divisor of the capacity's 128-slot blocks giving splits of about `split_keys` keys (exactly
    that for a `span_capacity`), so a long span is read by many programs at once (measured: 16 fixed splits ran a
    128k span at 1/6 of the bandwidth); a split past a sequence's `stop` exits at once. `programs` (sequences x KV
    heads x query tiles) below `tuning.Tuning.span_programs` shortens the splits in proportion: a hybrid target's
    2 KV heads of 256 at batch 1 read 8k slots in 0.030 ms with 128-key splits against 0.047 ms with 512 (H200,
    docs/benchmarks.md)."""
    tuning = tuning or process_platform().tuning
    blocks, per_split = capacity // SPAN_ALIGN, split_keys(capacity, tile, tuning) / SPAN_ALIGN
    if programs is not None and programs < tuning.span_programs:
        per_split = max(1.0, per_split * programs / tuning.span_programs)
    return min((d for d in range(1, blocks + 1) if blocks % d == 0), key=lambda d: abs(blocks / d - per_split))


def use_pallas(q: jax.Array, span: Span, platform: Platform) -> bool:
    """The GPU kernel applies on Hopper or newer to 16-bit operands, few query rows per KV head and block-aligned
    capacities (on a GPU: `on_gpu` decides that)."""
    _, _, groups, Sq, d_h = q.shape
    return (
        platform.hopper_or_newer
        and q.dtype in (jnp.bfloat16, jnp.float16)
        and span.k.dtype == q.dtype
        and groups * Sq <= _PALLAS_MAX_ROWS
        and span.k.shape[2] % SPAN_ALIGN == 0
        and d_h in (64, 128, 256)
    )


def causal_self_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                          implementation: Literal["cudnn", "xla"] = "cudnn") -> jax.Array:
    """Causal attention of a sequence over itself (a prompt into an empty cache) with cuDNN's fused flash kernel
    (`jax.nn.dot_product_attention(implementation="cudnn")`): `q [batch, S, n_h, d_h]`, `k, v [batch, n_kv, S,
    d_h]` heads-major -> `[batch, S, n_h, d_h]`. Row i sees keys 0..i: right-padded rows only reach the padding
    behind them. cuDNN: GPU only, 16-bit operands; `implementation="xla"` is the same function on any backend
    (how the tests run the fused prefill on a CPU)."""
    k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [batch, S, n_kv, d_h]
    return jax.nn.dot_product_attention(q, k, v, scale=q.shape[-1] ** -0.5, is_causal=True,
                                        implementation=implementation)


def use_cudnn(dtype: jnp.dtype, head_dim: int) -> bool:
    """Where `causal_self_attention` applies (on a GPU: `on_gpu` decides that): 16-bit operands, a head size
    cuDNN's kernel takes."""
    return dtype in (jnp.bfloat16, jnp.float16) and head_dim in (64, 128)


def attend(
    q: jax.Array,
    q_positions: jax.Array,
    rule: LayerRule,
    dense: Sequence[KeyValues] = (),
    spans: Sequence[Span] = (),
    *,
    impl: Impl = "auto",
    block: int | None = None,
    sink_logits: jax.Array | None = None,
    platform: Platform | None = None,
) -> jax.Array:
    """Softmax attention of `q [batch, Sq, n_h, d_h]` at `q_positions [batch, Sq]` over all sources together.

    `dense` sources are masked by `rule`; `spans` are read unmasked (the caller guarantees the rule lets every
    query see them). `sink_logits [n_h]`: a learned logit per head that joins every query's softmax, unscaled, as
    a key with a zero value (GPT-OSS / Nemotron sinks: the column appended before the softmax and dropped after);
    it enters as one more partial, so every kernel path takes it unchanged. impl: "xla" (blocked loop), "pallas"
    (the Mosaic GPU kernel for spans, Hopper or newer) or "auto" (the kernel where it applies: a program lowered for
    a Hopper or newer GPU, 16-bit operands, at most `_PALLAS_MAX_ROWS` (256) query rows per KV head); another is a
    `ValueError`. `block`: the XLA loop's key slots a step (default the platform's `span_block`); `platform`: the
    device facts and tuning that choose (default `platform.process_platform()`). Returns `[batch, Sq, n_h, d_h]` in
    q's dtype; a query that sees no key gets zeros (with sinks too:
    the sink's value is zero).
    """
    check_impl("attend", impl, ATTEND_IMPLS)
    platform = platform or process_platform()
    batch, Sq, n_h, d_h = q.shape
    n_kv = (dense[0] if dense else spans[0]).k.shape[1]
    q5 = q.reshape(batch, Sq, n_kv, n_h // n_kv, d_h).transpose(0, 2, 3, 1, 4)  # [batch, n_kv, groups, Sq, d_h]
    parts = [_dense(q5, q_positions, kv, rule) for kv in dense]
    for span in spans:
        xla = functools.partial(_span_xla, block=block or platform.tuning.span_block)
        pallas = functools.partial(_span_pallas, tuning=platform.tuning)
        if impl == "pallas":
            parts.append(pallas(q5, span))
        elif impl == "auto" and use_pallas(q5, span, platform):
            parts.append(on_gpu(platform, pallas, xla, q5, span))
        else:
            parts.append(xla(q5, span))
    if sink_logits is not None:
        parts.append(_sink(q5, sink_logits))
    total = functools.reduce(_merge, parts)
    out = total.acc / jnp.where(total.l > 0, total.l, 1.0)[..., None]  # [batch, n_kv, groups, Sq, d_h] f32
    return out.transpose(0, 3, 1, 2, 4).reshape(batch, Sq, n_h, d_h).astype(q.dtype)

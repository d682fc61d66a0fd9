"""The blocked attention (`dflash_jax.attention`) against a naive float64 softmax over full score matrices."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from dflash_jax.attention import KeyValues, LayerRule, Span, attend
from dflash_jax.tuning import FALLBACK

from ._pallas import needs_gpu


def rule_mask(q_pos, k_pos, rule):
    """`[b, Sq, T]` bool: the rule, written from its definition (model.py's docstring)."""
    dist = q_pos[:, :, None] - k_pos[:, None, :]
    ok = np.ones(dist.shape, bool)
    if rule.causal:
        ok &= dist >= 0
    if rule.window is not None:
        ok &= (np.abs(dist) < rule.window) | (k_pos[:, None, :] < rule.sinks)
    return ok


def naive(q, k, v, mask):
    """Float64 softmax over full score matrices with an explicit mask `[b, Sq, T]`; `q [b, Sq, n_h, d]`,
    `k, v [b, n_kv, T, d]`; a query that sees nothing gets zeros."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    b, Sq, n_h, d = q.shape
    group = n_h // k.shape[1]
    out = np.zeros(q.shape)
    for s in range(b):
        for h in range(n_h):
            scores = np.where(mask[s], q[s, :, h] @ k[s, h // group].T / np.sqrt(d), -np.inf)  # [Sq, T]
            peak = scores.max(1, keepdims=True)
            w = np.exp(scores - np.where(np.isfinite(peak), peak, 0.0))
            total = w.sum(1, keepdims=True)
            out[s, :, h] = (w @ v[s, h // group]) / np.where(total > 0, total, 1.0)
    return out


def _inputs(rng, batch, Sq, n_h, n_kv, T, d=16):
    q = rng.standard_normal((batch, Sq, n_h, d)).astype(np.float32) * 2
    k = rng.standard_normal((batch, n_kv, T, d)).astype(np.float32) * 2
    v = rng.standard_normal((batch, n_kv, T, d)).astype(np.float32)
    return q, k, v


RULES = [LayerRule(True, None), LayerRule(False, None), LayerRule(True, 5), LayerRule(False, 7),
         LayerRule(True, 4, 3)]


@pytest.mark.parametrize("rule", RULES, ids=str)
@pytest.mark.parametrize("n_h,n_kv", [(4, 4), (4, 2), (8, 2)])
def test_spans_and_dense_rows_equal_the_naive_softmax(rule, n_h, n_kv):
    """A cache span (ragged `[start, stop)` per sequence, one ending at the capacity, a block size that does not
    divide the capacity) plus new rows scored under the rule: one softmax over the keys both cover."""
    rng = np.random.default_rng(n_h * 10 + n_kv)
    batch, T, Sq = 3, 45, 6
    q, k, v = _inputs(rng, batch, Sq, n_h, n_kv, T + Sq)
    start, stop = np.array([0, 3, 10]), np.array([20, 45, 10])  # the last: empty
    q_pos = stop[:, None] + np.arange(Sq)  # the new rows follow the span
    new_ok = np.array([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], bool)
    span = Span(jnp.asarray(k[:, :, :T]), jnp.asarray(v[:, :, :T]), jnp.asarray(start), jnp.asarray(stop))
    fresh = KeyValues(jnp.asarray(k[:, :, T:]), jnp.asarray(v[:, :, T:]), jnp.asarray(q_pos), jnp.asarray(new_ok))
    got = jax.jit(lambda *a: attend(*a, impl="xla", block=16), static_argnums=2)(
        jnp.asarray(q), jnp.asarray(q_pos), rule, (fresh,), (span,))
    chex.assert_shape(got, q.shape)
    chex.assert_type(got, jnp.float32)

    in_span = (np.arange(T) >= start[:, None]) & (np.arange(T) < stop[:, None])  # [b, T]
    mask = np.concatenate([  # span keys: every query sees them; new rows: the rule decides
        np.broadcast_to(in_span[:, None, :], (batch, Sq, T)),
        new_ok[:, None, :] & rule_mask(q_pos, q_pos, rule),
    ], axis=2)
    np.testing.assert_allclose(np.asarray(got), naive(q, k, v, mask), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("rule", RULES, ids=str)
def test_dense_rows_alone_equal_the_naive_softmax(rule):
    """Only masked rows (a ring buffer's, say): positions out of order, some invalid."""
    rng = np.random.default_rng(1)
    batch, Sq, T = 2, 5, 12
    q, k, v = _inputs(rng, batch, Sq, 4, 2, T)
    q_pos = np.array([[20, 21, 22, 23, 24], [9, 10, 11, 12, 13]])
    k_pos = np.stack([rng.permutation(np.arange(13, 25)), rng.permutation(np.arange(2, 14))])
    k_ok = rng.random((batch, T)) < 0.8
    k_ok[np.arange(batch)[:, None], np.argsort(k_pos, 1)[:, -Sq:]] = True  # each query at least sees itself
    kv = KeyValues(jnp.asarray(k), jnp.asarray(v), jnp.asarray(k_pos), jnp.asarray(k_ok))
    got = attend(jnp.asarray(q), jnp.asarray(q_pos), rule, (kv,))
    mask = k_ok[:, None, :] & rule_mask(q_pos, k_pos, rule)
    np.testing.assert_allclose(np.asarray(got), naive(q, k, v, mask), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("start,stop,garbage", [([8, 40], [24, 64], np.nan), ([5, 41], [23, 60], 1e3)])
def test_a_span_reads_only_its_range(start, stop, garbage):
    """Slots outside `[start, stop)` never matter. Block-aligned ranges: NaNs outside leave the output unchanged,
    so those blocks are not read at all; ragged ones: large values in the blocks' masked slots change nothing."""
    rng = np.random.default_rng(2)
    q, k, v = _inputs(rng, 2, 3, 4, 2, 64)
    start, stop = np.asarray(start), np.asarray(stop)

    def run(k, v):
        span = Span(jnp.asarray(k), jnp.asarray(v), jnp.asarray(start), jnp.asarray(stop))
        return np.asarray(attend(jnp.asarray(q), jnp.zeros((2, 3), jnp.int32), LayerRule(True, None), (), (span,),
                                 impl="xla", block=8))

    outside = (np.arange(64) < start[:, None]) | (np.arange(64) >= stop[:, None])  # [b, T]
    where = np.broadcast_to(outside[:, None, :, None], k.shape)
    np.testing.assert_array_equal(run(np.where(where, garbage, k), np.where(where, garbage, v)), run(k, v))


def _kernel_twin(q, k, v, start, stop, *, keys_per_split, **_):
    """`span_partials`' contract (module docstring of `_span_attention_mgpu`) written out in jnp: the unnormalised
    partial softmax over `[start, stop)`, `m` -inf and `l` 0 where no key; the split length checked as the kernel
    requires it (a multiple of its 64-key step dividing the capacity)."""
    capacity, d_h = k.shape[2], q.shape[-1]
    assert keys_per_split % 64 == 0 and capacity % keys_per_split == 0, (capacity, keys_per_split)
    slots = jnp.arange(capacity)
    ok = ((slots >= start[:, None]) & (slots < stop[:, None]))[:, None, None, :]  # [b, 1, 1, T]
    s = jnp.where(ok, jnp.einsum("bhrd,bhtd->bhrt", q, k) * d_h**-0.5, -jnp.inf)
    m = s.max(-1)  # [b, n_kv, rows]
    p = jnp.where(ok, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)[..., None]), 0.0)
    return jnp.einsum("bhrt,bhtd->bhrd", p, v), m, p.sum(-1)


@pytest.mark.parametrize("n_h,n_kv", [(4, 2), (8, 2), (4, 4)])
def test_the_kernel_path_splits_and_merges_like_one_softmax(monkeypatch, n_h, n_kv):
    """`attend(impl="pallas")` on a CPU with the kernel replaced by a jnp twin of its contract: the wrapper's GQA
    rows (query heads x block tokens per KV head), split length and merge with dense rows give one softmax over
    every key (ragged spans, one empty, one the whole cache; the Mosaic kernel itself: the interpreter test above
    and the GPU test below)."""
    from dflash_jax import _span_attention_mgpu

    monkeypatch.setattr(_span_attention_mgpu, "span_partials", _kernel_twin)
    rng = np.random.default_rng(n_h + n_kv)
    batch, T, Sq, rule = 3, 256, 3, LayerRule(True, None)
    q, k, v = _inputs(rng, batch, Sq, n_h, n_kv, T + Sq)
    start, stop = np.array([5, 0, 40]), np.array([200, 256, 40])  # the last: empty
    q_pos = stop[:, None] + np.arange(Sq)
    new_ok = np.ones((batch, Sq), bool)
    span = Span(jnp.asarray(k[:, :, :T]), jnp.asarray(v[:, :, :T]), jnp.asarray(start), jnp.asarray(stop))
    fresh = KeyValues(jnp.asarray(k[:, :, T:]), jnp.asarray(v[:, :, T:]), jnp.asarray(q_pos), jnp.asarray(new_ok))
    got = jax.jit(lambda *a: attend(*a, impl="pallas"), static_argnums=2)(  # one program, traced with the twin
        jnp.asarray(q), jnp.asarray(q_pos), rule, (fresh,), (span,))
    in_span = (np.arange(T) >= start[:, None]) & (np.arange(T) < stop[:, None])
    mask = np.concatenate([np.broadcast_to(in_span[:, None, :], (batch, Sq, T)),
                           new_ok[:, None, :] & rule_mask(q_pos, q_pos, rule)], axis=2)
    np.testing.assert_allclose(np.asarray(got), naive(q, k, v, mask), rtol=2e-5, atol=2e-5)


def test_bfloat16_stays_close_to_float32():
    rng = np.random.default_rng(3)
    q, k, v = _inputs(rng, 1, 4, 8, 2, 300)
    span = lambda dt: Span(jnp.asarray(k, dt), jnp.asarray(v, dt), jnp.asarray([0]), jnp.asarray([300]))  # noqa
    f32 = attend(jnp.asarray(q), jnp.zeros((1, 4), jnp.int32), LayerRule(True, None), (), (span(jnp.float32),))
    b16 = attend(jnp.asarray(q, jnp.bfloat16), jnp.zeros((1, 4), jnp.int32), LayerRule(True, None), (),
                 (span(jnp.bfloat16),))
    chex.assert_type(b16, jnp.bfloat16)
    np.testing.assert_allclose(np.asarray(b16, np.float32), np.asarray(f32), atol=0.05)


@pytest.mark.skipif(not hasattr(plgpu, "InterpretGPUParams"), reason="JAX's GPU interpreter runs it from jax 0.11")
def test_mosaic_kernel_in_the_gpu_interpreter():
    """The Mosaic GPU span kernel itself, run by JAX's GPU interpreter on the CPU, against the float64 softmax:
    ragged spans (one not block-aligned at either end, one empty, one the whole cache) over two splits of 128
    keys, 8 query rows per KV head padded to the kernel's 64, bf16 operands."""
    from dflash_jax._span_attention_mgpu import span_partials

    rng = np.random.default_rng(11)
    batch, n_kv, rows, T, d = 3, 2, 8, 256, 64
    q, k, v = _inputs(rng, batch, rows, n_kv, n_kv, T, d)
    q, k, v = (np.asarray(jnp.asarray(a, jnp.bfloat16), np.float32) for a in (q, k, v))  # what the kernel reads
    start, stop = np.array([3, 100, 0]), np.array([200, 100, 256])
    q4 = q.transpose(0, 2, 1, 3)  # [batch, n_kv, rows, d]: one query head per KV head here
    acc, m, l = span_partials(*(jnp.asarray(a, jnp.bfloat16) for a in (q4, k, v)), jnp.asarray(start),
                              jnp.asarray(stop), keys_per_split=128, block_k=FALLBACK.span_block_k,
                              stages=FALLBACK.span_stages, interpret=plgpu.InterpretGPUParams())
    chex.assert_shape(acc, (batch, n_kv, rows, d))
    out = np.asarray(acc) / np.where(np.asarray(l) > 0, np.asarray(l), 1)[..., None]
    slots = np.arange(T)
    mask = np.broadcast_to(((slots >= start[:, None]) & (slots < stop[:, None]))[:, None], (batch, rows, T))
    expected = naive(q, k, v, mask).transpose(0, 2, 1, 3)  # [batch, n_kv, rows, d]
    # P and each split's output in bf16 (as in the former Triton kernel): measured max error 8.1e-3 at |x| = 2.2,
    # 3.6e-3 relative; bf16's half ulp is 3.9e-3 relative
    np.testing.assert_allclose(out, expected, rtol=5e-3, atol=2e-3)
    assert np.all(np.asarray(m)[1] == -np.inf) and np.all(np.asarray(l)[1] == 0) and np.all(out[1] == 0)
    assert np.all(np.isfinite(np.asarray(m)[[0, 2]]))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("Sq,n_h,n_kv,d", [(1, 32, 8, 128), (16, 32, 8, 128), (16, 32, 4, 128), (8, 8, 8, 128),
                                           (17, 32, 8, 128), (4, 16, 2, 256), (17, 16, 2, 256), (32, 16, 2, 256),
                                           (16, 8, 8, 64)])
def test_gpu_kernel_equals_the_xla_path(Sq, n_h, n_kv, d):
    """The split-K Mosaic GPU kernel over ragged spans (one empty) equals the blocked XLA loop, bf16 operands; up to
    256 query rows per KV head (`_PALLAS_MAX_ROWS`: 136 is the 35B-A3B's 17-token verify), head sizes 64, 128, 256."""
    rng = np.random.default_rng(Sq)
    T = 4096
    q, k, v = (jnp.asarray(a, jnp.bfloat16) for a in _inputs(rng, 3, Sq, n_h, n_kv, T, d))
    span = Span(k, v, jnp.asarray([0, 100, 7]), jnp.asarray([4096, 3000, 7]))
    q_pos = jnp.zeros((3, Sq), jnp.int32)
    ref = attend(q, q_pos, LayerRule(True, None), (), (span,), impl="xla")
    got = attend(q, q_pos, LayerRule(True, None), (), (span,), impl="pallas")
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32), atol=2e-2, rtol=2e-2)
    assert np.all(np.asarray(got[2], np.float32) == 0)  # an empty span: no keys, zeros

"""`propose` with its context cache against the uncached forward, and the samplers against the NumPy reference."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dflash_jax.attention import SPAN_ALIGN, _splits, span_capacity, split_keys
from dflash_jax.config import parse_config
from dflash_jax.drafting import _propose, init_cache, propose, sample_drafts
from dflash_jax.model import AttentionOptions, attention_rules, draft_hidden
from dflash_jax.platform import process_platform
from dflash_jax.testing import preset_dict, random_drafter

from . import _numpy_reference as ref
from ._drafters import block, features, tiny_drafter
from ._pallas import needs_gpu

FAMILIES = ["tiny-dflash", "tiny-dflash2", "tiny-dspark"]
# (num_new per sequence) for three steps of a batch of 2: different lengths, an idle sequence (0 new rows);
# the lengths (5, 9), (9, 9), (13, 13) keep the uncached comparisons to three compiled shapes
STEPS = [(5, 9), (4, 0), (4, 4)]
PAD = 9  # new context rows are padded to this many, so every step runs the same compiled program
sample = jax.jit(sample_drafts)

RING_SPANS_MIN_BATCH = process_platform().tuning.ring_spans_min_batch  # this process's (the fallback on a CPU)


def _uncached(drafter, feats, length, anchor, attention=AttentionOptions()):
    """(final hidden of the draft rows, greedy proposal) of one sequence from its whole context, no cache."""
    c = drafter.config
    B, n = c.effective_block_size, c.num_draft_tokens
    hidden = draft_hidden(
        drafter, feats[None, :length], block(drafter, [anchor]),
        context_positions=np.arange(length)[None], block_positions=(length + np.arange(B))[None],
        attention=attention,
    )[:, B - n:]
    return hidden, sample(drafter, hidden, jnp.asarray([anchor]))


@pytest.mark.parametrize("preset", FAMILIES)
def test_cached_propose_matches_uncached(preset):
    """Over several steps, batch 2 with different lengths, sequence 0 sampled at T = 0.8 and sequence 1 greedy:
    the same drafts and the same draft distributions q as `sample_drafts` with the same key on the uncached
    forward's hidden states (measured 4.5e-6 on q, 6e-7 on DSpark's confidences). A second cache that first takes
    rows it then rejects (`trim` back to the old lengths) gives the same drafts: rejection leaves no trace."""
    drafter = tiny_drafter(preset)
    feats = features(drafter, 2, sum(n for n, _ in STEPS) + PAD, seed=1)
    garbage = features(drafter, 2, PAD, seed=2)
    rng = np.random.default_rng(3)
    exact, rewound = init_cache(drafter, 2, 32), init_cache(drafter, 2, 32)
    lengths = np.zeros(2, int)
    temperature = jnp.asarray([0.8, 0.0])
    programs = _propose._cache_size()  # the jitted step behind `propose`
    for step, num_new in enumerate(map(np.array, STEPS)):
        new = garbage.copy()  # rows past num_new are padding: never seen, never kept
        for b in range(2):
            new[b, : num_new[b]] = feats[b, lengths[b] : lengths[b] + num_new[b]]
        anchors = rng.integers(0, drafter.config.vocab_size, 2).astype(np.int32)
        drawn = dict(key=jax.random.key(step), temperature=temperature)
        got, exact = propose(drafter, exact, new, num_new, anchors, **drawn)
        _, rewound = propose(drafter, rewound, garbage, np.full(2, PAD), anchors, **drawn)  # rows then rejected
        also, rewound = propose(drafter, rewound.trim(lengths), new, num_new, anchors, **drawn)
        lengths += num_new
        np.testing.assert_array_equal(np.asarray(exact.lengths), lengths)
        np.testing.assert_array_equal(np.asarray(also.tokens), np.asarray(got.tokens))
        uncached = [_uncached(drafter, feats[b], lengths[b], anchors[b]) for b in range(2)]
        want = sample(drafter, jnp.concatenate([h for h, _ in uncached]), jnp.asarray(anchors), **drawn)
        np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
        np.testing.assert_array_equal(np.asarray(got.tokens[1]), np.asarray(uncached[1][1].tokens[0]))  # greedy
        np.testing.assert_allclose(np.asarray(got.probs), np.asarray(want.probs), rtol=0, atol=1.5e-5)
        if want.confidence is not None:
            np.testing.assert_allclose(np.asarray(got.confidence), np.asarray(want.confidence), rtol=0, atol=2e-6)
    assert len(set(np.asarray(got.tokens).ravel().tolist())) > 2, "degenerate drafts prove little"
    assert _propose._cache_size() - programs <= 1, "every step, first and rewound ones included, is one program"


def test_dspark_markov_and_confidence_match_reference():
    """Sequential Markov-biased argmax from prev_0 = anchor, and the confidence head, vs NumPy."""
    drafter = tiny_drafter("tiny-dspark")
    hidden, proposal = _uncached(drafter, features(drafter, 1, 5, seed=1)[0], 5, anchor=11)
    params, h = ref.to_numpy(drafter.params), np.asarray(hidden[0], np.float64)
    base = ref.unary_logits(preset_dict("tiny-dspark"), h, ref.to_numpy(drafter.lm_head))
    tokens = ref.markov_greedy(params, base, 11)
    np.testing.assert_array_equal(np.asarray(proposal.tokens[0]), tokens)
    assert (tokens != base.argmax(-1)).any(), "the Markov bias should change some drafts"
    np.testing.assert_allclose(np.asarray(proposal.confidence[0]), ref.confidence(params, h, 11, tokens), atol=1e-6)


def test_dspark_confidence_cut():
    """The proposal ends before the first row whose confidence is below the threshold (0: no cut)."""
    drafter = tiny_drafter("tiny-dspark")
    hidden, proposal = _uncached(drafter, features(drafter, 1, 5, seed=1)[0], 5, anchor=11)
    conf = np.asarray(proposal.confidence[0])
    n = drafter.config.num_draft_tokens
    assert int(proposal.num_tokens[0]) == n
    for threshold in (0.0, 1.0, *np.sort(conf)[[1, 3]] + 1e-6):
        below = np.flatnonzero(conf < threshold)
        cut = sample(drafter, hidden, jnp.asarray([11]), confidence_threshold=threshold)
        assert int(cut.num_tokens[0]) == (below[0] if below.size else n)


def test_dflash2_selector_matches_reference():
    """Top-K candidates of the softcapped, scaled unary logits, walked with the bilinear transition score."""
    drafter = tiny_drafter("tiny-dflash2")
    hidden, proposal = _uncached(drafter, features(drafter, 1, 9, seed=1)[0], 9, anchor=11)
    h = np.asarray(hidden[0], np.float64)
    raw = preset_dict("tiny-dflash2")  # config.json as written
    unary = ref.unary_logits(raw, h, ref.to_numpy(drafter.lm_head))
    tokens = ref.selector_greedy(ref.to_numpy(drafter.params), raw, h, unary, 11)
    np.testing.assert_array_equal(np.asarray(proposal.tokens[0]), tokens)
    assert (tokens != unary.argmax(-1)).any(), "the transition scores should change some drafts"


@pytest.mark.parametrize("preset", FAMILIES)
def test_sampling_returns_the_proposal_distribution(preset):
    """With a key: q rows are distributions, each draft has q > 0; T = 0 sequences stay greedy with one-hot q;
    plain DFlash q = softmax(logits / T), DSpark q = softmax((logits + Markov bias of the sampled prev) / T),
    DFlash2 q lives on the top-K candidates."""
    drafter = tiny_drafter(preset)
    c = drafter.config
    hidden, greedy = _uncached(drafter, features(drafter, 1, 5, seed=1)[0], 5, anchor=11)
    hidden = jnp.concatenate([hidden, hidden])  # sequence 0 sampled at T = 0.7, sequence 1 greedy
    drawn = sample(drafter, hidden, jnp.asarray([11, 11]), key=jax.random.key(0), temperature=jnp.asarray([0.7, 0.0]))
    tokens, q = np.asarray(drawn.tokens), np.asarray(drawn.probs)
    assert q.shape == (2, c.num_draft_tokens, c.vocab_size)
    np.testing.assert_allclose(q.sum(-1), 1.0, atol=1e-5)
    assert (np.take_along_axis(q, tokens[..., None], -1) > 0).all()
    np.testing.assert_array_equal(tokens[1], np.asarray(greedy.tokens[0]))
    np.testing.assert_array_equal(q[1], np.eye(c.vocab_size)[tokens[1]])

    h = np.asarray(hidden[0], np.float64)
    logits = ref.unary_logits(preset_dict(preset), h, ref.to_numpy(drafter.lm_head))
    if preset == "tiny-dspark":
        expected = ref.markov_distributions(ref.to_numpy(drafter.params), logits, 11, tokens[0], 0.7)
        np.testing.assert_allclose(q[0], expected, atol=1e-5)
    elif preset == "tiny-dflash2":
        top_k = np.argsort(-logits, axis=-1)[:, : c.dflash_config.selector_top_k]
        support = q[0] > 0
        assert support.sum(-1).max() <= top_k.shape[1]
        assert all(set(np.flatnonzero(s)) <= set(t) for s, t in zip(support, top_k))
    else:
        e = np.exp(logits / 0.7 - (logits / 0.7).max(-1, keepdims=True))
        np.testing.assert_allclose(q[0], e / e.sum(-1, keepdims=True), atol=1e-5)


def test_samples_follow_q():
    """Empirically, over many keys, the first draft of a plain DFlash proposal is distributed as its q row."""
    drafter = tiny_drafter("tiny-dflash")
    hidden, _ = _uncached(drafter, features(drafter, 1, 5, seed=1)[0], 5, anchor=11)
    draw = jax.jit(jax.vmap(lambda k: sample_drafts(drafter, hidden, jnp.asarray([11]), key=k, temperature=2.0)))
    drawn = draw(jax.random.split(jax.random.key(1), 4000))
    counts = np.bincount(np.asarray(drawn.tokens[:, 0, 0]), minlength=drafter.config.vocab_size)
    q = np.asarray(drawn.probs[0, 0, 0])
    assert 0.5 * np.abs(counts / counts.sum() - q).sum() < 0.06  # total variation, ~0.03 expected at n = 4000


def test_reduced_draft_vocabulary_maps_through_d2t():
    """A drafter with its own reduced LM head and d2t: drafts and q come out in target ids."""
    drafter = tiny_drafter("tiny-dflash", draft_vocab_size=48)
    d2t = np.asarray(drafter.params["d2t"])
    assert drafter.params["lm_head"]["weight"].shape[0] == 48
    hidden, greedy = _uncached(drafter, features(drafter, 1, 5, seed=1)[0], 5, anchor=11)
    draft_ids = np.asarray(jnp.argmax(hidden[0] @ drafter.params["lm_head"]["weight"].T, -1))
    np.testing.assert_array_equal(np.asarray(greedy.tokens[0]), draft_ids + d2t[draft_ids])
    drawn = sample(drafter, hidden, jnp.asarray([11]), key=jax.random.key(0), temperature=1.0)
    q = np.asarray(drawn.probs[0])
    assert q.shape[-1] == drafter.config.vocab_size
    assert set(np.flatnonzero(q.sum(0))) <= set(np.arange(48) + d2t)
    np.testing.assert_allclose(q.sum(-1), 1.0, atol=1e-5)


def test_a_reduced_vocabulary_with_a_selector_is_refused():
    """The selector's walk needs the anchor in draft ids (a t2d map no checkpoint ships): NotImplementedError naming
    d2t, raised when the step is traced, greedy or sampled. (A Markov head over a reduced vocabulary runs:
    tests/test_layouts_speculators.py.)"""
    drafter = tiny_drafter("tiny-dflash2", draft_vocab_size=48)
    assert "d2t" in drafter.params
    hidden = jnp.zeros((1, drafter.config.num_draft_tokens, drafter.config.hidden_size))
    for options in ({}, dict(key=jax.random.key(0), temperature=1.0)):
        with pytest.raises(NotImplementedError, match=r"reduced draft vocabulary \(d2t\)"):
            sample_drafts(drafter, hidden, jnp.asarray([11]), **options)


def test_propose_on_a_mesh(cpu_mesh):
    """Params replicated under jit with the inputs replicated too (`cpu_mesh`), and with the batch split over
    the devices (a mesh of Auto axes): the same drafts, and the cache comes back batch-sharded."""
    drafter = tiny_drafter("tiny-dflash")
    n = len(jax.devices())
    new, num_new, anchors = features(drafter, n, PAD, seed=4), np.arange(n) % PAD + 1, np.arange(n, dtype=np.int32)
    auto = jax.make_mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    runs = []
    for mesh, batch in ((cpu_mesh, P()), (auto, P("data"))):
        put = functools.partial(jax.device_put, device=NamedSharding(mesh, batch))
        replicated = jax.device_put(drafter, NamedSharding(mesh, P()))
        got, cache = propose(replicated, jax.tree.map(put, init_cache(drafter, n, 32)), put(new), put(num_new),
                             put(anchors))
        np.testing.assert_array_equal(np.asarray(cache.lengths), num_new)
        assert cache.keys[0].sharding.is_fully_replicated == (batch == P() or n == 1)
        runs.append(np.asarray(got.tokens))
    np.testing.assert_array_equal(runs[0], runs[1])


# (num_new per sequence) after a first step of a long prompt: the context grows to 6x the tiny DFlash2 window
LONG_STEPS = [(40, 33), (3, 5), (8, 1), (5, 8), (2, 4), (6, 3)]


@pytest.mark.parametrize("attention, spans", [(AttentionOptions(), False),
                                              (AttentionOptions(draft_window=6, draft_sinks=2), False),
                                              (AttentionOptions(draft_window=5), True)],
                         ids=["trained", "window+sinks", "window, roomy ring spans"])
def test_ring_buffers_and_chunked_appends_give_the_uncached_drafts(attention, spans):
    """Past the window: tiny DFlash2 (a sliding layer of window 8, a ring of 16 rows; a full layer) after a
    40-row first step appended in chunks of 16, then steps until the ring wrapped ~4 times. Every step's drafts
    equal the uncached forward over the whole context with the same rule, for the trained rule and for the
    opt-in draft window on the full layer (with sinks: a span and a masked edge; without: a ring). Rings are
    scored whole, or (`ring_spans`, as from 8 sequences on) read as the slot ranges the window covers (two where
    it wraps) and a masked edge, here with rings of 21 rows, more than the windows need (as long rings are,
    rounded up for the GPU kernel)."""
    drafter = tiny_drafter("tiny-dflash2")
    total = np.sum(LONG_STEPS, axis=0)
    feats = features(drafter, 2, int(total.max()) + 40, seed=4)
    rng = np.random.default_rng(5)
    cache = init_cache(drafter, 2, 128, attention=attention)
    assert not cache.ring_spans and init_cache(drafter, RING_SPANS_MIN_BATCH, 128).ring_spans
    cache = dataclasses.replace(cache, ring_spans=spans)
    if spans:
        wider = [jnp.zeros((*a.shape[:2], 21, a.shape[3]), a.dtype) if ring else a
                 for a, ring in zip(cache.keys, cache.rings)]
        cache = dataclasses.replace(cache, keys=tuple(wider), values=tuple(jnp.zeros_like(a) for a in wider))
    if not attention.draft_sinks:
        assert all(k.shape[2] <= (21 if spans else 16) for k in cache.keys[:1]) and cache.rings[0]
    assert cache.rings[1] == (attention.draft_window is not None and not attention.draft_sinks)
    lengths = np.zeros(2, int)
    for step, num_new in enumerate(map(np.array, LONG_STEPS)):
        width = 40 if step == 0 else 9
        new = np.zeros((2, width, feats.shape[-1]), np.float32)
        for b in range(2):
            new[b, : num_new[b]] = feats[b, lengths[b] : lengths[b] + num_new[b]]
        anchors = rng.integers(0, drafter.config.vocab_size, 2).astype(np.int32)
        got, cache = propose(drafter, cache, new, num_new, anchors, append_chunk=16, attention=attention)
        lengths += num_new
        if step == len(LONG_STEPS) - 1:  # the whole history counts: every earlier append is in these drafts
            for b in range(2):
                _, want = _uncached(drafter, feats[b], lengths[b], anchors[b], attention)
                np.testing.assert_array_equal(np.asarray(got.tokens[b]), np.asarray(want.tokens[0]))
    np.testing.assert_array_equal(np.asarray(cache.lengths), lengths)
    assert not np.asarray(cache.overflow).any()


@pytest.mark.gpu
@needs_gpu
def test_gpu_kernel_reads_rings_as_the_xla_path_does():
    """bf16 tiny DFlash2 with a 200-token window and a full layer, a batch of `RING_SPANS_MIN_BATCH` (so the ring is
    read as spans by the GPU kernel, 512 rows), 900 context rows (the ring wrapped): the drafting distribution q
    equals the blocked XLA path's."""
    raw = preset_dict("tiny-dflash2") | {"sliding_window": 200}
    drafter = random_drafter(raw, seed=3, dtype=jnp.bfloat16)
    c, batch = drafter.config, RING_SPANS_MIN_BATCH
    cache = init_cache(drafter, batch, 1024)
    assert cache.rings[0] and cache.ring_spans and cache.keys[0].shape[2] == span_capacity(200 + c.effective_block_size)
    rng = np.random.default_rng(0)
    for seed in range(3):
        new = jnp.asarray(features(drafter, batch, 310, seed=seed), jnp.bfloat16)
        _, cache = propose(drafter, cache, new, rng.integers(290, 311, batch), np.arange(batch, dtype=np.int32))
    new = jnp.asarray(features(drafter, batch, 9, seed=9), jnp.bfloat16)
    num_new, anchors = rng.integers(1, 10, batch), np.arange(batch, dtype=np.int32) + 5
    runs = [propose(drafter, jax.tree.map(jnp.copy, cache), new, num_new, anchors, key=jax.random.key(0),
                    temperature=1.0, impl=impl)[0] for impl in ("auto", "xla")]
    np.testing.assert_allclose(np.asarray(runs[0].probs), np.asarray(runs[1].probs), atol=2e-2)


def test_the_draft_window_is_the_numpy_rule():
    """The uncached forward under `draft_window` / `draft_sinks` equals the NumPy reference's masks."""
    drafter = tiny_drafter("tiny-dflash")
    c = drafter.config
    feats = features(drafter, 1, 30, seed=6)[0]
    B = c.effective_block_size
    hidden = draft_hidden(drafter, feats[None], block(drafter, [3]), context_positions=np.arange(30)[None],
                          block_positions=(30 + np.arange(B))[None],
                          attention=AttentionOptions(draft_window=7, draft_sinks=3))
    rules = ref.layer_rules(preset_dict("tiny-dflash"), draft_window=7, draft_sinks=3)
    want = ref.hidden_states(ref.to_numpy(drafter.params), preset_dict("tiny-dflash"), feats.astype(np.float64),
                             np.asarray(block(drafter, [3]))[0], np.arange(30), 30 + np.arange(B),
                             np.asarray(drafter.embedding, np.float64), rules)
    np.testing.assert_allclose(np.asarray(hidden[0]), want, rtol=0, atol=2e-4)
    full = draft_hidden(drafter, feats[None], block(drafter, [3]), context_positions=np.arange(30)[None],
                        block_positions=(30 + np.arange(B))[None])
    assert not np.allclose(np.asarray(full), np.asarray(hidden), atol=1e-3)  # the window changed something


def test_overflow_is_flagged_never_clamped():
    """Rows past `max_context` are dropped and the sequence flagged; `check` raises; lengths keep counting. The
    cache is donated to `propose` (every array of it) and its static fields come back as they went in."""
    drafter = tiny_drafter("tiny-dflash")
    cache = init_cache(drafter, 2, 12)
    new = features(drafter, 2, 9, seed=7)
    first = cache
    _, cache = propose(drafter, cache, new, np.array([9, 2]), np.zeros(2, np.int32))
    assert all(a.is_deleted() for a in jax.tree.leaves(first))  # the whole cache was donated
    assert (cache.max_context, cache.rings, cache.attention) == (12, first.rings, AttentionOptions())  # static
    cache.check()
    _, cache = propose(drafter, cache, new, np.array([9, 2]), np.zeros(2, np.int32))
    np.testing.assert_array_equal(np.asarray(cache.lengths), [18, 4])
    np.testing.assert_array_equal(np.asarray(cache.overflow), [True, False])
    with pytest.raises(ValueError, match=r"sequences \[0\] outgrew max_context=12"):
        cache.check()
    with pytest.raises(ValueError, match="attention options"):
        propose(drafter, init_cache(drafter, 2, 12), new, np.array([9, 2]), np.zeros(2, np.int32),
                attention=AttentionOptions(draft_window=4))


@pytest.mark.parametrize("fields, bad", [(dict(draft_window=0), "draft_window"), (dict(draft_sinks=-1), "draft_sinks"),
                                         (dict(draft_sinks=2), "draft_sinks"), (dict(causal=1), "causal"),
                                         (dict(sliding_window=None), "sliding_window"),
                                         (dict(draft_window=True), "draft_window")], ids=str)
def test_attention_options_are_checked_once_made(fields, bad):
    """A bad switch is a ValueError naming the field, raised where the options are made (no entry point sees it)."""
    with pytest.raises(ValueError, match=rf"AttentionOptions\.{bad}\b"):
        AttentionOptions(**fields)


def test_attention_options_take_numpy_integers_as_ints():
    """A NumPy integer window is stored as a Python int: equal and hashing alike, so one compiled program."""
    options = AttentionOptions(draft_window=np.int64(8), draft_sinks=np.int32(2))
    assert options == AttentionOptions(draft_window=8, draft_sinks=2) and type(options.draft_window) is int
    assert hash(options) == hash(AttentionOptions(draft_window=8, draft_sinks=2))


def test_long_rings_are_aligned_for_the_gpu():
    """A ring of more than `SPAN_ALIGN` rows is rounded up: to a multiple of it when scored whole (XLA padded an
    unaligned 4112-row ring for its GPU GEMMs every step), by `span_capacity` when read as spans. Shorter rings
    keep window + block rows; a short `max_context` caps a ring before it is rounded."""
    raw, drafter = preset_dict("tiny-dflash2"), tiny_drafter("tiny-dflash2")
    with_window = lambda w: dataclasses.replace(drafter, config=parse_config(raw | {"sliding_window": w}))  # noqa: E731
    block = drafter.config.effective_block_size
    aligned = lambda rows: -(-rows // SPAN_ALIGN) * SPAN_ALIGN  # noqa: E731
    for window, batch, max_context in ((8, 2, 1024), (200, 2, 1024), (200, RING_SPANS_MIN_BATCH, 1024),
                                       (240, 1, 1024), (200, 2, 150)):
        cache = init_cache(with_window(window), batch, max_context)
        needed = min(window + block, max_context)  # the window and a block, or the whole context if shorter
        rows = needed if needed <= SPAN_ALIGN else span_capacity(needed) if cache.ring_spans else aligned(needed)
        assert cache.ring_spans == (batch >= RING_SPANS_MIN_BATCH)
        assert cache.rings[0] and cache.keys[0].shape[2] == rows and cache.values[0].shape == cache.keys[0].shape


@pytest.mark.parametrize("append_chunk", [2048, 32], ids=["one append", "chunked"])
def test_a_full_context_still_holds_the_block(append_chunk):
    """Contexts of exactly `max_context` = `SPAN_ALIGN` rows: a full layer whose queries see every key reads the cache
    with the step's rows written into it, the block after the context, so the cache has room for a block past
    `max_context`. The drafts equal the uncached forward's, and no sequence is flagged."""
    drafter = tiny_drafter("tiny-dflash")
    assert not any(r.causal or r.window for r in attention_rules(drafter.config))
    feats = features(drafter, 2, 128, seed=8)
    cache = init_cache(drafter, 2, 128)
    assert cache.keys[0].shape[2] == span_capacity(128 + drafter.config.effective_block_size)
    lengths, anchors = np.zeros(2, int), np.array([5, 9], np.int32)
    for num_new in (np.array([60, 68]), np.array([68, 60])):
        new = np.zeros((2, 68, feats.shape[-1]), np.float32)
        for b in range(2):
            new[b, : num_new[b]] = feats[b, lengths[b] : lengths[b] + num_new[b]]
        got, cache = propose(drafter, cache, new, num_new, anchors, append_chunk=append_chunk)
        lengths += num_new
    np.testing.assert_array_equal(np.asarray(cache.lengths), [128, 128])
    cache.check()
    for b in range(2):
        _, want = _uncached(drafter, feats[b], 128, anchors[b])
        np.testing.assert_array_equal(np.asarray(got.tokens[b]), np.asarray(want.tokens[0]))


def test_full_layers_are_aligned_for_the_gpu_kernel():
    """Full layers hold `max_context` plus a block rounded up to `SPAN_ALIGN` rows (the GPU kernel reads only aligned
    caches: an unaligned one fell back to the XLA loop, 8x slower at 32k). Rows past `max_context` are not kept:
    only the last block's scratch rows follow the kept context, and the slots past them stay empty.
    Long caches are multiples of their split length, so the kernel reads them in splits of that many keys
    (128-slot alignment alone gave capacities of a prime number of blocks, and splits of 128 keys)."""
    drafter = tiny_drafter("tiny-dflash")
    cache = init_cache(drafter, 2, 20)
    assert all(k.shape[2] == SPAN_ALIGN for k in cache.keys) and not any(cache.rings)
    new = features(drafter, 2, 9, seed=7)
    for _ in range(3):
        _, cache = propose(drafter, cache, new, np.array([9, 2]), np.zeros(2, np.int32))
    np.testing.assert_array_equal(np.asarray(cache.overflow), [True, False])
    B, keys = drafter.config.effective_block_size, np.asarray(cache.keys[0])
    assert keys[0, :, : 20 + B].all() and not keys[0, :, 20 + B :].any()  # lengths 27: 20 kept, then the block
    assert keys[1, :, : 6 + B].all() and not keys[1, :, 6 + B :].any()  # lengths 6
    for rows in (1, 128, 129, 1024, 1025, 2848, 8992, 16384, 16385, 33568, 65537, 131872):  # the benchmark's 2k..128k
        capacity = span_capacity(rows)
        longest = max(split_keys(capacity, tile) for tile in (16, 64, 128))
        # aligned, and rounded up by less than one of the kernel's longest splits
        assert capacity >= rows and capacity % SPAN_ALIGN == 0 and capacity - rows < max(longest, SPAN_ALIGN)
        for tile in (16, 64, 128):  # read in splits of exactly the tuned length (for more than one block)
            expected = split_keys(capacity, tile) if rows > SPAN_ALIGN else capacity
            assert capacity // _splits(capacity, tile) == expected, (rows, tile)


def test_init_cache_where_the_params_carry_a_two_axis_sharding(cpu_mesh):
    """Params committed with a spelled-out 2-d `P(None, None)` (as `nnx.jit` leaves them): the rank-1 lengths
    and the 4-d K/V take a spec of their own rank (a ValueError before)."""
    drafter = tiny_drafter("tiny-dflash")
    where = NamedSharding(cpu_mesh, P(None, None))
    params = jax.tree.map(lambda a: jax.device_put(a, where) if a.ndim == 2 else a, drafter.params)
    cache = init_cache(dataclasses.replace(drafter, params=params), 2, 16)
    assert cache.lengths.sharding.spec == P(None) and cache.keys[0].sharding.spec == P(None, None, None, None)

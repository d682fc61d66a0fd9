"""An independent NumPy reference of the DFlash-family drafter, written from the reference implementations
(z-lab/dflash `dflash/model.py`, SpecForge `specforge/modeling/draft/`, DeepSpec `deepspec/modeling/dspark/`,
vLLM `qwen3_dflash.py` / `qwen3_dflash2.py`; docs/references.md says which rule comes from where).

Float64 throughout, except the RoPE frequencies and angles, which are formed in float32 as transformers forms
them (spec §7), so that tight tolerances hold. One sequence at a time, heads and sequential walks as explicit
loops, attention over the concatenated [context, block] keys with an explicit mask: deliberately a different
formulation from `dflash_jax.model` (which batches, merges softmax parts and scans), so the two can only agree
by computing the same function.
"""

from __future__ import annotations

import math

import numpy as np


def to_numpy(tree):
    """A parameter tree (any leaves) as float64 NumPy (integer leaves keep their integer type)."""
    if isinstance(tree, dict):
        return {k: to_numpy(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [to_numpy(v) for v in tree]
    a = np.asarray(tree)
    return a if np.issubdtype(a.dtype, np.integer) else a.astype(np.float64)


def rms_norm(x, w, eps):
    return w * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def silu(x):
    return x / (1.0 + np.exp(-x))


def inv_freq(config) -> tuple[np.ndarray, float]:
    """RoPE inverse frequencies (float32) and the cos/sin scaling: plain RoPE, or YaRN (arXiv 2309.00071 as
    transformers implements it: ramp between interpolated and original frequencies over a correction range)."""
    d = config.head_dim
    base = np.float32(config.rope_theta) ** (np.arange(0, d, 2).astype(np.float32) / np.float32(d))
    plain = (np.float32(1.0) / base).astype(np.float32)
    scaling = config.rope_scaling
    if scaling is None or (scaling.rope_type or scaling.type) != "yarn":
        return plain, 1.0
    factor = scaling.factor
    original = scaling.original_max_position_embeddings or config.max_position_embeddings or 32768
    fast, slow = scaling.beta_fast or 32.0, scaling.beta_slow or 1.0
    # dimension index at which a frequency completes `n` rotations over the original context
    dim_of = lambda n: d * math.log(original / (2 * math.pi * n)) / (2 * math.log(config.rope_theta))  # noqa: E731
    lo, hi = max(math.floor(dim_of(fast)), 0), min(math.ceil(dim_of(slow)), d - 1)
    hi = hi + 0.001 if lo == hi else hi
    keep = np.float32(1.0) - np.clip((np.arange(d // 2, dtype=np.float32) - lo) / np.float32(hi - lo), 0, 1)
    freq = (plain / np.float32(factor)) * (np.float32(1.0) - keep) + plain * keep
    mscale = 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0
    return freq.astype(np.float32), mscale


def rope(x, positions, config):
    """x: [rows, heads, d]; rotate-half layout; angles in float32."""
    freq, scale = inv_freq(config)
    angles = positions.astype(np.float32)[:, None] * freq[None, :]  # float32
    angles = np.concatenate([angles, angles], axis=-1).astype(np.float64)
    cos, sin = np.cos(angles)[:, None, :] * scale, np.sin(angles)[:, None, :] * scale
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def grouped_conv(z, delta, base):
    """z: [B, H]; delta: [B, taps, G]; base: [taps, H]. Backward taps only, zero before the block."""
    rows, hidden = z.shape
    taps, groups = delta.shape[1:]
    group_of = np.arange(hidden) // (hidden // groups)
    out = np.zeros_like(z)
    for i in range(rows):
        for t in range(taps):
            if i - t >= 0:
                out[i] += (base[t] + delta[i, t, group_of]) * z[i - t]
    return out


def conv_pair(p, x):
    """(convolved input, output-side kernel) of one `attention_conv` / `mlp_conv`."""
    taps = p["base_kernel"].shape[1]
    delta = (x @ p["kernel_projection"]["weight"].T).reshape(x.shape[0], 2, taps, -1)
    return grouped_conv(x, delta[:, 0], p["base_kernel"][0]), delta[:, 1]


def layer_rules(config, causal=None, sliding_window=True):
    """[(causal, window | None)] per layer: vLLM's `_dflash_layer_causal` order (`is_causal`, then
    `dflash_config.causal`, then "sliding layer"), a window |q - k| <= w - 1 on sliding layers."""
    rules = []
    for i in range(config.num_hidden_layers):
        sliding = bool(config.layer_types) and config.layer_types[i] == "sliding_attention"
        c = causal
        if c is None:
            c = config.is_causal
        if c is None and config.dflash_config is not None:
            c = config.dflash_config.causal
        if c is None:
            c = sliding
        w = config.sliding_window if (sliding_window and sliding and config.use_sliding_window) else None
        rules.append((bool(c), w))
    return rules


def zlab_rules(config):
    """z-lab's transformers model (`dflash/model.py`): `is_causal=False` and no attention mask on every layer, and
    its eager / sdpa attention functions take `sliding_window` without applying it, so every key is visible."""
    return [(False, None)] * config.num_hidden_layers


def vllm_v1_rules(config):
    """vLLM's v1 proposer (`vllm/v1/spec_decode/dflash.py`): one causal flag for every layer, False as soon as
    `_dflash_layer_causal` makes any layer non-causal; windows stay per layer."""
    per_layer = layer_rules(config)
    causal = all(c for c, _ in per_layer)
    return [(causal, w) for _, w in per_layer]


def specforge_block_mask(anchor, seq_len, block_size, window=None):
    """SpecForge's training mask (`create_dflash_sdpa_mask`) for one block: `[B, seq_len + B]` bool.

    Keys 0..seq_len-1 are the sequence (context at its own position), then the block's B rows. Context is
    visible before the anchor; a sliding layer's query at block offset i sees context from anchor + i - (w - 1)
    on and block rows 0..i; a full layer sees the whole block.
    """
    offsets = np.arange(block_size)[:, None]  # [B, 1]: each query's offset in the block
    kv = np.broadcast_to(np.arange(seq_len + block_size), (block_size, seq_len + block_size))
    context = (kv < seq_len) & (kv < anchor)
    draft = kv >= seq_len
    if window is not None:
        context &= kv >= anchor + offsets - (window - 1)
        draft &= (kv - seq_len) <= offsets
    return context | draft


def allowed(query_positions, key_positions, causal, window, sinks=0):
    """`[Sq, Sk]` bool: which keys each query may attend to under one layer's (causal, window) rule; with a
    window, the first `sinks` positions stay visible (the opt-in draft window of full layers)."""
    delta = query_positions[:, None] - key_positions[None, :]
    ok = np.ones(delta.shape, bool)
    if causal:
        ok &= delta >= 0
    if window is not None:
        ok &= (np.abs(delta) <= window - 1) | (key_positions[None, :] < sinks)
    return ok


def hidden_states(params, config, target_hidden, block_ids, ctx_pos, blk_pos, embed, rules):
    """One sequence: target_hidden [S, Lf*H], block_ids [B] -> final-normed hidden [B, H]."""
    eps = config.rms_norm_eps
    n_h, n_kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    group = n_h // n_kv
    ctx = rms_norm(target_hidden @ params["fc"]["weight"].T, params["hidden_norm"]["weight"], eps)
    x = embed[block_ids].astype(np.float64)
    if config.input_embedding_scale is not None:
        x = x * config.input_embedding_scale
    B, S = len(block_ids), len(ctx_pos)
    key_pos = np.concatenate([ctx_pos, blk_pos])

    def proj(p, name, rows):
        y = rows @ p[name]["weight"].T
        return y + p[name]["bias"] if "bias" in p[name] else y

    for lp, (causal, window, *sinks) in zip(params["layers"], rules):  # sinks: with a draft window
        a = lp["self_attn"]
        xn = rms_norm(x, lp["input_layernorm"]["weight"], eps)
        if "attention_conv" in lp:
            xn, attn_kernel = conv_pair(lp["attention_conv"], xn)
        q = rms_norm(proj(a, "q_proj", xn).reshape(B, n_h, d), a["q_norm"]["weight"], eps)
        q = rope(q, blk_pos, config)
        both = np.concatenate([ctx, xn], axis=0)  # context then block, as the reference concatenates
        k = rms_norm(proj(a, "k_proj", both).reshape(S + B, n_kv, d), a["k_norm"]["weight"], eps)
        k = rope(k, key_pos, config)
        v = proj(a, "v_proj", both).reshape(S + B, n_kv, d)
        visible = allowed(blk_pos, key_pos, causal, window, *sinks)
        out = np.zeros((B, n_h, d))
        for h in range(n_h):
            kv = h // group
            scores = (q[:, h] @ k[:, kv].T) / math.sqrt(d)
            scores = np.where(visible, scores, -np.inf)
            probs = np.exp(scores - scores.max(axis=1, keepdims=True))
            probs /= probs.sum(axis=1, keepdims=True)
            out[:, h] = probs @ v[:, kv]
        o = proj(a, "o_proj", out.reshape(B, n_h * d))
        if "attention_conv" in lp:
            o = grouped_conv(o, attn_kernel, lp["attention_conv"]["base_kernel"][1])
        x = x + o
        m = rms_norm(x, lp["post_attention_layernorm"]["weight"], eps)
        if "mlp_conv" in lp:
            m, mlp_kernel = conv_pair(lp["mlp_conv"], m)
        mlp = lp["mlp"]
        m = (silu(m @ mlp["gate_proj"]["weight"].T) * (m @ mlp["up_proj"]["weight"].T)) @ mlp["down_proj"]["weight"].T
        if "mlp_conv" in lp:
            m = grouped_conv(m, mlp_kernel, lp["mlp_conv"]["base_kernel"][1])
        x = x + m
    return rms_norm(x, params["norm"]["weight"], eps)


def unary_logits(config, hidden, lm_head):
    """`lm_head(h)`; for DFlash2, `softcap(. * output_multiplier)` with the values of `dflash_config` (SpecForge
    `dflash2.py` `transform_unary_logits`, vLLM `qwen3_dflash2.py`), identity for the ones it does not set."""
    z = hidden @ lm_head.T
    sub = config.dflash_config
    if config.family != "dflash2" or sub is None:
        return z
    if sub.output_multiplier is not None:
        z = z * sub.output_multiplier
    if sub.final_logit_softcapping is not None:
        z = sub.final_logit_softcapping * np.tanh(z / sub.final_logit_softcapping)
    return z


def markov_greedy(params, base_logits, anchor):
    """DSpark: tokens[k] = argmax(base[k] + w2 @ w1[prev]), prev = anchor then the previous draft."""
    w1, w2 = params["markov_head"]["markov_w1"]["weight"], params["markov_head"]["markov_w2"]["weight"]
    tokens, prev = [], anchor
    for row in base_logits:
        prev = int(np.argmax(row + w2 @ w1[prev]))
        tokens.append(prev)
    return np.array(tokens)


def markov_distributions(params, base_logits, anchor, tokens, temperature):
    """The q rows of a sampled DSpark walk: softmax((base[k] + w2 @ w1[prev_k]) / T), prev given by `tokens`."""
    w1, w2 = params["markov_head"]["markov_w1"]["weight"], params["markov_head"]["markov_w2"]["weight"]
    prevs = [anchor, *tokens[:-1]]
    rows = []
    for row, prev in zip(base_logits, prevs):
        z = (row + w2 @ w1[prev]) / temperature
        e = np.exp(z - z.max())
        rows.append(e / e.sum())
    return np.array(rows)


def confidence(params, hidden, anchor, tokens):
    """sigmoid(proj([h_k ; markov_w1[prev_k]])) per draft row (h only when the head is that narrow)."""
    w, b = params["confidence_head"]["proj"]["weight"][0], params["confidence_head"]["proj"]["bias"][0]
    prevs = [anchor, *tokens[:-1]]
    out = []
    for h, prev in zip(hidden, prevs):
        f = h if w.shape[0] == h.shape[0] else np.concatenate([h, params["markov_head"]["markov_w1"]["weight"][prev]])
        out.append(1.0 / (1.0 + np.exp(-(f @ w + b))))
    return np.array(out)


def selector_greedy(params, config, hidden, unary, anchor):
    """DFlash2 walk: per row, the top-K unary candidates scored u + sum_r A[pred, r] p[r] Bc[cand, r]."""
    sel = params["candidate_selector"]
    A, Bc, P = sel["predecessor_codebook"], sel["successor_codebook"], sel["hidden_projection"]["weight"]
    K = config.dflash_config.selector_top_k
    pred, tokens = anchor, []
    for h, u in zip(hidden, unary):
        cand = np.argsort(-u, kind="stable")[:K]
        p = P @ h
        scores = [u[c] + np.sum(A[pred] * p * Bc[c]) for c in cand]
        pred = int(cand[int(np.argmax(scores))])
        tokens.append(pred)
    return np.array(tokens)

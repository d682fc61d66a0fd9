"""An independent NumPy reference of the DFlash-family drafter, written from the reference implementations
(z-lab/dflash `dflash/model.py`, SpecForge `specforge/modeling/draft/`, DeepSpec `deepspec/modeling/dspark/`,
vLLM `qwen3_dflash.py` / `qwen3_dflash2.py`; docs/references.md says which rule comes from where), and of the
Qwen3 / Llama targets (transformers' `modeling_qwen3.py` / `modeling_llama.py`), greedy decoding included.

Float64 throughout, except the RoPE frequencies and angles, which are formed in float32 as transformers forms
them (`modeling_rope_utils.py`), so that tight tolerances hold. One sequence at a time, heads and sequential
walks as explicit loops, attention with an explicit mask, no cache: deliberately a different formulation from
`dflash_jax.model` / `dflash_jax.target` (which batch, cache, merge softmax parts and scan), so the two can only
agree by computing the same function. Configs are read as config.json states them, never through the package.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np

from ._io import load_file


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


def head_dim(raw: dict) -> int:
    """config.json's `head_dim`, else hidden_size / num_attention_heads (transformers' Qwen3 default)."""
    return raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]


def rope_block(raw: dict) -> dict:
    """The RoPE block as written: transformers 5's `rope_parameters`, else the legacy `rope_scaling` (or {})."""
    return raw.get("rope_parameters") or raw.get("rope_scaling") or {}


def inv_freq(raw: dict) -> tuple[np.ndarray, float]:
    """RoPE inverse frequencies (float32) and the cos/sin scaling of config.json `raw`: plain RoPE, or YaRN (arXiv
    2309.00071 as transformers implements it: ramp between interpolated and original frequencies over a
    correction range)."""
    d, scaling = head_dim(raw), rope_block(raw)
    # no theta stated: 1e7, the default of the loader dflash_jax was designed from (a convention, warned at load;
    # transformers' Qwen3Config would take 1e4, vLLM 1e6)
    theta = raw.get("rope_theta", scaling.get("rope_theta", 1e7))
    base = np.float32(theta) ** (np.arange(0, d, 2).astype(np.float32) / np.float32(d))
    plain = (np.float32(1.0) / base).astype(np.float32)
    if (scaling.get("rope_type") or scaling.get("type")) != "yarn":
        return plain, 1.0
    factor = scaling["factor"]
    original = scaling.get("original_max_position_embeddings") or raw.get("max_position_embeddings") or 32768
    fast, slow = scaling.get("beta_fast") or 32.0, scaling.get("beta_slow") or 1.0
    # dimension index at which a frequency completes `n` rotations over the original context
    dim_of = lambda n: d * math.log(original / (2 * math.pi * n)) / (2 * math.log(theta))  # noqa: E731
    lo, hi = max(math.floor(dim_of(fast)), 0), min(math.ceil(dim_of(slow)), d - 1)
    hi = hi + 0.001 if lo == hi else hi
    keep = np.float32(1.0) - np.clip((np.arange(d // 2, dtype=np.float32) - lo) / np.float32(hi - lo), 0, 1)
    freq = (plain / np.float32(factor)) * (np.float32(1.0) - keep) + plain * keep
    mscale = 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0
    return freq.astype(np.float32), mscale


def rotate(x, positions, freq, scale=1.0):
    """x: [rows, heads, d]; neox rotate-half layout; angles `position * freq` formed in float32."""
    angles = positions.astype(np.float32)[:, None] * freq[None, :]  # float32
    angles = np.concatenate([angles, angles], axis=-1).astype(np.float64)
    cos, sin = np.cos(angles)[:, None, :] * scale, np.sin(angles)[:, None, :] * scale
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def rope(x, positions, raw: dict):
    """A drafter's RoPE (plain or YaRN, `inv_freq`) on x: [rows, heads, d]."""
    return rotate(x, positions, *inv_freq(raw))


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


def layer_types(raw: dict) -> tuple[list[bool], list[bool], int | None]:
    """From config.json as written (not the package's resolved config): per layer, whether it is sliding, whether
    it was declared sliding, and the sliding window (None: no window applies).

    Declared: `layer_types` when stated; else transformers' `Qwen3Config` derivation (with `use_sliding_window` and
    a `sliding_window`, the layers from `max_window_layers` on slide; transformers reads no window without
    `use_sliding_window`). MiMo's `dflash_config.use_swa` makes every layer sliding when none is declared, and
    `dflash_config.swa_window_size` (else `sliding_window`) is then the window of the sliding layers (vLLM
    `qwen3_dflash.py` `_resolve_layer_attention`).
    """
    n, sub = raw["num_hidden_layers"], raw.get("dflash_config") or {}
    window = raw.get("sliding_window") if raw.get("use_sliding_window") else None
    if raw.get("layer_types") is not None:
        declared = [kind == "sliding_attention" for kind in raw["layer_types"]]
    else:
        first = raw.get("max_window_layers", 28) if window is not None else n  # 28: Qwen3Config's default
        declared = [i >= first for i in range(n)]
    sliding = declared
    if sub.get("use_swa") and not any(declared):
        sliding = [True] * n
    if sub.get("use_swa") or sub.get("swa_window_size"):
        window = sub.get("swa_window_size") or raw.get("sliding_window")
    return sliding, declared, window


def layer_rules(raw: dict, causal=None, sliding_window=True, draft_window=None, draft_sinks=0):
    """[(causal, window | None, sinks)] per layer of config.json `raw`, as vLLM serves it: causality from the
    `causal` option, else `is_causal`, else `dflash_config.causal`, else "declared sliding" (vLLM
    `_dflash_layer_causal`); a sliding layer's window |q - k| <= w - 1 unless `sliding_window=False`; the other
    layers unbounded, or `draft_window` with `draft_sinks` when given (dflash-mlx's opt-in window)."""
    sliding, declared, window = layer_types(raw)
    stated = causal
    if stated is None:
        stated = raw.get("is_causal")
    if stated is None:
        stated = (raw.get("dflash_config") or {}).get("causal")
    rules = []
    for slides, was_declared in zip(sliding, declared):
        c = was_declared if stated is None else bool(stated)
        if sliding_window and slides and window is not None:
            rules.append((c, window, 0))
        else:
            rules.append((c, draft_window, draft_sinks if draft_window is not None else 0))
    return rules


def zlab_rules(raw: dict):
    """z-lab's transformers model (`dflash/model.py`): `is_causal=False` and no attention mask on every layer, and
    its eager / sdpa attention functions take `sliding_window` without applying it, so every key is visible."""
    return [(False, None, 0)] * raw["num_hidden_layers"]


def assistant_rules(raw: dict):
    """transformers' Muse-Glimmer assistant (`MuseGlimmerAssistantAttention.is_causal = False`, masks from
    `create_bidirectional_sliding_window_mask`): on a sliding layer a query sees the keys within `sliding_window`
    positions on either side (|q - k| < w), on a full one every key; z-lab's MLX loader reads it so too
    (`dflash/model_mlx.py`, `is_causal=False` for this architecture, window on the context)."""
    return [(False, raw["sliding_window"] if kind == "sliding_attention" else None, 0) for kind in raw["layer_types"]]


def vllm_v1_rules(raw: dict):
    """vLLM's v1 proposer (`vllm/v1/spec_decode/dflash.py`): one causal flag for every layer, False as soon as
    `_dflash_layer_causal` makes any layer non-causal; windows stay per layer."""
    per_layer = layer_rules(raw)
    causal = all(c for c, _, _ in per_layer)
    return [(causal, w, sinks) for _, w, sinks in per_layer]


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


def hidden_states(params, raw: dict, target_hidden, block_ids, ctx_pos, blk_pos, embed, rules):
    """One sequence of a drafter of config.json `raw`: target_hidden [S, Lf*H], block_ids [B] -> final-normed
    hidden [B, H]."""
    eps = raw["rms_norm_eps"]
    n_h, n_kv, d = raw["num_attention_heads"], raw["num_key_value_heads"], head_dim(raw)
    group = n_h // n_kv
    ctx = rms_norm(target_hidden @ params["fc"]["weight"].T, params["hidden_norm"]["weight"], eps)
    x = embed[block_ids].astype(np.float64)
    scale = (raw.get("dflash_config") or {}).get("input_embedding_scale")
    if scale is not None:
        x = x * scale
    B, S = len(block_ids), len(ctx_pos)
    key_pos = np.concatenate([ctx_pos, blk_pos])

    def proj(p, name, rows):
        y = rows @ p[name]["weight"].T
        return y + p[name]["bias"] if "bias" in p[name] else y

    for lp, (causal, window, sinks) in zip(params["layers"], rules):
        a = lp["self_attn"]
        xn = rms_norm(x, lp["input_layernorm"]["weight"], eps)
        if "attention_conv" in lp:
            xn, attn_kernel = conv_pair(lp["attention_conv"], xn)
        q = rms_norm(proj(a, "q_proj", xn).reshape(B, n_h, d), a["q_norm"]["weight"], eps)
        q = rope(q, blk_pos, raw)
        both = np.concatenate([ctx, xn], axis=0)  # context then block, as the reference concatenates
        k = rms_norm(proj(a, "k_proj", both).reshape(S + B, n_kv, d), a["k_norm"]["weight"], eps)
        k = rope(k, key_pos, raw)
        v = proj(a, "v_proj", both).reshape(S + B, n_kv, d)
        visible = allowed(blk_pos, key_pos, causal, window, sinks)
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


def is_dflash2(raw: dict) -> bool:
    """A DFlash2 drafter: so named in `architectures`, or `dflash_config` declares its convs or selector."""
    sub = raw.get("dflash_config") or {}
    named = any("DFlash2" in a for a in raw.get("architectures") or [])
    return named or any(sub.get(k) for k in ("conv_kernel_size", "conv_group_size", "selector_rank"))


def unary_logits(raw: dict, hidden, lm_head):
    """`lm_head(h)`; for DFlash2, `softcap(. * output_multiplier)` with the values of `dflash_config` (SpecForge
    `dflash2.py` `transform_unary_logits`, vLLM `qwen3_dflash2.py`), identity for the ones it does not set."""
    z = hidden @ lm_head.T
    sub = raw.get("dflash_config") or {}
    if not is_dflash2(raw):
        return z
    if sub.get("output_multiplier") is not None:
        z = z * sub["output_multiplier"]
    cap = sub.get("final_logit_softcapping")
    if cap is not None:
        z = cap * np.tanh(z / cap)
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


def selector_greedy(params, raw: dict, hidden, unary, anchor):
    """DFlash2 walk: per row, the top-K unary candidates scored u + sum_r A[pred, r] p[r] Bc[cand, r]."""
    sel = params["candidate_selector"]
    A, Bc, P = sel["predecessor_codebook"], sel["successor_codebook"], sel["hidden_projection"]["weight"]
    K = raw["dflash_config"]["selector_top_k"]
    pred, tokens = anchor, []
    for h, u in zip(hidden, unary):
        cand = np.argsort(-u, kind="stable")[:K]
        p = P @ h
        scores = [u[c] + np.sum(A[pred] * p * Bc[c]) for c in cand]
        pred = int(cand[int(np.argmax(scores))])
        tokens.append(pred)
    return np.array(tokens)


# --------------------------------------------------------------------------------------------------------------
# The targets: a Qwen3 / Llama decoder over an HF checkpoint's tensors, and greedy decoding with it
# --------------------------------------------------------------------------------------------------------------


def decoder_inv_freq(raw: dict, d: int) -> np.ndarray:
    """A target's RoPE frequencies from its config.json: default, or Llama 3's piecewise rule written frequency by
    frequency (Meta's `apply_scaling` in llama/model.py of llama-models)."""
    scaling = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    theta = raw.get("rope_theta", scaling.get("rope_theta"))
    inv = np.float32(1) / np.float32(theta) ** (np.arange(0, d, 2).astype(np.float32) / np.float32(d))
    if scaling.get("rope_type") != "llama3":
        return inv
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    out = []
    for f in inv.astype(np.float64):
        wavelength = 2 * np.pi / f
        if wavelength < old / high:  # high frequencies: unchanged
            out.append(f)
        elif wavelength > old / low:  # low frequencies: slowed by the factor
            out.append(f / factor)
        else:  # in between: interpolated
            smooth = (old / wavelength - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return np.asarray(out, np.float32)


def decoder(raw: dict, weights: dict, tokens) -> tuple[np.ndarray, list[np.ndarray]]:
    """(logits [S, V], hidden_states) of one sequence: `weights` the checkpoint's tensors by HF name (`model.`
    prefix), transformers' `output_hidden_states` convention (entry 0 the embedding output, entry i the output of
    layer i - 1, the last entry after the final norm). Qwen3's q/k norms where the checkpoint has them (Llama has
    none), and the projections' biases where it has them (`attention_bias`, `mlp_bias`); causal attention over
    the whole sequence."""
    w = {k: np.asarray(v, np.float64) for k, v in weights.items()}
    eps, n_h, n_kv = raw["rms_norm_eps"], raw["num_attention_heads"], raw["num_key_value_heads"]
    d = raw.get("head_dim") or raw["hidden_size"] // n_h
    inv = decoder_inv_freq(raw, d)
    S = len(tokens)
    positions = np.arange(S)
    x = w["model.embed_tokens.weight"][list(tokens)]
    states = [x]
    for i in range(raw["num_hidden_layers"]):
        def p(name, i=i):
            return w[f"model.layers.{i}.{name}.weight"]

        def linear(name, y, i=i):
            bias = w.get(f"model.layers.{i}.{name}.bias")
            return y @ p(name).T + (0 if bias is None else bias)

        def norm(name, y, i=i):
            key = f"model.layers.{i}.self_attn.{name}.weight"
            return rms_norm(y, w[key], eps) if key in w else y

        xn = rms_norm(x, p("input_layernorm"), eps)
        q = rotate(norm("q_norm", linear("self_attn.q_proj", xn).reshape(S, n_h, d)), positions, inv)
        k = rotate(norm("k_norm", linear("self_attn.k_proj", xn).reshape(S, n_kv, d)), positions, inv)
        v = linear("self_attn.v_proj", xn).reshape(S, n_kv, d)
        heads = []
        for h in range(n_h):
            g = h // (n_h // n_kv)
            scores = q[:, h] @ k[:, g].T / np.sqrt(d)
            scores[np.triu_indices(S, 1)] = -np.inf
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            heads.append((probs / probs.sum(-1, keepdims=True)) @ v[:, g])
        x = x + linear("self_attn.o_proj", np.concatenate(heads, axis=-1))
        hn = rms_norm(x, p("post_attention_layernorm"), eps)
        x = x + linear("mlp.down_proj", silu(linear("mlp.gate_proj", hn)) * linear("mlp.up_proj", hn))
        states.append(x)
    states[-1] = rms_norm(x, w["model.norm.weight"], eps)
    head = w["model.embed_tokens.weight"] if raw["tie_word_embeddings"] else w["lm_head.weight"]
    return states[-1] @ head.T, states


def numpy_decoder(directory: str, tokens) -> tuple[np.ndarray, list[np.ndarray]]:
    """`decoder` over a checkpoint directory (config.json and model.safetensors)."""
    with open(os.path.join(directory, "config.json")) as f:
        raw = json.load(f)
    return decoder(raw, load_file(os.path.join(directory, "model.safetensors")), tokens)


def greedy(raw: dict, weights: dict, prompt, max_new_tokens: int) -> list[int]:
    """Greedy decoding the plain way: the whole sequence through `decoder` per new token, the argmax appended."""
    sequence = list(prompt)
    for _ in range(max_new_tokens):
        logits, _ = decoder(raw, weights, sequence)
        sequence.append(int(np.argmax(logits[-1])))
    return sequence[len(prompt):]


def softmax(z):
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def warped_distribution(logits, temperature, top_k=None, top_p=None, min_p=None):
    """Sampling's distribution over the last axis after transformers' warpers, in its order (`generation/
    logits_process.py`: Temperature, TopK, TopP, MinP), each as it is written there: top-k removes the logits below
    the k-th largest; top-p sorts ascending and removes the tokens whose cumulative probability is <= 1 - top_p
    (the largest always kept); min-p removes the tokens whose probability is below min_p times the largest one's."""
    z = np.array(logits, np.float64) / temperature
    rows = z.reshape(-1, z.shape[-1])
    for row in rows:  # in place, one row at a time
        if top_k:
            row[row < np.sort(row)[-min(top_k, row.size)]] = -np.inf
        if top_p is not None and top_p < 1:
            order = np.argsort(row, kind="stable")  # ascending
            cumulative = np.cumsum(softmax(row[order]))
            remove = cumulative <= 1 - top_p
            remove[-1] = False
            row[order[remove]] = -np.inf
        if min_p:
            probs = softmax(row)
            row[probs < min_p * probs.max()] = -np.inf
    return softmax(rows).reshape(z.shape)

"""Nemotron-H (`target.nemotron_h`, its config and its parameter spec) against transformers 5.25.0's outputs on two
tiny models (`tests/data/nemotron_h`, README there: float32, the MoE model `ME*MEM*E` and the dense one `M-*M-M*-`,
whose `time_step_limit` [0.001, 0.5] clamps a third of its Mamba time steps).

Tolerances are near what the float32 code measures (each test's comment), well under the README's suggested 1e-4
and far under the effect of any deliberate change (>= 0.1 on the logits). Every program is jitted once per shape
and config: the prefill always runs prompts padded to 9 rows, the decode one row, the verify 6.
"""

import dataclasses
import json
import math
import os

import chex
import jax
import jax.numpy as jnp
import msgspec
import numpy as np
import pytest
from safetensors.numpy import load_file

from dflash_jax.errors import ConfigError
from dflash_jax.target import moe
from dflash_jax.target import nemotron_h as nh
from dflash_jax.target.nemotron_h_config import (
    ATTENTION,
    MAMBA,
    MLP,
    MOE,
    NemotronHConfig,
    parse_nemotron_h_config,
)
from dflash_jax.target.nemotron_h_spec import ROOT, expert_tensors, parameter_spec

from ._pallas import needs_mosaic_interpreter

DATA = os.path.join(os.path.dirname(__file__), "data", "nemotron_h")
REAL = os.path.join(DATA, "nvidia-nemotron-3.5-lightning-30b-a3b-nvfp4-config.json")  # the released target's
ALL = tuple(range(-1, 8))  # every feature: the embedding output, then blocks 0..7 (the last after norm_f)
PROMPT = 9  # the prefill's padded width
SEQ = 13  # the reference's sequence length

forward = jax.jit(nh.forward, static_argnames=("config", "layer_ids", "ops"))
prefill = jax.jit(nh.prefill, static_argnames=("config", "layer_ids", "chunk", "ops", "project"))
commit = jax.jit(nh.commit)


# --------------------------------------------------------------------------------------------------------------
# The reference models
# --------------------------------------------------------------------------------------------------------------


def tree_from_checkpoint(tensors: dict[str, np.ndarray], c: NemotronHConfig) -> dict:
    """The parameter tree (`nemotron_h` docstring) from a checkpoint's tensors, as `parameter_spec` declares them
    (the per-expert tensors stacked); every tensor of the checkpoint used."""
    tree: dict = {"layers": [{} for _ in range(c.num_hidden_layers)]}
    used = set()
    for spec in parameter_spec(c):
        if ".experts." in spec.name:
            parts = expert_tensors(c, spec.name)
            value = np.stack([tensors[p] for p in parts])
            used |= set(parts)
        else:
            value = tensors[spec.name]
            used.add(spec.name)
        assert value.shape == spec.shape, spec.name
        path = spec.name.removeprefix(ROOT).split(".")
        node = tree
        if path[0] == "layers":
            node, path = tree["layers"][int(path[1])], path[2:]
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = jnp.asarray(value)
    assert used == set(tensors)
    return tree


@dataclasses.dataclass(frozen=True)
class Model:
    config: NemotronHConfig
    params: dict
    io: dict


def _load(name: str) -> Model:
    with open(os.path.join(DATA, name, "config.json")) as f:
        config = parse_nemotron_h_config(json.load(f), source=name)
    tensors = load_file(os.path.join(DATA, name, "model.safetensors"))
    return Model(config, tree_from_checkpoint(tensors, config), load_file(os.path.join(DATA, name, "io.safetensors")))


@pytest.fixture(scope="module", params=["moe", "dense"])
def model(request) -> Model:
    return _load(request.param)


@pytest.fixture(scope="module")
def moe_model() -> Model:
    return _load("moe")


def _cache(m: Model) -> nh.NemotronHCache:
    return nh.init_cache(m.config, 2, 32, jnp.float32)


def _prefill(m: Model, tokens: np.ndarray, lengths, chunk: int = 8):
    """Prompts right-padded to `PROMPT` rows (the pad a token id that the real rows never see), chunk 8 over the
    batch of 2: 4 rows of each prompt a step, 3 steps, the Mamba scan in chunks of chunk_size = 4 within."""
    padded = np.full((2, PROMPT), 5, np.int32)
    for b, n in enumerate(lengths):
        padded[b, :n] = tokens[b, :n]
    return prefill(m.params, m.config, jnp.asarray(padded), _cache(m), jnp.asarray(lengths, jnp.int32), ALL, chunk)


def _step(m: Model, cache, tokens, lengths):
    """One decode row per sequence, committed: `(logits [2, V], cache)`."""
    logits, _, pending = forward(m.params, m.config, jnp.asarray(tokens, jnp.int32)[:, None], cache,
                                 jnp.asarray(lengths, jnp.int32))
    return np.asarray(logits[:, 0]), commit(pending, jnp.ones(2, jnp.int32))


# --------------------------------------------------------------------------------------------------------------
# Parity with transformers
# --------------------------------------------------------------------------------------------------------------


def test_forward_matches_transformers(model):
    """One forward of the 13 tokens from an empty cache: logits (measured 3.2e-6 both) and every feature
    (hidden_states[0..8]: the embedding, blocks 0..6, block 7 after norm_f; measured 1.1e-5 moe, 6.4e-6 dense on
    values up to 17, the reference's own float32 rounding per its README)."""
    io = model.io
    logits, features, _ = forward(model.params, model.config, jnp.asarray(io["input_ids"], jnp.int32),
                                  _cache(model), jnp.zeros(2, jnp.int32), ALL)
    chex.assert_trees_all_close(np.asarray(logits), io["logits"], rtol=0, atol=1e-5)
    features = np.asarray(features).reshape(2, SEQ, len(ALL), -1).transpose(2, 0, 1, 3)
    chex.assert_trees_all_close(features, io["hidden_states"], rtol=0, atol=3e-5)


def test_bfloat16(model):
    """bf16 weights and cache run under strict dtype promotion: float32 logits and SSM states, bf16 features, K/V
    and conv states; the logits within bf16's reach of the float32 reference (measured 0.069 moe, 0.104 dense on
    logits up to 4.3)."""
    params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), model.params)
    logits, features, pending = forward(params, model.config, jnp.asarray(model.io["input_ids"], jnp.int32),
                                        nh.init_cache(model.config, 2, 32, jnp.bfloat16), jnp.zeros(2, jnp.int32),
                                        (3,))
    assert (logits.dtype, features.dtype, pending.k[0].dtype) == (jnp.float32, jnp.bfloat16, jnp.bfloat16)
    assert (pending.mamba[0].conv.dtype, pending.mamba[0].ssm.dtype) == (jnp.bfloat16, jnp.float32)
    chex.assert_trees_all_close(np.asarray(logits), model.io["logits"], rtol=0, atol=0.25)


def test_prefill_states_match_transformers(model):
    """The Mamba states after a 9-token prefill (chunk 8: 4 rows a step; transformers keeps K = 4 conv columns,
    this package the K - 1 = 3 it needs: the last 3 of them). Measured: last logits 3.3e-6 (moe) / 2.0e-6
    (dense), features 1.1e-5 / 6.9e-6, conv states 3.5e-6 / 2.2e-6, SSM states 1.2e-6 / 3.3e-6."""
    io = model.io
    logits, features, cache = _prefill(model, io["input_ids"], [PROMPT, PROMPT])
    chex.assert_trees_all_close(np.asarray(logits), io["logits"][:, PROMPT - 1], rtol=0, atol=1e-5)
    features = np.asarray(features).reshape(2, PROMPT, len(ALL), -1).transpose(2, 0, 1, 3)
    chex.assert_trees_all_close(features, io["hidden_states"][:, :, :PROMPT], rtol=0, atol=3e-5)
    for state, i in zip(cache.mamba, model.config.blocks(MAMBA)):
        chex.assert_trees_all_close(np.asarray(state.conv), io[f"prefill9_conv_state_{i}"][..., 1:], rtol=0,
                                    atol=1e-5)
        chex.assert_trees_all_close(np.asarray(state.ssm), io[f"prefill9_ssm_state_{i}"], rtol=0, atol=1e-5)


def test_ragged_prefill_then_decode_equals_the_full_forward(model):
    """Prompts of 9 and 6 tokens (the second padded with another token), then 4 decode steps each: every logit
    row equals the reference's full forward at its position (measured 2.5e-6 moe, 2.8e-6 dense). For the dense
    model the comparison
    is with the full forward, not transformers' `decode_logits`: its cached one-row step skips `time_step_limit`
    (1.71 away from its own forward), this package clamps every row."""
    io, lengths = model.io, np.array([PROMPT, 6])
    tokens, reference = io["input_ids"], io["logits"]
    logits, _, cache = _prefill(model, tokens, lengths)
    chex.assert_trees_all_close(np.asarray(logits), reference[[0, 1], lengths - 1], rtol=0, atol=1e-5)
    for s in range(4):
        at = lengths + s
        logits, cache = _step(model, cache, tokens[[0, 1], at], at)
        chex.assert_trees_all_close(logits, reference[[0, 1], at], rtol=0, atol=1e-5)


def test_moe_decode_matches_transformers_decode_logits(moe_model):
    """Without a clamp transformers' cached decode is its forward (3.9e-6 apart): this package's matches both
    (measured 2.9e-6 from `decode_logits`)."""
    io = moe_model.io
    _, _, cache = _prefill(moe_model, io["input_ids"], [PROMPT, PROMPT])
    for s in range(4):
        logits, cache = _step(moe_model, cache, io["input_ids"][:, PROMPT + s], [PROMPT + s] * 2)
        chex.assert_trees_all_close(logits, io["decode_logits"][:, s], rtol=0, atol=1e-5)


def _greedy(m: Model, prompt: np.ndarray, steps: int) -> np.ndarray:
    logits, _, cache = _prefill(m, prompt, [len(prompt[0])] * 2)
    out, length = [np.argmax(logits, -1)], len(prompt[0])
    for _ in range(steps - 1):
        logits, cache = _step(m, cache, out[-1], [length] * 2)
        out.append(np.argmax(logits, -1))
        length += 1
    return np.stack(out, 1)


def test_greedy_decoding_matches_transformers(moe_model):
    """12 greedy tokens from the first 5 (a prefill, then 11 one-row steps): transformers' `generate` exactly
    (its smallest top-1 - top-2 gap along the path is 0.032)."""
    io = moe_model.io
    np.testing.assert_array_equal(_greedy(moe_model, io["input_ids"][:, :5], 12), io["greedy_tokens"])


def test_dense_greedy_follows_the_clamped_forward():
    """The dense model's `greedy_tokens` come from transformers' unclamped decode steps, which its own forward
    disagrees with (README: 1.37 apart, another argmax). This package clamps every row, so its greedy path is
    the argmax of one full forward over the prompt and that path (its smallest top-1 - top-2 gap: 0.0064, 2000x
    the logits' error); it parts from transformers' `generate` at the fifth new token of the first prompt and the
    fourth of the second."""
    m = _load("dense")
    io = m.io
    tokens = _greedy(m, io["input_ids"][:, :5], 8)
    path = np.concatenate([io["input_ids"][:, :5], tokens], 1)  # [2, 13]: one forward's shape
    logits, _, _ = forward(m.params, m.config, jnp.asarray(path, jnp.int32), _cache(m), jnp.zeros(2, jnp.int32))
    np.testing.assert_array_equal(np.argmax(np.asarray(logits)[:, 4:-1], -1), tokens)
    assert (tokens != io["greedy_tokens"][:, :8]).any(axis=1).all()


# --------------------------------------------------------------------------------------------------------------
# Commit: a verify of S rows rolled back to any prefix
# --------------------------------------------------------------------------------------------------------------


def test_commit_equals_running_only_the_kept_rows(model):
    """A 6-row verify (S > chunk_size 4) after a 5-token prefill, committed at every k in 0..6 (the two sequences
    at different k): each Mamba state equals the state of decoding only those rows one at a time (measured
    conv 1.5e-6, ssm 1.2e-6), and the next step from the committed cache gives the full forward's logits there
    (K/V rows past the kept ones never read; measured 3.5e-6; the verify's own logits 3.3e-6)."""
    io, S, start = model.io, 6, 5
    tokens = io["input_ids"]
    _, _, cache = _prefill(model, tokens, [start, start])
    logits, _, pending = forward(model.params, model.config, jnp.asarray(tokens[:, start:start + S], jnp.int32),
                                 cache, jnp.full(2, start, jnp.int32))
    chex.assert_trees_all_close(np.asarray(logits), io["logits"][:, start:start + S], rtol=0, atol=1e-5)
    chex.assert_shape(pending.mamba[0].ssm, (2, S + 1, 8, 8, 16))
    stepped = [cache]  # the committed cache after decoding j rows one at a time, j = 0..S
    for j in range(S):
        stepped.append(_step(model, stepped[-1], tokens[:, start + j], [start + j] * 2)[1])
    for k in range(S + 1):
        kept = np.array([k, S - k])
        committed = commit(pending, jnp.asarray(kept, jnp.int32))
        for b in range(2):
            row = lambda state, b=b: jax.tree.map(lambda a: np.asarray(a[b]), state)  # noqa: E731
            for got, want in zip(committed.mamba, stepped[kept[b]].mamba):
                chex.assert_trees_all_close(row(got), row(want), rtol=0, atol=1e-5)
        at = start + kept
        if (at < SEQ - 1).all():
            next_logits, _ = _step(model, committed, tokens[[0, 1], at], at)
            chex.assert_trees_all_close(next_logits, io["logits"][[0, 1], at], rtol=0, atol=1e-5)
    chex.assert_trees_all_equal_shapes(commit(pending, jnp.zeros(2, jnp.int32)), cache)


# --------------------------------------------------------------------------------------------------------------
# Each part matters
# --------------------------------------------------------------------------------------------------------------


def _relu_experts(p, x, weights, experts):
    """The routed experts with relu instead of relu^2 (the shared expert unchanged)."""
    e = p["experts"]
    up, down = (jnp.take(e[name], experts, axis=0) for name in ("up_proj", "down_proj"))
    h = jax.nn.relu(jnp.einsum("th,tkih->tki", x, up, precision="highest"))
    return jnp.einsum("tki,tkhi,tk->th", h, down, weights, precision="highest")


def _without(params: dict, drop) -> dict:
    layers = [dict(p, mixer=drop(p["mixer"])) if "gate" in p["mixer"] else p for p in params["layers"]]
    return dict(params, layers=layers)


@pytest.mark.parametrize("change, measured", [
    ("no correction bias", 4.47),
    ("routed_scaling_factor 1", 2.69),
    ("no shared expert", 3.76),
    ("relu, not relu^2", 2.92),
])
def test_each_part_of_the_moe_block_matters(moe_model, change, measured):
    """Each part dropped moves the MoE model's logits by >= 0.5, 5e4 times the parity tolerance (measured: the
    parameter, matching the README where it states one)."""
    m, ops, config, params = moe_model, nh.ONE_DEVICE, moe_model.config, moe_model.params
    if change == "no correction bias":
        params = _without(params, lambda p: dict(p, gate=dict(p["gate"], e_score_correction_bias=jnp.zeros(8))))
    elif change == "routed_scaling_factor 1":
        config = msgspec.structs.replace(config, routed_scaling_factor=1.0)
    elif change == "no shared expert":
        params = _without(params, lambda p: dict(p, shared_experts=jax.tree.map(jnp.zeros_like, p["shared_experts"])))
    else:
        ops = nh.Ops(routed=_relu_experts)
    logits, _, _ = forward(params, config, jnp.asarray(m.io["input_ids"], jnp.int32), _cache(m),
                           jnp.zeros(2, jnp.int32), ops=ops)
    moved = float(np.abs(np.asarray(logits) - m.io["logits"]).max())
    assert moved > 0.5
    assert moved == pytest.approx(measured, abs=0.01)


# --------------------------------------------------------------------------------------------------------------
# The MoE block: router, and the experts through `target.moe`'s machinery
# --------------------------------------------------------------------------------------------------------------


def _transformers_router(x, weight, bias, c: NemotronHConfig):
    """`NemotronHTopkRouter.forward` in NumPy float64 (its group-limited choice included)."""
    scores = 1 / (1 + np.exp(-(x @ weight.T)))
    choice = scores + bias
    T, E = choice.shape
    groups = np.sort(choice.reshape(T, c.n_group, -1), -1)[..., -2:].sum(-1)
    top_groups = np.argsort(-groups, -1)[:, :c.topk_group]
    mask = np.zeros((T, c.n_group), bool)
    np.put_along_axis(mask, top_groups, True, -1)
    choice = np.where(np.repeat(mask, E // c.n_group, -1), choice, -np.inf)
    experts = np.argsort(-choice, -1)[:, :c.num_experts_per_tok]
    weights = np.take_along_axis(scores, experts, -1)
    if c.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return weights * c.routed_scaling_factor, experts


@pytest.mark.parametrize("n_group, topk_group, norm", [(1, 1, True), (4, 2, True), (4, 2, False), (2, 2, True)])
def test_router_matches_transformers_with_groups(n_group, topk_group, norm):
    """The choice within the `topk_group` best of `n_group` groups (a group scored by its two best biased
    scores), renormalised or not: the same experts, the weights within 3.3e-7 (measured). With 4 groups of which 2
    are kept the limit changes the choice of 36 of the 40 tokens."""
    c = parse_nemotron_h_config({"hybrid_override_pattern": "E", "hidden_size": 32, "n_routed_experts": 16,
                                 "num_experts_per_tok": 4, "n_group": n_group, "topk_group": topk_group,
                                 "norm_topk_prob": norm, "routed_scaling_factor": 2.5})
    rng = np.random.default_rng(3)
    x, w, bias = rng.standard_normal((40, 32)), rng.normal(0, 0.5, (16, 32)), rng.normal(0, 0.5, 16)
    p = {"gate": {"weight": jnp.asarray(w, jnp.float32), "e_score_correction_bias": jnp.asarray(bias, jnp.float32)}}
    weights, experts = jax.jit(nh.route, static_argnums=1)(p, c, jnp.asarray(x, jnp.float32))
    want_weights, want_experts = _transformers_router(x.astype(np.float32).astype(np.float64),
                                                      np.float32(w).astype(np.float64), np.float32(bias), c)
    np.testing.assert_array_equal(np.asarray(experts), want_experts)
    np.testing.assert_allclose(np.asarray(weights), want_weights, rtol=0, atol=1e-6)
    assert experts.dtype == jnp.int32


@pytest.fixture(scope="module")
def routed_inputs(moe_model):
    """The first MoE block's experts with 26 tokens routed as the model routes them."""
    p = moe_model.params["layers"][1]["mixer"]
    x = jnp.asarray(np.random.default_rng(4).standard_normal((26, 64)), jnp.float32)
    weights, experts = nh.route(p, moe_model.config, x)
    return p, x, weights, experts


@pytest.mark.parametrize("impl", ["gather", "reduce", "tiled", "grouped", "ragged_dot"])
def test_moe_machinery_runs_relu2_experts(moe_model, routed_inputs, impl):
    """`target.moe`'s expert products take the relu^2 experts (stacks without `gate_proj`) in every form: equal
    to this module's `gathered_experts` (measured: gather 0, reduce 3.4e-6, tiled 2.9e-6, grouped and ragged_dot
    1.2e-6, on values up to 10)."""
    p, x, weights, experts = routed_inputs
    want = nh.gathered_experts(p, x, weights, experts)
    got = jax.jit(moe.weighted_experts, static_argnums=4)(p, x, weights, experts, impl)
    chex.assert_trees_all_close(got, want, rtol=0, atol=1e-5)


@needs_mosaic_interpreter
def test_moe_kernel_runs_relu2_experts():
    """The Mosaic GPU slots kernel (interpret mode; bf16 stacks of the sizes it tiles) on relu^2 experts: equal to
    `moe._gathered`, which forms h as the kernel's path does (float32 products, relu^2, one rounding to bf16; this
    module's `gathered_experts` rounds the up product first, as transformers' bf16 experts do: 0.016 away on values
    up to 3, bf16's resolution)."""
    rng, E, H, I, T, k = np.random.default_rng(6), 8, 128, 128, 5, 2
    stacks = {"up_proj": rng.standard_normal((E, I, H)) * 0.1, "down_proj": rng.standard_normal((E, H, I)) * 0.1}
    p = {"experts": {name: jnp.asarray(w, jnp.bfloat16) for name, w in stacks.items()}}
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.bfloat16)
    experts = jnp.asarray(np.argsort(rng.random((T, E)), axis=1)[:, :k], jnp.int32)  # distinct within a token
    weights = jnp.asarray(rng.random((T, k)), jnp.float32)
    got = np.asarray(moe._slotted(p, x, weights, experts, interpret=True))
    want = np.asarray(moe._gathered(p, x, weights, experts))
    np.testing.assert_allclose(got, want, rtol=0, atol=2.0**-12 * np.abs(want).max())


def test_forward_with_the_moe_machinery_matches_transformers(moe_model):
    """The model with `target.moe`'s tiled experts (as a prefill runs them) in `Ops`: transformers' logits
    (measured 3.7e-6)."""
    m = moe_model
    ops = nh.Ops(routed=_tiled_experts)
    logits, _, _ = forward(m.params, m.config, jnp.asarray(m.io["input_ids"], jnp.int32), _cache(m),
                           jnp.zeros(2, jnp.int32), ops=ops)
    chex.assert_trees_all_close(np.asarray(logits), m.io["logits"], rtol=0, atol=1e-5)


def _tiled_experts(p, x, weights, experts):
    return moe.weighted_experts(p, x, weights, experts, "tiled")


# --------------------------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------------------------


def _raw(**changes) -> dict:
    with open(os.path.join(DATA, "moe", "config.json")) as f:
        raw = json.load(f)
    raw.update(changes)
    return {k: v for k, v in raw.items() if v is not DROP}


DROP = object()


def test_the_tiny_and_the_real_configs_parse():
    with open(REAL) as f:
        real = parse_nemotron_h_config(json.load(f), source=REAL)
    kinds = real.layers_block_type
    assert (real.num_hidden_layers, kinds.count(MAMBA), kinds.count(MOE), kinds.count(ATTENTION)) == (52, 23, 23, 6)
    assert real.pattern.startswith("MEMEM*EMEMEM*E") and real.time_step_limit == (0.0, math.inf)
    assert (real.n_groups, real.mamba_num_heads, real.mamba_head_dim, real.ssm_state_size, real.chunk_size) == (
        8, 64, 64, 128, 128)
    assert (real.n_routed_experts, real.num_experts_per_tok, real.moe_shared_expert_intermediate_size,
            real.moe_intermediate_size, real.routed_scaling_factor) == (128, 6, 3712, 1856, 2.5)
    assert real.in_proj_rows == 2 * 4096 + 2 * 8 * 128 + 64 and real.head_dim == 128
    moe_c, dense = _load("moe").config, _load("dense").config
    assert (moe_c.pattern, dense.pattern) == ("ME*MEM*E", "M-*M-M*-")
    assert dense.time_step_limit == (0.001, 0.5) and dense.mamba_dims.time_step_max == 0.5
    assert hash(real) != hash(moe_c) and {real, moe_c, dense} == {real, moe_c, dense}
    assert dense.blocks(MLP) == (1, 4, 7) and moe_c.blocks(ATTENTION) == (2, 6)


@pytest.mark.parametrize("blocks", [
    {"layers_block_type": ["mamba", "moe", "attention", "mlp"]},  # the Hub's names
    {"layers_block_type": ["linear_attention", "moe", "full_attention", "mlp"]},  # transformers 5's
    {"layer_types": ["mamba", "moe", "attention", "mlp"]},  # transformers' attribute alias
    {"hybrid_override_pattern": "ME*-"},
    {"hybrid_override_pattern": "ME*-", "layers_block_type": ["mamba", "moe", "full_attention", "mlp"]},
    {"hybrid_override_pattern": "ME*-", "num_hidden_layers": 4},
])
def test_block_spellings(blocks):
    c = parse_nemotron_h_config(_raw(**{"layers_block_type": DROP, **blocks}))
    assert c.layers_block_type == (MAMBA, MOE, ATTENTION, MLP) and c.num_hidden_layers == 4 and c.pattern == "ME*-"


@pytest.mark.parametrize("limit, expected", [
    ([0.0, math.inf], (0.0, math.inf)),  # JSON `Infinity`, as json.loads reads it
    (json.loads("[0.0, 1e999]"), (0.0, math.inf)),
    ([0.0, {"__float__": "Infinity"}], (0.0, math.inf)),  # transformers' save_pretrained
    ([0.001, "inf"], (0.001, math.inf)),
    (["0.001", "Infinity"], (0.001, math.inf)),
    (None, (0.0, math.inf)),
    (DROP, (0.0, math.inf)),
    ([0.001, 0.5], (0.001, 0.5)),
])
def test_time_step_limit_spellings(limit, expected):
    c = parse_nemotron_h_config(_raw(time_step_limit=limit))
    assert c.time_step_limit == expected and isinstance(c.time_step_limit, tuple)


def test_json_infinity_as_written():
    text = json.dumps(_raw(time_step_limit=[0.0, math.inf]))
    assert "Infinity" in text
    assert parse_nemotron_h_config(json.loads(text)).time_step_limit == (0.0, math.inf)


@pytest.mark.parametrize("alias, field, value", [
    ("mamba_n_groups", "n_groups", 4),
    ("mamba_d_conv", "conv_kernel", 3),
    ("mamba_d_state", "ssm_state_size", 32),
    ("mamba_expand", "expand", 3),
    ("mamba_dt_min", "time_step_min", 0.01),
    ("mamba_dt_max", "time_step_max", 0.2),
    ("mamba_dt_limit", "time_step_limit", (0.01, 1.0)),
    ("mamba_dt_init_floor", "time_step_floor", 0.001),
    ("mamba_chunk_size", "chunk_size", 64),
    ("num_local_experts", "n_routed_experts", 16),
])
def test_legacy_aliases(alias, field, value):
    """Each legacy name alone sets its field; beside the current name it must agree with it."""
    stated = list(value) if isinstance(value, tuple) else value
    assert getattr(parse_nemotron_h_config(_raw(**{field: DROP, alias: stated})), field) == value
    assert getattr(parse_nemotron_h_config(_raw(**{field: stated, alias: stated})), field) == value
    other = [0.02, 2.0] if isinstance(value, tuple) else value * 2
    with pytest.raises(ConfigError, match=rf"^src: {alias} .* disagrees with {field} "):
        parse_nemotron_h_config(_raw(**{field: other, alias: stated}), "src")


@pytest.mark.parametrize("changes, field", [
    ({"layers_block_type": ["mamba", "moe", "mamba2"]}, r"layers_block_type\[2\] is 'mamba2'"),
    ({"layers_block_type": DROP, "hybrid_override_pattern": "ME*X-"}, r"hybrid_override_pattern\[3\] is 'X'"),
    ({"layers_block_type": "ME*-"}, "layers_block_type is 'ME\\*-'"),
    ({"hybrid_override_pattern": "ME*-"}, r"layers_block_type \(ME\*MEM\*E as a pattern\) disagrees with "
                                          r"hybrid_override_pattern \(ME\*-\)"),
    ({"layers_block_type": DROP}, "no blocks: layers_block_type and hybrid_override_pattern are both absent"),
    ({"layers_block_type": []}, "no blocks: .* empty"),
    ({"num_hidden_layers": 52}, "num_hidden_layers=52 but the blocks number 8"),
    ({"num_attention_heads": 5}, "num_attention_heads=5 is not a multiple of num_key_value_heads=2"),
    ({"mamba_num_heads": 9}, "mamba_num_heads=9 is not a multiple of n_groups=2"),
    ({"moe_latent_size": 32}, "moe_latent_size=32: latent expert projections .* not implemented"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok=9 exceeds n_routed_experts=8"),
    ({"n_group": 3}, "n_routed_experts=8 is not a multiple of n_group=3"),
    ({"n_group": 2, "topk_group": 3}, "topk_group=3 exceeds n_group=2"),
    ({"time_step_limit": [0.5, 0.1]}, r"time_step_limit is \[0.5, 0.1\]; expected 0 <= low <= high"),
    ({"time_step_limit": [0.0, "lots"]}, "time_step_limit holds 'lots'"),
    ({"time_step_limit": [0.0, {"__float__": "NaN"}]}, r"time_step_limit is \[0.0, nan\]"),
    ({"time_step_limit": 0.5}, "time_step_limit is 0.5; expected a pair"),
    ({"mlp_hidden_act": "silu"}, "mlp_hidden_act is 'silu'; only 'relu2'"),
    ({"mamba_hidden_act": "gelu"}, "mamba_hidden_act is 'gelu'; only 'silu'"),
    ({"use_conv_bias": False}, "use_conv_bias=false is not implemented"),
    ({"use_bias": True}, "use_bias=true is not implemented"),
    ({"mlp_bias": True}, "mlp_bias=true is not implemented"),
    ({"hidden_size": 0}, r"hidden_size"),
    ({"model_type": "qwen3"}, "model_type is 'qwen3', expected 'nemotron_h'"),
])
def test_refusals_name_the_field(changes, field):
    with pytest.raises(ConfigError, match=rf"^my/config.json: .*{field}"):
        parse_nemotron_h_config(_raw(**changes), "my/config.json")


def test_routing_fields_of_a_model_without_moe_blocks_are_not_read():
    c = parse_nemotron_h_config(_raw(layers_block_type=["mamba", "mlp"], num_experts_per_tok=99))
    assert c.pattern == "M-"


# --------------------------------------------------------------------------------------------------------------
# The parameter spec
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["moe", "dense"])
def test_the_spec_declares_every_tensor_of_the_checkpoint(name):
    """`tree_from_checkpoint` consumes every tensor through the spec (above); here the counts and the axes."""
    m = _load(name)
    specs = parameter_spec(m.config)
    stored = load_file(os.path.join(DATA, name, "model.safetensors"))
    assert sum(len(expert_tensors(m.config, s.name)) if ".experts." in s.name else 1 for s in specs) == len(stored)
    axes = {s.name.removeprefix(ROOT): s.axes for s in specs}
    # the Mamba mixer by head: in_proj and the conv by their rows, in the sharded order (module docstring)
    assert axes["layers.0.mixer.in_proj.weight"] == ("heads", "embed")
    assert axes["layers.0.mixer.conv1d.weight"] == ("heads", None, None)
    assert axes["layers.0.mixer.A_log"] == axes["layers.0.mixer.norm.weight"] == ("heads",)
    assert axes["layers.0.mixer.out_proj.weight"] == ("embed", "heads")
    assert axes["layers.2.mixer.q_proj.weight"] == ("heads", "embed")
    assert axes["layers.2.mixer.o_proj.weight"] == ("embed", "heads")
    if name == "moe":
        assert axes["layers.1.mixer.experts.up_proj"] == ("experts", "expert_mlp", "embed")
        assert axes["layers.1.mixer.shared_experts.down_proj.weight"] == ("embed", "mlp")
        assert axes["layers.1.mixer.gate.e_score_correction_bias"] == (None,)
    for s in specs:
        assert len(s.axes) == len(s.shape), s.name
        assert s.init.host(np.random.default_rng(0), s.shape).shape == s.shape


def test_a_tied_config_has_no_lm_head():
    c = parse_nemotron_h_config(_raw(tie_word_embeddings=True))
    assert "lm_head.weight" not in {s.name for s in parameter_spec(c)}
    assert nh.lm_head({"embeddings": {"weight": 1}}) == 1

"""Qwen3 targets for tests, examples and benchmarks: random checkpoints, and a target/drafter pair that agree.

- `write_qwen3_checkpoint(directory, "tiny-qwen3")`: a random Hugging Face Qwen3 directory (config.json +
  safetensors) that both `Qwen3Target.from_pretrained` and transformers' `Qwen3ForCausalLM` load. The tiny
  presets match the tiny drafters of `dflash_jax.testing` (hidden 64, vocab 128, 2 layers, so their
  `target_layer_ids` [0, 1] are valid): any tiny drafter pairs with a tiny target.
- `random_qwen3(config)`: random weights drawn on the device (no checkpoint), for benchmarks at real sizes.
- `successor_target(target, successor)` and `successor_drafter(drafter, successor)`: the accept path on demand.
  The target is rebuilt so its greedy next token is `successor[last token]` (embedding and LM head aligned,
  decoder layers kept but scaled down, so the context still nudges it now and then); a DSpark drafter's
  Markov head is rebuilt so its rows walk the same map. Together they accept nearly whole blocks; with
  another map (`successor_drafter(d, other)`) the drafter is always wrong: the two bounds of the speedup.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from .drafter import Drafter
from .plan import build_tree, init_leaves
from .safetensors import write_tensors
from .target.config import ARCHITECTURES, DecoderConfig, Qwen3Config, parse_decoder_config
from .target.dense import DecoderTarget, Qwen3Target, plan_decoder

_TINY_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu",
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rope_scaling": None, "tie_word_embeddings": False,
    "attention_bias": False, "attention_dropout": 0.0, "use_sliding_window": False, "sliding_window": None,
    "max_window_layers": 2, "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16",
}
_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256}
_TINY_LLAMA = {  # transformers-4 layout: `rope_theta` + `rope_scaling`; head_dim unstated (hidden / heads)
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 8, "num_key_value_heads": 2, "max_position_embeddings": 1024, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "rope_scaling": _LLAMA3_ROPE, "tie_word_embeddings": False,
    "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0, "pretraining_tp": 1,
    "bos_token_id": 0, "eos_token_id": [1, 2], "torch_dtype": "bfloat16",
}
QWEN3_TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny-qwen3": _TINY_QWEN3,
    "tiny-qwen3-tied": {**_TINY_QWEN3, "tie_word_embeddings": True},
    # tensor-parallel tests: 8 heads of 8 and 2 KV heads, so 2 devices split the KV heads and 4 or 8 replicate them
    "tiny-qwen3-tp": {**_TINY_QWEN3, "num_attention_heads": 8, "head_dim": 8},
    "tiny-llama": _TINY_LLAMA,
    "tiny-llama-tied": {**_TINY_LLAMA, "tie_word_embeddings": True},
    # transformers-5 layout: `rope_parameters` holds the theta and the scaling
    "tiny-llama-v5": {**{k: v for k, v in _TINY_LLAMA.items() if k not in ("rope_theta", "rope_scaling")},
                      "rope_parameters": {**_LLAMA3_ROPE, "rope_theta": 500000.0}},
}


def _parse(raw: dict[str, Any], source: str) -> DecoderConfig:
    """A raw config decoded as the architecture it names (Qwen3 when it names none)."""
    kind = next((ARCHITECTURES[a] for a in raw.get("architectures", ()) if a in ARCHITECTURES), Qwen3Config)
    return parse_decoder_config(raw, kind, source=source)


def write_qwen3_checkpoint(
    directory: str | os.PathLike[str],
    config: str | dict[str, Any] = "tiny-qwen3",
    *,
    seed: int = 0,
    num_shards: int = 1,
    dtype: str = "bfloat16",
) -> DecoderConfig:
    """Write a random Qwen3 or Llama checkpoint of `config` (a preset name or a raw config dict; the architecture
    its `architectures` names) to `directory`.

    Each weight is drawn by its spec's initialiser (`target.parameter_spec`: norms near 1, linears scaled by
    fan-in), as the drafter test checkpoints' are. `num_shards > 1` writes shards plus an index; `dtype` is
    "bfloat16" or "float32".
    Returns the config.
    """
    raw = copy.deepcopy(QWEN3_TINY_CONFIGS[config] if isinstance(config, str) else config)
    raw["torch_dtype"] = dtype
    parsed = _parse(raw, f"decoder config {config if isinstance(config, str) else ''}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    out_dtype = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}[dtype]
    arrays = {t.name: t.init.host(rng, t.shape).astype(out_dtype) for t in plan_decoder(parsed)}
    (directory / "config.json").write_text(json.dumps(raw, indent=2))
    write_tensors(directory, arrays, num_shards)
    return parsed


def random_qwen3(config: DecoderConfig | dict[str, Any] | str, *, seed: int = 0, dtype=jnp.bfloat16) -> DecoderTarget:
    """A target with random weights drawn on the default device, each by its spec's initialiser as
    `write_qwen3_checkpoint` draws it (norm gains ~1, linears N(0, 1/fan_in))."""
    if not isinstance(config, DecoderConfig):
        config = _parse(QWEN3_TINY_CONFIGS[config] if isinstance(config, str) else config, "random_qwen3")
    plan = plan_decoder(config)
    keys = jax.random.split(jax.random.key(seed), len(plan))
    params = build_tree(plan, init_leaves(keys, plan, dtype))
    params["layers"] = tuple(params["layers"])
    return (Qwen3Target if isinstance(config, Qwen3Config) else DecoderTarget)(params=params, config=config)


OUTPUT_PROJECTIONS = ("o_proj", "out_proj", "down_proj")  # what writes a mixer's or an MLP's output into the stream


def scaled_outputs(layers: Any, scale: float) -> Any:
    """The layers with every output projection (attention `o_proj`, delta-net `out_proj`, MLP and expert
    `down_proj`) times `scale`: each layer adds `scale` times what it added before."""

    def scaled(path, leaf):
        names = {getattr(k, "key", None) for k in path}
        return leaf * scale if names & set(OUTPUT_PROJECTIONS) else leaf

    return jax.tree_util.tree_map_with_path(scaled, layers)


def successor_params(target: Any, successor: np.ndarray, margin: float, layer_scale: float, seed: int,
                     unit_norm: float) -> dict[str, Any]:
    """The params of `target` rebuilt so that its greedy next token is (nearly always) `successor[last token]`
    (`successor_target`, `_qwen3_5_testing.successor_qwen3_5`): unit-RMS random embedding rows, LM-head row v
    `margin / H * embed[successor^-1[v]]`, the final norm's weight `unit_norm` (the value that is a unit gain),
    every output projection times `layer_scale`. Each leaf is committed where `target`'s leaf of that name is (an
    untied head beside a tied one: where the embedding is), when that one is committed (loaded): the rebuilt
    target then runs the programs compiled for `target` instead of compiling them again for uncommitted arrays."""
    vocab, hidden, dtype = target.config.vocab_size, target.config.hidden_size, target.embed.dtype
    embed = jax.random.normal(jax.random.key(seed), (vocab, hidden), jnp.float32)
    embed = embed / jnp.sqrt(jnp.mean(embed * embed, axis=1, keepdims=True))  # unit RMS rows
    predecessor = jnp.argsort(jnp.asarray(successor))  # predecessor[successor[t]] = t
    params = {
        "embed_tokens": {"weight": embed.astype(dtype)},
        "lm_head": {"weight": (embed[predecessor] * (margin / hidden)).astype(dtype)},  # an untied head
        "norm": {"weight": jnp.full((hidden,), unit_norm, dtype)},
        "layers": scaled_outputs(target.params["layers"], layer_scale),
    }
    old = {"lm_head": target.params["embed_tokens"], **target.params}

    def place(new: jax.Array, was: jax.Array) -> jax.Array:
        return jax.device_put(new, was.sharding) if was.committed else new

    return jax.tree.map(place, params, {name: old[name] for name in params})


def successor_target(target: DecoderTarget, successor: np.ndarray, *, margin: float = 10.0,
                     layer_scale: float = 0.5, seed: int = 0) -> DecoderTarget:
    """The target rebuilt so that its greedy next token is (nearly always) `successor[last token]`.

    successor: a permutation of the vocabulary. Embedding rows are random with unit RMS; LM-head row v is
    `margin / H * embed[successor^-1[v]]`, so for a residual stream equal to `embed[t]` the logit of
    `successor[t]` is `margin` and the others are about `N(0, margin^2 / H)`. Attention and MLP outputs are
    scaled by `layer_scale`: the earlier tokens still move the logits a little, and sometimes the winner.
    """
    params = successor_params(target, successor, margin, layer_scale, seed, unit_norm=1.0)
    return dataclasses.replace(target, params=params)


def successor_drafter(drafter: Drafter, successor: np.ndarray, *, scale: float = 100.0, seed: int = 0) -> Drafter:
    """A DSpark drafter whose Markov head walks `successor`: row k drafts `successor^(k+1)[anchor]`.

    The Markov bias of row k is `markov_w2 @ markov_w1[prev]`; with `markov_w1[t] = u_t` and
    `markov_w2[v] = scale * u_{successor^-1[v]}` it is `scale` at `successor[prev]` and `scale * <u_s, u_t>` elsewhere.
    For rank >= vocab the codes u are one-hot (exact); otherwise random unit vectors (cross terms about
    `scale / sqrt(rank)`, far below `scale`). `scale` drowns the backbone's own logits.
    """
    params = drafter.params
    if "markov_head" not in params:
        raise ValueError("successor_drafter needs a DSpark drafter (one with a markov_head)")
    V, r = params["markov_head"]["markov_w1"]["weight"].shape
    dtype = params["markov_head"]["markov_w1"]["weight"].dtype
    if r >= V:
        codes = jnp.eye(V, r, dtype=jnp.float32)
    else:
        codes = jax.random.normal(jax.random.key(seed), (V, r), jnp.float32)
        codes = codes / jnp.linalg.norm(codes, axis=1, keepdims=True)
    predecessor = jnp.argsort(jnp.asarray(successor))
    markov = {"markov_w1": {"weight": codes.astype(dtype)},
              "markov_w2": {"weight": (scale * codes[predecessor]).astype(dtype)}}
    return dataclasses.replace(drafter, params={**params, "markov_head": markov})

"""Qwen3.5 hybrid targets for tests, examples and benchmarks: random checkpoints and random in-memory targets.

- `write_qwen3_5_checkpoint(directory, "tiny-qwen3_5")`: a random Hugging Face directory (config.json +
  safetensors) that `Qwen3_5Target.from_pretrained` and transformers' `Qwen3_5ForCausalLM` load (checked by hand:
  float32 logits within 1.6e-5); "tiny-qwen3_5-vl" lays it out as a multimodal `Qwen3_5ForConditionalGeneration`
  checkpoint does (the text model under `model.language_model.`, a `text_config`, plus a vision and an MTP tensor
  a text target skips; not a loadable vision model). The tiny
  presets have hidden 64, vocab 128 and 2 layers (linear, full: `layer_types` stated), so the tiny drafters'
  `target_layer_ids` [0, 1] are valid. "tiny-qwen3_5-moe" is the MoE variant (`qwen3_5_moe_text`,
  `Qwen3_5MoeForCausalLM`: 8 experts, top-2, expert width 32, shared expert 32), written with the experts fused
  as released (`experts.gate_up_proj [E, 2I, H]`, `experts.down_proj`). "tiny-qwen3_5-tp" and
  "tiny-qwen3_5-moe-tp" split over tensor axes of 2 and 4 (8 heads, 2 KV heads, 4 delta-net key and
  8 value heads).
  Every checkpoint stores the delta net's `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a` and `conv1d`, as
  released.
- `random_qwen3_5(config)`: random weights drawn on the device, each as its spec's initialiser draws it.
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

from ._qwen3_testing import successor_params
from .plan import init_leaves
from .safetensors import write_tensors
from .target.qwen3_5 import MULTIMODAL_PREFIX, Qwen3_5Target, fuse_stored, plan_qwen3_5
from .target.qwen3_5_config import Qwen3_5Config, parse_qwen3_5_config

_TINY_TEXT = {
    "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "hidden_act": "silu",
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False, "attn_output_gate": True,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "full_attention_interval": 2,
    # stated (as the interval derives it): the drafters' taps [0, 1] a delta-net layer's output and the last one's
    "layer_types": ["linear_attention", "full_attention"],
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                        "mrope_section": [1, 1, 0], "mrope_interleaved": True},
    "bos_token_id": 0, "eos_token_id": 1,
}
_TINY_MOE = {**{k: v for k, v in _TINY_TEXT.items() if k != "intermediate_size"},
             "architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text",
             "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
             "shared_expert_intermediate_size": 32}
_TP = {"num_attention_heads": 8, "head_dim": 8, "linear_num_key_heads": 4,
       "linear_num_value_heads": 8, "linear_key_head_dim": 8, "linear_value_head_dim": 8}
QWEN3_5_TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny-qwen3_5": _TINY_TEXT,
    "tiny-qwen3_5-tied": {**_TINY_TEXT, "tie_word_embeddings": True},
    # tensor-parallel tests: 8 heads, 2 KV heads (split by 2 devices, replicated by 4), 4 delta-net key heads
    # serving 8 value heads (two each): every split divides by 2 and 4
    "tiny-qwen3_5-tp": {**_TINY_TEXT, **_TP},
    "tiny-qwen3_5-moe": _TINY_MOE,
    "tiny-qwen3_5-moe-tp": {**_TINY_MOE, **_TP},
    "tiny-qwen3_5-vl": {
        "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "tie_word_embeddings": False,
        "text_config": {k: v for k, v in _TINY_TEXT.items() if k not in ("architectures", "tie_word_embeddings")},
        "vision_config": {"model_type": "qwen3_5_vision", "depth": 1, "hidden_size": 16, "out_hidden_size": 64},
    },
}
# Tensors of a multimodal checkpoint outside the text model (a text target reads none of them)
_OTHER_TENSORS = {"model.visual.patch_embed.proj.weight": (16, 3, 2, 4, 4), "mtp.fc.weight": (64, 128)}


def _config(config: str | dict[str, Any]) -> dict[str, Any]:
    return copy.deepcopy(QWEN3_5_TINY_CONFIGS[config] if isinstance(config, str) else config)


def write_qwen3_5_checkpoint(
    directory: str | os.PathLike[str],
    config: str | dict[str, Any] = "tiny-qwen3_5",
    *,
    seed: int = 0,
    num_shards: int = 1,
    dtype: str = "bfloat16",
) -> Qwen3_5Config:
    """Write a random Qwen3.5 checkpoint of `config` (a preset name or a raw `qwen3_5_text` / multimodal
    `qwen3_5` config dict) to `directory`; each weight drawn by its spec's initialiser
    (`target.qwen3_5.parameter_spec`). A multimodal config is written with the text model under
    `model.language_model.` and a vision and an MTP tensor. Returns the parsed (text) config."""
    raw = _config(config)
    raw["torch_dtype"] = dtype
    parsed = parse_qwen3_5_config(raw, source="write_qwen3_5_checkpoint")
    multimodal = "text_config" in raw
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    out_dtype = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}[dtype]
    plan = plan_qwen3_5(parsed, MULTIMODAL_PREFIX if multimodal else "model.")
    # the stored layout: delta-net q/k/v projections and convs fused, experts' gate and up fused (as released)
    arrays = fuse_stored({t.name: t.init.host(rng, t.shape).astype(out_dtype) for t in plan}, parsed)
    if multimodal:
        arrays |= {name: rng.standard_normal(shape).astype(out_dtype) for name, shape in _OTHER_TENSORS.items()}
    (directory / "config.json").write_text(json.dumps(raw, indent=2))
    write_tensors(directory, arrays, num_shards)
    return parsed


def random_qwen3_5(config: Qwen3_5Config | dict[str, Any] | str = "tiny-qwen3_5", *, seed: int = 0,
                   dtype=jnp.bfloat16) -> Qwen3_5Target:
    """A Qwen3.5 target with random weights drawn on the default device (as `write_qwen3_5_checkpoint` draws
    them), no checkpoint."""
    if not isinstance(config, Qwen3_5Config):
        config = parse_qwen3_5_config(_config(config), source="random_qwen3_5")
    plan = plan_qwen3_5(config)
    keys = jax.random.split(jax.random.key(seed), len(plan))
    return Qwen3_5Target(params=Qwen3_5Target.tree(plan, init_leaves(keys, plan, dtype)),
                         config=config)


def successor_qwen3_5(target: Qwen3_5Target, successor: np.ndarray, *, margin: float = 10.0,
                      layer_scale: float = 0.5, seed: int = 0) -> Qwen3_5Target:
    """The hybrid target rebuilt as `_qwen3_testing.successor_target` rebuilds a dense one: its greedy next token
    is (nearly always) `successor[last token]`, every mixer's and MLP's output scaled by `layer_scale`. The final
    norm is zero-centred here (`(1 + w) * x_hat`): a zero weight is its unit gain."""
    params = successor_params(target, successor, margin, layer_scale, seed, unit_norm=0.0)  # (1 + w) gains
    return dataclasses.replace(target, params=params)

"""Random Hugging Face Qwen3 checkpoints (config.json + safetensors) for tests, examples and demos.

`write_qwen3_checkpoint(directory, "tiny-qwen3")` writes a directory that both `Qwen3Target.from_pretrained`
and transformers' `Qwen3ForCausalLM.from_pretrained` load. The tiny presets match the tiny drafters of
`dflash_jax.testing` (hidden 64, vocab 128, 6 layers: `target_layer_ids` [1, 3] are valid), so any tiny drafter
can be paired with a tiny target.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from .target import Qwen3Config, parse_qwen3_config, plan_qwen3
from .safetensors import write_tensors
from .testing import random_tensor

_TINY_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu",
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rope_scaling": None, "tie_word_embeddings": False,
    "attention_bias": False, "attention_dropout": 0.0, "use_sliding_window": False, "sliding_window": None,
    "max_window_layers": 6, "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16",
}
QWEN3_TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny-qwen3": _TINY_QWEN3,
    "tiny-qwen3-tied": {**_TINY_QWEN3, "tie_word_embeddings": True},
}


def write_qwen3_checkpoint(
    directory: str | os.PathLike[str],
    config: str | dict[str, Any] = "tiny-qwen3",
    *,
    seed: int = 0,
    num_shards: int = 1,
    dtype: str = "bfloat16",
    tensors: dict[str, np.ndarray] | None = None,
) -> Qwen3Config:
    """Write a random Qwen3 checkpoint of `config` (a preset name or a raw config dict) to `directory`.

    Weights are drawn as the drafter test checkpoints' are (`testing.random_tensor`: norms near 1, linears
    scaled by fan-in). `tensors` replaces given tensors by name (e.g. a hand-built `lm_head.weight`);
    `num_shards > 1` writes shards plus an index; `dtype` is "bfloat16" or "float32". Returns the config.
    """
    raw = copy.deepcopy(QWEN3_TINY_CONFIGS[config] if isinstance(config, str) else config)
    raw["torch_dtype"] = dtype
    parsed = parse_qwen3_config(raw, source=f"qwen3 config {config if isinstance(config, str) else ''}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    out_dtype = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}[dtype]
    arrays = {t.name: random_tensor(t, parsed, rng).astype(out_dtype) for t in plan_qwen3(parsed)}
    for name, value in (tensors or {}).items():
        if name not in arrays:
            raise KeyError(f"{name!r} is not a tensor of this Qwen3 checkpoint")
        arrays[name] = np.asarray(value).astype(out_dtype).reshape(arrays[name].shape)
    (directory / "config.json").write_text(json.dumps(raw, indent=2))
    write_tensors(directory, arrays, num_shards)
    return parsed

"""Random, structurally exact drafter checkpoints for tests, demos, benchmarks and users' own pipelines.

`write_checkpoint(directory, config)` writes config.json and safetensors holding exactly the tensors a
released checkpoint of that config holds (every family, bare or `model.`-prefixed, single file or sharded
with an index, BF16, NVFP4 or FP8). `config` is a `DflashConfig`, a raw config dict, or the name of a preset:
one of the released drafters in `configs/` (real shapes) or one of the tiny configs below (fast tests).
`random_drafter(config)` draws the same tensors on the device without a checkpoint. Qwen3 and Llama targets to
pair with them: `write_qwen3_checkpoint` (presets tiny-qwen3*, tiny-llama*), `random_qwen3`, and
`successor_target` / `successor_drafter` (a target and a drafter that agree, for the accept path), from
`dflash_jax._qwen3_testing`; Qwen3.5 hybrid targets: `write_qwen3_5_checkpoint` (presets tiny-qwen3_5*),
`random_qwen3_5`, `successor_qwen3_5`, from `dflash_jax._qwen3_5_testing`; `random_nemotron_h`,
`successor_nemotron_h`, from `dflash_jax._nemotron_h_testing`.
"""

from __future__ import annotations

import copy
import functools
import json
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from ._nemotron_h_testing import (  # noqa: F401  (the Nemotron-H target helpers, re-exported)
    random_nemotron_h,
    successor_nemotron_h,
    write_nemotron_h_checkpoint,
)
from ._qwen3_5_testing import (  # noqa: F401  (the Qwen3.5 hybrid target helpers, re-exported)
    QWEN3_5_TINY_CONFIGS,
    random_qwen3_5,
    successor_qwen3_5,
    write_qwen3_5_checkpoint,
)
from ._qwen3_testing import (  # noqa: F401  (the Qwen3 target helpers, re-exported)
    QWEN3_TINY_CONFIGS,
    random_qwen3,
    successor_drafter,
    successor_target,
    write_qwen3_checkpoint,
)
from .config import DflashConfig, parse_config
from .drafter import Drafter
from .fp8.checkpoint import declare_fp8, fp8_tensors
from .nvfp4.checkpoint import declare_nvfp4, exclusion_matcher, nvfp4_tensors
from .plan import build_tree, full_plan, init_leaves
from .safetensors import write_tensors
from .spec import INT, LINEAR

__all__ = ["TINY_CONFIGS", "presets", "preset_dict", "resolve_config", "random_drafter", "write_checkpoint",
           "QWEN3_TINY_CONFIGS", "random_qwen3", "successor_drafter", "successor_target", "write_qwen3_checkpoint",
           "QWEN3_5_TINY_CONFIGS", "random_qwen3_5", "successor_qwen3_5", "write_qwen3_5_checkpoint"]

_BASE_TINY = {
    "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
    "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "num_target_layers": 2, "block_size": 8,
    "dflash_config": {"mask_token_id": 127, "target_layer_ids": [0, 1]},
}
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny-dflash": _BASE_TINY,
    "tiny-dflash2": {
        **_BASE_TINY, "architectures": ["DFlash2DraftModel"], "is_causal": False,
        "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8, "use_sliding_window": True,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "rope_theta": 10000.0,
        "dflash_config": {"mask_token_id": 127, "target_layer_ids": [0, 1], "block_size": 8,
                          "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 16, "selector_top_k": 4,
                          "final_logit_softcapping": 20.0, "output_multiplier": 0.5},
    },
    "tiny-dspark": {
        **{k: v for k, v in _BASE_TINY.items() if k != "dflash_config"},
        "architectures": ["DSparkDraftModel"], "block_size": 7, "markov_rank": 32, "markov_head_type": "vanilla",
        "enable_confidence_head": True, "mask_token_id": 127, "target_layer_ids": [0, 1],
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "original_max_position_embeddings": 64},
        "dspark_config": {"markov_rank": 32, "mask_token_id": 127, "target_layer_ids": [0, 1]},
    },
    # NVIDIA's Nemotron 3.5 Lightning drafters (configs/nvidia-nemotron-3.5-lightning-*-nvfp4.json), tiny: their
    # own embedding, no LM head, W4A16 NVFP4 (the DSpark's attention and embeddings excluded); the DFlash one
    # bidirectional with YaRN x128, the DSpark one block-causal in a context window, with sinks and a bonus anchor
    "tiny-nemotron-dflash": {
        **{k: v for k, v in _BASE_TINY.items() if k not in ("rope_theta", "num_target_layers")},
        "has_embed_tokens": True, "mask_token_id": 127, "target_layer_ids": [-1, 0, 1],
        "max_position_embeddings": 1048576,
        "rope_parameters": {"factor": 128.0, "original_max_position_embeddings": 8192, "rope_theta": 10000,
                            "rope_type": "yarn"},
        "dflash_config": {"causal": False, "target_layer_ids": [-1, 0, 1]},
        "quantization_config": {"quant_algo": "W4A16_NVFP4", "group_size": 16, "exclude_modules": ["embed_tokens"]},
    },
    "tiny-nemotron-dspark": {
        **{k: v for k, v in _BASE_TINY.items() if k not in ("dflash_config", "num_target_layers")},
        "architectures": ["Qwen3DSparkModel"], "attention_sink_bias": True, "dspark_bonus_anchor": True,
        "dspark_markov_rank": 32, "markov_rank": 32, "sample_from_anchor": False, "has_embed_tokens": True,
        "target_layer_ids": [-1, 0, 1],
        "dflash_config": {"attention_sink_bias": True, "causal": True, "mask_token_id": 127, "swa_window_size": 6,
                          "target_layer_ids": [-1, 0, 1], "use_swa": True, "sample_from_anchor": False},
        "quantization_config": {"quant_algo": "W4A16_NVFP4", "group_size": 16,
                                "exclude_modules": ["embed_tokens", "markov_head.markov_w1", "layers.*.self_attn*"]},
    },
    # DeepSpec's Gemma 4 DSpark as its build_draft_config + save_pretrained (transformers 5.10.2) write it: the
    # target's Gemma 4 text config with the draft fields added (a K = V global layer: global_head_dim,
    # num_global_key_value_heads); tests/data/golden/gemma4-dspark-tiny-a is one, written by DeepSpec
    "tiny-gemma4-dspark": {
        "architectures": ["Gemma4DSparkModel"], "model_type": "gemma4_text", "target_model_type": "gemma4",
        "target_text_model_type": "gemma4_text", "attention_bias": False, "attention_dropout": 0.0,
        "attention_k_eq_v": True, "block_size": 7, "bos_token_id": 2, "confidence_head_with_markov": True,
        "dtype": "bfloat16", "eos_token_id": 1,
        "enable_confidence_head": True, "enable_moe_block": False, "final_logit_softcapping": 30.0,
        "global_head_dim": 32, "head_dim": 16, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 64,
        "hidden_size_per_layer_input": 0, "initializer_range": 0.02, "intermediate_size": 128,
        "layer_types": ["full_attention", "full_attention"], "markov_head_type": "vanilla", "markov_rank": 32,
        "mask_token_id": 4, "max_position_embeddings": 4096, "moe_intermediate_size": None, "num_anchors": 512,
        "num_attention_heads": 4, "num_experts": None, "num_global_key_value_heads": 1, "num_hidden_layers": 2,
        "num_key_value_heads": 2, "num_kv_shared_layers": 0, "num_target_layers": 4, "pad_token_id": 0,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {
            "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
            "rope_theta": None, "rope_type": "default",
            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}},
        "sliding_window": 512, "target_layer_ids": [1, 3], "tie_word_embeddings": False, "top_k_experts": None,
        "transformers_version": "5.10.2", "use_bidirectional_attention": None, "use_cache": True,
        "use_double_wide_mlp": False, "vocab_size": 128, "vocab_size_per_layer_input": 128,
    },
}


def _configs_dir() -> Path:
    packaged = Path(__file__).parent / "configs"  # wheel installs (force-included)
    return packaged if packaged.is_dir() else Path(__file__).parent.parent / "configs"  # source checkout


def presets() -> list[str]:
    """Names accepted wherever a config is: the released drafters of `configs/` and the tiny ones."""
    return sorted(p.stem for p in _configs_dir().glob("*.json")) + sorted(TINY_CONFIGS)


@functools.cache
def preset_dict(name: str) -> dict[str, Any]:
    if name in TINY_CONFIGS:
        return TINY_CONFIGS[name]
    file = _configs_dir() / f"{name}.json"
    if not file.is_file():
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(presets())}")
    return json.loads(file.read_text())


def resolve_config(config: DflashConfig | dict[str, Any] | str) -> tuple[DflashConfig, dict[str, Any]]:
    """A config given as a struct, a raw dict or a preset name -> (DflashConfig, raw dict to write)."""
    if isinstance(config, str):
        raw = copy.deepcopy(preset_dict(config))
        return parse_config(raw, source=f"preset {config}"), raw
    if isinstance(config, dict):
        return parse_config(config), copy.deepcopy(config)
    import msgspec

    raw = msgspec.to_builtins(config)
    return config, {k: v for k, v in raw.items() if v is not None}


def random_drafter(config: DflashConfig | dict[str, Any] | str, *, seed: int = 0, dtype=jnp.bfloat16) -> Drafter:
    """A drafter with random weights drawn on the default device (no checkpoint; for benchmarks at real
    sizes), each tensor as its spec's initialiser draws it (`spec.drafter_spec`: linears N(0, 1/fan_in), norm
    gains ~1, ...), plus a random target embedding (N(0, 1)) and LM head (N(0, 1/H)) attached."""
    config, _ = resolve_config(config)
    plan = full_plan(config)
    keys = jax.random.split(jax.random.key(seed), len(plan) + 2)
    leaves = init_leaves(keys, plan, dtype)
    shape = (config.vocab_size, config.hidden_size)
    return Drafter(params=build_tree(plan, leaves), config=config).attach(
        embed=jax.random.normal(keys[-2], shape, dtype),
        lm_head=jax.random.normal(keys[-1], shape, dtype) * (config.hidden_size**-0.5),
    )


def write_checkpoint(
    directory: str | os.PathLike[str],
    config: DflashConfig | dict[str, Any] | str,
    *,
    seed: int = 0,
    prefix: str = "",
    num_shards: int = 1,
    nvfp4: bool = False,
    own_embeddings: bool | None = None,
    fp8: bool = False,
) -> DflashConfig:
    """Write a random drafter checkpoint of `config` (a struct, raw dict or preset name) to `directory`.

    `prefix` is `""` (z-lab layout) or `"model."`; `num_shards > 1` writes shards plus
    `model.safetensors.index.json`; `nvfp4` stores every linear weight ModelOpt-style (packed U8 + F8
    block scales + F32 global scale, with hf_quant_config.json); `fp8` stores them as ModelOpt's FP8
    per-tensor export does (F8_E4M3 weight + F32 scale + input_scale, `quant_algo: "FP8"`); a config that declares
    its NVFP4 export (`quantization_config` with `exclude_modules`, as NVIDIA's Nemotron 3.5 drafters do) keeps
    that declaration and its excluded modules in BF16. `own_embeddings` adds `embed_tokens` and `lm_head` as
    DeepSpec DSpark drafters ship them; None (the default): `embed_tokens` alone where the config says
    `has_embed_tokens`. Returns the decoded config.
    """
    if nvfp4 and fp8:
        raise ValueError("write_checkpoint: nvfp4=True and fp8=True; choose one format")
    config, raw = resolve_config(config)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tensors: dict[str, np.ndarray] = {}
    declared = config.quantization_config if nvfp4 and config.quantization_config is not None else None
    excluded = exclusion_matcher(declared.ignore if declared is not None else ())
    for t in full_plan(config, prefix=prefix, own_embeddings=own_embeddings):
        value = t.init.host(rng, t.shape)  # float32, or int64 for d2t
        if nvfp4 and t.kind == LINEAR and not excluded(t.name.removeprefix(prefix).removesuffix(".weight")):
            packed = nvfp4_tensors(t.name, value)
            weight_only = declared is not None and declared.quant_algo == "W4A16_NVFP4"  # no activation scale
            tensors.update({k: v for k, v in packed.items() if not (weight_only and k.endswith(".input_scale"))})
        elif fp8 and t.kind == LINEAR:
            tensors.update(fp8_tensors(t.name, value))
        else:
            tensors[t.name] = value if t.kind == INT else value.astype(ml_dtypes.bfloat16)
    if nvfp4 and declared is None:
        declare_nvfp4(directory, raw, excluded=[])
    if fp8:
        declare_fp8(directory, raw)
    (directory / "config.json").write_text(json.dumps(raw, indent=2))
    write_tensors(directory, tensors, num_shards)
    return config

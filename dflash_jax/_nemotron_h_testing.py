"""Nemotron-H targets for tests and benchmarks.

- `random_nemotron_h(config)`: random weights drawn on the device.
- `successor_nemotron_h(target, successor)`: one rebuilt so that its greedy next token follows a fixed map of the
  last token (`_qwen3_testing.successor_target`'s construction), every block still running at full size.
- `write_nemotron_h_checkpoint(directory, raw, quantized=True)`: a random checkpoint directory, float or as
  NVIDIA's ModelOpt `MIXED_PRECISION` export lays out the released NVFP4 target (`quantized`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import types
from typing import Any

import jax.numpy as jnp
import numpy as np

from . import fp8, nvfp4
from ._qwen3_testing import successor_params
from .safetensors import write_tensors
from .target.nemotron_h_config import parse_nemotron_h_config
from .target.nemotron_h_spec import expert_tensors
from .target.nemotron_h_target import STACKS, NemotronHTarget, random_nemotron_h

__all__ = ["random_nemotron_h", "successor_nemotron_h", "write_nemotron_h_checkpoint"]

_NAMES = {"embeddings": "embed_tokens", "norm_f": "norm", "layers": "layers", "lm_head": "lm_head"}  # ours: theirs
# What the released NVFP4 target stores quantized (its hf_quant_config.json): name suffix -> ModelOpt quant_algo
FP8_W8A8 = (".mixer.in_proj.weight", ".mixer.out_proj.weight")  # Mamba blocks' only
NVFP4_W4A16 = (".up_proj.weight", ".down_proj.weight", "lm_head.weight")  # routed and shared experts, the head


def successor_nemotron_h(target: NemotronHTarget, successor: np.ndarray, *, margin: float = 10.0,
                         layer_scale: float = 0.5, seed: int = 0) -> NemotronHTarget:
    """The target whose greedy next token is (nearly always) `successor[last token]`: unit-RMS random embedding
    rows, LM-head row v `margin / H * embed[successor^-1[v]]`, `norm_f` a unit gain (`weight * x`), every mixer's
    output projection (Mamba and MLP `out_proj` / `down_proj`, attention `o_proj`, the experts' `down_proj`) times
    `layer_scale`."""
    renamed = {theirs: target.params[ours] for ours, theirs in _NAMES.items() if ours in target.params}
    view = types.SimpleNamespace(config=target.config, embed=target.embed, params=renamed)
    params = successor_params(view, successor, margin, layer_scale, seed, unit_norm=1.0)
    return dataclasses.replace(target, params={ours: params[theirs] for ours, theirs in _NAMES.items()})


def write_nemotron_h_checkpoint(directory: str | os.PathLike[str], raw: dict[str, Any], *, seed: int = 0,
                                quantized: bool = False, input_scale: float = 0.05) -> dict[str, np.ndarray]:
    """Write config.json (`raw`) and random float32 weights as transformers names them (one tensor per expert);
    with `quantized`, as ModelOpt's `MIXED_PRECISION` export stores the released NVFP4 target: Mamba `in_proj` /
    `out_proj` FP8 W8A8 (`weight` E4M3, `weight_scale`, a static `input_scale`), every routed and shared expert's
    `up_proj` / `down_proj` and `lm_head` W4A16 NVFP4 group 16 (`weight` U8, `weight_scale` E4M3,
    `weight_scale_2`), everything else as drawn, and `hf_quant_config.json` naming each quantized layer. Returns
    the tensors written."""
    config = parse_nemotron_h_config(raw, source="write_nemotron_h_checkpoint")
    target = random_nemotron_h(config, seed=seed, dtype=jnp.float32)
    tensors: dict[str, np.ndarray] = {}
    for t in NemotronHTarget.plan(config):
        value: Any = target.params
        for key in t.path:
            value = value[key]
        names = expert_tensors(config, t.name) if t.name.endswith(STACKS) else [t.name]
        tensors |= {name: np.asarray(part) for name, part in zip(names, value if len(names) > 1 else [value])}
    layers: dict[str, dict[str, Any]] = {}
    if quantized:
        for name in list(tensors):
            stem = name.removesuffix(".weight")
            if name.endswith(FP8_W8A8):
                weight, weight_scale = fp8.quantize(tensors[name])
                tensors |= {name: weight, stem + ".weight_scale": np.asarray(weight_scale, np.float32),
                            stem + ".input_scale": np.asarray(input_scale, np.float32)}
                layers[stem] = {"quant_algo": "FP8"}
            elif name.endswith(NVFP4_W4A16):
                packed, block_scale, scale_2 = nvfp4.quantize(tensors[name])
                tensors |= {name: packed, stem + ".weight_scale": block_scale,
                            stem + ".weight_scale_2": np.asarray(scale_2, np.float32)}
                layers[stem] = {"quant_algo": "W4A16_NVFP4", "group_size": 16}
    os.makedirs(directory, exist_ok=True)
    write_tensors(directory, tensors)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(raw, f, indent=2)
    if quantized:
        quant = {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None, "quantized_layers": layers}
        with open(os.path.join(directory, "hf_quant_config.json"), "w") as f:
            json.dump({"producer": {"name": "modelopt"}, "quantization": quant}, f, indent=2)
    return tensors

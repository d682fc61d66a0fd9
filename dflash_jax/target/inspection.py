"""`inspect_target`: what a target checkpoint directory holds, from its config.json and tensor headers alone
(`dflash-jax inspect <target dir>`): the family, its shape, experts, declared quantization, the feature taps a
drafter's `target_layer_ids` may name, and each planned tensor checked as `from_pretrained` would check it.
Nothing but headers and small JSON files is read.
"""

from __future__ import annotations

import collections
import os
from typing import Any

from ..errors import CheckpointError
from ..nvfp4.checkpoint import QUANT_CONFIG_FILE
from ..plan import check_tensors, tensor_report
from ..safetensors import Checkpoint, read_json
from .loading import family_of

__all__ = ["inspect_target"]


def inspect_target(path: str, file: str, raw: dict[str, Any]) -> dict[str, Any]:
    """The description of the target checkpoint directory `path`, whose config.json (`file`) was read as `raw`:
    `family` (the loader class and model type), `resolved` (layers, hidden size, heads, vocabulary, experts,
    quantization, taps) and `plan.tensor_report`'s `tensors`, `files`, `missing` and `malformed`. A config the family
    does not run is a `ConfigError`, as from `load_target`."""
    family = family_of(file, raw)
    config = family.parse(raw, file)
    failures: list[tuple[str, CheckpointError]] = []
    with Checkpoint(path) as stored:
        prefix = family.prefix(stored)
        plan = family.plan(config, prefix)
        check_tensors(plan, family.views(stored, config, prefix), path, failures)
        report = tensor_report(stored, failures)
    n = config.num_hidden_layers
    resolved = {
        "layers": _layers(config),
        "hidden_size": config.hidden_size,
        "heads (q/kv x dim)": f"{config.num_attention_heads}/{config.num_key_value_heads} x {config.head_dim}",
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_position_embeddings,
        "experts": (f"{config.num_experts}, {config.num_experts_per_tok} per token"
                    if getattr(config, "num_experts", 0) else "none (dense MLP)"),
        "quantization": _quantization(path, raw, report["tensors"]),
        "tied embeddings": bool(config.tie_word_embeddings),
        "feature taps": f"target_layer_ids in [-1, {n - 1}]: -1 the embedding output, l < {n - 1} layer l's output, "
                        f"{n - 1} the last layer's after the final norm",
    }
    return {"family": f"{family.__name__} ({config.model_type or config.MODEL_TYPE})",
            "architectures": raw.get("architectures"), "resolved": resolved, **report}


def _layers(config: Any) -> str:
    """The layer count and, for a hybrid, its mix: Qwen3.5's layer types counted, NemotronH's block pattern."""
    if hasattr(config, "pattern"):
        return f"{config.num_hidden_layers} ({config.pattern}: M Mamba-2, E MoE, * attention, - MLP)"
    kinds = collections.Counter(getattr(config, "layer_types", ()))
    mix = ", ".join(f"{count} {kind}" for kind, count in kinds.items())
    return f"{config.num_hidden_layers}" + (f" ({mix})" if mix else "")


def _quantization(path: str, raw: dict[str, Any], tensors: list[dict[str, Any]]) -> str:
    """What config.json's `quantization_config` and hf_quant_config.json declare, and the stored dtypes counted."""
    declared = []
    block = raw.get("quantization_config")
    if isinstance(block, dict):
        declared.append(str(block.get("quant_algo") or block.get("quant_method") or "declared"))
    exported = os.path.join(path, QUANT_CONFIG_FILE)
    if os.path.lexists(exported):  # read only if a regular file (`read_json`)
        block = read_json(exported, "the quantization config")
        block = block.get("quantization") if isinstance(block, dict) else None
        declared.append(str(block.get("quant_algo") if isinstance(block, dict) else f"unreadable {QUANT_CONFIG_FILE}"))
    dtypes = collections.Counter(t["dtype"] for t in tensors)
    stored = ", ".join(f"{count} {dtype}" for dtype, count in dtypes.most_common())
    return f"{' / '.join(declared) if declared else 'none declared'}; tensors: {stored or 'none'}"

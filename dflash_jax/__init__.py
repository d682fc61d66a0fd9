"""dflash_jax: load and run DFlash-family speculative-decoding drafters (DFlash, DFlash2, DSpark) in JAX.

    drafter = dflash_jax.load_drafter("path/to/drafter", mesh=mesh)        # typed config + replicated params
    drafter = drafter.attach(embed=target.embed, lm_head=target.lm_head)  # the target's, when not shipped
    logits = dflash_jax.draft_logits(drafter, target_hidden, block_ids, context_positions=..., block_positions=...)
    proposal, cache = dflash_jax.propose(drafter, cache, target_hidden, num_new, anchor_ids)
    result = dflash_jax.speculative_generate(target, drafter, prompt_ids, max_new_tokens=64)

Modules: `config` (config decoding), `safetensors` (header-first reading), `nvfp4` (ModelOpt NVFP4 and its
Pallas kernel), `spec` (every architecture's parameters, declared once), `plan` (a checkpoint's tensors planned
and checked), `validate` (value checks), `placement` (tensors onto devices), `loader` (checkpoint -> `Drafter`,
the type of `drafter`), `layers` and `rope` (the layers and rotary embeddings drafters and targets share),
`model` (the drafter forward), `drafting` (one cached drafting step), `target` (the target protocol;
`target.dense`: Qwen3 and Llama targets, tensor-parallel on a mesh; `target.qwen3_5`: the Qwen3.5/3.6 hybrids;
`target.moe`: their MoE block, `target.experts` its expert stacks from either disk layout; `target.delta_rule`,
`target.mamba2`: the recurrent mixers' maths; `target.loading`: `load_target`; `target.inspection`: what a
target directory holds, for `dflash-jax inspect`), `pairing` (is a drafter compatible with a target), `generate`
(the draft/verify loop), `adaptive` (its draft-length policy), `testing` (random checkpoints), `hub` (Hugging Face
hub ids), `nnx` / `linen` (Flax modules), `cli`. Each public module lists what it offers in `__all__`.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from ._version import VERSION as __version__

if TYPE_CHECKING:  # the names below are imported on first use (`__getattr__`): `dflash-jax --help` needs no JAX
    from .adaptive import Adaptive, Calibration, StepCosts
    from .compile_cache import enable_compile_cache
    from .config import DflashConfig, parse_config
    from .cost_store import CostStore
    from .drafter import Drafter, draft_to_target_ids
    from .drafting import ContextCache, Proposal, append_context, init_cache, propose, sample_drafts
    from .errors import CheckpointError, ConfigError, IncompatiblePairError
    from .generate import GenerationResult, greedy_generate, sample_generate, speculative_generate
    from .linen import DrafterModule
    from .loader import load_config, load_drafter
    from .model import AttentionOptions, draft_hidden, draft_logits
    from .pairing import check_pair
    from .sampling import Sampling
    from .target import Target
    from .target.dense import DecoderTarget, Qwen3Target
    from .target.loading import load_target
    from .target.qwen3_5 import Qwen3_5Target


# public name -> the module that defines it
_EXPORTS = {
    "DflashConfig": "config", "parse_config": "config",
    "Drafter": "drafter", "draft_to_target_ids": "drafter",
    "ContextCache": "drafting", "Proposal": "drafting", "append_context": "drafting", "init_cache": "drafting",
    "propose": "drafting", "sample_drafts": "drafting",
    "CheckpointError": "errors", "ConfigError": "errors", "IncompatiblePairError": "errors",
    "Adaptive": "adaptive", "Calibration": "adaptive", "StepCosts": "adaptive", "CostStore": "cost_store",
    "GenerationResult": "generate", "greedy_generate": "generate",
    "sample_generate": "generate", "speculative_generate": "generate",
    "DrafterModule": "linen",
    "load_config": "loader", "load_drafter": "loader",
    "AttentionOptions": "model", "draft_hidden": "model", "draft_logits": "model",
    "check_pair": "pairing",
    "enable_compile_cache": "compile_cache",
    "Sampling": "sampling",
    "Target": "target",
    "DecoderTarget": "target.dense", "Qwen3Target": "target.dense",
    "load_target": "target.loading",
    "Qwen3_5Target": "target.qwen3_5",
}


def __getattr__(name: str) -> Any:
    """Import what `name` needs on first use: an exported name from its module, or a submodule
    (`dflash_jax.hub`). Importing the package itself imports nothing of JAX, so the command line answers
    `--help` and argument errors at once."""
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    elif not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # later reads skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


__all__ = [
    "__version__",
    "Adaptive",
    "AttentionOptions",
    "Calibration",
    "CostStore",
    "CheckpointError",
    "ConfigError",
    "ContextCache",
    "DecoderTarget",
    "DflashConfig",
    "Drafter",
    "DrafterModule",
    "GenerationResult",
    "IncompatiblePairError",
    "Proposal",
    "Qwen3Target",
    "Qwen3_5Target",
    "Sampling",
    "StepCosts",
    "Target",
    "append_context",
    "check_pair",
    "draft_hidden",
    "draft_logits",
    "draft_to_target_ids",
    "enable_compile_cache",
    "greedy_generate",
    "init_cache",
    "load_config",
    "load_drafter",
    "load_target",
    "parse_config",
    "propose",
    "sample_drafts",
    "sample_generate",
    "speculative_generate",
]

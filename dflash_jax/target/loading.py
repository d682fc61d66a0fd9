"""`load_target`: a checkpoint directory or hub id -> the target its config.json's `architectures` names."""

from __future__ import annotations

import os
from typing import Unpack

import jax
import jax.numpy as jnp

from .._config_file import read_config_json
from ..hub import HubOptions, resolve
from .config import ARCHITECTURES, TARGET, is_drafter_config, not_a_target
from .dense import DecoderTarget
from .qwen3_5 import Qwen3_5Target
from .qwen3_5_config import ARCHITECTURES as QWEN3_5_ARCHITECTURES
from .qwen3_5_config import MOE_ARCHITECTURES


def load_target(
    path: str | os.PathLike[str],
    *,
    mesh: jax.sharding.Mesh | None = None,
    dtype: jnp.dtype = jnp.bfloat16,
    tensor_axis: str | None = "model",
    progress: bool | None = None,
    **hub: Unpack[HubOptions],
) -> DecoderTarget | Qwen3_5Target:
    """Load the target config.json's `architectures` names from a directory or a hub id, sharded over `mesh`, as
    the family's `from_pretrained` says: `DecoderTarget` for Qwen3ForCausalLM / LlamaForCausalLM, `Qwen3_5Target`
    for Qwen3_5ForCausalLM / Qwen3_5ForConditionalGeneration and the MoE Qwen3_5MoeForCausalLM /
    Qwen3_5MoeForConditionalGeneration; another architecture is a `ConfigError`."""
    path = resolve(path, **hub)
    file, raw = read_config_json(path, TARGET)
    names = raw.get("architectures")
    names = [a for a in names if isinstance(a, str)] if isinstance(names, list) else []
    kinds: list[type[DecoderTarget] | type[Qwen3_5Target]] = [
        Qwen3_5Target if a in QWEN3_5_ARCHITECTURES + MOE_ARCHITECTURES else DecoderTarget
        for a in names if a in (*ARCHITECTURES, *QWEN3_5_ARCHITECTURES, *MOE_ARCHITECTURES)]
    if not kinds or is_drafter_config(raw):
        raise not_a_target(file, raw, [*ARCHITECTURES, *QWEN3_5_ARCHITECTURES, *MOE_ARCHITECTURES])
    return kinds[0].from_pretrained(path, mesh=mesh, dtype=dtype, progress=progress, tensor_axis=tensor_axis)

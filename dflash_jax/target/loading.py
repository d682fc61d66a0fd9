"""`load_target`: a checkpoint directory or hub id -> the target its config.json's `architectures` names."""

from __future__ import annotations

import os
from typing import Unpack

import jax
import jax.numpy as jnp

from ..hub import HubOptions
from .dense import DecoderTarget


def load_target(
    path: str | os.PathLike[str],
    *,
    mesh: jax.sharding.Mesh | None = None,
    dtype: jnp.dtype = jnp.bfloat16,
    tensor_axis: str | None = "model",
    progress: bool | None = None,
    **hub: Unpack[HubOptions],
) -> DecoderTarget:
    """Load the target config.json's `architectures` names (`ARCHITECTURES`: Qwen3ForCausalLM, LlamaForCausalLM)
    from a directory or a hub id, sharded over `mesh`, as `DecoderTarget.from_pretrained` says; another
    architecture is a `ConfigError`."""
    return DecoderTarget.from_pretrained(path, mesh=mesh, dtype=dtype, progress=progress, tensor_axis=tensor_axis,
                                         **hub)


"""`load_target`: a checkpoint directory or hub id -> the target its config.json's `architectures` names.

`FAMILIES` is the one registry of the architectures the package runs, each to its family (`family.Family`);
config.json is read once, here, and handed to the family's load.
"""

from __future__ import annotations

import os
from types import MappingProxyType
from typing import Any, Unpack

import jax
import jax.numpy as jnp

from .._config_file import read_config_json
from ..hub import HubOptions, resolve
from .config import TARGET, is_drafter_config, not_a_target
from .dense import DecoderTarget
from .family import Family
from .nemotron_h_target import NemotronHTarget
from .qwen3_5 import Qwen3_5Target

__all__ = ["FAMILIES", "load_target"]

FAMILIES = MappingProxyType({architecture: family for family in (DecoderTarget, Qwen3_5Target, NemotronHTarget)
                             for architecture in family.ARCHITECTURES})


def load_target(
    path: str | os.PathLike[str],
    *,
    mesh: jax.sharding.Mesh | None = None,
    dtype: jnp.dtype = jnp.bfloat16,
    tensor_axis: str | None = "model",
    progress: bool | None = None,
    **hub: Unpack[HubOptions],
) -> Family:
    """Load the target its config.json's `architectures` names (`FAMILIES`) from a directory or a hub id, sharded over
    `mesh`, as the family's `from_pretrained` says: `DecoderTarget` for Qwen3ForCausalLM / LlamaForCausalLM,
    `Qwen3_5Target` for Qwen3_5ForCausalLM / Qwen3_5ForConditionalGeneration and the MoE Qwen3_5MoeForCausalLM /
    Qwen3_5MoeForConditionalGeneration, `NemotronHTarget` for NemotronHForCausalLM; another architecture is a
    `ConfigError`."""
    path = resolve(path, **hub)
    file, raw = read_config_json(path, TARGET)
    return family_of(file, raw).load(path, file, raw, mesh=mesh, dtype=dtype, progress=progress,
                                     tensor_axis=tensor_axis)


def named_family(raw: dict[str, Any]) -> type[Family] | None:
    """The family of the first architecture a config.json (read as `raw`) names that `FAMILIES` holds, or None."""
    names = raw.get("architectures")
    names = [a for a in names if isinstance(a, str)] if isinstance(names, list) else []
    return next((FAMILIES[a] for a in names if a in FAMILIES), None)


def family_of(file: str, raw: dict[str, Any]) -> type[Family]:
    """`named_family` of config.json (`file`, read as `raw`); none, or a drafter's config, is a `ConfigError`
    (`not_a_target`)."""
    family = named_family(raw)
    if family is None or is_drafter_config(raw):
        raise not_a_target(file, raw, list(FAMILIES))
    return family

"""NVFP4 at the checkpoint level: validating ModelOpt exports before loading, and writing them.

ModelOpt stores a quantized Linear under the same `<m>.weight` name a BF16 checkpoint uses (as U8 packed
codes) plus `<m>.weight_scale` (F8_E4M3) and `<m>.weight_scale_2` (F32 scalar); `<m>.input_scale` may be
present and is ignored (weights are dequantized, activations are not quantized). The export's
`hf_quant_config.json` and/or config.json `quantization_config` are checked against the tensors.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
from collections.abc import Callable, Set
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from ..config import DflashConfig, QuantizationConfig, normalise_quantization
from ..errors import CheckpointError
from ..safetensors import Checkpoint, read_json
from ._checks import check_nvfp4_shapes, check_scales
from ._reference import quantize

__all__ = ["nvfp4_tensors", "declare_nvfp4", "declared_quantization", "exclusion_matcher", "QUANT_CONFIG_FILE",
           "SUPPORTED_ALGOS"]

QUANT_CONFIG_FILE = "hf_quant_config.json"
SUPPORTED_ALGOS = ("NVFP4", "W4A16_NVFP4")  # weight-only dequantization is the same for both


def nvfp4_companions(name: str) -> tuple[str, str]:
    """The block-scale and global-scale tensors ModelOpt stores beside a packed `<m>.weight`."""
    stem = name.removesuffix(".weight")
    return stem + ".weight_scale", stem + ".weight_scale_2"


def check_packed(checkpoint: Checkpoint, name: str, expected_shape: tuple[int, ...]) -> None:
    """Check what the headers tell of a U8 `<m>.weight` and its companions: presence, dtypes, shapes against
    the config. Their values are checked later (`check_packed_scales`), once every tensor's header has passed."""
    info = checkpoint[name]
    scale_name, scale_2_name = nvfp4_companions(name)
    for companion in (scale_name, scale_2_name):
        if companion not in checkpoint:
            raise CheckpointError(
                f"{info.file}: tensor {name!r} is U8 (NVFP4-packed) but its companion {companion!r} is missing"
            )
    scale, scale_2 = checkpoint[scale_name], checkpoint[scale_2_name]
    if scale.dtype not in ("F8_E4M3", "U8"):
        raise CheckpointError(f"{scale.file}: tensor {scale_name!r} has dtype {scale.dtype}, expected F8_E4M3")
    if scale_2.dtype not in ("F32", "BF16", "F16"):
        raise CheckpointError(f"{scale_2.file}: tensor {scale_2_name!r} has dtype {scale_2.dtype}, expected F32")
    try:
        check_nvfp4_shapes(name, info.shape, scale.shape, scale_2.shape, expected_shape)
    except CheckpointError as e:
        raise CheckpointError(f"{info.file}: {e}") from None


def check_packed_scales(checkpoint: Checkpoint, name: str, dtype) -> None:
    """Check the scale values of a packed `<m>.weight` whose headers passed `check_packed` (`check_scales`)."""
    scale_name, scale_2_name = nvfp4_companions(name)
    try:
        check_scales(name, checkpoint.array(scale_name), checkpoint.array(scale_2_name), dtype)
    except CheckpointError as e:
        raise CheckpointError(f"{checkpoint[scale_name].file}: {e}") from None


def check_quant_config(directory: str, config: DflashConfig, packed: Set[str]) -> None:
    """Check that what the export declares (hf_quant_config.json, quantization_config) fits the tensors."""
    for source, quant in declared_quantization(directory, config):
        if quant.quant_algo is not None and quant.quant_algo not in SUPPORTED_ALGOS:
            raise CheckpointError(
                f"{source}: quant_algo {quant.quant_algo!r} but tensors are U8-packed; "
                f"expected one of {SUPPORTED_ALGOS}"
            )
        if quant.group_size is not None and quant.group_size != 16:
            raise CheckpointError(f"{source}: group_size {quant.group_size}; NVFP4 uses blocks of 16")
        excluded = exclusion_matcher(quant.ignore)
        for name in sorted(packed):
            module = name.removesuffix(".weight")
            if excluded(module) or excluded(name):
                raise CheckpointError(f"{source}: {module!r} is excluded from quantization but stored packed")


def declared_quantization(directory: str, config: DflashConfig) -> list[tuple[str, QuantizationConfig]]:
    """What the export declares, as (source file, block) pairs: hf_quant_config.json's `quantization`, then
    config.json's `quantization_config`."""
    declared: list[tuple[str, QuantizationConfig]] = []
    file = os.path.join(directory, QUANT_CONFIG_FILE)
    if os.path.lexists(file):  # read only if a regular file: a FIFO or a directory there is refused
        exported = read_json(file, "the quantization config")
        block = exported.get("quantization", {}) if isinstance(exported, dict) else None
        if not isinstance(block, dict):
            raise CheckpointError(f"{file}: expected an object with a `quantization` object, as ModelOpt writes")
        try:
            declared.append((file, msgspec.convert(normalise_quantization(block), QuantizationConfig)))
        except msgspec.ValidationError as e:
            raise CheckpointError(f"{file}: cannot read the quantization block ({e})") from None
    if config.quantization_config is not None:
        declared.append((os.path.join(directory, "config.json"), config.quantization_config))
    return declared


def exclusion_matcher(patterns: tuple[str, ...]) -> Callable[[str], bool]:
    """Whether a name matches any of ModelOpt's `ignore` / `exclude_modules` patterns (fnmatch, case-sensitive).

    Built once per list, not patterns x tensors `fnmatch` calls (100k patterns took 157 s that way): plain
    names go in a set, wildcard patterns into one compiled regular expression. The decoder caps the list at
    `config.MAX_IGNORE_PATTERNS`, so building stays well under a second.
    """
    literal = {p for p in patterns if not any(c in p for c in "*?[")}
    wildcards = [fnmatch.translate(p) for p in patterns if p not in literal]
    regex = re.compile("|".join(wildcards)) if wildcards else None
    return lambda name: name in literal or (regex is not None and regex.match(name) is not None)


def nvfp4_tensors(name: str, weight: np.ndarray) -> dict[str, np.ndarray]:
    """The tensors ModelOpt writes for one quantized Linear `name` (`<m>.weight`, [N, K])."""
    packed, scale, scale_2 = quantize(weight)
    scale_name, scale_2_name = nvfp4_companions(name)
    return {
        name: packed,
        scale_name: scale,
        scale_2_name: np.asarray(scale_2, np.float32).reshape(()),
        name.removesuffix(".weight") + ".input_scale": np.asarray(1.0, np.float32),  # written, then ignored
    }


def declare_nvfp4(directory: Path, raw_config: dict[str, Any], excluded: list[str]) -> None:
    """Write hf_quant_config.json and the config's `quantization_config` as ModelOpt's export does."""
    quant = {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16, "exclude_modules": excluded}
    (directory / QUANT_CONFIG_FILE).write_text(
        json.dumps({"producer": {"name": "modelopt"}, "quantization": quant}, indent=2)
    )
    raw_config["quantization_config"] = {
        "quant_method": "modelopt", "quant_algo": "NVFP4", "ignore": excluded,
        "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "float", "group_size": 16}}},
    }

"""FP8 per-tensor weights at the checkpoint level: validating ModelOpt FP8 exports before loading, and writing them.

ModelOpt stores an FP8 Linear under the BF16 name `<m>.weight` (F8_E4M3 [N, K]) with `<m>.weight_scale` (F32
scalar) and `<m>.input_scale` (ignored: weights are dequantized or multiplied weight-only, activations are not
quantized). The export's `hf_quant_config.json` / config.json `quantization_config` must say `FP8`. MXFP8
(E8M0 block-32 scales, U8 `[N, K/32]`) is refused by name: this package does not load it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CheckpointError
from ..safetensors import Checkpoint
from . import check_scale, quantize

__all__ = ["fp8_tensors", "declare_fp8", "SUPPORTED_ALGOS"]

SUPPORTED_ALGOS = ("FP8",)
REFUSED_ALGOS = {"MXFP8": "MXFP8 (E8M0 scales per block of 32)"}
SCALE_DTYPES = ("F32", "BF16", "F16")


def fp8_companions(name: str) -> tuple[str]:
    """The per-tensor scale ModelOpt stores beside an FP8 `<m>.weight`."""
    return (name.removesuffix(".weight") + ".weight_scale",)


def check_fp8(checkpoint: Checkpoint, name: str, expected_shape: tuple[int, ...]) -> None:
    """Check what the headers tell of an F8_E4M3 `<m>.weight` and its scale: presence, dtype, a per-tensor scale
    (an MXFP8 block scale is refused by name), the shape against the config. Values: `check_fp8_scale`."""
    info = checkpoint[name]
    (scale_name,) = fp8_companions(name)
    if scale_name not in checkpoint:
        raise CheckpointError(f"{info.file}: tensor {name!r} is F8_E4M3 (FP8) but its scale {scale_name!r} is missing")
    scale = checkpoint[scale_name]
    if scale.dtype == "U8" and len(info.shape) == 2 and len(scale.shape) == 2:
        raise CheckpointError(
            f"{scale.file}: tensor {scale_name!r} is U8 {list(scale.shape)}: E8M0 block scales of an "
            f"{REFUSED_ALGOS['MXFP8']} export, which dflash_jax does not load; expected FP8 per-tensor (F32 [])")
    if scale.dtype not in SCALE_DTYPES:
        raise CheckpointError(f"{scale.file}: tensor {scale_name!r} has dtype {scale.dtype}, expected F32")
    if tuple(scale.shape) not in ((), (1,)):
        raise CheckpointError(
            f"{scale.file}: tensor {scale_name!r} has shape {list(scale.shape)}; expected a per-tensor scale [] "
            "or [1] (ModelOpt FP8)")
    if tuple(info.shape) != tuple(expected_shape):
        raise CheckpointError(f"{info.file}: tensor {name!r} has shape {list(info.shape)}, expected "
                              f"{list(expected_shape)} from the config")


def check_fp8_scale(checkpoint: Checkpoint, name: str, dtype: Any) -> None:
    """Check the scale value of an FP8 `<m>.weight` whose headers passed `check_fp8` (`fp8.check_scale`)."""
    (scale_name,) = fp8_companions(name)
    try:
        check_scale(scale_name, checkpoint.array(scale_name), dtype)
    except CheckpointError as e:
        raise CheckpointError(f"{checkpoint[scale_name].file}: {e}") from None


def check_declared(declared: list[tuple[str, Any]], nvfp4: bool, fp8: bool) -> None:
    """Refuse a declared `quant_algo` this package does not load (`REFUSED_ALGOS`) by name, and one that does not
    fit FP8 tensors. `declared`: (source file, `QuantizationConfig`) pairs; `nvfp4` / `fp8`: which kinds of
    quantized tensors the checkpoint holds (NVFP4's own declarations are `nvfp4.checkpoint.check_quant_config`'s)."""
    for source, quant in declared:
        algo = quant.quant_algo
        if algo in REFUSED_ALGOS:
            raise CheckpointError(f"{source}: quant_algo {algo!r} is {REFUSED_ALGOS[algo]}, which dflash_jax does "
                                  "not load; expected NVFP4 or FP8 (per-tensor)")
        if fp8 and not nvfp4 and algo is not None and algo not in SUPPORTED_ALGOS:
            raise CheckpointError(f"{source}: quant_algo {algo!r} but tensors are F8_E4M3; expected one of "
                                  f"{SUPPORTED_ALGOS}")


def fp8_tensors(name: str, weight: np.ndarray) -> dict[str, np.ndarray]:
    """The tensors ModelOpt writes for one FP8 Linear `name` (`<m>.weight`, [N, K])."""
    data, scale = quantize(weight)
    (scale_name,) = fp8_companions(name)
    return {
        name: data,
        scale_name: np.asarray(scale, np.float32).reshape(()),
        name.removesuffix(".weight") + ".input_scale": np.asarray(1.0, np.float32),  # written, then ignored
    }


def declare_fp8(directory: Path, raw_config: dict[str, Any]) -> None:
    """Write hf_quant_config.json and the config's `quantization_config` as ModelOpt's FP8 export does."""
    quant: dict[str, Any] = {"quant_algo": "FP8", "kv_cache_quant_algo": None, "exclude_modules": []}
    (directory / "hf_quant_config.json").write_text(
        json.dumps({"producer": {"name": "modelopt"}, "quantization": quant}, indent=2))
    raw_config["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "FP8", "ignore": []}

"""Convert a BF16 drafter checkpoint to NVFP4, as NVIDIA ModelOpt would export it (`dflash-jax convert-nvfp4`)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from .._config_file import read_config_json
from ..errors import CheckpointError
from ..loader import load_config
from ..plan import open_checked
from ..safetensors import INDEX_FILE, write_tensors
from ..spec import LINEAR
from .checkpoint import QUANT_CONFIG_FILE, declare_nvfp4, nvfp4_tensors

__all__ = ["convert_checkpoint"]

# What makes a checkpoint, besides its *.safetensors files: replaced together, never mixed.
CHECKPOINT_FILES = (INDEX_FILE, "config.json", QUANT_CONFIG_FILE)


def convert_checkpoint(
    source: str | os.PathLike[str],
    destination: str | os.PathLike[str],
    *,
    exclude: Iterable[str] = (),
    overwrite: bool = False,
) -> int:
    """Quantize every linear weight of the drafter at `source` (except modules named in `exclude`) with
    ModelOpt's NVFP4 algorithm and write the result to `destination`; other tensors are copied unchanged.

    `destination` must be new or empty: a checkpoint left there would shadow or mix with the new one (its
    index would win over the new `model.safetensors`). With `overwrite=True`, its checkpoint files
    (`*.safetensors`, the index, config.json, hf_quant_config.json) are replaced whole: the new ones are
    written beside it first, then the old ones removed and the new ones moved in; other files stay.
    Returns the number of weights quantized. The whole checkpoint passes through host memory once. A source
    already quantized (NVFP4 or FP8 weights) is refused (`CheckpointError`), before anything is written.
    """
    source, destination = os.fspath(source), Path(destination)
    if destination.resolve() == Path(source).resolve():
        raise CheckpointError(f"{destination}: refusing to convert a checkpoint onto itself")
    if destination.exists() and not destination.is_dir():
        raise CheckpointError(f"{destination}: not a directory; expected a new or empty destination directory")
    if destination.is_dir() and any(destination.iterdir()) and not overwrite:
        raise CheckpointError(
            f"{destination}: not empty; expected a new or empty destination directory (or overwrite=True, "
            "`--overwrite`, to replace the checkpoint there)"
        )
    excluded = sorted(exclude)
    with open_checked(source, load_config(source)) as (checkpoint, _, plan, packed):
        if packed:  # quantizing the rest would mix formats under one declaration; a copy would claim a conversion
            kinds = sorted({"NVFP4" if checkpoint[n].dtype == "U8" else "FP8" for n in packed})
            raise CheckpointError(f"{source}: already quantized ({len(packed)} linear weights stored as "
                                  f"{' and '.join(kinds)}); convert-nvfp4 quantizes an unquantized (BF16, FP16 or "
                                  "FP32) drafter checkpoint: convert the one this was exported from")
        linear = {t.name for t in plan if t.kind == LINEAR}
        linear = {n for n in linear if n.removesuffix(".weight") not in excluded}
        tensors: dict[str, np.ndarray] = {}
        for name in checkpoint:
            array = checkpoint.array(name)
            tensors.update(nvfp4_tensors(name, array) if name in linear else {name: np.array(array)})
    _, raw = read_config_json(source, "a drafter checkpoint directory")  # read again: rewritten as it is
    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=destination.parent, prefix=f".{destination.name}.partial-"))
    try:
        declare_nvfp4(staging, raw, excluded)
        (staging / "config.json").write_text(json.dumps(raw, indent=2))
        write_tensors(staging, tensors)
        destination.mkdir(exist_ok=True)
        for old in destination.iterdir():
            if old.name.endswith(".safetensors") or old.name in CHECKPOINT_FILES:
                old.unlink()
        for new in staging.iterdir():
            new.replace(destination / new.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return len(linear)

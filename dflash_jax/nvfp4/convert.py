"""Convert a BF16 drafter checkpoint to NVFP4, as NVIDIA ModelOpt would export it (`dflash-jax convert-nvfp4`)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from ..config import load_config
from ..errors import CheckpointError
from ..safetensors import Checkpoint, write_tensors
from .checkpoint import declare_nvfp4, nvfp4_tensors


def convert_checkpoint(
    source: str | os.PathLike[str], destination: str | os.PathLike[str], *, exclude: Iterable[str] = ()
) -> int:
    """Quantize every linear weight of the drafter at `source` (except modules named in `exclude`) with
    ModelOpt's NVFP4 algorithm and write the result to `destination`; other tensors are copied unchanged.

    Returns the number of weights quantized. The whole checkpoint passes through host memory once.
    """
    from ..loader import check_tensor, find_prefix, plan_tensors

    source, destination = os.fspath(source), Path(destination)
    if destination.resolve() == Path(source).resolve():
        raise CheckpointError(f"{destination}: refusing to convert a checkpoint onto itself")
    config = load_config(source)
    excluded = sorted(exclude)
    with Checkpoint(source) as checkpoint:
        plan = plan_tensors(config, checkpoint.__contains__, find_prefix(checkpoint, source), source)
        linear = {t.name for t in plan if not check_tensor(t, checkpoint, source) and t.kind == "linear"}
        linear = {n for n in linear if n.removesuffix(".weight") not in excluded}
        tensors: dict[str, np.ndarray] = {}
        for name in checkpoint:
            array = checkpoint.array(name)
            tensors.update(nvfp4_tensors(name, array) if name in linear else {name: np.array(array)})
    with open(os.path.join(source, "config.json")) as f:
        raw = json.load(f)
    destination.mkdir(parents=True, exist_ok=True)
    declare_nvfp4(destination, raw, excluded)
    (destination / "config.json").write_text(json.dumps(raw, indent=2))
    write_tensors(destination, tensors)
    return len(linear)

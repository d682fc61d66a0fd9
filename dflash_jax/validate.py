"""Checks of tensor values that headers cannot show, run by the loader before anything is placed.

Headers give names, dtypes and shapes; a corrupted or badly exported checkpoint can still carry NaN/Inf
weights or a `d2t` that maps draft ids outside the target vocabulary. The policy (docs/errors.md):

- Every floating tensor of at most `SCAN_ELEMENTS` elements is scanned for NaN/Inf: RMSNorm gains,
  biases, DFlash2 conv base kernels, the confidence head. These are tiny (a few hundred KiB for a whole
  drafter), and a NaN there is almost certainly a corrupted file that would turn every draft into NaN, so
  it is an error naming the tensor. The big matrices (fc, projections, codebooks, Markov factors,
  embeddings) are not scanned by default: that would mean reading the whole checkpoint once more.
  `scan_checkpoint(path)` does the full read when you suspect a file.
- NVFP4 block scales and global scales are checked by `nvfp4.checkpoint.check_packed_scales`: not NaN,
  block scales >= 0, global scales finite and > 0, and their products within the load dtype, neither
  overflowing nor dequantizing a nonzero code to 0. FP8 per-tensor scales by `fp8.checkpoint.check_fp8_scale`:
  finite, > 0, normal, 2**-9 x scale normal, and 448 x scale within the load dtype and nonzero in it.
- `d2t` is read in chunks of `D2T_CHUNK` (one integer per draft token) and every `draft_id + d2t[draft_id]`
  must be a target id: `0 <= target < vocab_size`. A config that declares a draft vocabulary smaller than
  the target's needs a `d2t`: without one, draft ids would silently be taken for target ids.

These run only after every planned tensor's header has been checked (`plan.check_tensors`), so a missing
or misshapen tensor is reported before a byte of tensor data is read.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable

import numpy as np

from .config import DflashConfig
from .errors import CheckpointError
from .fp8.checkpoint import check_fp8_scale
from .nvfp4.checkpoint import check_packed_scales
from .plan import TensorPlan
from .safetensors import FLOAT_DTYPES, Checkpoint, TensorInfo
from .spec import INT

__all__ = ["scan_checkpoint", "check_tensor_values", "check_d2t"]

SCAN_ELEMENTS = 1 << 16  # tensors up to this many elements are scanned for NaN/Inf on every load
D2T_CHUNK = 1 << 20  # d2t entries compared at a time: bounded memory whatever the vocabulary


def check_d2t_present(config: DflashConfig, plan: Iterable[TensorPlan], checkpoint: Checkpoint) -> None:
    """A drafter whose config declares a reduced draft vocabulary must carry a `d2t`."""
    reduced = config.draft_vocab_size is not None and config.draft_vocab_size < config.vocab_size
    if reduced and not any(t.kind == INT for t in plan):
        raise CheckpointError(
            f"{checkpoint.path}: config declares draft_vocab_size={config.draft_vocab_size} < "
            f"vocab_size={config.vocab_size} but the checkpoint has no `d2t` (or `draft_id_to_target_id`); "
            "expected one, to map draft ids to target ids"
        )


def check_tensor_values(plan: Iterable[TensorPlan], checkpoint: Checkpoint, packed: frozenset[str], dtype,
                        vocab_size: int) -> None:
    """The value checks of every planned tensor, a drafter's or a target's: NVFP4 scales, `d2t`'s range (into
    `vocab_size`), NaN/Inf in small floating tensors (norm gains, biases)."""
    for t in plan:
        if t.name in packed:
            check = check_packed_scales if checkpoint[t.name].dtype == "U8" else check_fp8_scale
            check(checkpoint, t.name, dtype)
            continue
        info = checkpoint[t.name]
        if t.kind == INT:
            check_d2t(checkpoint, info, vocab_size)
        elif info.dtype in FLOAT_DTYPES and math.prod(info.shape) <= SCAN_ELEMENTS:
            check_finite(checkpoint, info)


def check_finite(checkpoint: Checkpoint, info: TensorInfo) -> None:
    """Raise `CheckpointError` naming the tensor when it holds a NaN or an Inf."""
    array = checkpoint.array(info.name)
    bad = ~np.isfinite(array)
    if bad.any():
        first = tuple(int(i) for i in np.unravel_index(int(np.argmax(bad)), array.shape))
        raise CheckpointError(
            f"{info.file}: tensor {info.name!r} holds {int(bad.sum())} NaN/Inf of {array.size} values "
            f"(first at index {list(first)}: {array[first]}); expected finite values: the file is corrupted"
        )


def check_d2t(checkpoint: Checkpoint, info: TensorInfo, vocab_size: int) -> None:
    """Every `draft_id + d2t[draft_id]` must be a target id in `[0, vocab_size)`; `D2T_CHUNK` ids at a time."""
    offsets = checkpoint.array(info.name).reshape(-1)
    bad, first = 0, None
    for start in range(0, offsets.size, D2T_CHUNK):
        chunk = offsets[start : start + D2T_CHUNK]
        draft = np.arange(start, start + chunk.size, dtype=np.int64)
        # Bound the offsets before any arithmetic, so that neither a U64 cast nor the sum can wrap around.
        in_range = (chunk >= -draft) & (chunk < vocab_size - draft) if chunk.dtype.kind == "i" else (
            chunk < vocab_size - draft.astype(np.uint64)
        )
        if not in_range.all():
            bad += int((~in_range).sum())
            first = start + int(np.argmin(in_range)) if first is None else first
    if first is not None:
        raise CheckpointError(
            f"{info.file}: tensor {info.name!r} maps draft id {first} to target id {first + int(offsets[first])} "
            f"(d2t[{first}] = {int(offsets[first])}), outside the target vocabulary [0, {vocab_size}); "
            f"{bad} of {offsets.size} ids out of range; expected draft + d2t[draft] < vocab_size"
        )


def scan_checkpoint(path: str | os.PathLike[str]) -> None:
    """Scan every floating tensor of a checkpoint (a directory or a .safetensors file) for NaN/Inf.

    A full read of the checkpoint, for files you suspect; `load_drafter` scans only the small tensors.
    Raises `CheckpointError` naming the first bad tensor.
    """
    with Checkpoint(path) as checkpoint:
        for name in sorted(checkpoint):
            info = checkpoint[name]
            if info.dtype in FLOAT_DTYPES:
                check_finite(checkpoint, info)

"""The PyTorch goldens of tests/data/golden (README there), as the tests read them."""

from __future__ import annotations

import functools
import os

import jax.numpy as jnp
import numpy as np

from dflash_jax.drafter import Drafter
from dflash_jax.loader import load_drafter
from dflash_jax.model import AttentionOptions

from ._drafters import GOLDEN
from ._io import load_file

# The reference's generate helper runs DFlash2's sliding layers unwindowed and bidirectional (z-lab's rule);
# `*_masked` outputs are SpecForge's training masks, dflash_jax's default rule for `is_causal: false`.
UNWINDOWED = AttentionOptions(causal=False, sliding_window=False)
CASES = {  # case: (golden directory, io suffix, attention)
    "dflash-tiny-a": ("dflash-tiny-a", "", AttentionOptions()),
    "dflash-tiny-b": ("dflash-tiny-b", "", AttentionOptions()),
    "dspark-tiny-a": ("dspark-tiny-a", "", AttentionOptions()),
    "dspark-tiny-b": ("dspark-tiny-b", "", AttentionOptions()),
    "dflash2-tiny-a": ("dflash2-tiny-a", "", UNWINDOWED),
    "dflash2-tiny-b": ("dflash2-tiny-b", "", UNWINDOWED),
    "dflash2-tiny-b-masked": ("dflash2-tiny-b", "_masked", AttentionOptions()),
}


@functools.cache
def golden(case: str, dtype=jnp.float32) -> tuple[Drafter, dict[str, np.ndarray]]:
    """(the drafter, with the golden embedding and LM head attached unless it ships its own; the io tensors with
    the case's suffix dropped from its `expected_*` names)."""
    directory, suffix, _ = CASES[case]
    io = load_file(os.path.join(GOLDEN, directory, "io.safetensors"))
    if suffix:  # the lattice is stored for the unmasked rule only
        io = {k: v for k, v in io.items() if k != "expected_lattice"}
        io.update({k.removesuffix(suffix): v for k, v in io.items() if k.endswith(suffix)})
    drafter = load_drafter(os.path.join(GOLDEN, directory), dtype=dtype)
    if "embed_tokens" not in drafter.params:  # z-lab and DFlash2 drafters use the target's
        drafter = drafter.attach(embed=jnp.asarray(io["embed"]), lm_head=jnp.asarray(io["lm_head"]))
    return drafter, io

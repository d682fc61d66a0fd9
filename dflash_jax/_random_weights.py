"""Random weights in the range trained ones have, for the test checkpoints of drafters and targets."""

from __future__ import annotations

import numpy as np

from .config import DflashConfig
from .loader import TensorPlan


def random_tensor(t: TensorPlan, config: DflashConfig, rng: np.random.Generator) -> np.ndarray:
    """Values in the range trained weights have, so forward passes stay well conditioned."""
    leaf = t.path[-1]
    if t.kind == "int":  # d2t: a sorted subset of the target vocabulary, as offsets
        target = np.sort(rng.choice(config.vocab_size, size=t.shape[0], replace=False))
        return (target - np.arange(t.shape[0])).astype(np.int64)
    if leaf == "base_kernel":  # identity first tap plus a little noise, as initialised
        kernel = 0.1 * rng.standard_normal(t.shape)
        kernel[:, 0] += 1.0
        return kernel.astype(np.float32)
    if leaf == "weight" and len(t.shape) == 1:  # RMSNorm gains
        return (1.0 + 0.1 * rng.standard_normal(t.shape)).astype(np.float32)
    if leaf == "bias":
        return (0.02 * rng.standard_normal(t.shape)).astype(np.float32)
    fan_in = t.shape[-1]
    return (rng.standard_normal(t.shape) / np.sqrt(fan_in)).astype(np.float32)

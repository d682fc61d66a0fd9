"""Nemotron-H targets for tests and benchmarks: `random_nemotron_h(config)` draws random weights on the device;
`successor_nemotron_h(target, successor)` rebuilds one so that its greedy next token follows a fixed map of the
last token (`_qwen3_testing.successor_target`'s construction), every block still running at full size."""

from __future__ import annotations

import dataclasses
import types

import numpy as np

from ._qwen3_testing import successor_params
from .target.nemotron_h_target import NemotronHTarget, random_nemotron_h

__all__ = ["random_nemotron_h", "successor_nemotron_h"]

_NAMES = {"embeddings": "embed_tokens", "norm_f": "norm", "layers": "layers", "lm_head": "lm_head"}  # ours: theirs


def successor_nemotron_h(target: NemotronHTarget, successor: np.ndarray, *, margin: float = 10.0,
                         layer_scale: float = 0.5, seed: int = 0) -> NemotronHTarget:
    """The target whose greedy next token is (nearly always) `successor[last token]`: unit-RMS random embedding
    rows, LM-head row v `margin / H * embed[successor^-1[v]]`, `norm_f` a unit gain (`weight * x`), every mixer's
    output projection (Mamba and MLP `out_proj` / `down_proj`, attention `o_proj`, the experts' `down_proj`) times
    `layer_scale`."""
    renamed = {theirs: target.params[ours] for ours, theirs in _NAMES.items() if ours in target.params}
    view = types.SimpleNamespace(config=target.config, embed=target.embed, params=renamed)
    params = successor_params(view, successor, margin, layer_scale, seed, unit_norm=1.0)
    return dataclasses.replace(target, params={ours: params[theirs] for ours, theirs in _NAMES.items()})

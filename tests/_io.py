"""Shared test I/O: independent safetensors reading and writing (the safetensors package's own, not the package
under test), rewriting a checkpoint's tensors, a parameter-tree leaf by HF name, and a deadline for reads that
could hang.

safetensors.numpy looks dtypes up on the numpy module, which has no float8 types; ml_dtypes provides them.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable, Sequence
from typing import Any

import ml_dtypes
import numpy as np
from safetensors.numpy import load_file, save_file

for _name in ("float8_e4m3fn", "float8_e5m2", "bfloat16"):
    if not hasattr(np, _name):
        setattr(np, _name, getattr(ml_dtypes, _name))

__all__ = ["deadline", "leaf", "load_file", "rewrite_tensors", "save_file"]


def rewrite_tensors(directory: str | os.PathLike[str], change: Callable[[dict[str, np.ndarray]], Any]) -> str:
    """Apply `change` (edits the dict of name -> array in place) to `directory/model.safetensors`; its path."""
    path = os.path.join(directory, "model.safetensors")
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path)
    return path


def leaf(params: dict[str, Any], name: str | Sequence[str | int]) -> Any:
    """The leaf of a parameter tree at an HF tensor name (prefix stripped: `layers.0.mlp.up_proj.weight`) or at a
    path of keys (`("layers", 0, "mlp", "up_proj", "weight")`), following the documented tree."""
    node = params
    for key in name.split(".") if isinstance(name, str) else name:
        node = node[int(key)] if isinstance(key, str) and key.isdigit() else node[key]
    return node


@contextlib.contextmanager
def deadline(seconds: int):
    """Turn a hang into a test failure (SIGALRM; the suite runs on Linux)."""
    def fail(*_):
        raise TimeoutError(f"no answer within {seconds} s: a hang")
    previous = signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)

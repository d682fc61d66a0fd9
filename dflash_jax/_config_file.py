"""The one reader of a checkpoint's config.json, for drafters and targets alike (`load_config`,
`load_target`, the targets' `from_pretrained`, the NVFP4 converter): one set of guards for every kind of
checkpoint.

`generation_eos` reads the end-of-sequence ids of a checkpoint's generation_config.json through the same guards:
transformers stops generating at them, before config.json's `eos_token_id`.

The path is a checkpoint directory or the config.json itself; the file must be a regular file of at most
`config.MAX_CONFIG_BYTES` (a FIFO or a device, whose read could block forever, is refused), UTF-8 JSON with no
duplicate keys and an object at the top level. Every failure is a `ConfigError` naming the file.
"""

from __future__ import annotations

import os
from typing import Any

from .config import MAX_CONFIG_BYTES, decode_config_json
from .errors import CheckpointError, ConfigError
from .safetensors import read_small


def read_config_json(path: str | os.PathLike[str], expected: str, *, file_ok: bool = False
                     ) -> tuple[str, dict[str, Any]]:
    """`(file, raw dict)` of the config.json of the checkpoint directory `path` (with `file_ok`, `path` may be the
    config file itself). `expected`: what the caller loads, for the messages ("a drafter checkpoint directory")."""
    path = os.fspath(path)
    if not file_ok and os.path.isfile(path):  # a loader would go on to open it as a safetensors file
        raise ConfigError(f"{path}: a file, not a directory; expected {expected} holding config.json")
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if file.endswith(".safetensors"):
        raise ConfigError(f"{file}: a safetensors file; expected {expected} holding it and config.json")
    if not os.path.lexists(file):
        what = "a directory without config.json" if os.path.isdir(path) else "no such file"
        raise ConfigError(f"{path}: {what}; expected {expected} or its config.json")
    try:
        raw = read_small(file, "config.json", MAX_CONFIG_BYTES)
    except CheckpointError as e:
        raise ConfigError(str(e)) from None
    return file, decode_config_json(raw, file, f"the config.json of {expected}")


def generation_eos(directory: str | os.PathLike[str]) -> tuple[int, ...] | None:
    """The `eos_token_id` (one id or a list) of `directory`'s generation_config.json as a tuple, or None where the
    file or the key is absent (or null): then config.json's stands. A value of another type is a `ConfigError`
    naming the file."""
    file = os.path.join(os.fspath(directory), "generation_config.json")
    if not os.path.lexists(file):
        return None
    _, raw = read_config_json(file, "a generation_config.json", file_ok=True)
    eos = raw.get("eos_token_id")
    ids = [eos] if isinstance(eos, int) else eos
    if eos is None:
        return None
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise ConfigError(f"{file}: eos_token_id is {eos!r}; expected a token id or a list of them")
    return tuple(ids)

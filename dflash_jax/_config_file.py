"""The one reader of a checkpoint's config.json, for drafters and targets alike (`load_config`,
`load_target`, the targets' `from_pretrained`, the NVFP4 converter): one set of guards for every kind of
checkpoint.

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

"""The two errors the package raises for bad input.

Both are `ValueError`s so that callers who already catch that keep working; each message names the file
(or other source) and, where there is one, the tensor or field, and says what was expected.
"""


class ConfigError(ValueError):
    """A drafter config.json (or raw config) that cannot be decoded or is inconsistent."""


class CheckpointError(ValueError):
    """A checkpoint whose files or tensors are missing, malformed or disagree with the config."""

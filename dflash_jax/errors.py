
__all__ = ["ConfigError", "CheckpointError", "IncompatiblePairError"]
"""The errors the package raises for bad input.

All are `ValueError`s so that callers who already catch that keep working; each message names the file
(or other source) and, where there is one, the tensor or field, and says what was expected.
"""


class ConfigError(ValueError):
    """A drafter config.json (or raw config) that cannot be decoded or is inconsistent."""


class CheckpointError(ValueError):
    """A checkpoint whose files or tensors are missing, malformed or disagree with the config."""


class IncompatiblePairError(ValueError):
    """A drafter and a target that cannot run together: another vocabulary, hidden size or layer count
    (`dflash_jax.pairing.check_pair`), or a target that cannot roll a verify back."""

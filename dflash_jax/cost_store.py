"""Step costs kept for the next process: `CostStore`, what an adaptive policy measured, on disk.

The adaptive draft length (`adaptive.Adaptive`) predicts its step costs (`step_cost_model`) and measures them in
runs long enough, in every new process: a process that decodes a few hundred tokens a request chooses by the
prediction throughout. `Calibration(store=CostStore())` keeps what it measures in one small JSON file per setup
(what a step's cost depends on: the device kind, both models' configs and dtypes, batch, cache capacity, draft
lengths, sampling, attention options, and this package's version) and reads it back before predicting.

The files steer only the choice of draft length, never a token (speculative decoding returns the target's tokens
whatever the lengths), but a planted file could still make every step slow: the directory follows the compile
cache's rules (`_private`: this user's, writable by nobody else, created 0700), and a file not owned by this user,
writable by others, or not a well-formed record of the setup's lengths, batch and device is not read (the setup is
measured anew). `clear()` deletes every record.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import stat
from collections.abc import Hashable
from pathlib import Path

import msgspec

from ._private import private_directory, state_home
from ._version import VERSION
from .adaptive import StepCosts

__all__ = ["CostStore"]

SUBDIRECTORY = os.path.join("dflash_jax", "step_costs")


@dataclasses.dataclass(frozen=True)
class CostStore:
    """Step costs by setup in `directory` (default `$XDG_STATE_HOME/dflash_jax/step_costs`, else
    `~/.local/state/dflash_jax/step_costs`). `get` / `put` by the setup key `speculative_generate` computes
    (`draft_policy.setup_key`); `clear()` forgets everything. A directory another user could write is not used
    (one warning; `get` finds nothing, `put` keeps nothing)."""

    directory: str | os.PathLike[str] | None = None

    def _home(self) -> Path | None:
        if self.directory is not None:
            return private_directory(Path(self.directory), "step costs", "CostStore(directory=...)")
        home = state_home()
        return None if home is None else private_directory(home / SUBDIRECTORY, "step costs", "XDG_STATE_HOME")

    @staticmethod
    def _name(setup: Hashable) -> str:
        return hashlib.sha256(repr((setup, VERSION)).encode()).hexdigest() + ".json"

    def get(self, setup: Hashable) -> StepCosts | None:
        """The costs stored for `setup`, or None: none stored, or a file this user did not write alone, or one that
        is not a valid record."""
        home = self._home()
        if home is None:
            return None
        path = home / self._name(setup)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return None
        with os.fdopen(fd, "rb") as f:
            status = os.fstat(f.fileno())
            if not stat.S_ISREG(status.st_mode) or status.st_uid != os.getuid() or status.st_mode & 0o022:
                return None
            data = f.read(1 << 16)
        try:  # `StepCosts`' own checks run in the decode (a failed one is a ValidationError)
            return msgspec.json.decode(data, type=StepCosts)
        except (msgspec.ValidationError, msgspec.DecodeError):
            return None

    def put(self, setup: Hashable, costs: StepCosts) -> None:
        """Keep `costs` for `setup` (written whole to a temporary file, then renamed: a reader never sees half)."""
        home = self._home()
        if home is None:
            return
        path = home / self._name(setup)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(msgspec.json.encode(costs))
        os.replace(temporary, path)

    def clear(self) -> None:
        """Delete every stored record."""
        home = self._home()
        if home is None:
            return
        for path in home.glob("*.json"):
            path.unlink(missing_ok=True)

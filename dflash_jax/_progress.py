"""The progress callbacks of the decode loops running now, by call id: the one process-wide table of the package.

Why a table: the loop calls back from inside the compiled program (`jax.debug.callback`), and what it calls is part
of the program, so a callback passed in directly would compile the loop anew for every callback (and a program
holding no callback could not report). The program holds `report` and a call id (a traced int32) instead, and
`report` looks the id up here: one compiled loop serves every callback, and none. JAX gives a host callback no
per-call argument but arrays, hence one table per process; it is private, locked (calls may run from several
threads), and bounded (`MAX_CALLS` at once: an entry lives only while its call runs, `Callbacks.held`).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator

import numpy as np

MAX_CALLS = 1024  # calls with a progress callback running at once in one process


class Callbacks:
    """Progress callbacks by call id, each registered for the time its call runs (`held`)."""

    def __init__(self, limit: int = MAX_CALLS):
        self._limit = limit
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._by_id: dict[int, Callable[[np.ndarray], None]] = {}

    @contextlib.contextmanager
    def held(self, callback: Callable[[np.ndarray], None] | None) -> Iterator[int]:
        """A call id for the loop; while the block runs, `report(id, ...)` calls `callback` (if not None)."""
        with self._lock:
            call = next(self._ids)
            if callback is not None:
                if len(self._by_id) >= self._limit:
                    raise RuntimeError(f"more than {self._limit} decode calls with a progress callback are running "
                                       "in this process at once")
                self._by_id[call] = callback
        try:
            yield call
        finally:
            with self._lock:
                self._by_id.pop(call, None)

    def report(self, call: np.ndarray, n_out: np.ndarray) -> None:
        """The host side of the loop's callback: `n_out [batch]` to the callback of call `call`, if it has one."""
        with self._lock:
            callback = self._by_id.get(int(call))
        if callback is not None:
            callback(n_out)

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_id)


CALLBACKS = Callbacks()

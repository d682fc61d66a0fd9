"""The progress callbacks' table (`dflash_jax._progress`): an entry lives only while its call runs, a report reaches
only its own call's callback, the table is bounded, and threads registering at once get distinct ids."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from dflash_jax._progress import Callbacks


def test_a_report_reaches_its_own_call_while_it_runs():
    table, seen = Callbacks(), {"a": [], "b": []}
    with table.held(seen["a"].append) as a, table.held(None) as none, table.held(seen["b"].append) as b:
        assert len({a, none, b}) == 3 and len(table) == 2  # a call without a callback holds no entry
        table.report(np.int32(a), np.array([1, 2]))
        table.report(np.int32(none), np.array([5]))
        assert [x.tolist() for x in seen["a"]] == [[1, 2]] and seen["b"] == []
    assert len(table) == 0
    table.report(np.int32(a), np.array([3]))  # a call that ended: nothing is called
    assert len(seen["a"]) == 1


def test_the_table_is_bounded_and_freed_after_an_error():
    table = Callbacks(limit=2)
    with table.held(print), table.held(print):
        with pytest.raises(RuntimeError, match="more than 2 decode calls"), table.held(print):
            pass
    with pytest.raises(ValueError), table.held(print):
        raise ValueError("the call failed")
    assert len(table) == 0


def test_threads_get_distinct_ids():
    table, ids = Callbacks(), []

    def register():
        for _ in range(200):
            with table.held(print) as call:
                ids.append(call)

    threads = [threading.Thread(target=register) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(ids)) == 800 and len(table) == 0

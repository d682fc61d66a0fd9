"""`CostStore`: step costs kept on disk for the next process, read only from a private directory and files this user
alone wrote (`dflash_jax.cost_store`). The loop reading them instead of measuring: tests/test_adaptive.py."""

from __future__ import annotations

import os

import pytest

from dflash_jax import Calibration, CostStore, StepCosts

SETUP = ("cpu", 1, "Qwen3Target", "config", ("float32", "float32"), 2, 128, (0, 7), False, None)
COSTS = StepCosts((0, 7), (0.001, 0.004), 2, "cpu")


def test_a_record_outlives_its_store_object_until_cleared(tmp_path):
    CostStore(tmp_path).put(SETUP, COSTS)
    assert CostStore(tmp_path).get(SETUP) == COSTS  # another object, as the next process makes it
    assert CostStore(tmp_path).get(SETUP[:-1] + ("other attention",)) is None
    CostStore(tmp_path).clear()
    assert CostStore(tmp_path).get(SETUP) is None


def test_files_another_user_could_have_written_are_not_read(tmp_path):
    store = CostStore(tmp_path / "costs")
    store.put(SETUP, COSTS)
    (record,) = (tmp_path / "costs").glob("*.json")
    os.chmod(record, 0o666)
    assert store.get(SETUP) is None  # writable by others: not read
    os.chmod(record, 0o600)
    record.write_text('{"draft_lengths": [0, 7], "seconds": [0.001], "batch": 2, "device": "cpu"}')
    assert store.get(SETUP) is None  # not a valid record of two lengths
    os.chmod(tmp_path / "costs", 0o777)
    with pytest.warns(RuntimeWarning, match="not using .* for step costs: it is writable by group or others"):
        assert store.get(SETUP) is None


def test_a_calibration_reads_the_store_and_keeps_what_it_measures(tmp_path):
    store = CostStore(tmp_path)
    store.put(SETUP, COSTS)
    calibration = Calibration(store=store)
    assert calibration.known(SETUP, (0, 7), 2, "cpu") == COSTS and calibration.measured[SETUP] == COSTS
    assert Calibration(store=store).known(SETUP, (0, 7), 2, "NVIDIA H100 80GB HBM3") is None  # another device
    other = SETUP[:-1] + ("b",)
    calibration.keep(other, COSTS)
    assert store.get(other) == COSTS

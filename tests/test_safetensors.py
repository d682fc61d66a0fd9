"""The header-first reader: every dtype, single and sharded layouts, zero-copy views, the index checks."""

import json
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from dflash_jax import CheckpointError
from dflash_jax.safetensors import DTYPES, Checkpoint, read_header

SAMPLES = {
    "BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32, "F64": np.float64, "I64": np.int64,
    "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
}


def sample(dtype, shape, seed):
    values = np.random.default_rng(seed).uniform(-100, 100, size=shape)
    return (values > 0) if dtype is np.bool_ else values.astype(dtype)


def test_every_dtype_round_trips_bit_exactly(tmp_path):
    tensors = {name: sample(dtype, (3, 5), i) for i, (name, dtype) in enumerate(SAMPLES.items())}
    tensors["scalar"] = np.array(2.5, np.float32)
    tensors["empty"] = np.zeros((0, 4), np.float32)
    save_file(tensors, tmp_path / "model.safetensors")
    header, _ = read_header(str(tmp_path / "model.safetensors"))
    assert {header[n].dtype for n in SAMPLES} == set(SAMPLES) and set(SAMPLES) <= set(DTYPES)
    with Checkpoint(tmp_path) as ckpt:
        for name, expected in tensors.items():
            got = ckpt.array(name)
            assert got.dtype == expected.dtype and got.shape == expected.shape
            assert got.tobytes() == expected.tobytes()
            assert not got.flags.writeable and not got.flags.owndata  # a view of the map, no copy


def test_sharded_index(tmp_path):
    a, b = np.arange(6, dtype=np.float32).reshape(2, 3), np.ones(4, ml_dtypes.bfloat16)
    save_file({"a": a}, tmp_path / "s1.safetensors")
    save_file({"b": b}, tmp_path / "s2.safetensors")
    index = {"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with Checkpoint(tmp_path) as ckpt:
        assert sorted(ckpt) == ["a", "b"] and len(ckpt.files) == 2
        np.testing.assert_array_equal(ckpt.array("a"), a)


@pytest.mark.parametrize(
    "weight_map,message",
    [
        ({"a": "s1.safetensors", "b": "missing.safetensors"}, "does not exist"),
        ({"a": "s1.safetensors", "b": "s1.safetensors"}, "promised"),
        ({"a": "s1.safetensors"}, "does not list"),
        ({"a": "../s1.safetensors"}, "inside"),
    ],
)
def test_index_inconsistencies(tmp_path, weight_map, message):
    save_file({"a": np.zeros(2, np.float32)}, tmp_path / "s1.safetensors")
    save_file({"b": np.zeros(2, np.float32)}, tmp_path / "s2.safetensors")
    if weight_map == {"a": "s1.safetensors"}:  # s1 also holds a tensor the index gives to nobody
        save_file({"a": np.zeros(2, np.float32), "c": np.zeros(1, np.float32)}, tmp_path / "s1.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=message):
        Checkpoint(tmp_path)


def test_same_tensor_in_two_unindexed_files(tmp_path):
    save_file({"a": np.zeros(2, np.float32)}, tmp_path / "x.safetensors")
    save_file({"a": np.ones(2, np.float32)}, tmp_path / "y.safetensors")
    with pytest.raises(CheckpointError, match="'a' is in both"):
        Checkpoint(tmp_path)


def test_header_is_read_without_tensor_data(tmp_path):
    """A header that promises more data than the file holds fails at open, before any read."""
    path = tmp_path / "model.safetensors"
    save_file({"w": np.zeros((64, 64), np.float32)}, path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match="'w'.*past the end"):
        Checkpoint(tmp_path)


# --- issue 13 §2: a file that changes during a load does not load wrong -------------------------------

def test_a_file_renamed_over_after_its_header_is_read_from_the_file_that_was_opened(tmp_path):
    """An atomic rename between reading the header and the data: the offsets of the old file must never be
    applied to the bytes of the new one (the old reader opened the path twice)."""
    old = {"a": np.arange(8, dtype=np.float32), "b": np.full(4, 7, np.float32)}
    save_file(old, tmp_path / "model.safetensors")
    with Checkpoint(tmp_path) as ckpt:
        new = {"a": np.full(2, -1, np.float32), "b": np.arange(10, dtype=np.float32)}  # other offsets
        save_file(new, tmp_path / "new.tmp")
        (tmp_path / "new.tmp").replace(tmp_path / "model.safetensors")
        for name, expected in old.items():
            np.testing.assert_array_equal(ckpt.array(name), expected)


TRUNCATE_BETWEEN_TENSORS = """
import os, sys
import numpy as np
from safetensors.numpy import save_file
from dflash_jax import CheckpointError
from dflash_jax.safetensors import Checkpoint
path = os.path.join(sys.argv[1], "model.safetensors")
save_file({"a": np.ones(4096, np.float32), "b": np.ones(4096, np.float32)}, path)
with Checkpoint(sys.argv[1]) as ckpt:
    first, second = sorted(ckpt, key=lambda n: ckpt[n].start)
    float(ckpt.array(first).sum())  # mapped and touched
    os.truncate(path, ckpt[second].start + 16)
    try:
        float(ckpt.array(second).sum())  # touching pages past the end: SIGBUS
    except CheckpointError as e:
        print(e)
"""


def test_a_file_truncated_between_two_tensors_is_a_checkpoint_error_not_sigbus(tmp_path):
    out = subprocess.run([sys.executable, "-c", TRUNCATE_BETWEEN_TENSORS, str(tmp_path)], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.returncode == 0, f"exit status {out.returncode} (-7 is SIGBUS): {out.stderr[-2000:]}"
    assert "model.safetensors: tensor" in out.stdout and "truncated after its header was read" in out.stdout


# --- issue 13 §5: a tensor in two files while the index names one of them -----------------------------

def test_a_stale_file_beside_the_index_holding_its_tensors_is_ambiguous(tmp_path):
    save_file({"a": np.zeros(2, np.float32)}, tmp_path / "s1.safetensors")
    save_file({"a": np.ones(2, np.float32)}, tmp_path / "model.safetensors")  # e.g. a conversion's output
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "s1.safetensors"}}))
    with pytest.raises(CheckpointError, match="model.safetensors: holds tensor 'a', which .* maps to 's1.safetensors'"):
        Checkpoint(tmp_path)


def test_files_beside_the_index_with_other_tensors_are_ignored(tmp_path):
    save_file({"a": np.zeros(2, np.float32)}, tmp_path / "s1.safetensors")
    save_file({"z": np.ones(2, np.float32)}, tmp_path / "extra.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "s1.safetensors"}}))
    with Checkpoint(tmp_path) as ckpt:
        assert list(ckpt) == ["a"]

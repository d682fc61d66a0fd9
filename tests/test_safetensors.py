"""The header-first reader: every dtype, single and sharded layouts, zero-copy views, the index checks."""

import json

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

"""Property-based fuzzing of the header reader, the config decoder, the loader (issue 7) and the rules of issue
13 (duplicate keys, UTF-8 only, RoPE ranges with finite frequencies, NVFP4 scales).

Properties: random bytes and random mutations of valid files, configs and checkpoints raise only the
documented errors (`CheckpointError`, `ConfigError`), never anything else, never a hang; whatever is
accepted is usable (every tensor view lies inside its file, every decoded config is consistent); and
every valid file, in any layout the format allows, still loads bit-exactly.

CI runs the "ci" settings: derandomized (reproducible), under a minute on 2 cores. The long run explores:

    HYPOTHESIS_PROFILE=long .venv/bin/python -m pytest tests/test_fuzz.py -p no:cacheprovider

("long": 50x the examples, random seeds; failures are saved in .hypothesis/ and replayed first.)
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import warnings
from pathlib import Path

import jax.numpy as jnp
import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash_jax import CheckpointError, ConfigError, load_drafter, parse_config
from dflash_jax.config import DflashConfig, DflashSubConfig, DsparkSubConfig
from dflash_jax.nvfp4 import check_scales
from dflash_jax.nvfp4._reference import dequantize_xla
from dflash_jax.rope import RopeScaling, rope_frequencies
from dflash_jax.safetensors import DTYPES, Checkpoint
from dflash_jax.testing import TINY_CONFIGS, write_checkpoint

from ._io import load_file
from .hostile import forge

CONFIGS_DIR = Path(__file__).parent.parent / "configs"

_PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
_SCALE = 50 if _PROFILE == "long" else 1


def fuzz(examples: int):
    """Settings for one fuzzer: `examples` in CI (derandomized), 50x that and random seeds in the long run."""
    return settings(
        max_examples=examples * _SCALE,
        deadline=None,
        derandomize=_PROFILE != "long",
        database=None if _PROFILE != "long" else settings.default.database,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )


# --- strategies --------------------------------------------------------------------------------------

HUGE_INTS = st.sampled_from([-1, 0, 2**31, 2**32, 2**53 + 1, 2**63, 2**64 - 1, 2**64, 10**30, -(2**63)])
JSON_SCALARS = (
    st.none() | st.booleans() | st.integers(-5, 300) | HUGE_INTS | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8) | st.sampled_from(["", "\ud800", "BF16", "F8_E4M3", "U8", "yarn", "vanilla", "dspark"])
)
KEYS = st.text(max_size=6) | st.sampled_from(["weights", "group_size", "rope_theta", "mask_token_id", "dtype", "shape"])
JSON = st.recursive(
    JSON_SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(KEYS, inner, max_size=4),
    max_leaves=12,
)
DTYPE_NAMES = sorted(DTYPES)


def dumps(value) -> bytes:
    """JSON as Python writes it (NaN and Infinity literals included); lone surrogates as escapes."""
    return json.dumps(value).encode()


@st.composite
def tensor_dicts(draw, max_tensors: int = 5) -> dict[str, np.ndarray]:
    """Random tensors of every dtype (scalars and empty ones included) with random bytes as values."""
    names = draw(st.lists(st.text(min_size=1, max_size=10).filter(lambda s: s != "__metadata__"),
                          max_size=max_tensors, unique=True))
    tensors = {}
    for name in names:
        dtype = DTYPES[draw(st.sampled_from(DTYPE_NAMES))]
        shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
        size = math.prod(shape) * dtype.itemsize
        tensors[name] = np.frombuffer(draw(st.binary(min_size=size, max_size=size)), dtype).reshape(shape)
    return tensors


@pytest.fixture(scope="module")
def scratch():
    with tempfile.TemporaryDirectory() as directory:
        yield Path(directory)


def read_all(path: Path) -> dict[str, np.ndarray]:
    """Open with the package's reader and touch every tensor: each must be exactly the bytes of the file
    at its declared place."""
    blob = path.read_bytes()
    out = {}
    with Checkpoint(path) as checkpoint:
        for name, info in checkpoint.items():
            assert 0 <= info.start <= info.end <= len(blob)
            array = checkpoint.array(name)
            assert array.shape == info.shape and array.tobytes() == blob[info.start : info.end]
            out[name] = np.array(array)
    return out


def assert_same_bytes(got: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(expected)
    for name, array in expected.items():
        assert got[name].dtype == array.dtype and got[name].shape == array.shape, name
        assert got[name].tobytes() == array.tobytes(), name  # bit-exact: NaN payloads, -0.0, bool bytes


# --- the header reader -------------------------------------------------------------------------------

@fuzz(500)
@given(blob=st.binary(max_size=512))
def test_random_bytes(scratch, blob):
    path = scratch / "random.safetensors"
    path.write_bytes(blob)
    try:
        read_all(path)
    except CheckpointError:
        pass


# Header entries that are nearly right, so that the checks behind the first ones get exercised too.
DIMS = st.integers(-2, 4) | st.sampled_from([0, 2**31, 2**63, 2**64, 10**30])
ENTRY_FIELDS = {
    "dtype": st.sampled_from(DTYPE_NAMES) | JSON,
    "shape": st.lists(DIMS, max_size=3) | JSON,
    "data_offsets": (st.integers(0, 9).map(lambda b: [b, b]) | st.lists(st.integers(-2, 40), min_size=2, max_size=2)
                     | JSON),
}


@st.composite
def near_valid_entries(draw):
    """Well-typed entries whose offsets mostly agree with dtype x shape: they reach the last checks."""
    dtype, shape, begin = draw(st.sampled_from(DTYPE_NAMES)), draw(st.lists(DIMS, max_size=3)), draw(st.integers(0, 16))
    size = math.prod(shape) * DTYPES[dtype].itemsize
    end = begin + size if draw(st.integers(0, 3)) else draw(st.integers(-2, 40))
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


ENTRIES = near_valid_entries() | st.fixed_dictionaries(ENTRY_FIELDS) | st.fixed_dictionaries({}, optional=ENTRY_FIELDS)


@fuzz(800)
@given(header=JSON | st.dictionaries(st.text(max_size=6), ENTRIES | JSON, max_size=3), data=st.binary(max_size=64))
def test_random_headers(scratch, header, data):
    """Random JSON headers, many of them shaped like tensor entries, over a random data section."""
    path = forge.write_raw(scratch / "header.safetensors", dumps(header), data)
    try:
        read_all(path)
    except CheckpointError:
        pass


@st.composite
def mutations(draw):
    """One change to a valid file: a byte flipped, cut, inserted; the length prefix; a header field."""
    kind = draw(st.sampled_from(["flip", "truncate", "insert", "length", "field", "drop_field", "pad"]))
    return kind, draw(st.integers(0, 2**16)), draw(st.integers(0, 255)), draw(JSON), draw(st.integers(0, 2**64 - 1))


def mutate(blob: bytes, mutation) -> bytes:
    kind, position, byte, value, big = mutation
    n = int.from_bytes(blob[:8], "little")
    if kind == "flip":  # mostly inside the header, where a flip is interesting
        i = position % (8 + n + 8) if len(blob) > 8 + n + 8 else position % len(blob)
        return blob[:i] + bytes([blob[i] ^ (byte or 1)]) + blob[i + 1 :]
    if kind == "truncate":
        return blob[: position % len(blob)]
    if kind == "insert":
        i = position % len(blob)
        return blob[:i] + bytes([byte]) + blob[i:]
    if kind == "length":
        return (big if byte % 2 else (n + byte - 128) % 2**64).to_bytes(8, "little") + blob[8:]
    if kind == "pad":  # what safetensors itself writes: spaces after the JSON
        return ((n + byte) % 2**64).to_bytes(8, "little") + blob[8 : 8 + n] + b" " * byte + blob[8 + n :]
    header, data = json.loads(blob[8 : 8 + n]), blob[8 + n :]
    names = sorted(k for k in header if k != "__metadata__")
    if not names:
        return blob
    entry = header[names[position % len(names)]]
    field = ["dtype", "shape", "data_offsets"][byte % 3]
    if kind == "field":
        entry[field] = value
    else:
        entry.pop(field, None)
    raw = dumps(header)
    return len(raw).to_bytes(8, "little") + raw + data


@fuzz(600)
@given(tensors=tensor_dicts(), changes=st.lists(mutations(), min_size=1, max_size=3))
def test_mutated_valid_files(scratch, tensors, changes):
    path = forge.write_tensors(scratch / "mutated.safetensors", tensors)
    blob = path.read_bytes()
    for change in changes:
        if len(blob) < 8:
            break
        try:
            blob = mutate(blob, change)
        except (ValueError, UnicodeDecodeError):  # an earlier mutation broke the JSON: keep the bytes
            continue
    path.write_bytes(blob)
    try:
        read_all(path)
    except CheckpointError:
        pass


@fuzz(200)
@given(tensors=tensor_dicts(), order=st.randoms(use_true_random=False), gap=st.integers(0, 9),
       pad=st.integers(0, 7), metadata=st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=2))
def test_valid_files_read_bit_exactly(scratch, tensors, order, gap, pad, metadata):
    """Any layout the format allows (tensor order, gaps, header padding, metadata) reads bit-exactly,
    and agrees with the safetensors package's own reader on the files it accepts (no gaps)."""
    names = list(tensors)
    order.shuffle(names)
    header, data = forge.layout({n: tensors[n] for n in names}, gap=gap)
    header["__metadata__"] = metadata
    raw = dumps(header) + b" " * pad
    path = forge.write_raw(scratch / "valid.safetensors", raw, data)
    assert_same_bytes(read_all(path), tensors)
    if gap == 0 and tensors:
        assert_same_bytes(load_file(path), tensors)


# --- the config decoder ------------------------------------------------------------------------------

def released_configs() -> list[dict]:
    """The repository's copies of released configs (the same bases on every machine) and the tiny presets."""
    files = sorted(CONFIGS_DIR.glob("*.json"))
    return [json.loads(f.read_text()) for f in files] + list(TINY_CONFIGS.values())


BASES = released_configs()
FIELDS = sorted({f.encode_name for f in msgspec.structs.fields(DflashConfig)} | {"rope_parameters"})  # file names
SUB_FIELDS = {"dflash_config": DflashSubConfig.__struct_fields__, "dspark_config": DsparkSubConfig.__struct_fields__,
              "rope_scaling": RopeScaling.__struct_fields__, "rope_parameters": RopeScaling.__struct_fields__,
              "quantization_config": ("quant_method", "quant_algo", "group_size", "ignore", "exclude_modules",
                                      "config_groups")}


def check_decoded(config: DflashConfig) -> None:
    """What every accepted config guarantees its readers."""
    hash(config)
    assert config.family in ("dflash", "dflash2", "dspark")
    assert config.num_draft_tokens >= 1 and config.effective_block_size >= 1
    assert config.rope_type in ("default", "yarn", "proportional") and math.isfinite(config.rope_theta)
    assert 0 <= config.mask_token_id < config.vocab_size
    assert config.target_layer_ids and config.num_attention_heads % config.num_key_value_heads == 0
    assert config.num_hidden_layers <= 1024 and max(config.hidden_size, config.vocab_size) < 2**31
    if config.num_target_layers is not None:
        assert max(config.target_layer_ids) < config.num_target_layers
    if config.draft_vocab_size is not None:
        assert config.draft_vocab_size <= config.vocab_size
    assert all(-1 <= i < 2**31 for i in config.target_layer_ids)
    inv_freq, scaling = rope_frequencies(config)  # issue 13: finite RoPE for every accepted config
    assert np.isfinite(inv_freq).all() and math.isfinite(scaling), (config.rope_theta, config.rope_scaling)


def decode(raw) -> DflashConfig | None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            config = parse_config(raw, source="fuzz/config.json")
        except ConfigError as e:
            assert "fuzz/config.json" in str(e)
            return None
    check_decoded(config)
    return config


@fuzz(500)
@given(blob=st.binary(max_size=256) | JSON.map(dumps))
def test_config_random_input(blob):
    decode(blob)


@st.composite
def config_edits(draw):
    """A valid released or tiny config with 1-4 fields set to random JSON, deleted, or nested blocks edited."""
    raw = json.loads(json.dumps(draw(st.sampled_from(BASES))))
    for _ in range(draw(st.integers(1, 4))):
        block = draw(st.sampled_from([None, *SUB_FIELDS]))
        target, keys = (raw, FIELDS) if block is None or not isinstance(raw.get(block), dict) else (
            raw[block], SUB_FIELDS[block])
        key = draw(st.sampled_from(sorted(keys)))
        action = draw(st.sampled_from(["set", "set", "small", "delete"]))
        if action == "delete":
            target.pop(key, None)
        else:
            target[key] = draw(JSON if action == "set" else st.integers(-1, 8) | st.floats(-1, 8) | HUGE_INTS)
    return raw


@fuzz(1200)
@given(raw=config_edits())
def test_config_mutations(raw):
    """A dict and the same dict as JSON text give the same answer: the same config, or both a ConfigError."""
    as_dict, as_text = decode(raw), decode(dumps(raw))
    assert as_dict == as_text, (as_dict, as_text)


@fuzz(100)
@given(raw=config_edits(), data=st.data())
def test_config_with_a_key_given_twice_is_refused(raw, data):
    """Issue 13: the last of two values must never silently win; the decoder refuses a duplicate anywhere."""
    text = dumps(raw).decode()
    key = data.draw(st.sampled_from(sorted(raw)))
    doubled = "{" + json.dumps(key) + ": " + json.dumps(raw[key]) + ", " + text[1:]
    with pytest.raises(ConfigError, match="duplicate key"):
        parse_config(doubled, source="fuzz/config.json")


@fuzz(50)
@given(raw=config_edits(), encoding=st.sampled_from(["utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le"]))
def test_config_not_in_utf8_is_refused(raw, encoding):
    with pytest.raises(ConfigError, match="fuzz/config.json"):
        parse_config(dumps(raw).decode().encode(encoding), source="fuzz/config.json")


@fuzz(300)
@given(base=st.sampled_from(BASES), theta=st.floats(allow_nan=True, allow_infinity=True) | HUGE_INTS,
       scaling=st.fixed_dictionaries({}, optional={
           "rope_type": st.sampled_from(["yarn", "default", "linear"]),
           "factor": st.floats(allow_nan=False) | HUGE_INTS, "beta_fast": st.floats(-64, 1e30),
           "beta_slow": st.floats(-64, 1e30), "original_max_position_embeddings": st.integers(-1, 2**40),
           "mscale": st.floats(-10, 10), "mscale_all_dim": st.floats(-10, 10),
           "attention_factor": st.floats(-1e3, 1e3)}))
def test_rope_fields_give_finite_frequencies_or_a_config_error(base, theta, scaling):
    """The new RoPE ranges: whatever rope_theta and YaRN fields say, an accepted config has finite RoPE."""
    raw = json.loads(json.dumps(base))
    raw.pop("rope_parameters", None)
    raw.update(rope_theta=theta, rope_scaling=scaling or None)
    decode(raw)


def test_released_configs_decode():
    for raw in BASES:
        assert decode(raw) is not None


# --- the loader --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_checkpoints(scratch):
    """One valid checkpoint per family, written once; examples copy and break them."""
    out = {}
    for preset in TINY_CONFIGS:
        directory = scratch / preset
        write_checkpoint(directory, preset)
        out[preset] = directory
    return out


def load_or_refuse(directory: Path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return load_drafter(directory, dtype=jnp.float32)
        except (CheckpointError, ConfigError) as e:
            assert str(directory) in str(e)
            return None


@fuzz(150)
@given(preset=st.sampled_from(sorted(TINY_CONFIGS)), data=st.data())
def test_loader_on_mutated_checkpoints(tiny_checkpoints, scratch, preset, data):
    """A tiny drafter with its config edited (shapes, heads, blocks) or one header entry changed:
    refused with a documented error, or loaded with every leaf the shape the config asks for."""
    source, directory = tiny_checkpoints[preset], scratch / "mutant"
    directory.mkdir(exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        (directory / name).write_bytes((source / name).read_bytes())
    raw = json.loads((source / "config.json").read_text())
    if data.draw(st.booleans()):
        key = data.draw(st.sampled_from(["hidden_size", "intermediate_size", "num_hidden_layers", "head_dim",
                                         "num_attention_heads", "num_key_value_heads", "vocab_size",
                                         "draft_vocab_size", "attention_bias", "markov_rank", "block_size"]))
        raw[key] = data.draw(st.integers(-1, 200) | st.booleans() | JSON)
        (directory / "config.json").write_bytes(dumps(raw))
    else:
        header, blob = forge.read_raw(directory / "model.safetensors")
        name = data.draw(st.sampled_from(sorted(k for k in header if k != "__metadata__")))
        field = data.draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
        header[name][field] = data.draw(JSON | st.sampled_from(DTYPE_NAMES) | st.lists(st.integers(0, 130), max_size=3))
        forge.write_raw(directory / "model.safetensors", header, blob)
    drafter = load_or_refuse(directory)
    if drafter is not None:
        config = drafter.config
        width = len(config.target_layer_ids) * config.hidden_size
        assert drafter.params["fc"]["weight"].shape == (config.hidden_size, width)
        assert len(drafter.params["layers"]) == config.num_hidden_layers


@fuzz(12)
@given(preset=st.sampled_from(sorted(TINY_CONFIGS)), seed=st.integers(0, 2**16), shards=st.integers(1, 4),
       prefix=st.sampled_from(["", "model."]), order=st.randoms(use_true_random=False), gap=st.integers(0, 5))
def test_valid_checkpoints_load_bit_exactly(scratch, preset, seed, shards, prefix, order, gap):
    """Random valid drafters, re-laid out (shuffled tensor order, gaps) load to exactly the stored values."""
    directory = scratch / "valid"
    for old in directory.glob("*"):
        old.unlink()
    write_checkpoint(directory, preset, seed=seed, num_shards=shards, prefix=prefix)
    stored = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors = forge.read_tensors(file)
        names = list(tensors)
        order.shuffle(names)
        forge.write_tensors(file, {n: tensors[n] for n in names}, gap=gap)
        stored.update(tensors)
    drafter = load_or_refuse(directory)
    assert drafter is not None
    leaves = {t: v for t, v in _named_leaves(drafter.params, prefix)}
    assert sorted(leaves) == sorted(stored)
    for name, value in leaves.items():
        expected = stored[name].astype(np.float32 if stored[name].dtype.kind in "fV" else np.int32)
        np.testing.assert_array_equal(np.asarray(value), expected, err_msg=name)


def _named_leaves(tree, prefix: str, path: str = ""):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _named_leaves(value, prefix, f"{path}{key}.")
    elif isinstance(tree, list):
        for i, value in enumerate(tree):
            yield from _named_leaves(value, prefix, f"{path}{i}.")
    else:
        name = path[:-1]
        yield (name if name == "d2t" else prefix + name), tree


# --- NVFP4 scales (issue 13 §3) --------------------------------------------------------------------------

@fuzz(150)
@given(scale=st.binary(min_size=8, max_size=8) | st.binary(min_size=8, max_size=8).map(lambda b: bytes(
           x & 0x7F for x in b)),  # and global scales whose products with the block scales underflow
       scale_2=st.floats(allow_nan=True, allow_infinity=True, width=32) | st.floats(2.0**-126, 2.0**-110, width=32)
       | st.floats(2.0**-40, 2.0**-20, width=32),
       codes=st.binary(min_size=64, max_size=64), dtype=st.sampled_from([jnp.bfloat16, jnp.float16, jnp.float32]))
def test_nvfp4_scales_are_refused_or_give_finite_weights(scale, scale_2, codes, dtype):
    """Any block scale bytes and global scale: `check_scales` refuses them, or every dequantized weight is
    finite in the load dtype, none is negated by a scale (the sign comes from the code alone) and none of a
    nonzero code and block scale is 0 (flushed or rounded away)."""
    scale = np.frombuffer(scale, np.uint8).reshape(2, 4)  # [N, K/16], K = 64
    packed = np.frombuffer(codes, np.uint8).reshape(2, 32)  # [N, K/2]
    scale_2 = np.float32(scale_2)
    try:
        check_scales("w", scale, scale_2, dtype)
    except CheckpointError as e:
        assert str(e).startswith("w_scale")
        return
    weights = np.asarray(dequantize_xla(packed, scale.view(jnp.float8_e4m3fn), scale_2, dtype), np.float32)
    assert np.isfinite(weights).all()
    low, high = packed & 15, packed >> 4
    nibbles = np.stack([low, high], -1).reshape(2, 64)
    negative_code = nibbles >= 8  # the E2M1 sign bit
    assert not (weights[~negative_code] < 0).any() and not (weights[negative_code] > 0).any()
    nonzero = (nibbles & 7 != 0) & np.repeat(scale & 0x7F != 0, 16, axis=1)
    assert (weights[nonzero] != 0).all()

"""NVFP4 checkpoints through load_drafter: values, mixed checkpoints, companions, declared quant config, convert."""

import json
import re

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dflash_jax import CheckpointError, load_drafter
from dflash_jax.cli import main as cli
from dflash_jax.nvfp4.convert import convert_checkpoint
from dflash_jax.testing import write_checkpoint

from ._io import leaf, load_file, rewrite_tensors, save_file

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float64)


def numpy_dequant(packed, scale, scale_2):
    """Independent decode: nibble table lookup, float64 products, then one rounding to bf16."""
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[0], -1)  # [N, K]
    values = np.where(codes & 8, -1.0, 1.0) * E2M1[codes & 7]
    block = scale.astype(np.float32).astype(np.float64) * np.float64(np.float32(scale_2))  # [N, K/16]
    # f32(scale) * f32(scale_2) rounded to f32, times an E2M1 value (exact in f32): same as ModelOpt's f32 math
    block = block.astype(np.float32).astype(np.float64)
    return (values * np.repeat(block, 16, axis=1)).astype(np.float32).astype(ml_dtypes.bfloat16)


@pytest.mark.parametrize("preset", ["tiny-dflash", "tiny-dflash2", "tiny-dspark"])
def test_nvfp4_checkpoints_load_to_expected_values(tmp_path, preset):
    write_checkpoint(tmp_path, preset, nvfp4=True, prefix="model.")
    tensors = load_file(tmp_path / "model.safetensors")
    drafter = load_drafter(tmp_path, weights="dequantized")  # the values placed, whatever "auto" picks here
    packed = [n for n, v in tensors.items() if v.dtype == np.uint8]
    assert "model.fc.weight" in packed and len(packed) >= 1 + 7 * drafter.config.num_hidden_layers
    for name in packed:
        stem = name.removesuffix(".weight")
        expected = numpy_dequant(tensors[name], tensors[stem + ".weight_scale"], tensors[stem + ".weight_scale_2"])
        got = np.asarray(leaf(drafter.params, name.removeprefix("model.")))
        assert got.dtype == jnp.bfloat16
        np.testing.assert_array_equal(got.astype(np.float32), expected.astype(np.float32))
    norm = tensors["model.norm.weight"]
    np.testing.assert_array_equal(np.asarray(drafter.params["norm"]["weight"]).view(np.uint16), norm.view(np.uint16))


def test_mixed_checkpoint_and_bf16_scale_2(tmp_path):
    """A BF16 linear beside NVFP4 ones passes through untouched; a bf16 [1] scale_2 is accepted."""
    write_checkpoint(tmp_path / "bf16", "tiny-dflash", seed=4)
    write_checkpoint(tmp_path / "q", "tiny-dflash", nvfp4=True, seed=4)
    bf16, q = load_file(tmp_path / "bf16/model.safetensors"), load_file(tmp_path / "q/model.safetensors")
    for suffix in ("", "_scale", "_scale_2"):
        q.pop(f"layers.0.mlp.up_proj.weight{suffix}")
    q["layers.0.mlp.up_proj.weight"] = bf16["layers.0.mlp.up_proj.weight"]
    q["fc.weight_scale_2"] = q["fc.weight_scale_2"].reshape(1).astype(ml_dtypes.bfloat16)
    save_file(q, tmp_path / "q/model.safetensors")
    drafter = load_drafter(tmp_path / "q", weights="dequantized")
    up = np.asarray(drafter.params["layers"][0]["mlp"]["up_proj"]["weight"])
    np.testing.assert_array_equal(up.view(np.uint16), bf16["layers.0.mlp.up_proj.weight"].view(np.uint16))


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda t: t.pop("fc.weight_scale"), "companion 'fc.weight_scale' is missing"),
        (lambda t: t.pop("layers.1.self_attn.o_proj.weight_scale_2"), "'layers.1.self_attn.o_proj.weight_scale_2' is missing"),
        (lambda t: t.update({"fc.weight_scale": t["fc.weight_scale"][:, :4]}), "fc.weight_scale: shape"),
        (lambda t: t.update({"fc.weight_scale_2": np.ones(2, np.float32)}), "fc.weight_scale_2: expected a scalar"),
        (lambda t: t.update({"fc.weight_scale": t["fc.weight_scale"].astype(np.float32)}), "dtype F32, expected F8_E4M3"),
        (lambda t: t.update({"fc.weight_scale_2": np.array(np.nan, np.float32)}), "fc.weight_scale_2: nan is not a finite number > 0"),
        (lambda t: t["layers.0.mlp.down_proj.weight_scale"].view(np.uint8).__setitem__((0, 0), 0x7F), "NaN"),
        (lambda t: t.update({"layers.0.mlp.up_proj.weight": t["layers.0.mlp.up_proj.weight"][:, :16],
                             "layers.0.mlp.up_proj.weight_scale": t["layers.0.mlp.up_proj.weight_scale"][:, :2]}),
         "disagrees with the config"),
    ],
)
def test_bad_nvfp4_tensors(tmp_path, change, message):
    write_checkpoint(tmp_path, "tiny-dflash", nvfp4=True)
    rewrite_tensors(tmp_path, change)
    with pytest.raises(CheckpointError, match=message) as err:
        load_drafter(tmp_path)
    assert "model.safetensors" in str(err.value)


def test_k_not_multiple_of_32(tmp_path):
    from dflash_jax.testing import preset_dict

    raw = {**preset_dict("tiny-dflash"), "intermediate_size": 48}  # down_proj K = 48
    write_checkpoint(tmp_path, raw, nvfp4=True)
    with pytest.raises(CheckpointError, match="down_proj.weight: unpacked K = 48"):
        load_drafter(tmp_path)


@pytest.mark.parametrize(
    "quantization,message",
    [
        ({"quant_algo": "FP8", "group_size": 16}, "quant_algo 'FP8'"),
        ({"quant_algo": "NVFP4", "group_size": 32}, "group_size 32"),
        ({"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["layers.*.mlp.*"]}, "excluded"),
    ],
)
def test_declared_quantization_checked_against_tensors(tmp_path, quantization, message):
    write_checkpoint(tmp_path, "tiny-dflash", nvfp4=True)
    (tmp_path / "hf_quant_config.json").write_text(json.dumps({"quantization": quantization}))
    with pytest.raises(CheckpointError, match=message) as err:
        load_drafter(tmp_path)
    assert "hf_quant_config.json" in str(err.value)


def test_convert_cli_round_trip(tmp_path, capsys):
    write_checkpoint(tmp_path / "bf16", "tiny-dflash2", seed=2)
    assert cli(["convert-nvfp4", str(tmp_path / "bf16"), str(tmp_path / "q")]) == 0
    assert "linear weights stored as NVFP4" in capsys.readouterr().out
    bf16 = load_drafter(tmp_path / "bf16", dtype=jnp.float32)
    q = load_drafter(tmp_path / "q", dtype=jnp.float32)
    ref, got = bf16.params["fc"]["weight"], q.params["fc"]["weight"]
    relative = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
    assert 0 < relative < 0.15  # 4-bit weights: close, not equal
    np.testing.assert_array_equal(q.params["norm"]["weight"], bf16.params["norm"]["weight"])
    assert json.loads((tmp_path / "q/hf_quant_config.json").read_text())["quantization"]["quant_algo"] == "NVFP4"


def test_convert_refuses_an_already_quantized_checkpoint(tmp_path, capsys):
    """It copied the NVFP4 checkpoint and exited 0 saying "0 linear weights stored as NVFP4"."""
    write_checkpoint(tmp_path / "q", "tiny-dflash", nvfp4=True)
    assert cli(["convert-nvfp4", str(tmp_path / "q"), str(tmp_path / "again")]) == 2
    assert re.search(r"error: .*q: already quantized \(\d+ linear weights stored as NVFP4\); convert-nvfp4 quantizes",
                     capsys.readouterr().err)
    assert not (tmp_path / "again").exists()


# --- issue 13 §6: converting into a directory that holds a checkpoint -------------------------------------

def test_convert_refuses_a_destination_that_holds_a_checkpoint(tmp_path):
    """Before: exit 0, and the loader then preferred the old index: BF16 weights under the NVFP4 config."""
    write_checkpoint(tmp_path / "bf16", "tiny-dflash", seed=2)
    write_checkpoint(tmp_path / "old", "tiny-dflash", seed=3, num_shards=2)
    before = {p.name: p.read_bytes() for p in (tmp_path / "old").iterdir()}
    with pytest.raises(CheckpointError, match="old: not empty; expected a new or empty destination"):
        convert_checkpoint(tmp_path / "bf16", tmp_path / "old")
    assert {p.name: p.read_bytes() for p in (tmp_path / "old").iterdir()} == before
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(CheckpointError, match="file: not a directory"):
        convert_checkpoint(tmp_path / "bf16", tmp_path / "file")


def test_convert_with_overwrite_replaces_the_checkpoint_whole(tmp_path):
    write_checkpoint(tmp_path / "bf16", "tiny-dflash", seed=2)
    write_checkpoint(tmp_path / "q", "tiny-dflash", seed=3, num_shards=2)  # a stale sharded checkpoint
    (tmp_path / "q" / "tokenizer.json").write_text("{}")  # not a checkpoint file: kept
    convert_checkpoint(tmp_path / "bf16", tmp_path / "q", overwrite=True)
    names = sorted(p.name for p in (tmp_path / "q").iterdir())
    assert names == ["config.json", "hf_quant_config.json", "model.safetensors", "tokenizer.json"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".q.partial-")]
    q, bf16 = load_drafter(tmp_path / "q", dtype=jnp.float32), load_drafter(tmp_path / "bf16", dtype=jnp.float32)
    np.testing.assert_array_equal(q.params["norm"]["weight"], bf16.params["norm"]["weight"])  # the new source's


def test_convert_into_an_empty_directory(tmp_path):
    write_checkpoint(tmp_path / "bf16", "tiny-dflash")
    (tmp_path / "empty").mkdir()
    assert convert_checkpoint(tmp_path / "bf16", tmp_path / "empty") > 0
    load_drafter(tmp_path / "empty")

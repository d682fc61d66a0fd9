"""One load path: drafters and targets read config.json through one reader with one set of guards
(`_config_file.read_config_json`), and every loader runs the same value checks and unexpected-tensor warning
before placing (`loader.check_and_place`)."""

from __future__ import annotations

import os

import pytest

from dflash_jax import ConfigError, load_config, load_target
from dflash_jax.target.dense import DecoderTarget
from dflash_jax.target.qwen3_5 import Qwen3_5Target

BAD = {
    "not JSON": (b"{hidden_size: 64}", "not valid JSON"),
    "not UTF-8": (b'{"hidden_size": "\xff"}', "not UTF-8 JSON"),
    "duplicate keys": (b'{"hidden_size": 64, "hidden_size": 65}', "duplicate key"),
    "an array": (b"[]", "expected a JSON object at the top level, found list"),
    "nested too deeply": (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
}
LOADERS = {"load_config": load_config, "load_target": load_target,
           "DecoderTarget": DecoderTarget.from_pretrained, "Qwen3_5Target": Qwen3_5Target.from_pretrained}


@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("loader", LOADERS)
def test_every_loader_refuses_a_bad_config_json_alike(tmp_path, bad, loader):
    text, message = BAD[bad]
    (tmp_path / "config.json").write_bytes(text)
    with pytest.raises(ConfigError, match=message) as refused:
        LOADERS[loader](tmp_path)
    assert str(refused.value).startswith(f"{tmp_path / 'config.json'}: ")


@pytest.mark.parametrize("loader", LOADERS)
def test_a_fifo_config_json_is_refused_not_read(tmp_path, loader):
    os.mkfifo(tmp_path / "config.json")  # a read would block forever
    with pytest.raises(ConfigError, match="config.json"):
        LOADERS[loader](tmp_path)


@pytest.mark.parametrize("loader", ["load_target", "DecoderTarget", "Qwen3_5Target"])
def test_a_target_loader_given_a_file_names_it(tmp_path, loader):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="config.json: a file, not a directory; expected a target checkpoint"):
        LOADERS[loader](tmp_path / "config.json")

"""Hostile and broken inputs (issue 7): each gets a documented error naming the file and the tensor or
field; nothing else escapes, nothing hangs, nothing is placed on a device, nothing outside is read.

`CASES` is the corpus. Every case writes a valid tiny drafter (`write_checkpoint`), breaks one thing
(`build`), loads it with `load_drafter` and checks the error class and the words its message must contain.
The forging tools are in tests/hostile/forge.py; real configs of non-drafters in tests/hostile/*.json.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import json
import math
import os
import shutil
import sys
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import chex
import jax
import ml_dtypes
import numpy as np
import pytest

import dflash_jax.placement
import dflash_jax.safetensors
import dflash_jax.validate
from dflash_jax import CheckpointError, ConfigError, load_drafter
from dflash_jax.testing import TINY_CONFIGS, write_checkpoint
from dflash_jax.validate import scan_checkpoint

from ._io import deadline
from .hostile import forge

HERE = Path(__file__).parent / "hostile"
ST = "model.safetensors"
INDEX = "model.safetensors.index.json"
SHARD_1, SHARD_2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
BF16 = ml_dtypes.bfloat16


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    build: Callable[[Path], Any]  # breaks the valid checkpoint written in the directory it is given
    error: type[ValueError]
    says: tuple[str, ...]  # the message contains each: the file, the tensor or field, what was expected
    base: str | dict = "tiny-dflash"  # what write_checkpoint writes first
    shards: int = 1
    nvfp4: bool = False
    load: str = "."  # the path handed to load_drafter, relative to the checkpoint directory


# --- building blocks: each returns a `build` step ----------------------------------------------------

def replace(data: bytes, file: str = ST):
    return lambda d: (d / file).write_bytes(data)


def raw_header(header: bytes | Any, data: bytes = b"", length: int | None = None, file: str = ST):
    return lambda d: forge.write_raw(d / file, header, data, length=length)


def header(edit: Callable[[dict], Any], file: str = ST):
    return lambda d: forge.edit_header(d / file, edit)


def entry(name: str, file: str = ST, **fields):
    """Set fields of one tensor's header entry (dtype, shape, data_offsets)."""
    return header(lambda h: h[name].update(fields), file)


def offsets(name: str, new: Callable[[int, int], Any]):
    """Rewrite one tensor's data_offsets from its current (begin, end)."""
    return header(lambda h: h[name].update(data_offsets=new(*h[name]["data_offsets"])))


def tensors(edit: Callable[[dict], Any], file: str = ST):
    return lambda d: forge.edit_tensors(d / file, edit)


def put(name: str, change: Callable[[np.ndarray], np.ndarray], file: str = ST):
    """Replace one tensor by `change(tensor)`."""
    return tensors(lambda t: t.update({name: change(t[name])}), file)


def poke(name: str, index: tuple, value: float, file: str = ST):
    """Set one element of a tensor (a NaN, an Inf, an out-of-range id)."""
    def edit(t):
        t[name][index] = value
    return tensors(edit, file)


def config(edit: Callable[[dict], Any]):
    return lambda d: forge.edit_json(d / "config.json", edit)


def config_text(text: bytes):
    return replace(text, "config.json")


def index(edit: Callable[[dict], Any]):
    return lambda d: forge.edit_json(d / INDEX, edit)


def truncate(nbytes: int, file: str = ST):
    def build(d):
        data = (d / file).read_bytes()
        (d / file).write_bytes(data[:-nbytes])
    return build


def steps(*builds):
    return lambda d: [b(d) for b in builds]


def deep(n: int = 100_000) -> bytes:
    return b"[" * n + b"]" * n


def swap_in(config_file: str, tensors_of: Callable[[], dict[str, np.ndarray]] | None):
    """Replace the checkpoint by another model's: its config (a file of tests/hostile/) and/or tensors."""
    def build(d):
        if config_file:
            shutil.copy(HERE / config_file, d / "config.json")
        if tensors_of:
            forge.write_tensors(d / ST, tensors_of())
    return build


def eagle3_tensors() -> dict[str, np.ndarray]:
    """An EAGLE-3 drafter's tensors (SpecForge / official layout) at tiny size: note its `fc.weight`."""
    rng = np.random.default_rng(0)
    w = lambda *shape: rng.standard_normal(shape).astype(BF16)  # noqa: E731
    H, V, V_d = 64, 128, 32
    out = {"fc.weight": w(H, 3 * H), "norm.weight": w(H), "lm_head.weight": w(V_d, H),
           "d2t": np.zeros(V_d, np.int64), "t2d": np.zeros(V, np.bool_),
           "midlayer.hidden_norm.weight": w(H), "midlayer.input_layernorm.weight": w(H),
           "midlayer.post_attention_layernorm.weight": w(H)}
    for proj, shape in {"q_proj": (H, 2 * H), "k_proj": (32, 2 * H), "v_proj": (32, 2 * H), "o_proj": (H, H)}.items():
        out[f"midlayer.self_attn.{proj}.weight"] = w(*shape)
    for proj, shape in {"gate_proj": (128, H), "up_proj": (128, H), "down_proj": (H, 128)}.items():
        out[f"midlayer.mlp.{proj}.weight"] = w(*shape)
    return out


def qwen3_tensors() -> dict[str, np.ndarray]:
    """A (tiny) Qwen3 target's tensors: embeddings, layers, LM head, no fc."""
    z = lambda *shape: np.zeros(shape, BF16)  # noqa: E731
    return {"model.embed_tokens.weight": z(128, 64), "model.norm.weight": z(64), "lm_head.weight": z(128, 64),
            "model.layers.0.input_layernorm.weight": z(64), "model.layers.0.self_attn.q_proj.weight": z(64, 64)}


TINY = TINY_CONFIGS["tiny-dflash"]
REDUCED_VOCAB = {**TINY, "draft_vocab_size": 64}  # writes a d2t (I64 [64]) into the checkpoint
WITH_BIAS = {**TINY, "attention_bias": True}

CASES = [
    # --- the safetensors file itself ---------------------------------------------------------------------
    Case("empty file", replace(b""), CheckpointError, (ST, "0 bytes", "too short")),
    Case("shorter than 8 bytes", replace(b"\x10\0\0"), CheckpointError, (ST, "3 bytes", "too short")),
    Case("header length past the end", raw_header({}, length=1000), CheckpointError,
         (ST, "header length 1000", "larger than the file")),
    Case("header length absurd", raw_header({}, length=2**64 - 1), CheckpointError,
         (ST, f"header length {2**64 - 1}", "limit")),
    Case("header length zero", raw_header(b"", data=b"{}"), CheckpointError, (ST, "header", "not valid UTF-8 JSON")),
    Case("header not JSON", raw_header(b"{'fc.weight': 1}"), CheckpointError, (ST, "not valid UTF-8 JSON")),
    Case("header not UTF-8", raw_header(b'{"fc.weight\xff": {}}'), CheckpointError, (ST, "not valid UTF-8 JSON")),
    Case("header a JSON array", raw_header(b"[]"), CheckpointError, (ST, "header is a JSON list", "expected an object")),
    Case("header nested 100k deep", raw_header(deep()), CheckpointError, (ST, "header", "nested too deeply")),
    Case("header integer of 5000 digits", raw_header(b'{"x": ' + b"1" * 5000 + b"}"), CheckpointError,
         (ST, "not valid UTF-8 JSON", "digits")),
    Case("header duplicate tensor name",
         raw_header(b'{"norm.weight": {}, "norm.weight": {}}'), CheckpointError, (ST, "duplicate", "'norm.weight'")),
    Case("header UTF-8 BOM", raw_header(b"\xef\xbb\xbf{}"), CheckpointError, (ST, "not valid UTF-8 JSON")),
    Case("__metadata__ not an object", header(lambda h: h.update(__metadata__=[1])), CheckpointError,
         (ST, "__metadata__", "expected an object")),
    Case("__metadata__ value an object", header(lambda h: h.update(__metadata__={"format": {}})), CheckpointError,
         (ST, "__metadata__['format']", "expected a string")),
    # --- one tensor entry of the header -------------------------------------------------------------------
    Case("entry not an object", header(lambda h: h.update({"norm.weight": 5})), CheckpointError,
         (ST, "'norm.weight'", "expected an object")),
    Case("dtype missing", header(lambda h: h["norm.weight"].pop("dtype")), CheckpointError,
         (ST, "'norm.weight'", "dtype None", "expected one of")),
    Case("dtype unknown", entry("norm.weight", dtype="F4"), CheckpointError, (ST, "'norm.weight'", "'F4'", "expected one of")),
    Case("dtype a list", entry("norm.weight", dtype=["BF16"]), CheckpointError, (ST, "'norm.weight'", "expected one of")),
    Case("shape negative", entry("norm.weight", shape=[-64]), CheckpointError,
         (ST, "'norm.weight'", "[-64]", "non-negative integers")),
    Case("shape not integers", entry("norm.weight", shape=[64.0]), CheckpointError, (ST, "'norm.weight'", "non-negative integers")),
    Case("shape of booleans", entry("norm.weight", shape=[True]), CheckpointError, (ST, "'norm.weight'", "non-negative integers")),
    Case("shape a string", entry("norm.weight", shape="64"), CheckpointError, (ST, "'norm.weight'", "non-negative integers")),
    Case("empty tensor with a 2**70 dim", header(lambda h: h.update(
        {"x": {"dtype": "F32", "shape": [2**70, 0], "data_offsets": [0, 0]}})), CheckpointError, (ST, "'x'", "out of range")),
    Case("100 dimensions", header(lambda h: h.update(
        {"x": {"dtype": "F32", "shape": [1] * 100, "data_offsets": [0, 0]}})), CheckpointError, (ST, "'x'", "dimensions")),
    Case("data_offsets out of order", offsets("norm.weight", lambda b, e: [e, b]), CheckpointError,
         (ST, "'norm.weight'", "out of order")),
    Case("data_offsets negative", offsets("norm.weight", lambda b, e: [-128, 0]), CheckpointError,
         (ST, "'norm.weight'", "out of order")),
    Case("data_offsets not a pair", offsets("norm.weight", lambda b, e: [b]), CheckpointError,
         (ST, "'norm.weight'", "not a pair of integers")),
    Case("data_offsets beyond the end", offsets("norm.weight", lambda b, e: [10**9, 10**9 + 128]), CheckpointError,
         (ST, "'norm.weight'", "past the end of the data section")),
    Case("data_offsets 2**80", offsets("norm.weight", lambda b, e: [2**80, 2**80 + 128]), CheckpointError,
         (ST, "'norm.weight'", "past the end")),
    Case("data_offsets not dtype x shape", offsets("norm.weight", lambda b, e: [b, e - 2]), CheckpointError,
         (ST, "'norm.weight'", "span 126 bytes, expected 128 for BF16 [64]")),
    Case("two tensors overlap", header(lambda h: h["hidden_norm.weight"].update(data_offsets=h["norm.weight"]["data_offsets"])),
         CheckpointError, (ST, "'hidden_norm.weight'", "'norm.weight'", "overlap")),
    Case("data section truncated", truncate(100), CheckpointError, (ST, "past the end", "truncated")),
    Case("data section gone", lambda d: forge.write_raw(d / ST, forge.read_raw(d / ST)[0]), CheckpointError,
         (ST, "past the end of the data section (0 bytes)")),
    # --- files that are not safetensors files -------------------------------------------------------------
    Case("model.safetensors is a FIFO", lambda d: ((d / ST).unlink(), os.mkfifo(d / ST)), CheckpointError,
         (ST, "not a regular file")),
    Case("no safetensors at all", lambda d: (d / ST).unlink(), CheckpointError, ("no model.safetensors",)),
    Case("model.safetensors is a directory", lambda d: ((d / ST).unlink(), (d / ST).mkdir()), CheckpointError,
         (ST, "not a regular file")),
    Case("model.safetensors a dangling link", lambda d: ((d / ST).unlink(), (d / ST).symlink_to(d / "gone")),
         CheckpointError, (ST, "not a regular file")),
    # --- sharded checkpoints and their index --------------------------------------------------------------
    Case("index not JSON", replace(b"{weight_map", INDEX), CheckpointError, (INDEX, "not valid UTF-8 JSON"), shards=2),
    Case("index nested 100k deep", replace(deep(), INDEX), CheckpointError, (INDEX, "nested too deeply"), shards=2),
    Case("index without weight_map", index(lambda i: i.pop("weight_map")), CheckpointError, (INDEX, "weight_map"), shards=2),
    Case("index weight_map values not strings", index(lambda i: i["weight_map"].update({"fc.weight": 1})),
         CheckpointError, (INDEX, "weight_map"), shards=2),
    Case("index lists one tensor twice", replace(
        b'{"weight_map": {"fc.weight": "' + SHARD_1.encode() + b'", "fc.weight": "' + SHARD_2.encode() + b'"}}', INDEX),
         CheckpointError, (INDEX, "duplicate key 'fc.weight'"), shards=2),
    Case("index names a FIFO", lambda d: ((d / SHARD_2).unlink(), os.mkfifo(d / SHARD_2)), CheckpointError,
         (INDEX, SHARD_2, "not a regular file"), shards=2),
    Case("index names a missing shard", lambda d: (d / SHARD_2).unlink(), CheckpointError,
         (INDEX, SHARD_2, "does not exist"), shards=2),
    Case("shard lacks a tensor the index promises", tensors(lambda t: t.pop("norm.weight"), SHARD_1), CheckpointError,
         (SHARD_1, "'norm.weight'", "promised by"), shards=2),
    Case("same tensor in two shards", tensors(lambda t: t.update({"norm.weight": np.ones(64, BF16)}), SHARD_2),
         CheckpointError, (SHARD_2, "'norm.weight'", f"maps it to '{SHARD_1}'"), shards=2),
    Case("index points at ../x", index(lambda i: i["weight_map"].update({"fc.weight": "../outside.safetensors"})),
         CheckpointError, (INDEX, "'fc.weight'", "'../outside.safetensors'", "inside"), shards=2),
    Case("index points at an absolute path", lambda d: forge.edit_json(
        d / INDEX, lambda i: i["weight_map"].update({"fc.weight": str(d.parent / "outside.safetensors")})),
         CheckpointError, (INDEX, "'fc.weight'", "outside.safetensors", "inside"), shards=2),
    Case("index points into a subdirectory", index(lambda i: i["weight_map"].update({"fc.weight": f"sub/{SHARD_1}"})),
         CheckpointError, (INDEX, "'fc.weight'", "inside"), shards=2),
    Case("index points at config.json", index(lambda i: i["weight_map"].update({"fc.weight": "config.json"})),
         CheckpointError, ("config.json", "header length"), shards=2),
    # --- config.json --------------------------------------------------------------------------------------
    Case("no config.json", lambda d: (d / "config.json").unlink(), ConfigError, ("without config.json", "expected")),
    Case("config.json not JSON", config_text(b"{hidden_size: 64}"), ConfigError, ("config.json", "not valid JSON")),
    Case("config.json not UTF-8", config_text(b'{"hidden_size": "\xff"}'), ConfigError, ("config.json", "not valid JSON")),
    Case("config.json an array", config_text(b"[]"), ConfigError, ("config.json", "expected a JSON object")),
    Case("config.json nested 100k deep", config_text(deep()), ConfigError, ("config.json", "nested too deeply")),
    Case("config.json integer of 5000 digits", config_text(b'{"hidden_size": ' + b"6" * 5000 + b"}"), ConfigError,
         ("config.json", "not valid JSON", "digits")),
    Case("config.json lone surrogate", config_text(json.dumps({**TINY, "hidden_size": "\ud800"}).encode()), ConfigError,
         ("config.json", "surrogate")),
    Case("field of the wrong type", config(lambda c: c.update(hidden_size="64")), ConfigError,
         ("config.json", "$.hidden_size", "Expected `int`")),
    Case("float where an int is", config(lambda c: c.update(head_dim=16.5)), ConfigError, ("config.json", "$.head_dim")),
    Case("bool where an int is", config(lambda c: c.update(vocab_size=True)), ConfigError, ("config.json", "$.vocab_size")),
    Case("negative size", config(lambda c: c.update(intermediate_size=-128)), ConfigError,
         ("config.json", "$.intermediate_size", ">= 1")),
    Case("huge size", config(lambda c: c.update(vocab_size=10**30)), ConfigError, ("config.json", "$.vocab_size", "<=")),
    Case("10**12 layers", config(lambda c: c.update(num_hidden_layers=10**12)), ConfigError,
         ("config.json", "$.num_hidden_layers", "<= 1024")),
    Case("required field missing", config(lambda c: c.pop("head_dim")), ConfigError, ("config.json", "head_dim")),
    Case("block size 0", config(lambda c: c.update(block_size=0)), ConfigError, ("config.json", "$.block_size")),
    Case("nested block size 0", config(lambda c: c["dflash_config"].update(block_size=0)), ConfigError,
         ("config.json", "$.dflash_config.block_size")),
    Case("block size 1 leaves no drafts", config(lambda c: c.update(block_size=1)), ConfigError,
         ("config.json", "block size 1", ">= 2")),
    Case("head counts do not divide", config(lambda c: c.update(num_key_value_heads=3)), ConfigError,
         ("config.json", "num_attention_heads=4", "num_key_value_heads=3")),
    Case("conv group does not divide hidden", config(lambda c: c["dflash_config"].update(conv_group_size=24)),
         ConfigError, ("config.json", "conv_group_size=24", "hidden_size=64"), base="tiny-dflash2"),
    Case("rope_scaling and rope_parameters disagree", config(lambda c: c.update(
        rope_scaling={"rope_type": "yarn", "factor": 4.0})), ConfigError,
         ("config.json", "rope_scaling", "rope_parameters", "different"), base="tiny-dflash2"),
    Case("rope_theta and rope_parameters disagree", config(lambda c: c.update(rope_theta=5e5)), ConfigError,
         ("config.json", "rope_theta", "rope_parameters.rope_theta"), base="tiny-dflash2"),
    Case("rope_parameters an array", config(lambda c: c.update(rope_parameters=[1])), ConfigError,
         ("config.json", "rope_parameters", "expected an object")),
    Case("NaN rms_norm_eps", config_text(json.dumps({**TINY, "rms_norm_eps": math.nan}).encode()), ConfigError,
         ("config.json", "$.rms_norm_eps")),
    Case("rope_theta 1e999", config_text(json.dumps(TINY).replace('"rope_theta": 10000.0', '"rope_theta": 1e999').encode()),
         ConfigError, ("config.json", "$.rope_theta", "<= 1e+30")),
    Case("Infinity yarn beta", config(lambda c: c["rope_scaling"].update(beta_fast=math.inf)), ConfigError,
         ("config.json", "rope_scaling.beta_fast=inf", "finite"), base="tiny-dspark"),
    Case("mask token outside the vocabulary", config(lambda c: c["dflash_config"].update(mask_token_id=128)),
         ConfigError, ("config.json", "mask_token_id=128", "vocab_size=128")),
    Case("draft vocabulary larger than the target's", config(lambda c: c.update(draft_vocab_size=256)), ConfigError,
         ("config.json", "draft_vocab_size=256", "vocab_size=128")),
    Case("target layer beyond the target", config(lambda c: c["dflash_config"].update(target_layer_ids=[0, 2])),
         ConfigError, ("config.json", "target_layer_ids", "num_target_layers=2")),
    Case("target_layer_ids a string", config(lambda c: c["dflash_config"].update(target_layer_ids="1,3")),
         ConfigError, ("config.json", "$.dflash_config.target_layer_ids")),
    Case("unknown layer type", config(lambda c: c["layer_types"].__setitem__(1, "linear_attention")), ConfigError,
         ("config.json", "layer_types[1] = 'linear_attention'", "full_attention"), base="tiny-dflash2"),
    Case("unsupported markov head", config(lambda c: c.update(markov_head_type="gated")), ConfigError,
         ("config.json", "markov_head_type='gated'", "vanilla"), base="tiny-dspark"),
    Case("quantization groups of the wrong shape", config(lambda c: c.update(
        quantization_config={"config_groups": {"g": {"weights": [16]}}, "group_size": "16"})), ConfigError,
         ("config.json", "$.quantization_config.group_size")),
    # --- not a DFlash-family drafter ----------------------------------------------------------------------
    Case("a Qwen3 target checkpoint", swap_in("qwen3-8b-target.config.json", qwen3_tensors), ConfigError,
         ("config.json", "Qwen3ForCausalLM", "target model", "expected a DFlash")),
    Case("a Llama target (no head_dim)", swap_in("llama3.1-8b-target.config.json", qwen3_tensors), ConfigError,
         ("config.json", "LlamaForCausalLM", "target model", "expected a DFlash")),
    Case("an EAGLE-3 drafter", swap_in("eagle3-llama3.1-8b.config.json", eagle3_tensors), ConfigError,
         ("config.json", "LlamaForCausalLMEagle3", "EAGLE drafter", "expected a DFlash")),
    Case("an EAGLE-3 drafter without architectures", steps(swap_in("eagle3-llama3.1-8b.config.json", eagle3_tensors),
         config(lambda c: c.pop("architectures"))), ConfigError, ("config.json", "EAGLE-3 drafter", "expected a DFlash")),
    Case("EAGLE-3 tensors under a DFlash config", swap_in("", eagle3_tensors), CheckpointError,
         ("midlayer", "EAGLE-3", "expected `fc.weight` with `layers.*`")),
    Case("target tensors under a DFlash config", swap_in("", qwen3_tensors), CheckpointError,
         ("no `fc.weight`", "full language model", "expected a DFlash-family drafter")),
    Case("an empty directory", lambda d: [p.unlink() for p in d.iterdir()], ConfigError, ("without config.json",)),
    Case("a path that does not exist", lambda d: None, ConfigError, ("nope", "no such file"), load="nope"),
    Case("the safetensors file instead of its directory", lambda d: None, ConfigError,
         (ST, "expected the checkpoint directory"), load=ST),
    # --- tensors that disagree with the config ------------------------------------------------------------
    Case("missing tensor", tensors(lambda t: t.pop("layers.1.mlp.down_proj.weight")), CheckpointError,
         ("missing tensor 'layers.1.mlp.down_proj.weight'", "expected shape [64, 128]")),
    Case("missing bias", tensors(lambda t: t.pop("layers.0.self_attn.k_proj.bias")), CheckpointError,
         ("missing tensor 'layers.0.self_attn.k_proj.bias'", "[32]"), base=WITH_BIAS),
    Case("wrong shape", put("fc.weight", lambda w: w.T.copy()), CheckpointError,
         (ST, "'fc.weight'", "shape [128, 64]", "expected [64, 128]")),
    Case("config larger than the tensors", config(lambda c: c.update(intermediate_size=256)), CheckpointError,
         (ST, "'layers.0.mlp.gate_proj.weight'", "shape [128, 64]", "expected [256, 64]")),
    Case("norm of integers", put("norm.weight", lambda w: w.view(np.int16)), CheckpointError,
         (ST, "'norm.weight'", "dtype I16", "expected one of BF16")),
    Case("FP8 linear weight without its scale",
         put("layers.0.mlp.up_proj.weight", lambda w: w.astype(ml_dtypes.float8_e4m3fn)),
         CheckpointError, (ST, "'layers.0.mlp.up_proj.weight' is F8_E4M3 (FP8)",
                           "its scale 'layers.0.mlp.up_proj.weight_scale' is missing")),
    Case("reduced draft vocabulary without d2t", tensors(lambda t: t.pop("d2t")), CheckpointError,
         ("draft_vocab_size=64 < vocab_size=128", "no `d2t`"), base=REDUCED_VOCAB),
    Case("d2t of floats", put("d2t", lambda x: x.astype(np.float32)), CheckpointError,
         (ST, "'d2t'", "dtype F32", "expected one of I64"), base=REDUCED_VOCAB),
    Case("d2t maps beyond the target vocabulary", poke("d2t", (63,), 65), CheckpointError,
         (ST, "'d2t'", "draft id 63 to target id 128", "outside the target vocabulary [0, 128)"), base=REDUCED_VOCAB),
    Case("d2t maps below 0", poke("d2t", (5,), -6), CheckpointError,
         (ST, "'d2t'", "draft id 5 to target id -1", "outside the target vocabulary"), base=REDUCED_VOCAB),
    Case("d2t value that int32 would wrap", poke("d2t", (0,), 2**32), CheckpointError,
         (ST, "'d2t'", "draft id 0", "outside"), base=REDUCED_VOCAB),
    Case("d2t of U64 past 2**63", put("d2t", lambda x: np.full(x.shape, 2**64 - 1, np.uint64)), CheckpointError,
         (ST, "'d2t'", "outside"), base=REDUCED_VOCAB),
    # --- NaN / Inf (policy: docs/errors.md) ---------------------------------------------------------------
    Case("NaN in a norm", poke("norm.weight", (3,), np.nan), CheckpointError,
         (ST, "'norm.weight'", "1 NaN/Inf of 64", "index [3]", "expected finite")),
    Case("Inf in a q_norm", poke("layers.1.self_attn.q_norm.weight", (0,), np.inf), CheckpointError,
         (ST, "'layers.1.self_attn.q_norm.weight'", "NaN/Inf")),
    Case("NaN in a bias", poke("layers.0.self_attn.q_proj.bias", (7,), np.nan), CheckpointError,
         (ST, "'layers.0.self_attn.q_proj.bias'", "NaN/Inf"), base=WITH_BIAS),
    Case("NaN in a DFlash2 conv kernel", poke("layers.1.mlp_conv.base_kernel", (1, 0, 5), np.nan), CheckpointError,
         (ST, "'layers.1.mlp_conv.base_kernel'", "index [1, 0, 5]"), base="tiny-dflash2"),
    Case("Inf in the confidence head", poke("confidence_head.proj.bias", (0,), -np.inf), CheckpointError,
         (ST, "'confidence_head.proj.bias'", "NaN/Inf"), base="tiny-dspark"),
    Case("NaN in a sharded norm", poke("hidden_norm.weight", (0,), np.nan, SHARD_2), CheckpointError,
         (SHARD_2, "'hidden_norm.weight'", "NaN/Inf"), shards=2),
    # --- NVFP4 companions (ModelOpt layout) ---------------------------------------------------------------
    Case("NVFP4 weight_scale missing", tensors(lambda t: t.pop("layers.0.mlp.up_proj.weight_scale")), CheckpointError,
         (ST, "'layers.0.mlp.up_proj.weight'", "'layers.0.mlp.up_proj.weight_scale'", "missing"), nvfp4=True),
    Case("NVFP4 weight_scale_2 missing", tensors(lambda t: t.pop("fc.weight_scale_2")), CheckpointError,
         (ST, "'fc.weight_scale_2'", "missing"), nvfp4=True),
    Case("NVFP4 scale of the wrong shape", put("layers.1.self_attn.o_proj.weight_scale", lambda s: s[:, :2].copy()),
         CheckpointError, (ST, "layers.1.self_attn.o_proj.weight_scale", "expected [64, 4]"), nvfp4=True),
    Case("NVFP4 scale of the wrong dtype", put("fc.weight_scale", lambda s: s.astype(np.float32)), CheckpointError,
         (ST, "'fc.weight_scale'", "F32", "expected F8_E4M3"), nvfp4=True),
    Case("NVFP4 K not a multiple of 32", put("layers.0.mlp.up_proj.weight", lambda w: w[:, :24].copy()),
         CheckpointError, (ST, "layers.0.mlp.up_proj.weight", "48", "multiple of 32"), nvfp4=True),
    Case("NVFP4 unpacked shape disagrees with the config", config(lambda c: c.update(intermediate_size=96)),
         CheckpointError, (ST, "layers.0.mlp.gate_proj.weight", "[128, 64]", "[96, 64]"), nvfp4=True),
    Case("NVFP4 NaN block scale", poke("layers.0.self_attn.q_proj.weight_scale", (2, 1), np.nan), CheckpointError,
         (ST, "layers.0.self_attn.q_proj.weight_scale", "NaN"), nvfp4=True),
    Case("NVFP4 Inf global scale", put("fc.weight_scale_2", lambda s: np.full_like(s, np.inf)), CheckpointError,
         (ST, "fc.weight_scale_2", "not a finite number > 0"), nvfp4=True),
    Case("NVFP4 hf_quant_config.json not JSON", replace(b"{quant", "hf_quant_config.json"), CheckpointError,
         ("hf_quant_config.json", "not valid UTF-8 JSON"), nvfp4=True),
    Case("NVFP4 hf_quant_config.json nested 100k deep", replace(deep(), "hf_quant_config.json"), CheckpointError,
         ("hf_quant_config.json", "nested too deeply"), nvfp4=True),
    Case("NVFP4 hf_quant_config.json quantization not an object",
         replace(b'{"quantization": 5}', "hf_quant_config.json"), CheckpointError,
         ("hf_quant_config.json", "`quantization` object"), nvfp4=True),
    Case("NVFP4 declared group size 32", lambda d: forge.edit_json(
        d / "hf_quant_config.json", lambda q: q["quantization"].update(group_size=32)), CheckpointError,
         ("hf_quant_config.json", "group_size 32", "16"), nvfp4=True),
    # --- issue 13: finite but corrupt NVFP4 scales, pattern lists, ambiguous files ------------------------
    Case("NVFP4 negative global scale", put("fc.weight_scale_2", lambda s: -s), CheckpointError,
         (ST, "fc.weight_scale_2", "not a finite number > 0"), nvfp4=True),
    Case("NVFP4 zero global scale", put("fc.weight_scale_2", lambda s: s * 0), CheckpointError,
         (ST, "fc.weight_scale_2", "not a finite number > 0"), nvfp4=True),
    Case("NVFP4 global scale 3e38", put("layers.1.mlp.up_proj.weight_scale_2", lambda s: np.full_like(s, 3e38)),
         CheckpointError, (ST, "layers.1.mlp.up_proj.weight_scale_2", "beyond bfloat16's range"), nvfp4=True),
    Case("NVFP4 block scales with the sign bit set", put(
        "layers.0.self_attn.q_proj.weight_scale", lambda s: (s.view(np.uint8) | 0x80).view(s.dtype)),
         CheckpointError, (ST, "layers.0.self_attn.q_proj.weight_scale", "negative", ">= 0"), nvfp4=True),
    Case("NVFP4 exclude list of 5000 patterns", lambda d: forge.edit_json(
        d / "hf_quant_config.json", lambda q: q["quantization"].update(exclude_modules=[f"m{i}.*" for i in range(5000)])),
         CheckpointError, ("hf_quant_config.json", "$.ignore", "<= 4096"), nvfp4=True),
    Case("quantization_config ignore of 5000 patterns", config(lambda c: c.update(
        quantization_config={"quant_algo": "NVFP4", "ignore": [f"m{i}" for i in range(5000)]})), ConfigError,
         ("config.json", "$.quantization_config.ignore", "<= 4096")),
    Case("config.json duplicate mask_token_id", config_text(
        json.dumps(TINY)[:-1].encode() + b', "dflash_config": {"mask_token_id": 1, "mask_token_id": 2}}'),
         ConfigError, ("config.json", "duplicate key")),
    Case("config.json duplicate num_hidden_layers", config_text(
        b'{"num_hidden_layers": 2, ' + json.dumps(TINY)[1:].encode()), ConfigError,
         ("config.json", "duplicate key 'num_hidden_layers'")),
    Case("config.json in UTF-16", config_text(json.dumps(TINY).encode("utf-16")), ConfigError,
         ("config.json", "not valid JSON", "not UTF-8 JSON", "byte-order mark of UTF-16")),
    Case("config.json in UTF-32", config_text(json.dumps(TINY).encode("utf-32-le")), ConfigError,
         ("config.json", "not valid JSON")),
    Case("rope_theta 1e-300", config(lambda c: c.update(rope_theta=1e-300)), ConfigError,
         ("config.json", "$.rope_theta", "> 1")),
    Case("rope_theta 1", config(lambda c: c.update(rope_theta=1.0)), ConfigError, ("config.json", "$.rope_theta")),
    Case("odd head_dim under YaRN", config(lambda c: c.update(head_dim=5)), ConfigError,
         ("config.json", "head_dim=5 is odd"), base="tiny-dspark"),  # found by test_fuzz: a raw shape error in RoPE
    Case("odd head_dim", config(lambda c: c.update(head_dim=15)), ConfigError, ("config.json", "head_dim=15 is odd")),
    Case("YaRN factor 1e-300", config(lambda c: c["rope_scaling"].update(factor=1e-300)), ConfigError,
         ("config.json", "rope_scaling.factor=1e-300", "[1, 1e+06]"), base="tiny-dspark"),
    Case("YaRN beta_fast negative", config(lambda c: c["rope_scaling"].update(beta_fast=-32.0)), ConfigError,
         ("config.json", "$.rope_scaling.beta_fast", "> 0"), base="tiny-dspark"),
    Case("num_target_layers 2**40", config(lambda c: (c["dflash_config"].pop("target_layer_ids"),
                                                      c.update(num_target_layers=2**40))), ConfigError,
         ("config.json", "$.num_target_layers", "<= 2147483647")),
    Case("num_target_layers too few to derive ids", config(lambda c: (c["dflash_config"].pop("target_layer_ids"),
                                                                       c.update(num_target_layers=1))), ConfigError,
         ("config.json", "num_target_layers=1 is too few", "target_layer_ids")),
    Case("target_layer_ids empty", config(lambda c: c["dflash_config"].update(target_layer_ids=[])), ConfigError,
         ("config.json", "target_layer_ids is empty")),
    # --- issue 26: values float32 cannot hold, a file for a directory, a d2t past the vocabulary -----------
    Case("NVFP4 subnormal global scale", put("fc.weight_scale_2", lambda s: np.full_like(s, 1e-40)), CheckpointError,
         (ST, "fc.weight_scale_2", "subnormal", "flushes to 0"), nvfp4=True),
    Case("YaRN beta_fast 0 in float32", config(lambda c: c["rope_scaling"].update(beta_fast=1e-50)), ConfigError,
         ("config.json", "rope_scaling.beta_fast=1e-50 is 0 in float32"), base="tiny-dspark"),
    Case("YaRN beta_slow Inf in float32", config(lambda c: c["rope_scaling"].update(beta_slow=1e39)), ConfigError,
         ("config.json", "rope_scaling.beta_slow=1e+39 is Inf in float32"), base="tiny-dspark"),
    Case("config.json given for the directory", lambda d: None, ConfigError,
         ("config.json", "a file, not a directory", "expected the checkpoint directory"), load="config.json"),
    Case("d2t of 2**31 entries (sparse)", steps(tensors(lambda t: t.pop("d2t")), lambda d: forge.add_sparse(
        d / ST, {"d2t": (2**31,)}, np.int64)), CheckpointError,
         (ST, "'d2t'", "shape [2147483648]", "expected [64]"), base=REDUCED_VOCAB),
    Case("stale model.safetensors beside the index", lambda d: forge.write_tensors(
        d / ST, forge.read_tensors(d / SHARD_1)), CheckpointError, (ST, "index.json maps to", SHARD_1, "ambiguous"),
         shards=2),
]


@pytest.fixture
def placements(monkeypatch) -> list[int]:
    """Counts calls of `place_all`: a refused checkpoint must never reach device placement."""
    calls: list[int] = []
    real = dflash_jax.placement.place_all

    def counting(plan, *args, **kwargs):
        calls.append(len(plan))
        return real(plan, *args, **kwargs)

    monkeypatch.setattr(dflash_jax.placement, "place_all", counting)
    return calls


_opened: list[str] | None = None  # paths opened while a test watches (see `watch_opens`)


def _audit(event: str, args: tuple) -> None:
    if _opened is not None and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        _opened.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)


@contextlib.contextmanager
def watch_opens():
    """Record every file opened inside the block (Python's audit hook: open(), os.open, io)."""
    global _opened
    _opened = []
    try:
        yield _opened
    finally:
        _opened = None


def checkpoint_for(case: Case, tmp_path: Path) -> Path:
    directory = tmp_path / "ckpt"
    write_checkpoint(directory, case.base, num_shards=case.shards, nvfp4=case.nvfp4)
    # a valid file just outside, for the cases that try to escape: it must never be opened
    write_checkpoint(tmp_path / "other", "tiny-dflash")
    shutil.copy(tmp_path / "other" / ST, tmp_path / "outside.safetensors")
    return directory


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_corpus(case: Case, tmp_path: Path, placements: list[int]):
    directory = checkpoint_for(case, tmp_path)
    case.build(directory)
    with deadline(20), watch_opens() as opened, pytest.raises(ValueError) as caught:
        load_drafter(directory / case.load)
    error = caught.value
    assert type(error) is case.error, f"{type(error).__name__}: {error}"  # not a bare ValueError or another class
    missing = [s for s in case.says if s not in str(error)]
    assert not missing, f"message lacks {missing}: {error}"
    assert not placements, "a refused checkpoint reached device placement"
    outside = [p for p in opened if p.startswith(str(tmp_path)) and not p.startswith(str(directory))]
    assert not outside, f"read outside the checkpoint directory: {outside}"


def test_corpus_cases_are_unique():
    assert len({c.id for c in CASES}) == len(CASES)


def test_absurd_header_length_allocates_nothing(tmp_path: Path):
    """A header length of 99 MB (under the 100 MB cap) in a 20-byte file: refused before any read."""
    path = forge.write_raw(tmp_path / ST, b"{}", length=99 * 1024 * 1024)
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError, match="larger than the file"):
            dflash_jax.safetensors.read_header(str(path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1024 * 1024, f"peak {peak} bytes"


def test_fifo_is_refused_not_read(tmp_path: Path):
    os.mkfifo(tmp_path / "a.safetensors")
    with deadline(10), pytest.raises(CheckpointError, match="not a regular file"):
        dflash_jax.safetensors.read_header(str(tmp_path / "a.safetensors"))
    forge.write_tensors(tmp_path / "b.safetensors", {"x": np.arange(3, dtype=np.float32)})
    with deadline(10), dflash_jax.safetensors.Checkpoint(tmp_path) as checkpoint:  # the FIFO is skipped
        assert list(checkpoint) == ["x"]


def test_hf_cache_symlinks_still_load(tmp_path: Path):
    """Hugging Face's cache links every file of a snapshot to ../../blobs: symlinks are followed (only
    names in the index that leave the directory are refused)."""
    write_checkpoint(tmp_path / "written", "tiny-dflash2", num_shards=2)
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "abc123"
    blobs.mkdir()
    snapshot.mkdir(parents=True)
    for i, file in enumerate(sorted((tmp_path / "written").iterdir())):
        shutil.copy(file, blobs / f"blob{i}")
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", f"blob{i}"))
    drafter = load_drafter(snapshot)
    expected = forge.read_tensors(tmp_path / "written" / SHARD_1)["fc.weight"]
    chex.assert_trees_all_equal(np.asarray(drafter.params["fc"]["weight"]), expected)


def test_big_matrices_are_not_scanned_unless_asked(tmp_path: Path, monkeypatch):
    """The NaN/Inf policy: small tensors on every load, the big matrices only through scan_checkpoint."""
    write_checkpoint(tmp_path, "tiny-dflash")
    poke("fc.weight", (1, 2), np.nan)(tmp_path)  # 8192 elements: scanned at the default limit
    with pytest.raises(CheckpointError, match="'fc.weight' holds 1 NaN/Inf"):
        load_drafter(tmp_path)
    monkeypatch.setattr(dflash_jax.validate, "SCAN_ELEMENTS", 4096)  # as if fc were a real-size matrix
    drafter = load_drafter(tmp_path)
    assert np.isnan(np.asarray(drafter.params["fc"]["weight"], np.float32)[1, 2])
    with pytest.raises(CheckpointError, match=f"{ST}: tensor 'fc.weight' holds 1 NaN/Inf"):
        scan_checkpoint(tmp_path)


def test_scan_checkpoint_passes_a_clean_checkpoint(tmp_path: Path):
    write_checkpoint(tmp_path, "tiny-dspark", num_shards=3)
    scan_checkpoint(tmp_path)


# --- issue 13 §4: checks cost no more than the work they guard ------------------------------------------

def test_every_header_is_checked_before_any_tensor_value_is_read(tmp_path: Path, monkeypatch):
    """A missing tensor late in the plan is reported before a single scale or norm is read (the old order
    scanned each NVFP4 weight's scales as it went: a sparse 1 GiB scale file cost 3.2 GB of RSS first)."""
    write_checkpoint(tmp_path, "tiny-dflash", nvfp4=True)
    tensors(lambda t: t.pop("layers.1.post_attention_layernorm.weight"))(tmp_path)
    read: list[str] = []
    real = dflash_jax.safetensors.Checkpoint.array
    monkeypatch.setattr(dflash_jax.safetensors.Checkpoint, "array", lambda self, n: read.append(n) or real(self, n))
    with pytest.raises(CheckpointError, match="missing tensor 'layers.1.post_attention_layernorm.weight'"):
        load_drafter(tmp_path)
    assert read == []


def test_the_d2t_range_check_works_in_bounded_memory(tmp_path: Path, monkeypatch):
    """The old check allocated the whole index range (and temporaries) at once: 16 GiB for a sparse
    [2**31 - 2] d2t. Chunked, the peak is a few chunks whatever the vocabulary."""
    n = 1 << 20
    forge.write_tensors(tmp_path / ST, {"d2t": np.zeros(n, np.int64)})
    monkeypatch.setattr(dflash_jax.validate, "D2T_CHUNK", 1 << 14)
    with dflash_jax.safetensors.Checkpoint(tmp_path) as checkpoint:
        tracemalloc.start()
        try:
            dflash_jax.validate.check_d2t(checkpoint, checkpoint["d2t"], vocab_size=n)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < n, f"peak {peak} bytes for a d2t of {8 * n} bytes"
        with pytest.raises(CheckpointError, match=f"draft id {n - 1} to target id {n - 1}.* 1 of {n} ids"):
            dflash_jax.validate.check_d2t(checkpoint, checkpoint["d2t"], vocab_size=n - 1)


def test_exclusion_patterns_match_as_fnmatch_does():
    from dflash_jax.nvfp4.checkpoint import exclusion_matcher

    patterns = ("lm_head", "*.q_proj", "layers.[01].mlp.*", "fc?weight", "a+b(c)")
    excluded = exclusion_matcher(patterns)
    for name in ("lm_head", "lm_head.weight", "layers.0.self_attn.q_proj", "layers.1.mlp.up_proj",
                 "layers.2.mlp.up_proj", "fc.weight", "fcweight", "a+b(c)", "a+bc", ""):
        assert excluded(name) == any(fnmatch.fnmatchcase(name, p) for p in patterns), name
    assert not exclusion_matcher(())("anything")


def test_many_exclusion_patterns_are_cheap(tmp_path: Path):
    """4096 wildcard patterns (the cap) over an NVFP4 checkpoint: one compiled matcher, not 4096 x tensors calls."""
    write_checkpoint(tmp_path, "tiny-dflash", nvfp4=True)
    forge.edit_json(tmp_path / "hf_quant_config.json",
                    lambda q: q["quantization"].update(exclude_modules=[f"model.m{i}.*" for i in range(4096)]))
    with deadline(20):
        load_drafter(tmp_path)


class _SmallDevice:
    """A device that reports its memory, as GPUs do (CPUs report none)."""

    id, platform = 7, "gpu"

    def __init__(self, free: int):
        self.free = free

    def memory_stats(self):
        return {"bytes_limit": self.free + 1000, "bytes_in_use": 1000}

    def __repr__(self):
        return "cuda:7"


def test_a_checkpoint_larger_than_the_free_device_memory_is_refused_before_placement(tmp_path: Path, monkeypatch):
    write_checkpoint(tmp_path, "tiny-dflash")
    monkeypatch.setattr(dflash_jax.placement, "target_sharding", lambda mesh: SimpleNamespace(
        addressable_devices=[_SmallDevice(free=100_000)], shard_shape=lambda shape: shape))
    puts = []
    monkeypatch.setattr(dflash_jax.placement.jax, "device_put", lambda *a, **k: puts.append(a))
    with pytest.raises(CheckpointError, match=r"needs 0 MiB on each device as float32 but cuda:7 has 0 MiB free"):
        load_drafter(tmp_path, dtype=np.float32)
    assert puts == []


def test_check_fits_counts_the_leaves_at_the_load_dtype(tmp_path: Path):
    from dflash_jax.loader import load_config
    from dflash_jax.plan import open_checked

    write_checkpoint(tmp_path, "tiny-dflash")
    with open_checked(str(tmp_path), load_config(tmp_path)) as (checkpoint, _, plan, _):
        sources = [[t.name] for t in plan]
        elements = sum(math.prod(t.shape) for t in plan)
        largest = max(checkpoint[t.name].nbytes for t in plan)
        fits = dflash_jax.placement.check_fits
        fits(plan, sources, checkpoint, [_SmallDevice(2 * elements)], np.dtype(BF16))  # no conversion
        with pytest.raises(CheckpointError):
            fits(plan, sources, checkpoint, [_SmallDevice(2 * elements - 1)], np.dtype(BF16))
        fits(plan, sources, checkpoint, [_SmallDevice(4 * elements + largest)], np.dtype(np.float32))
        with pytest.raises(CheckpointError):
            fits(plan, sources, checkpoint, [_SmallDevice(4 * elements + largest - 1)], np.dtype(np.float32))


# --- issue 13 §8: load_drafter's arguments ------------------------------------------------------------

@pytest.mark.parametrize("dtype,says", [
    (np.int8, "dtype=int8 cannot hold the weights"), (np.int32, "dtype=int32"), (np.bool_, "dtype=bool"),
    (ml_dtypes.float8_e4m3fn, "dtype=float8_e4m3fn"), ("banana", "dtype='banana' is not a dtype"),
    (np.float64, "dtype=float64"),  # without x64, JAX would silently load float32
])
def test_a_load_dtype_that_cannot_hold_the_weights_is_refused(tmp_path: Path, placements, dtype, says):
    write_checkpoint(tmp_path, "tiny-dflash")
    with pytest.raises(ValueError, match=says):
        load_drafter(tmp_path, dtype=dtype)
    assert not placements


@pytest.mark.parametrize("mesh,says", [
    ([], "mesh is a list"), ("cpu", "mesh is a str"),
    (jax.sharding.Mesh(np.empty((0,), object), ("x",)), "mesh has no devices"),
])
def test_a_mesh_that_is_not_a_mesh_of_devices_is_refused(tmp_path: Path, placements, mesh, says):
    write_checkpoint(tmp_path, "tiny-dflash")
    with pytest.raises(ValueError, match=says):
        load_drafter(tmp_path, mesh=mesh)
    assert not placements

"""What the decode loops share (`dflash_jax.bookkeeping`), from the user's side: every generate function stops at the
target's end-of-sequence ids by default (generation_config.json's, else config.json's, read at load), as
transformers and vLLM do, and runs to its budget with `stop_token_ids=()`."""

from __future__ import annotations

import json

import jax.numpy as jnp
import msgspec
import pytest

from dflash_jax import greedy_generate, load_target, sample_generate, speculative_generate
from dflash_jax._qwen3_testing import random_qwen3, write_qwen3_checkpoint
from dflash_jax.errors import ConfigError
from dflash_jax.testing import random_drafter

PROMPT, MAX_NEW = [3, 14, 15, 92], 12


@pytest.fixture(scope="module")
def target():
    return random_qwen3("tiny-qwen3", seed=0, dtype=jnp.float32)


def _with_eos(target, eos):
    return type(target)(params=target.params, config=msgspec.structs.replace(target.config, eos_token_id=eos),
                        layout=target.layout)


def test_every_generate_function_stops_at_the_targets_eos_by_default(target):
    """The target's eos id made the 5th token of its unstopped greedy run: each function's output ends there (kept),
    and with `stop_token_ids=()` runs to the budget. (On 03f7534 the default ran past it, to the budget.)"""
    full = greedy_generate(target, PROMPT, max_new_tokens=MAX_NEW, stop_token_ids=()).tokens[0]
    assert len(full) == MAX_NEW
    eos = full[4]
    stopping = _with_eos(target, (eos, 500))
    expected = full[: full.index(eos) + 1]
    drafter = random_drafter("tiny-dflash", dtype=jnp.float32)
    assert stopping.eos_token_ids == (eos, 500)
    assert greedy_generate(stopping, PROMPT, max_new_tokens=MAX_NEW).tokens == [expected]
    assert speculative_generate(stopping, drafter, PROMPT, max_new_tokens=MAX_NEW,
                                draft_length="fixed").tokens == [expected]
    assert sample_generate(stopping, PROMPT, max_new_tokens=MAX_NEW, temperature=0.0).tokens == [expected]
    assert greedy_generate(stopping, PROMPT, max_new_tokens=MAX_NEW, stop_token_ids=()).tokens == [full]


def test_generation_config_eos_comes_before_config_json(tmp_path):
    write_qwen3_checkpoint(tmp_path, dtype="float32")  # config.json: eos_token_id 1
    assert load_target(tmp_path, dtype=jnp.float32).eos_token_ids == (1,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9], "do_sample": False}))
    assert load_target(tmp_path, dtype=jnp.float32).eos_token_ids == (7, 9)
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6}))  # no eos stated: config's
    assert load_target(tmp_path, dtype=jnp.float32).eos_token_ids == (1,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "</s>"}))
    with pytest.raises(ConfigError, match=r"generation_config.json: eos_token_id is '</s>'"):
        load_target(tmp_path, dtype=jnp.float32)

"""Config decoding: every released config, every resolved value, every documented error."""

import json
import pathlib
import warnings
from unittest.mock import ANY

import pytest

from dflash_jax import ConfigError, DflashConfig, load_config, parse_config
from dflash_jax.config import default_target_layer_ids, replace

CONFIGS = pathlib.Path(__file__).parent.parent / "configs"

# (file, family, effective block size, drafts per step, mask id, target layer ids, rope theta, rope type)
RELEASED = [
    ("zlab-qwen3-8b-dflash-b16", "dflash", 16, 15, 151669, (1, 9, 17, 25, 33), 1e6, "default"),
    ("zlab-qwen3.6-35b-a3b-dflash-v2", "dflash", 16, 15, 248070, (1, 10, 19, 28, 37), 1e7, "default"),
    ("zlab-qwen3.6-35b-a3b-dflash-tf5", "dflash", 16, 15, 248077, (1, 6, 11, 16, 22, 27, 32, 37), 1e7, "default"),
    ("muse-glimmer-dflash2", "dflash2", 16, 15, 201818, (1, 13, 25, 37, 49), 5e5, "default"),
    ("radixark-qwen3.8-27b-dspark", "dspark", 7, 7, 248070, (5, 19, 33, 47, 61), 1e7, "yarn"),
]


@pytest.mark.parametrize("name,family,block,drafts,mask,layers,theta,rope", RELEASED)
def test_released_configs(name, family, block, drafts, mask, layers, theta, rope):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        config = load_config(CONFIGS / f"{name}.json")
    stated = "rope_theta" in (CONFIGS / f"{name}.json").read_text()
    assert [str(w.message) for w in record if "rope_theta" in str(w.message)] == ([] if stated else [ANY])
    assert isinstance(config, DflashConfig)
    assert (config.family, config.effective_block_size, config.num_draft_tokens) == (family, block, drafts)
    assert (config.mask_token_id, config.target_layer_ids) == (mask, layers)
    assert (config.rope_theta, config.rope_type) == (theta, rope)
    hash(config)  # static-argument ready


def test_released_details():
    tf5 = load_config(CONFIGS / "zlab-qwen3.6-35b-a3b-dflash-tf5.json")
    assert tf5.layer_types[-1] == "full_attention" and tf5.sliding_window == 4096 and tf5.use_sliding_window
    assert tf5.block_size == 16 and tf5.dflash_config.block_size == 16
    muse = load_config(CONFIGS / "muse-glimmer-dflash2.json")
    assert muse.logit_transform == pytest.approx((0.19611613513818404, 20.0))  # nested in dflash_config
    assert muse.final_logit_softcapping is None and muse.output_multiplier is None  # nothing at the top level
    assert (muse.dflash_config.conv_kernel_size, muse.dflash_config.conv_group_size) == (2, 16)
    assert (muse.dflash_config.selector_rank, muse.dflash_config.selector_top_k) == (256, 16)
    assert muse.rms_norm_eps == 1e-5 and muse.is_causal is False
    spark = load_config(CONFIGS / "radixark-qwen3.8-27b-dspark.json")
    assert spark.markov_rank == 256 and spark.enable_confidence_head
    assert spark.confidence_head_with_markov is None  # not stated: the loader reads it off the projection's width
    assert spark.rope_scaling.factor == 32.0 and spark.rope_scaling.original_max_position_embeddings == 8192
    v2 = load_config(CONFIGS / "zlab-qwen3.6-35b-a3b-dflash-v2.json")
    assert v2.rope_scaling is None and v2.num_key_value_heads == 4


def base(**overrides):
    """The z-lab Qwen3-8B config (rope_theta 1e6, its target's), without rope_theta when `rope_parameters` is
    given."""
    raw = json.loads((CONFIGS / "zlab-qwen3-8b-dflash-b16.json").read_text())
    if "rope_parameters" in overrides:
        del raw["rope_theta"]
    raw.update(overrides)
    return raw


def test_rust_schema_defaults():
    raw = base()
    del raw["block_size"], raw["rope_theta"]
    with pytest.warns(UserWarning, match="no `rope_theta`") as record:
        config = parse_config(raw, source="drafter/config.json")
    assert config.block_size == 16 and config.rope_theta == 1e7 and config.rope_type == "default"
    (message,) = [str(w.message) for w in record]
    assert "drafter/config.json" in message and "10000000" in message and "1e4" in message and "1e6" in message
    assert config.confidence_head_with_markov is None and config.markov_rank == 0
    assert config.draft_vocab_size is None
    assert config.rms_norm_eps == 1e-6 and config.markov_head_type is None and not config.enable_confidence_head


def test_trained_block_size_wins():
    """A DFlash2 drafter trained at 8 must never come up as the top-level default of 16."""
    raw = base(dflash_config={"mask_token_id": 5, "target_layer_ids": [1], "block_size": 8,
                              "conv_kernel_size": 2, "conv_group_size": 16})
    del raw["block_size"]
    config = parse_config(raw)
    assert (config.effective_block_size, config.num_draft_tokens, config.family) == (8, 7, "dflash2")


def test_input_forms_and_unknown_fields():
    raw = base(some_new_field={"x": 1})
    expected = parse_config(raw)
    assert parse_config(json.dumps(raw)) == expected == parse_config(json.dumps(raw).encode())


def test_rope_parameters():
    config = parse_config(base(rope_parameters={"rope_theta": 5e5, "rope_type": "yarn", "factor": 4.0}))
    assert config.rope_theta == 5e5 and config.rope_type == "yarn" and config.rope_scaling.factor == 4.0
    same = {"rope_type": "yarn", "factor": 4.0}
    with pytest.warns(UserWarning, match="no `rope_theta`"):  # rope_parameters without a theta
        assert parse_config(base(rope_parameters=same, rope_scaling=same)).rope_type == "yarn"
    with pytest.raises(ConfigError, match="rope_parameters"):
        parse_config(base(rope_parameters={"rope_type": "yarn", "factor": 4.0}, rope_scaling={"rope_type": "default"}))
    with pytest.raises(ConfigError, match="rope_theta"):
        parse_config(base(rope_theta=1e6, rope_parameters={"rope_theta": 5e5}))


def test_unknown_rope_type_warns_and_runs_plain():
    with pytest.warns(UserWarning, match="llama3"):
        config = parse_config(base(rope_scaling={"rope_type": "llama3", "factor": 8.0}))
    assert config.rope_type == "default"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert parse_config(base(rope_theta=1e6, rope_scaling={"type": "yarn", "factor": 2.0})).rope_type == "yarn"


def test_deepspec_dspark_top_level():
    raw = base(architectures=["Qwen3DSparkModel"], block_size=7, markov_rank=256, markov_head_type="vanilla",
               mask_token_id=151669, target_layer_ids=[1, 9, 17, 25, 33], enable_confidence_head=True)
    del raw["dflash_config"]
    config = parse_config(raw)
    assert (config.family, config.num_draft_tokens, config.mask_token_id) == ("dspark", 7, 151669)


def test_specforge_dspark_nested_fields_hoisted():
    raw = base(dflash_config={"projector_type": "dspark", "mask_token_id": 3, "target_layer_ids": [1, 2],
                              "markov_rank": 64, "enable_confidence_head": True})
    config = parse_config(raw)
    assert config.family == "dspark" and config.markov_rank == 64 and config.enable_confidence_head


def test_mask_sources_in_order_and_zero_is_valid():
    raw = base(mask_token_id=7, dspark_config={"mask_token_id": 9})
    assert parse_config(raw).mask_token_id == 151669  # dflash_config first
    raw["dflash_config"] = {"target_layer_ids": [1]}
    assert parse_config(raw).mask_token_id == 7  # then top level
    del raw["mask_token_id"]
    assert parse_config(raw).mask_token_id == 9  # then dspark_config
    raw["dflash_config"]["mask_token_id"] = 0
    assert parse_config(raw).mask_token_id == 0


def test_default_target_layer_ids():
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    assert default_target_layer_ids(36, 1) == (18,)
    raw = base(dflash_config={"mask_token_id": 1})
    assert parse_config(raw).target_layer_ids == (1, 9, 17, 25, 33)


@pytest.mark.parametrize(
    "change,field",
    [
        (lambda r: r.pop("hidden_size"), "hidden_size"),
        (lambda r: r.update(hidden_size="4096"), "hidden_size"),
        (lambda r: r.update(num_hidden_layers=-1), "num_hidden_layers"),
        (lambda r: r.update(block_size=0), "block_size"),
        (lambda r: r.update(markov_head_type="gated"), "markov_head_type"),
        (lambda r: r.update(num_target_layers=20), "num_target_layers"),
        (lambda r: r.update(num_key_value_heads=5), "num_key_value_heads"),
        (lambda r: r.update(dflash_config={"target_layer_ids": [1]}), "mask"),
        (lambda r: r.update(dflash_config={"mask_token_id": 1}, num_target_layers=None), "target_layer_ids"),
        (lambda r: r.update(layer_types=["full_attention"]), "layer_types"),
    ],
)
def test_errors_name_source_and_field(change, field):
    raw = base()
    change(raw)
    with pytest.raises(ConfigError, match=field) as err:
        parse_config(raw, source="drafter/config.json")
    assert "drafter/config.json" in str(err.value) and isinstance(err.value, ValueError)


def test_not_a_drafter(tmp_path):
    with pytest.raises(ConfigError, match="without config.json"):
        load_config(tmp_path)
    qwen = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
            "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "vocab_size": 128}
    (tmp_path / "config.json").write_text(json.dumps(qwen))
    with pytest.raises(ConfigError, match="target model"):
        load_config(tmp_path)
    with pytest.raises(ConfigError, match="EAGLE"):
        parse_config({**qwen, "architectures": ["LlamaForCausalLMEagle3"]})


def test_frozen_and_replace_checks_again():
    """A config cannot be changed in place; `replace` derives one and checks it as a file is checked (types,
    bounds, consistency), with the typed error naming the field; the stated values stay apart from resolved ones."""
    config = parse_config(base())
    with pytest.raises(AttributeError):
        config.hidden_size = 1
    assert replace(config, hidden_size=8).hidden_size == 8
    with pytest.raises(ConfigError, match=r"replace\(hidden_size\).*hidden_size"):
        replace(config, hidden_size=0)  # below its bound
    with pytest.raises(ConfigError, match="num_key_value_heads=3"):
        replace(config, num_key_value_heads=3)  # consistent types, inconsistent heads
    with pytest.raises(ConfigError, match="outside the target vocabulary"):
        replace(config, vocab_size=config.mask_token_id)
    assert config.stated_mask_token_id is None and config.mask_token_id == config.dflash_config.mask_token_id


# --- issue 13 §5 ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-32", "utf-32-be"])
def test_only_utf8_is_decoded(encoding):
    text = json.dumps(base())
    assert parse_config(text.encode("utf-8")) == parse_config(text)
    with pytest.raises(ConfigError, match="c.json: not valid JSON"):  # without a BOM: NULs, not JSON
        parse_config(text.encode(encoding), source="c.json")


@pytest.mark.parametrize("key", ["mask_token_id", "num_hidden_layers", "target_layer_ids"])
def test_a_duplicate_key_is_refused_not_last_wins(key):
    raw = base()
    raw.setdefault(key, raw["dflash_config"].get(key))
    text = json.dumps(raw)
    doubled = text[:-1] + f', "{key}": {json.dumps(raw[key])}}}'
    with pytest.raises(ConfigError, match=f"duplicate key '{key}'"):
        parse_config(doubled)
    with pytest.raises(ConfigError, match="duplicate key"):
        parse_config(doubled.encode())


@pytest.mark.parametrize("theta", [1e-300, 0.5, 1.0, 1e31])
def test_rope_theta_outside_the_finite_range_is_refused(theta):
    with pytest.raises(ConfigError, match=r"\$.rope_theta"):
        parse_config(base(rope_theta=theta))


def test_derived_target_layer_ids_stay_within_the_target():
    raw = base(dflash_config={"mask_token_id": 1})
    for n in (4, 36, 2**31 - 1):
        ids = parse_config({**raw, "num_target_layers": n}).target_layer_ids
        assert all(0 <= i < n for i in ids), (n, ids)
    with pytest.raises(ConfigError, match="num_target_layers"):
        parse_config({**raw, "num_target_layers": 2**31})


def test_an_odd_head_dim_is_refused_for_drafters_and_targets():
    """Rotary embeddings turn pairs of dimensions: an odd head size is a ConfigError naming it, for a drafter and
    for each dense target kind, never a shape error (or a silent misrotation) inside the RoPE tables."""
    from dflash_jax.target.config import LlamaConfig, Qwen3Config, parse_decoder_config
    from dflash_jax.testing import QWEN3_TINY_CONFIGS

    with pytest.raises(ConfigError, match="head_dim=5 is odd"):
        parse_config(base(head_dim=5))
    for name, kind in (("tiny-qwen3", Qwen3Config), ("tiny-llama", LlamaConfig)):
        with pytest.raises(ConfigError, match="head_dim=7 is odd"):
            parse_decoder_config({**QWEN3_TINY_CONFIGS[name], "head_dim": 7}, kind)


def test_rope_config_is_what_both_config_kinds_provide():
    """`rope.rope_frequencies` reads a `RopeConfig`: the drafter's config and every target config provide it."""
    from dflash_jax.rope import RopeConfig
    from dflash_jax.target.config import LlamaConfig, Qwen3Config, parse_decoder_config
    from dflash_jax.testing import QWEN3_TINY_CONFIGS

    targets = [parse_decoder_config(QWEN3_TINY_CONFIGS[name], kind)
               for name, kind in (("tiny-qwen3", Qwen3Config), ("tiny-llama", LlamaConfig))]
    for config in [parse_config(base()), *targets]:
        assert isinstance(config, RopeConfig)
    assert targets[1].head_dim == 64 // 8 and targets[1].stated_head_dim is None  # resolved, stated apart

"""Hostile calls (issue 26): arguments of the public entry points that ran silently wrong, escaped as raw
Python/JAX errors or misled. Each gets a `TypeError` / `ValueError` (or the loaders' `ConfigError` /
`CheckpointError`) naming the argument, the field or the tensor, before anything is compiled or placed.

Cheap by design: the refusals come before any compilation; the few runs are one tiny drafting step each.
"""

from __future__ import annotations

import copy
import functools
import math
import re
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import dflash_jax._memory
import dflash_jax.placement
from dflash_jax import Adaptive, AttentionOptions, CheckpointError, ConfigError, cli, load_drafter, load_target
from dflash_jax._arguments import check_seed
from dflash_jax._qwen3_testing import QWEN3_TINY_CONFIGS, write_qwen3_checkpoint
from dflash_jax.config import parse_config
from dflash_jax.drafter import Drafter
from dflash_jax.drafting import append_context, init_cache, propose
from dflash_jax.generate import greedy_generate, sample_generate, speculative_generate
from dflash_jax.linen import DrafterModule, init_params
from dflash_jax.model import draft_logits
from dflash_jax.nnx import DFlashDrafter
from dflash_jax.target.config import LlamaConfig, parse_decoder_config
from dflash_jax.target.dense import Qwen3Target
from dflash_jax.testing import TINY_CONFIGS, write_checkpoint

from ._drafters import block, features, tiny_drafter
from .hostile import forge

ST = "model.safetensors"
GiB = 2**30


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("qwen3")
    write_qwen3_checkpoint(directory, "tiny-qwen3", seed=1)
    return directory


@pytest.fixture(scope="module")
def target(target_dir):
    return load_target(target_dir, dtype=jnp.float32)


@pytest.fixture(scope="module")
def drafter():
    return tiny_drafter("tiny-dflash")  # H 64, 2 layers, block 8, vocab 128, embedding and LM head attached


@pytest.fixture
def nothing_placed(monkeypatch) -> list:
    """Fails the test at the first host->device copy of a load: a refused load must place nothing (and a 96 GiB
    one must not start)."""
    puts: list = []

    def refuse(*args, **kwargs):
        puts.append(args)
        raise AssertionError("a load that should have been refused reached jax.device_put")

    monkeypatch.setattr(dflash_jax.placement.jax, "device_put", refuse)
    return puts


def copy_dir(source: Path, destination: Path) -> Path:
    shutil.copytree(source, destination)
    return destination


# --- load_target gets load_drafter's guards ---------------------------------------------------------------

@pytest.mark.parametrize("dtype,says", [
    (jnp.int8, "dtype=int8 cannot hold the weights"), (jnp.bool_, "dtype=bool"), (np.float64, "dtype=float64"),
    ("banana", "dtype='banana' is not a dtype"),
])
def test_load_target_refuses_a_dtype_that_cannot_hold_the_weights(target_dir, nothing_placed, dtype, says):
    with pytest.raises(ValueError, match=says):
        load_target(target_dir, dtype=dtype)  # int8 / bool loaded all-zero weights


def test_load_target_refuses_nan_norms_and_warns_of_unexpected_tensors(target_dir, tmp_path, nothing_placed):
    directory = copy_dir(target_dir, tmp_path / "t")

    def edit(t):
        t["model.layers.1.input_layernorm.weight"][5] = np.nan
    forge.edit_tensors(directory / ST, edit)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'model.layers.1.input_layernorm.weight' "
                                              r"holds 1 NaN/Inf of 64 values"):
        load_target(directory)
    forge.edit_tensors(directory / ST, lambda t: t.update({
        "model.layers.1.input_layernorm.weight": np.ones(64, np.float32), "model.vision_tower.weight": np.ones(3)}))
    with pytest.raises(AssertionError, match="reached jax.device_put"), \
            pytest.warns(UserWarning, match=r"1 unexpected tensors ignored: \['model.vision_tower.weight'\]"):
        load_target(directory)


def test_a_mesh_without_the_tensor_axis_or_not_a_mesh_is_refused(target_dir, cpu_mesh, nothing_placed):
    with pytest.raises(ValueError, match=r"tensor_axis='tp' is not an axis of the mesh \(its axes: 'data'\).*"
                                         r"tensor_axis=None"):
        load_target(target_dir, mesh=cpu_mesh, tensor_axis="tp")  # loaded a full copy per device
    with pytest.raises(ValueError, match="mesh is a list"):
        load_target(target_dir, mesh=list(jax.devices()))  # AttributeError before


def test_a_target_loader_given_a_drafter_directory_says_so(tmp_path, nothing_placed):
    write_checkpoint(tmp_path, "tiny-dflash")
    for load in (Qwen3Target.from_pretrained, load_target):
        with pytest.raises(ConfigError, match=r"config.json: architectures \['DFlashDraftModel'\]: a DFlash-family "
                                              r"drafter \(load it with load_drafter\); expected a target"):
            load(tmp_path)  # "missing tensor model.embed_tokens.weight" before


def test_load_drafter_given_its_config_json_says_what_it_expects(tmp_path):
    write_checkpoint(tmp_path, "tiny-dflash")
    with pytest.raises(ConfigError, match="config.json: a file, not a directory; load_drafter expected the "
                                          "checkpoint directory"):
        load_drafter(tmp_path / "config.json")  # a safetensors header length before


# --- RoPE scalars in float32 ------------------------------------------------------------------------------

@pytest.mark.parametrize("field,value,says", [
    ("factor", 1e-50, "rope_scaling.factor=1e-50 is 0 in float32"),
    ("factor", 1e-40, "rope_scaling.factor=1e-40 is a subnormal number in float32"),
    ("low_freq_factor", 1e-46, "rope_scaling.low_freq_factor=1e-46 is 0 in float32"),
    ("high_freq_factor", 1e39, "rope_scaling.high_freq_factor=1e+39 is Inf in float32"),
])
def test_llama3_rope_scalars_that_float32_cannot_hold_are_refused(field, value, says):
    raw = copy.deepcopy(QWEN3_TINY_CONFIGS["tiny-llama"])
    raw["rope_scaling"][field] = value  # positive, so the bounds passed: NaN logits before
    with pytest.raises(ConfigError, match=re.escape(says)):
        parse_decoder_config(raw, LlamaConfig, source="config.json")


# --- the sizes of a load or a run, before allocating ------------------------------------------------------

def test_a_96_gib_checkpoint_is_refused_on_cpu_before_placing(tmp_path, nothing_placed, monkeypatch):
    """A sparse 96 GiB drafter (six [2**27, 64] bf16 MLP matrices) onto the 8 CPU devices: the host's available
    memory (pinned at 64 GiB here, so the test does not depend on the machine) is checked before any copy; it
    was not checked at all for CPUs, and the load ran into the kernel's OOM killer."""
    I = 2**27
    write_checkpoint(tmp_path, "tiny-dflash")
    mlp = {f"layers.{i}.mlp.{p}.weight": (I, 64) if p != "down_proj" else (64, I)
           for i in range(2) for p in ("gate_proj", "up_proj", "down_proj")}
    forge.edit_tensors(tmp_path / ST, lambda t: [t.pop(n) for n in mlp])
    forge.add_sparse(tmp_path / ST, mlp, ml_dtypes.bfloat16)
    forge.edit_json(tmp_path / "config.json", lambda c: c.update(intermediate_size=I))
    assert (tmp_path / ST).stat().st_size > 96 * GiB
    monkeypatch.setattr(dflash_jax.placement, "host_available_bytes", lambda: 64 * GiB)
    with pytest.raises(CheckpointError, match=r"needs 98,304 MiB as bfloat16 on each of 8 host-memory device\(s\).*"
                                              r"but the host has 65,536 MiB available"):
        load_drafter(tmp_path, mesh=jax.make_mesh((8,), ("replica",)))


def test_a_d2t_whose_int32_copy_does_not_fit_the_host_is_refused_before_placing(tmp_path, nothing_placed,
                                                                                   monkeypatch):
    """Placing a d2t makes an int32 copy of it on the host (`placement._host_array`) beside its int32 leaf, which the
    fit check did not count: a sparse d2t of about 2**31 entries passed it and placement ran out of memory (an
    8 GiB MemoryError, issue 55). Here at 1/512 of that size, on a host pinned at 24 MiB: 16 MiB of leaves fit,
    their 16 MiB copy besides does not; refused before any copy, naming the tensor."""
    n = 2**22
    write_checkpoint(tmp_path, {**TINY_CONFIGS["tiny-dflash"], "vocab_size": n + 1, "draft_vocab_size": n})
    monkeypatch.setattr(dflash_jax.placement, "host_available_bytes", lambda: 24 * 2**20)
    with pytest.raises(CheckpointError, match=r"needs 16 MiB as bfloat16 on each of 1 host-memory device\(s\) .* and "
                       r"16 MiB on the host for 'd2t' narrowed to int32, 32 MiB in all, but the host has 24 MiB "
                       r"available \(the largest leaf: 'd2t', 16 MiB\)"):
        load_drafter(tmp_path)


def test_a_cache_that_cannot_exist_is_refused_with_its_size(target, drafter, monkeypatch):
    with pytest.raises(ValueError, match=r"would need \d+ positions per sequence, past int32 positions"):
        speculative_generate(target, drafter, [1, 2], max_new_tokens=2**31 - 1, beyond_max_positions=True)
    monkeypatch.setattr(dflash_jax._memory, "host_available_bytes", lambda: 4 * GiB)
    # 2 layers x K and V x 2 KV heads x 16 x float32 = 0.5 KiB per position: 2**24 positions are 8 GiB; the
    # drafter's cache (2 layers) adds as much
    with pytest.raises(ValueError, match=r"greedy_generate: the KV caches for 1 sequence\(s\) of 16777344 positions "
                                         r"need 8.00 GiB, but the target's 1 device\(s\) \(1 on the host's "
                                         r"available memory\) have 4.00 GiB free"):
        greedy_generate(target, [1, 2], max_new_tokens=2**24, beyond_max_positions=True)
    with pytest.raises(ValueError, match=r"speculative_generate: the KV caches .* need 16.00 GiB"):
        speculative_generate(target, drafter, [1, 2], max_new_tokens=2**24, beyond_max_positions=True)


# --- the arguments of generate ----------------------------------------------------------------------------

BAD_PROMPTS = [
    ("567", TypeError, "prompt_ids is a str"),  # read as three one-token prompts before
    (b"\x01\x02", TypeError, "prompt_ids is a bytes"),
    ([1.0, 2.7], TypeError, r"prompt_ids\[0\] = 1.0 is a float"),  # truncated before
    ([True, 2], TypeError, r"prompt_ids\[0\] = True is a bool"),
    ([[1, 2], "34"], TypeError, r"prompt_ids\[1\] is a str"),
    ([[1, 2], [3, 4.0]], TypeError, r"prompt_ids\[1\]\[1\] = 4.0 is a float"),
    (np.array([1.5, 2.0]), TypeError, r"prompt_ids\[0\] = 1.5 is a float"),
    (7, TypeError, "prompt_ids is a int"),
    ([2**40], ValueError, r"prompt_ids\[0\] = 1099511627776 is outside the vocabulary \[0, 128\)"),
    ([[1], []], ValueError, r"prompt_ids\[1\] is empty"),
    (np.array([[1, 2], [3, 500]]), ValueError, r"prompt_ids\[1\]\[1\] = 500 is outside the vocabulary"),
    (jnp.array([1, 200]), ValueError, r"prompt_ids\[1\] = 200 is outside the vocabulary"),
]


@pytest.mark.parametrize("prompt_ids,error,says", BAD_PROMPTS, ids=[repr(p[0])[:20] for p in BAD_PROMPTS])
def test_prompt_ids_that_are_not_token_ids_are_refused(target, drafter, prompt_ids, error, says):
    with pytest.raises(error, match="speculative_generate: " + says):
        speculative_generate(target, drafter, prompt_ids, max_new_tokens=4)
    with pytest.raises(error, match="greedy_generate: " + says):
        greedy_generate(target, prompt_ids, max_new_tokens=4)


@pytest.mark.parametrize("changes,error,says", [
    (dict(prefill_chunk=0), ValueError, r"prefill_chunk=0 is outside \[1, "),  # ZeroDivisionError before
    (dict(prefill_chunk=-3), ValueError, "prefill_chunk=-3"),
    (dict(prefill_chunk=True), TypeError, "prefill_chunk must be an int, got bool"),
    (dict(max_new_tokens=True), TypeError, "max_new_tokens must be an int, got bool"),
    (dict(max_new_tokens=4.0), TypeError, "max_new_tokens must be an int, got float"),
    (dict(seed=2**64), ValueError, r"seed=18446744073709551616 is outside"),  # OverflowError before
    (dict(seed=True), TypeError, "seed must be an int, got bool"),
    (dict(seed=1.5), TypeError, "seed must be an int"),
    (dict(stop_token_ids=[2**40]), ValueError, r"stop_token_ids\[0\]=1099511627776 is outside"),  # OverflowError
    (dict(stop_token_ids="12"), TypeError, "stop_token_ids is a str"),
    (dict(temperature="0.5"), TypeError, "temperature must be a number"),
    (dict(confidence_threshold=math.nan), ValueError, r"confidence_threshold=nan is outside \[0, 1\]"),
    (dict(confidence_threshold=1.5), ValueError, r"confidence_threshold=1.5 is outside \[0, 1\]"),
    (dict(draft_length="sometimes"), TypeError,
     "draft_length must be 'adaptive', 'fixed', an int or a dflash_jax.Adaptive"),
    (dict(draft_length=0), ValueError, r"draft_length=0 is outside \[1, "),
])
def test_generate_arguments_of_the_wrong_type_or_range_are_refused(target, drafter, changes, error, says):
    kwargs = {"max_new_tokens": 4, **changes}
    with pytest.raises(error, match="speculative_generate: " + says):
        speculative_generate(target, drafter, [1, 2], **kwargs)


def test_seeds_of_64_bits_fold_into_a_key_as_numpy_would():
    """Unsigned 64-bit seeds are the int64 of the same bits (what `np.uint64(s).view(np.int64)` gives), so every
    64-bit seed makes a key; wider ones are refused."""
    for s in (0, 2**63 - 1, -(2**63), 2**63, 2**64 - 1, np.uint64(2**64 - 1)):
        folded = check_seed("x", s)
        assert folded == int(np.array(int(s), np.uint64 if s >= 2**63 else np.int64).view(np.int64))
        jax.random.key(folded)
    with pytest.raises(ValueError, match="seed"):
        check_seed("x", 2**64)


def test_speculative_generate_under_jit_is_refused_clearly(target, drafter):
    tokens = jnp.asarray([1, 2, 3], jnp.int32)
    run = jax.jit(functools.partial(speculative_generate, max_new_tokens=4))
    with pytest.raises(TypeError, match="speculative_generate is a host-side driver.*jit its pieces"):
        run(target, drafter, tokens)  # a TracerIntegerConversionError deep inside before
    with pytest.raises(TypeError, match="greedy_generate is a host-side driver"):
        jax.jit(lambda t: greedy_generate(target, t, max_new_tokens=4))(tokens)


def test_a_call_staged_with_no_traced_argument_is_refused_at_once(target, drafter):
    """`jax.jit(lambda: speculative_generate(...))()` traces nothing the guard could see among the arguments: it
    compiled the prefill and then raised a raw ConcretizationTypeError."""
    for where, call in (("speculative_generate", lambda: speculative_generate(target, drafter, [1, 2, 3],
                                                                             max_new_tokens=4)),
                        ("sample_generate", lambda: sample_generate(target, [1, 2, 3], max_new_tokens=4)),
                        ("greedy_generate", lambda: greedy_generate(target, [1, 2, 3], max_new_tokens=4))):
        with pytest.raises(TypeError, match=f"{where} is a host-side driver"):
            jax.jit(call)()
        with pytest.raises(TypeError, match=f"{where} is a host-side driver"):
            jax.eval_shape(call)


def test_target_and_drafter_swapped_name_the_arguments(target, drafter):
    with pytest.raises(TypeError, match=r"target, is a Drafter, a drafter \(are target and drafter swapped\?\)"):
        speculative_generate(drafter, target, [1, 2, 3], max_new_tokens=4)  # AttributeError: vocab_size before
    with pytest.raises(TypeError, match=r"target is a str; expected a dflash_jax.Target"):
        speculative_generate("qwen3", drafter, [1, 2, 3], max_new_tokens=4)


# --- the drafting entry points -----------------------------------------------------------------------------

def step_inputs(drafter, batch=2, rows=4):
    return (features(drafter, batch, rows, seed=3), np.array([4, 2], np.int32), np.array([5, 9], np.int32))


def test_heads_of_the_wrong_shape_are_refused(drafter):
    """`attach` checks the target's embedding / LM head; a `Drafter` built with them by hand (as the linen and NNX
    modules build one) is checked when a forward is traced. `attach` is the one way to give them: the forwards
    take no `embed=` / `lm_head=`."""
    hidden, num_new, anchors = step_inputs(drafter)
    wrong = jnp.zeros((128, 32), jnp.float32)
    for heads, says in ((dict(embed=wrong), r"propose: embed has shape \[128, 32\], expected \[128, 64\]"),
                        (dict(lm_head=wrong[:100]), r"propose: lm_head has shape \[100, 32\], expected \[128, 64\]")):
        with pytest.raises(ValueError, match=says):  # a dot_general shape error before
            propose(Drafter(drafter.params, config=drafter.config, **heads), init_cache(drafter, 2, 32), hidden,
                    num_new, anchors)
        with pytest.raises(ValueError, match=says.replace("propose", "attach")):
            drafter.attach(**heads)
    with pytest.raises(TypeError, match=r"attach: embed is a list; expected an array \[128, 64\]"):
        drafter.attach(embed=[[0.0] * 64] * 128)  # AttributeError before
    positions = dict(context_positions=np.tile(np.arange(4), (2, 1)), block_positions=np.tile(4 + np.arange(8), (2, 1)))
    with pytest.raises(ValueError, match=r"draft_hidden: lm_head has shape \[128, 32\]"):
        draft_logits(Drafter(drafter.params, config=drafter.config, lm_head=wrong), hidden, block(drafter, [1, 2]),
                     **positions)
    with pytest.raises(TypeError, match="unexpected keyword argument 'lm_head'"):
        draft_logits(drafter, hidden, block(drafter, [1, 2]), **positions, lm_head=drafter.lm_head)


def test_num_new_as_a_list_and_a_reused_donated_cache(drafter):
    hidden, num_new, anchors = step_inputs(drafter)
    expected, cache = propose(drafter, init_cache(drafter, 2, 32), hidden, num_new, anchors)
    got, _ = propose(drafter, init_cache(drafter, 2, 32), hidden, [4, 2], anchors)  # a list of ints
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(expected.tokens))
    with pytest.raises(TypeError, match="propose: num_new has dtype float"):
        propose(drafter, init_cache(drafter, 2, 32), hidden, [4.0, 2.0], anchors)
    donated = init_cache(drafter, 2, 32)
    propose(drafter, donated, hidden, num_new, anchors)
    for call in (lambda: propose(drafter, donated, hidden, num_new, anchors),
                 lambda: append_context(drafter, donated, hidden, num_new)):
        with pytest.raises(ValueError, match="this cache was donated to an earlier call.*use the cache that call "
                                             "returned"):
            call()


@pytest.mark.parametrize("call,says", [
    (lambda d, h, n, a: propose(d, init_cache(d, 2, 32), h, n, a, append_chunk=0), "propose: append_chunk=0"),
    (lambda d, h, n, a: append_context(d, init_cache(d, 2, 32), h, n, append_chunk=-1), "append_context: append_chunk"),
    (lambda d, h, n, a: append_context(d, init_cache(d, 2, 32), h, n, projected=True),  # features not projected
     r"append_context: target_hidden has shape \[2, \d+, \d+\], expected \[2, n_new, 64\] \(the cache's batch, "
     r"projected context rows of hidden 64\)"),
    (lambda d, h, n, a: init_cache(d, 2, 0), r"init_cache: max_context=0 is outside \[1, "),
    (lambda d, h, n, a: init_cache(d, True, 8), "init_cache: batch_size must be an int, got bool"),
    (lambda d, h, n, a: init_cache(d, 2, 8, dtype=jnp.float64), "init_cache: dtype=float64 cannot hold"),
    (lambda d, h, n, a: propose(d, init_cache(d, 2, 32), h, n, [5, 2**40]),  # wrapped to 0 silently before
     r"propose: anchor_ids has entries past int32 \(5 .. 1099511627776\)"),
    (lambda d, h, n, a: AttentionOptions(draft_window=2**40), r"draft_window must be an integer in \[1, 2\*\*31 - 1\]"),
    (lambda d, h, n, a: Adaptive(draft_lengths=(0, True)), "Adaptive.draft_lengths must hold ints"),
    (lambda d, h, n, a: Adaptive(memory=True), r"Adaptive.memory must be a number in \(0, 1\)"),
])
def test_drafting_sizes_and_dtypes_are_checked(drafter, call, says):
    with pytest.raises((TypeError, ValueError), match=says):  # ZeroDivisionError / float32 silently before
        call(drafter, *step_inputs(drafter))


def test_the_target_prefill_chunk_is_checked(target):
    with pytest.raises(ValueError, match=r"prefill: chunk=0 is outside \[1, "):
        target.prefill(jnp.ones((1, 4), jnp.int32), target.init_cache(1, 16), jnp.array([4]), chunk=0)


def test_checked_runs_the_value_checks_the_jitted_step_cannot(drafter):
    """Under jit the values are tracers: a negative num_new, an id past the vocabulary, a temperature without a
    key run silently (documented). `checked=True` refuses them; the default path reads nothing back to the host
    (the transfer guard would raise), so it costs no sync."""
    hidden, num_new, anchors = step_inputs(drafter)
    bad = [(dict(num_new=np.array([-1, 2])), r"num_new \[-1, 2\] has entries outside \[0, 4\]"),
           (dict(anchor_ids=np.array([5, 128])), r"anchor_ids\[1\] = 128 is outside the vocabulary"),
           (dict(temperature=0.7), "temperature 0.7 > 0 without a key"),
           (dict(temperature=-1.0, key=jax.random.key(0)), r"temperature -1.0 must be finite and >= 0")]
    for changes, says in bad:
        args = {"num_new": num_new, "anchor_ids": anchors, **changes}
        with pytest.raises(ValueError, match="propose: " + says):
            propose(drafter, init_cache(drafter, 2, 32), hidden, checked=True, **args)
    device_args = jax.device_put((hidden, num_new, anchors))
    cache = init_cache(drafter, 2, 32)
    with jax.transfer_guard_device_to_host("disallow"):
        propose(drafter, cache, *device_args)
    with pytest.raises(ValueError, match=r"draft_logits: block_ids\[0, 0\] = 200 is outside the vocabulary"):
        draft_logits(drafter, hidden, np.full((2, 8), 200, np.int32), context_positions=np.tile(np.arange(4), (2, 1)),
                     block_positions=np.tile(4 + np.arange(8), (2, 1)), checked=True)


# --- a parameter tree of another config -------------------------------------------------------------------

TWO_LAYERS = parse_config(TINY_CONFIGS["tiny-dflash"])
ONE_LAYER = parse_config({**TINY_CONFIGS["tiny-dflash"], "num_hidden_layers": 1})


def block_call_inputs(config, batch=1, rows=3):
    B = config.effective_block_size
    return (np.zeros((batch, rows, 2 * config.hidden_size), np.float32), np.ones((batch, B), np.int32),
            np.tile(np.arange(rows), (batch, 1)), np.tile(rows + np.arange(B), (batch, 1)))


@pytest.fixture(scope="module")
def one_layer_params():
    return init_params(ONE_LAYER, jax.random.key(0), dtype=jnp.float32)


def test_a_tree_of_one_layer_under_a_two_layer_config_is_refused(one_layer_params, drafter):
    hidden, ids, cpos, bpos = block_call_inputs(TWO_LAYERS)
    heads = dict(embed=drafter.embed, lm_head=drafter.lm_head)
    says = "the parameter tree has 1 layers but the config has num_hidden_layers=2"
    with pytest.raises(ValueError, match=says):  # an IndexError before
        draft_logits(Drafter(one_layer_params, config=TWO_LAYERS, **heads), hidden, ids, context_positions=cpos,
                     block_positions=bpos)
    with pytest.raises(ValueError, match=says):  # a silent one-layer network before (linen reads what it is given)
        DrafterModule(TWO_LAYERS).apply({"params": one_layer_params}, hidden, ids, context_positions=cpos,
                                        block_positions=bpos, **heads)


def test_an_nnx_state_of_another_config_is_refused_by_name(drafter):
    wide = parse_config({**TINY_CONFIGS["tiny-dflash"], "intermediate_size": 96})
    graphdef, _ = nnx.split(DFlashDrafter.init(TWO_LAYERS, rngs=nnx.Rngs(0), dtype=jnp.float32))
    _, state = nnx.split(DFlashDrafter.init(wide, rngs=nnx.Rngs(0), dtype=jnp.float32))
    module = nnx.merge(graphdef, state)
    hidden, ids, cpos, bpos = block_call_inputs(TWO_LAYERS)
    with pytest.raises(ValueError, match=r"parameter 'layers.0.mlp.gate_proj.weight' has shape \[96, 64\], "
                                         r"expected \[128, 64\] from the config"):  # deep in an einsum before
        module(hidden, ids, context_positions=cpos, block_positions=bpos)
    with pytest.raises(ValueError, match=r"block_ids has dtype float32, expected integer token ids"):
        DFlashDrafter.from_drafter(drafter)(hidden, ids.astype(np.float32), context_positions=cpos,
                                            block_positions=bpos)


def test_convert_nvfp4_has_the_overwrite_flag_its_error_names(tmp_path, capsys):
    write_checkpoint(tmp_path / "bf16", "tiny-dflash")
    argv = ["convert-nvfp4", str(tmp_path / "bf16"), str(tmp_path / "q")]
    assert cli.main(argv) == 0
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "`--overwrite`, to replace the checkpoint there" in err
    assert cli.main([*argv, "--overwrite"]) == 0  # argparse refused the flag the message names before
    load_drafter(tmp_path / "q")

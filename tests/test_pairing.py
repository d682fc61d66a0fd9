"""A drafter and a target that do not belong together are refused before anything compiles, naming both and the
two values (`dflash_jax.pairing`); and inside the loop no draft id outside the target's vocabulary is accepted,
even when the loop runs without the check. Every compatible pair returns the target's greedy tokens."""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash_jax import (
    AttentionOptions,
    IncompatiblePairError,
    check_pair,
    draft_policy,
    greedy_generate,
    load_drafter,
    speculative_generate,
)
from dflash_jax._qwen3_testing import random_qwen3
from dflash_jax._shapes import round_up
from dflash_jax.bookkeeping import BUDGET_BUCKET, CACHE_BUCKET, pad_prompts, stop_array, stop_ids, to_lists
from dflash_jax.drafting import init_cache
from dflash_jax.generate import _spec_decode, _spec_prefill
from dflash_jax.nnx import DFlashDrafter
from dflash_jax.sampling import sampling_controls
from dflash_jax.target import PREFILL_CHUNK
from dflash_jax.testing import preset_dict, random_drafter, write_checkpoint

# Speculative runs here use the fixed draft length: one verify shape to compile per pair (the adaptive default
# compiles four); its losslessness is test_generate.py's and test_adaptive.py's.

pytestmark = pytest.mark.filterwarnings("ignore:Generating overly large repr")  # hypothesis printing the target

PROMPT = [1, 2, 3]
MAX_NEW = 12
FAMILIES = ("tiny-dflash", "tiny-dflash2", "tiny-dspark")


@pytest.fixture(scope="module")
def target():
    return random_qwen3("tiny-qwen3", seed=0, dtype=jnp.float32)  # vocab 128, hidden 64, 2 layers


@pytest.fixture(scope="module")
def greedy(target):
    return greedy_generate(target, PROMPT, max_new_tokens=MAX_NEW).tokens


@pytest.fixture
def no_compile():
    """Fail if the loop got as far as compiling a program of its own."""
    programs = _spec_prefill._cache_size(), _spec_decode._cache_size()
    yield
    compiled = _spec_prefill._cache_size(), _spec_decode._cache_size()
    assert compiled == programs, "the pair was not refused before compiling"


@pytest.fixture(scope="module")
def wide_dspark(tmp_path_factory):
    """The issue's pairing mistake: a DSpark drafter with its own 256-token embedding and head (another tokenizer)."""
    directory = tmp_path_factory.mktemp("wide")
    write_checkpoint(directory, {**preset_dict("tiny-dspark"), "vocab_size": 256}, own_embeddings=True)
    return load_drafter(directory, dtype=jnp.float32)


def test_another_vocabulary_is_refused_naming_both(target, wide_dspark, no_compile):
    with pytest.raises(IncompatiblePairError, match=r"vocab_size is 256, the target's 128") as e:
        speculative_generate(target, wide_dspark, PROMPT, max_new_tokens=MAX_NEW)
    assert "DSparkDraftModel" in str(e.value) and "Qwen3Target" in str(e.value)


def test_an_nnx_module_is_checked_too(target, wide_dspark, no_compile):
    module = DFlashDrafter.from_drafter(wide_dspark)
    with pytest.raises(IncompatiblePairError, match=r"vocab_size is 256, the target's 128"):
        speculative_generate(target, module, PROMPT, max_new_tokens=MAX_NEW)


def test_out_of_vocabulary_drafts_are_never_accepted(target, wide_dspark, greedy):
    """The loop run directly, as `speculative_generate` runs it at the fixed length, without the pair check: the
    256-token drafter proposes ids the target cannot embed: before the loop's own guard they were embedded as NaN
    and the output became `[13, 0, 0, ...]`."""
    K, attention = wide_dspark.config.num_draft_tokens, AttentionOptions()
    tokens, lengths = pad_prompts([PROMPT])
    capacity = round_up(tokens.shape[1] + BUDGET_BUCKET + K + 1, CACHE_BUCKET)
    stop, warp = stop_array(stop_ids(target, None)), sampling_controls("test", 0.0, None, None, None)
    policy, settings, _ = draft_policy.resolve_draft_length("fixed", K)
    caches = target.init_cache(1, capacity), init_cache(wide_dspark, 1, capacity)
    state = _spec_prefill(target, wide_dspark, *caches, tokens, lengths, stop, warp, jax.random.key(0),
                          jnp.int32(MAX_NEW), capacity=BUDGET_BUCKET, sampling=False, attention=attention,
                          prefill_chunk=PREFILL_CHUNK)
    state = _spec_decode(target, wide_dspark, state, stop, warp, jnp.float32(0.0), jnp.int32(0),
                         jnp.ones(1, jnp.float32), jnp.int32(-1), jnp.int32(2**31 - 1), settings, sampling=False,
                         attention=attention, policy=policy)
    assert to_lists(*jax.device_get((state.out, state.n_out))) == greedy


def _changed(preset: str, **changes):
    return random_drafter({**preset_dict(preset), **changes}, seed=0, dtype=jnp.float32)


@pytest.mark.parametrize(("changes", "words"), [
    (dict(hidden_size=96, num_attention_heads=4, head_dim=24), "hidden_size is 96, the target's 64"),
    (dict(num_target_layers=8), "trained on a 8-layer target"),
    (dict(num_target_layers=None, dflash_config={"mask_token_id": 127, "target_layer_ids": [1, 7]}),
     r"name layers \[7\] outside \[-1, 1\]"),
])
def test_other_shapes_are_refused(target, no_compile, changes, words):
    with pytest.raises(IncompatiblePairError, match=words):
        speculative_generate(target, _changed("tiny-dflash", **changes), PROMPT, max_new_tokens=MAX_NEW)


def test_an_own_head_of_another_size_is_refused(target, no_compile):
    drafter = _changed("tiny-dspark")
    own = {"lm_head": {"weight": jnp.zeros((200, 64), jnp.float32)}}
    drafter = dataclasses.replace(drafter, params={**drafter.params, **own})
    with pytest.raises(IncompatiblePairError, match="own lm_head has 200 rows, the target's vocabulary 128"):
        speculative_generate(target, drafter, PROMPT, max_new_tokens=MAX_NEW)


def test_a_target_that_cannot_roll_back_is_refused(target):
    @dataclasses.dataclass
    class NoCommit:  # a Target of the old protocol: no way to undo a verify's rejected rows
        vocab_size: int = 128
        hidden_size: int = 64
        num_layers: int = 2

    with pytest.raises(IncompatiblePairError, match="missing commit.*recurrent state"):
        check_pair(NoCommit(), _changed("tiny-dflash"))
    with pytest.raises(IncompatiblePairError, match="no commit"):
        greedy_generate(NoCommit(), PROMPT, max_new_tokens=MAX_NEW)  # type: ignore[arg-type]


# --- every pairing: incompatible ones refused before compiling, compatible ones lossless ------------------------

_TARGET = {"vocab_size": 128, "hidden_size": 64, "num_target_layers": 2}
_MISMATCH = st.one_of(  # top-level fields every family reads (the presets' mask token, 127, is in each vocabulary)
    st.sampled_from([130, 256, 4096]).map(lambda v: {"vocab_size": v}),
    st.sampled_from([(32, 8), (96, 24), (128, 32)]).map(lambda h: {"hidden_size": h[0], "head_dim": h[1]}),
    st.sampled_from([5, 6, 8, 36]).map(lambda n: {"num_target_layers": n}),
)
_LAYER_IDS = st.sampled_from([[2], [1, 2], [0, 9], [-1, 30]])  # stated in dflash_config: tiny-dflash's block


@settings(max_examples=25, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(family=st.sampled_from(FAMILIES), mismatch=_MISMATCH, layer_ids=st.none() | _LAYER_IDS)
def test_every_incompatible_pair_is_refused_before_compiling(target, no_compile, family, mismatch, layer_ids):
    raw = {**preset_dict(family), **mismatch}
    if layer_ids is not None:  # a second mismatch, or the only one with `mismatch` cleared
        raw = {**preset_dict("tiny-dflash"), "num_target_layers": None,
               "dflash_config": {"mask_token_id": 127, "target_layer_ids": layer_ids}}
    drafter = random_drafter(raw, seed=0, dtype=jnp.float32)
    with pytest.raises(IncompatiblePairError, match="cannot be paired"):
        speculative_generate(target, drafter, PROMPT, max_new_tokens=MAX_NEW)


@settings(max_examples=6, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(family=st.sampled_from(FAMILIES), seed=st.integers(0, 2**16))
def test_every_compatible_pair_is_lossless(target, greedy, family, seed):
    drafter = random_drafter({**preset_dict(family), **_TARGET}, seed=seed, dtype=jnp.float32)
    check_pair(target, drafter)
    assert speculative_generate(target, drafter, PROMPT, max_new_tokens=MAX_NEW,
                                draft_length="fixed").tokens == greedy


# --- which embedding a drafter that ships its own uses (docs/loading.md "Which embedding") ---------------------


@pytest.fixture(scope="module")
def own_heads_dir(tmp_path_factory):
    """A DeepSpec-style DSpark checkpoint whose own embed_tokens / lm_head are random, not the target's copies."""
    directory = tmp_path_factory.mktemp("own_heads")
    write_checkpoint(directory, "tiny-dspark", seed=5, own_embeddings=True)
    return directory


def test_shipped_heads_unlike_the_targets_are_named_in_a_warning(target, own_heads_dir, greedy):
    drafter = load_drafter(own_heads_dir, dtype=jnp.float32)
    with pytest.warns(UserWarning, match=r"own embed_tokens and lm_head differ from the target's.*embeddings='target'"):
        tokens = speculative_generate(target, drafter, PROMPT, max_new_tokens=MAX_NEW, draft_length="fixed").tokens
    assert tokens == greedy


def test_shipped_heads_equal_to_the_targets_raise_no_warning(target, own_heads_dir):
    drafter = load_drafter(own_heads_dir, dtype=jnp.float32)
    params = {**drafter.params, "embed_tokens": {"weight": target.embed}, "lm_head": {"weight": target.lm_head}}
    copies = dataclasses.replace(drafter, params=params)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_pair(target, copies)
    with pytest.warns(UserWarning, match="own lm_head differ"):  # one head unlike the target's is named alone
        check_pair(target, dataclasses.replace(copies, params={**params, "lm_head": drafter.params["lm_head"]}))


def test_embeddings_target_leaves_the_shipped_heads_unread_and_attaches_the_targets(target, own_heads_dir, greedy):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "unexpected tensors" warning for the heads left unread
        drafter = load_drafter(own_heads_dir, dtype=jnp.float32, embeddings="target")
        assert "embed_tokens" not in drafter.params and "lm_head" not in drafter.params
        check_pair(target, drafter)
    assert speculative_generate(target, drafter, PROMPT, max_new_tokens=MAX_NEW,
                                draft_length="fixed").tokens == greedy


def test_embeddings_takes_own_or_target_only(own_heads_dir):
    with pytest.raises(ValueError, match=r"load_drafter: embeddings='shared'; expected one of 'own', 'target'"):
        load_drafter(own_heads_dir, embeddings="shared")  # type: ignore[arg-type]

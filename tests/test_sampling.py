"""The sampling controls (`dflash_jax.sampling`) against the NumPy reference written from transformers' warpers,
the plain sampling baseline `sample_generate` against the target's exact distribution, and the conventions of the
decoding entry points (keys, seeds, keyword-only arguments, refused values)."""

from __future__ import annotations

import inspect
import itertools
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import greedy_generate, sample_generate, speculative_generate
from dflash_jax._qwen3_testing import QWEN3_TINY_CONFIGS, random_qwen3
from dflash_jax.sampling import Sampling, Warp, choose, resolve_sampling, rng_key, sampling_controls, warp_logits

from ._numpy_reference import warped_distribution
from .test_generate_sampling import PROMPT, SAMPLES, WHOLE_BATCH, V, _chi2_z, _distribution

CONTROLS = [dict(top_k=7), dict(top_p=0.6), dict(min_p=0.3), dict(top_k=12, top_p=0.9, min_p=0.05),
            dict(top_k=1), dict(top_p=1e-6), dict(top_k=0, top_p=1.0, min_p=0.0), dict(top_k=500)]


@pytest.mark.parametrize("controls", CONTROLS)
def test_warp_matches_transformers_warpers(controls):
    logits = jax.random.normal(jax.random.key(0), (4, 3, 50)) * 3  # [batch, rows, vocab]
    ours = jax.nn.softmax(warp_logits(logits, 0.7, **controls), axis=-1)
    expected = warped_distribution(np.asarray(logits), 0.7, **controls)
    np.testing.assert_array_equal(np.asarray(ours) > 0, expected > 0)  # the same tokens cut, however small
    chex.assert_trees_all_close(ours, expected, atol=1e-6)  # measured: at most 1.8e-7 (float32 softmax)


def test_per_sequence_controls_and_greedy_rows():
    """`Warp` with `[batch]` controls warps each sequence with its own; a sequence at temperature 0 stays greedy
    in a sampled batch (its q one-hot at the argmax)."""
    logits = jax.random.normal(jax.random.key(1), (3, 2, 40)) * 2
    warp = Warp(temperature=jnp.array([0.5, 1.5, 0.0]), top_k=jnp.array([3, 0, 5]), top_p=jnp.array([1.0, 0.7, 0.5]),
                min_p=jnp.array([0.0, 0.1, 0.0]))
    tokens, probs = choose(jax.random.key(2), logits, warp)
    for b, (t, k, p, m) in enumerate([(0.5, 3, None, None), (1.5, None, 0.7, 0.1)]):
        expected = warped_distribution(np.asarray(logits[b]), t, top_k=k, top_p=p, min_p=m)
        chex.assert_trees_all_close(probs[b], expected, atol=1e-6)
        assert all(expected[r, tokens[b, r]] > 0 for r in range(2))  # drawn inside the kept set
    greedy = np.argmax(np.asarray(logits[2]), -1)
    np.testing.assert_array_equal(tokens[2], greedy)
    np.testing.assert_array_equal(probs[2], np.eye(40)[greedy])


@pytest.mark.parametrize("temperature", [1e-300, 1e-45, 1e-38, 2.0**-126, 1e-12, 1.0, 1e3])
def test_every_temperature_gives_the_warped_distribution(temperature):
    """From a float64 below float32's range to 1e3, jitted: the distribution `choose` draws from (and
    `Warp.probs`) is the reference's, one-hot at the argmax where the temperature is tiny (logits / T overflowed
    and the softmax was NaN); below float32's normal range the temperature is 0, greedy."""
    logits = jax.random.normal(jax.random.key(3), (4, 3, 50)) * 3
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        warp = sampling_controls("f", temperature, None, None, 0.01)
    assert [str(w.message) for w in said] == (["f: min_p=0.01 has no effect at temperature 0 (greedy decoding takes "
                                               "the argmax); pass a temperature > 0 to sample under it"]
                                              if temperature < 2.0**-126 else [])
    assert (float(warp.temperature) == 0) == (temperature < 2.0**-126)
    tokens, probs = jax.jit(choose)(jax.random.key(4), logits, warp)
    expected = warped_distribution(np.asarray(logits), temperature, min_p=0.01)  # float64
    chex.assert_trees_all_close(probs, expected, atol=1e-6)
    chex.assert_trees_all_close(jax.jit(Warp.probs)(warp, logits), probs, atol=0)
    assert all(expected[b, r, tokens[b, r]] > 0 for b in range(4) for r in range(3))


def test_ties_at_the_kth_logit_are_kept():
    kept = np.isfinite(np.asarray(warp_logits(jnp.array([3.0, 2.0, 2.0, 1.0]), 1.0, top_k=2)))
    assert kept.tolist() == [True, True, True, False]  # as transformers' TopKLogitsWarper


@pytest.fixture(scope="module")
def target():
    return random_qwen3({**QWEN3_TINY_CONFIGS["tiny-qwen3"], "vocab_size": V}, seed=5, dtype=jnp.float32)


@pytest.fixture(scope="module")
def logits(target):
    seqs = np.array([PROMPT + list(c) for c in itertools.product(range(V), repeat=2)], np.int32)
    return target(jnp.asarray(seqs), target.init_cache(len(seqs), 8), jnp.zeros(len(seqs), jnp.int32)).logits


def test_sample_generate_follows_the_warped_distribution(target, logits):
    """The plain baseline: x1 from the prefill, x2 and x3 from decode steps, all three controls on (each binds
    somewhere: the counts' cells the reference gives probability 0 must stay empty)."""
    controls = dict(top_k=6, top_p=0.85, min_p=0.1)
    exact = _distribution(logits, 0.8, **controls)
    assert (_distribution(logits, 0.8, top_k=6) > 0).sum() > (exact > 0).sum()  # top_p / min_p cut more
    tokens = np.array(sample_generate(target, [PROMPT] * SAMPLES, max_new_tokens=3, temperature=0.8,
                                      key=jax.random.key(4), prefill_chunk=WHOLE_BATCH, stop_token_ids=(),
                                      **controls).tokens)  # [SAMPLES, 3]: every sample, its eos draws included
    joint12 = np.zeros((V, V))
    np.add.at(joint12, (tokens[:, 0], tokens[:, 1]), 1)
    assert _chi2_z(joint12, SAMPLES * exact.sum(2)) < 4
    assert _chi2_z(np.bincount(tokens[:, 2], minlength=V), SAMPLES * exact.sum((0, 1))) < 4


def test_keys_seeds_and_greedy(target):
    """`seed=n` is `key=jax.random.key(n)`, a legacy `PRNGKey(n)` holds the same bits; temperature 0 is greedy."""
    run = lambda **kw: sample_generate(target, [PROMPT] * 4, max_new_tokens=5, **kw).tokens  # noqa: E731
    three = run(seed=3)
    assert three == run(key=jax.random.key(3)) == run(key=jax.random.PRNGKey(3)) != run(seed=4)
    assert run(temperature=0.0) == greedy_generate(target, [PROMPT] * 4, max_new_tokens=5).tokens


def test_one_sampling_value(target):
    """`sampling=Sampling(...)` is the loose keywords as one value (temperature 1 unless given); both at once are
    refused before anything runs; a cut at temperature 0 warns that greedy decoding ignores it."""
    run = lambda **kw: sample_generate(target, [PROMPT] * 4, max_new_tokens=5, **kw).tokens  # noqa: E731
    assert run(sampling=Sampling(0.7, top_k=5, seed=1)) == run(temperature=0.7, top_k=5, seed=1)
    assert run(sampling=Sampling(key=jax.random.key(3))) == run(seed=3)
    with pytest.raises(ValueError, match=r"speculative_generate: pass sampling= or the loose keywords \(top_p\)"):
        speculative_generate(target, None, PROMPT, max_new_tokens=2, sampling=Sampling(), top_p=0.5)
    with pytest.raises(TypeError, match="sampling is a dict; expected a dflash_jax.Sampling"):
        sample_generate(target, PROMPT, max_new_tokens=2, sampling={"temperature": 0.5})
    with pytest.warns(UserWarning, match="sample_generate: top_k=5, min_p=0.1 has no effect at temperature 0") as w:
        greedy = run(temperature=0.0, top_k=5, min_p=0.1)  # the program of `test_keys_seeds_and_greedy`
    assert greedy == greedy_generate(target, [PROMPT] * 4, max_new_tokens=5).tokens
    assert w[0].filename == __file__  # attributed to the caller of the entry point
    with pytest.warns(UserWarning, match="speculative_generate: top_p=0.9 has no effect"):
        resolve_sampling("speculative_generate", Sampling(0.0, top_p=0.9), 0.0, 0.0, None, None, None, None, None)


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(key=jax.random.key(0), seed=0), ValueError, "not both"),
    (dict(key=7), TypeError, "key is a int"),
    (dict(key=jax.random.split(jax.random.key(0), 2)), TypeError, "expected one JAX PRNG key"),
    (dict(top_p=0.0), ValueError, "top_p=0.0 is outside (0, 1]"),
    (dict(top_p=1.5), ValueError, "top_p"),
    (dict(min_p=-0.1), ValueError, "min_p=-0.1 is outside [0, 1]"),
    (dict(top_k=-1), ValueError, "top_k=-1"),
    (dict(top_k=2.5), TypeError, "top_k must be an int"),
    (dict(temperature=float("nan")), ValueError, "temperature=nan"),
    (dict(temperature=-1.0), ValueError, "temperature=-1.0"),
])
def test_bad_sampling_arguments_are_refused(target, kwargs, error, words):
    with pytest.raises(error, match="sample_generate: .*" + words.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        sample_generate(target, PROMPT, max_new_tokens=2, **kwargs)


def test_one_signature_style():
    """Every decoding entry point takes the prompt(s) positionally and everything else by keyword, and the sampled
    ones spell their sampling arguments alike."""
    for fn in (speculative_generate, greedy_generate, sample_generate):
        params = list(inspect.signature(fn).parameters.values())
        positional = [p.name for p in params if p.kind is not inspect.Parameter.KEYWORD_ONLY]
        assert positional[-1] == "prompt_ids" and "max_new_tokens" not in positional, fn.__name__
    sampled = ("top_k", "top_p", "min_p", "key", "seed", "stop_token_ids", "prefill_chunk", "beyond_max_positions")
    spec, plain = inspect.signature(speculative_generate).parameters, inspect.signature(sample_generate).parameters
    assert all(spec[name].default == plain[name].default for name in sampled)


def test_helpers_check_their_arguments():
    assert sampling_controls("f", 0.5, 0, 1.0, 0.0).top_k is None  # the controls that keep every token are off
    assert rng_key("f", None, None).shape == ()

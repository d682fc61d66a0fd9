"""Sampling controls: temperature, top-k, top-p and min-p, applied alike to the target's and the drafts' logits.

    warp_logits(logits, temperature, top_k=, top_p=, min_p=)   logits [..., n] -> the warped logits (-inf cut)
    Warp                                                       the controls of one batch, a pytree (`jit` argument)
    choose(key, logits, warp)                                  one id per row, and the distribution it came from
    Sampling(temperature, top_k=, top_p=, min_p=, key=, seed=)  the controls and randomness of a call, one value
    sampling_controls(where, ...) / rng_key(where, key, seed)  the host-side checks of the public entry points
    resolve_sampling(where, sampling, ...)                     a call's `Sampling` or loose keywords -> Warp, key

The warpers are transformers' (`generation/logits_process.py`), in its order: divide by the temperature, keep
the `top_k` largest logits (ties at the k-th value kept), keep the smallest set of the largest whose probability
reaches `top_p` (of the top-k distribution), keep the tokens whose probability is at least `min_p` times the
largest one's. Every control keeps a prefix of the logits sorted in decreasing order, so the kept set is one
threshold on the logits: the largest of the three controls' thresholds; a row never loses its argmax.

Speculative sampling stays lossless under warping when the rejection rule compares the distributions the tokens
are actually drawn from (vLLM's `RejectionSampler` and SGLang's speculative sampling warp both sides so): the
target's p is the softmax of its warped logits, and the drafter draws from the softmax of its own warped logits,
q, which the rule reads from `Proposal.probs`. Accepting draft x with probability min(1, p(x) / q(x)) and drawing
from norm(max(p - q, 0)) after a rejection gives exactly p whatever q is (Leviathan et al. 2023, Theorem 1), so
the output follows the target's warped distribution; a draft outside p's support (p(x) = 0) is always rejected.
Warping the drafts too keeps q close to p, which is what acceptance needs.

A control that is off is None in `Warp`: no sort is traced for it. Values are arrays, so that different values
of the same controls share one compiled program.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._arguments import check_integer, check_number, check_seed, refuse_traced

__all__ = ["Warp", "warp_logits", "choose"]


def warp_logits(
    logits: jax.Array,
    temperature: float | jax.Array,
    *,
    top_k: int | jax.Array | None = None,
    top_p: float | jax.Array | None = None,
    min_p: float | jax.Array | None = None,
) -> jax.Array:
    """`logits [..., n]` less their row's largest, divided by `temperature` (> 0), with the tokens the controls cut
    set to -inf (float32): the softmax of the result is transformers' sampling distribution.

    The largest is subtracted before dividing, so that at any temperature the largest logit is 0 and the rest are
    below it (-inf at the least): logits / T alone spans 1e10 at T = 1e-9 and overflows to inf - inf at smaller
    ones, and XLA's fused softmax of it came out NaN under jit. Each control is a scalar or an array that
    broadcasts against `logits[..., :1]` (e.g. `[batch, 1]` per sequence); None, `top_k` 0, `top_p` 1 and `min_p`
    0 keep every token.
    """
    x = jnp.asarray(logits, jnp.float32)
    scaled = (x - jnp.max(x, axis=-1, keepdims=True)) / jnp.asarray(temperature, jnp.float32)
    if top_k is None and top_p is None and min_p is None:
        return scaled
    n = scaled.shape[-1]
    ordered = -jnp.sort(-scaled, axis=-1)  # [..., n] largest first
    cut = jnp.full(scaled.shape[:-1] + (1,), -jnp.inf)  # [..., 1] the smallest logit kept
    if top_k is not None:
        k = jnp.asarray(top_k, jnp.int32)
        kth = jnp.take_along_axis(ordered, jnp.broadcast_to(jnp.clip(k, 1, n) - 1, cut.shape), axis=-1)
        cut = jnp.where(k > 0, kth, cut)
    if top_p is not None:
        probs = jax.nn.softmax(jnp.where(ordered >= cut, ordered, -jnp.inf), axis=-1)  # of the top-k tokens
        before = jnp.cumsum(probs, axis=-1) - probs  # [..., n] the mass of the larger tokens
        count = jnp.sum(before < jnp.asarray(top_p, jnp.float32), axis=-1, keepdims=True)  # >= 1: before[0] = 0
        kept = jnp.take_along_axis(ordered, jnp.clip(count, 1, n) - 1, axis=-1)
        cut = jnp.where(jnp.asarray(top_p) < 1, jnp.maximum(cut, kept), cut)
    if min_p is not None:  # p >= min_p * p_max  <=>  logit >= max logit (0) + log(min_p)
        cut = jnp.maximum(cut, jnp.log(jnp.asarray(min_p, jnp.float32)))
    return jnp.where(scaled >= cut, scaled, -jnp.inf)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Warp:
    """The sampling controls of a batch, each a scalar or `[batch]`: temperature (0: that sequence is greedy),
    `top_k` (int32, 0: off), `top_p` (1: off), `min_p` (0: off); a control that is None is off for every
    sequence and costs nothing."""

    temperature: jax.Array
    top_k: jax.Array | None = None
    top_p: jax.Array | None = None
    min_p: jax.Array | None = None

    def logits(self, logits: jax.Array) -> jax.Array:
        """`logits [batch, ..., n]` warped per sequence (a temperature of 0 divides by 1: greedy rows are picked
        by argmax, `choose`)."""
        def per_row(x):  # [batch] -> [batch, 1, ..., 1]; a scalar stays one
            return None if x is None else jnp.reshape(x, jnp.shape(x) + (1,) * (logits.ndim - jnp.ndim(x)))

        t = per_row(self.temperature)
        return warp_logits(logits, jnp.where(t > 0, t, 1.0), top_k=per_row(self.top_k), top_p=per_row(self.top_p),
                           min_p=per_row(self.min_p))

    def probs(self, logits: jax.Array) -> jax.Array:
        """The distribution `choose` draws each row of `logits [batch, ..., n]` from: the softmax of the warped
        logits, one-hot at the argmax for the sequences at temperature 0 (greedy)."""
        return _drawn_from(self.logits(logits), jnp.argmax(logits, axis=-1), _sampled(self, logits.ndim))


def _sampled(warp: Warp, ndim: int) -> jax.Array:
    """`[batch, 1, ..., 1]` (`ndim` axes; a scalar temperature: all 1): the sequences sampled, at temperature > 0
    (XLA flushes a subnormal one to 0, so it is greedy here as everywhere in the program)."""
    t = warp.temperature
    return jnp.reshape(t > 0, jnp.shape(t) + (1,) * (ndim - jnp.ndim(t)))


def _drawn_from(warped: jax.Array, greedy: jax.Array, sampled: jax.Array) -> jax.Array:
    return jnp.where(sampled, jax.nn.softmax(warped, axis=-1), jax.nn.one_hot(greedy, warped.shape[-1]))


def choose(key: jax.Array | None, logits: jax.Array, warp: Warp) -> tuple[jax.Array, jax.Array | None]:
    """One id per row of `logits [batch, ..., n]`: argmax without a key; with one, a draw from the warped
    distribution, returned too (`[batch, ..., n]`; one-hot at the argmax for the sequences whose temperature is
    0, which stay greedy in a sampled batch)."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if key is None:
        return greedy, None
    warped, hot = warp.logits(logits), _sampled(warp, logits.ndim)
    sampled = jax.random.categorical(key, warped).astype(jnp.int32)
    return jnp.where(hot[..., 0], sampled, greedy), _drawn_from(warped, greedy, hot)


def sampling_controls(where: str, temperature: Any, top_k: Any, top_p: Any, min_p: Any) -> Warp:
    """The controls of `speculative_generate` / `sample_generate` as a `Warp`, after refusing values that would
    sample something else than asked: a temperature that is not a finite number >= 0, a `top_k` that is not an
    int >= 0, a `top_p` outside (0, 1], a `min_p` outside [0, 1] (`TypeError` / `ValueError` naming the
    argument). Controls that keep every token (`top_k` 0, `top_p` 1, `min_p` 0, None) are off. A temperature
    below float32's smallest normal number (2**-126, about 1.2e-38), float64 values below float32's range included,
    is 0: greedy, the limit of sampling as T -> 0 (ties aside). XLA flushes a subnormal float32 to 0, so the
    program could not divide by it, and 0 would say "greedy" in some places of it and not in others."""
    refuse_traced(where, temperature, top_k, top_p, min_p)
    t = check_number(where, "temperature", temperature)
    if not (np.isfinite(t) and t >= 0):
        raise ValueError(f"{where}: temperature={t} must be finite and >= 0 (0 is greedy)")
    if t < np.finfo(np.float32).tiny:
        t = 0.0
    k = None if top_k is None else check_integer(where, "top_k", top_k, 0)
    p = None if top_p is None else check_number(where, "top_p", top_p)
    if p is not None and not 0 < p <= 1:
        raise ValueError(f"{where}: top_p={p} is outside (0, 1] (1 keeps every token)")
    m = None if min_p is None else check_number(where, "min_p", min_p)
    if m is not None and not 0 <= m <= 1:
        raise ValueError(f"{where}: min_p={m} is outside [0, 1] (0 keeps every token)")
    cuts = [f"{name}={v}" for name, v, off in (("top_k", k, 0), ("top_p", p, 1), ("min_p", m, 0))
            if v is not None and v != off]
    if t == 0 and cuts:  # as transformers warns when do_sample is False: the caller may believe it samples
        warnings.warn(f"{where}: {', '.join(cuts)} has no effect at temperature 0 (greedy decoding takes the "
                      "argmax); pass a temperature > 0 to sample under it",
                      UserWarning, stacklevel=4)  # `resolve_sampling`'s caller's caller
    return Warp(
        temperature=jnp.float32(t),
        top_k=None if not k else jnp.int32(k),
        top_p=None if p is None or p == 1 else jnp.float32(p),
        min_p=None if not m else jnp.float32(m),
    )


def rng_key(where: str, key: Any, seed: Any) -> jax.Array:
    """The randomness of a decoding call: `key` (a JAX PRNG key: `jax.random.key(n)`, or a legacy
    `jax.random.PRNGKey(n)`), or `jax.random.key(seed)` for an integer `seed`; neither: seed 0. Both, or a key
    of another kind (an int, a batch of keys), are refused naming the argument."""
    if key is not None and seed is not None:
        raise ValueError(f"{where}: pass key= or seed=, not both (seed is a shorthand for key=jax.random.key(seed))")
    if key is None:
        return jax.random.key(check_seed(where, 0 if seed is None else seed))
    refuse_traced(where, key)
    if isinstance(key, jax.Array) and jnp.issubdtype(key.dtype, jax.dtypes.prng_key) and key.shape == ():
        return key
    if isinstance(key, (jax.Array, np.ndarray)) and key.dtype == np.uint32 and key.shape == (2,):
        return jax.random.wrap_key_data(jnp.asarray(key))  # a legacy PRNGKey: its raw bits
    shown = f"{type(key).__name__} {getattr(key, 'dtype', '')}{list(getattr(key, 'shape', ()))}"
    raise TypeError(f"{where}: key is a {shown}; expected one JAX PRNG key, e.g. key=jax.random.key(0) (or seed=0)")


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How a decoding call samples, as one value: `speculative_generate(..., sampling=Sampling(0.7, top_p=0.9,
    seed=1))` is `speculative_generate(..., temperature=0.7, top_p=0.9, seed=1)`, and `sample_generate` takes the
    same. `temperature` 1 by default (a `Sampling` samples; 0 is greedy); the cuts as `warp_logits` (None: off);
    randomness from `key` (a JAX PRNG key) or `seed` (an int; neither: seed 0). Checked where it is used
    (`sampling_controls`, `rng_key`), with the errors of the loose keywords."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    key: jax.Array | None = None
    seed: int | None = None


def resolve_sampling(where: str, sampling: Sampling | None, temperature: Any, default_temperature: float, top_k: Any,
            top_p: Any, min_p: Any, key: Any, seed: Any) -> tuple[Warp, jax.Array]:
    """A call's `Warp` and key from its `sampling` value, or from the loose keywords when it is None. Both at once
    (a loose keyword off its default) is refused: which one would win is not for the reader to guess."""
    if sampling is None:
        return sampling_controls(where, temperature, top_k, top_p, min_p), rng_key(where, key, seed)
    if not isinstance(sampling, Sampling):
        raise TypeError(f"{where}: sampling is a {type(sampling).__name__}; expected a dflash_jax.Sampling")
    loose = {"temperature": temperature != default_temperature, "top_k": top_k is not None,
             "top_p": top_p is not None, "min_p": min_p is not None, "key": key is not None, "seed": seed is not None}
    if any(loose.values()):
        given = ", ".join(name for name, on in loose.items() if on)
        raise ValueError(f"{where}: pass sampling= or the loose keywords ({given}), not both")
    s = sampling
    return (sampling_controls(where, s.temperature, s.top_k, s.top_p, s.min_p),
            rng_key(f"{where}: Sampling", s.key, s.seed))

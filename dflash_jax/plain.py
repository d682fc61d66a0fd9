"""The target alone, one forward per token: `greedy_generate` and `sample_generate`, the baselines speculative
decoding must reproduce (greedy: token for token; sampled: in distribution) and beat.

Same prompt handling, stop rule, position check and result as `speculative_generate` (`bookkeeping`); the decode is
one `lax.while_loop` program, compiled once per (batch, prompt bucket, budget bucket).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from ._arguments import check_cache_fits, check_generate
from ._shapes import round_up
from .bookkeeping import (
    BUDGET_BUCKET,
    CACHE_BUCKET,
    GenerationResult,
    check_positions,
    commit,
    pad_prompts,
    stop_array,
    stop_ids,
    to_lists,
)
from .errors import IncompatiblePairError
from .sampling import Sampling, Warp, choose, resolve_sampling
from .target import PREFILL_CHUNK, Target

__all__ = ["greedy_generate", "sample_generate"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _State:
    """The plain loop's carry (every array has a static shape)."""

    cache: Any  # the target's KV cache
    lengths: jax.Array  # [batch] positions in the cache
    last: jax.Array  # [batch] the last new token, not yet run through the target
    out: jax.Array  # [batch, capacity] new tokens
    n_out: jax.Array  # [batch] tokens in `out`
    budget: jax.Array  # [] int32 max_new_tokens
    done: jax.Array  # [batch] bool
    key: jax.Array  # sampling: split every step; greedy: unused


@functools.partial(jax.jit, static_argnames=("capacity", "prefill_chunk", "sampling"), donate_argnames=("cache",))
def plain_prefill(target: Target, cache, tokens, lengths, stop, budget, warp: Warp, key, *, capacity: int,
                  prefill_chunk: int, sampling: bool) -> _State:
    """Run the prompts, take the first token."""
    batch = tokens.shape[0]
    first_key, key = jax.random.split(key)
    out = target.prefill(tokens, cache, lengths, layer_ids=(), chunk=prefill_chunk)
    first = choose(first_key if sampling else None, out.logits, warp)[0]  # [batch]
    return _State(
        cache=out.cache,
        lengths=lengths,
        last=first,
        out=jnp.zeros((batch, capacity), jnp.int32).at[:, 0].set(first),
        n_out=jnp.ones((batch,), jnp.int32),
        budget=budget,
        done=(first[:, None] == stop).any(-1) | (budget <= 1),
        key=key,
    )


@functools.partial(jax.jit, static_argnames=("sampling",), donate_argnames=("state",))
def plain_decode(target: Target, state: _State, stop, warp: Warp, *, sampling: bool) -> _State:
    """One target forward per token, in a `lax.while_loop`, until every sequence is done."""

    def step(s: _State) -> _State:
        step_key, key = jax.random.split(s.key)
        o = target(s.last[:, None], s.cache, s.lengths, layer_ids=())  # `last` enters the cache at position `lengths`
        nxt = choose(step_key if sampling else None, o.logits[:, 0], warp)[0]  # [batch]
        live = ~s.done
        advance = live.astype(jnp.int32)  # [batch] 1 while running
        out, n_out, done = commit(s.out, s.n_out, s.done, s.budget, stop, nxt[:, None], jnp.zeros_like(nxt))
        return _State(
            cache=target.commit(o.cache, advance),
            lengths=s.lengths + advance,
            last=jnp.where(live, nxt, s.last),
            out=out,
            n_out=n_out,
            budget=s.budget,
            done=done,
            key=key,
        )

    return jax.lax.while_loop(lambda s: ~s.done.all(), step, state)


def greedy_generate(
    target: Target,
    prompt_ids: Sequence[int] | Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    stop_token_ids: Sequence[int] | None = None,
    prefill_chunk: int = PREFILL_CHUNK,
    beyond_max_positions: bool = False,
) -> GenerationResult:
    """The target alone, greedy: the baseline speculative decoding must reproduce and beat.

    Same prompt handling, stop rule (by default the target's eos ids; `stop_token_ids=()`: none), position check and
    result as `speculative_generate` (no acceptance lengths).
    """
    warp, key = resolve_sampling("greedy_generate", None, 0.0, 0.0, None, None, None, None, None)
    return _plain_generate("greedy_generate", target, prompt_ids, max_new_tokens, warp, key, False, stop_token_ids,
                           prefill_chunk, beyond_max_positions)


def sample_generate(
    target: Target,
    prompt_ids: Sequence[int] | Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    key: jax.Array | None = None,
    seed: int | None = None,
    sampling: Sampling | None = None,
    stop_token_ids: Sequence[int] | None = None,
    prefill_chunk: int = PREFILL_CHUNK,
    beyond_max_positions: bool = False,
) -> GenerationResult:
    """The target alone, sampled (transformers' `generate(do_sample=True, ...)`, whose temperature is 1 by default
    too): the baseline a sampled `speculative_generate` must match in distribution and beat in speed.

    The sampling controls, `key`, `seed` and `sampling` are `speculative_generate`'s (temperature 0: greedy, as
    `greedy_generate`); the rest as `greedy_generate`.
    """
    warp, rng = resolve_sampling("sample_generate", sampling, temperature, 1.0, top_k, top_p, min_p, key, seed)
    return _plain_generate("sample_generate", target, prompt_ids, max_new_tokens, warp, rng,
                           float(warp.temperature) > 0, stop_token_ids, prefill_chunk, beyond_max_positions)


def _plain_generate(where: str, target: Target, prompt_ids: Sequence[int] | Sequence[Sequence[int]],
                    max_new_tokens: int, warp: Warp, key: jax.Array, sampling: bool,
                    stop_token_ids: Sequence[int] | None, prefill_chunk: int,
                    beyond_max_positions: bool) -> GenerationResult:
    """`greedy_generate` and `sample_generate`: one target step per token (`key` read only when `sampling`)."""
    if not hasattr(target, "commit"):
        raise IncompatiblePairError(f"{where}: {type(target).__name__} has no commit(pending, kept): it "
                                    "does not implement the Target protocol (dflash_jax.Target)")
    prompts = check_generate(where, target, prompt_ids, max_new_tokens=max_new_tokens, prefill_chunk=prefill_chunk,
                             stop_token_ids=stop_token_ids)
    check_positions(prompts, max_new_tokens, target, None, beyond_max_positions)
    tokens, lengths = pad_prompts(prompts)
    out_capacity = round_up(max_new_tokens, BUDGET_BUCKET)
    capacity = round_up(tokens.shape[1] + out_capacity, CACHE_BUCKET)
    check_cache_fits(where, target, None, len(prompts), capacity)
    stop = stop_array(stop_ids(target, stop_token_ids))
    start = time.perf_counter()
    state = jax.block_until_ready(
        plain_prefill(target, target.init_cache(len(prompts), capacity), tokens, lengths, stop,
                      jnp.int32(max_new_tokens), warp, key, capacity=out_capacity, prefill_chunk=prefill_chunk,
                      sampling=sampling)
    )
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    state = plain_decode(target, state, stop, warp, sampling=sampling)
    new, n_out = jax.device_get((state.out, state.n_out))
    decode = time.perf_counter() - start
    return GenerationResult(to_lists(new, n_out), [[] for _ in prompts], prefill, decode, [0] * len(prompts))


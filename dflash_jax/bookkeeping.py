"""What every decode loop shares (`generate.speculative_generate`, `plain.greedy_generate` / `sample_generate`):
prompts padded into shared shapes, the stop ids, the commit of a step's tokens, the position check and the result.

    pad_prompts(prompts)           -> (tokens [batch, P], lengths [batch]), P a multiple of PROMPT_BUCKET
    stop_ids(where, target, ids)   the ids a sequence stops after: the target's eos ids unless given
    commit(out, n_out, done, ...)  a step's tokens into the output buffer, cut after a stop id and at the budget
    GenerationResult               the tokens and statistics of a call
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ._shapes import round_up
from .adaptive import StepCosts
from .drafter import Drafter
from .target import Target

__all__ = ["GenerationResult", "PROMPT_BUCKET", "CACHE_BUCKET", "BUDGET_BUCKET"]

PROMPT_BUCKET = 16  # prompts are right-padded to a multiple of this, so prompt lengths share compilations
CACHE_BUCKET = 128  # cache capacities are rounded up to a multiple of this
BUDGET_BUCKET = 64  # output buffers hold a multiple of this many tokens: budgets within one share compilations


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    """New tokens and statistics of one `speculative_generate` / `greedy_generate` / `sample_generate` call.

    Always batched, whether `prompt_ids` was one prompt or several: `tokens[i]` are prompt i's new ids,
    `acceptance_lengths[i]` its verify steps' acceptance lengths, `plain_tokens[i]` how many of its tokens plain
    target steps made (steps verifying no drafts, which the adaptive policy chooses), not verifies; one prompt is
    `result.tokens[0]`. Acceptance lengths count the bonus token (the reference's tau per step: accepted drafts +
    1); the first new token comes from the prefill and belongs to no step. Times are wall clock and include
    compilation the first time a shape is seen: warm up first to measure speed. `step_costs`: the step times the
    adaptive policy chose lengths by (measured in this call, kept by the `Adaptive` passed from an earlier one, or
    given), None at a fixed length or where they could not be measured; `Adaptive(costs=result.step_costs)` gives
    them to a call in another process, which then measures nothing.
    """

    tokens: list[list[int]]
    acceptance_lengths: list[list[int]]
    prefill_seconds: float
    decode_seconds: float
    plain_tokens: list[int]
    step_costs: StepCosts | None = None

    @property
    def num_tokens(self) -> int:
        """New tokens over all prompts."""
        return sum(len(t) for t in self.tokens)

    @property
    def tokens_per_second(self) -> float:
        """New tokens per second of prefill + decode."""
        return self.num_tokens / max(self.prefill_seconds + self.decode_seconds, 1e-9)

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens made by the decode loop (all but each prompt's first) per second of decode."""
        return (self.num_tokens - len(self.tokens)) / max(self.decode_seconds, 1e-9)

    @property
    def mean_acceptance_length(self) -> float:
        """Mean tokens per verify step (accepted drafts + 1), over all prompts; nan without steps."""
        steps = [a for seq in self.acceptance_lengths for a in seq]
        return float(np.mean(steps)) if steps else float("nan")


def pad_prompts(prompts: list[list[int]]) -> tuple[jax.Array, jax.Array]:
    """Right-pad to a bucketed length: `(tokens [batch, P] int32, lengths [batch] int32)`."""
    width = round_up(max(len(p) for p in prompts), PROMPT_BUCKET)
    tokens = np.zeros((len(prompts), width), np.int32)
    for row, p in zip(tokens, prompts):
        row[: len(p)] = p
    return jnp.asarray(tokens), jnp.asarray([len(p) for p in prompts], jnp.int32)


def stop_ids(target: Target, stop_token_ids: Sequence[int] | None) -> tuple[int, ...]:
    """The ids a sequence stops after: `stop_token_ids` when given (`()`: none, every sequence runs to its budget),
    else the target's end-of-sequence ids as its checkpoint states them (`eos_token_ids`: generation_config.json's,
    else config.json's; transformers and vLLM stop there too). A target without `eos_token_ids` has none."""
    if stop_token_ids is not None:
        return tuple(int(t) for t in stop_token_ids)
    return tuple(getattr(target, "eos_token_ids", ()))


def stop_array(stop_token_ids: Sequence[int]) -> jax.Array:
    """Stop ids as int32, padded with -1 (matches nothing) to a multiple of 8 entries, so that different stop
    lists share a compilation."""
    ids = list(stop_token_ids)
    return jnp.asarray(ids + [-1] * (round_up(max(len(ids), 1), 8) - len(ids)), jnp.int32)


def to_lists(tokens: np.ndarray, counts: np.ndarray) -> list[list[int]]:
    """The first `counts[i]` tokens of each row of `tokens [batch, capacity]`."""
    return [row[:n].tolist() for row, n in zip(tokens, counts)]


def commit(out: jax.Array, n_out: jax.Array, done: jax.Array, budget: jax.Array, stop: jax.Array,
           made: jax.Array, accepted: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Append a step's tokens: `(out, n_out, done)` after writing `made [batch, R]`'s first `accepted + 1` tokens
    (`accepted [batch]`; a plain step: `R = 1`, `accepted = 0`) of each running sequence to `out [batch, capacity]`
    at `n_out [batch]`, cut after a stop token (kept) and at the `budget`."""
    batch, R = made.shape
    live = ~done
    is_stop = (made[..., None] == stop).any(-1) & (jnp.arange(R) <= accepted[:, None])  # [batch, R]
    keep = jnp.where(is_stop.any(1), jnp.argmax(is_stop, axis=1) + 1, accepted + 1)
    keep = jnp.where(live, jnp.minimum(keep, budget - n_out), 0)  # [batch]
    kept = jnp.arange(R) < keep[:, None]  # [batch, R]
    slots = jnp.where(kept, n_out[:, None] + jnp.arange(R), out.shape[1])  # past the end: dropped
    n_out = n_out + keep
    out = out.at[jnp.arange(batch)[:, None], slots].set(made, mode="drop")
    return out, n_out, done | (is_stop & kept).any(1) | (n_out >= budget)


def check_positions(prompts: list[list[int]], max_new_tokens: int, target: Target, drafter: Drafter | None,
                    allowed: bool) -> None:
    """Refuse, before anything compiles, sequences longer than the models' `max_position_embeddings`."""
    longest = max(len(p) for p in prompts) + max_new_tokens
    limits = [("target", target.max_positions)]
    if drafter is not None:
        limits.append(("drafter", drafter.config.max_position_embeddings))
    for name, limit in limits:
        if limit is not None and longest > limit and not allowed:
            raise ValueError(
                f"a prompt of {longest - max_new_tokens} tokens plus max_new_tokens={max_new_tokens} reaches "
                f"position {longest}, beyond the {name}'s max_position_embeddings={limit}; shorten it, or pass "
                "beyond_max_positions=True to run past what the model was trained for"
            )

"""Checks of the arguments of the drafting entry points, for inputs that would otherwise run silently wrong.

Each raises `ValueError` naming the function and the argument. Shapes are static, so the shape checks work
on tracers too (inside `jax.jit` they run once, at trace time); values are checked only where the host can
see them (concrete arrays, Python numbers): under `jit` a traced token id, temperature or `num_new` is not
checked, and the callers' docstrings say so.

  check_block_inputs(config, where, target_hidden, block_ids, context_positions, block_positions)
  check_propose_inputs(config, where, cache_batch, target_hidden, num_new, anchor_ids)
  check_sampling(where, key, temperature)
  check_token_ids(where, name, ids, vocab_size)
"""

from __future__ import annotations

import jax
import numpy as np

from .config import DflashConfig


def _concrete(x) -> np.ndarray | None:
    """`x` as a NumPy array when its values are known on the host (not a tracer), else None."""
    return None if isinstance(x, jax.core.Tracer) else np.asarray(x)


def _shape(x) -> tuple[int, ...]:
    return tuple(np.shape(x))


def check_token_ids(where: str, name: str, ids, vocab_size: int) -> None:
    """Every id in `ids` (when concrete) must be an integer in `[0, vocab_size)`: an id past the embedding
    would be clamped by the gather and silently embed another token."""
    values = _concrete(ids)
    if values is None or values.size == 0:
        return
    if not np.issubdtype(values.dtype, np.integer):
        raise ValueError(f"{where}: {name} has dtype {values.dtype}, expected integer token ids")
    bad = (values < 0) | (values >= vocab_size)
    if bad.any():
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"{where}: {name}{list(first)} = {int(values[first])} is outside the vocabulary "
                         f"[0, {vocab_size}); {int(bad.sum())} of {values.size} ids out of range")


def check_block_inputs(config: DflashConfig, where: str, target_hidden, block_ids, context_positions,
                       block_positions) -> None:
    """`draft_hidden` / `draft_logits`: target_hidden `[batch, S, Lf*H]`, block_ids `[batch, B]` of token ids,
    context_positions `[batch, S]`, block_positions `[batch, B]`, with Lf, H and B from the config."""
    width = len(config.checked_target_layer_ids) * config.hidden_size
    block = config.effective_block_size
    hidden = _shape(target_hidden)
    if len(hidden) != 3 or hidden[2] != width:
        raise ValueError(f"{where}: target_hidden has shape {list(hidden)}, expected [batch, S, {width}] "
                         f"({len(config.checked_target_layer_ids)} target layers x hidden {config.hidden_size})")
    batch, rows = hidden[:2]
    for name, x, expected in (("block_ids", block_ids, (batch, block)),
                              ("context_positions", context_positions, (batch, rows)),
                              ("block_positions", block_positions, (batch, block))):
        if _shape(x) != expected:
            raise ValueError(f"{where}: {name} has shape {list(_shape(x))}, expected {list(expected)}"
                             + (f" (the block size is {block})" if expected[1] == block else ""))
    check_token_ids(where, "block_ids", block_ids, config.vocab_size)


def check_propose_inputs(config: DflashConfig, where: str, cache_batch: int, target_hidden, num_new,
                         anchor_ids=None) -> None:
    """`propose` / `append_context`: target_hidden `[batch, n_new, Lf*H]` with the cache's batch, num_new
    `[batch]` in `[0, n_new]`, anchor_ids (`propose`'s) `[batch]` of token ids."""
    width = len(config.checked_target_layer_ids) * config.hidden_size
    hidden = _shape(target_hidden)
    if len(hidden) != 3 or hidden[2] != width or hidden[0] != cache_batch:
        raise ValueError(f"{where}: target_hidden has shape {list(hidden)}, expected [{cache_batch}, n_new, {width}] "
                         f"(the cache's batch, {len(config.checked_target_layer_ids)} target layers x hidden "
                         f"{config.hidden_size})")
    batch, n_new = hidden[:2]
    for name, x in (("num_new", num_new), ("anchor_ids", anchor_ids)):
        if x is not None and _shape(x) != (batch,):
            raise ValueError(f"{where}: {name} has shape {list(_shape(x))}, expected [{batch}]")
    counts = _concrete(num_new)
    if counts is not None and ((counts < 0) | (counts > n_new)).any():
        raise ValueError(f"{where}: num_new {counts.tolist()} has entries outside [0, {n_new}] (n_new, the "
                         "padded row count of target_hidden)")
    if anchor_ids is not None:
        check_token_ids(where, "anchor_ids", anchor_ids, config.vocab_size)


def check_sampling(where: str, key, temperature) -> None:
    """temperature (scalar or `[batch]`, when concrete) must be finite and >= 0, and a positive one needs a
    `key`: without one, drafting is greedy whatever the temperature says."""
    values = _concrete(temperature)
    if values is None:
        return
    if not np.isfinite(values).all() or (values < 0).any():
        raise ValueError(f"{where}: temperature {values.tolist()} must be finite and >= 0 (0 is greedy)")
    if key is None and (values > 0).any():
        raise ValueError(f"{where}: temperature {values.tolist()} > 0 without a key would draft greedily; "
                         "pass key=jax.random.key(...) to sample, or temperature=0 for greedy")

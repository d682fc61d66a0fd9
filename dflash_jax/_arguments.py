"""Checks of the arguments of the public entry points, for inputs that would otherwise run silently wrong or
fail deep inside JAX.

Each raises `ValueError` (a value out of range) or `TypeError` (a value of the wrong kind) naming the function
and the argument. Shapes are static, so the shape checks work on tracers too (inside `jax.jit` they run once,
at trace time); values are checked only where the host can see them (concrete arrays, Python numbers): under
`jit` a traced token id, temperature or `num_new` is not checked (`propose(..., checked=True)` and
`draft_logits(..., checked=True)` check them eagerly before the jitted call), and the callers' docstrings say so.

  check_integer(where, name, value, minimum, maximum)       an int (not a bool) in range
  check_seed(where, seed)                                  a Python int of at most 64 bits -> a JAX seed
  check_prompt_ids(where, prompt_ids, vocab_size)          one prompt or a batch of prompts of token ids
  check_load_arguments(where, dtype, mesh)                 a floating load dtype, a mesh of devices
  check_heads(config, where, embed, lm_head)               the target's embedding / LM head, [V, H]
  check_params(config, params, where)                      a parameter tree of the config's layers and shapes
  check_block_inputs(config, where, target_hidden, block_ids, context_positions, block_positions)
  check_propose_inputs(config, where, cache_batch, target_hidden, num_new, anchor_ids)
  check_sampling(where, key, temperature)
  check_token_ids(where, name, ids, vocab_size)
  refuse_traced(where, *trees)                             a host-side driver called under jit
  check_roles(where, target, drafter)                      a target where a target belongs (not a drafter)
  check_generate(where, target, prompt_ids, ...)           the arguments of the decoding entry points
  check_cache_fits(where, target, drafter, batch, capacity) the decode caches against the devices' memory
  as_ids(where, name, x)                                   a list or array of integer ids, as an array
  call_donating(where, cache, fn, *args, **kwargs)         fn, with a reused donated cache named as such
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._memory import free_bytes
from .config import DflashConfig
from .spec import drafter_spec, expand

INT32_MAX = 2**31 - 1  # token ids, positions, sizes and chunk lengths all index int32 arrays


def _concrete(x) -> np.ndarray | None:
    """`x` as a NumPy array when its values are known on the host (not a tracer), else None."""
    return None if isinstance(x, jax.core.Tracer) else np.asarray(x)


def _shape(x) -> tuple[int, ...]:
    return tuple(np.shape(x))


def check_token_ids(where: str, name: str, ids, vocab_size: int) -> None:
    """Every id in `ids` (when concrete) must be an integer in `[0, vocab_size)`: an id past the embedding
    would be clamped by the gather and silently embed another token. The dtype is checked on tracers too: a
    float or bool id array would be truncated or taken for 0/1."""
    dtype = getattr(ids, "dtype", None)
    if dtype is not None and not np.issubdtype(dtype, np.integer):
        raise ValueError(f"{where}: {name} has dtype {dtype}, expected integer token ids")
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
                         anchor_ids=None, projected: bool = False) -> None:
    """`propose` / `append_context`: target_hidden `[batch, n_new, Lf*H]` (`projected`: `[batch, n_new, H]`) with
    the cache's batch, num_new `[batch]` in `[0, n_new]`, anchor_ids (`propose`'s) `[batch]` of token ids."""
    layers = 1 if projected else len(config.checked_target_layer_ids)
    width = layers * config.hidden_size
    hidden = _shape(target_hidden)
    if len(hidden) != 3 or hidden[2] != width or hidden[0] != cache_batch:
        what = "projected context rows of hidden" if projected else f"{layers} target layers x hidden"
        raise ValueError(f"{where}: target_hidden has shape {list(hidden)}, expected [{cache_batch}, n_new, {width}] "
                         f"(the cache's batch, {what} {config.hidden_size})")
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


def check_integer(where: str, name: str, value: Any, minimum: int = 0, maximum: int = INT32_MAX) -> int:
    """`value` as a Python int in `[minimum, maximum]`: a bool, a float or a string is a `TypeError`, an int out
    of range (0 or negative chunk sizes, sizes past int32) a `ValueError`, both naming `where` and `name`."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{where}: {name} must be an int, got {type(value).__name__} {value!r}")
    if not minimum <= value <= maximum:
        raise ValueError(f"{where}: {name}={value} is outside [{minimum}, {maximum}]")
    return int(value)


def check_number(where: str, name: str, value: Any) -> float:
    """A real number (a Python or NumPy scalar, not a bool) as a float: `TypeError` otherwise."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{where}: {name} must be a number, got {type(value).__name__} {value!r}")
    return float(value)


def check_seed(where: str, seed: Any) -> int:
    """A seed for `jax.random.key`: any int of at most 64 bits, signed or unsigned (an unsigned one past int64
    is taken as the int64 of the same bits, as NumPy's uint64 -> int64 view would); wider ones are refused,
    rather than silently truncated or raising OverflowError inside JAX."""
    seed = check_integer(where, "seed", seed, -(2**63), 2**64 - 1)
    return seed - 2**64 if seed >= 2**63 else seed


def refuse_traced(where: str, *trees: Any) -> None:
    """`TypeError` when any leaf is a tracer, or when the call itself is being staged out (`jax.jit(lambda:
    f(...))()`, `jax.eval_shape`: no argument is traced, but an operation on no arguments comes out a tracer):
    `where` is a host-side driver (it compiles its own programs, reads results back and times them), which
    `jax.jit` / `vmap` / `grad` cannot trace. Refused at once, before the first program is compiled."""
    traced = any(isinstance(leaf, jax.core.Tracer) for tree in trees for leaf in jax.tree.leaves(tree))
    if traced or isinstance(jnp.zeros((), jnp.int8), jax.core.Tracer):
        raise TypeError(
            f"{where} is a host-side driver (it compiles and runs the prefill and the decode loop itself and "
            "reads the tokens back), so it cannot run under jax.jit, vmap or grad: call it outside them. To "
            "compile a loop of your own, jit its pieces: target.prefill, target(...), dflash_jax.propose, "
            "dflash_jax.append_context"
        )


def _token(value: Any) -> int | None:
    """A token id as a Python int, or None when `value` is not an integer (a bool, a float, a string)."""
    if isinstance(value, (np.ndarray, jax.Array)) and value.ndim == 0:
        value = value.item() if np.issubdtype(value.dtype, np.integer) else None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        return None
    return int(value)


def _is_row(x: Any) -> bool:
    """Whether `x` is a sequence of tokens (a prompt), rather than a token."""
    return isinstance(x, (Sequence, np.ndarray, jax.Array)) and not (getattr(x, "ndim", 1) == 0)


def check_prompt_ids(where: str, prompt_ids: Any, vocab_size: int) -> list[list[int]]:
    """A batch of non-empty prompts of token ids in `[0, vocab_size)` (one bare prompt: a batch of one). A
    string (`"567"` would read as three prompts), floats (truncated), bools, nested
    deeper than a batch or ids outside the vocabulary are refused, naming `prompt_ids` and the first bad entry."""
    refuse_traced(where, prompt_ids)
    if isinstance(prompt_ids, (str, bytes)) or not isinstance(prompt_ids, (Sequence, np.ndarray, jax.Array)):
        raise TypeError(f"{where}: prompt_ids is a {type(prompt_ids).__name__}; expected token ids: a list of ints "
                        "(one prompt) or a list of such lists (a batch)")
    given = list(np.asarray(prompt_ids)) if isinstance(prompt_ids, jax.Array) else list(prompt_ids)
    single = not given or not _is_row(given[0])
    rows = [given] if single else given
    prompts = []
    for b, row in enumerate(rows):
        name = "prompt_ids" if single else f"prompt_ids[{b}]"
        if isinstance(row, (str, bytes)) or not _is_row(row):
            raise TypeError(f"{where}: {name} is a {type(row).__name__}; expected a list of int token ids")
        if isinstance(row, (np.ndarray, jax.Array)) and np.issubdtype(row.dtype, np.integer):  # checked at once
            check_token_ids(where, name, row, vocab_size)
            prompt = np.asarray(row).tolist()
        else:
            prompt = _prompt(where, name, row, vocab_size)
        if not prompt:
            raise ValueError(f"{where}: {name} is empty; every prompt needs at least one token")
        prompts.append(prompt)
    if not prompts:
        raise ValueError(f"{where}: prompt_ids is empty; every prompt needs at least one token")
    return prompts


def _prompt(where: str, name: str, row: Any, vocab_size: int) -> list[int]:
    """One prompt given as a sequence: each entry an int (not a bool, a float, a string) in the vocabulary."""
    prompt = []
    for i, t in enumerate(row):
        token = _token(t)
        if token is None:
            shown = t.item() if isinstance(t, np.generic) else t  # 1.5, not np.float64(1.5)
            raise TypeError(f"{where}: {name}[{i}] = {shown!r} is a {type(t).__name__}; expected an int token id")
        if not 0 <= token < vocab_size:
            raise ValueError(f"{where}: {name}[{i}] = {token} is outside the vocabulary [0, {vocab_size})")
        prompt.append(token)
    return prompt


def check_load_arguments(where: str, dtype: Any, mesh: Any) -> jnp.dtype:
    """The load dtype as a `jnp.dtype`, after refusing what would load silently wrong: an integer or bool dtype
    (all-zero weights), float8 (weights rounded to 3 mantissa bits), float64 without x64 (JAX gives float32),
    and a mesh that is not a `jax.sharding.Mesh` or has no devices. Raises `ValueError` naming the argument."""
    x64 = jax.config.jax_enable_x64  # type: ignore[attr-defined]  # a run-time flag, not in jax's Config stub
    allowed = [jnp.bfloat16, jnp.float16, jnp.float32] + ([jnp.float64] if x64 else [])
    names = ", ".join(jnp.dtype(d).name for d in allowed)
    try:
        resolved = jnp.dtype(dtype)
    except TypeError:
        raise ValueError(f"{where}: dtype={dtype!r} is not a dtype; expected one of {names}") from None
    if resolved not in [jnp.dtype(d) for d in allowed]:
        raise ValueError(f"{where}: dtype={resolved.name} cannot hold the weights; expected one of {names}"
                         + ("" if x64 or resolved != jnp.float64 else " (float64 needs jax_enable_x64)"))
    check_mesh(where, mesh)
    return resolved


def check_mesh(where: str, mesh: Any) -> None:
    """None, or a `jax.sharding.Mesh` of at least one device (a list of devices is not one)."""
    if mesh is not None and not isinstance(mesh, jax.sharding.Mesh):
        raise ValueError(f"{where}: mesh is a {type(mesh).__name__}; expected a jax.sharding.Mesh or None")
    if mesh is not None and mesh.devices.size == 0:
        raise ValueError(f"{where}: mesh has no devices; expected a jax.sharding.Mesh of at least one device")


def check_heads(config: DflashConfig, where: str, embed: Any = None, lm_head: Any = None) -> None:
    """The target's embedding `[vocab_size, H]` and an LM head `[vocab_size or draft_vocab_size, H]` (HF layout),
    when given: an array of another width would fail deep inside a matmul, another vocabulary clamp ids
    silently. (The target's `[vocab_size, H]` head may be attached to a drafter that ships its own reduced one.)"""
    H, V = config.hidden_size, config.vocab_size
    heads = {V, config.draft_vocab_size or V}
    for name, value, rows in (("embed", embed, {V}), ("lm_head", lm_head, heads)):
        expected = " or ".join(f"[{n}, {H}]" for n in sorted(rows))
        if value is None:
            continue
        if not hasattr(value, "shape") or not hasattr(value, "dtype"):
            raise TypeError(f"{where}: {name} is a {type(value).__name__}; expected an array {expected}")
        if len(value.shape) != 2 or value.shape[1] != H or value.shape[0] not in rows:
            raise ValueError(f"{where}: {name} has shape {list(value.shape)}, expected {expected} (vocabulary x "
                             "hidden_size of the drafter's config)")


def check_params(config: DflashConfig, params: Any, where: str) -> None:
    """The parameter tree against the config: its layer count and every tensor the config declares at its
    shape (optional parts, when present). A tree of another config (one layer under a two-layer config, an
    `nnx.merge` of another drafter's state) would index past the layers or fail inside an einsum."""
    layers = params.get("layers") if isinstance(params, Mapping) else None
    if not isinstance(layers, (list, tuple)) or len(layers) != config.num_hidden_layers:
        found = len(layers) if isinstance(layers, (list, tuple)) else "no"
        raise ValueError(f"{where}: the parameter tree has {found} layers but the config has "
                         f"num_hidden_layers={config.num_hidden_layers}; expected the tree of this config")
    for spec in expand(drafter_spec(config), config.num_hidden_layers):
        node: Any = params
        for part in spec.name.split("."):
            if part.isdigit():  # a layer index: in range, the count is checked above
                node = node[int(part)] if isinstance(node, (list, tuple)) else None
            else:
                node = node.get(part) if isinstance(node, Mapping) else None
            if node is None:
                break
        if node is None:
            if spec.optional is None:
                raise ValueError(f"{where}: the parameter tree lacks {spec.name!r}, which the config declares "
                                 f"(shape {list(spec.shape)})")
            continue
        if tuple(np.shape(node)) != spec.shape:
            raise ValueError(f"{where}: parameter {spec.name!r} has shape {list(np.shape(node))}, expected "
                             f"{list(spec.shape)} from the config; a tree of another config?")


def check_generate(where: str, target: Any, prompt_ids: Any, *, max_new_tokens: Any, prefill_chunk: Any,
                   stop_token_ids: Any, drafter: Any = None,
                   confidence_threshold: Any = 0.0) -> list[list[int]]:
    """The arguments of `speculative_generate` / `greedy_generate` / `sample_generate`: the batch of prompts once
    each is of the right type and in range (`check_prompt_ids`, ints >= 1 for `max_new_tokens` and
    `prefill_chunk`, stop ids as non-negative int32s, a number in [0, 1] for the threshold; the sampling controls
    and the key are `sampling`'s). Called under `jax.jit` it refuses at once (`refuse_traced`)."""
    refuse_traced(where, target, drafter, prompt_ids, max_new_tokens, confidence_threshold)
    check_roles(where, target, drafter)
    check_integer(where, "max_new_tokens", max_new_tokens, 1)
    check_integer(where, "prefill_chunk", prefill_chunk, 1)
    prompts = check_prompt_ids(where, prompt_ids, target.vocab_size)
    if stop_token_ids is not None:
        if isinstance(stop_token_ids, (str, bytes)) or not isinstance(stop_token_ids, (Sequence, np.ndarray)):
            raise TypeError(f"{where}: stop_token_ids is a {type(stop_token_ids).__name__}; expected a list of int "
                            "token ids or None")
        for i, t in enumerate(stop_token_ids):
            if _token(t) is None:
                raise TypeError(f"{where}: stop_token_ids[{i}] = {t!r} is a {type(t).__name__}; expected an int")
            check_integer(where, f"stop_token_ids[{i}]", _token(t))  # past the vocabulary: never matches
    threshold = check_number(where, "confidence_threshold", confidence_threshold)
    if not 0 <= threshold <= 1:  # NaN too: a predicted acceptance is a probability
        raise ValueError(f"{where}: confidence_threshold={threshold} is outside [0, 1] (0 verifies every draft)")
    return prompts


def _is_drafter(x: Any) -> bool:
    """A `Drafter` (its config a `DflashConfig`) or a Flax module holding one (`nnx.DFlashDrafter`)."""
    return isinstance(getattr(x, "config", None), DflashConfig) or hasattr(x, "drafter")


def check_roles(where: str, target: Any, drafter: Any = None) -> None:
    """`TypeError` naming the arguments when `target` is a drafter (`speculative_generate(drafter, target, ...)`)
    or anything else without a vocabulary, rather than an `AttributeError` from deep inside."""
    order = "(target, drafter, prompt_ids, ...)" if drafter is not None else "(target, prompt_ids, ...)"
    if _is_drafter(target):
        swapped = " (are target and drafter swapped?)" if drafter is not None and not _is_drafter(drafter) else ""
        raise TypeError(f"{where}: the first argument, target, is a {type(target).__name__}, a drafter{swapped}; "
                        f"the call is {where}{order}, the target a dflash_jax.Target (load_target)")
    if not hasattr(target, "vocab_size"):
        raise TypeError(f"{where}: target is a {type(target).__name__}; expected a dflash_jax.Target (load_target); "
                        f"the call is {where}{order}")


def check_cache_fits(where: str, target: Any, drafter: Any, batch: int, capacity: int) -> None:
    """Refuse, before anything is allocated, decode caches of `capacity` positions per sequence that cannot
    exist: positions past int32, or more bytes than the target's devices have free (`_memory.free_bytes`:
    what they report, the host's available memory for CPUs). The target's cache is measured abstractly
    (`jax.eval_shape` of its `init_cache`), the drafter's bounded by every layer keeping every position; under
    several processes, this process's devices against their share of it."""
    if capacity > INT32_MAX:
        raise ValueError(f"{where}: the caches would need {capacity} positions per sequence, past int32 positions "
                         f"({INT32_MAX}); lower max_new_tokens")
    shapes = jax.eval_shape(lambda: target.init_cache(batch, capacity))
    needed = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))
    if drafter is not None:
        c = drafter.config
        itemsize = np.dtype(drafter.params["fc"]["weight"].dtype).itemsize
        needed += (2 * c.num_hidden_layers * batch * c.num_key_value_heads * (capacity + c.effective_block_size)
                   * c.head_dim * itemsize)
    devices = target.embed.devices() if hasattr(target.embed, "devices") else jax.local_devices()[:1]
    # Across processes (`jax.distributed`) only this process's devices answer: their share of the caches
    local = [d for d in devices if d.process_index == jax.process_index()]
    needed = needed * len(local) // max(len(devices), 1)
    free, what = free_bytes(local)
    if free is not None and needed > free:
        raise ValueError(f"{where}: the KV caches for {batch} sequence(s) of {capacity} positions need "
                         f"{needed / 2**30:,.2f} GiB, but the target's {what} have {free / 2**30:,.2f} GiB free; "
                         "lower max_new_tokens, the prompt length or the batch")


def as_ids(where: str, name: str, x: Any) -> Any:
    """An integer array argument (`num_new`, `anchor_ids`): an array as it is, a list or a number as a NumPy
    array (a Python list under `jit` would be a pytree of scalars); floats and bools are a `TypeError`. Host
    values past int32 are a `ValueError`: JAX would wrap them silently (2**40 becomes 0)."""
    if not hasattr(x, "dtype"):
        if isinstance(x, (str, bytes)):
            raise TypeError(f"{where}: {name} is a {type(x).__name__}; expected an integer array")
        x = np.asarray(x)
    if not np.issubdtype(x.dtype, np.integer):
        raise TypeError(f"{where}: {name} has dtype {x.dtype}; expected integers")
    if isinstance(x, np.ndarray) and x.size and (x.min() < -INT32_MAX - 1 or x.max() > INT32_MAX):
        raise ValueError(f"{where}: {name} has entries past int32 ({x.min()} .. {x.max()})")
    return x


def call_donating(where: str, cache: Any, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)`, a jitted function that donates `cache`: when it fails because a buffer was donated
    or deleted and the cache is, the error says so (JAX's names only a buffer). Nothing is checked on success."""
    try:
        return fn(*args, **kwargs)
    except (ValueError, RuntimeError) as e:
        leaves = [x for x in jax.tree.leaves(cache) if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)]
        if not any(x.is_deleted() for x in leaves):
            raise
        raise ValueError(f"{where}: this cache was donated to an earlier call (its buffers are deleted); use the "
                         "cache that call returned") from e

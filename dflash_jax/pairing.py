"""Can this drafter draft for this target? `check_pair(target, drafter)`, once, before anything compiles.

Speculative decoding is lossless only if the drafter speaks the target's language: its drafts are target token
ids, its input features are the target's hidden states at layers the target has. A drafter trained for another
tokenizer or another model runs without a shape error in several ways (a larger vocabulary gives draft ids past
the target's embedding; a DSpark drafter ships its own heads, so nothing is attached and nothing is checked),
so every such pairing is refused here with both values named:

- vocabulary: the drafter's `vocab_size` (the id space of its drafts, also with a reduced `d2t` draft vocabulary)
  and the rows of the embedding and LM head it ships equal the target's `vocab_size`;
- hidden size: the target's features are `Lf * H` wide for the drafter's `fc` (`[H, Lf * H]`), and an attached
  embedding / LM head is `[V, H]`: the two `hidden_size`s are equal;
- layers: every `target_layer_ids` entry is a layer of the target (-1, the embedding output, included), and a
  stated `num_target_layers` is the target's layer count;
- rollback: the target has `commit` (`Target`), so a verify that rejects drafts can be undone.

A drafter that ships its own `embed_tokens` / `lm_head` as frozen copies of its training target's (DeepSpec's
DSpark drafters) and finds the target's different is warned about, not refused (`warn_shipped_heads_differ`):
the references disagree on which to use there, and either keeps the output the target's.

Prompt lengths against `max_position_embeddings` are checked per call (`bookkeeping.check_positions`).
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp

from .drafter import Drafter
from .errors import IncompatiblePairError

__all__ = ["check_pair", "describe_drafter", "describe_target"]


def describe_drafter(drafter: Drafter) -> str:
    """A short name for messages: family, architecture and sizes (a drafter does not know its path)."""
    c = drafter.config
    arch = c.architectures[0] if c.architectures else c.family
    return f"drafter {arch} ({c.family}, hidden {c.hidden_size}, vocab {c.vocab_size})"


def describe_target(target: Any) -> str:
    """A short name for messages: class, model type and sizes, of any object passed as a target."""
    config = getattr(target, "config", None)
    kind = getattr(config, "model_type", None) or type(target).__name__
    return (f"target {type(target).__name__} ({kind}, hidden {getattr(target, 'hidden_size', '?')}, "
            f"vocab {getattr(target, 'vocab_size', '?')}, {getattr(target, 'num_layers', '?')} layers)")


def check_pair(target: Any, drafter: Drafter, *, where: str = "speculative_generate") -> None:
    """Raise `IncompatiblePairError` (a ValueError) naming both models and the two values that disagree."""
    if not isinstance(drafter, Drafter):
        raise TypeError(f"{where}: drafter must be a dflash_jax.Drafter (load_drafter's result), got "
                        f"{type(drafter).__name__}")
    missing = [name for name in ("vocab_size", "hidden_size", "num_layers", "commit") if not hasattr(target, name)]
    if missing:
        why = (" `commit(pending, kept)` rolls a verify back to its accepted rows; without it a target with a "
               "recurrent state would keep the rejected drafts" if "commit" in missing else "")
        raise IncompatiblePairError(f"{where}: {type(target).__name__} does not implement the Target protocol "
                                    f"(dflash_jax.Target): missing {', '.join(missing)}.{why}")
    c, V = drafter.config, target.vocab_size
    names = f"{describe_drafter(drafter)} and {describe_target(target)}"

    def refuse(what: str) -> None:
        raise IncompatiblePairError(f"{where}: {names} cannot be paired: {what}")

    if c.vocab_size != V:
        refuse(f"the drafter's vocab_size is {c.vocab_size}, the target's {V}; its drafts would be ids of another "
               "vocabulary (pair a drafter trained for this target's tokenizer)")
    for name in ("embed_tokens", "lm_head"):
        own = drafter.params.get(name)
        if own is not None and own["weight"].shape[0] != V:
            refuse(f"the drafter's own {name} has {own['weight'].shape[0]} rows, the target's vocabulary {V}")
    if c.hidden_size != target.hidden_size:
        refuse(f"the drafter's hidden_size is {c.hidden_size}, the target's {target.hidden_size}; the drafter reads "
               "the target's hidden states")
    N = target.num_layers
    if c.num_target_layers is not None and c.num_target_layers != N:
        refuse(f"the drafter was trained on a {c.num_target_layers}-layer target (num_target_layers), this one has "
               f"{N} layers")
    outside = [l for l in c.checked_target_layer_ids if not -1 <= l < N]
    if outside:
        refuse(f"target_layer_ids {list(c.checked_target_layer_ids)} name layers {outside} outside [-1, {N - 1}]")
    warn_shipped_heads_differ(target, drafter, where)


@jax.jit
def _equal(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.array_equal(a, b.astype(a.dtype))  # one fused reduction, no [V, H] mask in memory


def warn_shipped_heads_differ(target: Any, drafter: Drafter, where: str) -> None:
    """Warn when the drafter's own `embed_tokens` / `lm_head` differ from the target's.

    DeepSpec trains them as frozen copies of the target's (`initialize_embeddings_and_head(freeze=True)`), so a
    difference means the drafter was trained for another target or revision. Its evaluator then drafts with the
    shipped ones, as this package does; SGLang's DSpark loader skips them and uses the target's
    (`load_drafter(embeddings="target")`). NVIDIA's Nemotron drafters declare their embedding (`has_embed_tokens`),
    and every reference uses it: no warning. A quantized head on either side is not compared.
    """
    if drafter.config.has_embed_tokens:
        return
    differ = []
    targets = {"embed_tokens": getattr(target, "embed", None), "lm_head": getattr(target, "lm_head", None)}
    for name, theirs in targets.items():
        own = drafter.params.get(name, {}).get("weight")
        if not isinstance(own, jax.Array) or not isinstance(theirs, jax.Array) or own.shape != theirs.shape:
            continue  # a packed copy cannot equal a float head: not compared
        if not bool(_equal(own, theirs)):
            differ.append(name)
    if differ:
        warnings.warn(
            f"{where}: the drafter's own {' and '.join(differ)} differ from the target's; DeepSpec trains them as "
            "frozen copies of its target's, so this drafter was trained for another target or revision. Drafting "
            "uses the drafter's own, as DeepSpec's evaluator does; load_drafter(..., embeddings='target') uses the "
            "target's, as SGLang does. The output is the target's either way; only acceptance changes.",
            stacklevel=4)  # the caller of speculative_generate

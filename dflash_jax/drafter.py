"""The `Drafter` type: a drafter's config and parameter tree, with the target's embeddings when it ships none.

What `load_drafter` returns and every forward function reads (`model`, `drafting`, `generate`); it knows
nothing of files, so the forward modules import it without the I/O stack.
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import jax
import jax.numpy as jnp

from ._arguments import check_heads
from ._summary import summary
from .config import DflashConfig

__all__ = ["Drafter", "draft_to_target_ids"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Drafter:
    """A loaded drafter: `config` (static), `params` (docs/design.md tree) and the target's attached
    `embed` / `lm_head` ([V, H], HF layout) when the drafter does not ship its own; `weights` (static): the form
    `load_drafter` placed quantized weights in ("packed", "fp8", "dequantized"; "packed (auto, batch 1)" where
    `weights="auto"` chose it), None where there were none or the drafter was not loaded.

    A pytree: pass it whole through `jax.jit`; the config is static metadata.
    """

    params: dict[str, Any]
    embed: jax.Array | None = None
    lm_head: jax.Array | None = None
    # Always given (a default only because it follows defaulted fields; None is no usable config).
    config: DflashConfig = dataclasses.field(default=cast(DflashConfig, None), metadata=dict(static=True))
    weights: str | None = dataclasses.field(default=None, metadata=dict(static=True))

    def __repr__(self) -> str:
        c = self.config
        attached = [name for name, x in (("embed", self.embed), ("lm_head", self.lm_head)) if x is not None]
        return summary("Drafter", [c.family, f"{c.num_hidden_layers} layers", f"hidden {c.hidden_size}",
                                   f"block {c.effective_block_size}", f"vocab {c.vocab_size}"]
                       + ([f"target's {' and '.join(attached)} attached"] if attached else [])
                       + ([f"weights {self.weights}"] if self.weights else []), self)

    def attach(self, *, embed: jax.Array | None = None, lm_head: jax.Array | None = None) -> Drafter:
        """Return a drafter that uses the target's embedding `[vocab_size, H]` / LM head `[draft vocabulary, H]`
        (HF layout); another shape is a `ValueError` naming it (`_arguments.check_heads`)."""
        check_heads(self.config, "attach", embed, lm_head)
        return dataclasses.replace(
            self,
            embed=self.embed if embed is None else embed,
            lm_head=self.lm_head if lm_head is None else lm_head,
        )

    @property
    def param_bytes(self) -> int:
        """Bytes of the drafter's own parameters (`params`; an attached target embedding / LM head not counted),
        quantized weights at their stored size (`weights="packed"`): what one device holds of a replicated
        drafter (`nbytes` of each array, so a sharded one counts whole)."""
        return sum(int(x.nbytes) for x in jax.tree.leaves(self.params))

    @property
    def embedding(self) -> jax.Array:
        """The embedding the block is embedded with [V, H]: the drafter's own, else the attached target's."""
        return self._own_or_attached("embed_tokens", self.embed, "embed")

    @property
    def output_head(self) -> jax.Array:
        """The LM head [V, H]: the drafter's own, else the attached target's."""
        return self._own_or_attached("lm_head", self.lm_head, "lm_head")

    def _own_or_attached(self, name: str, attached: jax.Array | None, keyword: str) -> jax.Array:
        own = self.params.get(name)
        if own is not None:
            return own["weight"]
        if attached is None:
            raise ValueError(f"this drafter ships no {name}: attach the target's with drafter.attach({keyword}=...)")
        return attached


def draft_to_target_ids(draft_ids: jax.Array, d2t: jax.Array | None) -> jax.Array:
    """Map draft-vocabulary ids to target ids: `target = draft + d2t[draft]` (identity without d2t)."""
    if d2t is None:
        return draft_ids
    return draft_ids + jnp.take(d2t, draft_ids, axis=0).astype(draft_ids.dtype)

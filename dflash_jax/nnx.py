"""The drafter as a Flax NNX module: `DFlashDrafter`, whose state is the loaded arrays themselves.

    module = DFlashDrafter.from_pretrained("z-lab/Qwen3-8B-DFlash-b16", mesh=mesh)   # or from_drafter(drafter)
    module = DFlashDrafter.from_drafter(drafter.attach(embed=target.embed, lm_head=target.lm_head))
    logits = module(target_hidden, block_ids, context_positions=..., block_positions=...)   # = draft_logits
    proposal, cache = module.propose(cache, target_hidden, num_new, anchor_ids)      # = drafting.propose

The state mirrors the loader's tree (docs/loading.md "Parameter tree"): `module.params["layers"][0]["mlp"]["up_proj"]
["weight"]` is an `nnx.Param` holding the very array `load_drafter` placed, with its sharding (nothing is
copied); a weight kept quantized (`weights="packed"`: `nvfp4.Packed`, `fp8.Fp8`) is one `nnx.Param` holding
the whole leaf, so that `nnx.split` / `nnx.merge` hand it back packed. The target's embedding and LM head,
when attached (`from_drafter` of an attached drafter), are
`TargetWeight` variables, not `nnx.Param`s: they belong to the target, so filtering `nnx.Param` gives the
drafter's own weights (what a fine-tune would train).

`DFlashDrafter.init(config, rngs=...)` builds the same tree with random values (`dflash_jax.linen.init_params`);
`nnx.eval_shape(lambda: DFlashDrafter.init(config, rngs=nnx.Rngs(0)))` gives it abstract (shapes and dtypes
only), to plan shardings before anything is loaded. `nnx.split` / `nnx.merge` / `nnx.jit` work as for any
module; the forward and drafting step themselves are `jax.jit`-compiled functions of `dflash_jax.model` and
`dflash_jax.drafting`, given a `Drafter` view of the module's current values (`module.drafter`).
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from . import drafting
from .config import DflashConfig
from .drafter import Drafter
from .drafting import ContextCache, Proposal
from .layers import is_quantized
from .linen import init_params
from .loader import load_drafter
from .model import AttentionOptions, draft_logits

__all__ = ["DFlashDrafter", "TargetWeight"]


class TargetWeight(nnx.Variable):
    """The target's embedding or LM head `[V, H]` attached to a drafter that ships none (not trained with it)."""


class DFlashDrafter(nnx.Module):
    """A DFlash / DFlash2 / DSpark drafter as an `nnx.Module` (module docstring)."""

    def __init__(
        self,
        config: DflashConfig,
        params: dict[str, Any],
        *,
        embed: jax.Array | None = None,
        lm_head: jax.Array | None = None,
    ):
        """Wrap a parameter tree in the loader's layout (`Drafter.params`) as `nnx.Param`s, without copying."""
        self.config = config
        self.params = nnx.data(jax.tree.map(nnx.Param, params, is_leaf=is_quantized))
        self.embed = nnx.data(None if embed is None else TargetWeight(embed))
        self.lm_head = nnx.data(None if lm_head is None else TargetWeight(lm_head))

    @classmethod
    def from_drafter(cls, drafter: Drafter) -> DFlashDrafter:
        """The module over a loaded `Drafter`'s arrays (and its attached target embedding / LM head)."""
        return cls(drafter.config, drafter.params, embed=drafter.embed, lm_head=drafter.lm_head)

    @classmethod
    def from_pretrained(
        cls, path_or_id: str | os.PathLike[str], *, mesh: jax.sharding.Mesh | None = None,
        dtype: jnp.dtype = jnp.bfloat16, **options: Any,
    ) -> DFlashDrafter:
        """`load_drafter(path_or_id, mesh=mesh, dtype=dtype, **options)` as a module (a directory or a hub id;
        options: `progress`, and `revision`, `cache_dir`, `local_files_only`, `token` for hub ids)."""
        return cls.from_drafter(load_drafter(path_or_id, mesh=mesh, dtype=dtype, **options))

    @classmethod
    def init(
        cls, config: DflashConfig, *, rngs: nnx.Rngs, dtype: jnp.dtype = jnp.bfloat16, own_embeddings: bool = False
    ) -> DFlashDrafter:
        """A randomly initialised drafter of `config`, with the loader's tree (`dflash_jax.linen.init_params`)."""
        return cls(config, init_params(config, rngs.params(), dtype=dtype, own_embeddings=own_embeddings))

    @property
    def drafter(self) -> Drafter:
        """The module's current values as a `Drafter` (the pytree `dflash_jax`'s functions take)."""
        values = jax.tree.map(lambda v: v.get_value(), self.params, is_leaf=lambda x: isinstance(x, nnx.Variable))
        return Drafter(
            params=values, config=self.config,
            embed=None if self.embed is None else self.embed.get_value(),
            lm_head=None if self.lm_head is None else self.lm_head.get_value(),
        )

    def __call__(
        self, target_hidden: jax.Array, block_ids: jax.Array, *, context_positions: jax.Array,
        block_positions: jax.Array, attention: AttentionOptions = AttentionOptions(),
    ) -> jax.Array:
        """Float32 logits `[batch, B, V]`: `dflash_jax.draft_logits` with this module's weights (and the target's
        embedding / LM head it was made with, `from_drafter` of an attached drafter)."""
        return draft_logits(self.drafter, target_hidden, block_ids, context_positions=context_positions,
                            block_positions=block_positions, attention=attention)

    def init_cache(self, batch_size: int, max_context: int, **options: Any) -> ContextCache:
        """`dflash_jax.init_cache` for this drafter (`options`: `dtype`, `sharding`, `attention`)."""
        return drafting.init_cache(self.drafter, batch_size, max_context, **options)

    def propose(
        self, cache: ContextCache, target_hidden: jax.Array, num_new: jax.Array, anchor_ids: jax.Array,
        **options: Any,
    ) -> tuple[Proposal, ContextCache]:
        """One drafting step: `dflash_jax.propose` with this module's weights (`options`: `key`, `temperature`,
        `top_k`, `top_p`, `min_p`, `confidence_threshold`, `attention`, ... as `propose` takes
        them). The cache is donated: use the returned one."""
        return drafting.propose(self.drafter, cache, target_hidden, num_new, anchor_ids, **options)

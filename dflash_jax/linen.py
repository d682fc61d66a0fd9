"""The drafter as a Flax linen module, `DrafterModule`, whose `init` declares the loader's parameter tree.

`DrafterModule(config).init(key, target_hidden, block_ids, context_positions=..., block_positions=...)` returns
`{"params": tree}` with exactly the tree `load_drafter` builds for a checkpoint of that config (the same
nesting, names, shapes and dtypes: docs/loading.md "Parameter tree"), randomly initialised, so that a pipeline can
init the whole model, then put a loaded checkpoint in the drafter's place (`params["drafter"] =
drafter.params`); `apply` with loaded params computes `draft_logits`. `init_params(config, key)` is the same
tree without a module (the NNX module draws its random initialisation from it too).

Which optional parts the tree holds follows the checkpoints released for the config (`plan.full_plan`):
the heads the config declares (DFlash2 convs and selector, DSpark Markov and confidence heads), `d2t` when the
draft vocabulary is reduced, and `embed_tokens` / `lm_head` only with `own_embeddings=True` (DeepSpec DSpark
drafters ship them; the others use the target's, passed to the call as `embed` / `lm_head`).
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from .config import DflashConfig
from .drafter import Drafter
from .model import AttentionOptions, draft_logits
from .plan import TensorPlan, build_tree, full_plan, init_leaves

__all__ = ["DrafterModule", "init_params"]


@functools.partial(jax.jit, static_argnames=("config", "dtype", "own_embeddings"))
def init_params(
    config: DflashConfig, key: jax.Array, *, dtype: jnp.dtype = jnp.bfloat16, own_embeddings: bool = False
) -> dict[str, Any]:
    """The loader's parameter tree for `config`, randomly initialised (see the module docstring); one compiled
    program, placed on the default device."""
    plan = full_plan(config, own_embeddings=own_embeddings)
    return build_tree(plan, init_leaves(jax.random.split(key, len(plan)), plan, dtype))


def init_subtree(key: jax.Array, plan: list[TensorPlan], name: str, dtype: jnp.dtype) -> Any:
    """The subtree `params[name]` alone (what a linen `self.param(name, ...)` declares), each tensor drawn by its
    spec's initialiser (`plan.init_leaves`: linears N(0, 1/fan_in), norm gains 1 + N(0, 0.1^2), ...)."""
    subset = [t for t in plan if t.path[0] == name]
    return build_tree(subset, init_leaves(jax.random.split(key, len(subset)), subset, dtype))[name]


class DrafterModule(nn.Module):
    """`draft_logits` as a linen module over the pytree of `load_drafter`.

    `init` declares that tree (random values, `param_dtype`); `apply({"params": drafter.params}, ...)` runs the
    loaded checkpoint. Inside a larger linen model it is a submodule like any other. `embed` / `lm_head`
    ([V, H], the target's) are needed unless the drafter ships its own (`own_embeddings=True`); `attention`:
    the attention rule (`AttentionOptions`).
    """

    config: DflashConfig
    attention: AttentionOptions = AttentionOptions()
    own_embeddings: bool = False
    param_dtype: Any = jnp.bfloat16

    @nn.compact
    def __call__(
        self, target_hidden: jax.Array, block_ids: jax.Array, *, context_positions: jax.Array,
        block_positions: jax.Array, embed: jax.Array | None = None, lm_head: jax.Array | None = None,
    ) -> jax.Array:
        if self.is_initializing():  # declare the tree; at apply time the given tree is used as it is
            plan = full_plan(self.config, own_embeddings=self.own_embeddings)
            for name in dict.fromkeys(t.path[0] for t in plan):
                assert isinstance(name, str)  # top-level keys are names (ints index only the layers)
                self.param(name, init_subtree, plan, name, self.param_dtype)
        drafter = Drafter(params=dict(self.variables["params"]), config=self.config, embed=embed, lm_head=lm_head)
        return draft_logits(drafter, target_hidden, block_ids, context_positions=context_positions,
                            block_positions=block_positions, attention=self.attention)  # [batch, B, V] float32

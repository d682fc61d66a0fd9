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
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from .config import DflashConfig
from .drafter import Drafter
from .model import AttentionOptions, draft_logits
from .plan import TensorPlan, build_tree, full_plan


@functools.partial(jax.jit, static_argnames=("config", "dtype", "own_embeddings"))
def init_params(
    config: DflashConfig, key: jax.Array, *, dtype: jnp.dtype = jnp.bfloat16, own_embeddings: bool = False
) -> dict[str, Any]:
    """The loader's parameter tree for `config`, randomly initialised (see the module docstring); one compiled
    program, placed on the default device."""
    plan = declared_plan(config, own_embeddings=own_embeddings)
    return build_tree(plan, init_leaves(key, plan, dtype))


def declared_plan(config: DflashConfig, *, own_embeddings: bool = False) -> list[TensorPlan]:
    """The tensors of a released checkpoint of `config`, in the loader's plan order."""
    return full_plan(config, own_embeddings=own_embeddings)


def init_subtree(key: jax.Array, plan: list[TensorPlan], name: str, dtype: jnp.dtype) -> Any:
    """The subtree `params[name]` alone (what a linen `self.param(name, ...)` declares)."""
    subset = [t for t in plan if t.path[0] == name]
    return build_tree(subset, init_leaves(key, subset, dtype))[name]


def init_leaves(key: jax.Array, plan: list[TensorPlan], dtype: jnp.dtype) -> list[jax.Array]:
    """A trainable starting point for each planned tensor: linears, codebooks and embeddings N(0, 1/fan_in)
    (`[out, in]`: fan_in is the last axis), RMSNorm gains 1, biases 0, DFlash2 conv base kernels the identity
    (first tap 1), d2t 0 (draft id i is target id i). The normal draws are slices of one draw, so that
    initialising compiles one random-number program, not one per shape."""
    sizes = [math.prod(t.shape) for t in plan if _drawn(t)]
    flat, offset = jax.random.normal(key, (sum(sizes),), jnp.float32), 0
    leaves = []
    for t in plan:
        if t.kind == "int":
            leaves.append(jnp.zeros(t.shape, jnp.int32))
        elif t.path[-1] == "base_kernel":  # [2, taps, H]
            leaves.append(jnp.zeros(t.shape, dtype).at[:, 0].set(1))
        elif t.path[-1] == "bias":
            leaves.append(jnp.zeros(t.shape, dtype))
        elif not _drawn(t):
            leaves.append(jnp.ones(t.shape, dtype))
        else:
            size = math.prod(t.shape)
            z = flat[offset : offset + size].reshape(t.shape)
            leaves.append((z * t.shape[-1] ** -0.5).astype(dtype))
            offset += size
    return leaves


def _drawn(t: TensorPlan) -> bool:
    """Whether `init_leaves` draws the tensor (a matrix), rather than setting it (gains, biases, convs, d2t)."""
    return t.kind != "int" and len(t.shape) > 1 and t.path[-1] != "base_kernel"


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
            plan = declared_plan(self.config, own_embeddings=self.own_embeddings)
            for name in dict.fromkeys(t.path[0] for t in plan):
                assert isinstance(name, str)  # top-level keys are names (ints index only the layers)
                self.param(name, init_subtree, plan, name, self.param_dtype)
        drafter = Drafter(params=dict(self.variables["params"]), config=self.config, embed=embed, lm_head=lm_head)
        return draft_logits(drafter, target_hidden, block_ids, context_positions=context_positions,
                            block_positions=block_positions, attention=self.attention)  # [batch, B, V] float32

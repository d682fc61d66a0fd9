"""The target side of speculative decoding: what the loop needs of a target model (`Target`), and nothing else.

This module is the protocol only: `generate` imports it without pulling in any file reading. The families live
in their own modules, each a pure model with its config:

    target.config    DecoderConfig (Qwen3Config, LlamaConfig): the config.json fields a dense decoder reads
    target.layout    Layout: where a target's leaves and cache live on a mesh (tensor-parallel)
    target.dense     DecoderTarget (Qwen3Target): the dense decoder, Qwen3 and Llama 3.x
    target.loading   load_target: a checkpoint directory or hub id -> the target its `architectures` names

Features: a target returns, besides its logits, the features a DFlash-family drafter reads, in the
convention of transformers' `hidden_states`:

    feature l = transformers' hidden_states[l + 1]   the output of decoder layer l, for 0 <= l < N - 1
    feature N - 1 = hidden_states[N]                 the LAST layer's output AFTER the final norm
    feature -1 = hidden_states[0]                    the embedding output (DeepSpec)

concatenated shallow-to-deep in `layer_ids` order: `[batch, S, Lf * H]`, in the dtype of `embed`. A prefill can
hand them through a `FeatureMap` as each step makes them (the drafter's context projection), so that a long
prompt's `Lf * H`-wide features never exist whole.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import jax

from .._summary import summary

__all__ = ["Target", "HFTarget", "TargetOutput", "KVCache", "FeatureMap", "mapped", "check_layer_ids", "PREFILL_CHUNK"]

PREFILL_CHUNK = 2048  # prompt tokens per prefill step, over the whole batch (`dense.prefill_chunks`)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """A static-shape KV cache: per layer `k`, `v` `[batch, n_kv, T, d_h]` (post k_norm + RoPE keys, heads-major
    as `attention.KeyValues`); slot t = position t. One buffer per layer, updated in place."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TargetOutput:
    """What one target forward returns."""

    logits: jax.Array  # [batch, S, V] float32 (`prefill`: [batch, V], at each prompt's last token)
    features: jax.Array  # [batch, S, Lf * H] at the requested layer ids, shallow to deep
    cache: Any  # `__call__`: pending, until `Target.commit` keeps the accepted rows; `prefill`: committed


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FeatureMap:
    """A row-wise map of features, `fn(params, features [batch, rows, Lf * H]) -> [batch, rows, D]`, that a
    target's `prefill` applies to each step's rows as it makes them, returning `[batch, P, D]`: the speculative
    loop passes the drafter's context projection (`fc`, then `hidden_norm`), so that the prompts' features exist
    only a step at a time (8 prompts of 32k rows of a Qwen3-8B: 10 GiB of features, 2 GiB projected). `fn` acts
    on each row alone and is static (hashable: part of the compiled program's key); `params`, its arrays, are
    traced."""

    params: Any
    fn: Callable[[Any, jax.Array], jax.Array] = dataclasses.field(metadata=dict(static=True))

    def __call__(self, features: jax.Array) -> jax.Array:
        return self.fn(self.params, features)


def mapped(project: FeatureMap | None, features: jax.Array) -> jax.Array:
    """`project(features)`, or the features as they are without a map."""
    return features if project is None else project(features)


def check_layer_ids(layer_ids: tuple[int, ...], n: int) -> None:
    """A `ValueError` for a feature layer id outside `[-1, n)` for an `n`-layer target (-1: the embedding output)."""
    for l in layer_ids:
        if not -1 <= l < n:
            raise ValueError(f"target layer id {l} is outside [-1, {n - 1}] for a {n}-layer target")


def other_family(raw: dict[str, Any], expected: str) -> str:
    """The problem of a family's loader given another family's config.json (`Qwen3Target.from_pretrained` of a
    Llama directory; `expected`: the model types it reads, as shown): what the directory holds, and the loader
    that picks the family by itself."""
    names = raw.get("architectures")
    holds = f" ({', '.join(map(str, names))})" if isinstance(names, list) and names else ""
    return (f"model_type is {raw.get('model_type')!r}, expected {expected}: the directory holds a "
            f"{raw.get('model_type')!r} checkpoint{holds}; load it with dflash_jax.load_target, which picks the "
            "family its config.json names")


@runtime_checkable
class Target(Protocol):
    """A causal LM that `speculative_generate` can verify drafts with.

    Requirements:
    - It is a JAX pytree (arrays as leaves, configuration as static metadata), so it is passed through `jax.jit`
      as an argument rather than baked into the program as constants.
    - `vocab_size`: the size of the logits' last axis; `embed`, `lm_head`: `[V, H]` in HF layout, handed to
      `drafter.attach` (DFlash drafters use the target's embedding and LM head). `hidden_size` (H, the width of
      one feature) and `num_layers` (the decoder layers a drafter's `target_layer_ids` index): the loop checks a
      drafter against them before anything compiles.
    - `init_cache(batch, max_length)`: an empty cache pytree for up to `max_length` positions per sequence.
    - `__call__(tokens, cache, lengths, *, layer_ids)`: run `tokens [batch, S]` at positions
      `lengths[b] .. lengths[b] + S - 1`, attending to the first `lengths[b]` cached positions and causally
      among the new ones; return `TargetOutput` (logits and features for every new token, a *pending* cache).
      Cache entries at positions `>= lengths[b] + S` must never influence the result: the loop trims an
      attention cache to an accepted prefix by passing a smaller `lengths` next time.
    - `commit(pending, kept)`: the cache after keeping only the first `kept[b]` (`[batch]`, 0..S) of the rows the
      last `__call__` ran, exactly as if only those had been run; its shapes never depend on S. The loop calls it
      after every `__call__`, with the accepted rows of a verify (0 for finished sequences). An attention cache
      returns the pending cache as it is (its rejected slots lie past `lengths` and are overwritten); a recurrent
      state (Gated DeltaNet, Mamba), which has already absorbed all S rows, must bring back the state after row
      `kept[b]`. A target without `commit` is refused by the loop: it cannot be rolled back.
    - `prefill(tokens, cache, lengths, *, layer_ids, chunk, project=None)`: run right-padded prompts `tokens
      [batch, P]` (real lengths `lengths`) into an empty cache; return the features of every row and the logits
      `[batch, V]` of each prompt's last token only (a long prompt's `[P, V]` logits would not fit), `chunk`
      tokens at a time. With a `FeatureMap` `project`, the features returned are its map of them, applied to
      each step's rows (a prefill without the keyword returns them whole; the loop maps them after).
    - `max_positions`: the longest sequence it runs (`max_position_embeddings`), or None for no limit.
    - optionally `eos_token_ids`: the ids generation stops after unless the call says otherwise (a target
      without it stops only at the call's `stop_token_ids`).
    """

    @property
    def vocab_size(self) -> int: ...

    @property
    def embed(self) -> jax.Array: ...

    @property
    def lm_head(self) -> jax.Array: ...

    @property
    def hidden_size(self) -> int: ...

    @property
    def num_layers(self) -> int: ...

    def init_cache(self, batch_size: int, max_length: int) -> Any: ...

    def __call__(
        self, tokens: jax.Array, cache: Any, lengths: jax.Array, *, layer_ids: tuple[int, ...]
    ) -> TargetOutput: ...

    def commit(self, pending: Any, kept: jax.Array) -> Any: ...

    def prefill(
        self, tokens: jax.Array, cache: Any, lengths: jax.Array, *, layer_ids: tuple[int, ...], chunk: int,
        project: FeatureMap | None = None,
    ) -> TargetOutput: ...

    @property
    def max_positions(self) -> int | None: ...


class HFTarget:
    """The `Target` properties of a model whose `params` follow the Hugging Face tree (`embed_tokens`, an
    untied `lm_head` when present) and whose `config` has the HF field names: shared by the target families."""

    params: Any
    config: Any

    def __repr__(self) -> str:
        c = self.config
        layout = getattr(self, "layout", None)
        mesh = [] if layout is None else [f"mesh {dict(layout.mesh.shape)}"]
        return summary(type(self).__name__, [getattr(c, "model_type", None) or type(c).__name__,
                                             f"{c.num_hidden_layers} layers", f"hidden {c.hidden_size}",
                                             f"vocab {c.vocab_size}", *mesh], self.params)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def max_positions(self) -> int:
        return self.config.max_position_embeddings

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The ids generation stops after by default: the checkpoint's generation_config.json `eos_token_id`, else
        config.json's (read at load), as a tuple."""
        return self.config.eos_token_ids

    @property
    def embed(self) -> jax.Array:
        """The input embedding `[V, H]` (HF layout; vocabulary-sharded on a tensor axis), for `drafter.attach`."""
        return self.params["embed_tokens"]["weight"]

    @property
    def lm_head(self) -> jax.Array:
        """The LM head `[V, H]` (HF layout; the embedding when tied), for `drafter.attach(lm_head=...)`."""
        own = self.params.get("lm_head")
        return self.embed if own is None else own["weight"]

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

concatenated shallow-to-deep in `layer_ids` order: `[batch, S, Lf * H]`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable

import jax

PREFILL_CHUNK = 2048  # prompt tokens per prefill step (`DecoderTarget.prefill`)

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
    cache: Any  # the cache with the new tokens' K/V written


@runtime_checkable
class Target(Protocol):
    """A causal LM that `speculative_generate` can verify drafts with.

    Requirements:
    - It is a JAX pytree (arrays as leaves, configuration as static metadata), so it is passed through `jax.jit`
      as an argument rather than baked into the program as constants.
    - `vocab_size`: the size of the logits' last axis; `embed`, `lm_head`: `[V, H]` in HF layout, handed to
      `drafter.attach` (DFlash drafters use the target's embedding and LM head).
    - `init_cache(batch, max_length)`: an empty cache pytree for up to `max_length` positions per sequence.
    - `__call__(tokens, cache, lengths, *, layer_ids)`: run `tokens [batch, S]` at positions
      `lengths[b] .. lengths[b] + S - 1`, attending to the first `lengths[b]` cached positions and causally
      among the new ones; return `TargetOutput` (logits and features for every new token, the updated cache).
      Cache entries at positions `>= lengths[b] + S` must never influence the result: the loop trims a cache to
      an accepted prefix by passing a smaller `lengths` next time.
    - `prefill(tokens, cache, lengths, *, layer_ids, chunk)`: run right-padded prompts `tokens [batch, P]` (real lengths
      `lengths`) into an empty cache; return the features of every row and the logits `[batch, V]` of each
      prompt's last token only (a long prompt's `[P, V]` logits would not fit), `chunk` tokens at a time.
    - `max_positions`: the longest sequence it runs (`max_position_embeddings`), or None for no limit.
    """

    @property
    def vocab_size(self) -> int: ...

    @property
    def embed(self) -> jax.Array: ...

    @property
    def lm_head(self) -> jax.Array: ...

    def init_cache(self, batch_size: int, max_length: int) -> Any: ...

    def __call__(
        self, tokens: jax.Array, cache: Any, lengths: jax.Array, *, layer_ids: tuple[int, ...]
    ) -> TargetOutput: ...

    def prefill(
        self, tokens: jax.Array, cache: Any, lengths: jax.Array, *, layer_ids: tuple[int, ...], chunk: int
    ) -> TargetOutput: ...

    @property
    def max_positions(self) -> int | None: ...


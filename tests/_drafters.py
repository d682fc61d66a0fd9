"""Tiny random drafters for the forward and drafting tests, with inputs that make the drafts discriminative."""

from __future__ import annotations

import dataclasses
import functools
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.drafter import Drafter
from dflash_jax.loader import load_drafter
from dflash_jax.testing import TINY_CONFIGS, write_checkpoint

GOLDEN = os.path.join(os.path.dirname(__file__), "data", "golden")


@functools.cache
def tiny_drafter(preset: str, seed: int = 0, draft_vocab_size: int | None = None) -> Drafter:
    """A float32 drafter of a `dflash_jax.testing` tiny preset with the target's embedding and LM head attached.

    With `draft_vocab_size`, the drafter ships its own reduced LM head (and embedding) and a `d2t` map.
    q_norm/k_norm gains are tripled (as the golden drafters double theirs) so that attention is sharp and the
    identical MASK rows of a block come out clearly different: otherwise every draft is the same token and
    "same drafts" would prove little. The Markov head and selector codebooks are scaled up likewise, so that
    their bias changes some drafts.
    """
    directory = tempfile.mkdtemp(prefix=f"{preset}-")
    raw = {**TINY_CONFIGS[preset], **({"draft_vocab_size": draft_vocab_size} if draft_vocab_size else {})}
    config = write_checkpoint(directory, raw, seed=seed, own_embeddings=draft_vocab_size is not None)
    drafter = load_drafter(directory, dtype=jnp.bfloat16)  # as stored: no per-shape conversion programs to compile
    gains = {"q_norm": 3.0, "k_norm": 3.0, "markov_head": 3.0, "candidate_selector": 2.0}

    def to_float32(path, leaf):  # on the host: exact (bf16 -> f32), then sharpened
        leaf = np.asarray(leaf)
        if np.issubdtype(leaf.dtype, np.integer):
            return jnp.asarray(leaf)  # d2t
        gain = np.prod([gains.get(getattr(k, "key", None), 1.0) for k in path])
        return jnp.asarray(leaf.astype(np.float32) * np.float32(gain))

    drafter = dataclasses.replace(drafter, params=jax.tree_util.tree_map_with_path(to_float32, drafter.params))
    rng = np.random.default_rng(seed + 1)
    vocab, hidden = config.vocab_size, config.hidden_size
    return drafter.attach(
        embed=jnp.asarray(rng.standard_normal((vocab, hidden)), jnp.float32),
        lm_head=jnp.asarray(rng.standard_normal((vocab, hidden)), jnp.float32),
    )


def features(drafter: Drafter, batch: int, rows: int, seed: int = 0) -> np.ndarray:
    """Random target features `[batch, rows, Lf*H]` with per-layer scales growing with depth, like real ones."""
    c = drafter.config
    rng = np.random.default_rng(seed)
    scales = np.repeat(2.0 ** np.arange(len(c.target_layer_ids)), c.hidden_size)
    return (rng.standard_normal((batch, rows, len(c.target_layer_ids) * c.hidden_size)) * scales).astype(np.float32)


def block(drafter: Drafter, anchors) -> np.ndarray:
    """`[anchor, MASK x (B-1)]` per sequence: `[batch, B]` int32."""
    c = drafter.config
    anchors = np.asarray(anchors, np.int32)
    masks = np.full((len(anchors), c.effective_block_size - 1), c.mask_token_id, np.int32)
    return np.concatenate([anchors[:, None], masks], axis=1)

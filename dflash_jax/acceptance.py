"""The acceptance rule of a verify step: how many of a proposal's drafts stand, and the token that ends the step.

Greedy (no key): a draft stands while it is the target's argmax; the step ends with the target's argmax after the
last one that stood. Sampled (temperature T > 0): the standard speculative-sampling rule (Leviathan et al. 2023,
Chen et al. 2023), so the output is distributed exactly as the target's own sampling at T: draft x (drawn from q)
is accepted with probability min(1, p(x) / q(x)); at the first rejection the token is drawn from
norm(max(p - q, 0)); after the last proposed draft it is drawn from p. p = softmax(target logits / T), cut by
`top_k` / `top_p` / `min_p` when given, and q is the distribution the drafter actually drew from
(`Proposal.probs`: its own logits under the same controls; `dflash_jax.sampling`). z-lab's reference loop
compares each draft with a token sampled from the target, which is lossless too, but accepts less
(docs/references.md).

Drafts past a DSpark confidence cut (`Proposal.num_tokens`) are never accepted: the step then ends with a token
drawn from p (greedy: the target's argmax), which is what the rule gives for a draft that was not made.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .drafting import Proposal
from .sampling import Warp

__all__ = ["accept", "in_vocabulary"]


def in_vocabulary(drafts: jax.Array, vocab_size: int) -> tuple[jax.Array, jax.Array]:
    """`(drafts with ids outside [0, vocab_size) replaced by 0, which drafts were inside)`, both `[batch, K]`.

    A second line of defence behind `pairing.check_pair`: an id past the target's vocabulary would be embedded as
    NaN by the verify's gather (and poison the cache), so the target sees 0 there, and `accept` never accepts
    such a draft: greedily it is no argmax; sampled, it is a draw where p = 0, always rejected, and the residual
    max(p - q, 0) of the standard rule keeps the output distributed as p.
    """
    inside = (drafts >= 0) & (drafts < vocab_size)
    return jnp.where(inside, drafts, 0), inside


def accept(key: jax.Array | None, logits: jax.Array, proposal: Proposal, warp: Warp) -> tuple[jax.Array, jax.Array]:
    """Verify a proposal: `(accepted drafts [batch], the step's last token [batch])`; greedy without a key.

    logits: `[batch, K + 1, V]`, row j the target's logits for the token after verify row j (row j < K checks
    draft j, row K follows the last draft).
    """
    drafts, inside = in_vocabulary(proposal.tokens, logits.shape[-1])  # [batch, K]
    K = drafts.shape[1]
    proposed = jnp.arange(K) < proposal.num_tokens[:, None]  # [batch, K]
    if key is None:  # greedy: a draft stands if it is the target's argmax
        choice = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [batch, K + 1]
        ok = (drafts == choice[:, :K]) & proposed & inside
        accepted = jnp.cumprod(ok, axis=1).sum(axis=1).astype(jnp.int32)
        return accepted, jnp.take_along_axis(choice, accepted[:, None], axis=1)[:, 0]

    accept_key, residual_key = jax.random.split(key)
    assert proposal.probs is not None  # a proposal drafted with a key carries its q (`drafting.propose`)
    p = warp.probs(logits)  # [batch, K + 1, V] the target's warped distribution (`sampling`)
    q = jnp.where(proposed[..., None], proposal.probs, 0.0)  # [batch, K, V]; 0: no draft
    q = jnp.pad(q, ((0, 0), (0, 1), (0, 0)))  # [batch, K + 1, V]
    p_draft = jnp.take_along_axis(p[:, :K], drafts[..., None], axis=2)[..., 0]  # [batch, K]
    q_draft = jnp.take_along_axis(q[:, :K], drafts[..., None], axis=2)[..., 0]
    u = jax.random.uniform(accept_key, drafts.shape)
    ok = (u * q_draft < p_draft) & proposed & inside  # accept with probability min(1, p / q)
    accepted = jnp.cumprod(ok, axis=1).sum(axis=1).astype(jnp.int32)
    p_a = jnp.take_along_axis(p, accepted[:, None, None], axis=1)[:, 0]  # [batch, V]
    q_a = jnp.take_along_axis(q, accepted[:, None, None], axis=1)[:, 0]  # zero after the last proposed draft
    residual = jnp.maximum(p_a - q_a, 0.0)
    residual = jnp.where(residual.sum(-1, keepdims=True) > 0, residual, p_a)  # p == q: never rejected
    last = jax.random.categorical(residual_key, jnp.log(residual)).astype(jnp.int32)
    return accepted, last

"""Step costs predicted before the first step: what a decode step reads and computes, at the device's rates.

The adaptive draft length (`dflash_jax.adaptive`) chooses by `StepCosts.seconds`, and only their ratios matter:
`seconds(l) / seconds(0)` sets whether drafting pays at an acceptance and what a probe costs. A run that had to
measure them first decoded at the fixed length until the measurement finished, which a run of a few dozen tokens
never does (issue 57). The prediction is a roofline per forward pass, summed over what a step runs:

    forward(rows) = max(bytes / read rate, flops / FLOP rate) + layers * layer_seconds
    seconds(0)    = step_seconds + target(batch)                   a plain step: the target on one row a sequence
    seconds(l)    = step_seconds + target(batch * (l + 1)) + drafter(batch * (K + 1)) + walk
    walk          = (K - 1) * (walk_bytes / read rate + layer_seconds)      a DSpark drafter's Markov walk

- bytes: every weight of the model counted as read once (the embedding too: a slight overestimate), except the
  routed experts of a MoE model, of which a forward on `rows` rows reads the distinct experts its rows route to,
  `E (1 - (1 - k / E) ** rows)` of the `E` per layer under uniform routing (what makes a MoE verify dear: 17 rows
  of Nemotron-H reach ~71 of 128 experts where one row reaches 6); plus the caches the forward reads (the target's
  K/V and recurrent states, the drafter's context K/V), counted at the run's capacity (the cache as allocated:
  about the context the run reaches). The drafter reads its LM head (its own or the target's).
- flops: two per weight and row, a routed expert's weight counted `k / E` of the rows. Attention's own products
  (over the cache) are left out: at decode row counts the cache's read bounds them.
- walk: a DSpark drafter draws its K drafts one after another, each through `markov_w2` ([V, r]: 78 MB at
  Qwen3-8B's vocabulary and rank 256 in bf16), so the walk reads it once per draft where the forward counts it once.
- the device's rates (`tuning.StepRates`: the read rate and bf16 GEMM rate measured on it, docs/benchmarks.md,
  and a fixed cost per layer of a forward and per step: kernel launches, the loop's small ops), from its tuning
  entry, `tuning.CPU_RATES` off a GPU.

The MoE block's few-row path reads each (row, expert) pair's weights where the device's tuning has it gather them
("gather", "reduce": 102 pairs for those 17 rows), and the prediction counts them so. What it leaves out (kernels
below the read rate) makes a verify look cheaper than it is (a 17-row Nemotron-H verify was measured at 5.7x a
plain step); that errs on the side of drafting, where a probe or a verify shows
the drafter's worth. A `StepCosts` given, measured (`adaptive.Calibration`) or stored (`cost_store.CostStore`)
is used instead where there is one.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from .adaptive import StepCosts
from .tuning import StepRates

__all__ = ["ModelReads", "model_reads", "forward_seconds", "predict_costs"]


@dataclasses.dataclass(frozen=True)
class ModelReads:
    """What one forward pass of a model reads and computes, by the parts whose reads differ with the rows.

    weight_bytes / weight_count: the weights every row reads (bytes as stored, and their number for the FLOPs);
    expert_bytes / expert_count: the routed experts' weights (0 for a dense model), of which `experts` per layer
    exist and `experts_per_row` are routed to per row; cache_bytes: the caches a forward reads; layers: the
    forward's layers (its fixed cost)."""

    weight_bytes: float
    weight_count: float
    expert_bytes: float = 0.0
    expert_count: float = 0.0
    experts: int = 0
    experts_per_row: int = 0
    cache_bytes: float = 0.0
    layers: int = 1
    pairs_read_up_to: int = 0  # (row, expert) pairs up to which each pair reads its expert (`target.moe`'s few rows)
    walk_bytes: float = 0.0  # a weight read again at each sequential draft after the first (DSpark's `markov_w2`)
    walk_steps: int = 0  # those sequential drafts (K - 1)

    def expert_share(self, rows: int) -> float:
        """The share of the experts' bytes a forward on `rows` rows reads: each (row, expert) pair its expert's,
        `rows k / E`, where the MoE block runs that few pairs by gathering each pair's weights (up to
        `pairs_read_up_to` pairs: `tuning.Tuning.moe_few_rows` "gather" or "reduce"); else each distinct expert
        once, `1 - (1 - k / E) ** rows` (uniform routing)."""
        if not self.experts:
            return 0.0
        pairs = rows * self.experts_per_row
        if pairs <= self.pairs_read_up_to:
            return pairs / self.experts
        return 1.0 - (1.0 - self.experts_per_row / self.experts) ** rows


def _size(leaf: Any, field: str) -> float:
    return float(getattr(leaf, field, 0) or 0)


def model_reads(params: Any, cache: Any, layers: int, experts: int = 0, experts_per_row: int = 0,
                extra: tuple[Any, ...] = (), pairs_read_up_to: int = 0, walk: Any = None,
                walk_steps: int = 0) -> ModelReads:
    """The reads of a model whose weights are `params` (a pytree; a routed expert's stacks under a key named
    "experts", as `target.moe` keeps them, counted apart when `experts` is given), with `cache` (a pytree of
    arrays) and `extra` weights read besides (an attached LM head); `pairs_read_up_to`: as `ModelReads`'; `walk`:
    a weight (among `params`) read again `walk_steps` times, one after another."""
    weight_bytes = weight_count = expert_bytes = expert_count = 0.0
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        routed = experts > 0 and any(getattr(key, "key", None) == "experts" for key in path)
        if routed:
            expert_bytes, expert_count = expert_bytes + _size(leaf, "nbytes"), expert_count + _size(leaf, "size")
        else:
            weight_bytes, weight_count = weight_bytes + _size(leaf, "nbytes"), weight_count + _size(leaf, "size")
    for leaf in jax.tree.leaves(extra):
        weight_bytes, weight_count = weight_bytes + _size(leaf, "nbytes"), weight_count + _size(leaf, "size")
    cache_bytes = sum(_size(leaf, "nbytes") for leaf in jax.tree.leaves(cache))
    return ModelReads(weight_bytes, weight_count, expert_bytes, expert_count, experts, experts_per_row, cache_bytes,
                      max(int(layers), 1), pairs_read_up_to, _size(walk, "nbytes"),
                      walk_steps if walk is not None else 0)


def forward_seconds(model: ModelReads, rows: int, rates: StepRates) -> float:
    """Seconds of one forward of `model` on `rows` rows (all sequences' together) at `rates` (module doc)."""
    share = model.expert_share(rows)
    read = model.weight_bytes + model.expert_bytes * share + model.cache_bytes
    routed = model.experts_per_row / model.experts if model.experts else 0.0
    flops = 2.0 * rows * (model.weight_count + model.expert_count * routed)
    walk = model.walk_steps * (model.walk_bytes / rates.read_bytes_per_s + rates.layer_seconds)
    return max(read / rates.read_bytes_per_s, flops / rates.flops_per_s) + model.layers * rates.layer_seconds + walk


def predict_costs(target: ModelReads, drafter: ModelReads, lengths: tuple[int, ...], num_draft_tokens: int,
                  batch: int, device: str, rates: StepRates) -> StepCosts:
    """`StepCosts` of `lengths` for `batch` sequences predicted from the two models' reads at `rates` (module
    doc): a plain step runs the target on one row a sequence; a step of `l` drafts the drafter on its block of
    `num_draft_tokens + 1` rows and the target on `l + 1`."""
    drafting = forward_seconds(drafter, batch * (num_draft_tokens + 1), rates)
    seconds = tuple(rates.step_seconds + forward_seconds(target, batch * (n + 1), rates) + (drafting if n else 0.0)
                    for n in lengths)
    return StepCosts(lengths, seconds, batch, device)

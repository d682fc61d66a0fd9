"""MoE expert weights as the stacks the block runs (`target.moe`), from either layout checkpoints store them in.

`moe.moe_block` reads, per MoE layer, `experts.gate_proj` / `experts.up_proj` `[E, I, H]` and `experts.down_proj`
`[E, H, I]`. On disk they are either

    fused (released Qwen3.5 / 3.6 MoE)   experts.gate_up_proj [E, 2I, H] (gate rows, then up), experts.down_proj
    per expert (transformers 4 layout)   experts.{j}.gate_proj.weight / up_proj.weight [I, H], down_proj.weight [H, I]

(transformers 5.24.0 `conversion_mapping.py`: `qwen3_5_moe_text` = the `qwen2_moe` converter, which stacks the
per-expert layout into the fused one on load; a fused checkpoint is read as it is.)

`add_expert_stacks` declares a MoE layer's stacks on a `target.views.TensorViews`, so that they appear as tensors
of their own: a fused `gate_up_proj` as two row ranges (`GATE_UP`; views of the map, nothing copied), per-expert
tensors stacked on the fly (a part of a stack reads only its experts' bytes, one part of one layer in memory at a
time). The loader's plan, checks and placement (`plan.check_tensors`, `placement.place_all`) run on it unchanged;
every source tensor's presence, dtype and shape is checked when it is declared (`CheckpointError` naming the
tensor), and a layer that stores its experts in both layouts, wholly or in part, is refused naming a tensor of each.
"""

from __future__ import annotations

from ..errors import CheckpointError
from .moe import MoeConfig
from .views import Fused, TensorViews

__all__ = ["add_expert_stacks"]

GATE_UP = Fused("experts.gate_up_proj", ("experts.gate_proj", "experts.up_proj"), 1, "fused gate and up projections")


def add_expert_stacks(views: TensorViews, prefix: str, c: MoeConfig) -> None:
    """Declare the stacks `{prefix}experts.{gate_proj,up_proj,down_proj}` of the MoE block under `prefix` (e.g.
    `model.language_model.layers.0.mlp.`; sizes `c`) on `views`, from whichever layout the checkpoint stores."""
    E, I, H = c.num_experts, c.moe_intermediate_size, c.hidden_size
    shapes = {"gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}
    fused = prefix + GATE_UP.stored
    if fused in views:
        stray = next((name for j in range(E) for proj in shapes
                      if (name := f"{prefix}experts.{j}.{proj}.weight") in views), None)
        if stray is not None:  # the per-expert layout too: it would be ignored
            views.refuse_twice(stray, fused, "one tensor per expert, beside the fused stacks")
        views.split(prefix, GATE_UP, [(E, I, H), (E, I, H)])
        return  # `experts.down_proj` is stored as the stack itself
    if prefix + "experts.0.gate_proj.weight" not in views:
        raise CheckpointError(
            f"{views.path}: no expert weights under {prefix!r}: expected {fused!r} [{E}, {2 * I}, {H}] (fused, as "
            f"released) and {prefix}experts.down_proj, or {prefix}experts.{{j}}.gate_proj.weight, up_proj, "
            f"down_proj for each of the {E} experts"
        )
    for proj, shape in shapes.items():
        views.stack(f"{prefix}experts.{proj}", [f"{prefix}experts.{j}.{proj}.weight" for j in range(E)], shape,
                    f"the {proj} of expert")

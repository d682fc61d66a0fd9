"""The NVIDIA Nemotron-H / Nemotron 3 target (`NemotronHForCausalLM`): the maths of `target.nemotron_h` on the family
template (`target.family.Family`), as the third family.

What this module adds to the maths: the load (tensors under `backbone.` with `lm_head.weight` beside them, each MoE
block's per-expert `mixer.experts.{e}.up_proj.weight` / `down_proj.weight` read as the stacks the block runs,
`mtp.*` not read; ModelOpt's mixed NVFP4 / FP8 export read as `stored_plan` says, dequantized), the mesh layout
(`nemotron_h_spec`'s logical axes: attention and the Mamba mixer by heads, experts by their width; each Mamba block's
`in_proj` and conv read with their rows permuted so that each device's shard holds its own sections, `views`), the
cache placed where the layout says, and the jitted `Target` methods, the cache donated. The verify's pending cache
keeps each Mamba state after every row, and `commit` selects each sequence's (`nemotron_h.commit`): a rollback is a
selection inside the compiled loop, no replay. The routed experts run on `target.moe`'s machinery (`OPS`): the
maths' own gather would copy `[T, k, I, H]` of expert weights, 114 GiB for a 2048-token prefill chunk at the
Lightning shapes. """

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._shapes import zeros
from ..errors import ConfigError
from ..plan import TensorPlan, init_leaves, planned
from ..safetensors import Checkpoint
from ..spec import FLOAT32, LINEAR
from . import PREFILL_CHUNK, FeatureMap, TargetOutput
from . import nemotron_h as model
from .family import Family
from .layout import Layout, make_layout, tensor_shards
from .mamba2 import CONV_SECTIONS, IN_PROJ_SECTIONS, conv_order, in_proj_order
from .moe import weighted_experts
from .nemotron_h_config import ARCHITECTURES, MAMBA, MOE, NemotronHConfig, parse_nemotron_h_config
from .nemotron_h_spec import KV_AXES, MAMBA_CONV_AXES, MAMBA_SSM_AXES, ROOT, expert_tensors, parameter_spec
from .sections import Sectioned
from .views import TensorViews

__all__ = ["NemotronHTarget", "random_nemotron_h"]

STACKS = ("experts.up_proj", "experts.down_proj")  # a MoE block's expert stacks, under its `mixer.`
QUANTIZED = ("U8", "F8_E4M3")  # NVFP4-packed codes, FP8 weights
OPS = model.Ops(routed=weighted_experts)  # gathered or read in place for few rows, tiled by expert for a prefill


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, repr=False)
class NemotronHTarget(Family):
    """A Nemotron-H hybrid (Mamba-2, MoE, attention, MLP blocks as its config says; `target.nemotron_h`). A pytree
    (params as leaves; config and layout static). Implements `Target`; loads and shards as every family does."""

    params: dict[str, Any]
    config: NemotronHConfig = dataclasses.field(metadata=dict(static=True))
    layout: Layout | None = dataclasses.field(default=None, metadata=dict(static=True))

    ARCHITECTURES = ARCHITECTURES
    PREFIXES = (ROOT,)
    IGNORED = ("mtp.",)

    @classmethod
    def parse(cls, raw: dict[str, Any], source: str) -> NemotronHConfig:
        return parse_nemotron_h_config(raw, source=source)

    @classmethod
    def plan(cls, config: NemotronHConfig, prefix: str = ROOT) -> list[TensorPlan]:
        """Every tensor, its tree path the HF name with `backbone.` stripped (`lm_head.weight` at the root)."""
        return [planned(s, s.name, root=ROOT) for s in parameter_spec(config)]

    @classmethod
    def layout_for(cls, config: NemotronHConfig, mesh: jax.sharding.Mesh, tensor_axis: str | None,
                   source: str) -> Layout:
        """`layout.make_layout`, plus what else splits over the tensor axis: the Mamba heads (which it must divide)
        and B / C groups (which it must divide, or be a multiple of, dividing their rows), the MoE blocks' expert
        and shared-expert widths."""
        layout = make_layout(config, mesh, tensor_axis, source)
        tp, c = layout.tensor_size, config
        fields = (("mamba_num_heads",) if c.blocks(MAMBA) else ()) + (
            ("moe_intermediate_size", "moe_shared_expert_intermediate_size") if c.blocks(MOE) else ())
        odd = [f"{field}={getattr(c, field)}" for field in fields if getattr(c, field) % tp]
        if odd:
            raise ConfigError(
                f"{source}: tensor axis {tensor_axis!r} has {tp} devices, which does not divide {', '.join(odd)}; "
                "expected a tensor-parallel size dividing the Mamba heads and the MoE widths too")
        groups, rows = c.n_groups, c.n_groups * c.ssm_state_size
        if c.blocks(MAMBA) and (groups % tp if tp <= groups else tp % groups or rows % tp):
            raise ConfigError(
                f"{source}: tensor axis {tensor_axis!r} has {tp} devices and n_groups={groups} (ssm_state_size="
                f"{c.ssm_state_size}): expected one to divide the other, and the axis to divide the B / C rows "
                f"n_groups * ssm_state_size={rows} (each device holds its heads' groups' rows, or its share of them)")
        return layout

    @classmethod
    def views(cls, checkpoint: Checkpoint, config: NemotronHConfig, prefix: str,
              layout: Layout | None = None) -> TensorViews:
        """Each MoE block's per-expert tensors as its stacks (`experts.up_proj [E, I, H]`, `down_proj [E, H, I]`),
        float experts only: quantized ones are read one by one (`stored_plan`) and stacked once dequantized; with a
        tensor axis of several devices in `layout`, each Mamba block's `in_proj` and conv with their rows in the
        sharded order (`mamba_orders`)."""
        views = TensorViews(checkpoint)
        for name, order in mamba_orders(config, prefix, tensor_shards(layout)).items():
            views.reorder(name, order)
        shapes = {t.name: t.shape for t in cls.plan(config, prefix)}
        for i in config.blocks(MOE):
            for stack in STACKS:
                name = f"{prefix}layers.{i}.mixer.{stack}"
                sources = expert_tensors(config, name)
                if sources[0] in checkpoint and checkpoint[sources[0]].dtype in QUANTIZED:
                    continue
                views.stack(name, sources, shapes[name][1:], f"the {stack.split('.')[-1]} of expert")
        return views

    @classmethod
    def stored_plan(cls, config: NemotronHConfig, prefix: str, checkpoint: Checkpoint) -> list[TensorPlan]:
        """The plan as a ModelOpt export stores it: an expert stack the checkpoint does not hold as one view (its
        experts quantized: `views`) read as its E per-expert tensors, and beside each FP8 projection stored with an
        `input_scale` (W8A8: Mamba's `in_proj` / `out_proj` in the mixed NVFP4 export) that scale, applied to the
        projection's input as the checkpoint's kernels do (`layers.static_fp8_input`)."""
        plan: list[TensorPlan] = []
        for t in cls.plan(config, prefix):
            if t.name.endswith(STACKS) and t.name not in checkpoint:
                *root, proj = t.path
                plan += [TensorPlan((*root, e, proj, "weight"), name, t.shape[1:], LINEAR, (), t.init)
                         for e, name in enumerate(expert_tensors(config, t.name))]
                continue
            plan.append(t)
            scale = t.name.removesuffix(".weight") + ".input_scale"
            if t.kind == LINEAR and t.name in checkpoint and checkpoint[t.name].dtype == "F8_E4M3" \
                    and scale in checkpoint:
                plan.append(TensorPlan((*t.path[:-1], "input_scale"), scale, (), FLOAT32))
        return plan

    @classmethod
    def tree(cls, plan: list[TensorPlan], leaves: list[Any]) -> Any:
        """The leaves nested; experts read one by one stacked as the block runs them, each expert's own buffer
        freed once in its stack (a dequantized expert set is most of the model: two copies would not fit)."""
        params = super().tree(plan, leaves)
        for layer in params["layers"]:
            experts = layer["mixer"].get("experts")
            if isinstance(experts, list):
                layer["mixer"]["experts"] = {proj: _stacked([e[proj]["weight"] for e in experts])
                                             for proj in experts[0]}
        return params

    def describe(self) -> str:
        c = self.config
        return (f"nemotron_h target, {len(c.pattern)} blocks ({c.pattern}), hidden={c.hidden_size}, "
                f"vocab={c.vocab_size}")

    # --- the Target protocol ----------------------------------------------------------------------------------

    @property
    def embed(self) -> jax.Array:
        return self.params["embeddings"]["weight"]

    @property
    def lm_head(self) -> jax.Array:
        return model.lm_head(self.params)

    @property
    def num_layers(self) -> int:
        return len(self.config.pattern)

    def sectioned(self) -> Sectioned:
        """Each Mamba block's `in_proj` and conv (`mamba2.in_proj_order`, `conv_order`)."""
        dims = self.config.mamba_dims
        return Sectioned(tuple(self.config.blocks(MAMBA)), "mixer", {
            "in_proj": dims.section_sizes(IN_PROJ_SECTIONS), "conv1d": dims.section_sizes(CONV_SECTIONS)})

    def init_cache(self, batch_size: int, max_length: int) -> model.NemotronHCache:
        """An empty cache for `batch_size` sequences of up to `max_length` positions (`nemotron_h.init_cache`),
        placed as the layout says."""
        empty = model.init_cache(self.config, batch_size, max_length, self.embed.dtype)
        if self.layout is None:
            return empty
        layout = self.layout

        def placed(x: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
            return zeros(x.shape, x.dtype, layout.sharding(axes, batch_size))

        return model.NemotronHCache(
            tuple(placed(k, KV_AXES) for k in empty.k), tuple(placed(v, KV_AXES) for v in empty.v),
            tuple(dataclasses.replace(s, conv=placed(s.conv, MAMBA_CONV_AXES), ssm=placed(s.ssm, MAMBA_SSM_AXES))
                  for s in empty.mamba))

    def __call__(self, tokens: jax.Array, cache: model.NemotronHCache, lengths: jax.Array, *,
                 layer_ids: tuple[int, ...] = ()) -> TargetOutput:
        """Run `tokens [batch, S]` at positions `lengths .. lengths + S - 1` after the committed `cache`: float32
        logits `[batch, S, V]`, the features at `layer_ids` and the pending cache, to be committed with `commit`."""
        return _forward(self, tokens, (cache.k, cache.v), cache.mamba, lengths, tuple(layer_ids))

    def commit(self, pending: model.PendingCache, kept: jax.Array) -> model.NemotronHCache:
        """The committed cache after keeping the first `kept [batch]` (0..S) rows of the last `__call__`."""
        return _commit(pending, kept)

    def prefill(self, tokens: jax.Array, cache: model.NemotronHCache, lengths: jax.Array, *,
                layer_ids: tuple[int, ...] = (), chunk: int = PREFILL_CHUNK,
                project: FeatureMap | None = None) -> TargetOutput:
        """Right-padded prompts `tokens [batch, P]` (`lengths` real tokens) into an empty cache, `chunk` token rows
        a step over the batch: the features of every row (or `project`'s map of them), the logits of each
        prompt's last token `[batch, V]` float32, the committed cache."""
        return _prefill(self, tokens, cache, lengths, project, tuple(layer_ids), chunk)


@functools.partial(jax.jit, static_argnames=("layer_ids",), donate_argnames=("kv",))
def _forward(target: NemotronHTarget, tokens: jax.Array, kv: tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]],
             mamba: tuple, lengths: jax.Array, layer_ids: tuple[int, ...]) -> TargetOutput:
    """The K/V caches donated (written in place); the Mamba states not (the pending cache keeps them per row, of
    other shapes: no buffer to reuse). The layer ids are checked by `nemotron_h.blocks`."""
    cache = model.NemotronHCache(*kv, mamba)
    logits, features, pending = model.forward(target.params, target.config, tokens, cache, lengths, layer_ids,
                                              ops=_ops(target.layout))
    return TargetOutput(logits, features, pending)


def _ops(layout: Layout | None) -> model.Ops:
    """`OPS`, the Mamba mixers' rows in the layout's blocks (`mamba_orders`)."""
    return dataclasses.replace(OPS, mamba_shards=tensor_shards(layout))


def _commit(pending: model.PendingCache, kept: jax.Array) -> model.NemotronHCache:
    """`nemotron_h.commit`, the Mamba states' selection compiled; the K/V buffers handed on as they are (a jitted
    pass-through would copy them: they cannot alias the per-row states, which are of other shapes)."""
    return model.NemotronHCache(pending.k, pending.v, _select(pending.mamba, kept))


@jax.jit
def _select(states: tuple, kept: jax.Array) -> tuple:
    return model.commit(model.PendingCache((), (), states), kept).mamba


@functools.partial(jax.jit, static_argnames=("layer_ids", "chunk"), donate_argnames=("cache",))
def _prefill(target: NemotronHTarget, tokens: jax.Array, cache: model.NemotronHCache, lengths: jax.Array,
             project: FeatureMap | None, layer_ids: tuple[int, ...], chunk: int) -> TargetOutput:
    logits, features, cache = model.prefill(target.params, target.config, tokens, cache, lengths, layer_ids, chunk,
                                            project=project, ops=_ops(target.layout))
    return TargetOutput(logits, features, cache)


def mamba_orders(config: NemotronHConfig, prefix: str, shards: int) -> dict[str, np.ndarray]:
    """By checkpoint name, the rows each Mamba block's `in_proj` (its weight, and an NVFP4 weight's block scales)
    and conv (weight, bias) are read in, split in `shards` (`mamba2.in_proj_order`, `conv_order`); none for one."""
    if shards == 1:
        return {}
    dims = config.mamba_dims._replace(shards=shards)
    in_proj, conv = in_proj_order(dims), conv_order(dims)
    rows = {"in_proj.weight": in_proj, "in_proj.weight_scale": in_proj, "conv1d.weight": conv, "conv1d.bias": conv}
    return {f"{prefix}layers.{i}.mixer.{name}": order for i in config.blocks(MAMBA) for name, order in rows.items()}


def _stacked(arrays: list[jax.Array]) -> jax.Array:
    stack = jnp.stack(arrays)
    for a in arrays:
        a.delete()
    return stack


def random_nemotron_h(config: NemotronHConfig, *, seed: int = 0, dtype: jnp.dtype = jnp.bfloat16) -> NemotronHTarget:
    """A target of `config` with random weights drawn on the device (no checkpoint), each tensor by its spec's
    initialiser: for benchmarks at real sizes and tests."""
    plan = NemotronHTarget.plan(config)
    keys = jax.random.split(jax.random.key(seed), len(plan))
    return NemotronHTarget(params=NemotronHTarget.tree(plan, init_leaves(keys, plan, dtype)), config=config)

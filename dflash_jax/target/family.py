"""The template of a target family: one load, one placement on a mesh, for every family.

A family (`dense.DecoderTarget`, `qwen3_5.Qwen3_5Target`) is a registered dataclass subclassing `Family`: `params`
as leaves, `config` and `layout` static. `Family` gives it `from_pretrained` / `load` and `shard`; the family gives
its pieces:

    ARCHITECTURES                         the config.json `architectures` it runs (`loading.FAMILIES`)
    PREFIXES, IGNORED                     where its tensors may live (the first that holds `embed_tokens` wins);
                                          checkpoint parts it does not read
    parse(raw, source) -> config          its config decoder
    plan(config, prefix) -> [TensorPlan]  its tensors, from its parameter spec
    tree(plan, leaves) -> params          the placed leaves nested as `params` (by default at their paths)
    layout_for(config, mesh, axis, src)   where its leaves and caches live on a mesh (`layout.Layout`)
    views(checkpoint, config, prefix,     what the load reads the plan from (a fused or per-expert layout; rows
          layout)                         in the order the layout shards them)
    stored_plan(config, prefix, views)    the tensors of this checkpoint (by default `plan`: a family whose
                                          quantized exports store other tensors plans them here)
    describe()                            one line for the load's log
    sectioned()                           the mixers whose rows a layout's tensor axis orders (`target.sections`),
                                          moved into the new order by `shard`

A load reads config.json once (`load_target` hands it over), checks every planned tensor's presence, dtype and shape
before any data is read, then the small tensors' values, then places each leaf on its shard
(`loader.check_and_place`): a failure raises before anything is placed. Quantized tensors (NVFP4, FP8: `LINEAR`
tensors stored so) are dequantized on their devices, placed replicated, and moved onto their shards once the tree
is built (`placed`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, ClassVar, Self, Unpack

import jax
import jax.numpy as jnp
import msgspec

from .._arguments import check_load_arguments, check_mesh
from .._config_file import generation_eos, read_config_json
from ..hub import HubOptions, resolve
from ..loader import check_and_place
from ..plan import TensorPlan, build_tree, check_tensors
from ..safetensors import Checkpoint
from . import PREFILL_CHUNK, FeatureMap, HFTarget, TargetOutput
from .config import TARGET, is_drafter_config, not_a_target
from .layout import Layout, make_layout, tensor_shards
from .sections import Sectioned, move_sections

__all__ = ["Family"]

log = logging.getLogger("dflash_jax")


def tied_extras(tied: bool) -> tuple[str, ...]:
    """The LM head a checkpoint of tied embeddings may carry: transformers ignores it, and so does the load, without
    a warning."""
    return ("lm_head.weight",) if tied else ()


class Family(HFTarget):
    """The template (module docstring): a family subclasses it as a `jax.tree_util.register_dataclass` dataclass
    with fields `params`, `config` and `layout` (the last two static)."""

    params: Any
    config: Any
    layout: Layout | None

    ARCHITECTURES: ClassVar[tuple[str, ...]] = ()
    PREFIXES: ClassVar[tuple[str, ...]] = ("model.",)
    IGNORED: ClassVar[tuple[str, ...]] = ()

    # --- the family's pieces ------------------------------------------------------------------------------------

    @classmethod
    def parse(cls, raw: dict[str, Any], source: str) -> Any:
        raise NotImplementedError

    @classmethod
    def plan(cls, config: Any, prefix: str = "model.") -> list[TensorPlan]:
        raise NotImplementedError

    @classmethod
    def tree(cls, plan: list[TensorPlan], leaves: list[Any]) -> Any:
        """The placed leaves nested at their paths, `params["layers"]` a tuple of per-layer dicts (each weight its
        own buffer, as placed; the layers run unrolled, every matmul reading its weights in place)."""
        params = build_tree(plan, leaves)
        params["layers"] = tuple(params["layers"])
        return params

    @classmethod
    def layout_for(cls, config: Any, mesh: jax.sharding.Mesh, tensor_axis: str | None, source: str) -> Layout:
        """`layout.make_layout`: the heads, the vocabulary and the MLP split over the tensor axis; a family with
        more to split checks it too."""
        return make_layout(config, mesh, tensor_axis, source)

    @classmethod
    def prefix(cls, checkpoint: Checkpoint) -> str:
        """Where this checkpoint's tensors live: the first of `PREFIXES` holding `embed_tokens`, else the last."""
        return next((p for p in cls.PREFIXES if p + "embed_tokens.weight" in checkpoint), cls.PREFIXES[-1])

    @classmethod
    def views(cls, checkpoint: Checkpoint, config: Any, prefix: str, layout: Layout | None = None) -> Any:
        """What the plan is read from, to be placed as `layout` says (None: one device): the checkpoint itself,
        unless a family reads another layout as its own."""
        return checkpoint

    @classmethod
    def stored_plan(cls, config: Any, prefix: str, checkpoint: Checkpoint) -> list[TensorPlan]:
        """The tensors a load reads from `checkpoint` (`views`' result): the family's plan."""
        return cls.plan(config, prefix)

    @classmethod
    def placed(cls, params: Any, config: Any, layout: Layout) -> Any:
        """`params` moved onto the shards `layout` gives the family's plan; a leaf the plan does not hold (a quantized
        export's activation scale) replicated."""
        axes: dict[tuple, tuple[str | None, ...]] = {t.path: t.axes for t in cls.plan(config)}

        def put(path: tuple, leaf: jax.Array) -> jax.Array:
            keys = tuple(getattr(k, "key", getattr(k, "idx", None)) for k in path)
            return jax.device_put(leaf, layout.sharding(axes.get(keys, ())))

        return jax.tree_util.tree_map_with_path(put, params)

    def describe(self) -> str:
        raise NotImplementedError

    # --- the `Target` protocol, each family's own ------------------------------------------------------------------

    def init_cache(self, batch_size: int, max_length: int) -> Any:
        raise NotImplementedError

    def __call__(self, tokens: jax.Array, cache: Any, lengths: jax.Array, *,
                 layer_ids: tuple[int, ...] = ()) -> TargetOutput:
        raise NotImplementedError

    def commit(self, pending: Any, kept: jax.Array) -> Any:
        raise NotImplementedError

    def prefill(self, tokens: jax.Array, cache: Any, lengths: jax.Array, *, layer_ids: tuple[int, ...] = (),
                chunk: int = PREFILL_CHUNK, project: FeatureMap | None = None) -> TargetOutput:
        raise NotImplementedError

    # --- the template -------------------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str],
        *,
        mesh: jax.sharding.Mesh | None = None,
        dtype: jnp.dtype = jnp.bfloat16,
        progress: bool | None = None,
        tensor_axis: str | None = "model",
        **hub: Unpack[HubOptions],
    ) -> Self:
        """Load a Hugging Face checkpoint directory of this family (config.json + `model.safetensors` or an index
        with shards), or a hub id (`hub`: `revision`, `cache_dir`, `local_files_only`, `token` as transformers spells
        them, `dflash_jax.hub`).

        Floating tensors are cast to `dtype` (bfloat16, float16 or float32; float64 with x64: another is a
        `ValueError`, as for `load_drafter`). Without `mesh` they land on the first local device; with it, each
        leaf is sharded as the family's `Layout` says (tensor-parallel over `tensor_axis`, replicated with
        `tensor_axis=None`; an axis the mesh lacks is a `ValueError` naming the mesh's axes), each process reading
        only the byte ranges of its own devices' shards. Every tensor's presence, dtype and shape is checked against
        the config before any data is read, then the small tensors' values (NaN/Inf norm gains and biases), all
        before anything is placed (`CheckpointError`); tensors the family does not use are warned about. A tensor
        axis that does not divide the heads, the vocabulary or the widths it splits is a `ConfigError`.
        """
        path = resolve(path, **hub)
        file, raw = read_config_json(path, TARGET)
        return cls.load(path, file, raw, mesh=mesh, dtype=dtype, progress=progress, tensor_axis=tensor_axis)

    @classmethod
    def load(cls, path: str, file: str, raw: dict[str, Any], *, mesh: jax.sharding.Mesh | None = None,
             dtype: jnp.dtype = jnp.bfloat16, progress: bool | None = None, tensor_axis: str | None = "model"
             ) -> Self:
        """`from_pretrained` of a resolved directory `path` whose config.json (`file`) was read as `raw`."""
        dtype = check_load_arguments(f"{cls.__name__}.from_pretrained", dtype, mesh)
        if is_drafter_config(raw):  # else refused as a config of another model_type, which says less
            raise not_a_target(file, raw, list(cls.ARCHITECTURES))
        config = cls.parse(raw, file)
        eos = generation_eos(path)  # what transformers stops at, before config.json's
        if eos is not None:
            config = msgspec.structs.replace(config, eos_token_id=eos)
        layout = None if mesh is None else cls.layout_for(config, mesh, tensor_axis, path)
        with Checkpoint(path) as stored:
            prefix = cls.prefix(stored)
            checkpoint = cls.views(stored, config, prefix, layout)
            plan = cls.stored_plan(config, prefix, checkpoint)
            quantized = check_tensors(plan, checkpoint, path)
            shardings = None if layout is None else [layout.sharding(() if t.name in quantized else t.axes)
                                                     for t in plan]  # quantized: placed replicated, moved after
            leaves = check_and_place(path, plan, checkpoint, quantized, vocab_size=config.vocab_size, mesh=mesh,
                                     dtype=dtype, progress=progress,
                                     ignored=(*cls.IGNORED, *tied_extras(config.tie_word_embeddings)),
                                     shardings=shardings)
        params = cls.tree(plan, leaves)
        if layout is not None and quantized:
            params = cls.placed(params, config, layout)
        target = cls(params=params, config=config, layout=layout)  # type: ignore[call-arg]
        log.info("%s: %s, tensor-parallel %d", path, target.describe(), 1 if layout is None else layout.tensor_size)
        return target

    def shard(self, mesh: jax.sharding.Mesh, *, tensor_axis: str | None = "model") -> Self:
        """This target moved onto `mesh` with the layout `from_pretrained` gives (each leaf `device_put` onto its
        planned sharding): for targets built in memory (`random_qwen3`, `successor_target`, ...); a checkpoint loads
        straight onto its shards with `from_pretrained` / `load_target`."""
        where = f"{type(self).__name__}.shard"
        check_mesh(where, mesh)
        layout = self.layout_for(self.config, mesh, tensor_axis, where)
        params = self.placed(self.params, self.config, layout)
        old, new, sectioned = tensor_shards(self.layout), tensor_shards(layout), self.sectioned()
        if old != new and sectioned.layers:  # the tree a load onto `layout` gives
            params = {**params, "layers": move_sections(params["layers"], sectioned, old, new)}
        return dataclasses.replace(self, params=params, layout=layout)  # type: ignore[type-var]

    def sectioned(self) -> Sectioned:
        """The mixers whose tensors hold their rows in the tensor axis' blocks (`target.sections`): none here."""
        return Sectioned((), "", {})


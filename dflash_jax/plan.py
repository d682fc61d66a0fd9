"""The plan of a load: which checkpoint tensor fills which leaf of the tree, checked before a byte is read.

From the config's parameter spec (`spec.drafter_spec`, `target.parameter_spec`) and the checkpoint's headers
alone: `plan_tensors` decides which tensors make up the drafter (the optional parts the checkpoint carries),
`check_tensors` checks the presence, dtype and shape of every one (NVFP4 companions included), and
`build_tree` nests the placed leaves at their paths (docs/loading.md "Parameter tree"). `open_checked` does all of it
for a drafter directory: the one way the loader, the CLI, the NVFP4 converter and the tests open a checkpoint.
Any problem raises `CheckpointError` naming the file and the tensor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from .config import DflashConfig, replace
from .errors import CheckpointError
from .fp8.checkpoint import check_declared, check_fp8
from .layouts import ENCODER, PUBLISHED_NAMES, check_context_layout
from .nvfp4.checkpoint import check_packed, check_quant_config, declared_quantization, nvfp4_companions
from .safetensors import INT_DTYPES, WEIGHT_DTYPES, Checkpoint
from .spec import CONFIDENCE, INT, LINEAR, MARKOV, FanIn, Initializer, ParamSpec, drafter_spec, expand, leaf_dtype

__all__ = ["TensorPlan", "CheckedPlan", "open_checked", "plan_tensors", "check_tensors", "build_tree", "full_plan",
           "unexpected_tensors"]

# Tensors a checkpoint may carry that the drafter does not use; not worth a warning.
IGNORED_SUFFIXES = (".input_scale", ".k_scale", ".v_scale", ".pre_quant_scale")
IGNORED_NAMES = ("t2d",)
# Tensors (by name part) of extensions this package does not implement: loading the rest of such a checkpoint
# would run a different network from the one trained, so they are refused, not warned about (docs/references.md).
UNIMPLEMENTED_TENSORS = (
    ("attention_sink_bias", "a learned per-head attention sink the config does not declare (expected "
                            "`attention_sink_bias: true` with it)"),
    ("markov_head.gate_proj.", "a gated Markov head (SpecForge / DeepSpec `markov_head_type: gated`)"),
    ("markov_head.joint_proj.", "an RNN Markov head (SpecForge / DeepSpec `markov_head_type: rnn`)"),
    ("mask_embedding", "a separately trained mask embedding (vLLM `_read_mask_embedding`)"),
    (".g_proj.", "Laguna's per-head softplus gate on the attention output (poolside DFlash; SGLang dflash.py)"),
    ("aux_hidden_norms.", "Laguna's per-feature norms before fc (poolside DFlash; SGLang dflash.py)"),
    ("fc_norm", "a norm of the fc input (Laguna / hybrid DFlash exports)"),
    (".qkv_proj.", "a fused QKV projection (Laguna / Nemotron exports), which the drafter's layer stores split"),
    (".self_attn.sinks", "a learned per-head attention sink (Nemotron-style)"),
    ("kv_a_proj_with_mqa", "multi-head latent attention (MLA: Kimi-K3 / DeepSeek-V4 drafters)"),
    (".mlp.experts.", "a mixture-of-experts MLP (DeepSeek-V4 DSpark)"),
    ("pre_feedforward_layernorm", "Gemma 4's sandwich norms (DeepSpec Gemma 4 DSpark; run for its architecture, "
                                  "Gemma4DSparkModel, only)"),
    ("layer_scalar", "Gemma 4's per-layer output scale (DeepSpec Gemma 4 DSpark; run for its architecture, "
                     "Gemma4DSparkModel, only)"),
)
MASK_EMBEDDING_FILE = "mask_embedding.pt"  # vLLM's override of the mask token's embedding row (MiMo)
# Optional parts a config declares that a checkpoint may still lack: drafting goes on without them, warned.
DRAFTS_WITHOUT: dict[str, Callable[[DflashConfig], str]] = {
    MARKOV: lambda c: f"config declares markov_rank={c.markov_rank}; drafting without the Markov bias",
    CONFIDENCE: lambda c: "config enables the confidence head; proposals will not be cut by confidence",
}


@dataclasses.dataclass(frozen=True)
class TensorPlan:
    """One leaf to load: which checkpoint tensor, where it goes in the tree, what it must look like."""

    path: tuple[str | int, ...]  # position in the tree, e.g. ("layers", 0, "mlp", "up_proj", "weight")
    name: str  # checkpoint tensor name (prefix included)
    shape: tuple[int, ...]  # expected logical shape
    kind: str  # `spec.LINEAR` (float or NVFP4-packed), `NORM`, `FLOAT`, `INT` (d2t)
    axes: tuple[str | None, ...] = ()  # logical axis per dimension (a target's tensor-parallel plan); (): none
    init: Initializer = FanIn()  # how a random drafter or test checkpoint draws it


def planned(spec: ParamSpec, name: str, root: str = "") -> TensorPlan:
    """The plan of one tensor of `spec` stored as `name`; its tree path is the spec's name, `root` stripped."""
    return TensorPlan(tree_path(spec.name.removeprefix(root)), name, spec.shape, spec.kind, spec.axes, spec.init)


def tree_path(name: str) -> tuple[str | int, ...]:
    """`"layers.0.mlp.up_proj.weight"` -> `("layers", 0, "mlp", "up_proj", "weight")`."""
    return tuple(int(x) if x.isdigit() else x for x in name.split("."))


def plan_tensors(
    config: DflashConfig, contains: Callable[[str], bool], prefix: str = "", where: str = "<checkpoint>"
) -> list[TensorPlan]:
    """Decide which tensors make up this drafter (`spec.drafter_spec`). `contains(name)` says whether the
    checkpoint has a tensor: an optional part is loaded when the config declares it and the checkpoint carries
    its first tensor, under its name or an alias, as the reference loaders do."""
    specs = expand(drafter_spec(config), config.num_hidden_layers)
    plan: list[TensorPlan] = []
    carried: dict[str, bool] = {}  # optional part -> whether the checkpoint has its first tensor
    for spec in specs:
        names = [prefix + spec.name, *(alias.format(p=prefix) for alias in spec.aliases)]
        name = next((n for n in names if contains(n)), names[0])
        if spec.optional is not None:
            if spec.optional not in carried:
                carried[spec.optional] = contains(name)
            if not carried[spec.optional]:
                continue
        plan.append(planned(spec, name))
    for part, says in DRAFTS_WITHOUT.items():
        if carried.get(part) is False:
            first = next(s.name for s in specs if s.optional == part)
            warnings.warn(f"{where}: the checkpoint has no {prefix}{first}, but the {says(config)}", stacklevel=2)
    return plan


def full_plan(config: DflashConfig, *, prefix: str = "", own_embeddings: bool | None = None) -> list[TensorPlan]:
    """Every tensor a released checkpoint of this config carries: the heads the config declares, `d2t` when the
    draft vocabulary is reduced, `embed_tokens` / `lm_head` when `own_embeddings` (DeepSpec style), and
    `embed_tokens` alone when it is None and the config says `has_embed_tokens` (NVIDIA's Nemotron 3.5 drafters,
    whose logits go through the target's head)."""
    own = {"embed_tokens.weight", "lm_head.weight"} if own_embeddings else set()
    if own_embeddings is None and config.has_embed_tokens:
        own = {"embed_tokens.weight"}
    reduced = config.draft_vocab_size is not None and config.draft_vocab_size != config.vocab_size
    published = {stored for a in config.architectures for stored in PUBLISHED_NAMES.get(a, {}).values()}
    renamed = {spec for a in config.architectures for spec in PUBLISHED_NAMES.get(a, {})}

    def contains(name: str) -> bool:
        name = name.removeprefix(prefix)
        if name in ("embed_tokens.weight", "lm_head.weight"):
            return name in own
        if name in published or name in renamed:  # stored under the architecture's published name
            return name in published
        return reduced if name == "d2t" else name != "draft_id_to_target_id"

    return plan_tensors(config, contains, prefix)


def init_leaves(keys: jax.Array, plan: list[TensorPlan], dtype: jnp.dtype) -> list[jax.Array]:
    """A random leaf per planned tensor, drawn on the default device by its spec's initialiser (`spec.FanIn`,
    `Gain`, ...) from `keys[i]` (`keys`: at least one per tensor); integer maps (d2t) stay int32, `spec.FLOAT32`
    tensors float32."""
    return [t.init.device(key, t.shape, leaf_dtype(t.kind, dtype)) for key, t in zip(keys, plan)]


def build_tree(plan: list[TensorPlan], leaves: list[Any]) -> dict[str, Any]:
    """Nest the leaves at their tree paths; `layers` becomes a list of per-layer dicts."""
    tree: dict[str, Any] = {}
    for t, leaf in zip(plan, leaves):
        node: Any = tree
        for key, nxt in zip(t.path[:-1], t.path[1:]):
            if isinstance(key, int):
                while len(node) <= key:
                    node.append({})
                node = node[key]
            else:
                node = node.setdefault(key, [] if isinstance(nxt, int) else {})
        node[t.path[-1]] = leaf
    return tree


# --------------------------------------------------------------------------------------------------------------
# Checks on the headers
# --------------------------------------------------------------------------------------------------------------


def find_prefix(checkpoint: Checkpoint, where: str) -> str:
    """`""` or `"model."`: the layout of the checkpoint, detected by its `fc.weight` (or `encoder.fc.weight`, whose
    set `layouts.check_context_layout` checks whole)."""
    names = set(checkpoint)
    if any(n.startswith(("midlayer.", "model.midlayer.")) for n in names):  # EAGLE-3 has an fc.weight too
        raise CheckpointError(
            f"{where}: tensors `midlayer.*`: this is an EAGLE-3 drafter, not a DFlash-family drafter; "
            "expected `fc.weight` with `layers.*`"
        )
    for prefix in ("", "model."):
        if any(prefix + fc in checkpoint for fc in ("fc.weight", *ENCODER)):
            check_context_layout(names, prefix, where)
            return prefix
    if "model.embed_tokens.weight" in names or "lm_head.weight" in names:
        what = "a full language model (it has embed_tokens/lm_head but no fc)"
    else:
        what = f"a checkpoint of {len(names)} tensors without one"
    raise CheckpointError(
        f"{where}: no `fc.weight` or `model.fc.weight` (nor the assistant's `encoder.*`): this is {what}; "
        "expected a DFlash-family drafter"
    )


def refuse_unimplemented(checkpoint: Checkpoint, where: str, declared: frozenset[str] = frozenset()) -> None:
    """Refuse a checkpoint that carries an extension this package does not implement, naming the tensor or file;
    the tensors `declared` by the config's network (Gemma 4's sandwich norms for a Gemma 4 drafter) are its own."""
    for name in sorted(set(checkpoint) - declared):
        for part, what in UNIMPLEMENTED_TENSORS:
            if part in name:
                raise CheckpointError(
                    f"{checkpoint[name].file}: tensor {name!r} is {what}, which dflash_jax does not implement; "
                    "running without it would run a different network"
                )
    override = os.path.join(where, MASK_EMBEDDING_FILE)
    if os.path.isfile(override):
        raise CheckpointError(
            f"{override}: a separately trained mask embedding (vLLM `_read_mask_embedding`), which dflash_jax does "
            "not implement; the mask token would be embedded with the target's row instead"
        )


def read_head_flags(config: DflashConfig, checkpoint: Checkpoint, prefix: str) -> DflashConfig:
    """The config with `confidence_head_with_markov` read off the confidence projection when the config is silent.

    SpecForge's DSpark exports may omit the flag (SpecForge's default is false) and ship a `[1, H]` projection;
    DeepSpec's and RadixArk's ship `[1, H + markov_rank]` (hidden state and Markov latent). The width decides.
    """
    name = f"{prefix}confidence_head.proj.weight"
    if config.confidence_head_with_markov is not None or not config.enable_confidence_head or name not in checkpoint:
        return config
    info = checkpoint[name]
    H, rank = config.hidden_size, config.markov_rank
    widths = {H: False, **({H + rank: True} if rank else {})}
    width = info.shape[-1] * (2 if info.dtype == "U8" else 1) if len(info.shape) == 2 else None  # U8: NVFP4 pairs
    if width not in widths:
        expected = " or ".join(f"[1, {w}] ({'with' if markov else 'without'} the Markov latent)"
                               for w, markov in widths.items())
        raise CheckpointError(
            f"{info.file}: tensor {name!r} has shape {list(info.shape)}; the config does not state "
            f"`confidence_head_with_markov`, so expected {expected}"
        )
    return replace(config, confidence_head_with_markov=widths[width])


def check_tensor(t: TensorPlan, checkpoint: Checkpoint, where: str) -> bool:
    """Check one planned tensor's presence, dtype and shape; return True when it is quantized (NVFP4-packed U8,
    or FP8 F8_E4M3 with a per-tensor scale)."""
    if t.name not in checkpoint:
        raise CheckpointError(f"{where}: missing tensor {t.name!r} (expected shape {list(t.shape)})")
    info = checkpoint[t.name]
    if t.kind == LINEAR and info.dtype == "U8":
        check_packed(checkpoint, t.name, t.shape)
        return True
    if t.kind == LINEAR and info.dtype == "F8_E4M3":
        check_fp8(checkpoint, t.name, t.shape)
        return True
    allowed = INT_DTYPES if t.kind == INT else WEIGHT_DTYPES
    if info.dtype not in allowed:
        raise CheckpointError(
            f"{info.file}: tensor {t.name!r} has dtype {info.dtype}, expected one of {', '.join(allowed)}"
            + (" (or U8 NVFP4-packed, or F8_E4M3 FP8)" if t.kind == LINEAR else "")
        )
    if info.shape != t.shape:
        raise CheckpointError(
            f"{info.file}: tensor {t.name!r} has shape {list(info.shape)}, expected {list(t.shape)} from the config"
        )
    return False


def check_tensors(plan: list[TensorPlan], checkpoint: Checkpoint, where: str,
                  problems: list[tuple[str, CheckpointError]] | None = None) -> frozenset[str]:
    """`check_tensor` on every planned tensor; returns the names of the quantized (NVFP4, FP8) ones. With `problems` (a
    list), each failure is appended as `(tensor name, error)` instead of raised, so that all are reported."""
    packed = set()
    for t in plan:
        try:
            if check_tensor(t, checkpoint, where):
                packed.add(t.name)
        except CheckpointError as e:
            if problems is None:
                raise
            problems.append((t.name, e))
    return frozenset(packed)


def warn_unexpected(where: str, plan: list[TensorPlan], checkpoint: Checkpoint, ignored: tuple[str, ...] = (),
                    stacklevel: int = 3) -> None:
    """Warn (once per load) about the checkpoint tensors the plan does not consume (`unexpected_tensors`, less
    `ignored`: names, and prefixes ending in "." for whole parts that are not the model loaded): a checkpoint of
    another configuration would otherwise load its matching part silently."""
    prefixes = tuple(n for n in ignored if n.endswith("."))
    extra = [n for n in unexpected_tensors(plan, checkpoint) if n not in ignored and not n.startswith(prefixes)]
    if extra:
        warnings.warn(f"{where}: {len(extra)} unexpected tensors ignored: {extra[:8]}", stacklevel=stacklevel)


def unexpected_tensors(plan: list[TensorPlan], checkpoint: Checkpoint) -> list[str]:
    """Checkpoint tensors the plan does not consume (NVFP4 companions and known extras excluded)."""
    used = {t.name for t in plan}
    used |= {c for t in plan if t.name.endswith(".weight") for c in nvfp4_companions(t.name)}
    return sorted(
        n for n in checkpoint
        if n not in used and not n.endswith(IGNORED_SUFFIXES) and n.split(".")[-1] not in IGNORED_NAMES
    )


def tensor_report(checkpoint: Checkpoint, failures: list[tuple[str, CheckpointError]]) -> dict[str, list[Any]]:
    """What `dflash-jax inspect` shows of an opened checkpoint whose plan was checked with `failures` collected
    (`check_tensors(..., problems=failures)`): `tensors` (name, dtype, shape, bytes, file; by name), `files`,
    `missing` and `malformed` (`(tensor name, message)`: absent from the checkpoint, or there but wrong)."""
    return {
        "tensors": [{"name": n, "dtype": checkpoint[n].dtype, "shape": list(checkpoint[n].shape),
                     "bytes": checkpoint[n].nbytes, "file": os.path.basename(checkpoint[n].file)}
                    for n in sorted(checkpoint)],
        "files": [os.path.basename(f) for f in checkpoint.files],
        "missing": [(n, str(e)) for n, e in failures if n not in checkpoint],
        "malformed": [(n, str(e)) for n, e in failures if n in checkpoint],
    }


# --------------------------------------------------------------------------------------------------------------
# Open, plan, check
# --------------------------------------------------------------------------------------------------------------


class CheckedPlan(NamedTuple):
    """A drafter checkpoint's plan whose headers passed every check."""

    checkpoint: Checkpoint  # open: tensors are read from it
    config: DflashConfig  # the config with `confidence_head_with_markov` read off the head (`read_head_flags`)
    plan: list[TensorPlan]
    packed: frozenset[str]  # the quantized weights among the planned tensors: NVFP4 (U8) or FP8 (F8_E4M3)


@contextlib.contextmanager
def open_checked(
    path: str, config: DflashConfig, *, problems: list[tuple[str, CheckpointError]] | None = None
) -> Iterator[CheckedPlan]:
    """Open the drafter checkpoint directory `path` (of `config`), plan it and check every planned tensor's header.

    Detects the layout prefix, refuses an extension this package does not implement, reads the head flags the
    config leaves unstated, plans (`plan_tensors`), checks each tensor (`check_tensors`; with `problems`, the
    per-tensor failures are collected there instead) and the export's NVFP4 declarations. Nothing is read but
    headers and small JSON files. The checkpoint stays open for the `with` block.
    """
    with Checkpoint(path) as checkpoint:
        prefix = find_prefix(checkpoint, path)
        declared = frozenset(prefix + s.name for s in expand(drafter_spec(config), config.num_hidden_layers))
        refuse_unimplemented(checkpoint, path, declared)
        config = read_head_flags(config, checkpoint, prefix)
        plan = plan_tensors(config, checkpoint.__contains__, prefix, path)
        packed = check_tensors(plan, checkpoint, path, problems)
        if packed:
            nvfp4 = {n for n in packed if checkpoint[n].dtype == "U8"}
            check_declared(declared_quantization(path, config), bool(nvfp4), len(nvfp4) < len(packed))
            if nvfp4:
                check_quant_config(path, config, nvfp4)
        yield CheckedPlan(checkpoint, config, plan, packed)

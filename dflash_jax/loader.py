"""`load_drafter`: a checkpoint directory (or hub id) in, a `Drafter` (config + replicated parameter pytree) out.

Loading runs in two phases, so that nothing is half-loaded:
1. Plan and check (`plan.open_checked`, then `check_and_place`'s value checks): from the config and the headers, decide
   which tensor fills which leaf of the tree and check presence, dtype and shape of every one (NVFP4 companions
   included), then the values headers cannot show (NaN/Inf in small tensors, NVFP4 scales, d2t). Any problem
   raises `CheckpointError` before anything is placed.
2. Place (`placement.place_all`): read each tensor from the memory map and put it straight onto its
   devices; NVFP4 tensors cross the host->device link packed and are dequantized there.

The tree mirrors the Hugging Face names (docs/design.md, docs/loading.md "Parameter tree").
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any, Literal, Unpack

import jax
import jax.numpy as jnp

from ._arguments import check_load_arguments
from ._config_file import read_config_json
from .config import DflashConfig, parse_config
from .drafter import Drafter
from .errors import ConfigError
from .hub import HubOptions, resolve
from .placement import WEIGHTS, auto_rules, auto_weights, place_all, target_sharding
from .plan import TensorPlan, build_tree, open_checked, warn_unexpected
from .platform import platform_of
from .safetensors import Checkpoint
from .spec import OWN_EMBED, OWN_HEAD
from .validate import check_d2t_present, check_tensor_values

__all__ = ["load_config", "load_drafter"]

log = logging.getLogger("dflash_jax")
EMBEDDINGS = ("own", "target")  # `load_drafter(embeddings=...)`: a shipped embedding / LM head used, or the target's
SHIPPED_HEADS = (OWN_EMBED, OWN_HEAD)  # the tree roots `embeddings="target"` leaves unread


def load_config(path: str | os.PathLike[str], **hub: Unpack[HubOptions]) -> DflashConfig:
    """Read a drafter config from a config.json file, a checkpoint directory or a Hugging Face hub id (`hub`:
    the keywords as transformers spells them, `dflash_jax.hub.resolve`)."""
    file, raw = read_config_json(resolve(path, **hub), "a drafter checkpoint directory", file_ok=True)
    return parse_config(raw, source=file)


def load_drafter(
    path: str | os.PathLike[str],
    *,
    mesh: jax.sharding.Mesh | None = None,
    dtype: jnp.dtype = jnp.bfloat16,
    progress: bool | None = None,
    weights: str = "auto",
    batch: int | None = None,
    embeddings: Literal["own", "target"] = "own",
    **hub: Unpack[HubOptions],
) -> Drafter:
    """Load a DFlash / DFlash2 / DSpark drafter checkpoint directory, or a Hugging Face hub id (`hub`:
    `revision`, `cache_dir`, `local_files_only`, `token` as transformers spells them, `dflash_jax.hub`; only
    what a load reads is downloaded).

    Every floating leaf is cast to `dtype`; `d2t` stays integer (int32). NVFP4 and FP8 linear weights are placed
    in the form `weights` names (docs/nvfp4.md "Weight forms"): "dequantized" (to `dtype`, on the device),
    "packed" (as stored: `nvfp4.Packed` / `fp8.Fp8` leaves computed in `dtype`), "fp8" (NVFP4 codes one E4M3
    byte each beside their scales, `nvfp4.Fp8Codes`; FP8 weights as `fp8.Fp8`), or "auto" (the default): the
    form the device's tuning entry measured fastest for `batch` sequences a step (default 1; `placement.auto_rules`:
    "dequantized" off a measured GPU or for a dtype other than bfloat16). The form placed is stated in the load's
    log line and in the drafter's repr (`Drafter.weights`). A checkpoint without quantized weights loads as it is
    (with "packed" or "fp8", said in one info line). With `mesh`, each leaf is
    replicated over it (`NamedSharding(mesh, P())`); without, it lands on the default device. Under a
    multi-process runtime each process reads and places only its own devices' copies. `progress`: a progress
    bar (None: only on a terminal). `embeddings`: a checkpoint that ships its own `embed_tokens` / `lm_head`
    (DeepSpec DSpark, NVIDIA's Nemotron drafters) drafts with them (`"own"`, what the families' authors run), or
    leaves them unread so the target's are attached (`"target"`, what SGLang runs for DeepSpec's DSpark drafters;
    docs/loading.md "Which embedding").

    Raises `ValueError` naming the argument for a `dtype` that is not bfloat16, float16 or float32 (float64
    with x64 enabled), a `weights` that is not one of the above, a `batch` that is not a positive int or is given
    with a form other than "auto", or a `mesh` that is not a non-empty `Mesh`, and `CheckpointError` /
    `ConfigError` for bad files, including a checkpoint larger than a device's free memory; then nothing has been
    placed.
    """
    dtype = check_load_arguments("load_drafter", dtype, mesh)
    if weights not in WEIGHTS:
        raise ValueError(f"load_drafter: weights={weights!r}; expected one of {', '.join(map(repr, WEIGHTS))}")
    if batch is not None and (weights != "auto" or isinstance(batch, bool) or not isinstance(batch, int)
                              or batch < 1):
        raise ValueError(f"load_drafter: batch={batch!r}; expected a positive int, the batch that "
                         f"weights='auto' chooses a form for" + ("" if weights == "auto" else
                                                                 f" (weights={weights!r} chooses none)"))
    if embeddings not in EMBEDDINGS:
        raise ValueError(f"load_drafter: embeddings={embeddings!r}; expected one of "
                         f"{', '.join(map(repr, EMBEDDINGS))}")
    platform = platform_of(target_sharding(mesh))  # where the leaves go: its tuning entry chooses for "auto"
    form = auto_weights(platform, dtype, batch or 1) if weights == "auto" else weights
    path = resolve(path, **hub)
    if os.path.isfile(path):  # a config.json (or another file) would be opened as a safetensors file
        raise ConfigError(f"{path}: a file, not a directory; load_drafter expected the checkpoint directory "
                          "holding config.json and the *.safetensors files (or a hub id)")
    with open_checked(path, load_config(path)) as checked:
        checkpoint, config, plan, packed = checked
        check_d2t_present(config, plan, checkpoint)
        shipped = [t.name for t in plan if t.path[0] in SHIPPED_HEADS] if embeddings == "target" else []
        plan = [t for t in plan if t.name not in shipped]
        packed = packed - frozenset(shipped)
        if weights in ("packed", "fp8") and not packed:
            log.info("%s: weights=%r but the checkpoint has no NVFP4 or FP8 weights; loaded as stored", path, weights)
        leaves = check_and_place(path, plan, checkpoint, packed, vocab_size=config.vocab_size, mesh=mesh, dtype=dtype,
                                 progress=progress, weights=form,
                                 ignored=tuple(name.removesuffix("weight") for name in shipped))
    params = build_tree(plan, leaves)
    chosen = None if not packed else f"{form} (auto, batch {batch or 1})" if weights == "auto" else form
    why = f"weights='auto' for batch {batch or 1}: {auto_rules(platform, dtype)[1]}" if weights == "auto" else None
    log.info("%s", summary(config, params, packed, checkpoint_path=path, weights=form, why=why))
    return Drafter(params=params, config=config, weights=chosen)


def check_and_place(
    where: str,
    plan: list[TensorPlan],
    checkpoint: Checkpoint,
    packed: frozenset[str],
    *,
    vocab_size: int,
    mesh: jax.sharding.Mesh | None,
    dtype: jnp.dtype,
    progress: bool | None,
    shardings: Sequence[jax.sharding.Sharding] | None = None,
    weights: str = "dequantized",
    ignored: tuple[str, ...] = (),
) -> list[Any]:
    """The second half of every load, drafter or target, once the plan's headers passed (`plan.check_tensors`):
    the values headers cannot show (`validate.check_tensor_values`: NaN/Inf in norm gains and biases, NVFP4 and
    FP8 scales within `dtype`, `d2t`'s range into `vocab_size`), a warning naming the tensors the plan does not use
    (less `ignored`, `plan.warn_unexpected`), then the leaves placed (`placement.place_all`). A failed check
    raises `CheckpointError` before anything is placed."""
    check_tensor_values(plan, checkpoint, packed, dtype, vocab_size)
    warn_unexpected(where, plan, checkpoint, ignored, stacklevel=4)
    return place_all(plan, checkpoint, packed, mesh=mesh, dtype=dtype, progress=progress, shardings=shardings,
                     weights=weights)


def summary(config: DflashConfig, params: dict[str, Any], packed: frozenset[str], *, checkpoint_path: str,
            weights: str = "dequantized", why: str | None = None) -> str:
    """The one-line load summary: layers, hidden, vocab, block size, target layers, family, heads, and the form
    the quantized tensors were placed in (`weights`; `why`: what chose it)."""
    heads: list[str] = [
        h for h in ("candidate_selector", "markov_head", "confidence_head", "embed_tokens", "lm_head", "d2t")
        if h in params]
    if "attention_conv" in params["layers"][0]:
        heads.insert(0, "convs")
    return (
        f"{checkpoint_path}: {config.family} drafter, {len(params['layers'])} layers, "
        f"hidden={config.hidden_size}, vocab={config.vocab_size}, block={config.effective_block_size} "
        f"({config.num_draft_tokens} drafts/step), target_layers={list(config.checked_target_layer_ids)}, "
        f"heads=[{', '.join(heads) or 'none'}]"
        + (f", {len(packed)} quantized tensors placed {weights}{f' ({why})' if why else ''}, input_scale ignored"
           if packed else "")
    )

"""`load_drafter`: a checkpoint directory in, a `Drafter` (config + replicated parameter pytree) out.

Loading runs in two phases, so that nothing is half-loaded:
1. Plan (`plan_tensors`): from the config and the headers alone, decide which tensor fills which leaf of
   the tree, with its expected shape; check presence, dtype and shape of every one (NVFP4 companions
   included). Any problem raises `CheckpointError` before a byte of tensor data is read.
2. Place (`placement.place_all`): read each tensor from the memory map and put it straight onto its
   devices; NVFP4 tensors cross the host->device link packed and are dequantized there.

The tree mirrors the Hugging Face names (docs/design.md, README "Parameter tree").
"""

from __future__ import annotations

import dataclasses
import logging
import os
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import msgspec

from .config import DflashConfig, load_config
from .errors import CheckpointError
from .safetensors import Checkpoint
from .validate import check_values

log = logging.getLogger("dflash_jax")

FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")
INT_DTYPES = ("I64", "I32", "I16", "I8", "U64", "U32", "U16", "U8")
# Tensors a checkpoint may carry that the drafter does not use; not worth a warning.
IGNORED_SUFFIXES = (".input_scale", ".k_scale", ".v_scale", ".pre_quant_scale")
IGNORED_NAMES = ("t2d",)
# Tensors (by name part) of extensions this package does not implement: loading the rest of such a checkpoint
# would run a different network from the one trained, so they are refused, not warned about (docs/references.md).
UNIMPLEMENTED_TENSORS = (
    ("attention_sink_bias", "a learned per-head attention sink (MiMo-style; vLLM qwen3_dflash.py)"),
    ("markov_head.gate_proj.", "a gated Markov head (SpecForge / DeepSpec `markov_head_type: gated`)"),
    ("markov_head.joint_proj.", "an RNN Markov head (SpecForge / DeepSpec `markov_head_type: rnn`)"),
    ("mask_embedding", "a separately trained mask embedding (vLLM `_read_mask_embedding`)"),
)
MASK_EMBEDDING_FILE = "mask_embedding.pt"  # vLLM's override of the mask token's embedding row (MiMo)


@dataclasses.dataclass(frozen=True)
class TensorPlan:
    """One leaf to load: which checkpoint tensor, where it goes in the tree, what it must look like."""

    path: tuple[str | int, ...]  # position in the tree, e.g. ("layers", 0, "mlp", "up_proj", "weight")
    name: str  # checkpoint tensor name (prefix included)
    shape: tuple[int, ...]  # expected logical shape
    kind: str  # "float" (norms, codebooks), "linear" (float or NVFP4-packed), "int" (d2t)
    axes: tuple[str | None, ...] = ()  # logical axis per dimension (a target's tensor-parallel plan); (): none


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Drafter:
    """A loaded drafter: `config` (static), `params` (docs/design.md tree) and the target's attached
    `embed` / `lm_head` ([V, H], HF layout) when the drafter does not ship its own.

    A pytree: pass it whole through `jax.jit`; the config is static metadata.
    """

    params: dict[str, Any]
    embed: jax.Array | None = None
    lm_head: jax.Array | None = None
    config: DflashConfig = dataclasses.field(default=None, metadata=dict(static=True))

    def attach(self, *, embed: jax.Array | None = None, lm_head: jax.Array | None = None) -> Drafter:
        """Return a drafter that uses the target's embedding / LM head (HF layout, [V, H])."""
        H = self.config.hidden_size
        for what, value in (("embed", embed), ("lm_head", lm_head)):
            if value is not None and (value.ndim != 2 or value.shape[1] != H):
                raise ValueError(f"attach: {what} has shape {value.shape}, expected [vocab, {H}]")
        return dataclasses.replace(
            self,
            embed=self.embed if embed is None else embed,
            lm_head=self.lm_head if lm_head is None else lm_head,
        )

    @property
    def embedding(self) -> jax.Array:
        """The embedding the block is embedded with: the drafter's own, else the attached target's."""
        own = self.params.get("embed_tokens")
        if own is not None:
            return own["weight"]
        if self.embed is None:
            raise ValueError("this drafter ships no embed_tokens: attach the target's with drafter.attach(embed=...)")
        return self.embed

    @property
    def output_head(self) -> jax.Array:
        """The LM head [V, H]: the drafter's own, else the attached target's."""
        own = self.params.get("lm_head")
        if own is not None:
            return own["weight"]
        if self.lm_head is None:
            raise ValueError("this drafter ships no lm_head: attach the target's with drafter.attach(lm_head=...)")
        return self.lm_head


def draft_to_target_ids(draft_ids: jax.Array, d2t: jax.Array | None) -> jax.Array:
    """Map draft-vocabulary ids to target ids: `target = draft + d2t[draft]` (identity without d2t)."""
    if d2t is None:
        return draft_ids
    return draft_ids + jnp.take(d2t, draft_ids, axis=0).astype(draft_ids.dtype)


def find_prefix(checkpoint: Checkpoint, where: str) -> str:
    """`""` or `"model."`: the layout of the checkpoint, detected by its `fc.weight`."""
    names = set(checkpoint)
    if any(n.startswith(("midlayer.", "model.midlayer.")) for n in names):  # EAGLE-3 has an fc.weight too
        raise CheckpointError(
            f"{where}: tensors `midlayer.*`: this is an EAGLE-3 drafter, not a DFlash-family drafter; "
            "expected `fc.weight` with `layers.*`"
        )
    if "fc.weight" in checkpoint:
        return ""
    if "model.fc.weight" in checkpoint:
        return "model."
    if "model.embed_tokens.weight" in names or "lm_head.weight" in names:
        what = "a full language model (it has embed_tokens/lm_head but no fc)"
    else:
        what = f"a checkpoint of {len(names)} tensors without one"
    raise CheckpointError(
        f"{where}: no `fc.weight` or `model.fc.weight`: this is {what}; expected a DFlash-family drafter"
    )


def plan_tensors(
    config: DflashConfig, contains: Callable[[str], bool], prefix: str = "", where: str = "<checkpoint>"
) -> list[TensorPlan]:
    """Decide which tensors make up this drafter. `contains(name)` says whether the checkpoint has a tensor:
    optional parts (DFlash2 convs and selector, DSpark heads, d2t, own embeddings) are loaded when the
    config declares them and the checkpoint carries them, as the reference loaders do."""
    c, p, checkpoint = config, prefix, _Names(contains)
    H, I, d_h = c.hidden_size, c.intermediate_size, c.head_dim
    q_dim, kv_dim = c.num_attention_heads * d_h, c.num_key_value_heads * d_h
    draft_vocab = c.draft_vocab_size or c.vocab_size
    plan: list[TensorPlan] = []

    def add(name: str, shape: tuple[int, ...], kind: str = "float", path: tuple | None = None) -> None:
        plan.append(TensorPlan(path or _tree_path(name), p + name, shape, kind))

    add("fc.weight", (H, len(c.target_layer_ids) * H), "linear")
    add("hidden_norm.weight", (H,))
    add("norm.weight", (H,))
    sub = c.dflash_config
    has_conv = bool(sub and sub.conv_kernel_size and sub.conv_group_size) and (
        f"{p}layers.0.attention_conv.base_kernel" in checkpoint
    )
    for i in range(c.num_hidden_layers):
        layer = f"layers.{i}."
        add(layer + "input_layernorm.weight", (H,))
        add(layer + "post_attention_layernorm.weight", (H,))
        for proj, (out_dim, in_dim) in {
            "q_proj": (q_dim, H), "k_proj": (kv_dim, H), "v_proj": (kv_dim, H), "o_proj": (H, q_dim),
        }.items():
            add(f"{layer}self_attn.{proj}.weight", (out_dim, in_dim), "linear")
            if c.attention_bias:
                add(f"{layer}self_attn.{proj}.bias", (out_dim,))
        add(layer + "self_attn.q_norm.weight", (d_h,))
        add(layer + "self_attn.k_norm.weight", (d_h,))
        for proj, shape in {"gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}.items():
            add(f"{layer}mlp.{proj}.weight", shape, "linear")
        if has_conv:
            taps, groups = sub.conv_kernel_size, H // sub.conv_group_size
            for conv in ("attention_conv", "mlp_conv"):
                add(f"{layer}{conv}.base_kernel", (2, taps, H))
                add(f"{layer}{conv}.kernel_projection.weight", (2 * taps * groups, H), "linear")

    if sub and sub.selector_rank and sub.selector_top_k and f"{p}candidate_selector.predecessor_codebook" in checkpoint:
        r = sub.selector_rank
        add("candidate_selector.predecessor_codebook", (draft_vocab, r))
        add("candidate_selector.successor_codebook", (draft_vocab, r))
        add("candidate_selector.hidden_projection.weight", (r, H), "linear")

    rank = c.markov_rank
    if rank and f"{p}markov_head.markov_w1.weight" in checkpoint:
        add("markov_head.markov_w1.weight", (draft_vocab, rank))
        add("markov_head.markov_w2.weight", (draft_vocab, rank), "linear")
    elif rank:
        warnings.warn(
            f"{where}: config declares markov_rank={rank} but the checkpoint has no "
            f"{p}markov_head.markov_w1.weight; drafting without the Markov bias",
            stacklevel=3,
        )
    if c.enable_confidence_head and f"{p}confidence_head.proj.weight" in checkpoint:
        # unstated (None): the Markov-conditioned head DeepSpec and SGLang ship; `load_drafter` reads the flag first
        width = H + (rank if c.confidence_head_with_markov is not False and rank else 0)
        add("confidence_head.proj.weight", (1, width), "linear")
        add("confidence_head.proj.bias", (1,))
    elif c.enable_confidence_head:
        warnings.warn(
            f"{where}: config enables the confidence head but the checkpoint has no "
            f"{p}confidence_head.proj.weight; proposals will not be cut by confidence",
            stacklevel=3,
        )

    for d2t in ("d2t", "draft_id_to_target_id"):
        if p + d2t in checkpoint:
            add(d2t, (draft_vocab,), "int", path=("d2t",))
            break
    for own, rows, kind in (("embed_tokens.weight", c.vocab_size, "float"), ("lm_head.weight", draft_vocab, "linear")):
        for name in (p + own, own):  # DeepSpec puts lm_head at the root even beside model.*
            if name in checkpoint:
                plan.append(TensorPlan(_tree_path(own), name, (rows, H), kind))
                break
    return plan


class _Names:
    """`name in _Names(contains)`: lets the plan read like a membership test on the checkpoint."""

    def __init__(self, contains: Callable[[str], bool]):
        self.contains = contains

    def __contains__(self, name: str) -> bool:
        return self.contains(name)


def _tree_path(name: str) -> tuple[str | int, ...]:
    parts = name.split(".")
    return tuple(int(x) if x.isdigit() else x for x in parts)


def nvfp4_companions(name: str) -> tuple[str, str]:
    """The block-scale and global-scale tensors ModelOpt stores beside a packed `<m>.weight`."""
    stem = name.removesuffix(".weight")
    return stem + ".weight_scale", stem + ".weight_scale_2"


def unexpected_tensors(plan: list[TensorPlan], checkpoint: Checkpoint) -> list[str]:
    """Checkpoint tensors the plan does not consume (NVFP4 companions and known extras excluded)."""
    used = {t.name for t in plan}
    used |= {c for t in plan if t.name.endswith(".weight") for c in nvfp4_companions(t.name)}
    return sorted(
        n for n in checkpoint
        if n not in used and not n.endswith(IGNORED_SUFFIXES) and n.split(".")[-1] not in IGNORED_NAMES
    )


def refuse_unimplemented(checkpoint: Checkpoint, where: str) -> None:
    """Refuse a checkpoint that carries an extension this package does not implement, naming the tensor or file."""
    for name in sorted(checkpoint):
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


def read_head_flags(config: DflashConfig, checkpoint: Checkpoint, prefix: str, where: str) -> DflashConfig:
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
    return msgspec.structs.replace(config, confidence_head_with_markov=widths[width])


def check_tensor(t: TensorPlan, checkpoint: Checkpoint, where: str) -> bool:
    """Check one planned tensor's presence, dtype and shape; return True when it is NVFP4-packed."""
    if t.name not in checkpoint:
        raise CheckpointError(f"{where}: missing tensor {t.name!r} (expected shape {list(t.shape)})")
    info = checkpoint[t.name]
    if t.kind == "linear" and info.dtype == "U8":
        from .nvfp4.checkpoint import check_packed  # imported here: the BF16 path needs no NVFP4 code

        check_packed(checkpoint, t.name, t.shape)
        return True
    allowed = INT_DTYPES if t.kind == "int" else FLOAT_DTYPES
    if info.dtype not in allowed:
        raise CheckpointError(
            f"{info.file}: tensor {t.name!r} has dtype {info.dtype}, expected one of {', '.join(allowed)}"
            + (" (or U8 NVFP4-packed)" if t.kind == "linear" else "")
        )
    if info.shape != t.shape:
        raise CheckpointError(
            f"{info.file}: tensor {t.name!r} has shape {list(info.shape)}, expected {list(t.shape)} from the config"
        )
    return False


def load_drafter(
    path: str | os.PathLike[str],
    *,
    mesh: jax.sharding.Mesh | None = None,
    dtype: jnp.dtype = jnp.bfloat16,
    progress: bool | None = None,
    revision: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    local_files_only: bool = False,
    token: str | bool | None = None,
) -> Drafter:
    """Load a DFlash / DFlash2 / DSpark drafter checkpoint directory, or a Hugging Face hub id (`dflash_jax.hub`:
    `revision`, `cache_dir`, `local_files_only`, `token` as transformers spells them; only what a load reads
    is downloaded).

    Every floating leaf is cast to `dtype` (NVFP4 tensors are dequantized to it on the device); `d2t`
    stays integer (int32). With `mesh`, each leaf is replicated over it (`NamedSharding(mesh, P())`);
    without, it lands on the default device. Under a multi-process runtime each process reads and places
    only its own devices' copies. `progress`: a progress bar (None: only on a terminal).

    Raises `ValueError` naming the argument for a `dtype` that is not bfloat16, float16 or float32 (float64
    with x64 enabled) or a `mesh` that is not a non-empty `Mesh`, and `CheckpointError` / `ConfigError` for
    bad files, including a checkpoint larger than a device's free memory; then nothing has been placed.
    """
    from .hub import resolve
    from .placement import place_all

    dtype = check_load_arguments(dtype, mesh)
    path = resolve(path, revision=revision, cache_dir=cache_dir, local_files_only=local_files_only, token=token)
    config = load_config(path)
    with Checkpoint(path) as checkpoint:
        prefix = find_prefix(checkpoint, path)
        refuse_unimplemented(checkpoint, path)
        config = read_head_flags(config, checkpoint, prefix, path)
        plan = plan_tensors(config, checkpoint.__contains__, prefix, path)
        packed = {t.name for t in plan if check_tensor(t, checkpoint, path)}
        if packed:
            from .nvfp4.checkpoint import check_quant_config

            check_quant_config(path, config, packed)
        check_values(config, plan, checkpoint, packed, dtype)  # NaN/Inf, NVFP4 scales, d2t: before placing
        extra = unexpected_tensors(plan, checkpoint)
        if extra:
            warnings.warn(f"{path}: {len(extra)} unexpected tensors ignored: {extra[:8]}", stacklevel=2)
        leaves = place_all(plan, checkpoint, packed, mesh=mesh, dtype=dtype, progress=progress)
    params = build_tree(plan, leaves)
    log.info("%s", summary(config, params, packed, checkpoint_path=path))
    return Drafter(params=params, config=config)


def check_load_arguments(dtype: Any, mesh: Any) -> jnp.dtype:
    """The load dtype as a `jnp.dtype`, after refusing what would load silently wrong: an integer dtype
    (all-zero weights), float8 (weights rounded to 3 mantissa bits), float64 without x64 (JAX gives float32),
    and a mesh that is not a `jax.sharding.Mesh` or has no devices. Raises `ValueError` naming the argument."""
    allowed = [jnp.bfloat16, jnp.float16, jnp.float32] + ([jnp.float64] if jax.config.jax_enable_x64 else [])
    names = ", ".join(jnp.dtype(d).name for d in allowed)
    try:
        resolved = jnp.dtype(dtype)
    except TypeError:
        raise ValueError(f"load_drafter: dtype={dtype!r} is not a dtype; expected one of {names}") from None
    if resolved not in [jnp.dtype(d) for d in allowed]:
        raise ValueError(f"load_drafter: dtype={resolved.name} cannot hold the weights; expected one of {names}")
    if mesh is not None and not isinstance(mesh, jax.sharding.Mesh):
        raise ValueError(f"load_drafter: mesh is a {type(mesh).__name__}; expected a jax.sharding.Mesh or None")
    if mesh is not None and mesh.devices.size == 0:
        raise ValueError("load_drafter: mesh has no devices; expected a jax.sharding.Mesh of at least one device")
    return resolved


def build_tree(plan: list[TensorPlan], leaves: list[jax.Array]) -> dict[str, Any]:
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


def summary(config: DflashConfig, params: dict[str, Any], packed: set[str], *, checkpoint_path: str) -> str:
    """The one-line load summary: layers, hidden, vocab, block size, target layers, family, heads."""
    heads = [h for h in ("candidate_selector", "markov_head", "confidence_head", "embed_tokens", "lm_head", "d2t")
             if h in params]
    if "attention_conv" in params["layers"][0]:
        heads.insert(0, "convs")
    return (
        f"{checkpoint_path}: {config.family} drafter, {len(params['layers'])} layers, "
        f"hidden={config.hidden_size}, vocab={config.vocab_size}, block={config.effective_block_size} "
        f"({config.num_draft_tokens} drafts/step), target_layers={list(config.target_layer_ids)}, "
        f"heads=[{', '.join(heads) or 'none'}]"
        + (f", {len(packed)} NVFP4 tensors dequantized (input_scale ignored)" if packed else "")
    )

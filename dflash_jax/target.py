"""The target side of speculative decoding: a `Target` protocol and `DecoderTarget`, a dense decoder in JAX
(Qwen3 and Llama 3.x: one forward, the architectures differing only in their config class).

`load_target(path, mesh=..., tensor_axis="model")` reads config.json's `architectures` (`Qwen3ForCausalLM`,
`LlamaForCausalLM`; anything else is refused by name) and loads the checkpoint (config.json + safetensors,
sharded or not) with the package's header-first reader; `Qwen3Target.from_pretrained(path)` does the same for a
Qwen3 directory only. The forward runs the new tokens of each sequence against a static-shape KV cache and
returns, besides the final hidden states, the target features a DFlash-family drafter reads:

    feature l = transformers' hidden_states[l + 1]   the output of decoder layer l, for 0 <= l < N - 1
    feature N - 1 = hidden_states[N]                 the LAST layer's output AFTER the final norm
    feature -1 = hidden_states[0]                    the embedding output (DeepSpec)

concatenated shallow-to-deep in `layer_ids` order: `[batch, S, Lf * H]`.

KV cache: `KVCache(k, v)`, per layer `[batch, n_kv, T, d_h]`; slot t holds position t. The cache itself carries
no length: the caller keeps `lengths [batch]` (tokens committed per sequence). A forward over `S` new tokens
attends to slots `[0, lengths)` (only those are read: `attention.Span`) and causally among the new rows, then
writes their K/V at slots `lengths .. lengths + S - 1`, so slots beyond a sequence's length are never read:
trimming the cache to an accepted prefix is just passing a smaller length next time (the rejected slots are
overwritten). Sequences of a batch may have different lengths; prompts of different lengths are right-padded.
`prefill` runs a long prompt in chunks and returns only the last token's logits.

Tensor parallelism (Megatron-style, through jax.sharding): every parameter is declared once with logical axes
(`parameter_spec`); a `Layout` maps them onto a mesh: q/k/v and gate/up split by output, o and down by input,
KV heads split (replicated where the tensor axis is larger than `num_key_value_heads`), embedding and LM head
split over the vocabulary, the cache by KV heads; the other mesh axes split the batch. GSPMD inserts the
collectives (an all-reduce after o and down; the vocabulary-sharded embedding lookup and LM head are a local
gather / matmul plus a reduction, never a gathered table); attention runs per device under `shard_map`.

Parameter tree (`DecoderTarget.params`): HF names with `model.` stripped, as the drafter's (docs/design.md);
`params["layers"]` is a tuple of per-layer dicts (each weight its own buffer, as placed), run unrolled, every
matmul reading its weights in place.

One decoder layer serves the drafter and the targets (`model.decoder_layer`, `model.queries` /
`model.keys_values`, `attention.attend`: GQA, float32 online softmax).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
from typing import Any, ClassVar, Protocol, TypeVar, Unpack, overload, runtime_checkable

import jax
import jax.numpy as jnp
import msgspec
from jax.sharding import NamedSharding, PartitionSpec

from .attention import KeyValues, LayerRule, Span, attend, causal_self_attention, span_capacity, use_cudnn
from .config import (
    MAX_CONFIG_BYTES,
    Dim,
    LayerCount,
    PositiveFloat,
    RopeScaling,
    RopeTheta,
    declared_rope_type,
    normalise_raw,
)
from .errors import CheckpointError, ConfigError
from .hub import HubOptions, resolve
from .model import decoder_layer, keys_values, lm_logits, queries, rms_norm, rope_tables
from .placement import auto_mesh, place_all
from .plan import TensorPlan, build_tree, check_tensors, planned
from .safetensors import Checkpoint, read_json
from .spec import BATCH, EMBED, HEADS, KV_HEADS, MLP, NORM, VOCAB, Bias, Gain, ParamSpec, expand

log = logging.getLogger("dflash_jax")

PREFILL_CHUNK = 2048  # prompt tokens per prefill step (`DecoderTarget.prefill`)

Params = dict[str, Any]


# --------------------------------------------------------------------------------------------------------------
# The protocol the speculative loop needs
# --------------------------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------------------------
# Configs: one decoder, a small difference per architecture
# --------------------------------------------------------------------------------------------------------------


class DecoderConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """The fields of a Hugging Face decoder `config.json` the forward reads (defaults: transformers' Qwen3Config).

    Frozen and hashable: a static `jax.jit` argument. A `config.RopeConfig`, as the drafter's config is (what
    `model.rope_frequencies` reads). The architectures differ only in the class constants: `MODEL_TYPE`,
    `QK_NORM` (per-head q/k RMSNorm) and `ROPE_TYPES`. `head_dim` and `num_key_value_heads` are read through
    properties that resolve what the file leaves unstated, as transformers does (`stated_*`: as stated).
    """

    MODEL_TYPE: ClassVar[str] = ""
    QK_NORM: ClassVar[bool] = True
    ROPE_TYPES: ClassVar[tuple[str, ...]] = ("default",)

    vocab_size: Dim = 151936
    hidden_size: Dim = 4096
    intermediate_size: Dim = 22016
    num_hidden_layers: LayerCount = 32
    num_attention_heads: Dim = 32
    stated_num_key_value_heads: Dim | None = msgspec.field(default=32, name="num_key_value_heads")
    stated_head_dim: Dim | None = msgspec.field(default=128, name="head_dim")
    hidden_act: str = "silu"
    max_position_embeddings: Dim = 32768
    rms_norm_eps: PositiveFloat = 1e-6
    tie_word_embeddings: bool = False
    rope_theta: RopeTheta = 10000.0
    rope_scaling: RopeScaling | None = None
    attention_bias: bool = False
    mlp_bias: bool = False
    use_sliding_window: bool = False
    eos_token_id: int | tuple[int, ...] | None = None
    model_type: str | None = None
    architectures: tuple[str, ...] = ()

    @property
    def head_dim(self) -> int:
        """As stated, else `hidden_size // num_attention_heads`."""
        return self.stated_head_dim or self.hidden_size // self.num_attention_heads

    @property
    def num_key_value_heads(self) -> int:
        """As stated, else `num_attention_heads` (multi-head attention)."""
        return self.stated_num_key_value_heads or self.num_attention_heads

    @property
    def rope_type(self) -> str:
        declared = declared_rope_type(self.rope_scaling)
        return declared if declared in self.ROPE_TYPES else "default"

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """`eos_token_id` as a tuple (configs state one id or a list)."""
        eos = self.eos_token_id
        return () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)


class Qwen3Config(DecoderConfig, frozen=True, forbid_unknown_fields=False):
    """Qwen3 (dense): per-head q/k norm, default or YaRN RoPE."""

    MODEL_TYPE: ClassVar[str] = "qwen3"
    QK_NORM: ClassVar[bool] = True
    ROPE_TYPES: ClassVar[tuple[str, ...]] = ("default", "yarn")


class LlamaConfig(DecoderConfig, frozen=True, forbid_unknown_fields=False):
    """Llama (3.x): no q/k norm, default or `llama3` RoPE, `head_dim` from the hidden size when unstated."""

    MODEL_TYPE: ClassVar[str] = "llama"
    QK_NORM: ClassVar[bool] = False
    ROPE_TYPES: ClassVar[tuple[str, ...]] = ("default", "llama3")

    stated_head_dim: Dim | None = msgspec.field(default=None, name="head_dim")
    intermediate_size: Dim = 11008
    stated_num_key_value_heads: Dim | None = msgspec.field(default=None, name="num_key_value_heads")
    max_position_embeddings: Dim = 2048
    vocab_size: Dim = 32000


ARCHITECTURES: dict[str, type[DecoderConfig]] = {"Qwen3ForCausalLM": Qwen3Config, "LlamaForCausalLM": LlamaConfig}


C = TypeVar("C", bound=DecoderConfig)


def parse_decoder_config(raw: dict[str, Any], kind: type[C], *, source: str = "<config>") -> C:
    """Decode a config dict as `kind` (transformers 4 `rope_theta`/`rope_scaling` or 5 `rope_parameters` layout)."""
    try:
        config = msgspec.convert(normalise_raw(raw, source), kind)
    except msgspec.ValidationError as e:
        raise ConfigError(f"{source}: {e}") from None
    problems = []
    if config.model_type not in (None, kind.MODEL_TYPE):
        problems.append(f"model_type is {config.model_type!r}, expected {kind.MODEL_TYPE!r}")
    if config.hidden_act != "silu":
        problems.append(f"hidden_act is {config.hidden_act!r}; only 'silu' (SwiGLU) is implemented")
    if config.num_attention_heads % config.num_key_value_heads:
        problems.append(
            f"num_attention_heads={config.num_attention_heads} is not a multiple of "
            f"num_key_value_heads={config.num_key_value_heads}"
        )
    if config.use_sliding_window:
        problems.append("use_sliding_window=true is not implemented (released dense models leave it off)")
    declared = declared_rope_type(config.rope_scaling)
    if declared not in kind.ROPE_TYPES:
        problems.append(f"rope type {declared!r}; only {' and '.join(kind.ROPE_TYPES)} are implemented")
    s = config.rope_scaling
    if declared == "llama3" and s is not None:  # declared only by a rope_scaling block
        absent = [f for f in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
                  if getattr(s, f) is None]
        low, high = s.low_freq_factor, s.high_freq_factor
        if absent:
            problems.append(f"rope type 'llama3' needs {', '.join(absent)} in rope_scaling / rope_parameters")
        elif low is not None and high is not None and low >= high:  # both stated: not absent
            problems.append(f"llama3 RoPE: low_freq_factor={low} must be below high_freq_factor={high}")
    if problems:
        raise ConfigError(f"{source}: " + "; ".join(problems))
    return config


def parse_qwen3_config(raw: dict[str, Any], *, source: str = "<config>") -> Qwen3Config:
    """Decode a Qwen3 config dict."""
    return parse_decoder_config(raw, Qwen3Config, source=source)


def read_config_json(path: str | os.PathLike[str]) -> tuple[str, dict[str, Any]]:
    """`(file, raw dict)` of a checkpoint directory's config.json."""
    file = os.path.join(os.fspath(path), "config.json")
    if not os.path.lexists(file):
        raise ConfigError(f"{path}: no config.json; expected a Hugging Face checkpoint directory")
    try:  # a regular file of bounded size (a FIFO would block forever), UTF-8, duplicate keys refused
        raw = read_json(file, "config.json", MAX_CONFIG_BYTES)
    except CheckpointError as e:
        raise ConfigError(str(e)) from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{file}: expected a JSON object at the top level")
    return file, raw


@overload
def load_decoder_config(path: str | os.PathLike[str], kind: type[C]) -> C: ...
@overload
def load_decoder_config(path: str | os.PathLike[str], kind: None = None) -> DecoderConfig: ...
def load_decoder_config(path: str | os.PathLike[str], kind: type[DecoderConfig] | None = None) -> DecoderConfig:
    """Read `config.json` as `kind`, or (None) as the architecture its `architectures` names."""
    file, raw = read_config_json(path)
    if kind is None:
        names = raw.get("architectures")
        names = [a for a in names if isinstance(a, str)] if isinstance(names, list) else []
        known = [ARCHITECTURES[a] for a in names if a in ARCHITECTURES]
        if not known:
            raise ConfigError(
                f"{file}: architectures {names or 'missing'}: not a target dflash_jax runs; expected one of "
                f"{', '.join(ARCHITECTURES)}"
            )
        kind = known[0]
    return parse_decoder_config(raw, kind, source=file)


def load_qwen3_config(path: str | os.PathLike[str]) -> Qwen3Config:
    """Read `config.json` from a Qwen3 checkpoint directory."""
    return load_decoder_config(path, Qwen3Config)


# --------------------------------------------------------------------------------------------------------------
# The parameters, declared once: shapes and logical axes
# --------------------------------------------------------------------------------------------------------------

def parameter_spec(c: DecoderConfig) -> list[ParamSpec]:
    """The tensors of a checkpoint of `c` (`spec.ParamSpec`; `{i}`: the layer), with their logical axes.

    Megatron-style axes: q/k/v and gate/up split by output (`HEADS` / `KV_HEADS` / `MLP` on dim 0), o and down by
    input (dim 1), embedding and LM head by the vocabulary; norms and the residual width (`EMBED`) replicated.
    `lm_head.weight` only when untied (a tied checkpoint may carry a copy: ignored, as transformers does).
    """
    H, I, d_h = c.hidden_size, c.intermediate_size, c.head_dim
    q_dim, kv_dim = c.num_attention_heads * d_h, c.num_key_value_heads * d_h
    gain_init = Gain()

    def norm(name: str, shape: tuple[int, ...], axes: tuple[str | None, ...]) -> ParamSpec:
        return ParamSpec(name, shape, kind=NORM, axes=axes, init=gain_init)

    bias_init = Bias()

    def bias(name: str, shape: tuple[int, ...], axes: tuple[str | None, ...]) -> ParamSpec:
        return ParamSpec(name, shape, axes=axes, init=bias_init)

    attn, mlp = "model.layers.{i}.self_attn.", "model.layers.{i}.mlp."
    specs = [ParamSpec("model.embed_tokens.weight", (c.vocab_size, H), axes=(VOCAB, EMBED)),
             norm("model.norm.weight", (H,), (EMBED,))]
    if not c.tie_word_embeddings:
        specs.append(ParamSpec("lm_head.weight", (c.vocab_size, H), axes=(VOCAB, EMBED)))
    # Targets load unquantized checkpoints: their matrices are `spec.FLOAT`, never `LINEAR` (NVFP4-packed).
    specs += [
        norm("model.layers.{i}.input_layernorm.weight", (H,), (EMBED,)),
        norm("model.layers.{i}.post_attention_layernorm.weight", (H,), (EMBED,)),
        ParamSpec(attn + "q_proj.weight", (q_dim, H), axes=(HEADS, EMBED)),
        ParamSpec(attn + "k_proj.weight", (kv_dim, H), axes=(KV_HEADS, EMBED)),
        ParamSpec(attn + "v_proj.weight", (kv_dim, H), axes=(KV_HEADS, EMBED)),
        ParamSpec(attn + "o_proj.weight", (H, q_dim), axes=(EMBED, HEADS)),
    ]
    if c.QK_NORM:
        specs += [norm(attn + "q_norm.weight", (d_h,), (None,)),
                  norm(attn + "k_norm.weight", (d_h,), (None,))]
    specs += [
        ParamSpec(mlp + "gate_proj.weight", (I, H), axes=(MLP, EMBED)),
        ParamSpec(mlp + "up_proj.weight", (I, H), axes=(MLP, EMBED)),
        ParamSpec(mlp + "down_proj.weight", (H, I), axes=(EMBED, MLP)),
    ]
    if c.attention_bias:
        specs += [bias(attn + "q_proj.bias", (q_dim,), (HEADS,)),
                  bias(attn + "k_proj.bias", (kv_dim,), (KV_HEADS,)),
                  bias(attn + "v_proj.bias", (kv_dim,), (KV_HEADS,)),
                  bias(attn + "o_proj.bias", (H,), (EMBED,))]
    if c.mlp_bias:
        specs += [bias(mlp + "gate_proj.bias", (I,), (MLP,)),
                  bias(mlp + "up_proj.bias", (I,), (MLP,)),
                  bias(mlp + "down_proj.bias", (H,), (EMBED,))]
    return specs


def plan_decoder(config: DecoderConfig) -> list[TensorPlan]:
    """Every tensor a checkpoint of `config` holds, with its tree path (HF name, `model.` stripped) and axes."""
    return [planned(s, s.name, root="model.") for s in expand(parameter_spec(config), config.num_hidden_layers)]


# --------------------------------------------------------------------------------------------------------------
# Where the arrays live on a mesh
# --------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Layout:
    """A target's placement on a mesh: logical axes -> mesh axes (hashable: static metadata of the target).

    `tensor_axis` (None when the mesh has no such axis) splits heads, the MLP width and the vocabulary; KV heads
    only when it has at most `num_key_value_heads` devices (`split_kv`), else every device keeps all KV heads
    and each query shard attends with its own group's. The other mesh axes (`batch_axes`) split the batch where
    it divides (else it is replicated). The mesh has Auto axis types (`placement.auto_mesh`).
    """

    mesh: jax.sharding.Mesh
    tensor_axis: str | None
    batch_axes: tuple[str, ...]
    split_kv: bool

    @property
    def tensor_size(self) -> int:
        return self.mesh.shape[self.tensor_axis] if self.tensor_axis else 1

    def spec(self, axes: tuple[str | None, ...], batch_size: int | None = None) -> PartitionSpec:
        """The PartitionSpec of logical `axes` (`BATCH` needs `batch_size`: split only where it divides)."""
        rules: dict[str | None, str | tuple[str, ...] | None] = {
            VOCAB: self.tensor_axis, HEADS: self.tensor_axis, MLP: self.tensor_axis,
            KV_HEADS: self.tensor_axis if self.split_kv else None}
        batch = math.prod(self.mesh.shape[a] for a in self.batch_axes)
        rules[BATCH] = self.batch_axes if self.batch_axes and batch_size is not None and batch_size % batch == 0 \
            else None
        return PartitionSpec(*(rules.get(a) for a in axes))

    def sharding(self, axes: tuple[str | None, ...], batch_size: int | None = None) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(axes, batch_size))

    def constrain(self, x: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
        """`x` pinned to the layout of `axes` (dim 0 the batch when `BATCH` is among them)."""
        return jax.lax.with_sharding_constraint(x, self.sharding(axes, x.shape[0]))


def make_layout(config: DecoderConfig, mesh: jax.sharding.Mesh, tensor_axis: str, source: str) -> Layout:
    """The layout of `config` on `mesh`; a tensor axis that does not divide a split dimension is a ConfigError."""
    mesh = auto_mesh(mesh)
    axis = tensor_axis if tensor_axis in mesh.axis_names else None
    tp = mesh.shape[axis] if axis else 1
    c = config
    for field in ("num_attention_heads", "vocab_size", "intermediate_size"):
        if getattr(c, field) % tp:
            raise ConfigError(
                f"{source}: tensor axis {tensor_axis!r} has {tp} devices, which does not divide "
                f"{field}={getattr(c, field)}; expected a tensor-parallel size dividing the heads, the vocabulary "
                "and the intermediate size"
            )
    n_kv = c.num_key_value_heads
    if (n_kv % tp if tp <= n_kv else tp % n_kv):
        raise ConfigError(
            f"{source}: tensor axis {tensor_axis!r} has {tp} devices and num_key_value_heads={n_kv}: expected one "
            "to divide the other (KV heads are split, or replicated when the axis is larger)"
        )
    batch_axes = tuple(a for a in mesh.axis_names if a != axis)
    return Layout(mesh, axis, batch_axes, split_kv=tp <= n_kv)


CACHE_AXES = (BATCH, KV_HEADS, None, None)  # [batch, n_kv, T, d_h]
ROWS_AXES = (BATCH, None, None)  # the residual stream [batch, S, H]: replicated over the tensor axis


# --------------------------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecoderTarget:
    """A dense decoder: RMSNorm, GQA, RoPE, SwiGLU, tied or untied embeddings, and Qwen3's per-head q/k norm where
    the config declares it (`DecoderConfig.QK_NORM`). Qwen3 and Llama 3 are this one class with another config.

    A pytree (params as leaves; config and layout static): pass it whole through `jax.jit`. Implements `Target`.
    `layout` is None on one device, else where the leaves and the cache live on a mesh (`Layout`).
    """

    params: Params
    config: DecoderConfig = dataclasses.field(metadata=dict(static=True))
    layout: Layout | None = dataclasses.field(default=None, metadata=dict(static=True))

    CONFIG: ClassVar[type[DecoderConfig] | None] = None  # the config class read; None: what `architectures` names

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str],
        *,
        mesh: jax.sharding.Mesh | None = None,
        dtype: jnp.dtype = jnp.bfloat16,
        progress: bool | None = None,
        tensor_axis: str = "model",
        **hub: Unpack[HubOptions],
    ) -> DecoderTarget:
        """Load a Hugging Face decoder directory: config.json + `model.safetensors` or an index with shards; or a
        hub id (`hub`: `revision`, `cache_dir`, `local_files_only`, `token` as transformers spells them,
        `dflash_jax.hub`).

        Floating tensors are cast to `dtype`. Without `mesh` they land on the first local device; with it, each
        leaf is sharded as `Layout` says (tensor-parallel over `tensor_axis` when the mesh has it, replicated
        otherwise), each process reading only the byte ranges of its own devices' shards. Every tensor's
        presence, dtype and shape is checked against the config before any data is read (`CheckpointError`);
        a tensor axis that does not divide the heads, the vocabulary or the intermediate size is a `ConfigError`.
        """
        path = resolve(path, **hub)
        config = load_decoder_config(path, cls.CONFIG)
        layout = None if mesh is None else make_layout(config, mesh, tensor_axis, path)
        with Checkpoint(path) as checkpoint:
            plan = plan_decoder(config)
            check_tensors(plan, checkpoint, path)
            shardings = None if layout is None else [layout.sharding(t.axes) for t in plan]
            leaves = place_all(plan, checkpoint, set(), mesh=mesh, dtype=dtype, progress=progress,
                               shardings=shardings)
        params = build_tree(plan, leaves)
        params["layers"] = tuple(params["layers"])  # one buffer per weight, as placed
        log.info(
            "%s: %s target, %d layers, hidden=%d, heads=%d/%d, vocab=%d, %s embeddings, tensor-parallel %d",
            path, config.MODEL_TYPE, config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
            config.num_key_value_heads, config.vocab_size, "tied" if config.tie_word_embeddings else "untied",
            1 if layout is None else layout.tensor_size,
        )
        return cls(params=params, config=config, layout=layout)

    def shard(self, mesh: jax.sharding.Mesh, *, tensor_axis: str = "model") -> DecoderTarget:
        """This target moved onto `mesh` with the layout `from_pretrained` gives (each leaf `device_put` onto its
        planned sharding): for targets built in memory (`random_qwen3`, `successor_target`); a checkpoint loads
        straight onto its shards with `from_pretrained` / `load_target`."""
        layout = make_layout(self.config, mesh, tensor_axis, f"{type(self).__name__}.shard")
        plan = plan_decoder(self.config)
        where = build_tree(plan, [layout.sharding(t.axes) for t in plan])
        where["layers"] = tuple(where["layers"])
        return dataclasses.replace(self, params=jax.device_put(self.params, where), layout=layout)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def embed(self) -> jax.Array:
        """The input embedding `[V, H]` (HF layout; vocabulary-sharded on a tensor axis), for `drafter.attach`."""
        return self.params["embed_tokens"]["weight"]

    @property
    def lm_head(self) -> jax.Array:
        """The LM head `[V, H]` (HF layout; the embedding when tied), for `drafter.attach(lm_head=...)`."""
        own = self.params.get("lm_head")
        return self.embed if own is None else own["weight"]

    @property
    def max_positions(self) -> int:
        return self.config.max_position_embeddings

    def init_cache(self, batch_size: int, max_length: int) -> KVCache:
        """An empty KV cache for `batch_size` sequences of up to `max_length` positions (rounded up by
        `attention.span_capacity`, so that the GPU kernel reads it well), in the params' dtype (on a mesh: split by KV
        heads over the tensor axis and by sequences over the others, `CACHE_AXES`)."""
        c = self.config
        shape = (batch_size, c.num_key_value_heads, span_capacity(max_length), c.head_dim)
        where = None if self.layout is None else self.layout.sharding(CACHE_AXES, batch_size)
        zeros = lambda: tuple(jnp.zeros(shape, self.embed.dtype, device=where)  # noqa: E731
                              for _ in range(c.num_hidden_layers))
        return KVCache(zeros(), zeros())

    def __call__(
        self, tokens: jax.Array, cache: KVCache, lengths: jax.Array, *, layer_ids: tuple[int, ...] = ()
    ) -> TargetOutput:
        """Run `tokens [batch, S]` after `lengths [batch]` cached positions (see the module docstring).

        Returns float32 logits `[batch, S, V]`, the features at `layer_ids` `[batch, S, len(layer_ids) * H]`
        (transformers' hidden_states[l + 1] convention) and the cache with the new K/V written. The caller must
        leave room: `lengths + S <= T` (writes past the cache's end are dropped).
        """
        return _forward(self, tokens, cache, lengths, tuple(layer_ids))

    def prefill(
        self, tokens: jax.Array, cache: KVCache, lengths: jax.Array, *, layer_ids: tuple[int, ...] = (),
        chunk: int = PREFILL_CHUNK, impl: str = "auto",
    ) -> TargetOutput:
        """Run right-padded prompts `tokens [batch, P]` (`lengths [batch]` real tokens) into an empty cache.

        impl "xla" (and "auto" off GPU): chunked, `chunk` tokens at a time through every layer (a `lax.scan`),
        each chunk attending to the cache written so far and causally to itself, so activations and scores are a
        chunk's, never `[P, P]`. "cudnn" (and "auto" on a GPU with 16-bit weights): the whole prompt at once,
        each layer's attention cuDNN's fused causal flash kernel (no `[P, P]` scores either; measured faster,
        docs/benchmarks.md).
        Returns the features of every row `[batch, P, Lf * H]`, the logits of each prompt's last token
        `[batch, V]` float32, and the cache.
        """
        return _prefill(self, tokens, cache, lengths, tuple(layer_ids), chunk, impl)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Qwen3Target(DecoderTarget):
    """A dense Qwen3 decoder: `DecoderTarget` whose `from_pretrained` reads only Qwen3 configs."""

    CONFIG = Qwen3Config


def load_target(
    path: str | os.PathLike[str],
    *,
    mesh: jax.sharding.Mesh | None = None,
    dtype: jnp.dtype = jnp.bfloat16,
    tensor_axis: str = "model",
    progress: bool | None = None,
    **hub: Unpack[HubOptions],
) -> DecoderTarget:
    """Load the target config.json's `architectures` names (`ARCHITECTURES`: Qwen3ForCausalLM, LlamaForCausalLM)
    from a directory or a hub id, sharded over `mesh`, as `DecoderTarget.from_pretrained` says; another
    architecture is a `ConfigError`."""
    return DecoderTarget.from_pretrained(path, mesh=mesh, dtype=dtype, progress=progress, tensor_axis=tensor_axis,
                                         **hub)


# --------------------------------------------------------------------------------------------------------------
# The forward
# --------------------------------------------------------------------------------------------------------------

_CAUSAL = LayerRule(causal=True, window=None)


def _check_layer_ids(layer_ids: tuple[int, ...], N: int) -> None:
    for l in layer_ids:
        if not -1 <= l < N:
            raise ValueError(f"target layer id {l} is outside [-1, {N - 1}] for a {N}-layer target")


def _attention(target: DecoderTarget, q: jax.Array, k: jax.Array, v: jax.Array, past_k: jax.Array,
               past_v: jax.Array, positions: jax.Array, start: jax.Array, fused: bool):
    """One layer's attention and cache write: `(out [batch, S, n_h, d_h], past_k, past_v)` with the new rows'
    K/V (`k, v [batch, n_kv, S, d_h]`) written at `positions [batch, S]` of the cache `[batch, n_kv, T, d_h]`.

    The new rows attend to the cache's slots `[0, start)` (a span) and causally to themselves; `fused`: the
    cache is empty and cuDNN's flash kernel runs the rows over themselves.

    On a mesh this runs under `shard_map`, each device on its own sequences and heads: attention needs no
    communication between heads, and the kernels it may use (the Pallas span kernel, cuDNN) are custom calls
    GSPMD cannot partition (it would gather their operands onto every device). Where the KV heads are
    replicated (a tensor axis larger than `num_key_value_heads`) a device's query heads all belong to one KV
    head, which it slices out of its full copy.
    """
    layout, c = target.layout, target.config

    def local(q, k, v, past_k, past_v, positions, start):
        batch, n_kv, S, _ = k.shape
        seq, heads = jnp.arange(batch)[:, None, None], jnp.arange(n_kv)[None, :, None]
        slots = positions[:, None, :]  # [batch, 1, S]: broadcast with seq and heads to [batch, n_kv, S]
        new_k = past_k.at[seq, heads, slots].set(k.astype(past_k.dtype), mode="drop")  # past the end: dropped
        new_v = past_v.at[seq, heads, slots].set(v.astype(past_v.dtype), mode="drop")
        if layout is not None and layout.tensor_axis and not layout.split_kv:
            group = jax.lax.axis_index(layout.tensor_axis) * q.shape[2] // (c.num_attention_heads // n_kv)
            k, v, past_k, past_v = (jax.lax.dynamic_slice_in_dim(a, group, 1, axis=1) for a in (k, v, past_k, past_v))
        if fused:
            return causal_self_attention(q, k, v), new_k, new_v
        past = Span(past_k, past_v, jnp.zeros_like(start), start)
        out = attend(q, positions, _CAUSAL, (KeyValues(k, v, positions, jnp.ones(positions.shape, bool)),), (past,))
        return out, new_k, new_v

    if layout is None:
        return local(q, k, v, past_k, past_v, positions, start)
    batch = q.shape[0]
    rows = layout.spec((BATCH, None), batch)
    q_spec = layout.spec((BATCH, None, HEADS, None), batch)  # [batch, S, n_h, d_h]
    kv_spec = layout.spec(CACHE_AXES, batch)  # [batch, n_kv, rows, d_h]
    return jax.shard_map(
        local, mesh=layout.mesh, in_specs=(q_spec, kv_spec, kv_spec, kv_spec, kv_spec, rows, PartitionSpec(rows[0])),
        out_specs=(q_spec, kv_spec, kv_spec), check_vma=False,
    )(q, k, v, past_k, past_v, positions, start)


def _layers(target: DecoderTarget, tokens, cache: KVCache, start: jax.Array, layer_ids: tuple[int, ...],
            fused: bool = False):
    """The decoder over `tokens [batch, S]` at positions `start[b] .. start[b] + S - 1`: `(hidden, features,
    cache)`. Each layer attends to its cache's slots `[0, start)` (a span: only those are read) and causally
    to the new rows, then writes the new rows' K/V at their positions (`_attention`). `fused`: the cache is
    empty (start = 0) and the new rows attend to themselves with cuDNN's flash kernel."""
    params, c, layout = target.params, target.config, target.layout
    N = c.num_hidden_layers
    batch, S = tokens.shape
    positions = start[:, None] + jnp.arange(S, dtype=jnp.int32)  # [batch, S]
    rope = rope_tables(c, positions)  # cos/sin [batch, S, d_h]

    x = x0 = jnp.take(target.embed, tokens, axis=0).astype(target.embed.dtype)  # [batch, S, H]
    keys, values, by_id = list(cache.k), list(cache.v), {}
    for i, p in enumerate(params["layers"]):

        def attention(attn, xn, i=i):
            q = queries(attn, c, xn, rope)  # [batch, S, n_h, d_h]
            k, v = keys_values(attn, c, xn, rope)  # [batch, n_kv, S, d_h]
            out, new_k, new_v = _attention(target, q, k, v, keys[i], values[i], positions, start, fused)
            return out.reshape(batch, S, -1), (new_k, new_v)

        x, (keys[i], values[i]) = decoder_layer(p, c, x, attention)
        if layout is not None:  # the row-parallel o/down sums end replicated over the tensor axis
            x = layout.constrain(x, ROWS_AXES)
        if i in layer_ids and i < N - 1:
            by_id[i] = x
    hidden = rms_norm(x, params["norm"]["weight"], c.rms_norm_eps)  # [batch, S, H]
    by_id |= {-1: x0, N - 1: hidden}
    features = jnp.concatenate([by_id[l] for l in layer_ids], axis=-1) if layer_ids else jnp.zeros((batch, S, 0),
                                                                                                     x0.dtype)
    return hidden, features, KVCache(tuple(keys), tuple(values))


@functools.partial(jax.jit, static_argnames=("layer_ids",))
def _forward(
    target: DecoderTarget, tokens: jax.Array, cache: KVCache, lengths: jax.Array, layer_ids: tuple[int, ...]
) -> TargetOutput:
    _check_layer_ids(layer_ids, target.config.num_hidden_layers)
    hidden, features, cache = _layers(target, tokens, cache, lengths.astype(jnp.int32), layer_ids)
    return TargetOutput(lm_logits(hidden, target.lm_head), features, cache)


@functools.partial(jax.jit, static_argnames=("layer_ids", "chunk", "impl"))
def _prefill(
    target: DecoderTarget, tokens: jax.Array, cache: KVCache, lengths: jax.Array, layer_ids: tuple[int, ...],
    chunk: int, impl: str,
) -> TargetOutput:
    _check_layer_ids(layer_ids, target.config.num_hidden_layers)
    batch, P = tokens.shape
    last = lengths.astype(jnp.int32) - 1  # [batch] each prompt's last row
    fused = impl == "auto" and use_cudnn(target.embed.dtype, target.config.head_dim)
    if impl == "cudnn" or fused:  # the whole prompt at once, fused
        hidden, features, cache = _layers(target, tokens, cache, jnp.zeros((batch,), jnp.int32), layer_ids, True)
        last_hidden = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]  # [batch, H]
        return TargetOutput(lm_logits(last_hidden, target.lm_head), features, cache)
    chunk = min(P, chunk)
    n_chunks = -(-P // chunk)
    pieces = jnp.pad(tokens, ((0, 0), (0, n_chunks * chunk - P))).reshape(batch, n_chunks, chunk).swapaxes(0, 1)

    def step(carry, inputs):
        cache, last_hidden = carry
        c, piece = inputs  # piece: [batch, chunk]
        hidden, features, cache = _layers(target, piece, cache, jnp.full((batch,), c * chunk, jnp.int32), layer_ids)
        row = jnp.clip(last - c * chunk, 0, chunk - 1)
        here = ((last >= c * chunk) & (last < (c + 1) * chunk))[:, None]
        last_hidden = jnp.where(here, jnp.take_along_axis(hidden, row[:, None, None], axis=1)[:, 0], last_hidden)
        return (cache, last_hidden), features

    H = target.config.hidden_size
    (cache, last_hidden), features = jax.lax.scan(
        step, (cache, jnp.zeros((batch, H), target.embed.dtype)), (jnp.arange(n_chunks), pieces)
    )  # features: [n_chunks, batch, chunk, Lf * H]
    features = features.swapaxes(0, 1).reshape(batch, n_chunks * chunk, -1)[:, :P]
    return TargetOutput(lm_logits(last_hidden, target.lm_head), features, cache)

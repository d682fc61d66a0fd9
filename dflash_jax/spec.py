"""The parameters of each architecture, declared once: name, shape, kind, logical axes, when optional, initialiser.

One `ParamSpec` per checkpoint tensor (jax-llm-examples' `abstract(cfg) -> ArrayInfo(shape, dtype, logical_axes,
init)`, with the Hugging Face name added). Everything else derives from these lists: the loader's plan
(`plan.plan_tensors`, `target.plan_decoder`), the random drafters, targets and test checkpoints of
`dflash_jax.testing`, and docs/loading.md's "Parameter tree" table (`tests/test_readme.py` renders and compares it).
`drafter_spec` declares the DFlash-family drafters; `target.parameter_spec` the Qwen3 / Llama targets.

Names are HF names without the layout prefix (`model.` of a prefixed drafter); `{i}` marks a per-layer
template, expanded by `expand`.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from .config import DflashConfig

__all__ = ["ParamSpec", "drafter_spec", "expand", "LINEAR", "NORM", "FLOAT", "INT", "CONVS", "SELECTOR", "MARKOV",
           "CONFIDENCE"]

# Logical axes (jax-llm-examples' style): what a dimension IS; a target's `Layout` maps them to mesh axes.
VOCAB, EMBED, HEADS, KV_HEADS, MLP, BATCH = "vocab", "embed", "heads", "kv_heads", "mlp", "batch"
# A mixture-of-experts layer's stacked expert weights `[E, ...]`: the expert index, and each expert's own SwiGLU
# width (distinct from `MLP`, so that a layout may split either one over a mesh axis, never both onto one).
EXPERTS, EXPERT_MLP = "experts", "expert_mlp"

# Kinds: how a tensor may be stored and is loaded.
LINEAR = "linear"  # a matrix applied as `x @ w.T`: float, or NVFP4-packed (U8 + scales)
NORM = "norm"  # an RMSNorm gain: float
FLOAT = "float"  # any other float tensor (biases, codebooks, conv kernels, embeddings)
INT = "int"  # an integer map (d2t), loaded as int32
FLOAT32 = "float32"  # a float tensor kept in float32 whatever the load's dtype: a router, whose choice of experts
# a narrower dtype would move (vLLM and transformers keep Nemotron-H's router weight and correction bias float32)


def leaf_dtype(kind: str, dtype: jnp.dtype) -> jnp.dtype:
    """The dtype a tensor of `kind` is placed in by a load in `dtype`."""
    return jnp.dtype(jnp.float32 if kind == FLOAT32 else jnp.int32 if kind == INT else dtype)


class Initializer(Protocol):
    """A distribution of random weights in the range trained ones have: `host` draws float32 (int64 for d2t)
    with NumPy, for test checkpoints; `device` draws with JAX on the default device, for random drafters and
    targets at real sizes."""

    def host(self, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray: ...

    def device(self, key: jax.Array, shape: tuple[int, ...], dtype: jnp.dtype) -> jax.Array: ...


@dataclasses.dataclass(frozen=True)
class FanIn:
    """N(0, 1 / fan_in), fan_in the last axis (`[out, in]`): projections, codebooks, embeddings."""

    def host(self, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    def device(self, key: jax.Array, shape: tuple[int, ...], dtype: jnp.dtype) -> jax.Array:
        return jax.random.normal(key, shape, dtype) * (shape[-1] ** -0.5)


@dataclasses.dataclass(frozen=True)
class Gain:
    """1 + N(0, 0.1^2): RMSNorm gains near 1."""

    def host(self, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)

    def device(self, key: jax.Array, shape: tuple[int, ...], dtype: jnp.dtype) -> jax.Array:
        return 1.0 + 0.1 * jax.random.normal(key, shape, dtype)


@dataclasses.dataclass(frozen=True)
class Bias:
    """N(0, 0.02^2): biases near 0."""

    def host(self, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        return (0.02 * rng.standard_normal(shape)).astype(np.float32)

    def device(self, key: jax.Array, shape: tuple[int, ...], dtype: jnp.dtype) -> jax.Array:
        return 0.02 * jax.random.normal(key, shape, dtype)


@dataclasses.dataclass(frozen=True)
class SinkLogits:
    """N(0, 1): attention sink logits, of the size of the scores they compete with."""

    def host(self, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    def device(self, key: jax.Array, shape: tuple[int, ...], dtype: jnp.dtype) -> jax.Array:
        return jax.random.normal(key, shape, dtype)


@dataclasses.dataclass(frozen=True)
class ConvIdentity:
    """A DFlash2 base kernel `[2, taps, H]`: the identity first tap plus N(0, 0.1^2), as initialised."""

    def host(self, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        kernel = 0.1 * rng.standard_normal(shape)
        kernel[:, 0] += 1.0
        return kernel.astype(np.float32)

    def device(self, key: jax.Array, shape: tuple[int, ...], dtype: jnp.dtype) -> jax.Array:
        return (0.1 * jax.random.normal(key, shape, dtype)).at[:, 0].add(1)


@dataclasses.dataclass(frozen=True)
class DraftToTarget:
    """`d2t [draft_V]`: a sorted subset of the target vocabulary of `vocab_size`, as offsets `target - draft`."""

    vocab_size: int

    def host(self, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        target = np.sort(rng.choice(self.vocab_size, size=shape[0], replace=False))
        return (target - np.arange(shape[0])).astype(np.int64)

    def device(self, key: jax.Array, shape: tuple[int, ...], dtype: jnp.dtype) -> jax.Array:
        target = jnp.sort(jax.random.choice(key, self.vocab_size, shape, replace=False))
        return (target - jnp.arange(shape[0])).astype(jnp.int32)


class ParamSpec(NamedTuple):
    """One checkpoint tensor: HF name (`{i}`: the layer), shape from the config, kind (`LINEAR`, `NORM`, `FLOAT`,
    `INT`), logical axis per dimension (`()`: none declared), initialiser, and `optional`: None when every
    checkpoint of the config has it, else the optional part it belongs to, loaded when the checkpoint carries
    the part's first tensor. `aliases`: other names it may be stored under (`{p}`: the layout prefix)."""

    name: str
    shape: tuple[int, ...]
    kind: str = FLOAT
    axes: tuple[str | None, ...] = ()
    init: Initializer = FanIn()
    optional: str | None = None
    aliases: tuple[str, ...] = ()


def expand(specs: list[ParamSpec], num_layers: int) -> list[ParamSpec]:
    """`specs` with each run of per-layer templates repeated layer by layer (`{i}` filled in), in order."""
    out: list[ParamSpec] = []
    for layered, group in itertools.groupby(specs, key=lambda s: "{i}" in s.name):
        run = list(group)
        out += [s._replace(name=s.name.format(i=i)) for i in range(num_layers) for s in run] if layered else run
    return out


# Optional parts of a drafter (`ParamSpec.optional`), as the reference loaders load them: when the config
# declares them (only then are they in `drafter_spec`) and the checkpoint carries them.
CONVS, SELECTOR, MARKOV, CONFIDENCE = "convs", "candidate_selector", "markov_head", "confidence_head"
D2T, OWN_EMBED, OWN_HEAD = "d2t", "embed_tokens", "lm_head"


def drafter_spec(c: DflashConfig) -> list[ParamSpec]:
    """The tensors of a DFlash / DFlash2 / DSpark drafter checkpoint of `c`, in plan order (HF layout `[out, in]`).

    Optional parts: DFlash2's convs and candidate selector, DSpark's Markov and confidence heads, `d2t` (also
    stored as `draft_id_to_target_id`), and the drafter's own `embed_tokens` / `lm_head` (DeepSpec puts
    `lm_head` at the root even beside `model.*`). `confidence_head_with_markov` unstated (None) is the
    Markov-conditioned head DeepSpec and SGLang ship; `load_drafter` reads the flag off the checkpoint first.
    A Gemma 4 drafter (`c.variant`) adds its sandwich norms and `layer_scalar` per layer and, with
    `attention_k_eq_v`, has no `v_proj`.
    """
    H, I, d_h = c.hidden_size, c.intermediate_size, c.head_dim
    q_dim, kv_dim = c.num_attention_heads * d_h, c.num_key_value_heads * d_h
    draft_vocab = c.draft_vocab_size or c.vocab_size
    sub = c.dflash_config
    attn, mlp = "layers.{i}.self_attn.", "layers.{i}.mlp."
    projections = {"q_proj": (q_dim, H), "k_proj": (kv_dim, H), "v_proj": (kv_dim, H), "o_proj": (H, q_dim)}
    if c.attention_k_eq_v:  # Gemma 4: V is the K projection's output
        del projections["v_proj"]
    specs = [
        # the Muse-Glimmer assistant stores these two as `encoder.*` (`dflash_jax.layouts.ENCODER`)
        ParamSpec("fc.weight", (H, len(c.checked_target_layer_ids) * H), LINEAR, aliases=("{p}encoder.fc.weight",)),
        ParamSpec("hidden_norm.weight", (H,), NORM, init=Gain(), aliases=("{p}encoder.output_norm_enc.weight",)),
        ParamSpec("norm.weight", (H,), NORM, init=Gain()),
        ParamSpec("layers.{i}.input_layernorm.weight", (H,), NORM, init=Gain()),
        ParamSpec("layers.{i}.post_attention_layernorm.weight", (H,), NORM, init=Gain()),
    ]
    if c.variant == "gemma4":  # sandwich norms around the MLP, the layer's output scale (`model.gemma4_*`)
        specs += [
            ParamSpec("layers.{i}.pre_feedforward_layernorm.weight", (H,), NORM, init=Gain()),
            ParamSpec("layers.{i}.post_feedforward_layernorm.weight", (H,), NORM, init=Gain()),
            ParamSpec("layers.{i}.layer_scalar", (1,), init=Gain()),
        ]
    for proj, (out_dim, in_dim) in projections.items():
        specs.append(ParamSpec(f"{attn}{proj}.weight", (out_dim, in_dim), LINEAR))
        if c.attention_bias:
            specs.append(ParamSpec(f"{attn}{proj}.bias", (out_dim,), init=Bias()))
    if c.attention_sinks:  # one learned logit per query head (`DflashConfig.attention_sinks`)
        specs.append(ParamSpec(attn + "attention_sink_bias", (c.num_attention_heads,), init=SinkLogits()))
    specs += [
        ParamSpec(attn + "q_norm.weight", (d_h,), NORM, init=Gain()),
        ParamSpec(attn + "k_norm.weight", (d_h,), NORM, init=Gain()),
        ParamSpec(mlp + "gate_proj.weight", (I, H), LINEAR),
        ParamSpec(mlp + "up_proj.weight", (I, H), LINEAR),
        ParamSpec(mlp + "down_proj.weight", (H, I), LINEAR),
    ]
    if sub and sub.conv_kernel_size and sub.conv_group_size:
        taps, groups = sub.conv_kernel_size, H // sub.conv_group_size
        for conv in ("attention_conv", "mlp_conv"):
            specs += [
                ParamSpec(f"layers.{{i}}.{conv}.base_kernel", (2, taps, H), init=ConvIdentity(), optional=CONVS),
                ParamSpec(f"layers.{{i}}.{conv}.kernel_projection.weight", (2 * taps * groups, H), LINEAR,
                          optional=CONVS),
            ]
    if sub and sub.selector_rank and sub.selector_top_k:
        r = sub.selector_rank
        specs += [
            ParamSpec("candidate_selector.predecessor_codebook", (draft_vocab, r), optional=SELECTOR),
            ParamSpec("candidate_selector.successor_codebook", (draft_vocab, r), optional=SELECTOR),
            ParamSpec("candidate_selector.hidden_projection.weight", (r, H), LINEAR, optional=SELECTOR),
        ]
    rank = c.markov_rank
    if rank:
        specs += [
            # indexed by the previous token, a target id (a reduced vocabulary's drafts are mapped: speculators')
            ParamSpec("markov_head.markov_w1.weight", (c.vocab_size, rank), optional=MARKOV),
            ParamSpec("markov_head.markov_w2.weight", (draft_vocab, rank), LINEAR, optional=MARKOV),
        ]
    if c.enable_confidence_head:
        width = H + (rank if c.confidence_head_with_markov is not False and rank else 0)
        specs += [
            ParamSpec("confidence_head.proj.weight", (1, width), LINEAR, optional=CONFIDENCE),
            ParamSpec("confidence_head.proj.bias", (1,), init=Bias(), optional=CONFIDENCE),
        ]
    return specs + [
        ParamSpec("d2t", (draft_vocab,), INT, init=DraftToTarget(c.vocab_size), optional=D2T,
                  aliases=("{p}draft_id_to_target_id",)),
        ParamSpec("embed_tokens.weight", (c.vocab_size, H), optional=OWN_EMBED, aliases=("embed_tokens.weight",)),
        ParamSpec("lm_head.weight", (draft_vocab, H), LINEAR, optional=OWN_HEAD, aliases=("lm_head.weight",)),
    ]

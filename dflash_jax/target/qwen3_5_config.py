"""Config of the Qwen3.5 / 3.6 hybrid text target (transformers' `qwen3_5_text`, and `qwen3_5` with its
`text_config` as the multimodal checkpoints ship).

The fields are transformers 5.24.0's `Qwen3_5TextConfig` (`models/qwen3_5/configuration_qwen3_5.py`), with its
defaults: `layer_types` (else every `full_attention_interval`-th layer full attention, the others linear),
the Gated DeltaNet sizes `linear_*`, partial rotary (`partial_rotary_factor`, in `rope_parameters` or top-level,
default 0.25). `rope_parameters.mrope_section` splits the rotary frequencies among three position streams
(temporal, height, width); for text all three are the token's position, so it is plain RoPE over the rotary
dimensions and is accepted without being read.

The MoE variant (`qwen3_5_moe_text`, and `qwen3_5_moe` with a `text_config`; transformers 5.24.0
`models/qwen3_5_moe/configuration_qwen3_5_moe.py`) is the same config with the MoE sizes `num_experts`,
`num_experts_per_tok`, `moe_intermediate_size`, `shared_expert_intermediate_size` (defaults Qwen3.5-35B-A3B's)
and no dense MLP: every layer's MLP is the sparse block (`target.moe`; transformers has no `mlp_only_layers` or
`decoder_sparse_step` for it, and always renormalises the top-k weights). A dense config's `num_experts` is 0.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, ClassVar

import msgspec

from ..config import Dim, LayerCount, RopeTheta, normalise_raw
from ..errors import ConfigError
from ..rope import PositiveFloat, RopeScaling, declared_rope_type
from . import other_family
from .moe import check_moe_config

__all__ = ["Qwen3_5Config", "parse_qwen3_5_config", "ARCHITECTURES", "MOE_ARCHITECTURES"]

LINEAR_ATTENTION, FULL_ATTENTION = "linear_attention", "full_attention"
ARCHITECTURES = ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration")
MOE_ARCHITECTURES = ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")
MOE_MODEL_TYPE = "qwen3_5_moe_text"
_MULTIMODAL_MODEL_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": MOE_MODEL_TYPE}  # -> their text_config's
# transformers' `Qwen3_5MoeTextConfig` defaults (Qwen3.5-35B-A3B), for the fields an MoE config leaves out
_MOE_DEFAULTS = {"num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
                 "shared_expert_intermediate_size": 512}

Fraction = Annotated[float, msgspec.Meta(gt=0, le=1)]
Count = Annotated[int, msgspec.Meta(ge=0)]


@dataclasses.dataclass(frozen=True)
class Rotary:
    """The rotary part of a head as a `rope.RopeConfig` (what `rope.rope_tables` reads): the first
    `head_dim` dimensions of each query/key head rotate (neox rotate-half within them), the rest pass through."""

    head_dim: int
    rope_theta: float
    max_position_embeddings: int
    rope_type: str = "default"
    rope_scaling: RopeScaling | None = None


class Qwen3_5Config(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """The `qwen3_5_text` / `qwen3_5_moe_text` fields the forward reads (`intermediate_size`: dense only; the
    four MoE sizes: MoE only, 0 in a dense config). Frozen and hashable: a static `jax.jit` argument. Implements
    `moe.MoeConfig`."""

    MODEL_TYPE: ClassVar[str] = "qwen3_5_text"

    vocab_size: Dim = 248320
    hidden_size: Dim = 4096
    intermediate_size: Dim = 12288
    num_hidden_layers: LayerCount = 32
    num_attention_heads: Dim = 16
    num_key_value_heads: Dim = 4
    head_dim: Dim = 256
    hidden_act: str = "silu"
    max_position_embeddings: Dim = 32768
    rms_norm_eps: PositiveFloat = 1e-6
    tie_word_embeddings: bool = False
    rope_theta: RopeTheta = 10000.0
    rope_scaling: RopeScaling | None = None
    partial_rotary_factor: Fraction = 0.25
    attention_bias: bool = False
    attn_output_gate: bool = True
    linear_conv_kernel_dim: Dim = 4
    linear_key_head_dim: Dim = 128
    linear_value_head_dim: Dim = 128
    linear_num_key_heads: Dim = 16
    linear_num_value_heads: Dim = 32
    stated_layer_types: tuple[str, ...] | None = msgspec.field(default=None, name="layer_types")
    full_attention_interval: Dim = 4
    num_experts: Count = 0
    num_experts_per_tok: Count = 0
    moe_intermediate_size: Count = 0
    shared_expert_intermediate_size: Count = 0
    eos_token_id: int | tuple[int, ...] | None = None
    model_type: str | None = None
    architectures: tuple[str, ...] = ()

    @property
    def is_moe(self) -> bool:
        """Every layer's MLP the sparse MoE block (`qwen3_5_moe_text`), else the dense SwiGLU MLP."""
        return self.num_experts > 0

    @property
    def norm_topk_prob(self) -> bool:
        """Always: `qwen3_5_moe` renormalises the top-k router weights and has no such field (`target.moe`)."""
        return True

    @property
    def layer_types(self) -> tuple[str, ...]:
        """As stated, else every `full_attention_interval`-th layer full attention (transformers' rule)."""
        if self.stated_layer_types is not None:
            return self.stated_layer_types
        n = self.full_attention_interval
        return tuple(LINEAR_ATTENTION if (i + 1) % n else FULL_ATTENTION for i in range(self.num_hidden_layers))

    @property
    def rotary(self) -> Rotary:
        return Rotary(int(self.head_dim * self.partial_rotary_factor), self.rope_theta, self.max_position_embeddings)

    @property
    def key_dim(self) -> int:  # the delta-net keys (and queries) of all heads
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """The channels of the delta-net's short convolution: queries, keys and values, in that order."""
        return 2 * self.key_dim + self.value_dim

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        eos = self.eos_token_id
        return () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)


def _text_config(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """The text config of a multimodal `qwen3_5` / `qwen3_5_moe` config (its `text_config`, with the outer
    `architectures` and `tie_word_embeddings`, which transformers reads off the outer config, and the text
    model_type the outer one implies when it states none), or `raw` itself."""
    outer = raw.get("model_type")
    if outer not in _MULTIMODAL_MODEL_TYPES and "text_config" not in raw:
        return raw
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"{source}: a multimodal Qwen3.5 config needs a `text_config` object, got {text!r}")
    text = dict(text)
    if isinstance(outer, str) and outer in _MULTIMODAL_MODEL_TYPES:
        text.setdefault("model_type", _MULTIMODAL_MODEL_TYPES[outer])
    text.setdefault("architectures", raw.get("architectures", []))
    text["tie_word_embeddings"] = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    return text


def parse_qwen3_5_config(raw: dict[str, Any], *, source: str = "<config>") -> Qwen3_5Config:
    """Decode a `qwen3_5_text` / `qwen3_5_moe_text` config dict, or a multimodal `qwen3_5` / `qwen3_5_moe` one
    (its `text_config`); `ConfigError` naming the field when it is not one this target runs. MoE: the model_type
    says so, or, where it is missing, an MoE architecture."""
    raw = dict(_text_config(raw, source))
    stated = raw.get("architectures")
    names = set(stated) if isinstance(stated, list) else set()
    model_type = raw.get("model_type")
    moe = model_type == MOE_MODEL_TYPE or (model_type is None and bool(names & set(MOE_ARCHITECTURES)))
    if moe:
        raw = {**_MOE_DEFAULTS, **raw}
    else:  # a dense config's MoE sizes (if any) are not read, as transformers' dense model reads none
        raw = {k: v for k, v in raw.items() if k not in _MOE_DEFAULTS}
    if names & set(MOE_ARCHITECTURES if not moe else ARCHITECTURES):
        raise ConfigError(f"{source}: architectures {sorted(names)} disagree with model_type {model_type!r}; "
                          f"expected {MOE_MODEL_TYPE!r} with {' / '.join(MOE_ARCHITECTURES)}, else "
                          f"{Qwen3_5Config.MODEL_TYPE!r} with {' / '.join(ARCHITECTURES)}")
    rope = raw.get("rope_parameters")
    if isinstance(rope, dict) and "partial_rotary_factor" in rope:
        stated = raw.get("partial_rotary_factor", rope["partial_rotary_factor"])
        if stated != rope["partial_rotary_factor"]:
            raise ConfigError(f"{source}: partial_rotary_factor ({stated!r}) disagrees with "
                              f"rope_parameters.partial_rotary_factor ({rope['partial_rotary_factor']!r})")
        raw["partial_rotary_factor"] = stated
    try:
        config = msgspec.convert(normalise_raw(raw, source), Qwen3_5Config)
    except msgspec.ValidationError as e:
        raise ConfigError(f"{source}: {e}") from None
    c, problems = config, []
    if c.model_type not in (None, Qwen3_5Config.MODEL_TYPE, MOE_MODEL_TYPE):
        problems.append(other_family(raw, f"{Qwen3_5Config.MODEL_TYPE!r} or {MOE_MODEL_TYPE!r} (or "
                                          f"{' / '.join(_MULTIMODAL_MODEL_TYPES)} with a text_config)"))
    if c.hidden_act != "silu":
        problems.append(f"hidden_act is {c.hidden_act!r}; only 'silu' is implemented")
    for heads, groups in (("num_attention_heads", "num_key_value_heads"),
                          ("linear_num_value_heads", "linear_num_key_heads")):
        if getattr(c, heads) % getattr(c, groups):
            problems.append(f"{heads}={getattr(c, heads)} is not a multiple of {groups}={getattr(c, groups)}")
    types = c.layer_types
    if len(types) != c.num_hidden_layers:
        problems.append(f"layer_types has {len(types)} entries for num_hidden_layers={c.num_hidden_layers}")
    for i, kind in enumerate(types):
        if kind not in (LINEAR_ATTENTION, FULL_ATTENTION):
            problems.append(f"layer_types[{i}] is {kind!r}; expected {LINEAR_ATTENTION!r} or {FULL_ATTENTION!r}")
            break
    if not c.attn_output_gate:
        problems.append("attn_output_gate=false is not implemented (transformers' Qwen3.5 attention always gates)")
    if declared_rope_type(c.rope_scaling) != "default":
        problems.append(f"rope type {declared_rope_type(c.rope_scaling)!r}; only 'default' is implemented")
    rotary = c.rotary.head_dim
    if rotary < 2 or rotary % 2:
        problems.append(f"partial_rotary_factor={c.partial_rotary_factor} gives {rotary} rotary dimensions of "
                        f"head_dim={c.head_dim}; expected an even number")
    if problems:
        raise ConfigError(f"{source}: " + "; ".join(problems))
    if moe:  # its sizes positive (0 would read as a dense config)
        check_moe_config(c, source)
    return config

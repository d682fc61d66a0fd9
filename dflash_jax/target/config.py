"""Configs of the dense decoder targets: one `DecoderConfig`, a small difference per architecture (Qwen3, Llama).

`parse_decoder_config(raw, kind)` decodes a config dict (`dense.DecoderTarget.parse` picks `kind` by the config's
`architectures`: `ARCHITECTURES`).
"""

from __future__ import annotations

from typing import Any, ClassVar, TypeVar

import msgspec

from ..config import Dim, LayerCount, RopeTheta, normalise_raw
from ..errors import ConfigError
from ..rope import PositiveFloat, RopeScaling, declared_rope_type, rope_problems
from . import other_family

__all__ = ["DecoderConfig", "Qwen3Config", "LlamaConfig", "ARCHITECTURES", "parse_decoder_config", "parse_qwen3_config"]


class DecoderConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """The fields of a Hugging Face decoder `config.json` the forward reads (defaults: transformers' Qwen3Config).

    Frozen and hashable: a static `jax.jit` argument. A `config.RopeConfig`, as the drafter's config is (what
    `rope.rope_frequencies` reads). The architectures differ only in the class constants: `MODEL_TYPE`,
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


TARGET = "a target checkpoint directory"  # what the target loaders expect, in `read_config_json`'s messages
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
        problems.append(other_family(raw, repr(kind.MODEL_TYPE)))
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
    problems += rope_problems(config)
    if problems:
        raise ConfigError(f"{source}: " + "; ".join(problems))
    return config


def parse_qwen3_config(raw: dict[str, Any], *, source: str = "<config>") -> Qwen3Config:
    """Decode a Qwen3 config dict."""
    return parse_decoder_config(raw, Qwen3Config, source=source)


def is_drafter_config(raw: dict[str, Any]) -> bool:
    """A DFlash-family drafter's config.json: a mask token at the top level or in its family's block."""
    return any(isinstance(block, dict) and "mask_token_id" in block
               for block in (raw, raw.get("dflash_config"), raw.get("dspark_config")))


def not_a_target(file: str, raw: dict[str, Any], expected: list[str]) -> ConfigError:
    """The error for a config.json that names none of the `expected` target architectures: a drafter's is said to
    be one."""
    names = raw.get("architectures")
    names = [a for a in names if isinstance(a, str)] if isinstance(names, list) else []
    what = ("a DFlash-family drafter (load it with load_drafter)" if is_drafter_config(raw)
            else "not a target dflash_jax runs")
    naming = ("one of " if len(expected) > 1 else "") + ", ".join(expected)
    return ConfigError(f"{file}: architectures {names or 'missing'}: {what}; expected a target checkpoint "
                       f"directory, its config.json naming {naming}")


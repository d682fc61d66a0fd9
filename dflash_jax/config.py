"""Drafter `config.json` decoding: one frozen `DflashConfig` for DFlash, DFlash2 and DSpark checkpoints.

Field names are the Hugging Face names, verbatim. Released checkpoints disagree on where things live
(`rope_parameters` vs `rope_scaling`, `block_size` nested or top-level, DSpark fields top-level or in a
`dspark_config` block), so the raw dict is normalised first (`normalise_raw`), then converted with msgspec
(types and bounds checked there), then checked for consistency (`check`). The struct keeps what the file
states; a value with several sources (the mask token, the target layers, ...) is read through a property
that resolves it, so every reader sees one answer and the stated values stay as stated. `replace` derives a
changed config and checks it again. `RopeConfig` is what the RoPE tables read, of a drafter's config or a
target's.
"""

from __future__ import annotations

import math
import warnings
from typing import Annotated, Any, Literal, NoReturn

import msgspec

from ._json import NotUTF8
from ._json import loads as json_loads
from .errors import ConfigError
from .layouts import GEMMA4, fold, not_implemented, renamed, restate
from .rope import Positive, PositiveFloat, RopeScaling, declared_rope_type, rope_problems

__all__ = ["DflashConfig", "DflashSubConfig", "DsparkSubConfig", "QuantizationConfig", "parse_config", "replace",
           "default_target_layer_ids"]

# Sizes and ids are bounded so that a hostile config cannot ask for absurd shapes or loops: every tensor
# dimension and token id fits in int32 (JAX's default index type), and the layer count bounds the plan.
MAX_DIM = 2**31 - 1
MAX_LAYERS = 1024  # released drafters have 1-8 layers; 10**12 would make planning hang
MAX_CONFIG_BYTES = 16 * 1024 * 1024  # a config.json is a few KiB

Dim = Annotated[int, msgspec.Meta(gt=0, le=MAX_DIM)]
NonNegative = Annotated[int, msgspec.Meta(ge=0, le=MAX_DIM)]
LayerCount = Annotated[int, msgspec.Meta(gt=0, le=MAX_LAYERS)]
LayerId = Annotated[int, msgspec.Meta(ge=-1, le=MAX_DIM)]  # -1 = the target's embedding output (DeepSpec)
# RoPE runs in float32: a base in (1, 1e30] keeps 1 / theta**(2i/d) finite and log(theta) > 0 (YaRN divides
# by it); 1e-300 made every frequency Inf and every draft NaN. Released drafters use 5e5 to 1e7.
RopeTheta = Annotated[float, msgspec.Meta(gt=1, le=1e30)]
MAX_ROPE_FACTOR = 1e6  # YaRN's factor: at least 1 (it stretches positions); factor x theta stays a finite float32
MAX_IGNORE_PATTERNS = 4096  # ModelOpt's exclude lists name a few modules or layer patterns
IgnorePatterns = Annotated[tuple[str, ...], msgspec.Meta(max_length=MAX_IGNORE_PATTERNS)]

LAYER_TYPES = ("full_attention", "sliding_attention")  # the attention kinds DFlash-family drafters use

# Markov / confidence fields that SpecForge and DeepSpec exports put nested or top-level.
_HOISTED = ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")

DEFAULT_ROPE_THETA = 1e7  # the original design's default; transformers' Qwen3Config would use 1e4, vLLM 1e6


class DflashSubConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """The nested `dflash_config` block (z-lab, SpecForge, DFlash2)."""

    mask_token_id: NonNegative | None = None
    target_layer_ids: tuple[LayerId, ...] | None = None
    projector_type: str | None = None
    conv_kernel_size: NonNegative = 0
    conv_group_size: NonNegative = 0
    selector_rank: NonNegative = 0
    selector_top_k: NonNegative = 0
    block_size: Dim | None = None
    causal: bool | None = None
    input_embedding_scale: float | None = None
    final_logit_softcapping: PositiveFloat | None = None  # DFlash2's unary transform (`logit_transform`)
    output_multiplier: float | None = None
    use_swa: bool = False  # MiMo-style: every layer sliding (vLLM `_resolve_layer_attention`), see `attention_layout`
    swa_window_size: Positive | None = None  # the window of sliding layers, over the top-level `sliding_window`
    sample_from_anchor: bool | None = None  # vLLM's form of a speculators export's flag (`sample_from_anchor`)
    attention_sink_bias: bool | None = None  # a learned sink logit per head (Nemotron 3.5; `attention_sinks`)


class DsparkSubConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """The `dspark_config` block of RadixArk-style DSpark exports."""

    mask_token_id: NonNegative | None = None
    target_layer_ids: tuple[LayerId, ...] | None = None
    markov_rank: NonNegative | None = None


class QuantizationConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """`quantization_config` of a ModelOpt export (or the `quantization` block of hf_quant_config.json)."""

    quant_algo: str | None = None
    group_size: Positive | None = None  # hoisted from config_groups.*.weights.group_size
    ignore: IgnorePatterns = ()  # also filled from `exclude_modules`


class DflashConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """A DFlash-family drafter config. Frozen and hashable: usable as a static `jax.jit` argument.

    The fields are the file's, as stated (after `normalise_raw` has folded the layouts). A value with several
    sources is stated under a `stated_` field (its HF name in the file) and read through the property of its
    HF name, which resolves it: `mask_token_id`, `target_layer_ids`, `markov_rank`, and the attention layout
    (`layer_types`, `is_causal`, `sliding_window`, `use_sliding_window`). Derive a changed config with
    `replace`, which checks it again.
    """

    hidden_size: Dim
    num_hidden_layers: LayerCount
    intermediate_size: Dim
    num_attention_heads: Dim
    num_key_value_heads: Dim
    head_dim: Dim
    vocab_size: Dim
    draft_vocab_size: Dim | None = None
    block_size: Dim = 16
    dflash_config: DflashSubConfig | None = None
    rope_theta: RopeTheta = DEFAULT_ROPE_THETA  # also read from rope_parameters.rope_theta; a default is warned
    rope_scaling: RopeScaling | None = None  # also read from `rope_parameters`
    markov_head_type: str | None = None
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool | None = None  # None: not stated; the loader reads it off the head's width
    rms_norm_eps: PositiveFloat = 1e-6
    attention_bias: bool = False
    num_target_layers: Dim | None = None  # bounded as stated ids are, so derived ids are too
    max_position_embeddings: Positive | None = None
    final_logit_softcapping: PositiveFloat | None = None  # top level: applied by Gemma 4 only (`logit_transform`)
    output_multiplier: float | None = None  # likewise
    dspark_config: DsparkSubConfig | None = None
    architectures: tuple[str, ...] = ()
    quantization_config: QuantizationConfig | None = None
    attention_k_eq_v: bool = False  # Gemma 4: V is the K projection's output (no v_proj), through `v_norm`
    # NVIDIA's Nemotron 3.5 exports (SGLang dflash.py / dspark.py, vLLM's DSpark speculator): the anchor as a
    # separate row before the drafts (`sample_from_anchor` off), the Markov rank under a second name, the drafter's
    # own embedding, the taps once more as hidden-state indices (EAGLE's name: z-lab's id + 1).
    dspark_bonus_anchor: bool | None = None
    dspark_markov_rank: NonNegative | None = None
    has_embed_tokens: bool | None = None
    has_lm_head: bool | None = None
    eagle_aux_hidden_state_layer_ids: tuple[LayerId, ...] | None = None
    # The top-level statements of values with several sources (resolved by the properties of their HF names).
    stated_mask_token_id: NonNegative | None = msgspec.field(default=None, name="mask_token_id")
    stated_target_layer_ids: tuple[LayerId, ...] | None = msgspec.field(default=None, name="target_layer_ids")
    stated_markov_rank: NonNegative = msgspec.field(default=0, name="markov_rank")
    stated_layer_types: tuple[str, ...] | None = msgspec.field(default=None, name="layer_types")
    stated_is_causal: bool | None = msgspec.field(default=None, name="is_causal")
    stated_sliding_window: Positive | None = msgspec.field(default=None, name="sliding_window")
    stated_use_sliding_window: bool = msgspec.field(default=False, name="use_sliding_window")
    stated_sample_from_anchor: bool | None = msgspec.field(default=None, name="sample_from_anchor")
    stated_attention_sink_bias: bool | None = msgspec.field(default=None, name="attention_sink_bias")

    # --- values with several sources, resolved: one answer for every reader ---------------------------------

    @property
    def mask_token_id(self) -> int | None:
        """`dflash_config.mask_token_id`, else the top level's, else `dspark_config`'s (None only before `check`)."""
        return self._first_stated("mask_token_id")

    @property
    def target_layer_ids(self) -> tuple[int, ...] | None:
        """The target layers read, stated as `mask_token_id` is, else the reference default for
        `num_target_layers` (`default_target_layer_ids`); None only before `check`."""
        stated = self._first_stated("target_layer_ids")
        if stated is None and self.num_target_layers is not None:
            return default_target_layer_ids(self.num_target_layers, self.num_hidden_layers)
        return stated

    @property
    def checked_mask_token_id(self) -> int:
        """`mask_token_id` of a checked config (`parse_config` and `replace` check each config they make)."""
        mask = self.mask_token_id
        assert mask is not None, "an unchecked DflashConfig: `check` refuses one without a mask token"
        return mask

    @property
    def checked_target_layer_ids(self) -> tuple[int, ...]:
        """`target_layer_ids` of a checked config (`parse_config` and `replace` check each config they make)."""
        layer_ids = self.target_layer_ids
        assert layer_ids is not None, "an unchecked DflashConfig: `check` refuses one without target_layer_ids"
        return layer_ids

    @property
    def sample_from_anchor(self) -> bool:
        """Whether the anchor's row drafts too (all B rows predict the next position) or only rows 1..B-1 do:
        stated as `mask_token_id` is (speculators, vLLM), else DSpark's convention for DSpark, z-lab's otherwise."""
        stated = self._first_stated("sample_from_anchor")
        if stated is None and self.dspark_bonus_anchor is not None:
            return not self.dspark_bonus_anchor  # the anchor is its own row: rows 1..B-1 draft (vLLM's DSpark)
        return self.family == "dspark" if stated is None else stated

    @property
    def attention_sinks(self) -> bool:
        """Whether every layer's softmax has a learned sink logit per head (`attention_sink_bias`, top level or in
        `dflash_config`): one extra, unscaled logit appended before the float32 softmax and dropped after (GPT-OSS,
        Nemotron 3.5; ModelOpt `modeling_dflash.py`, SGLang `dflash.py`)."""
        return bool(self._first_stated("attention_sink_bias"))

    @property
    def markov_rank(self) -> int:
        """The DSpark Markov head's rank (0: none): the top level's (hoisted from a block), else `dspark_config`'s."""
        spark = self.dspark_config.markov_rank if self.dspark_config is not None else None
        return self.stated_markov_rank or self.dspark_markov_rank or spark or 0

    @property
    def layer_types(self) -> tuple[str, ...] | None:
        """Per layer `full_attention` / `sliding_attention` (`attention_layout`)."""
        return self.attention_layout()[0]

    @property
    def is_causal(self) -> bool | None:
        return self.attention_layout()[1]

    @property
    def sliding_window(self) -> int | None:
        return self.attention_layout()[2]

    @property
    def use_sliding_window(self) -> bool:
        return self.attention_layout()[3]

    def attention_layout(self) -> tuple[tuple[str, ...] | None, bool | None, int | None, bool]:
        """`(layer_types, is_causal, sliding_window, use_sliding_window)` as stated, or with MiMo-style
        `dflash_config.use_swa` / `swa_window_size` read as vLLM's `_resolve_layer_attention` reads them.

        `use_swa` on a config without sliding layers makes every layer sliding; `swa_window_size` (else the
        top-level `sliding_window`) is the window of the sliding layers. vLLM takes causality from the layer types
        as declared, so layers that only `use_swa` makes sliding stay non-causal unless the config states
        `is_causal` / `causal`. The window is None when no source states one (`check` refuses that).
        """
        stated = (self.stated_layer_types, self.stated_is_causal, self.stated_sliding_window,
                  self.stated_use_sliding_window)
        sub = self.dflash_config
        if sub is None or not (sub.use_swa or sub.swa_window_size):
            return stated
        layer_types, is_causal = self.stated_layer_types, self.stated_is_causal
        made_sliding = sub.use_swa and "sliding_attention" not in (layer_types or ())
        if made_sliding:
            layer_types = ("sliding_attention",) * self.num_hidden_layers
            if is_causal is None and sub.causal is None:
                is_causal = False
        if not made_sliding and "sliding_attention" not in (layer_types or ()):
            return stated
        return layer_types, is_causal, sub.swa_window_size or self.stated_sliding_window, True

    def _first_stated(self, field: str):
        """The first stated of `dflash_config.<field>`, the top level's `stated_<field>`, `dspark_config.<field>`."""
        sources = (getattr(self.dflash_config, field, None), getattr(self, "stated_" + field),
                   getattr(self.dspark_config, field, None))
        return next((value for value in sources if value is not None), None)

    # --- derived values ----------------------------------------------------------------------------------------

    @property
    def effective_block_size(self) -> int:
        """The block size the drafter was trained at: `dflash_config.block_size` when stated."""
        nested = self.dflash_config.block_size if self.dflash_config else None
        return nested if nested is not None else self.block_size

    @property
    def family(self) -> Literal["dflash", "dflash2", "dspark"]:
        sub = self.dflash_config
        if (
            (sub is not None and sub.projector_type == "dspark")
            or any("DSpark" in a for a in self.architectures)
            or self.markov_rank > 0
            or self.dspark_config is not None
        ):
            return "dspark"
        if (sub is not None and (sub.conv_kernel_size or sub.conv_group_size or sub.selector_rank)) or any(
            "DFlash2" in a for a in self.architectures
        ):
            return "dflash2"
        return "dflash"

    @property
    def num_draft_tokens(self) -> int:
        """Drafts one step proposes: B with `sample_from_anchor` (DSpark's shifted rows), else B-1 (row 0 echoes
        the anchor)."""
        block = self.effective_block_size
        return block if self.sample_from_anchor else block - 1

    @property
    def variant(self) -> Literal["qwen3", "gemma4"]:
        """The layer the drafter is built of: Qwen3's, or Gemma 4's (DeepSpec's `Gemma4DSparkModel`:
        `model.gemma4_decoder_layer`). The architecture decides (`layouts.GEMMA4`)."""
        return "gemma4" if GEMMA4 in self.architectures else "qwen3"

    @property
    def rope_type(self) -> Literal["default", "yarn", "proportional"]:
        """`"yarn"`, `"proportional"` or `"default"`; any other declared type runs as plain RoPE (warned at parse
        time)."""
        declared = declared_rope_type(self.rope_scaling)
        return "yarn" if declared == "yarn" else "proportional" if declared == "proportional" else "default"

    @property
    def input_embedding_scale(self) -> float | None:
        """The factor the block's embeddings are multiplied by: Gemma 4's `sqrt(hidden_size)`
        (`Gemma4TextScaledWordEmbedding`), else `dflash_config.input_embedding_scale` when stated."""
        if self.variant == "gemma4":
            return math.sqrt(self.hidden_size)
        return self.dflash_config.input_embedding_scale if self.dflash_config else None

    @property
    def logit_transform(self) -> tuple[float | None, float | None]:
        """`(output_multiplier, final_logit_softcapping)` applied to the draft logits, None for "not applied".

        Only DFlash2 transforms its unary logits, and only with the values of `dflash_config` (SpecForge
        `dflash2.py` `transform_unary_logits`, vLLM `qwen3_dflash2.py`), and Gemma 4 softcaps its logits with the
        top-level `final_logit_softcapping` before the Markov bias (DeepSpec `Gemma4DSparkModel.compute_logits`);
        the other DFlash and DSpark heads use the plain LM-head output, whatever else the config carries
        (docs/references.md).
        """
        if self.variant == "gemma4":
            return None, self.final_logit_softcapping
        sub = self.dflash_config
        if self.family != "dflash2" or sub is None:
            return None, None
        return sub.output_multiplier, sub.final_logit_softcapping

    @property
    def num_key_value_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The reference default: `round(1 + i*(N_t-4)/(N_d-1))`, or `[N_t//2]` for a 1-layer drafter."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    step = (num_target_layers - 4) / (num_draft_layers - 1)
    return tuple(int(round(1 + i * step)) for i in range(num_draft_layers))


def parse_config(raw: str | bytes | dict[str, Any], *, source: str = "<config>") -> DflashConfig:
    """Decode a drafter config (JSON text, bytes, or an already-parsed dict) into a `DflashConfig`.

    Raises `ConfigError` naming `source` and the offending field, and nothing else, whatever `raw` holds.
    """
    try:
        raw = decode_config_json(raw, source, "a drafter config.json")
        names = renamed(raw)  # fields the fold copies into others: an error names them as the file does
        try:
            return _decode_folded(fold(raw, source), source)  # speculators nesting, ... (`dflash_jax.layouts`)
        except ConfigError as e:
            raise ConfigError(restate(str(e), names)) from None
    except RecursionError:
        raise ConfigError(f"{source}: JSON nested too deeply; expected a drafter config.json") from None


def _decode_folded(raw: dict[str, Any], source: str) -> DflashConfig:
    """`parse_config`'s decoding and checks of a folded config."""
    refusal = not_a_drafter(raw) or not_implemented(raw)
    if refusal:
        raise ConfigError(f"{source}: {refusal}")
    try:
        config = msgspec.convert(normalise_raw(raw, source), DflashConfig)
    except msgspec.ValidationError as e:
        raise ConfigError(f"{source}: {e}") from None
    except UnicodeError:  # msgspec cannot encode a lone surrogate ("\ud800") in a key or a string
        raise ConfigError(f"{source}: a key or string is not valid Unicode (lone surrogate escape)") from None
    check(config, source)
    _warn_unused(config, source)
    return config


def decode_config_json(raw: str | bytes | dict[str, Any], source: str, expected: str) -> dict[str, Any]:
    """A config's JSON text as a dict (a dict passes through): UTF-8 only, duplicate keys refused, an object at the
    top level; every failure a `ConfigError` naming `source` and what was `expected` ("a drafter config.json")."""
    try:
        if isinstance(raw, (str, bytes)):
            try:
                raw = json_loads(raw)
            except NotUTF8 as e:
                raise ConfigError(f"{source}: not valid JSON: the file is not UTF-8 JSON ({e}); save it as UTF-8 "
                                  "without a byte-order mark") from None
            except ValueError as e:  # JSONDecodeError, the int digits limit, duplicates
                raise ConfigError(f"{source}: not valid JSON ({e}); expected {expected}") from None
    except RecursionError:
        raise ConfigError(f"{source}: JSON nested too deeply; expected {expected}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a JSON object at the top level, found {type(raw).__name__}")
    return raw


def not_a_drafter(raw: dict[str, Any]) -> str | None:
    """Why a raw config is no DFlash-family drafter (an EAGLE drafter, a target model), or None.

    Judged on the raw dict before decoding, so that the fields such configs lack (`head_dim`, the mask
    token) do not hide what they are. Only a config with no mask token anywhere is refused here: every
    DFlash-family drafter has one, whatever its `architectures` says.
    """
    sources = (raw, raw.get("dflash_config"), raw.get("dspark_config"))
    if any(isinstance(s, dict) and s.get("mask_token_id") is not None for s in sources):
        return None
    architectures = raw.get("architectures")
    names = [a for a in architectures if isinstance(a, str)] if isinstance(architectures, list) else []
    listed = f"architectures [{', '.join(names)}]"
    expected = "expected a DFlash, DFlash2 or DSpark drafter config (with `dflash_config.mask_token_id`)"
    if any("eagle" in a.lower() for a in names) or "eagle_config" in raw:
        return f"{listed}, no mask token: this is an EAGLE drafter, not a DFlash-family drafter; {expected}"
    if any(a.endswith(("ForCausalLM", "ForConditionalGeneration")) for a in names):
        return f"{listed}, no mask token: this looks like a target model, not a drafter; {expected}"
    if "draft_vocab_size" in raw and "dflash_config" not in raw and "dspark_config" not in raw:
        return f"`draft_vocab_size` and no mask token: this looks like an EAGLE-3 drafter config; {expected}"
    return None


def normalise_raw(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """Fold the layouts real checkpoints ship into the one `DflashConfig` reads."""
    raw = dict(raw)
    params = raw.pop("rope_parameters", None)
    if params is not None and not isinstance(params, dict):
        raise ConfigError(f"{source}: `rope_parameters` is a JSON {type(params).__name__}, expected an object")
    if params is not None:
        scaling = raw.get("rope_scaling")
        if scaling is not None and scaling != params:
            raise ConfigError(
                f"{source}: both `rope_scaling` and `rope_parameters` are set, with different contents "
                f"({scaling!r} vs {params!r}); expected one of them"
            )
        raw["rope_scaling"] = params
        theta = params.get("rope_theta")
        if theta is not None:
            if "rope_theta" in raw and raw["rope_theta"] != theta:
                raise ConfigError(
                    f"{source}: `rope_theta` ({raw['rope_theta']!r}) disagrees with "
                    f"`rope_parameters.rope_theta` ({theta!r})"
                )
            raw["rope_theta"] = theta
    if "rope_theta" not in raw:
        warnings.warn(
            f"{source}: no `rope_theta` (top level or in `rope_parameters`): using {DEFAULT_ROPE_THETA:.0f}, the "
            "original design's default; transformers' Qwen3Config would use 1e4 and vLLM's DFlash 1e6. State the "
            "theta the drafter was trained with (usually its target's) in config.json",
            stacklevel=3,
        )
    for block in ("dflash_config", "dspark_config"):
        sub = raw.get(block)
        if isinstance(sub, dict):
            for key in _HOISTED:
                if key in sub and key not in raw:
                    raw[key] = sub[key]
    quant = raw.get("quantization_config")
    if isinstance(quant, dict):
        raw["quantization_config"] = normalise_quantization(quant)
    return raw


def normalise_quantization(block: dict[str, Any]) -> dict[str, Any]:
    """Fold ModelOpt's two layouts (config.json `quantization_config`, hf_quant_config `quantization`)."""
    out: dict[str, Any] = {k: block[k] for k in ("quant_algo", "group_size") if k in block}
    ignore = block.get("ignore", block.get("exclude_modules"))
    if ignore is not None:
        out["ignore"] = ignore
    groups = block.get("config_groups")
    if "group_size" not in out and isinstance(groups, dict):
        for group in groups.values():
            weights = group.get("weights") if isinstance(group, dict) else None
            size = weights.get("group_size") if isinstance(weights, dict) else None
            if size is not None:
                out["group_size"] = size
                break
    return out


def check(config: DflashConfig, source: str) -> None:
    """Refuse a config that is not self-consistent: `ConfigError` naming `source` and the field."""

    def fail(message: str) -> NoReturn:
        raise ConfigError(f"{source}: {message}")

    mask, layer_ids, sub = config.mask_token_id, config.target_layer_ids, config.dflash_config
    if layer_ids == ():
        fail("target_layer_ids is empty; expected the ids of the target layers the drafter reads")
    for problem in _disagreements(config):
        fail(problem)
    for field, value in _non_finite(config):
        fail(f"{field}={value} is not finite; expected a finite number")
    if mask is None:
        fail(
            "no mask token: expected `dflash_config.mask_token_id`, a top-level `mask_token_id` or "
            "`dspark_config.mask_token_id`"
        )
    if mask >= config.vocab_size:
        fail(f"mask_token_id={mask} is outside the target vocabulary (vocab_size={config.vocab_size})")
    if config.draft_vocab_size is not None and config.draft_vocab_size > config.vocab_size:
        fail(
            f"draft_vocab_size={config.draft_vocab_size} exceeds vocab_size={config.vocab_size}; "
            "expected a draft vocabulary that is a subset of the target's"
        )
    if layer_ids is None:
        fail(
            "no `target_layer_ids` (in dflash_config, top level or dspark_config) and no "
            "`num_target_layers` to derive the default from"
        )
    if config._first_stated("target_layer_ids") is None and min(layer_ids) < 0:
        fail(
            f"num_target_layers={config.num_target_layers} is too few for the default target_layer_ids of "
            f"{config.num_hidden_layers} draft layers ({list(layer_ids)}); expected `target_layer_ids` stated"
        )
    if config.num_target_layers is not None:
        bad = [i for i in layer_ids if i >= config.num_target_layers]
        if bad:
            fail(f"target_layer_ids {list(layer_ids)} has {bad} outside num_target_layers={config.num_target_layers}")
    if config.num_attention_heads % config.num_key_value_heads:
        fail(
            f"num_attention_heads={config.num_attention_heads} is not a multiple of "
            f"num_key_value_heads={config.num_key_value_heads}"
        )
    if config.markov_head_type is not None and config.markov_head_type != "vanilla":
        fail(
            f"markov_head_type={config.markov_head_type!r}: SpecForge's and DeepSpec's 'gated' and 'rnn' Markov "
            "heads are not implemented; only 'vanilla' (the low-rank bigram bias) is"
        )
    if config.layer_types is not None and len(config.layer_types) != config.num_hidden_layers:
        fail(f"layer_types has {len(config.layer_types)} entries, expected "
             f"num_hidden_layers={config.num_hidden_layers}")
    for i, kind in enumerate(config.layer_types or ()):
        if kind not in LAYER_TYPES:  # another kind (linear, chunked) would silently run as full attention
            fail(f"layer_types[{i}] = {kind!r}; expected one of {', '.join(LAYER_TYPES)}")
    if config.use_sliding_window and config.sliding_window is None and sub is not None and sub.use_swa:
        fail("dflash_config.use_swa without a window: expected `dflash_config.swa_window_size` or `sliding_window`")
    if sub is not None and sub.conv_group_size and config.hidden_size % sub.conv_group_size:
        fail(f"dflash_config.conv_group_size={sub.conv_group_size} does not divide hidden_size={config.hidden_size}")
    if sub is not None and bool(sub.conv_kernel_size) != bool(sub.conv_group_size):
        fail("dflash_config declares only one of conv_kernel_size / conv_group_size; expected both or neither")
    if sub is not None and bool(sub.selector_rank) != bool(sub.selector_top_k):
        fail("dflash_config declares only one of selector_rank / selector_top_k; expected both or neither")
    if not config.sample_from_anchor and config.effective_block_size < 2:
        fail(f"block size {config.effective_block_size} leaves no draft rows (z-lab convention needs >= 2)")
    dflash2 = [f"dflash_config.{k}" for k in ("conv_kernel_size", "selector_rank") if getattr(sub, k, 0)]
    dflash2 += [f"architectures {a!r}" for a in config.architectures if "DFlash2" in a]
    if dflash2 and config.family == "dspark":
        fail(f"{' and '.join(dflash2)} (DFlash2) in a DSpark config (markov_rank, dspark_config, a "
             "DSpark architecture or projector): half one family and half another; expected one family's fields")
    if config.sample_from_anchor and config.family == "dflash2":
        fail("sample_from_anchor: true with a DFlash2 drafter: its candidate selector was trained on rows 1..B-1 "
             "(SpecForge dflash2.py, vLLM qwen3_dflash2.py); drafting from the anchor's row is not implemented")
    if sub is not None and sub.selector_top_k > (config.draft_vocab_size or config.vocab_size):
        fail(f"dflash_config.selector_top_k={sub.selector_top_k} exceeds the draft vocabulary")
    factor = config.rope_scaling.factor if config.rope_scaling else None
    if config.rope_type == "yarn" and not 1 <= (factor or 0) <= MAX_ROPE_FACTOR:
        fail(f"rope_scaling.factor={factor}: rope_type 'yarn' needs a `factor` in [1, {MAX_ROPE_FACTOR:g}]")
    for problem in rope_problems(config):
        fail(problem)


def _disagreements(config: DflashConfig) -> list[str]:
    """Values a config states twice, differently: the taps, the sinks, the anchor row, the Markov rank (top level,
    `dflash_config`, `dspark_config`, and their second names). Which one a reference reads differs between engines
    (SGLang reads the nested taps, vLLM's speculators the top level's), so a drifted copy is refused, not resolved."""
    def stated(field: str) -> list[tuple[str, Any]]:  # where a field may be stated, as `_first_stated` reads them
        return [(f"dflash_config.{field}", getattr(config.dflash_config, field, None)),
                (field, getattr(config, "stated_" + field)),
                (f"dspark_config.{field}", getattr(config.dspark_config, field, None))]

    ranks = [(name, rank or None) for name, rank in stated("markov_rank")]  # a top-level rank of 0: unstated
    statements = [stated("target_layer_ids"), stated("attention_sink_bias"), stated("sample_from_anchor"),
                  [*ranks, ("dspark_markov_rank", config.dspark_markov_rank)]]
    problems = []
    for statement in statements:
        values = [(name, v) for name, v in statement if v is not None]
        if len({v for _, v in values}) > 1:
            problems.append(" but ".join(f"{name}={list(v) if isinstance(v, tuple) else v!r}" for name, v in values)
                            + ": one value stated differently; expected them equal")
    taps, aux = config.target_layer_ids, config.eagle_aux_hidden_state_layer_ids
    if aux is not None and taps is not None and list(aux) != [i + 1 for i in taps]:
        problems.append(f"eagle_aux_hidden_state_layer_ids={list(aux)} but target_layer_ids={list(taps)}: the "
                        "hidden-state indices are the target layers' ids + 1 (hidden_states[0] is the embedding); "
                        f"expected {[i + 1 for i in taps]}")
    if config.dspark_bonus_anchor and config._first_stated("sample_from_anchor"):
        problems.append("dspark_bonus_anchor: true with sample_from_anchor: true: a bonus anchor is its own row "
                        "before the drafts (rows 1..B-1 draft), sampling from the anchor's row drafts all B rows; "
                        "expected one layout")
    if config.dspark_bonus_anchor and config.family != "dspark":
        problems.append("dspark_bonus_anchor in a config of no DSpark drafter (no Markov rank, DSpark architecture "
                        "or dspark_config); expected a DSpark config")
    return problems


def _warn_unused(config: DflashConfig, source: str) -> None:
    """Warn about what a config states and this package does not apply: another RoPE type, a logit transform
    outside DFlash2."""
    declared = declared_rope_type(config.rope_scaling)
    if declared not in ("default", "yarn", "proportional"):
        warnings.warn(f"{source}: rope_type {declared!r} is not supported; running plain RoPE", stacklevel=3)
    transform = ("final_logit_softcapping", "output_multiplier")  # DFlash2's, from dflash_config (`logit_transform`)
    applied = ("final_logit_softcapping",) if config.variant == "gemma4" else ()  # Gemma 4's, top-level
    unused = [f"{field}={getattr(config, field)}" for field in transform
              if getattr(config, field) is not None and field not in applied]
    sub = config.dflash_config
    if sub is not None and config.family != "dflash2":
        unused += [f"dflash_config.{field}={getattr(sub, field)}" for field in transform
                   if getattr(sub, field) is not None]
    if unused:
        warnings.warn(
            f"{source}: {', '.join(unused)} not applied: only a DFlash2 drafter scales and softcaps its logits, "
            f"with the values in `dflash_config` (SpecForge dflash2.py, vLLM qwen3_dflash2.py); this "
            f"{config.family} drafter's logits are the plain LM-head output",
            stacklevel=3,
        )


def replace(config: DflashConfig, **changes: Any) -> DflashConfig:
    """`config` with `changes` (by Python field name, e.g. `confidence_head_with_markov=True`), decoded and checked
    again as a config file is: a value of the wrong type, out of its bounds or inconsistent with the rest raises
    `ConfigError` naming the field (`msgspec.structs.replace` would check nothing)."""
    source = f"replace({', '.join(changes)})"
    try:
        changed = msgspec.convert(msgspec.to_builtins(msgspec.structs.replace(config, **changes)), DflashConfig)
    except msgspec.ValidationError as e:
        raise ConfigError(f"{source}: {e}") from None
    check(changed, source)
    return changed


def _non_finite(struct: msgspec.Struct, prefix: str = ""):
    """(field path, value) of every NaN / Inf float in a decoded config, nested blocks included.

    JSON has no NaN or Infinity, but Python's json accepts those literals and reads 1e999 as inf."""
    for field in msgspec.structs.fields(struct):
        value, name = getattr(struct, field.name), field.encode_name  # the name in the file
        if isinstance(value, msgspec.Struct):
            yield from _non_finite(value, f"{prefix}{name}.")
        elif isinstance(value, float) and not math.isfinite(value):
            yield f"{prefix}{name}", value

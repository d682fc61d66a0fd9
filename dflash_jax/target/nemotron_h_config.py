"""Config of NVIDIA's Nemotron-H / Nemotron 3 hybrid targets (transformers' `nemotron_h`, `NemotronHForCausalLM`).

The fields are transformers 5.25.0's `NemotronHConfig` (`models/nemotron_h/configuration_nemotron_h.py`), with its
defaults, decoded from the spellings configs ship:

- The blocks, one mixer each (`x + mixer(norm(x))`): `layers_block_type`, a list of names in the Hub's spelling
  (`mamba`, `moe`, `attention`, `mlp`: the released Nemotron 3 files) or transformers 5's (`linear_attention`,
  `moe`, `full_attention`, `mlp`: what `save_pretrained` writes; `layer_types` is its attribute alias), or the
  older `hybrid_override_pattern`, one letter a block (`M` Mamba-2, `E` MoE, `*` attention, `-` MLP). Where both
  are given they must agree (transformers silently takes the list). Held as transformers 5's names.
- `num_hidden_layers`: the number of blocks; derived when absent, refused when it disagrees (transformers 5.25
  only warns and takes the list's length).
- The Mamba-2 fields under their legacy names as well (transformers' `__post_init__`): `mamba_n_groups`
  (n_groups), `mamba_d_conv` (conv_kernel), `mamba_expand` (expand), `mamba_dt_min` / `mamba_dt_max`
  (time_step_min / max), `mamba_dt_limit` (time_step_limit), `mamba_dt_init_floor` (time_step_floor),
  `mamba_conv_bias` (use_conv_bias), `mamba_chunk_size` (chunk_size); and `num_local_experts`
  (n_routed_experts, an attribute alias). transformers lets the legacy name win over the current one; here a
  field stated under both names must agree. `mamba_d_state` (ssm_state_size) is taken too, although
  transformers 5.25 does not read it (it would keep `ssm_state_size`'s default of 128 and fail on the
  checkpoint's shapes).
- `time_step_limit`, the clamp of the Mamba time step dt (not `time_step_min/max`, the range `dt_bias` was
  initialised from): a pair however JSON spells infinity (`Infinity`, `1e999`, a string `"inf"`, or
  `{"__float__": "Infinity"}` as `save_pretrained` writes it); absent or null: `(0, inf)`, no clamp.

Read by the forward: the sizes, `layer_norm_epsilon`, the MoE router's `n_group` / `topk_group` /
`norm_topk_prob` / `routed_scaling_factor`. Accepted and not read, as transformers does not read them either:
`attention_bias` (its attention has no bias whatever the field says), `residual_in_fp32`, `sliding_window`,
`mamba_ssm_cache_dtype` (states are float32), `n_shared_experts` (always one shared expert), `expand`,
`time_step_min/max/floor`, `rope_theta` / `partial_rotary_factor` (no positional encoding at all), the
multi-token-prediction head's `num_nextn_predict_layers` / `mtp_layers_block_type` (not part of the target).

Refused (`ConfigError` naming the source and the field): an unknown block, a config that names no blocks
(transformers would invent a 4-block default), heads that do not divide (attention heads by KV heads, Mamba heads
by `n_groups`), experts that do not split into `n_group` groups, `moe_latent_size` (latent expert projections: not
implemented), and the variants the maths does not run: `mlp_hidden_act` other than relu2, `mamba_hidden_act` other
than silu, `use_bias` (Mamba projection biases), `use_conv_bias` false, `mlp_bias`. The shape of
`e_score_correction_bias` is a checkpoint matter (checked with the tensors).
"""

from __future__ import annotations

import math
from typing import Annotated, Any, ClassVar

import msgspec

from ..errors import ConfigError
from . import other_family
from .mamba2 import Mamba2Dims

__all__ = ["NemotronHConfig", "parse_nemotron_h_config", "ARCHITECTURES", "MODEL_TYPE"]

# The block kinds, as transformers 5 names them (`layers_block_type`), and the other spellings of each.
MAMBA, MOE, ATTENTION, MLP = "linear_attention", "moe", "full_attention", "mlp"
BLOCK_NAMES = {"mamba": MAMBA, MAMBA: MAMBA, "moe": MOE, "attention": ATTENTION, ATTENTION: ATTENTION, "mlp": MLP}
PATTERN_LETTERS = {"M": MAMBA, "E": MOE, "*": ATTENTION, "-": MLP}  # `hybrid_override_pattern`
LETTER = {kind: letter for letter, kind in PATTERN_LETTERS.items()}
ARCHITECTURES = ("NemotronHForCausalLM",)
MODEL_TYPE = "nemotron_h"

# The same field under another name (transformers 5.25 `NemotronHConfig.__post_init__` and `attribute_map`), plus
# `mamba_d_state`, which transformers does not read (module docstring).
ALIASES = {
    "mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_d_state": "ssm_state_size",
    "mamba_expand": "expand", "mamba_dt_min": "time_step_min", "mamba_dt_max": "time_step_max",
    "mamba_dt_limit": "time_step_limit", "mamba_dt_init_floor": "time_step_floor",
    "mamba_conv_bias": "use_conv_bias", "mamba_chunk_size": "chunk_size", "num_local_experts": "n_routed_experts",
    "layer_types": "layers_block_type",
}
NO_LIMIT = (0.0, math.inf)  # transformers' default `time_step_limit`: no clamp

MAX_DIM = 2**31 - 1  # every size fits int32 (JAX's index type), as `dflash_jax.config` bounds a drafter's
MAX_BLOCKS = 1024  # the released models have 52 (Nemotron 3 Nano 30B) to 118 blocks
Dim = Annotated[int, msgspec.Meta(gt=0, le=MAX_DIM)]
Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_DIM)]
Blocks = Annotated[int, msgspec.Meta(gt=0, le=MAX_BLOCKS)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]


class NemotronHConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """The `nemotron_h` fields (HF names; transformers 5.25's defaults), decoded by `parse_nemotron_h_config`.
    Frozen and hashable: a static `jax.jit` argument. `layers_block_type` is held in transformers 5's names
    whatever the file spelled; `num_hidden_layers` is its length. Implements `target.moe.MoeConfig` (the
    `num_experts` / `shared_expert_intermediate_size` properties)."""

    MODEL_TYPE: ClassVar[str] = MODEL_TYPE

    layers_block_type: tuple[str, ...] = ()
    num_hidden_layers: Blocks = 1
    vocab_size: Dim = 131072
    hidden_size: Dim = 4096
    tie_word_embeddings: bool = False
    max_position_embeddings: Dim = 4096
    layer_norm_epsilon: PositiveFloat = 1e-5
    # attention
    num_attention_heads: Dim = 32
    stated_num_key_value_heads: Dim | None = msgspec.field(default=8, name="num_key_value_heads")
    stated_head_dim: Dim | None = msgspec.field(default=128, name="head_dim")
    attention_bias: bool = False  # not read: transformers' attention has no bias whatever it says
    # MLP blocks and the experts
    intermediate_size: Dim = 21504
    mlp_hidden_act: str = "relu2"
    mlp_bias: bool = False
    # Mamba-2
    ssm_state_size: Dim = 128
    mamba_num_heads: Dim = 128
    mamba_head_dim: Dim = 64
    mamba_hidden_act: str = "silu"
    n_groups: Dim = 8
    conv_kernel: Dim = 4
    expand: Dim = 2
    time_step_min: float = 0.001
    time_step_max: float = 0.1
    time_step_limit: tuple[float, float] = NO_LIMIT
    time_step_floor: float = 1e-4
    use_conv_bias: bool = True
    use_bias: bool = False
    chunk_size: Dim = 128
    # MoE
    n_routed_experts: Dim = 8
    n_shared_experts: Count = 1
    moe_intermediate_size: Dim = 7688
    moe_shared_expert_intermediate_size: Dim = 7688
    moe_latent_size: Dim | None = None
    num_experts_per_tok: Dim = 2
    routed_scaling_factor: PositiveFloat = 1.0
    n_group: Dim = 1
    topk_group: Dim = 1
    norm_topk_prob: bool = True
    # identity
    eos_token_id: int | tuple[int, ...] | None = 2
    model_type: str | None = None
    architectures: tuple[str, ...] = ()

    @property
    def num_key_value_heads(self) -> int:
        """As stated, else `num_attention_heads` (transformers' fallback)."""
        return self.stated_num_key_value_heads or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        """As stated, else `hidden_size // num_attention_heads`."""
        return self.stated_head_dim or self.hidden_size // self.num_attention_heads

    @property
    def pattern(self) -> str:
        """The blocks as `hybrid_override_pattern` letters (M E * -)."""
        return "".join(LETTER[kind] for kind in self.layers_block_type)

    def blocks(self, kind: str) -> tuple[int, ...]:
        """The indices of the blocks of `kind` (`MAMBA`, `MOE`, `ATTENTION`, `MLP`), in model order."""
        return tuple(i for i, k in enumerate(self.layers_block_type) if k == kind)

    @property
    def mamba_dims(self) -> Mamba2Dims:
        """The Mamba-2 mixer's sizes (`target.mamba2`); its dt clamp is `time_step_limit`."""
        return Mamba2Dims(heads=self.mamba_num_heads, head_dim=self.mamba_head_dim, groups=self.n_groups,
                          state=self.ssm_state_size, conv_kernel=self.conv_kernel, chunk=self.chunk_size,
                          eps=self.layer_norm_epsilon, time_step_min=self.time_step_limit[0],
                          time_step_max=self.time_step_limit[1])

    @property
    def in_proj_rows(self) -> int:
        """The rows of a Mamba block's `in_proj`: z (d_inner), x (d_inner), B and C (G N each), dt (heads)."""
        return self.mamba_dims.d_inner + self.mamba_dims.conv_dim + self.mamba_num_heads

    # `target.moe.MoeConfig`'s names for the MoE sizes
    @property
    def num_experts(self) -> int:
        return self.n_routed_experts

    @property
    def shared_expert_intermediate_size(self) -> int:
        return self.moe_shared_expert_intermediate_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        eos = self.eos_token_id
        return () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)


def _float_value(value: Any, source: str, field: str) -> float:
    """One bound of `time_step_limit` as a float: a JSON number (`Infinity` and `1e999` arrive as inf), a string
    Python's `float` reads (`"inf"`, `"Infinity"`), or transformers' tag `{"__float__": "Infinity"}`."""
    tagged = value.get("__float__") if isinstance(value, dict) and len(value) == 1 else None
    if isinstance(tagged, str):
        value = tagged
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    elif isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    raise ConfigError(f"{source}: {field} holds {value!r}; expected a number (Infinity, 1e999, \"inf\" or "
                      "{\"__float__\": \"Infinity\"} for no upper bound)")


def _time_step_limit(value: Any, source: str, field: str) -> tuple[float, float]:
    """`time_step_limit` as `(low, high)`, `0 <= low <= high`, low finite (null: no clamp)."""
    if value is None:
        return NO_LIMIT
    if not isinstance(value, list | tuple) or len(value) != 2:
        raise ConfigError(f"{source}: {field} is {value!r}; expected a pair [low, high] (or null: no clamp)")
    low, high = (_float_value(v, source, field) for v in value)
    if math.isnan(low) or math.isnan(high) or not 0 <= low <= high or math.isinf(low):
        raise ConfigError(f"{source}: {field} is [{low}, {high}]; expected 0 <= low <= high, low finite")
    return low, high


def _blocks(raw: dict[str, Any], source: str) -> tuple[str, ...]:
    """The block kinds from `layers_block_type` and/or `hybrid_override_pattern` (module docstring)."""
    listed, pattern = raw.get("layers_block_type"), raw.get("hybrid_override_pattern")
    from_list = from_pattern = None
    if listed is not None:
        if not isinstance(listed, list | tuple):
            raise ConfigError(f"{source}: layers_block_type is {listed!r}; expected a list of block names")
        kinds = []
        for i, name in enumerate(listed):
            if not isinstance(name, str) or name not in BLOCK_NAMES:
                raise ConfigError(
                    f"{source}: layers_block_type[{i}] is {name!r}; expected one of "
                    f"{', '.join(map(repr, BLOCK_NAMES))} (the Hub's or transformers 5's names)")
            kinds.append(BLOCK_NAMES[name])
        from_list = tuple(kinds)
    if pattern is not None:
        if not isinstance(pattern, str):
            raise ConfigError(f"{source}: hybrid_override_pattern is {pattern!r}; expected a string of M, E, * and -")
        for i, letter in enumerate(pattern):
            if letter not in PATTERN_LETTERS:
                raise ConfigError(
                    f"{source}: hybrid_override_pattern[{i}] is {letter!r} (in {pattern!r}); expected one of "
                    f"{', '.join(PATTERN_LETTERS)} (Mamba-2, MoE, attention, MLP)")
        from_pattern = tuple(PATTERN_LETTERS[letter] for letter in pattern)
    if from_list is not None and from_pattern is not None and from_list != from_pattern:
        spelled = "".join(LETTER[k] for k in from_list)
        raise ConfigError(f"{source}: layers_block_type ({spelled} as a pattern) disagrees with "
                          f"hybrid_override_pattern ({pattern}); expected one of them, or the same blocks in both")
    blocks = from_list if from_list is not None else from_pattern
    if not blocks:
        raise ConfigError(f"{source}: no blocks: layers_block_type and hybrid_override_pattern are "
                          f"{'both absent' if blocks is None else 'empty'}; expected the block kinds of the model")
    return blocks


def _routing_problems(c: NemotronHConfig) -> list[str]:
    """What the MoE router cannot run: more experts a token than there are, or than its groups hold."""
    problems = []
    if c.num_experts_per_tok > c.n_routed_experts:
        problems.append(f"num_experts_per_tok={c.num_experts_per_tok} exceeds n_routed_experts={c.n_routed_experts}")
    if c.n_routed_experts % c.n_group:
        problems.append(f"n_routed_experts={c.n_routed_experts} is not a multiple of n_group={c.n_group}")
    elif c.n_group > 1 and c.n_routed_experts // c.n_group < 2:
        problems.append(f"n_group={c.n_group} leaves fewer than 2 experts a group (a group's score is its top 2)")
    elif c.topk_group > c.n_group:
        problems.append(f"topk_group={c.topk_group} exceeds n_group={c.n_group}")
    elif c.num_experts_per_tok > (reachable := c.topk_group * (c.n_routed_experts // c.n_group)):
        problems.append(f"num_experts_per_tok={c.num_experts_per_tok} exceeds the {reachable} experts of "
                        f"topk_group={c.topk_group} groups")
    return problems


def parse_nemotron_h_config(raw: dict[str, Any], source: str = "<config>") -> NemotronHConfig:
    """Decode a `nemotron_h` config dict (module docstring): a `ConfigError` naming `source` and the field for
    anything this target does not run."""
    raw = dict(raw)
    for alias, field in ALIASES.items():
        if alias in raw:
            value = raw.pop(alias)
            if field in raw and raw[field] != value:
                raise ConfigError(f"{source}: {alias} ({value!r}) disagrees with {field} ({raw[field]!r}); they "
                                  "name the same field: expected one of them, or the same value in both")
            raw[field] = value
    blocks = _blocks(raw, source)
    raw.pop("hybrid_override_pattern", None)
    raw["layers_block_type"] = list(blocks)
    stated_layers = raw.get("num_hidden_layers")
    if stated_layers is not None and stated_layers != len(blocks):
        raise ConfigError(f"{source}: num_hidden_layers={stated_layers!r} but the blocks number {len(blocks)} "
                          f"({''.join(LETTER[k] for k in blocks)}); expected them to agree (or no num_hidden_layers)")
    raw["num_hidden_layers"] = len(blocks)
    raw["time_step_limit"] = list(_time_step_limit(raw.get("time_step_limit"), source, "time_step_limit"))
    try:
        c = msgspec.convert(raw, NemotronHConfig)
    except msgspec.ValidationError as e:
        raise ConfigError(f"{source}: {e}") from None

    problems = []
    if c.model_type not in (None, MODEL_TYPE):
        problems.append(other_family(raw, repr(MODEL_TYPE)))
    if c.num_attention_heads % c.num_key_value_heads:
        problems.append(f"num_attention_heads={c.num_attention_heads} is not a multiple of "
                        f"num_key_value_heads={c.num_key_value_heads}")
    if c.mamba_num_heads % c.n_groups:
        problems.append(f"mamba_num_heads={c.mamba_num_heads} is not a multiple of n_groups={c.n_groups} (each "
                        "group's B and C serve whole heads)")
    if c.moe_latent_size is not None:
        problems.append(f"moe_latent_size={c.moe_latent_size}: latent expert projections (fc1/fc2_latent_proj) are "
                        "not implemented; expected null")
    if c.blocks(MOE):  # the routing fields of a model without MoE blocks are not read
        problems += _routing_problems(c)
    for field, act, implemented in (("mlp_hidden_act", c.mlp_hidden_act, "relu2"),
                                    ("mamba_hidden_act", c.mamba_hidden_act, "silu")):
        if act != implemented:
            problems.append(f"{field} is {act!r}; only {implemented!r} is implemented")
    for field, flag, released in (("use_bias", c.use_bias, False), ("use_conv_bias", c.use_conv_bias, True),
                                  ("mlp_bias", c.mlp_bias, False)):
        if flag != released:
            problems.append(f"{field}={str(flag).lower()} is not implemented (released Nemotron-H models have "
                            f"{str(released).lower()})")
    if problems:
        raise ConfigError(f"{source}: " + "; ".join(problems))
    return c

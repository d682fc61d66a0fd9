"""Rotary position embeddings, shared by the drafters and the targets: the config fields they read, the frequencies
(plain, YaRN, Llama 3, Gemma 4's proportional) as transformers computes them, the cos/sin tables, the rotation.

Neox rotate-half layout; angles `position * inv_freq` formed in float32 exactly as transformers does (`inv_freq` in
float32: `modeling_rope_utils.py`), so float32 runs compare with the PyTorch references to rounding. Pure maths and
the config protocol: no I/O, no config file parsing (a config's `rope_scaling` block is decoded into `RopeScaling`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Annotated, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import msgspec
import numpy as np

__all__ = ["RopeConfig", "RopeScaling", "Rope", "rope_frequencies", "rope_tables", "apply_rope"]

Positive = Annotated[int, msgspec.Meta(gt=0)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]

# transformers' Qwen3Config default, used by YaRN when a config states no max_position_embeddings.
_QWEN3_DEFAULT_MAX_POSITIONS = 32768


@runtime_checkable
class RopeConfig(Protocol):
    """What `rope_frequencies` / `rope_tables` read: the drafters' `DflashConfig` and the targets'
    `target.DecoderConfig` both provide it."""

    @property
    def head_dim(self) -> int: ...

    @property
    def rope_theta(self) -> float: ...

    @property
    def rope_type(self) -> str: ...

    @property
    def rope_scaling(self) -> RopeScaling | None: ...

    @property
    def max_position_embeddings(self) -> int | None: ...

    def __hash__(self) -> int: ...  # `rope_frequencies` caches by config


class RopeScaling(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """HF `rope_scaling` / `rope_parameters` block (only the fields RoPE variants read)."""

    rope_type: str | None = None
    type: str | None = None  # pre-4.45 transformers name of rope_type
    factor: PositiveFloat | None = None
    beta_fast: PositiveFloat | None = None  # YaRN takes log(original / (beta * 2 pi)): <= 0 has none
    beta_slow: PositiveFloat | None = None
    original_max_position_embeddings: Positive | None = None
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool | None = None
    low_freq_factor: PositiveFloat | None = None  # Llama 3 (`rope_type: llama3`)
    high_freq_factor: PositiveFloat | None = None
    partial_rotary_factor: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None  # `proportional` (Gemma 4)


ROPE_SCALARS = ("factor", "beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim",
                "low_freq_factor", "high_freq_factor")  # RopeScaling's float fields


def rope_problems(config: RopeConfig) -> list[str]:
    """What would make the RoPE tables wrong: an odd `head_dim` (rotary embeddings turn pairs of dimensions, and
    the frequencies, `ceil(d / 2)` of them, would not fit the `d // 2` pairs: a shape error or a silent
    misrotation), and the RoPE scalars (`rope_theta`, the `rope_scaling` floats) whose float32 rounding is 0, Inf or
    subnormal though the value is not 0: the tables are computed in float32, where such a value (a Llama 3 `factor`
    of 1e-50, a `low_freq_factor` of 1e39) divides by zero or overflows and makes every logit NaN."""
    problems = []
    if config.head_dim % 2:
        problems.append(f"head_dim={config.head_dim} is odd; rotary embeddings turn pairs of dimensions, so it must "
                        "be even")
    tiny = float(np.finfo(np.float32).tiny)
    scaling = config.rope_scaling
    values = [("rope_theta", config.rope_theta)] + [
        (f"rope_scaling.{f}", getattr(scaling, f)) for f in ROPE_SCALARS if scaling is not None]
    for name, value in values:
        if value is None or value == 0 or not math.isfinite(value):
            continue  # 0 where allowed (mscale), and NaN/Inf, are the bounds' and `_non_finite`'s to refuse
        with np.errstate(over="ignore"):  # the overflow to Inf is what is looked for
            rounded = abs(float(np.float32(value)))
        if rounded == 0 or rounded < tiny or math.isinf(rounded):
            what = "0" if rounded == 0 else "Inf" if math.isinf(rounded) else "a subnormal number"
            problems.append(f"{name}={value:g} is {what} in float32, in which RoPE is computed; expected a value of "
                            f"magnitude in [{tiny:.3g}, {float(np.finfo(np.float32).max):.3g}]")
    return problems


def declared_rope_type(scaling: RopeScaling | None) -> str:
    if scaling is None:
        return "default"
    return scaling.rope_type or scaling.type or "default"




@functools.lru_cache(maxsize=64)
def rope_frequencies(config: RopeConfig) -> tuple[np.ndarray, float]:
    """`(inv_freq [d_h/2] float32, attention_scaling)` as transformers computes them.

    Default: `inv_freq = 1 / theta ** (arange(0, d, 2) / d)` in float32, scaling 1. YaRN follows transformers 5's
    `_compute_yarn_parameters`: `factor` as stated (derived from max/original positions only when absent),
    the attention factor from `attention_factor`, else the mscale/mscale_all_dim ratio, else
    `0.1 ln(factor) + 1`; the correction range from beta_fast/beta_slow (defaults 32/1) against
    `original_max_position_embeddings` (default `max_position_embeddings`), truncated unless `truncate=False`.
    """
    d = config.head_dim
    theta = np.float32(config.rope_theta)
    exponents = np.arange(0, d, 2, dtype=np.float32) / np.float32(d)  # [d/2]
    pos_freqs = theta**exponents  # [d/2] f32
    if config.rope_type == "llama3":
        return _llama3_frequencies((np.float32(1.0) / pos_freqs).astype(np.float32), config.rope_scaling), 1.0
    if config.rope_type == "proportional":
        return _proportional_frequencies(pos_freqs, config.rope_scaling), 1.0
    if config.rope_type != "yarn":
        return (np.float32(1.0) / pos_freqs).astype(np.float32), 1.0

    s = config.rope_scaling
    assert s is not None  # rope type "yarn" is declared only by a rope_scaling block (`declared_rope_type`)
    max_positions = config.max_position_embeddings or _QWEN3_DEFAULT_MAX_POSITIONS
    original = s.original_max_position_embeddings or max_positions
    factor = s.factor if s.factor is not None else max_positions / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_scaling = s.attention_factor
    if attention_scaling is None:
        if s.mscale and s.mscale_all_dim:
            attention_scaling = mscale(factor, s.mscale) / mscale(factor, s.mscale_all_dim)
        else:
            attention_scaling = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return d * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(config.rope_theta))

    low, high = correction_dim(s.beta_fast or 32), correction_dim(s.beta_slow or 1)
    if s.truncate is not False:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(d // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation = np.float32(1) - ramp.astype(np.float32)  # 1: keep the original frequency
    inv_freq = (np.float32(1) / (np.float32(factor) * pos_freqs)) * (np.float32(1) - extrapolation) + (
        np.float32(1) / pos_freqs
    ) * extrapolation
    return inv_freq.astype(np.float32), float(attention_scaling)


def _llama3_frequencies(inv_freq: np.ndarray, s) -> np.ndarray:
    """Llama 3.x `llama3` scaling (transformers' `_compute_llama3_parameters`), in float32: wavelengths longer than
    `original / low_freq_factor` are divided by `factor`, shorter than `original / high_freq_factor` kept, and
    those between interpolated smoothly."""
    factor, low, high = np.float32(s.factor), np.float32(s.low_freq_factor), np.float32(s.high_freq_factor)
    original = np.float32(s.original_max_position_embeddings)
    wavelen = np.float32(2 * math.pi) / inv_freq  # [d/2]
    scaled = np.where(wavelen > original / low, inv_freq / factor, inv_freq).astype(np.float32)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (np.float32(1) - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _proportional_frequencies(pos_freqs: np.ndarray, s) -> np.ndarray:
    """Gemma 4's `proportional` RoPE (transformers' `_compute_proportional_rope_parameters`), in float32: the first
    `int(partial_rotary_factor * d_h // 2)` frequencies of the full head's `1 / theta ** (2i / d_h)`, the rest 0
    (those pairs are not rotated), all divided by `factor`."""
    partial = s.partial_rotary_factor if s is not None and s.partial_rotary_factor is not None else 1.0
    factor = s.factor if s is not None and s.factor is not None else 1.0
    rotated = int(partial * (2 * len(pos_freqs)) // 2)  # rotated pairs, as transformers rounds them (d_h = 2 x pairs)
    inv_freq = np.float32(1.0) / pos_freqs  # [d/2]
    inv_freq[rotated:] = 0
    return (inv_freq / np.float32(factor)).astype(np.float32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Rope:
    """cos/sin tables for a set of rows, `[batch, rows, d_h]` float32 (attention scaling folded in)."""

    cos: jax.Array
    sin: jax.Array


def rope_tables(config: RopeConfig, positions: jax.Array) -> Rope:
    """cos/sin at integer `positions` `[batch, rows]`; angles `position * inv_freq` formed in float32."""
    inv_freq, scaling = rope_frequencies(config)
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [batch, rows, d/2]
    angles = jnp.concatenate([angles, angles], axis=-1)  # [batch, rows, d]
    return Rope(jnp.cos(angles) * scaling, jnp.sin(angles) * scaling)


def apply_rope(x: jax.Array, rope: Rope) -> jax.Array:
    """Rotate `x [batch, rows, heads, d_h]` (neox rotate-half) in float32; returns x's dtype."""
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)  # rotate_half
    cos, sin = rope.cos[:, :, None, :], rope.sin[:, :, None, :]  # [batch, rows, 1, d]
    return (xf * cos + rotated * sin).astype(x.dtype)

"""YaRN's optional branches (`attention_factor`, `mscale` / `mscale_all_dim`, `truncate=False`) against the
formulas of transformers' `_compute_yarn_parameters` (src/transformers/modeling_rope_utils.py), written out here
in float64 (Peng et al. 2023, "YaRN", arXiv:2309.00071): no compiled program, only the host-side tables."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dflash_jax.config import parse_config
from dflash_jax.rope import rope_frequencies
from dflash_jax.testing import preset_dict

D, THETA, FACTOR, ORIGINAL = 16, 10000.0, 4.0, 64  # tiny-dspark: head_dim 16, YaRN factor 4 over 64 positions


def yarn_config(**scaling):
    """tiny-dspark's config with its YaRN block extended by `scaling`."""
    raw = preset_dict("tiny-dspark")
    assert raw["head_dim"] == D and raw["rope_theta"] == THETA
    return parse_config({**raw, "rope_scaling": {**raw["rope_scaling"], **scaling}})


def get_mscale(scale: float, mscale: float = 1.0) -> float:
    """transformers' `get_mscale`: `0.1 * mscale * ln(scale) + 1`, 1 for scale <= 1."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(beta_fast: float = 32.0, beta_slow: float = 1.0, truncate: bool = True) -> np.ndarray:
    """transformers' YaRN inverse frequencies: a linear ramp over the correction range [low, high] (dimensions
    whose wavelength makes beta_fast .. beta_slow rotations over the original context) blends interpolated
    (`1 / (factor * theta^(2i/d))`) and original frequencies; the bounds floored / ceiled unless truncate=False."""

    def correction_dim(rotations: float) -> float:
        return D * math.log(ORIGINAL / (rotations * 2 * math.pi)) / (2 * math.log(THETA))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, D - 1)
    pos_freqs = THETA ** (np.arange(0, D, 2) / D)  # [d/2] float64
    ramp = np.clip((np.arange(D // 2) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # 1: the original frequency
    return 1 / (FACTOR * pos_freqs) * (1 - extrapolation) + 1 / pos_freqs * extrapolation


def test_attention_factor_is_taken_as_stated():
    """`attention_factor` given: the cos/sin scaling is exactly it; the frequencies are the plain YaRN ones."""
    freq, scaling = rope_frequencies(yarn_config(attention_factor=0.75, mscale=2.0, mscale_all_dim=1.0))
    assert scaling == 0.75  # wins over mscale / mscale_all_dim
    np.testing.assert_allclose(freq, yarn_inv_freq(), rtol=1e-6)


@pytest.mark.parametrize("mscale, mscale_all_dim", [(1.0, 0.5), (0.707, 0.707), (2.0, 1.0)])
def test_mscale_ratio(mscale, mscale_all_dim):
    """`mscale` and `mscale_all_dim` both given (DeepSeek-style): the scaling is their get_mscale ratio."""
    _, scaling = rope_frequencies(yarn_config(mscale=mscale, mscale_all_dim=mscale_all_dim))
    expected = get_mscale(FACTOR, mscale) / get_mscale(FACTOR, mscale_all_dim)
    assert scaling == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("scaling_fields", [{}, {"mscale": 2.0}, {"mscale_all_dim": 2.0}, {"mscale": 0.0}])
def test_default_attention_factor(scaling_fields):
    """Without `attention_factor` and without both mscales: `0.1 ln(factor) + 1`, whatever one mscale says."""
    _, scaling = rope_frequencies(yarn_config(**scaling_fields))
    assert scaling == pytest.approx(get_mscale(FACTOR), rel=1e-12)


@pytest.mark.parametrize("beta_fast, beta_slow", [(32.0, 1.0), (8.0, 2.0)])
def test_truncate_false_keeps_the_fractional_correction_range(beta_fast, beta_slow):
    """`truncate=False` ramps between the real-valued bounds; the default rounds them outwards (floor / ceil),
    which moves the ramp: the two frequency tables differ."""
    kept = rope_frequencies(yarn_config(beta_fast=beta_fast, beta_slow=beta_slow, truncate=False))[0]
    rounded = rope_frequencies(yarn_config(beta_fast=beta_fast, beta_slow=beta_slow))[0]
    np.testing.assert_allclose(kept, yarn_inv_freq(beta_fast, beta_slow, truncate=False), rtol=1e-6)
    np.testing.assert_allclose(rounded, yarn_inv_freq(beta_fast, beta_slow, truncate=True), rtol=1e-6)
    assert not np.allclose(kept, rounded, rtol=1e-3)

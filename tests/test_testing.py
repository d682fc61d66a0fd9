"""The planned tensor sets of released drafters match what their checkpoints are known to hold."""

import math

import pytest

from dflash_jax.testing import full_plan, presets, random_drafter, resolve_config


@pytest.mark.parametrize(
    "preset,tensors,shapes",
    [
        # z-lab/Qwen3.6-35B-A3B-DFlash (2026-04-27): 91 BF16 tensors, 948 MB (the Rust loader's verified count)
        ("zlab-qwen3.6-35b-a3b-dflash-v2", 91, {"fc.weight": (2048, 10240)}),
        # RadixArk/Qwen3.8-27B-DSpark: 62 tensors, incl. the Markov and confidence heads
        ("radixark-qwen3.8-27b-dspark", 62, {"markov_head.markov_w1.weight": (248320, 256),
                                              "confidence_head.proj.weight": (1, 5376)}),
        # DFlash2 fixture: 11 per layer + 4 conv tensors per layer + 3 selector tensors + fc/norms
        ("muse-glimmer-dflash2", 3 + 5 * 15 + 3, {"layers.0.attention_conv.kernel_projection.weight": (1664, 6656)}),
    ],
)
def test_released_checkpoints_tensor_sets(preset, tensors, shapes):
    plan = {t.name: t.shape for t in full_plan(resolve_config(preset)[0])}
    assert len(plan) == tensors
    for name, shape in shapes.items():
        assert plan[name] == shape


def test_reference_workload_size():
    config, _ = resolve_config("zlab-qwen3.6-35b-a3b-dflash-v2")
    nbytes = sum(2 * math.prod(t.shape) for t in full_plan(config))
    assert round(nbytes / 1e6) == 948


def test_presets_and_random_drafter():
    assert {"tiny-dflash", "tiny-dflash2", "tiny-dspark", "zlab-qwen3-8b-dflash-b16"} <= set(presets())
    drafter = random_drafter("tiny-dflash2", seed=1)
    assert drafter.embedding.shape == (128, 64) and len(drafter.params["layers"]) == 2
    with pytest.raises(ValueError, match="unknown preset"):
        resolve_config("no-such-drafter")

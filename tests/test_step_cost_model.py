"""Step costs predicted before the first step (`dflash_jax.step_cost_model`): what a forward reads and computes,
the routed experts a MoE forward's rows reach, and the costs' ratios the adaptive policy chooses by. The loop
choosing by them: tests/test_adaptive.py, tests/test_generate.py."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.draft_policy import Policy, predicted_costs
from dflash_jax.drafting import init_cache
from dflash_jax.step_cost_model import ModelReads, forward_seconds, model_reads, predict_costs
from dflash_jax.testing import random_drafter, random_qwen3
from dflash_jax.tuning import CPU_RATES, TUNING

H100 = TUNING["NVIDIA H100 80GB HBM3"].step_rates


def test_a_forward_reads_the_experts_its_rows_route_to():
    """Under uniform routing `rows` rows reach `E (1 - (1 - k/E)^rows)` distinct experts of a layer's E: one row its
    k, 17 rows of Nemotron-H (6 of 128) about 71, as docs/benchmarks.md counts them; a dense model reads none."""
    moe = ModelReads(1.0, 1.0, expert_bytes=128.0, expert_count=128.0, experts=128, experts_per_row=6)
    assert moe.expert_share(1) * 128 == pytest.approx(6)
    assert moe.expert_share(17) * 128 == pytest.approx(71.4, abs=0.1)
    assert ModelReads(1.0, 1.0).expert_share(17) == 0.0
    # The few-row path that gathers each (row, expert) pair's weights reads 102 experts' bytes for those 17 rows, up
    # to its pair limit; past it the tiles read each distinct expert once.
    gathering = ModelReads(1.0, 1.0, expert_bytes=128.0, expert_count=128.0, experts=128, experts_per_row=6,
                           pairs_read_up_to=102)
    assert gathering.expert_share(17) * 128 == pytest.approx(102)
    assert gathering.expert_share(18) == pytest.approx(moe.expert_share(18))


def test_weights_caches_and_experts_are_counted_apart():
    params = {"layers": {"experts": {"down_proj": np.zeros((4, 2, 3), np.float32)}, "w": np.zeros((3, 3), np.float32)}}
    cache = {"k": np.zeros((2, 5), np.float32)}
    reads = model_reads(params, cache, layers=2, experts=4, experts_per_row=1, extra=(np.zeros(7, np.float32), None))
    assert (reads.weight_bytes, reads.weight_count) == (4 * (9 + 7), 9 + 7)
    assert (reads.expert_bytes, reads.expert_count, reads.cache_bytes) == (4 * 24, 24, 4 * 10)
    dense = model_reads(params, cache, layers=2)  # no experts given: every weight is read by every row
    assert dense.weight_bytes == 4 * 33 and dense.expert_bytes == 0


def test_a_verify_costs_what_its_reads_and_products_cost():
    """A memory-bound forward costs its bytes at the read rate plus its layers' fixed cost; one with many rows its
    FLOPs at the GEMM rate. A step of l drafts adds the drafter's forward on its block to the target's on l + 1
    rows; a plain step is the target's on one. A MoE target's verify is dearer, over its plain step, than a dense
    target's of the same bytes: its rows reach more experts."""
    gb = 1e9
    dense = ModelReads(16 * gb, 8e9, layers=36)
    assert forward_seconds(dense, 1, H100) == pytest.approx(16 * gb / H100.read_bytes_per_s + 36 * H100.layer_seconds)
    assert forward_seconds(dense, 4096, H100) == pytest.approx(2 * 4096 * 8e9 / H100.flops_per_s
                                                               + 36 * H100.layer_seconds)
    drafter = ModelReads(2 * gb, 1e9, layers=5)
    costs = predict_costs(dense, drafter, (0, 3, 7, 16), 16, 1, "NVIDIA H100 80GB HBM3", H100)
    assert costs.draft_lengths == (0, 3, 7, 16) and costs.batch == 1
    assert list(costs.seconds) == sorted(costs.seconds)
    drafting = forward_seconds(drafter, 17, H100)
    assert costs.seconds[1] - costs.seconds[0] == pytest.approx(drafting, rel=0.05)  # 4 rows read as 1 does
    moe = ModelReads(4 * gb, 2e9, expert_bytes=12 * gb, expert_count=6e9, experts=128, experts_per_row=6, layers=36)
    moe_costs = predict_costs(moe, drafter, (0, 3, 7, 16), 16, 1, "NVIDIA H100 80GB HBM3", H100)
    ratio = [t / c.seconds[0] for c in (costs, moe_costs) for t in c.seconds[-1:]]
    assert ratio[1] > 1.5 * ratio[0]


def test_a_markov_walk_reads_its_weight_once_a_draft():
    """A DSpark drafter draws its K drafts one after another, each through `markov_w2`: its drafting step reads
    that weight K times, the forward's once plus K - 1 sequential reads, each with a layer's fixed cost (rank 512 at
    a Qwen3-8B vocabulary: 155 MB, 15 times, 1.15 ms more at the H100's rates)."""
    gb = 1e9
    forward = ModelReads(3.6 * gb, 1.8e9, layers=5)
    walked = ModelReads(3.6 * gb, 1.8e9, layers=5, walk_bytes=0.155 * gb, walk_steps=15)
    extra = forward_seconds(walked, 17, H100) - forward_seconds(forward, 17, H100)
    assert extra == pytest.approx(15 * (0.155 * gb / H100.read_bytes_per_s + H100.layer_seconds))
    drafter = random_drafter("tiny-dspark", dtype=jnp.float32)
    w2 = drafter.params["markov_head"]["markov_w2"]["weight"]
    reads = model_reads(drafter.params, None, 1, walk=w2, walk_steps=drafter.config.num_draft_tokens - 1)
    assert (reads.walk_bytes, reads.walk_steps) == (w2.nbytes, drafter.config.num_draft_tokens - 1)


def test_the_run_predicts_from_its_models_and_caches():
    """`draft_policy.predicted_costs` reads the target, the drafter with the target's LM head attached and both
    caches as the run allocates them, at the CPU's rates off a GPU: the longer verifies cost more, and a cache
    four times as long costs more at every length."""
    target = random_qwen3("tiny-qwen3", seed=1, dtype=jnp.float32)
    drafter = random_drafter("tiny-dflash", dtype=jnp.float32).attach(embed=target.embed, lm_head=target.lm_head)
    policy = Policy((0, 3, 7), True)

    def predicted(capacity):
        caches = target.init_cache(2, capacity), init_cache(drafter, 2, capacity)
        return predicted_costs(target, drafter, *caches, 2, policy)

    short, long = predicted(256), predicted(1024)
    assert short.device == "cpu" and short.batch == 2 and list(short.seconds) == sorted(short.seconds)
    assert all(b > a for a, b in zip(short.seconds, long.seconds))
    reads = model_reads(target, None, target.num_layers)
    assert short.seconds[0] > forward_seconds(reads, 2, CPU_RATES)  # the cache and the step's own cost on top
    dspark = random_drafter("tiny-dspark", dtype=jnp.float32).attach(embed=target.embed, lm_head=target.lm_head)
    caches = target.init_cache(2, 256), init_cache(dspark, 2, 256)
    walked = predicted_costs(target, dspark, *caches, 2, policy)
    w2 = dspark.params["markov_head"]["markov_w2"]["weight"]
    walk = (dspark.config.num_draft_tokens - 1) * (w2.nbytes / CPU_RATES.read_bytes_per_s + CPU_RATES.layer_seconds)
    assert walked.seconds[1] - walked.seconds[0] > walk  # the drafter's forward, and its walk

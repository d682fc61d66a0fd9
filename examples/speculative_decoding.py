"""Speculative decoding on a CPU with tiny random models, in under a minute.

Writes a tiny Qwen3 target and tiny drafters to a temporary directory, loads them the way real checkpoints are
loaded, and compares plain greedy decoding with speculative decoding:

1. a random DFlash drafter: nearly every draft is rejected (acceptance length about 1), the output is still
   the target's own, and speculation at the fixed draft length costs more than it saves. The adaptive policy
   (the default) predicts what a step of each draft length costs from the models and the device (docs/generate.md,
   "Cost model"; runs this short are too short to measure them in) and turns to plain target steps once the
   drafts prove wrong (the example prints how many tokens came from them): about greedy's speed, which this
   single timed run on a busy CPU shows only roughly (`benchmarks/adaptive.py --small --fresh` measures it, with
   repeats: docs/benchmarks.md);
2. a target rebuilt to follow a fixed successor map and a DSpark drafter whose Markov head walks that map:
   nearly whole blocks are accepted, which is where speculation pays.

Each configuration runs once to compile, then once timed.   python examples/speculative_decoding.py
"""

from __future__ import annotations

import copy
import tempfile

import jax.numpy as jnp
import numpy as np

import dflash_jax
from dflash_jax.generate import greedy_generate, speculative_generate
from dflash_jax.target.dense import Qwen3Target
from dflash_jax.testing import (
    preset_dict,
    successor_drafter,
    successor_target,
    write_checkpoint,
    write_qwen3_checkpoint,
)

PROMPTS = [[5, 17, 99, 3], [120, 4, 33, 8, 61, 2], [9, 9, 9, 9]]
MAX_NEW = 96


def timed(run):
    run()  # compile
    return run()


def report(name, result, reference=None):
    line = f"{name:<46} {result.decode_tokens_per_second:8.0f} tokens/s"
    if reference is not None:
        same = "same tokens as greedy" if result.tokens == reference.tokens else "DIFFERENT from greedy"
        line += f", mean acceptance length {result.mean_acceptance_length:.2f} ({same})"
    print(line)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        write_qwen3_checkpoint(f"{tmp}/target", "tiny-qwen3")
        write_checkpoint(f"{tmp}/dflash", "tiny-dflash")
        dspark = copy.deepcopy(preset_dict("tiny-dspark"))
        dspark["markov_rank"] = dspark["dspark_config"]["markov_rank"] = 128  # rank = vocab: an exact map
        write_checkpoint(f"{tmp}/dspark", dspark)

        target = Qwen3Target.from_pretrained(f"{tmp}/target", dtype=jnp.float32)
        dflash = dflash_jax.load_drafter(f"{tmp}/dflash", dtype=jnp.float32)
        dspark = dflash_jax.load_drafter(f"{tmp}/dspark", dtype=jnp.float32)

    print(f"{len(PROMPTS)} prompts x {MAX_NEW} new tokens, batch decoding, tokens/s of the decode loop\n")
    greedy = timed(lambda: greedy_generate(target, PROMPTS, max_new_tokens=MAX_NEW))
    report("random target, greedy", greedy)
    spec = timed(lambda: speculative_generate(target, dflash, PROMPTS, max_new_tokens=MAX_NEW, draft_length="fixed"))
    report("random target, random DFlash drafter", spec, greedy)
    adaptive = dflash_jax.Adaptive()  # predicts the step costs (measures them in a run long enough, and keeps them)
    spec = timed(lambda: speculative_generate(target, dflash, PROMPTS, max_new_tokens=MAX_NEW,
                                              draft_length=adaptive))
    report("random target, random DFlash drafter, adaptive", spec, greedy)
    measured = "measured" if adaptive.calibration.measured else "predicted"
    print(f"    {sum(spec.plain_tokens)} of {spec.num_tokens} tokens from plain target steps; step costs {measured}")

    successor = np.random.default_rng(0).permutation(target.config.vocab_size)
    follower = successor_target(target, successor)
    oracle = successor_drafter(dspark, successor)
    greedy = timed(lambda: greedy_generate(follower, PROMPTS, max_new_tokens=MAX_NEW))
    report("successor target, greedy", greedy)
    adaptive = dflash_jax.Adaptive()
    spec = timed(lambda: speculative_generate(follower, oracle, PROMPTS, max_new_tokens=MAX_NEW,
                                              draft_length=adaptive))
    report("successor target, DSpark drafter walking it", spec, greedy)


if __name__ == "__main__":
    main()

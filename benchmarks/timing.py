"""The benchmarks' one timing loop: wall seconds of repeated calls, each waited on, after untimed warm-up calls."""

import time
from collections.abc import Callable
from typing import Any

import jax


def call_seconds(run: Callable[[], Any], repeats: int, warmup: int = 1) -> list[float]:
    """Seconds of each of `repeats` calls of `run()` (until its outputs are ready), after `warmup` untimed calls
    (compilation, and a second call where the first's output shardings differ from its inputs')."""
    for _ in range(warmup):
        jax.block_until_ready(run())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(run())
        times.append(time.perf_counter() - start)
    return times

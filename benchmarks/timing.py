"""The benchmarks' one timing loop (wall seconds of repeated calls, each waited on, after untimed warm-up calls), and
the read rate their floors use."""

import json
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


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


def read_rate(gib: float = 4) -> float:
    """Bytes/s of `jnp.sum` over a bf16 array of `gib` GiB (one read): the device's read rate, the floors' unit."""
    x = jnp.ones((int(gib * 2**30) // 2,), jnp.bfloat16)
    f = jax.jit(lambda x: jnp.sum(x, dtype=jnp.float32))
    return x.nbytes / min(call_seconds(lambda: f(x), 5))


def matmul_rate(n: int) -> float:
    """FLOP/s of one bf16 `[n, n] @ [n, n]` (the fastest of 5)."""
    a = jnp.ones((n, n), jnp.bfloat16)
    f = jax.jit(lambda a: a @ a)
    return 2 * n**3 / min(call_seconds(lambda: f(a), 5))


def print_row(*cells: Any) -> None:
    """One row of a Markdown table, printed at once (the benchmarks' tables go to docs/benchmarks.md as printed)."""
    print("| " + " | ".join(str(c) for c in cells) + " |", flush=True)


def write_rows(path: str | None, args: Any, rows: list[dict]) -> None:
    """The run's rows as JSON at `path` (none: nothing), with the device, the jax version and the arguments."""
    if path:
        with open(path, "w") as f:
            json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, args=vars(args), rows=rows), f,
                      indent=2)

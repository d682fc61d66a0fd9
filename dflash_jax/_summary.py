"""One-line summaries of loaded models for `repr` (a notebook cell that shows a drafter or a target), in place of
the dataclass repr, which prints every array."""

from __future__ import annotations

from typing import Any

import jax


def _size(nbytes: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def summary(kind: str, details: list[str], tree: Any) -> str:
    """`kind(details..., N arrays, dtypes, D x platform, bytes)`: the arrays of `tree` counted, their dtypes, the
    devices they live on and their bytes (global: a sharded array counts whole); under a trace, the devices are
    not known and shown as such."""
    leaves = [x for x in jax.tree.leaves(tree) if hasattr(x, "dtype")]
    dtypes = "/".join(sorted({str(x.dtype) for x in leaves})) or "no arrays"
    if any(isinstance(x, jax.core.Tracer) for x in leaves):
        where = "traced"
    else:
        devices = {d for x in leaves if isinstance(x, jax.Array) for d in x.sharding.device_set}
        platforms = "/".join(sorted({str(getattr(d, "platform", "?")) for d in devices}))
        where = f"{len(devices)} x {platforms}" if devices else "host"
    nbytes = sum(int(x.size) * x.dtype.itemsize for x in leaves)
    return f"{kind}({', '.join(details)}, {len(leaves)} arrays, {dtypes}, {where}, {_size(nbytes)})"

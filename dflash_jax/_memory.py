"""How much memory devices have free: what placement and the decode loop check their arrays against up front.

A device that reports its memory (`device.memory_stats()`: GPUs, TPUs) has `bytes_limit - bytes_in_use` free.
CPU devices report none: they all draw on the host's memory, whose available bytes (`MemAvailable` of
/proc/meminfo: free plus reclaimable page cache, the kernel's estimate of what can be allocated without
swapping) they share, so several CPU devices count it once.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any


def host_available_bytes() -> int | None:
    """The host's available memory (`MemAvailable`), else free pages times the page size; None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def device_free_bytes(device: Any) -> int | None:
    """A device's free memory as it reports it; None for a device that reports none (a CPU)."""
    stats = device.memory_stats() or {}
    if "bytes_limit" not in stats:
        return None
    return stats["bytes_limit"] - stats.get("bytes_in_use", 0)


def free_bytes(devices: Iterable[Any]) -> tuple[int | None, str]:
    """`(free bytes over all of devices, what they are)`: the reporting devices' free memory, plus the host's
    available memory once for any that report none; None when nothing is known."""
    devices = list(devices)
    reported = [device_free_bytes(d) for d in devices]
    total = sum(r for r in reported if r is not None)
    silent = [d for d, r in zip(devices, reported) if r is None]
    if silent:
        host = host_available_bytes()
        if host is None:
            return (total if len(silent) < len(devices) else None), f"{len(devices)} device(s)"
        total += host
    what = f"{len(devices)} device(s)" + (f" ({len(silent)} on the host's available memory)" if silent else "")
    return total, what

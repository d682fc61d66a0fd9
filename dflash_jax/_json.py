"""JSON decoding shared by the config decoder and the checkpoint reader (no file access here)."""

from __future__ import annotations


def refuse_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    """`object_pairs_hook` for `json.loads`: a key given twice is an error, not silently the last value."""
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out

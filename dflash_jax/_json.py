"""JSON decoding shared by the config decoder and the checkpoint reader (no file access here)."""

from __future__ import annotations

import codecs
import json
from typing import Any

# UTF-32 LE first: its byte-order mark begins with UTF-16 LE's
_BOMS = ((codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"), (codecs.BOM_UTF16_LE, "UTF-16"),
         (codecs.BOM_UTF16_BE, "UTF-16"), (codecs.BOM_UTF8, "UTF-8 with a byte-order mark"))


class NotUTF8(ValueError):
    """The bytes are not UTF-8 text without a byte-order mark, which JSON files must be (RFC 8259, 8.1)."""


def loads(raw: str | bytes) -> Any:
    """`raw` decoded as UTF-8 JSON with duplicate keys refused. Raises `NotUTF8` saying which encoding the bytes
    look like (UTF-16, a byte-order mark, Latin-1), else `ValueError` (JSONDecodeError, duplicates, the int
    digits limit) or `RecursionError`. json.loads itself would guess UTF-16 and UTF-32 from bytes; UTF-16 text
    decoded as UTF-8 is valid but holds NULs, which JSON text never does."""
    if isinstance(raw, str):
        if raw.startswith("\ufeff"):
            raise NotUTF8("it starts with a byte-order mark (U+FEFF)")
        text = raw
    else:
        raw = bytes(raw)
        for bom, encoding in _BOMS:
            if raw.startswith(bom):
                raise NotUTF8(f"it starts with the byte-order mark of {encoding}")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise NotUTF8(f"byte 0x{raw[e.start]:02x} at offset {e.start} is not UTF-8 (Latin-1 or another legacy "
                          "encoding?)") from None
    if "\x00" in text:
        raise NotUTF8("it holds NUL characters, as UTF-16 or UTF-32 text read as UTF-8 does")
    return json.loads(text, object_pairs_hook=refuse_duplicate_keys)


def refuse_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    """`object_pairs_hook` for `json.loads`: a key given twice is an error, not silently the last value."""
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out

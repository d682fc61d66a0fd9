"""Forge safetensors files byte by byte, valid or broken, and edit the files of a written checkpoint.

`write_tensors` writes any dtype the format has (F8 and BF16 included) with the layout given (order,
gaps), so tests do not depend on what `safetensors.numpy` happens to support. `write_raw` writes a header
object (or raw header bytes) and a data section as they are, however wrong, for the corpus of broken files.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from dflash_jax.safetensors import DTYPES, Checkpoint

NAMES = {dtype: name for name, dtype in DTYPES.items()}


def header_bytes(header: Any) -> bytes:
    """JSON for a header object; bytes pass through untouched (for headers that are not JSON at all)."""
    return header if isinstance(header, bytes) else json.dumps(header).encode()


def write_raw(file: Path, header: Any, data: bytes = b"", *, length: int | None = None) -> Path:
    """8-byte little-endian length (the true one unless `length` lies), the header, the data section."""
    raw = header_bytes(header)
    declared = len(raw) if length is None else length
    file.write_bytes(declared.to_bytes(8, "little") + raw + data)
    return file


def layout(tensors: dict[str, np.ndarray], *, gap: int = 0) -> tuple[dict[str, Any], bytes]:
    """The header and data section of `tensors`, in the order given, `gap` unused bytes between them."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    chunks, offset = [], 0
    for name, array in tensors.items():
        blob = np.ascontiguousarray(array).tobytes()
        header[name] = {"dtype": NAMES[array.dtype], "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        chunks += [blob, b"\0" * gap]
        offset += len(blob) + gap
    return header, b"".join(chunks)


def write_tensors(file: Path, tensors: dict[str, np.ndarray], *, gap: int = 0) -> Path:
    header, data = layout(tensors, gap=gap)
    return write_raw(file, header, data)


def add_sparse(file: Path, tensors: dict[str, tuple[int, ...]], dtype) -> None:
    """Append tensors of these shapes to a (small) safetensors file as a hole: the file grows on paper only."""
    header, data = read_raw(file)
    end = len(data)
    for name, shape in tensors.items():
        size = math.prod(shape) * np.dtype(dtype).itemsize
        header[name] = {"dtype": NAMES[np.dtype(dtype)], "shape": list(shape), "data_offsets": [end, end + size]}
        end += size
    write_raw(file, header, data)
    os.truncate(file, file.stat().st_size + end - len(data))


def read_raw(file: Path) -> tuple[dict[str, Any], bytes]:
    """A (valid) file's header object and data section."""
    blob = file.read_bytes()
    n = int.from_bytes(blob[:8], "little")
    return json.loads(blob[8 : 8 + n]), blob[8 + n :]


def read_tensors(file: Path) -> dict[str, np.ndarray]:
    """Every tensor of a (valid) file, as writable copies."""
    with Checkpoint(file) as checkpoint:
        return {name: np.array(checkpoint.array(name)) for name in checkpoint}


def edit_header(file: Path, edit) -> Path:
    """Rewrite a file's header with `edit(header)` (which changes it in place); the data is kept."""
    header, data = read_raw(file)
    edit(header)
    return write_raw(file, header, data)


def edit_tensors(file: Path, edit) -> Path:
    """Rewrite a file with `edit(tensors)` (a dict of NumPy arrays, changed in place)."""
    tensors = read_tensors(file)
    edit(tensors)
    return write_tensors(file, tensors)


def edit_json(file: Path, edit) -> Path:
    """Rewrite a JSON file (config.json, the index) with `edit(obj)`, which changes it in place."""
    obj = json.loads(file.read_text())
    edit(obj)
    file.write_text(json.dumps(obj))
    return file

"""Header-first safetensors reading: plan from the headers, then map tensor bytes one tensor at a time.

A checkpoint is opened by reading only the JSON headers of its files (single `model.safetensors`, or the
shards of `model.safetensors.index.json`). Every header is validated before anything is read, so a bad
file fails fast with a `CheckpointError` naming the file and the tensor. Tensor data is then exposed as
read-only NumPy views of a memory map: no tensor is copied on the host until a caller asks for it, and
never the whole file into one buffer.

Format: 8-byte little-endian header length N, N bytes of JSON `{name: {dtype, shape, data_offsets: [b, e]},
"__metadata__": {...}}`, then the data section; a tensor's bytes are at `8 + N + b .. 8 + N + e`.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import mmap
import os
import stat
from collections.abc import Callable, Iterator, Mapping

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from ._json import NotUTF8
from ._json import loads as json_loads
from ._shapes import round_up
from .errors import CheckpointError

__all__ = ["Checkpoint", "TensorInfo", "read_header", "write_tensors", "INDEX_FILE", "SINGLE_FILE"]

DTYPES: dict[str, np.dtype] = {
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F16": np.dtype(np.float16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64),
    "U32": np.dtype(np.uint32),
    "U16": np.dtype(np.uint16),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
FLOAT_DTYPES = ("BF16", "F16", "F32", "F64", "F8_E4M3", "F8_E5M2")  # every floating dtype: what can hold a NaN
# The dtypes a float weight (norm, bias, unquantized matrix) may be stored in; float8 appears only as the
# block scales of an NVFP4-packed weight (`nvfp4.checkpoint.check_packed`).
WEIGHT_DTYPES = ("BF16", "F16", "F32", "F64")
INT_DTYPES = ("I64", "I32", "I16", "I8", "U64", "U32", "U16", "U8")
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the limit safetensors itself enforces
MAX_INDEX_BYTES = 100 * 1024 * 1024  # an index.json is a few hundred KiB; refuse to slurp anything absurd
MAX_DIMS = 32  # NumPy's own limit is 64; no real tensor has more than a handful of dimensions


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: its file and absolute byte range, with dtype and shape from the header."""

    name: str
    dtype: str  # safetensors name, e.g. "BF16"
    shape: tuple[int, ...]
    file: str
    start: int  # absolute offset in `file`
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def np_dtype(self) -> np.dtype:
        return DTYPES[self.dtype]


def read_header(path: str) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and validate one file's header; returns its tensors and its `__metadata__`."""
    with open_regular(path, "a safetensors file") as f:
        return _read_header(f, path)


def open_regular(path: str, what: str):
    """`path` opened for binary reading, refusing anything that is not a regular file (`what` says what was
    expected). The open does not block on a FIFO (O_NONBLOCK) and the check is on the opened file (fstat), so
    nothing can be swapped in between."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError(f"{path}: not a regular file; expected {what}")
    return os.fdopen(fd, "rb")


def _read_header(f, path: str) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """The header of the open file `f` (at offset 0), validated against the file's size."""
    try:
        size = os.fstat(f.fileno()).st_size
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CheckpointError(f"{path}: file of {size} bytes is too short to hold a safetensors header")
        length = int.from_bytes(prefix, "little")
        if length > MAX_HEADER_BYTES or 8 + length > size:
            raise CheckpointError(
                f"{path}: header length {length} is larger than the file ({size} bytes) or the "
                f"{MAX_HEADER_BYTES}-byte limit; the file is truncated or not safetensors"
            )
        raw = f.read(length)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
    header = _decode_json(path, raw, "header")
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is a JSON {type(header).__name__}, expected an object")
    metadata = _metadata(path, header.pop("__metadata__", None))
    base, data_size = 8 + length, size - 8 - length
    tensors = {name: _tensor_info(path, name, entry, base, data_size) for name, entry in header.items()}
    _check_no_overlap(path, tensors.values())
    return tensors, metadata


def read_small(path: str, what: str, limit: int) -> bytes:
    """The bytes of a small file of a checkpoint or a cache (a config, an index, a hub ref): a regular file of
    at most `limit` bytes (a FIFO or a device, whose read could block or never end, is refused); every failure
    a `CheckpointError` naming the file."""
    with open_regular(path, what) as f:
        try:
            raw = f.read(limit + 1)
        except OSError as e:
            raise CheckpointError(f"{path}: cannot read {what} ({e.strerror or e})") from None
    if len(raw) > limit:
        raise CheckpointError(f"{path}: larger than {limit} bytes; expected {what}, a small file")
    return raw


def read_json(path: str, what: str, limit: int = MAX_INDEX_BYTES) -> object:
    """A small JSON file of a checkpoint (the index, hf_quant_config.json, config.json): `read_small`, then UTF-8
    JSON with duplicate keys refused; every failure a `CheckpointError` naming the file."""
    return _decode_json(path, read_small(path, what, limit), what)


def _decode_json(path: str, raw: bytes, what: str) -> object:
    """UTF-8 JSON with duplicate keys refused; every failure (nesting too deep included) a CheckpointError."""
    try:
        return json_loads(raw)
    except RecursionError:
        raise CheckpointError(f"{path}: {what} is not usable JSON (nested too deeply)") from None
    except NotUTF8 as e:
        raise CheckpointError(f"{path}: {what} is not valid UTF-8 JSON: the file is not UTF-8 ({e}); save it as "
                              "UTF-8 without a byte-order mark") from None
    except ValueError as e:  # JSONDecodeError, the int digits limit, duplicates
        raise CheckpointError(f"{path}: {what} is not valid UTF-8 JSON ({e})") from None


def _metadata(path: str, metadata: object) -> dict[str, str]:
    """`__metadata__`: an object of strings (numbers and booleans are tolerated and stringified)."""
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise CheckpointError(f"{path}: __metadata__ is a JSON {type(metadata).__name__}, expected an object")
    for key, value in metadata.items():
        if isinstance(value, (dict, list)):
            raise CheckpointError(f"{path}: __metadata__[{key!r}] is a JSON {type(value).__name__}, expected a string")
    return {key: str(value) for key, value in metadata.items()}


def _tensor_info(path: str, name: str, entry: object, base: int, data_size: int) -> TensorInfo:
    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{path}: tensor {name!r}: {what}")

    if not isinstance(entry, dict):
        raise bad(f"header entry is a {type(entry).__name__}, expected an object with dtype/shape/data_offsets")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise bad(f"dtype {dtype!r} is missing or unknown; expected one of {sorted(DTYPES)}")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise bad(f"shape {shape!r} is not a list of non-negative integers")
    if len(shape) > MAX_DIMS or math.prod(max(d, 1) for d in shape) * DTYPES[dtype].itemsize >= 2**63:
        # only an empty tensor gets here with such dims (others are bounded by the file), but NumPy refuses it
        shown = shape if len(shape) <= MAX_DIMS else f"of {len(shape)} dimensions"
        raise bad(f"shape {shown} is out of range (at most {MAX_DIMS} dimensions, under 2**63 bytes)")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
        raise bad(f"data_offsets {offsets!r} is not a pair of integers")
    begin, end = offsets
    if not 0 <= begin <= end:
        raise bad(f"data_offsets {offsets} are out of order")
    if end > data_size:
        raise bad(f"data_offsets {offsets} run past the end of the data section ({data_size} bytes): file truncated?")
    expected = math.prod(shape) * DTYPES[dtype].itemsize
    if end - begin != expected:
        raise bad(f"data_offsets {offsets} span {end - begin} bytes, expected {expected} for {dtype} {shape}")
    return TensorInfo(name, dtype, tuple(shape), path, base + begin, base + end)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_no_overlap(path: str, tensors) -> None:
    previous = None
    for info in sorted(tensors, key=lambda t: (t.start, t.end)):
        if previous is not None and info.start < previous.end:
            raise CheckpointError(f"{path}: tensors {previous.name!r} and {info.name!r} overlap in the data section")
        if info.nbytes:
            previous = info


class Checkpoint(Mapping[str, TensorInfo]):
    """The tensors of a checkpoint directory (or a single .safetensors file), by name.

    Opening reads and validates headers only, and keeps each file open: its tensor bytes are mapped from
    that same open file, so a file replaced on disk (an atomic rename) while it loads cannot pair one
    file's offsets with another's bytes. `array(name)` returns a read-only NumPy view of the mapped bytes
    (zero-copy; pages are read when touched). Use as a context manager to close the files and maps.
    """

    def __init__(self, path: str | os.PathLike[str]):
        self.path = os.fspath(path)
        self._files: dict[str, io.BufferedReader] = {}
        self._maps: dict[str, tuple[mmap.mmap, np.ndarray]] = {}
        try:
            self._tensors, self.metadata = self._read_headers()
        except BaseException:
            self.close()
            raise

    def _read_headers(self) -> tuple[dict[str, TensorInfo], dict[str, str]]:
        if os.path.isfile(self.path):
            self.directory = os.path.dirname(self.path)
            return self._header(self.path)
        if not os.path.isdir(self.path):
            raise CheckpointError(f"{self.path}: no such file or directory")
        self.directory = self.path
        index = os.path.join(self.path, INDEX_FILE)
        if os.path.lexists(index):  # read only if a regular file: a FIFO or a directory there is refused
            return _read_sharded(self.path, index, self._header)
        tensors: dict[str, TensorInfo] = {}
        metadata: dict[str, str] = {}
        for file in _plain_files(self.path):
            found, file_metadata = self._header(file)
            for name in found.keys() & tensors.keys():
                raise CheckpointError(f"{self.path}: tensor {name!r} is in both {tensors[name].file} and {file}")
            tensors.update(found)
            metadata.update(file_metadata)
        return tensors, metadata

    def _header(self, file: str) -> tuple[dict[str, TensorInfo], dict[str, str]]:
        """Open `file` (kept open for its tensors) and read its header."""
        self._files[file] = open_regular(file, "a safetensors file")
        return _read_header(self._files[file], file)

    def __getitem__(self, name: str) -> TensorInfo:
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    @property
    def files(self) -> list[str]:
        return sorted({t.file for t in self._tensors.values()})

    def array(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only NumPy array (a view of the memory map, not a copy).

        The file's size is checked (fstat) on every call: a file truncated since its header was read, or
        since the previous tensor, is a `CheckpointError` here instead of a SIGBUS when the pages are touched.
        A truncation while the returned view is being copied can still end the process (docs/errors.md).
        """
        info = self._tensors[name]
        data = self._map(info.file)
        try:
            size = os.fstat(self._files[info.file].fileno()).st_size
        except OSError as e:
            raise CheckpointError(f"{info.file}: cannot read ({e.strerror or e})") from None
        if min(size, len(data)) < info.end:
            raise CheckpointError(
                f"{info.file}: tensor {name!r} ends at byte {info.end} but the file now holds {size} "
                "bytes; it was truncated after its header was read"
            )
        return data[info.start : info.end].view(info.np_dtype).reshape(info.shape)

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        """The part `index` (one step-1 slice per dimension) of a tensor, as a view of the map: only the pages
        under its byte ranges are touched when it is copied (a row block of a row-major tensor is one contiguous
        range; a column block, one range per row). None: the whole tensor (`array`)."""
        array = self.array(name)
        return array if index is None else array[index]

    def _map(self, file: str) -> np.ndarray:
        if file not in self._maps:
            try:  # the file opened for its header: the same bytes, whatever happened to the path since
                mapped = mmap.mmap(self._files[file].fileno(), 0, access=mmap.ACCESS_READ)
            except (OSError, ValueError) as e:  # ValueError: emptied since its header was read
                raise CheckpointError(f"{file}: cannot map the file ({e})") from None
            self._maps[file] = (mapped, np.frombuffer(mapped, np.uint8))
        return self._maps[file][1]

    def release(self, name: str) -> None:
        """Drop the pages under a tensor from this process's memory (MADV_DONTNEED). The bytes stay in the
        page cache and a later access maps them again, so this only bounds resident memory."""
        info = self._tensors[name]
        if info.file not in self._maps or not hasattr(mmap, "MADV_DONTNEED"):
            return
        page = mmap.PAGESIZE
        begin = round_up(info.start, page)  # whole pages only: neighbours may still be in use
        end = info.end // page * page
        if end > begin:
            self._maps[info.file][0].madvise(mmap.MADV_DONTNEED, begin, end - begin)

    def close(self) -> None:
        """Close the files and drop the maps. Arrays already handed out keep their pages alive until released."""
        self._maps.clear()
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _plain_files(directory: str) -> list[str]:
    single = os.path.join(directory, SINGLE_FILE)
    if os.path.isfile(single):
        return [single]
    if os.path.lexists(single):  # a directory, a FIFO, a dangling link: never opened
        raise CheckpointError(f"{single}: not a regular file; expected a safetensors file")
    files = sorted(
        os.path.join(directory, f) for f in os.listdir(directory)
        if f.endswith(".safetensors") and os.path.isfile(os.path.join(directory, f))
    )
    if not files:
        raise CheckpointError(f"{directory}: no {SINGLE_FILE}, {INDEX_FILE} or other .safetensors file")
    return files


def _read_sharded(
    directory: str, index_path: str, read: Callable[[str], tuple[dict[str, TensorInfo], dict[str, str]]]
) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Read an index.json and, with `read`, the headers of its shards; check that both tell the same story."""
    index = read_json(index_path, "the index")  # duplicate keys refused: one tensor, two shards
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index_path}: expected an object with a `weight_map` of tensor name -> shard file")
    shards: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        if os.path.basename(shard) != shard or shard in ("", ".", ".."):
            raise CheckpointError(
                f"{index_path}: tensor {name!r} maps to {shard!r}; expected a file name inside {directory}"
            )
        shards.setdefault(shard, []).append(name)
    tensors: dict[str, TensorInfo] = {}
    metadata: dict[str, str] = {}
    for shard, names in sorted(shards.items()):
        file = os.path.join(directory, shard)
        if not os.path.isfile(file):
            raise CheckpointError(
                f"{index_path}: shard {shard!r} (holding {names[0]!r}) does not exist or is not a regular file"
            )
        found, shard_metadata = read(file)
        metadata.update(shard_metadata)
        for name in names:
            if name not in found:
                raise CheckpointError(f"{file}: tensor {name!r} is promised by {INDEX_FILE} but not in this shard")
            tensors[name] = found[name]
        for name in found.keys() - set(names):
            owner = weight_map.get(name)
            where = f"the index maps it to {owner!r}" if owner else "the index does not list it"
            raise CheckpointError(f"{file}: holds tensor {name!r} but {where}")
    _refuse_strays(directory, index_path, set(shards), tensors)
    return tensors, metadata


def _refuse_strays(directory: str, index_path: str, shards: set[str], tensors: dict[str, TensorInfo]) -> None:
    """A .safetensors file beside the index that it does not name, holding a tensor the index maps elsewhere,
    makes the checkpoint ambiguous (a stale conversion, a half-finished copy): refused, not silently shadowed."""
    for stray in sorted(set(os.listdir(directory)) - shards):
        file = os.path.join(directory, stray)
        if not stray.endswith(".safetensors") or not os.path.isfile(file):
            continue
        for name in sorted(read_header(file)[0].keys() & tensors.keys()):
            raise CheckpointError(
                f"{file}: holds tensor {name!r}, which {INDEX_FILE} maps to {os.path.basename(tensors[name].file)!r}; "
                "the checkpoint is ambiguous: expected each tensor in one file (remove the stale file or the index)"
            )


def write_tensors(directory: str | os.PathLike[str], tensors: Mapping[str, np.ndarray], num_shards: int = 1) -> None:
    """Write `tensors` as `model.safetensors`, or as `num_shards` shards plus `model.safetensors.index.json`."""
    directory = os.fspath(directory)
    metadata = {"format": "pt"}
    if num_shards <= 1:
        save_file(dict(tensors), os.path.join(directory, SINGLE_FILE), metadata=metadata)
        return
    names = list(tensors)
    weight_map = {}
    for shard in range(num_shards):
        file = f"model-{shard + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[shard::num_shards]}
        save_file(part, os.path.join(directory, file), metadata=metadata)
        weight_map.update(dict.fromkeys(part, file))
    index = {"metadata": {"total_size": sum(a.nbytes for a in tensors.values())}, "weight_map": weight_map}
    with open(os.path.join(directory, INDEX_FILE), "w") as f:
        json.dump(index, f, indent=2)

"""The compiled conversions of a load (NVFP4 dequantization, casts), kept per process and on disk.

Compiling is what a fresh process pays for an NVFP4 load: on an H200 the first XLA compilation of a process
costs ~0.3 s on its own and each dequantizer ~0.15-0.2 s (XLA's Triton pipeline), more than a whole BF16
load, while loading a stored executable takes ~5 ms. So each executable is compiled once per process, on a
thread pool as soon as a load starts, and stored on disk for later processes.

Why not JAX's persistent compilation cache: it stores only programs that took over a second to compile
(`jax_persistent_cache_min_compile_time_secs`, default 1.0; a dequantizer takes 0.15-0.45 s), turning it on
is a process-wide setting that is not a loader's to change, and even on a hit it traces and lowers every
program again (25-75 ms per Pallas dequantizer) before it can look the entry up. Its trust model is the one
below minus the checks: "the compilation cache is considered trusted"
(https://docs.jax.dev/en/latest/persistent_compilation_cache.html).

On disk (threat model: docs/errors.md, "The compiled-program cache"): one file per executable in
`cache_dir()`, named by a hash of its description (the conversion and its input signature; device kind, id
and platform version; jax and jaxlib versions, XLA_FLAGS; the source of the code that builds it). A file is
`MAGIC`, the SHA-256 of the description and the payload, then the payload: the XLA executable as the PJRT
client serializes it. Nothing is unpickled: the callable around the executable (`Program`) is rebuilt from
the known signature. An executable is machine code, so an entry is used only when the directory and the file
are this user's and nobody else can write them (as ssh and JAX's own cache expect), the file is at most
`MAX_ENTRY_BYTES`, its digest matches before anything is deserialised (a damaged or renamed entry is
recompiled and replaced, never run), and the deserialised program has the parameters and the result the
signature implies. `DFLASH_JAX_CACHE_DIR` moves the directory (default `$XDG_CACHE_HOME/dflash_jax`, else
`~/.cache/dflash_jax`); an empty value turns the disk cache off.
"""

from __future__ import annotations

import functools
import hashlib
import os
import stat
import tempfile
import threading
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib.version
import jaxlib.xla_client as xc
import numpy as np

CACHE_ENV = "DFLASH_JAX_CACHE_DIR"
MAGIC = b"dflash_jax exe 1\n"  # 17 bytes; a new layout of the file gets a new magic
MAX_ENTRY_BYTES = 64 * 1024 * 1024  # a dequantizer's executable is ~10-200 KB
_DIGEST_BYTES = 32
_SOURCES = ("_executables.py", "nvfp4/__init__.py", "nvfp4/_pallas.py", "nvfp4/_reference.py")

# (kind, inputs, dtype, device) -> future `Program`, where kind is "nvfp4" or "cast" and inputs is a tuple
# of (shape, numpy dtype) per argument
_COMPILED: dict[tuple, Future] = {}
_LOCK = threading.RLock()  # re-entered when a future fails before its done-callback is added
_POOL = ThreadPoolExecutor(max_workers=8, thread_name_prefix="dflash_jax-compile")
_WARNED: set[str] = set()  # cache directories already warned about (untrusted, unwritable)


class Program:
    """A compiled conversion, called with its single-device input arrays; returns its one output array.

    It runs the XLA executable directly, the same way for a program just compiled and one read from disk,
    so every test of one path tests the other.
    """

    def __init__(self, executable: xc.LoadedExecutable):
        self.executable = executable

    def __call__(self, *arrays: jax.Array) -> jax.Array:
        ((out,),) = self.executable.execute_sharded(list(arrays)).disassemble_into_single_device_arrays()
        return out


def cache_dir() -> Path | None:
    """The on-disk executable cache directory, or None when `DFLASH_JAX_CACHE_DIR` is set empty."""
    configured = os.environ.get(CACHE_ENV)
    if configured is not None:
        return Path(configured).expanduser() if configured else None
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "dflash_jax"


def compiled(kind: str, inputs: tuple, dtype: jnp.dtype, device: jax.Device) -> Future:
    """The future compiled conversion (a `Program`), started on the pool the first time.

    A conversion that failed is forgotten, so that the next load tries again.
    """
    key = (kind, inputs, jnp.dtype(dtype), device)
    with _LOCK:
        future = _COMPILED.get(key)
        if future is None:
            future = _COMPILED[key] = _POOL.submit(_load_or_compile, key)
            future.add_done_callback(functools.partial(_forget_failure, key))
        return future


def _forget_failure(key: tuple, future: Future) -> None:
    if future.exception() is not None:
        with _LOCK:
            if _COMPILED.get(key) is future:
                del _COMPILED[key]


def _load_or_compile(key: tuple) -> Program:
    kind, inputs, dtype, device = key
    output = _output(kind, inputs, dtype)
    description = _describe(key)
    directory = _trusted_cache_dir()
    path = directory / f"{kind}-{hashlib.sha256(description).hexdigest()[:32]}.jaxexec" if directory else None
    if path is not None:
        executable = _load(path, description, device, inputs, output)
        if executable is not None:
            return Program(executable)
    specs = tuple(jax.ShapeDtypeStruct(shape, d, sharding=jax.sharding.SingleDeviceSharding(device))
                  for shape, d in inputs)
    executable = _compile(kind, specs, dtype).runtime_executable()
    problem = _signature_problem(executable, inputs, output)
    if problem:  # what `_output` or the jitted function says disagrees: a bug here, never stored
        raise AssertionError(f"compiled {kind} conversion of {inputs}: {problem}")
    if path is not None:
        _write_entry(path, description, device.client.serialize_executable(executable))
    return Program(executable)


def _compile(kind: str, specs: tuple[jax.ShapeDtypeStruct, ...], dtype: jnp.dtype) -> jax.stages.Compiled:
    if kind == "nvfp4":
        from .nvfp4 import dequantize

        fn = functools.partial(dequantize, dtype=dtype)
    else:
        fn = functools.partial(jnp.asarray, dtype=dtype)
    return jax.jit(fn).lower(*specs).compile()


def _output(kind: str, inputs: tuple, dtype: jnp.dtype) -> tuple[tuple[int, ...], np.dtype]:
    """The (shape, dtype) a conversion returns: packed [..., K/2] -> [..., K] for NVFP4, the shape for a cast."""
    shape = inputs[0][0]
    return ((*shape[:-1], 2 * shape[-1]) if kind == "nvfp4" else shape), np.dtype(dtype)


def _signature_problem(executable: xc.LoadedExecutable, inputs: tuple, output: tuple) -> str | None:
    """What differs between the executable's parameters and result and the expected signature, or None."""
    (module,) = executable.hlo_modules()
    program = xc.XlaComputation(module.as_serialized_hlo_module_proto()).program_shape()
    parameters = [(tuple(s.dimensions()), np.dtype(s.numpy_dtype())) for s in program.parameter_shapes()]
    if parameters != [(tuple(shape), np.dtype(d)) for shape, d in inputs]:
        return f"parameters {parameters}, expected {list(inputs)}"
    result = program.result_shape()
    if result.is_tuple() or (tuple(result.dimensions()), np.dtype(result.numpy_dtype())) != output:
        return f"result {result}, expected {output}"
    return None


def _describe(key: tuple) -> bytes:
    kind, inputs, dtype, device = key
    parts = (kind, inputs, dtype.name, device.platform, device.device_kind, device.id,
             device.client.platform_version, _environment())
    return repr(parts).encode()


@functools.cache
def _environment() -> tuple:
    """Versions, flags and the source of the conversion code: any change makes new cache entries."""
    package = Path(__file__).parent
    source = hashlib.sha256(b"".join((package / name).read_bytes() for name in _SOURCES)).hexdigest()
    x64 = jax.config.jax_enable_x64  # type: ignore[attr-defined]  # a run-time flag, not in jax's Config stub
    return jax.__version__, jaxlib.version.__version__, os.environ.get("XLA_FLAGS", ""), bool(x64), source


def _digest(description: bytes, payload: bytes) -> bytes:
    """Binds the payload to its description: an entry renamed to another signature's name does not match."""
    return hashlib.sha256(len(description).to_bytes(8, "little") + description + payload).digest()


def _trusted_cache_dir() -> Path | None:
    """The cache directory, created private if absent; None (warned once) when off or not trustworthy."""
    directory = cache_dir()
    if directory is None:
        return None
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        problem = _untrusted(directory)
    except OSError as e:
        problem = f"cannot use it ({e.strerror or e})"
    if problem is None:
        return directory
    _warn_once(directory, f"dflash_jax: not using {directory} for compiled conversions: {problem}. Loads "
                          f"will compile them in every process. Set {CACHE_ENV} to a private directory (yours, "
                          "mode 0700), or to '' to turn this cache off.")
    return None


def _untrusted(directory: Path) -> str | None:
    """Why another user could plant or swap entries in `directory`, or None.

    The directory must be this user's and writable by no one else; every directory above it must belong to
    this user or root and be writable by no one else unless sticky (like /tmp), so that nobody can replace it.
    """
    uid = os.getuid()
    resolved = directory.resolve()
    status = os.stat(resolved)
    if not stat.S_ISDIR(status.st_mode):
        return "not a directory"
    if status.st_uid != uid:
        return f"it is owned by uid {status.st_uid}, not by this user (uid {uid})"
    if status.st_mode & 0o022:
        return f"it is writable by group or others (mode {stat.S_IMODE(status.st_mode):04o})"
    for parent in resolved.parents:
        status = os.stat(parent)
        open_to_others = status.st_mode & 0o022 and not status.st_mode & stat.S_ISVTX
        if status.st_uid not in (uid, 0) or open_to_others:
            return (f"its parent {parent} (uid {status.st_uid}, mode {stat.S_IMODE(status.st_mode):04o}) lets "
                    "another user replace it")
    return None


def _load(path: Path, description: bytes, device: jax.Device, inputs: tuple, output: tuple
          ) -> xc.LoadedExecutable | None:
    """The stored executable, when the entry is trusted, intact and of this signature; else None."""
    payload = _read_entry(path, description)
    if payload is None:
        return None
    try:
        executable = device.client.deserialize_executable(payload, [device])
        return None if _signature_problem(executable, inputs, output) else executable
    except Exception:  # an executable of another build that the digest could not tell apart
        return None


def _read_entry(path: Path, description: bytes) -> bytes | None:
    """The payload of the entry at `path` if it is a regular file of this user that no one else can write,
    at most `MAX_ENTRY_BYTES`, with the right magic and digest; else None (it is recompiled and replaced)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)  # a FIFO does not block, a link fails
    except OSError:
        return None
    try:
        status = os.fstat(fd)
        if (not stat.S_ISREG(status.st_mode) or status.st_uid != os.getuid() or status.st_mode & 0o022
                or status.st_size > MAX_ENTRY_BYTES):
            return None
        chunks, size = [], 0
        while chunk := os.read(fd, MAX_ENTRY_BYTES + 1 - size):  # grown since fstat: still capped
            chunks.append(chunk)
            size += len(chunk)
            if size > MAX_ENTRY_BYTES:
                return None
    except OSError:
        return None
    finally:
        os.close(fd)
    blob = b"".join(chunks)
    head = len(MAGIC) + _DIGEST_BYTES
    payload = blob[head:]
    if blob[: len(MAGIC)] != MAGIC or blob[len(MAGIC) : head] != _digest(description, payload):
        return None
    return payload


def _write_entry(path: Path, description: bytes, payload: bytes) -> None:
    """Writes atomically (a private temporary file, then rename); warns once if it cannot."""
    blob = MAGIC + _digest(description, payload) + payload
    if len(blob) > MAX_ENTRY_BYTES:  # would be refused when read
        return
    try:
        fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=".partial-")  # 0600
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(temporary, path)  # fails on a directory there: it stays, loads compile
        except BaseException:
            os.unlink(temporary)
            raise
    except OSError as e:
        _warn_once(path.parent, f"dflash_jax: cannot write compiled conversions to {path} ({e.strerror or e}); "
                                f"loads will compile them in every process. Set {CACHE_ENV} to a writable "
                                "directory, or to '' to turn this cache off.")


def _warn_once(directory: Path, message: str) -> None:
    with _LOCK:
        if str(directory) in _WARNED:
            return
        _WARNED.add(str(directory))
    warnings.warn(message, RuntimeWarning, stacklevel=2)

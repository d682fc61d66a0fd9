"""The compiled conversions of a load (NVFP4 dequantization, casts), kept per process and on disk.

Compiling is what a fresh process pays for an NVFP4 load: on an H200 the first XLA compilation of a process
costs ~0.3 s on its own and each dequantizer ~0.15-0.2 s (the former Triton kernel), more than a whole BF16
load, while loading a stored executable takes ~5 ms. So each executable is compiled once per process, on a
thread pool as soon as a load starts, and stored on disk for later processes.

Why not JAX's persistent compilation cache: it stores only programs that took over a second to compile
(`jax_persistent_cache_min_compile_time_secs`, default 1.0; a dequantizer takes 0.15-0.45 s), turning it on
is a process-wide setting that is not a loader's to change, and even on a hit it traces and lowers every
program again (25-75 ms a dequantizer, measured with the Pallas kernel) before it can look the entry up. Its
trust model is the one below minus the checks: "the compilation cache is considered trusted"
(https://docs.jax.dev/en/latest/persistent_compilation_cache.html).

On disk (threat model: docs/errors.md, "The compiled-program cache"): one file per executable in
`cache_dir()`, named by a hash of its description (the conversion and its input signature; device kind, id
and platform version; jax and jaxlib versions, XLA_FLAGS; the source of the code that builds it). A file is
`MAGIC`, the HMAC-SHA256 of the description and the payload under this user's key bound to the directory
(`_private.user_key`: a random file kept outside every cache), then the payload: the XLA executable as the PJRT
client serializes it. Nothing is unpickled: the callable around the executable (`Program`) is rebuilt from the
known signature. An executable is machine code, so an entry is used only when the directory and the file are this user's
and nobody else can write them (as ssh and JAX's own cache expect), the file is at most `MAX_ENTRY_BYTES`,
its digest matches before anything is deserialised (a damaged or renamed entry, or one this user's package
did not write, is recompiled and replaced, never run), and the deserialised program has the parameters and
the result the signature implies. `DFLASH_JAX_CACHE_DIR` moves the directory (default
`$XDG_CACHE_HOME/dflash_jax`, else `~/.cache/dflash_jax`; no cache without a home directory); an empty value
turns the disk cache off. The directory rules and the key are `_private`'s, shared with the CLI's use of
JAX's compilation cache.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import hmac
import os
import stat
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from ._jax_compat import JAXLIB_VERSION
from ._jax_compat import xla_client as xc
from ._private import absolute, cache_home, private_directory, user_key, warn_once

CACHE_ENV = "DFLASH_JAX_CACHE_DIR"
MAGIC = b"dflash_jax exe 2\n"  # 17 bytes; a new layout of the file gets a new magic
MAX_ENTRY_BYTES = 64 * 1024 * 1024  # a dequantizer's executable is ~10-200 KB
_DIGEST_BYTES = 32
# The modules that build a conversion: their sources and every package module they import key the entries
_ENTRY_MODULES = ("dflash_jax._executables", "dflash_jax.nvfp4")

# (kind, inputs, dtype, device) -> future `Program`, where kind is "nvfp4" or "cast" and inputs is a tuple
# of (shape, numpy dtype) per argument
_COMPILED: dict[tuple, Future] = {}
_LOCK = threading.RLock()  # re-entered when a future fails before its done-callback is added
_POOL = ThreadPoolExecutor(max_workers=8, thread_name_prefix="dflash_jax-compile")
_WHAT = "compiled conversions"  # for `_private`'s warnings


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
    """The on-disk executable cache directory; None when `DFLASH_JAX_CACHE_DIR` is set empty, or (warned once)
    names no absolute path, or there is no home directory for the default."""
    configured = os.environ.get(CACHE_ENV)
    if configured is not None:
        return absolute(configured, CACHE_ENV) if configured else None
    home = cache_home()
    return home / "dflash_jax" if home else None


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
    cache = _trusted_cache()
    if cache:
        directory, secret = cache
        path = directory / f"{kind}-{hashlib.sha256(description).hexdigest()[:32]}.jaxexec"
        executable = _load(path, secret, description, device, inputs, output)
        if executable is not None:
            return Program(executable)
    specs = tuple(jax.ShapeDtypeStruct(shape, d, sharding=jax.sharding.SingleDeviceSharding(device))
                  for shape, d in inputs)
    executable = _compile(kind, specs, dtype).runtime_executable()
    problem = _signature_problem(executable, inputs, output)
    if problem:  # what `_output` or the jitted function says disagrees: a bug here, never stored
        raise AssertionError(f"compiled {kind} conversion of {inputs}: {problem}")
    if cache:
        _write_entry(path, secret, description, device.client.serialize_executable(executable))
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
    with _LOCK:  # the pool's threads start here at once, and CPython 3.11's ast.parse is not thread-safe
        source = source_digest(Path(__file__).parent)
    x64 = jax.config.jax_enable_x64  # type: ignore[attr-defined]  # a run-time flag, not in jax's Config stub
    return jax.__version__, JAXLIB_VERSION, os.environ.get("XLA_FLAGS", ""), bool(x64), source


def source_digest(package: Path) -> str:
    """SHA-256 of the sources of `_ENTRY_MODULES` and of every module of the package at `package` that they import,
    transitively (imports inside functions too), each file's path with its bytes."""
    digest = hashlib.sha256()
    for path in sorted(imported_sources(package, _ENTRY_MODULES)):
        digest.update(f"{path.relative_to(package).as_posix()}\n{path.stat().st_size}\n".encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def imported_sources(package: Path, modules: tuple[str, ...]) -> set[Path]:
    """The source files of `modules` (dotted names under the package at `package`) and of the package modules
    they import, transitively, read with `ast`. A module's parent packages count (their `__init__` runs first),
    the root's excepted: it only re-exports, and would make every file of the package part of every key."""
    root = package.name
    found: set[Path] = set()
    todo = list(modules)
    while todo:
        name = todo.pop()
        path = _module_file(package, name)
        if path is None or path in found:
            continue
        found.add(path)
        base = name if path.name == "__init__.py" else name.rpartition(".")[0]
        parts = name.split(".")
        todo += [".".join(parts[:n]) for n in range(2, len(parts))]  # parent packages, below the root
        for node in ast.walk(ast.parse(path.read_bytes(), str(path))):
            if isinstance(node, ast.Import):
                todo += [alias.name for alias in node.names if alias.name.startswith(root + ".")]
            elif isinstance(node, ast.ImportFrom):
                anchor = base.split(".")[: len(base.split(".")) - node.level + 1] if node.level else []
                module = ".".join(anchor + ([node.module] if node.module else []))
                if module == root or module.startswith(root + "."):
                    todo += [module, *(f"{module}.{alias.name}" for alias in node.names)]  # `from . import x`
    return found


def _module_file(package: Path, name: str) -> Path | None:
    """The source of module `name` ("dflash_jax.nvfp4._reference") under `package`, or None: not a module of it
    (an imported attribute, or the root)."""
    parts = name.split(".")[1:]
    if not parts:
        return None
    for path in (package.joinpath(*parts).with_suffix(".py"), package.joinpath(*parts, "__init__.py")):
        if path.is_file():
            return path
    return None


def _digest(key: bytes, description: bytes, payload: bytes) -> bytes:
    """Binds the payload to its description (an entry renamed to another signature's name does not match) and to
    this user's key (an entry this user's package did not write does not match)."""
    message = len(description).to_bytes(8, "little") + description + payload
    return hmac.new(key, message, hashlib.sha256).digest()


def _trusted_cache() -> tuple[Path, bytes] | None:
    """The cache directory, created private if absent, and its key; None (warned once) when off or not
    trustworthy."""
    directory = cache_dir()
    directory = private_directory(directory, _WHAT, CACHE_ENV) if directory else None
    key = user_key(directory, _WHAT) if directory else None
    return (directory, key) if directory and key else None


def _load(path: Path, key: bytes, description: bytes, device: jax.Device, inputs: tuple, output: tuple
          ) -> xc.LoadedExecutable | None:
    """The stored executable, when the entry is trusted, intact and of this signature; else None."""
    payload = _read_entry(path, key, description)
    if payload is None:
        return None
    try:
        executable = device.client.deserialize_executable(payload, [device])
        return None if _signature_problem(executable, inputs, output) else executable
    except Exception:  # an executable of another build that the digest could not tell apart
        return None


def _read_entry(path: Path, key: bytes, description: bytes) -> bytes | None:
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
    digest = blob[len(MAGIC) : head]
    if blob[: len(MAGIC)] != MAGIC or not hmac.compare_digest(digest, _digest(key, description, payload)):
        return None
    return payload


def _write_entry(path: Path, key: bytes, description: bytes, payload: bytes) -> None:
    """Writes atomically (a private temporary file, then rename); warns once if it cannot."""
    blob = MAGIC + _digest(key, description, payload) + payload
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
        warn_once(str(path.parent), f"dflash_jax: cannot write compiled conversions to {path} "
                           f"({e.strerror or e}); loads will compile them in every process. Set {CACHE_ENV} to a "
                           "writable directory, or to '' to turn this cache off.")


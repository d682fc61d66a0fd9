"""The compiled conversions of a load (NVFP4 dequantization, casts), kept per process and on disk.

Compiling is what a fresh process pays for an NVFP4 load: on an H200 the first XLA compilation of a process
costs ~0.3 s on its own and each dequantizer ~0.15-0.2 s (XLA's Triton pipeline), more than a whole BF16
load, while loading a stored executable takes ~5 ms. So each executable is compiled once per process, on a
thread pool as soon as a load starts, and stored on disk for later processes.

On disk: one file per executable in `cache_dir()`, named by a hash of all it depends on (the conversion and
its input signature; device kind, id and platform version; jax and jaxlib versions, XLA_FLAGS; the source of
the code that builds it). The files are JAX-serialized executables, which are pickles: loading one can run
code, so the directory is created private (0700), files are written 0600, and a file owned by another user or
writable by others is ignored. A file that does not load is recompiled and replaced. `DFLASH_JAX_CACHE_DIR`
moves the directory (default `$XDG_CACHE_HOME/dflash_jax`, else `~/.cache/dflash_jax`); an empty value turns
the disk cache off.
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
from jax.experimental import serialize_executable

CACHE_ENV = "DFLASH_JAX_CACHE_DIR"
_SOURCES = ("_executables.py", "nvfp4/__init__.py", "nvfp4/_pallas.py", "nvfp4/_reference.py")

# (kind, inputs, dtype, device) -> future compiled conversion, where kind is "nvfp4" or "cast" and inputs is
# a tuple of (shape, numpy dtype) per argument
_COMPILED: dict[tuple, Future] = {}
_LOCK = threading.Lock()
_POOL = ThreadPoolExecutor(max_workers=8, thread_name_prefix="dflash_jax-compile")
_WARNED: set[str] = set()  # cache directories already warned about (unwritable)


def cache_dir() -> Path | None:
    """The on-disk executable cache directory, or None when `DFLASH_JAX_CACHE_DIR` is set empty."""
    configured = os.environ.get(CACHE_ENV)
    if configured is not None:
        return Path(configured).expanduser() if configured else None
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "dflash_jax"


def compiled(kind: str, inputs: tuple, dtype: jnp.dtype, device: jax.Device) -> Future:
    """The future compiled conversion (a `jax.stages.Compiled`), started on the pool the first time."""
    key = (kind, inputs, jnp.dtype(dtype), device)
    with _LOCK:
        if key not in _COMPILED:
            _COMPILED[key] = _POOL.submit(_load_or_compile, key)
            _COMPILED[key].add_done_callback(lambda f: f.exception() and _COMPILED.pop(key, None))
        return _COMPILED[key]


def _load_or_compile(key: tuple) -> jax.stages.Compiled:
    kind, inputs, dtype, device = key
    specs = tuple(jax.ShapeDtypeStruct(shape, d, sharding=jax.sharding.SingleDeviceSharding(device))
                  for shape, d in inputs)
    in_tree, out_tree = jax.tree.structure((specs, {})), jax.tree.structure(0)
    directory = cache_dir()
    path = directory / f"{kind}-{_fingerprint(key)}.jaxexec" if directory else None
    if path is not None:
        blob = _read_private(path)
        if blob is not None:
            try:
                return serialize_executable.deserialize_and_load(blob, in_tree, out_tree, execution_devices=[device])
            except Exception:  # stale or damaged: compile again and replace it
                pass
    executable = _compile(kind, specs, dtype)
    if path is not None:
        blob, blob_in_tree, blob_out_tree = serialize_executable.serialize(executable)
        if (blob_in_tree, blob_out_tree) == (in_tree, out_tree):
            _write_private(path, blob)
    return executable


def _compile(kind: str, specs: tuple[jax.ShapeDtypeStruct, ...], dtype: jnp.dtype) -> jax.stages.Compiled:
    if kind == "nvfp4":
        from .nvfp4 import dequantize

        fn = functools.partial(dequantize, dtype=dtype)
    else:
        fn = functools.partial(jnp.asarray, dtype=dtype)
    return jax.jit(fn).lower(*specs).compile()


def _fingerprint(key: tuple) -> str:
    kind, inputs, dtype, device = key
    parts = (kind, inputs, dtype.name, device.platform, device.device_kind, device.id,
             device.client.platform_version, _environment())
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:32]


@functools.cache
def _environment() -> tuple:
    """Versions, flags and the source of the conversion code: any change makes new cache entries."""
    package = Path(__file__).parent
    source = hashlib.sha256(b"".join((package / name).read_bytes() for name in _SOURCES)).hexdigest()
    return (jax.__version__, jaxlib.version.__version__, os.environ.get("XLA_FLAGS", ""),
            bool(jax.config.jax_enable_x64), source)


def _read_private(path: Path) -> bytes | None:
    """The file's bytes if it is a regular file of this user that no one else can write, else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)  # a FIFO does not block, a link fails
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
            return None
        try:
            return f.read()
        except OSError:
            return None


def _write_private(path: Path, blob: bytes) -> None:
    """Writes atomically (temporary file, then rename), 0600 in a 0700 directory; warns once if it cannot."""
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=".partial-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(temporary, path)
        except BaseException:
            os.unlink(temporary)
            raise
    except OSError as e:
        if str(path.parent) not in _WARNED:
            _WARNED.add(str(path.parent))
            warnings.warn(f"dflash_jax: cannot write compiled conversions to {path.parent} ({e}); loads will "
                          f"compile them in every process. Set {CACHE_ENV} to a writable directory, or to '' "
                          "to turn this cache off.", RuntimeWarning, stacklevel=2)

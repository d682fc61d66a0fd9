"""JAX's persistent compilation cache, opt-in, under the package's rules for caches of code.

A process's first generation compiles its programs (most of its first call's time); with the cache on, a later
process of the same shapes, jax version and backend reads them from disk. The CLI turns it on for every run;
from Python it is `enable_compile_cache()`, once, before the first call. Its entries are programs the process
will run, so the directory must pass `_private`'s rules (this user's, writable by nobody else; created 0700);
one that does not, or no home directory for the default, leaves the cache off with one warning. JAX's own rules
apply too: only programs that took over a second to compile are stored (`jax_persistent_cache_min_compile_time_secs`),
keyed by the program, the backend and the jax/jaxlib versions (JAX's documentation, "Persistent compilation cache").
"""

from __future__ import annotations

import os
from pathlib import Path

from ._private import absolute, cache_home, private_directory

__all__ = ["enable_compile_cache"]

VARIABLE = "JAX_COMPILATION_CACHE_DIR"


def enable_compile_cache(path: str | os.PathLike[str] | None = None) -> str | None:
    """Turn on JAX's persistent compilation cache for this process; return its directory (None: off).

    `path` names the directory (relative: to the working directory); without it `$JAX_COMPILATION_CACHE_DIR`
    does when set (the empty string turns the cache off), else `$XDG_CACHE_HOME/dflash_jax/jax-compilation-cache`
    (default `~/.cache/...`). A directory another user could write to is not used: the cache is turned off, with
    one RuntimeWarning saying why.
    """
    if path is not None:
        setting = "enable_compile_cache(path=...)"
        directory: Path | None = Path(os.path.expanduser(os.fspath(path))).absolute()
    elif VARIABLE in os.environ:  # JAX read it when imported: overridden below when it is not trusted
        setting, configured = VARIABLE, os.environ[VARIABLE]
        directory = absolute(configured, VARIABLE) if configured else None
    else:
        home = cache_home()
        setting, directory = VARIABLE, home / "dflash_jax" / "jax-compilation-cache" if home else None
    trusted = private_directory(directory, "JAX's compilation cache", setting) if directory else None
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    jax.config.update("jax_compilation_cache_dir", str(trusted) if trusted else None)
    compilation_cache.reset_cache()  # JAX opens its cache at the first compile: a later setting needs this
    return str(trusted) if trusted else None

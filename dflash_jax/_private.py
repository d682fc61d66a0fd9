"""Private directories for caches of code (compiled conversions, JAX's compilation cache) and the per-user key.

A cache of executables is code the next process runs, so every cache the package or its CLI uses follows one
policy, the one ssh applies to `~/.ssh` (docs/errors.md, "The compiled-program cache"): the directory is this
user's and writable by nobody else, and every directory above it belongs to this user or root and is writable
by nobody else unless sticky (like /tmp). A directory that fails is not used at all, with one warning that
names the reason (and the chmod that fixes a directory of this user's). Directories the package creates get
mode 0700 whatever the umask, so that they pass these rules.

A cache with no usable home (HOME unset, a uid without a passwd entry, `~nosuchuser`) is off, with one
warning: a relative path would put it under the working directory (a directory named `~`).

The key authenticates entries (HMAC-SHA256): a random `KEY_BYTES`-byte file of this user's, created 0600 in the
private `$XDG_STATE_HOME/dflash_jax` (else `~/.local/state/dflash_jax`), never in a cache, and bound to each cache
directory (its device, inode and path) by an HMAC: so only entries this user's package wrote into that very
directory verify. A cache copied or unpacked from elsewhere, with or without a key file of its own (a "warm cache"
tarball), or forged over a known digest, is never deserialised: it is recompiled.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
import tempfile
import threading
import warnings
from pathlib import Path

KEY_FILE = "hmac.key"
KEY_BYTES = 32
_WARNED: set[str] = set()  # what was already warned about (a directory, a setting)
_LOCK = threading.Lock()


def cache_home() -> Path | None:
    """`$XDG_CACHE_HOME` when absolute (the XDG spec ignores a relative one), else `~/.cache`; None (warned once)
    when there is no home directory."""
    return _xdg("XDG_CACHE_HOME", ".cache")


def state_home() -> Path | None:
    """`$XDG_STATE_HOME` when absolute, else `~/.local/state` (where the key lives, `user_key`); None (warned once)
    when there is no home directory."""
    return _xdg("XDG_STATE_HOME", os.path.join(".local", "state"))


def _xdg(variable: str, default: str) -> Path | None:
    """`$variable` when absolute, else `~/default`; None (warned once) without a home directory."""
    xdg = os.environ.get(variable)
    if xdg and os.path.isabs(xdg):
        return Path(xdg)
    configured = os.environ.get("HOME")  # set but empty or relative: unusable (expanduser would make "" into "/")
    # unset: the passwd entry's, else "~" itself (a uid without an entry)
    home = os.path.expanduser("~") if configured is None or os.path.isabs(configured) else ""
    if not os.path.isabs(home):
        warn_once("home", "dflash_jax: no home directory (HOME unset and no passwd entry for this uid, or HOME "
                          "empty or not an absolute path), so compiled programs are not cached on disk; set "
                          "XDG_CACHE_HOME and XDG_STATE_HOME to private directories (or DFLASH_JAX_CACHE_DIR, "
                          "JAX_COMPILATION_CACHE_DIR for one cache)")
        return None
    return Path(home) / default


def absolute(configured: str, variable: str) -> Path | None:
    """The directory a setting names, `~` expanded; None (warned once) when that is not an absolute path."""
    expanded = os.path.expanduser(configured)
    if os.path.isabs(expanded):
        return Path(expanded)
    warn_once(variable, f"dflash_jax: {variable}={configured!r} is not an absolute path (an unknown user or no home "
                        "directory for '~'?), so that cache is off; set it to an absolute private directory")
    return None


def private_directory(directory: Path, what: str, variable: str) -> Path | None:
    """`directory`, created 0700 where missing; None (warned once) when another user could plant files in it.

    `what` names the cache and `variable` the setting that moves it, for the warning.
    """
    try:
        _make_private(directory)
        problem = untrusted(directory)
    except OSError as e:
        problem = f"cannot use it ({e.strerror or e})"
    if problem is None:
        return directory
    _not_using(str(directory), directory, what, problem, f"Set {variable} to a private directory (yours, mode 0700)")
    return None


def _not_using(once: str, directory: Path, what: str, problem: str, remedy: str) -> None:
    """Warn (once per `once`) that the cache `directory` is off, why, and what turns it back on."""
    warn_once(once, f"dflash_jax: not using {directory} for {what}: {problem}. Without it programs are compiled in "
                    f"every process. {remedy}, or set it to '' to turn this cache off.")


def _make_private(directory: Path) -> None:
    """Create the missing directories of `directory`, top first, each 0700 whatever the umask."""
    missing = [p for p in (directory, *directory.parents) if not os.path.lexists(p)]
    for path in reversed(missing):
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:  # made by another process meanwhile: judged by `untrusted`
            continue
        os.chmod(path, 0o700)  # the umask may have taken bits off 0700; it can never have added any


def untrusted(directory: Path) -> str | None:
    """Why another user could plant or swap files in `directory`, or None (the policy of the module docstring)."""
    uid = os.getuid()
    resolved = directory.resolve()
    status = os.stat(resolved)
    if not stat.S_ISDIR(status.st_mode):
        return "not a directory"
    if status.st_uid != uid:
        return f"it is owned by uid {status.st_uid}, not by this user (uid {uid})"
    if status.st_mode & 0o022:
        return (f"it is writable by group or others (mode {stat.S_IMODE(status.st_mode):04o}); "
                f"`chmod go-w {resolved}` makes it private")
    for parent in resolved.parents:
        status = os.stat(parent)
        open_to_others = status.st_mode & 0o022 and not status.st_mode & stat.S_ISVTX
        if status.st_uid not in (uid, 0) or open_to_others:
            fix = f"; `chmod go-w {parent}` fixes it" if status.st_uid == uid else ""
            return (f"its parent {parent} (uid {status.st_uid}, mode {stat.S_IMODE(status.st_mode):04o}) lets "
                    f"another user replace it{fix}")
    return None


def user_key(directory: Path, what: str) -> bytes | None:
    """The HMAC key of the private cache `directory`: this user's key (module docstring), created on first use, bound
    to the directory; None (warned once) when the key's directory is not private or the key file is not a regular
    0600 file of this user holding `KEY_BYTES` bytes."""
    path = key_file()
    if path is None or private_directory(path.parent, f"the signing key of {what}", "XDG_STATE_HOME") is None:
        return None
    master = _read_key(path, directory, what)
    if master is None:
        return None
    try:
        status = os.stat(directory)
    except OSError:
        return None
    identity = f"{os.getuid()}:{status.st_dev}:{status.st_ino}:{os.path.realpath(directory)}".encode()
    return hmac.new(master, identity, hashlib.sha256).digest()


def key_file() -> Path | None:
    """Where this user's key lives (`user_key`), or None without a home."""
    home = state_home()
    return home / "dflash_jax" / KEY_FILE if home else None


def _read_key(path: Path, directory: Path, what: str) -> bytes | None:
    """The key at `path`, created on first use; None (warned once, naming `directory`'s cache) when it is not a
    regular 0600 file of this user holding `KEY_BYTES` bytes."""
    try:
        if not os.path.lexists(path):
            _create_key(path)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # a link fails, a FIFO does not block
        try:
            status = os.fstat(fd)
            good = (stat.S_ISREG(status.st_mode) and status.st_uid == os.getuid()
                    and stat.S_IMODE(status.st_mode) == 0o600)
            key = os.read(fd, KEY_BYTES + 1) if good else b""
        finally:
            os.close(fd)
        good = good and len(key) == KEY_BYTES
        problem = None if good else (f"its key file {path} is not a regular 0600 file of this user holding "
                                     f"{KEY_BYTES} bytes; remove it to make a new one")
    except OSError as e:
        problem = f"cannot use its key file {path} ({e.strerror or e})"
    if problem is None:
        return key
    _not_using(str(path), directory, what, problem, "Set XDG_STATE_HOME to another private directory")
    return None


def _create_key(path: Path) -> None:
    """Write a new random key to `path`: a 0600 temporary file (O_EXCL), then linked into place, which never
    follows or replaces what is there, so that concurrent processes agree on one complete key."""
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=".key-")
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(KEY_BYTES))
        try:
            os.link(temporary, path)
        except FileExistsError:  # another process made it first: that one is used
            pass
    finally:
        os.unlink(temporary)


def warn_once(topic: str, message: str) -> None:
    """A RuntimeWarning the first time `topic` comes up in this process."""
    with _LOCK:
        if topic in _WARNED:
            return
        _WARNED.add(topic)
    warnings.warn(message, RuntimeWarning, stacklevel=3)

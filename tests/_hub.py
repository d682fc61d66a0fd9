"""A Hugging Face hub cache laid out as huggingface_hub lays it out, for loading hub ids with no network.

    <cache>/models--<owner>--<name>/blobs/<sha256>            the files' bytes, one blob per content
    <cache>/models--<owner>--<name>/snapshots/<commit>/<file> relative symlinks to ../../blobs/<sha256>
    <cache>/models--<owner>--<name>/refs/<revision>           the commit hash the revision points at

Importing this module turns the hub off for the test process (`HF_HUB_OFFLINE=1`, read by huggingface_hub
when it is imported); the tests pass `local_files_only=True` as well.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"


def repo_folder(cache_dir: str | os.PathLike[str], repo_id: str) -> Path:
    return Path(cache_dir) / ("models--" + repo_id.replace("/", "--"))


def add_to_cache(
    cache_dir: str | os.PathLike[str],
    repo_id: str,
    files: dict[str, bytes],
    *,
    revision: str = "main",
    commit: str | None = None,
) -> Path:
    """Put `files` (repo path -> bytes) into the cache as snapshot `commit` of `repo_id`, with `refs/<revision>`
    pointing at it. Returns the snapshot directory."""
    folder = repo_folder(cache_dir, repo_id)
    commit = commit or hashlib.sha1(repr(sorted(files)).encode() + revision.encode()).hexdigest()
    snapshot = folder / "snapshots" / commit
    for name, data in files.items():
        digest = hashlib.sha256(data).hexdigest()
        blob = folder / "blobs" / digest
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink():
            link.unlink()
        link.symlink_to(os.path.relpath(blob, link.parent))
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / revision).write_text(commit)  # no newline, as huggingface_hub writes it
    return snapshot


def directory_files(directory: str | os.PathLike[str]) -> dict[str, bytes]:
    """Every file under `directory`, by its relative path: a checkpoint written by `dflash_jax.testing`."""
    root = Path(directory)
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}

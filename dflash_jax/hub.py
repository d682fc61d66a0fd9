"""Hugging Face hub ids: `resolve(path_or_id)` -> a local checkpoint directory, fetching only what a load reads.

Every loader (`load_config`, `load_drafter`, `Qwen3Target.from_pretrained`) and every CLI verb takes either a
local path or a repo id such as `z-lab/Qwen3-8B-DFlash-b16`. A path that exists is used as it is (as
transformers does, a local directory wins over a repo of the same name); anything else of the form
`owner/name` is looked up on the hub through `huggingface_hub` (the optional extra `dflash_jax[hub]`), in its
cache (`HF_HOME`, `HF_HUB_CACHE` or `cache_dir=`), with the keywords transformers' `from_pretrained` uses:
`revision`, `cache_dir`, `local_files_only`, `token`. `HF_HUB_OFFLINE=1` and `HF_TOKEN` work as they do for
every hub library (huggingface_hub reads them when it is imported).

Only the files a load reads are downloaded, never the whole repository (which may hold PyTorch `.bin` twins,
consolidated exports or training states): first config.json, hf_quant_config.json and
model.safetensors.index.json, then exactly the shards the index names, or model.safetensors when there is no
index (any top-level `*.safetensors` when there is neither, which is what `Checkpoint` reads then). The
second step is pinned to the commit the first one resolved, so a branch that moves between them cannot mix
two revisions, and is skipped when the cache already holds those files.

A revision whose snapshot in the cache holds every file a load reads is used from the cache without asking
the hub (no wait on a network that is down; a branch stays where it was last fetched: pass a commit, or
delete the repo's cache entry, to move on). Shards its index names that the snapshot lacks get one bounded
request to the hub, then are fetched pinned to its commit or named in a `ConfigError` (not a minute of
retries). Whatever the cache says is checked first, so that a cache another tool or user tampered with cannot
point a load elsewhere: a ref must hold a commit hash, read as a small regular file (a FIFO would block), and
the snapshot and every file in it must lie inside the repo's cache entry (its files are links into
`../../blobs`); anything else is a `ConfigError` naming the file.

Every failure is a `ConfigError` naming the id: not on the hub, no such revision, gated or private without a
token, or (offline, or the hub unreachable) not in the cache. A path-looking argument that does not exist
(a path separator that is not `owner/name`, or a name ending in `.json` or `.safetensors`), or an id
huggingface_hub's rules refuse (`a/.`, `a/-b`, `a/x.git`), is "no such file or directory", never a hub error;
a revision that is no valid git ref name is a `ValueError` naming it.
"""

from __future__ import annotations

import glob
import os
import re
from typing import Any, TypedDict

from .errors import CheckpointError, ConfigError
from .safetensors import INDEX_FILE, SINGLE_FILE, read_json, read_small

__all__ = ["resolve", "HubOptions", "is_repo_id"]

METADATA_FILES = ("config.json", "generation_config.json", "hf_quant_config.json", INDEX_FILE)
# `owner/name`, as the hub spells repo ids (huggingface_hub's `validate_repo_id`): each 1-96 ASCII letters, digits,
# `-`, `_`, `.`, beginning and ending with neither `-` nor `.` (the owner: with a letter or digit).
_REPO_ID = re.compile(r"[A-Za-z0-9](?:[\w.-]{0,94}\w)?/\w(?:[\w.-]{0,94}\w)?", re.ASCII)
_COMMIT = re.compile(r"[0-9a-f]{40}")  # the hub's commit hashes (SHA-1)
# what git's `check-ref-format` refuses in a ref name, besides "@" alone and a trailing "."
_BAD_REF = re.compile(r"^$|^/|/$|//|\.\.|@\{|(^|/)\.|\.lock(/|$)|[\x00-\x20\x7f~^:?*\[\\]")


class HubOptions(TypedDict, total=False):
    """The hub keywords every loader takes (`**hub: Unpack[HubOptions]`), as transformers' `from_pretrained`
    spells them; they apply only to repo ids (`resolve`)."""

    revision: str | None  # a branch, tag or commit
    cache_dir: str | os.PathLike[str] | None  # else HF_HUB_CACHE / HF_HOME
    local_files_only: bool  # the cache only, never the network
    token: str | bool | None  # for gated or private repos; else HF_TOKEN


def is_repo_id(text: str) -> bool:
    """Whether `text` reads as a hub repo id `owner/name` (not a path such as `/x`, `./x`, `a/b/c`, `../x` or a
    file name such as `configs/x.json`), by huggingface_hub's rules, so that it never refuses one of ours with
    its own error."""
    return (bool(_REPO_ID.fullmatch(text)) and ".." not in text and "--" not in text
            and not text.endswith((".json", ".safetensors", ".git")))


def resolve(
    path_or_id: str | os.PathLike[str],
    *,
    revision: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    local_files_only: bool = False,
    token: str | bool | None = None,
) -> str:
    """A local path for `path_or_id`: the path itself when it exists, else the snapshot directory of the repo in
    the hub cache, holding the files a load reads (downloaded unless cached).

    The keywords are transformers' and apply only to repo ids. Raises `ConfigError` naming the path or the id
    when it cannot be had, and when huggingface_hub is not installed; `ValueError` for a malformed revision.
    """
    path = os.fspath(path_or_id)
    if os.path.exists(path):
        return path
    if not is_repo_id(path):
        raise ConfigError(f"no such file or directory: {path}")
    check_revision(revision)
    try:
        import huggingface_hub
        from huggingface_hub import constants
        from huggingface_hub.file_download import repo_folder_name
    except ImportError:
        raise ConfigError(
            f"{path}: no such file or directory; to load it as a Hugging Face hub id install huggingface_hub "
            "(pip install 'dflash_jax[hub]')"
        ) from None
    storage = os.path.join(os.fspath(cache_dir or constants.HF_HUB_CACHE),
                           repo_folder_name(repo_id=path, repo_type="model"))
    options: dict[str, Any] = dict(cache_dir=cache_dir, local_files_only=local_files_only, token=token)
    snapshot = _cached_snapshot(storage, path, revision)
    if snapshot is not None and os.path.exists(os.path.join(snapshot, "config.json")):
        missing = _missing(snapshot)
        if missing and missing != [SINGLE_FILE]:  # files its index names: fetched once each, or said missing
            _fetch_missing(huggingface_hub, path, snapshot, missing, revision, options)
            _check_inside(storage, snapshot, _ref_file(storage, revision) or snapshot)
        if not _missing(snapshot):
            return snapshot  # complete: nothing (more) to ask the hub
    snapshot = _snapshot(huggingface_hub, path, list(METADATA_FILES), revision=revision, **options)
    _check_inside(storage, snapshot, _ref_file(storage, revision) or snapshot)
    commit = os.path.basename(snapshot)  # snapshots/<commit hash>: pin the second step to it
    missing = _missing(snapshot)
    if missing:
        _snapshot(huggingface_hub, path, [glob.escape(name) for name in missing], revision=commit, **options)
        if _missing(snapshot) == [SINGLE_FILE]:  # no index, no model.safetensors: any top-level one
            _snapshot(huggingface_hub, path, ["*.safetensors"], ignore=["*/*"], revision=commit, **options)
    _check_inside(storage, snapshot, _ref_file(storage, revision) or snapshot)
    return snapshot


def check_revision(revision: str | None) -> None:
    """Refuse a revision that no branch, tag or commit can be named (git's ref-name rules, `git check-ref-format`):
    empty, `..`, an empty or dot-led component, a control character, space or one of `~^:?*[\\`."""
    if revision is None:
        return
    if not isinstance(revision, str):
        raise TypeError(f"revision: expected a branch, tag or commit name (a str), got {type(revision).__name__}")
    if revision == "@" or revision.endswith(".") or _BAD_REF.search(revision):
        raise ValueError(f"revision {revision!r}: not a valid branch, tag or commit name (git's rules: not empty, "
                         "no '..', no empty or dot-led path component, no spaces or control characters, none of "
                         "~^:?*[\\)")


def _ref_file(storage: str, revision: str | None) -> str | None:
    """The cache's ref file of a branch or tag (None for a commit, which needs none)."""
    revision = revision or "main"
    return None if _COMMIT.fullmatch(revision) else os.path.join(storage, "refs", revision)


def _cached_snapshot(storage: str, repo_id: str, revision: str | None) -> str | None:
    """The snapshot directory the cache holds for `revision`, checked (`_check_inside`); None when it has none."""
    ref = _ref_file(storage, revision)
    if ref is None:
        commit = revision or ""
    elif not os.path.lexists(ref):
        return None
    else:
        try:
            text = read_small(ref, "a hub ref (a commit hash)", 256)
        except CheckpointError as e:
            raise ConfigError(f"{e}; remove it (huggingface_hub writes it again online)") from None
        commit = text.decode("ascii", "replace")
        if not _COMMIT.fullmatch(commit):
            raise ConfigError(f"{ref}: this hub cache ref of {repo_id} holds {commit[:100]!r}, not a commit hash, "
                              "so it could point the load outside the cache; remove it (huggingface_hub writes it "
                              "again online)")
    snapshot = os.path.join(storage, "snapshots", commit)
    if not os.path.lexists(snapshot):
        return None
    _check_inside(storage, snapshot, ref or snapshot)
    return snapshot


def _check_inside(storage: str, snapshot: str, blame: str) -> None:
    """Refuse (naming `blame`, the ref file or the snapshot) a snapshot that is not a directory of the repo's
    `snapshots/`, or that holds an entry leading outside the repo's cache entry (files link into its blobs)."""
    root = os.path.realpath(storage)

    def refuse(entry: str) -> ConfigError:
        return ConfigError(f"{blame}: this hub cache entry leads outside {storage}: {entry} is "
                           f"{os.path.realpath(entry)}; refusing to load from elsewhere (remove the cache entry)")

    if os.path.dirname(os.path.realpath(snapshot)) != os.path.join(root, "snapshots"):
        raise refuse(snapshot)
    if not os.path.isdir(snapshot):
        raise ConfigError(f"{blame}: {snapshot} is not a directory; expected a hub cache snapshot (remove the entry)")
    for top, directories, files in os.walk(snapshot):
        for name in directories + files:  # a linked directory is listed, not entered
            entry = os.path.join(top, name)
            if not os.path.realpath(entry).startswith(root + os.sep):
                raise refuse(entry)


def _missing(snapshot: str) -> list[str]:
    """The weight files a load reads that `snapshot` lacks (none: it holds them all): the shards its index names,
    else model.safetensors, unless it holds some top-level safetensors file."""
    index = os.path.join(snapshot, INDEX_FILE)
    if os.path.lexists(index):  # read only if a regular file: a FIFO or a directory there is refused
        weight_map = read_json(index, "the index")
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        shards = sorted({s for s in weight_map.values() if isinstance(s, str)}) if isinstance(weight_map, dict) else []
        # a malformed index fetches nothing more: `Checkpoint` then says what is wrong with it
        return [s for s in shards if not os.path.exists(os.path.join(snapshot, s))]
    return [] if glob.glob(os.path.join(glob.escape(snapshot), "*.safetensors")) else [SINGLE_FILE]


def _fetch_missing(hub, repo_id: str, snapshot: str, missing: list[str], revision: str | None,
                   options: dict[str, Any]) -> None:
    """The files `missing` from a cached `snapshot`, fetched pinned to its commit after one bounded attempt to
    reach the hub (`get_hf_file_metadata`: one request within `HF_HUB_ETAG_TIMEOUT`, no retries), rather than
    through `snapshot_download` or a bare `hf_hub_download`, which retry for most of a minute when the hub is
    unreachable. A failure (offline or `local_files_only` included) is a `ConfigError` naming what is missing."""
    commit = os.path.basename(snapshot)
    try:
        if options["local_files_only"]:
            raise FileNotFoundError("local_files_only=True")
        hub.get_hf_file_metadata(hub.hf_hub_url(repo_id, missing[0], revision=commit), token=options["token"])
        for name in missing:
            hub.hf_hub_download(repo_id, name, revision=commit, **options)
    except Exception as e:  # huggingface_hub's errors, and its HTTP client's (httpx's ConnectError is no OSError)
        raise ConfigError(
            f"{repo_id}: the hub cache holds revision {revision or 'main'!r} (snapshot {snapshot}) without "
            f"{', '.join(missing)}, which its index names, and the hub could not supply "
            f"{'it' if len(missing) == 1 else 'them'} ({type(e).__name__}: {_first_line(e)}); download it online "
            "(or remove the snapshot to fetch it whole), or pass a local checkpoint directory"
        ) from None


def _snapshot(hub, repo_id: str, patterns: list[str], *, ignore: list[str] | None = None, **options) -> str:
    """`snapshot_download` of the files matching `patterns`, its errors turned into a `ConfigError`.

    huggingface_hub's errors are `OSError`s (HTTP errors, not-in-cache, offline) or `ValueError`s (a
    malformed id or revision) across its versions.
    """
    try:
        return hub.snapshot_download(repo_id, allow_patterns=patterns, ignore_patterns=ignore, **options)
    except (OSError, ValueError) as e:
        revision = options.get("revision") or "main"
        if isinstance(e, FileNotFoundError):  # LocalEntryNotFoundError: offline, or the hub unreachable
            from huggingface_hub import constants

            cache = options.get("cache_dir") or constants.HF_HUB_CACHE
            raise ConfigError(
                f"{repo_id}: not a local path, and revision {revision!r} of this Hugging Face repo is not in the "
                f"hub cache ({cache}) and could not be downloaded ({_first_line(e)}); download it once online, "
                "or pass a local checkpoint directory"
            ) from None
        raise ConfigError(
            f"{repo_id}: not a local path, and the Hugging Face hub refused it as a repo id at revision "
            f"{revision!r}: {type(e).__name__}: {_first_line(e)}"
        ) from None


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]

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
two revisions.

Every failure is a `ConfigError` naming the id: not on the hub, no such revision, gated or private without a
token, or (offline, or the hub unreachable) not in the cache.
"""

from __future__ import annotations

import glob
import os
import re
from typing import Any, TypedDict

from .errors import ConfigError
from .safetensors import INDEX_FILE, SINGLE_FILE, read_json

METADATA_FILES = ("config.json", "hf_quant_config.json", INDEX_FILE)
# `owner/name`, as the hub spells repo ids (names of 1-96 characters of letters, digits, `-`, `_`, `.`).
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}")


class HubOptions(TypedDict, total=False):
    """The hub keywords every loader takes (`**hub: Unpack[HubOptions]`), as transformers' `from_pretrained`
    spells them; they apply only to repo ids (`resolve`)."""

    revision: str | None  # a branch, tag or commit
    cache_dir: str | os.PathLike[str] | None  # else HF_HUB_CACHE / HF_HOME
    local_files_only: bool  # the cache only, never the network
    token: str | bool | None  # for gated or private repos; else HF_TOKEN


def is_repo_id(text: str) -> bool:
    """Whether `text` reads as a hub repo id `owner/name` (not a path such as `/x`, `./x`, `a/b/c` or `../x`)."""
    return bool(_REPO_ID.fullmatch(text)) and ".." not in text and "--" not in text


def resolve(
    path_or_id: str | os.PathLike[str],
    *,
    revision: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    local_files_only: bool = False,
    token: str | bool | None = None,
) -> str:
    """A local path for `path_or_id`: the path itself when it exists (or is no repo id), else the snapshot
    directory of the repo in the hub cache, holding the files a load reads (downloaded unless cached).

    The keywords are transformers' and apply only to repo ids. Raises `ConfigError` naming the id when it
    cannot be had, and when huggingface_hub is not installed.
    """
    path = os.fspath(path_or_id)
    if os.path.exists(path) or not is_repo_id(path):
        return path  # the caller's own reader says what is wrong with a path that is neither
    try:
        import huggingface_hub
    except ImportError:
        raise ConfigError(
            f"{path}: no such file or directory; to load it as a Hugging Face hub id install huggingface_hub "
            "(pip install 'dflash_jax[hub]')"
        ) from None
    options: dict[str, Any] = dict(cache_dir=cache_dir, local_files_only=local_files_only, token=token)
    snapshot = _snapshot(huggingface_hub, path, list(METADATA_FILES), revision=revision, **options)
    commit = os.path.basename(snapshot)  # snapshots/<commit hash>: pin the second step to it
    index = os.path.join(snapshot, INDEX_FILE)
    if os.path.isfile(index):
        weight_map = read_json(index, "the index")
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        shards = sorted({s for s in weight_map.values() if isinstance(s, str)}) if isinstance(weight_map, dict) else []
        if shards:  # a malformed index fetches nothing more: `Checkpoint` then says what is wrong with it
            _snapshot(huggingface_hub, path, [glob.escape(s) for s in shards], revision=commit, **options)
        return snapshot
    _snapshot(huggingface_hub, path, [SINGLE_FILE], revision=commit, **options)
    if not os.path.exists(os.path.join(snapshot, SINGLE_FILE)):  # no index, no model.safetensors: any top-level one
        _snapshot(huggingface_hub, path, ["*.safetensors"], ignore=["*/*"], revision=commit, **options)
    return snapshot


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

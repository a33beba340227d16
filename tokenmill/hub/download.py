"""A named model in the Hub's own cache: found there with no network, or downloaded into it.

Everything goes through ``huggingface_hub``: its cache (``HF_HOME``, ``HF_HUB_CACHE``), its resumable
downloads with their progress bars and file locks, ``HF_TOKEN``, ``HF_ENDPOINT`` for mirrors and
``HF_HUB_OFFLINE``. A model already complete in the cache starts without a single request (as Ollama's
do): ``tokenmill pull`` is how a cached revision is brought up to date. Only the files the model needs
are fetched (one quant of a GGUF repo; a safetensors repo's shards, config and tokenizer, never its
other formats), after the architecture and the free disk space are checked against the Hub's listing.
"""

from __future__ import annotations

import contextlib
import glob
import json
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenmill.errors import ModelLoadError
from tokenmill.hub.refs import HubRef, ModelFiles, choose_files

# (kind, summary) -> None, or a ModelLoadError naming the architecture: kind "hf" with the Hub's
# config summary (model_type, architectures), kind "gguf" with its GGUF summary (architecture).
ArchitectureCheck = Callable[[str, dict[str, Any]], None]


@dataclass(frozen=True)
class Resolved:
    """Where a named model is on this disk."""

    ref: HubRef
    revision: str  # as asked: a branch, a tag or a commit
    commit: str
    folder: Path  # the snapshot
    files: ModelFiles
    size: int  # bytes of the model's files

    @property
    def path(self) -> Path:
        """What the loader is given: the snapshot folder, or the GGUF file (a split model's first part)."""
        return self.folder / self.files.entry if self.files.entry else self.folder


def endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def cache_dir() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def resolve(
    ref: HubRef, revision: str | None = None, *, update: bool = False, check: ArchitectureCheck | None = None
) -> Resolved:
    """The model ``ref`` names at ``revision`` (default: the repo's main branch), from the cache if
    it is complete there (unless ``update``), else downloaded."""
    from huggingface_hub import constants

    revision = revision or "main"
    if not update and (cached := find_cached(ref, revision)) is not None:
        return cached
    if constants.HF_HUB_OFFLINE:
        raise ModelLoadError(
            f"{ref} (revision {revision}) is not in the Hub cache ({cache_dir()}) and HF_HUB_OFFLINE=1 forbids "
            f"downloading it: run `tokenmill pull {ref}` where the Hub is reachable, or unset HF_HUB_OFFLINE"
        )
    with hub_errors(ref, revision):
        return _download(ref, revision, check)


def find_cached(ref: HubRef, revision: str) -> Resolved | None:
    """The model, when every file it needs is in the cache's snapshot of ``revision``; no network.
    The snapshot is found as huggingface_hub's ``try_to_load_from_cache`` finds it (``refs/`` names
    the commit, ``snapshots/<commit>/`` holds its files, links made once a download completes), with
    the library's own names for the folders: its ``snapshot_download(local_files_only=True)`` would
    do the same after importing its whole API client, 0.1 s of every start."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import REGEX_COMMIT_HASH, repo_folder_name

    storage = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=ref.repo_id, repo_type="model")
    commit = revision
    if not REGEX_COMMIT_HASH.fullmatch(revision):
        try:
            commit = (storage / "refs" / revision).read_text().strip()
        except OSError:
            return None
    folder = storage / "snapshots" / commit
    if not folder.is_dir():
        return None
    names = _listing(storage, commit) or [str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()]
    try:
        files = choose_files(ref, names, lambda n: read_json_file(folder / n), where="the cache")
    except ModelLoadError:
        return None
    if not all((folder / f).is_file() for f in files.files):
        return None  # a shard not downloaded yet
    size = sum((folder / f).stat().st_size for f in files.files)
    return Resolved(ref, revision, commit, folder, files, size)


def _listing(storage: Path, commit: str) -> list[str] | None:
    """The repo's files at ``commit`` as the Hub listed them when the snapshot was downloaded (the
    client keeps the listing beside the snapshots, ``trees/<commit>.json``), so that a choice made
    offline (no tag: Q4_K_M, else the only GGUF) is the one made online, whichever quants are cached."""
    listing = read_json_file(storage / "trees" / f"{commit}.json")
    files = listing.get("files") if listing.get("format_version") == 1 else None
    return sorted(files) if isinstance(files, dict) else None


def read_json_file(path: str | Path) -> dict:
    """A small JSON file of a snapshot (a safetensors index), or {} when it is not one."""
    try:
        with open(path) as f:
            obj = json.load(f)
    except (OSError, ValueError):
        return {}
    return obj if isinstance(obj, dict) else {}


def _download(ref: HubRef, revision: str, check: ArchitectureCheck | None) -> Resolved:
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download, try_to_load_from_cache

    api = HfApi()
    rev = api.resolve_revision(ref.repo_id, revision=revision)  # one commit for every file; refs/ cached
    info = api.model_info(ref.repo_id, revision=rev.resolved, files_metadata=True)
    sizes = {s.rfilename: s.size or 0 for s in info.siblings or []}

    def read_json(name: str) -> dict:
        return read_json_file(hf_hub_download(ref.repo_id, name, revision=rev))

    if info.gated:  # the listing is public, the files are not: find out before any download starts
        api.auth_check(ref.repo_id)
    files = choose_files(ref, sizes, read_json, where=f"the Hub ({endpoint()})")
    if check is not None:
        if files.kind == "safetensors" and info.config:
            check("hf", info.config)
        elif files.kind == "gguf" and info.gguf:
            check("gguf", info.gguf)
    missing = [f for f in files.files if not isinstance(try_to_load_from_cache(ref.repo_id, f, revision=rev), str)]
    _check_disk(ref, sum(sizes.get(f, 0) for f in missing))
    folder = Path(snapshot_download(ref.repo_id, revision=rev, allow_patterns=[glob.escape(f) for f in files.files]))
    size = sum((folder / f).stat().st_size for f in files.files)
    return Resolved(ref, revision, rev.resolved, folder, files, size)


def _check_disk(ref: HubRef, need: int) -> None:
    """Refuse before downloading what the cache's disk cannot hold."""
    where = cache_dir()
    while not where.exists() and where != where.parent:
        where = where.parent
    free = shutil.disk_usage(where).free
    if need > free:
        raise ModelLoadError(
            f"{ref} needs {need / 2**30:.2f} GiB to download and {free / 2**30:.2f} GiB is free for the Hub cache "
            f"({cache_dir()}): free space there, or set HF_HUB_CACHE to a larger disk"
        )


def _said(error: BaseException) -> str:
    """The Hub's own words for an HTTP error, one line."""
    text = getattr(error, "server_message", None) or str(error)
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


@contextlib.contextmanager
def hub_errors(ref: HubRef, revision: str) -> Iterator[None]:
    """The client's exceptions as one line each that says what to do."""
    import httpx2
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
        RevisionResolutionError,
    )

    unreachable = (
        f"cannot reach the Hub at {endpoint()} and {ref} (revision {revision}) is not in the cache ({cache_dir()}): "
        f"connect, or run `tokenmill pull {ref}` where the Hub is reachable (HF_HUB_OFFLINE=1 starts from the "
        "cache alone)"
    )
    try:
        yield
    except GatedRepoError as e:
        raise ModelLoadError(
            f"{ref.repo_id} is gated: accept its terms at {endpoint()}/{ref.repo_id} and set HF_TOKEN to a token of "
            f"an account with access (the Hub said: {_said(e)})"
        ) from None
    except RepositoryNotFoundError:
        raise ModelLoadError(
            f"no model {ref.repo_id} on the Hub ({endpoint()}) and no file or folder of that name here "
            "(a private repo needs HF_TOKEN)"
        ) from None
    except HFValidationError as e:
        raise ModelLoadError(f"{ref} is not a valid Hub repo id or revision: {_said(e)}") from None
    except RevisionNotFoundError:
        raise ModelLoadError(f"{ref.repo_id} has no revision {revision!r} (a branch, a tag or a commit)") from None
    except RemoteEntryNotFoundError as e:
        raise ModelLoadError(f"{ref.repo_id} at {revision}: a file it lists is missing ({_said(e)})") from None
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else None
        if status in (401, 403):
            raise ModelLoadError(
                f"the Hub refused {ref.repo_id} (HTTP {status}): set HF_TOKEN to a token with read access to it "
                f"(the Hub said: {_said(e)})"
            ) from None
        raise ModelLoadError(f"the Hub answered HTTP {status} for {ref.repo_id}: {_said(e)}") from None
    except (
        LocalEntryNotFoundError,
        RevisionResolutionError,
        OfflineModeIsEnabled,
        httpx2.ConnectError,
        httpx2.TimeoutException,
        httpx2.RemoteProtocolError,
    ):
        raise ModelLoadError(unreachable) from None

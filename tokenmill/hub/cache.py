"""What the Hub's cache holds, by model, and removing a model from it: through huggingface_hub's own
cache tools (``scan_cache_dir``, ``delete_revisions``), which know the layout, the shared blobs and the
refs, so that freeing one revision never breaks another."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokenmill.errors import ModelLoadError
from tokenmill.hub.refs import HubRef, gguf_choices


@dataclass(frozen=True)
class CachedModel:
    """One cached revision of a model repo."""

    repo_id: str
    commit: str
    refs: tuple[str, ...]  # the branches and tags that point at it
    folder: Path  # its snapshot
    kind: str  # "safetensors", "gguf", "adapter" or "other"
    quants: dict[str, tuple[Path, int]]  # a GGUF repo's cached tags: each one's (first) file and its bytes
    size: int  # bytes on disk

    @property
    def revision(self) -> str:
        return ", ".join(self.refs) if self.refs else self.commit[:12]


def cached_models() -> list[CachedModel]:
    """Every cached model revision, by repo id."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir()
    except CacheNotFound:  # nothing downloaded yet
        return []
    out = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        for rev in sorted(repo.revisions, key=lambda r: r.last_modified, reverse=True):
            names = [str(f.file_path.relative_to(rev.snapshot_path)) for f in rev.files]
            ggufs = gguf_choices(names)
            if ggufs:
                kind = "gguf"
            elif "config.json" in names and any(n.endswith(".safetensors") for n in names):
                kind = "safetensors"
            elif "adapter_config.json" in names:
                kind = "adapter"
            else:
                kind = "other"
            sizes = {str(f.file_path.relative_to(rev.snapshot_path)): f.size_on_disk for f in rev.files}
            quants = {tag: (rev.snapshot_path / files[0], sum(sizes[f] for f in files)) for tag, files in ggufs.items()}
            out.append(
                CachedModel(
                    repo.repo_id,
                    rev.commit_hash,
                    tuple(sorted(rev.refs)),
                    rev.snapshot_path,
                    kind,
                    quants,
                    rev.size_on_disk,
                )
            )
    return out


def remove(ref: HubRef, revision: str | None = None) -> tuple[int, list[str]]:
    """Delete a repo's cached revisions (all, or the one a branch, tag or commit prefix names):
    the bytes freed and the commits removed."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    if ref.tag is not None:
        raise ModelLoadError(
            f"`tokenmill rm` removes a repo's download (a revision), and its quants share it: "
            f"`tokenmill rm {ref.repo_id}` (with --revision to keep the others)"
        )
    try:
        info = scan_cache_dir()
    except CacheNotFound:
        info = None
    repos = [] if info is None else [r for r in info.repos if r.repo_type == "model" and r.repo_id == ref.repo_id]
    if not repos:
        raise ModelLoadError(f"{ref.repo_id} is not in the Hub cache; `tokenmill list` shows what is")
    revisions = repos[0].revisions
    if revision is not None:
        revisions = [
            r for r in revisions if revision in r.refs or (len(revision) >= 7 and r.commit_hash.startswith(revision))
        ]
        if not revisions:
            held = ", ".join(sorted({*(x for r in repos[0].revisions for x in r.refs)})) or "none"
            raise ModelLoadError(f"{ref.repo_id} has no cached revision {revision!r} (cached refs: {held})")
    commits = sorted(r.commit_hash for r in revisions)
    assert info is not None
    strategy = info.delete_revisions(*commits)
    strategy.execute()
    return strategy.expected_freed_size, commits

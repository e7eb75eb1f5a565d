"""``hf://org/name@revision``: the identity is the commit sha from the Hub's metadata (``HfApi().model_info``;
offline, the local Hub cache's refs) and only ``config.json`` is read; the digest is derived from repo and commit,
never a branch name. Materialized as the Hub snapshot of exactly the identified commit. A branch's head (what a
tracked model follows) is the commit it names now."""

from __future__ import annotations

from pathlib import Path
from typing import cast

from builder.sources.base import Access, ResolvedCheckpoint, SourceIO, read_config_file, too_big
from kiln.digests import sha256_json
from kiln.errors import CheckpointNotFound, SpecError, StorageUnavailable
from kiln.sources import COMMIT_RE, parse_hf_ref


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _hub_cache() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE).resolve()


def _inside_hub_cache(path: Path, repo: str, revision: str | None) -> Path:
    """``path`` (in a snapshot folder) must lie inside the Hub cache, its folder named by a commit sha."""
    cache = _hub_cache()
    snapshot = path.parent if path.name == "config.json" else path
    if not (COMMIT_RE.fullmatch(snapshot.name) and snapshot.resolve().is_relative_to(cache)
            and path.resolve().is_relative_to(cache)):
        raise _not_found(repo, revision)
    return snapshot


def _not_found(repo: str, revision: str | None) -> CheckpointNotFound:
    # one answer for every missing or unusable revision: which files exist on the server is nobody's business
    hint = "download it once online, or unset HF_HUB_OFFLINE" if _offline() else "check the repo name and revision"
    return CheckpointNotFound(f"{repo}@{revision}: no checkpoint (config.json) found", field="checkpoint", fix=hint)


def _hf_error(exc: Exception, repo: str, revision: str | None) -> Exception:
    """huggingface_hub's exceptions as Kiln's: a missing repo, revision or file (or unusable cache contents)
    is one 422; the Hub failing or unreachable is a 503."""
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    if isinstance(exc, (CheckpointNotFound, SpecError)):
        return exc
    if isinstance(exc, (RepositoryNotFoundError, RevisionNotFoundError, EntryNotFoundError)):
        return _not_found(repo, revision)
    if isinstance(exc, HfHubHTTPError):
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if status is not None and 400 <= status < 500:
            return _not_found(repo, revision)
        return StorageUnavailable(f"the Hub answered {type(exc).__name__} for {repo}")
    if isinstance(exc, (OSError, ValueError)) and _offline():  # odd local cache contents
        return _not_found(repo, revision)
    return StorageUnavailable(f"the Hub is unreachable for {repo} ({type(exc).__name__})")


def _identify(ref: str, max_bytes: int | None) -> ResolvedCheckpoint:
    from huggingface_hub import HfApi, hf_hub_download

    repo, revision = parse_hf_ref(ref)
    size = None
    try:
        if _offline():
            config_path = Path(hf_hub_download(repo, "config.json", revision=revision, local_files_only=True))
            sha = config_path.parent.name  # the cache lays snapshots out as snapshots/<commit sha>/
        else:
            info = HfApi().model_info(repo, revision=revision, files_metadata=True)
            sha = info.sha or ""
            names = {s.rfilename for s in info.siblings or []}
            if "config.json" not in names:
                raise _not_found(repo, revision)
            size = sum(s.size or 0 for s in info.siblings or [])
            if max_bytes is not None and size > max_bytes:
                raise too_big(ref, size, max_bytes)
            config_path = Path(hf_hub_download(repo, "config.json", revision=sha))
    except Exception as exc:
        raise _hf_error(exc, repo, revision) from None
    if not COMMIT_RE.fullmatch(sha):
        raise _not_found(repo, revision)
    _inside_hub_cache(config_path, repo, revision)
    config = read_config_file(config_path, f"{repo}@{sha}")
    return ResolvedCheckpoint(ref, "hf", sha256_json({"hf": repo, "commit": sha}), None, sha, [], config, size)


def identify(ref: str, access: Access) -> tuple[ResolvedCheckpoint, bool]:
    return _identify(ref, access.max_bytes), False


def materialize(resolved: ResolvedCheckpoint, access: Access) -> Path:
    from huggingface_hub import snapshot_download

    repo, _ = parse_hf_ref(resolved.ref)
    revision = resolved.revision
    try:
        local = Path(snapshot_download(repo, revision=revision, local_files_only=_offline()))
    except Exception as exc:
        raise _hf_error(exc, repo, revision) from None
    snapshot = _inside_hub_cache(local, repo, revision)
    if snapshot.name != revision:
        raise _not_found(repo, revision)
    if access.max_bytes is not None:
        total = sum(p.stat().st_size for p in snapshot.rglob("*") if p.is_file())
        if total > access.max_bytes:
            raise too_big(resolved.ref, total, access.max_bytes)
    return snapshot


def latest(ref: str, access: Access) -> str:
    """The commit the reference's branch names now (its size is not judged here: the builds it starts judge it)."""
    return cast(str, _identify(ref, None).revision)  # _identify's revision is the commit sha it found


IO = SourceIO(identify, materialize, latest)

"""Stage 1, resolve: turn a checkpoint reference into immutable content, in two steps.

**Identify** (cheap; the API runs it for ``POST /v1/builds`` and the webhook, workers run it again):

- a local directory or ``file://`` URL → sha256 over its file manifest (relative path, size, sha256 of bytes);
- ``hf://org/name@revision`` → the commit sha from the Hub's metadata (``HfApi().model_info``; offline, the local
  Hub cache's refs) and only ``config.json``; the digest is derived from repo and commit, never a branch name;
- ``s3://bucket/prefix`` (allowed buckets only) → its listing (relative keys, sizes, ETags) hashed, and only
  ``config.json`` fetched. An ETag names one stored version of an object's bytes (S3 changes it whenever the
  object is written), so the listing is the content's identity; the download is checked against it.

Identify returns the parsed ``config.json`` (family and size rules are checked from it before anything is
enqueued) and never downloads weights.

**Materialize** (workers only): the identified content on local disk, bounded by the configured maximum
checkpoint size: a Hub snapshot of exactly the identified commit, or the S3 objects fetched with ``If-Match``
their identified ETag into ``<cache>/s3/<digest>``.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from urllib.parse import urlparse

from kiln.digests import sha256_file, sha256_json
from kiln.errors import CheckpointNotFound, SpecError, StorageUnavailable
from kiln.refs import COMMIT_RE, parse_hf_ref
from kiln.spec import local_path

#: config.json is read whole (it is small); anything bigger is not a model config.
MAX_CONFIG_BYTES = 16 << 20
#: The most objects an s3:// checkpoint may hold (the listing is read in the API process).
MAX_S3_OBJECTS = 10_000


@dataclass(frozen=True)
class ResolvedCheckpoint:
    ref: str
    kind: str  # local | hf | s3
    digest: str  # content digest: the only way a checkpoint enters a key
    local_dir: Path | None  # a local directory at once; hf / s3 only once materialized (on a worker)
    revision: str | None = None  # the Hub commit sha for hf://
    files: list[dict] = field(default_factory=list)
    config: dict = field(default_factory=dict, compare=False)  # the parsed config.json
    size: int | None = None  # total bytes, where the metadata says so

    def provenance(self) -> dict:
        return {"ref": self.ref, "kind": self.kind, "digest": self.digest, "revision": self.revision,
                "files": len(self.files)}


def file_manifest(directory: Path) -> list[dict]:
    """Every regular file under ``directory`` (hidden files and folders skipped), sorted by path."""
    entries = []
    for path in sorted(directory.rglob("*")):
        rel = path.relative_to(directory)
        if any(part.startswith(".") for part in rel.parts) or not path.is_file():
            continue
        digest, size = sha256_file(path)
        entries.append({"path": rel.as_posix(), "size": size, "sha256": digest})
    return entries


def _fingerprint(directory: Path) -> str:
    """Cheap identity of a directory's current content: paths, sizes, mtimes, ctimes and inodes (as git's index
    does) of the files :func:`file_manifest` would hash."""
    return sha256_json({"dir": str(directory), "entries": stat_entries(directory)})


def stat_entries(directory: Path) -> list[list]:
    """``[path, size, mtime_ns, ctime_ns, inode]`` of the files :func:`file_manifest` hashes — the same walk
    (symlinked folders are not entered, symlinked files are followed, hidden names skipped), sorted by path,
    done with ``os.scandir`` because the service runs it on every request for the folder."""
    entries: list[list] = []

    def walk(folder: str, prefix: str) -> None:
        with os.scandir(folder) as it:
            for entry in it:
                if entry.name.startswith("."):
                    continue
                if entry.is_dir(follow_symlinks=False):
                    walk(entry.path, f"{prefix}{entry.name}/")
                elif entry.is_file():
                    st = entry.stat()
                    # ctime changes on every write and cannot be set back by utime(), unlike mtime
                    entries.append([prefix + entry.name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino])

    walk(str(directory), "")
    entries.sort()
    return entries


def parse_config(data: bytes, where: str) -> dict:
    if len(data) > MAX_CONFIG_BYTES:
        raise CheckpointNotFound(f"{where}: config.json is over {MAX_CONFIG_BYTES} bytes", field="checkpoint",
                                 fix="point at a Hugging Face format checkpoint (config.json is a small JSON object)")
    try:
        config = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        config = None
    if not isinstance(config, dict):
        raise CheckpointNotFound(f"{where}: config.json is not a JSON object", field="checkpoint",
                                 fix="point at a Hugging Face format checkpoint directory")
    return config


def _read_config_file(path: Path, where: str) -> dict:
    with open(path, "rb") as f:
        return parse_config(f.read(MAX_CONFIG_BYTES + 1), where)


#: fingerprint → (digest, manifest, config), in front of the memo files: the service resolves the same folder on
#: every request for it, and re-reading and re-hashing its manifest would cost more than the fingerprint. The
#: fingerprint covers config.json's stat too, so a changed config is read again.
_MEMO: dict[str, tuple[str, list[dict], dict]] = {}


def _identify_local(ref: str, cache_root: Path) -> tuple[ResolvedCheckpoint, bool]:
    path = local_path(ref)
    if not path.is_dir():
        raise CheckpointNotFound(f"{path.name or path} is not a directory", field="checkpoint",
                                 fix="give a directory holding config.json and *.safetensors")
    if not (path / "config.json").is_file():
        raise CheckpointNotFound(f"{path.name} has no config.json", field="checkpoint",
                                 fix="point at a Hugging Face format checkpoint directory")
    fingerprint = _fingerprint(path).split(":")[1]
    if (known := _MEMO.get(fingerprint)) is not None:
        return ResolvedCheckpoint(ref, "local", known[0], path, None, known[1], copy.deepcopy(known[2]),
                                  sum(f["size"] for f in known[1])), True
    config = _read_config_file(path / "config.json", path.name)
    memo = cache_root / "local" / (fingerprint + ".json")
    was_cached = memo.is_file()
    if was_cached:
        files = json.loads(memo.read_text())
    else:
        files = file_manifest(path)
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_suffix(f".{uuid.uuid4().hex}.tmp")
        tmp.write_text(json.dumps(files))
        os.replace(tmp, memo)
    digest = sha256_json({"files": files})
    if len(_MEMO) >= 256:
        _MEMO.clear()
    _MEMO[fingerprint] = (digest, files, copy.deepcopy(config))
    return ResolvedCheckpoint(ref, "local", digest, path, None, files, config, sum(f["size"] for f in files)), was_cached


# -- hf:// -------------------------------------------------------------------------------------------
def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _hub_cache() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE).resolve()


def _inside_hub_cache(path: Path, repo: str, revision: str) -> Path:
    """``path`` (in a snapshot folder) must lie inside the Hub cache, its folder named by a commit sha."""
    cache = _hub_cache()
    snapshot = path.parent if path.name == "config.json" else path
    if not (COMMIT_RE.fullmatch(snapshot.name) and snapshot.resolve().is_relative_to(cache)
            and path.resolve().is_relative_to(cache)):
        raise _hf_not_found(repo, revision)
    return snapshot


def _hf_not_found(repo: str, revision: str) -> CheckpointNotFound:
    # one answer for every missing or unusable revision: which files exist on the server is nobody's business
    hint = "download it once online, or unset HF_HUB_OFFLINE" if _offline() else "check the repo name and revision"
    return CheckpointNotFound(f"{repo}@{revision}: no checkpoint (config.json) found", field="checkpoint", fix=hint)


def _hf_error(exc: Exception, repo: str, revision: str) -> Exception:
    """huggingface_hub's exceptions as Kiln's: a missing repo, revision or file (or unusable cache contents)
    is one 422; the Hub failing or unreachable is a 503."""
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    if isinstance(exc, (CheckpointNotFound, SpecError)):
        return exc
    if isinstance(exc, (RepositoryNotFoundError, RevisionNotFoundError, EntryNotFoundError)):
        return _hf_not_found(repo, revision)
    if isinstance(exc, HfHubHTTPError):
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if status is not None and 400 <= status < 500:
            return _hf_not_found(repo, revision)
        return StorageUnavailable(f"the Hub answered {type(exc).__name__} for {repo}")
    if isinstance(exc, (OSError, ValueError)) and _offline():  # odd local cache contents
        return _hf_not_found(repo, revision)
    return StorageUnavailable(f"the Hub is unreachable for {repo} ({type(exc).__name__})")


def _identify_hf(ref: str, max_bytes: int | None) -> ResolvedCheckpoint:
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
                raise _hf_not_found(repo, revision)
            size = sum(s.size or 0 for s in info.siblings or [])
            if max_bytes is not None and size > max_bytes:
                raise _too_big(ref, size, max_bytes)
            config_path = Path(hf_hub_download(repo, "config.json", revision=sha))
    except Exception as exc:
        raise _hf_error(exc, repo, revision) from None
    if not COMMIT_RE.fullmatch(sha):
        raise _hf_not_found(repo, revision)
    _inside_hub_cache(config_path, repo, revision)
    config = _read_config_file(config_path, f"{repo}@{sha}")
    return ResolvedCheckpoint(ref, "hf", sha256_json({"hf": repo, "commit": sha}), None, sha, [], config, size)


def _materialize_hf(resolved: ResolvedCheckpoint, max_bytes: int | None) -> Path:
    from huggingface_hub import snapshot_download

    repo, _ = parse_hf_ref(resolved.ref)
    try:
        local = Path(snapshot_download(repo, revision=resolved.revision, local_files_only=_offline()))
    except Exception as exc:
        raise _hf_error(exc, repo, resolved.revision) from None
    snapshot = _inside_hub_cache(local, repo, resolved.revision)
    if snapshot.name != resolved.revision:
        raise _hf_not_found(repo, resolved.revision)
    if max_bytes is not None:
        total = sum(p.stat().st_size for p in snapshot.rglob("*") if p.is_file())
        if total > max_bytes:
            raise _too_big(resolved.ref, total, max_bytes)
    return snapshot


# -- s3:// -------------------------------------------------------------------------------------------
def _too_big(ref: str, size: int, limit: int) -> SpecError:
    return SpecError(f"{ref!r} holds {size:,} bytes, over the {limit:,}-byte checkpoint limit", field="checkpoint",
                     fix="build a smaller checkpoint, or raise KILN_CHECKPOINT_MAX_BYTES on the service and workers")


def _s3_location(ref: str) -> tuple[str, str]:
    url = urlparse(ref)
    prefix = url.path.lstrip("/")
    return url.netloc, prefix if not prefix or prefix.endswith("/") else prefix + "/"


def check_bucket(ref: str, buckets: list[str] | None) -> None:
    bucket, _ = _s3_location(ref)
    if buckets is not None and bucket not in buckets:
        allowed = ", ".join(buckets) or "none are configured"
        raise SpecError(f"bucket {bucket!r} is not an allowed checkpoint bucket ({allowed})", field="checkpoint",
                        fix="use an allowed bucket, or add it to KILN_CHECKPOINT_BUCKETS on the service and workers")


def _s3_errors(ref: str, exc: Exception) -> Exception:
    from botocore.exceptions import ClientError

    if isinstance(exc, ClientError):
        code = exc.response.get("Error", {}).get("Code", "")
        if code in ("NoSuchBucket", "NoSuchKey", "404", "AccessDenied", "403"):
            return CheckpointNotFound(f"{ref}: {code}", field="checkpoint", fix="check the bucket, prefix and credentials")
        if code in ("PreconditionFailed", "412"):
            return CheckpointNotFound(f"{ref} changed while it was read", field="checkpoint",
                                      fix="submit the build again once the checkpoint's upload has finished")
        return StorageUnavailable(f"S3 error reading {ref}: {code}")
    return StorageUnavailable(f"S3 unreachable reading {ref}: {type(exc).__name__}")


def _identify_s3(ref: str, endpoint_url: str | None, buckets: list[str] | None,
                 max_bytes: int | None) -> ResolvedCheckpoint:
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError

    check_bucket(ref, buckets)
    bucket, prefix = _s3_location(ref)
    client = boto3.client("s3", endpoint_url=endpoint_url)
    files: list[dict] = []
    try:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for o in page.get("Contents", []):
                rel = o["Key"][len(prefix):]
                if not rel or rel.endswith("/"):
                    continue  # folder marker objects
                parts = rel.split("/")
                if any(p in ("", ".", "..") for p in parts):
                    raise CheckpointNotFound(f"{ref} holds an object key that escapes its prefix: {o['Key']!r}",
                                             field="checkpoint", fix="remove keys with '//', '.' or '..' segments")
                if any(p.startswith(".") for p in parts):
                    continue  # hidden, as in a local directory
                files.append({"path": rel, "size": o["Size"], "etag": o["ETag"]})
                if len(files) > MAX_S3_OBJECTS:
                    raise SpecError(f"{ref} holds over {MAX_S3_OBJECTS} objects", field="checkpoint",
                                    fix="point at the prefix that holds just the checkpoint's files")
        files.sort(key=lambda f: f["path"])
        config_entry = next((f for f in files if f["path"] == "config.json"), None)
        if config_entry is None:
            raise CheckpointNotFound(f"{ref} holds no config.json", field="checkpoint",
                                     fix="point at the prefix that holds the checkpoint's files")
        size = sum(f["size"] for f in files)
        if max_bytes is not None and size > max_bytes:
            raise _too_big(ref, size, max_bytes)
        body = client.get_object(Bucket=bucket, Key=prefix + "config.json", IfMatch=config_entry["etag"])["Body"]
        data = body.read(MAX_CONFIG_BYTES + 1)
        body.close()
    except (ClientError, BotoCoreError) as exc:
        raise _s3_errors(ref, exc) from None
    config = parse_config(data, ref)
    # keys relative to the prefix, sizes and ETags: the same objects at another prefix are the same checkpoint
    return ResolvedCheckpoint(ref, "s3", sha256_json({"s3": files}), None, None, files, config, size)


def _materialize_s3(resolved: ResolvedCheckpoint, cache_root: Path, endpoint_url: str | None,
                    buckets: list[str] | None, max_bytes: int | None) -> Path:
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError

    check_bucket(resolved.ref, buckets)
    final = cache_root / resolved.digest.split(":")[1]
    if final.is_dir():
        return final
    if max_bytes is not None and (resolved.size or 0) > max_bytes:
        raise _too_big(resolved.ref, resolved.size or 0, max_bytes)
    bucket, prefix = _s3_location(resolved.ref)
    client = boto3.client("s3", endpoint_url=endpoint_url)
    cache_root.mkdir(parents=True, exist_ok=True)
    staging = cache_root / f"staging-{uuid.uuid4().hex}"
    try:
        for f in resolved.files:
            dest = staging / f["path"]
            dest.parent.mkdir(parents=True, exist_ok=True)
            # exactly the identified bytes (If-Match the listed ETag), never more than the listing said
            body = client.get_object(Bucket=bucket, Key=prefix + f["path"], IfMatch=f["etag"])["Body"]
            written = 0
            with open(dest, "wb") as out:
                while chunk := body.read(1 << 20):
                    written += len(chunk)
                    if written > f["size"]:
                        raise CheckpointNotFound(f"{resolved.ref}: {f['path']} is longer than listed",
                                                 field="checkpoint", fix="submit the build again")
                    out.write(chunk)
            body.close()
            if written != f["size"]:
                raise CheckpointNotFound(f"{resolved.ref}: {f['path']} is shorter than listed", field="checkpoint",
                                         fix="submit the build again")
        try:
            os.replace(staging, final)
        except OSError:  # another worker materialized the same content first
            if not final.is_dir():
                raise
    except (ClientError, BotoCoreError) as exc:
        raise _s3_errors(resolved.ref, exc) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


# -- entry points ------------------------------------------------------------------------------------
def identify_checkpoint(ref: str, *, cache_root: Path, s3_endpoint_url: str | None = None,
                        buckets: list[str] | None = None, max_bytes: int | None = None
                        ) -> tuple[ResolvedCheckpoint, bool]:
    """The content identity and parsed config.json of ``ref``, without downloading weights; the flag says
    whether a cached answer was used (a local directory whose file stats are unchanged is not re-hashed).
    ``buckets``: the allowed s3:// buckets (None: any). Raises SpecError / CheckpointNotFound (bad input, 422)
    or StorageUnavailable."""
    if ref.startswith("hf://"):
        return _identify_hf(ref, max_bytes), False
    if ref.startswith("s3://"):
        return _identify_s3(ref, s3_endpoint_url, buckets, max_bytes), False
    return _identify_local(ref, cache_root)


def materialize_checkpoint(resolved: ResolvedCheckpoint, *, cache_root: Path, s3_endpoint_url: str | None = None,
                           buckets: list[str] | None = None, max_bytes: int | None = None) -> ResolvedCheckpoint:
    """``resolved`` with ``local_dir`` holding exactly its identified content (downloaded on first use)."""
    if resolved.kind == "hf":
        local = _materialize_hf(resolved, max_bytes)
    elif resolved.kind == "s3":
        local = _materialize_s3(resolved, cache_root / "s3", s3_endpoint_url, buckets, max_bytes)
    else:
        return resolved
    return replace(resolved, local_dir=local)


def resolve_checkpoint(ref: str, *, cache_root: Path, s3_endpoint_url: str | None = None,
                       buckets: list[str] | None = None, max_bytes: int | None = None
                       ) -> tuple[ResolvedCheckpoint, bool]:
    """Identify, then materialize (what a worker does)."""
    resolved, cached = identify_checkpoint(ref, cache_root=cache_root, s3_endpoint_url=s3_endpoint_url,
                                           buckets=buckets, max_bytes=max_bytes)
    return materialize_checkpoint(resolved, cache_root=cache_root, s3_endpoint_url=s3_endpoint_url,
                                  buckets=buckets, max_bytes=max_bytes), cached


def read_model_config(resolved: ResolvedCheckpoint) -> dict:
    return resolved.config

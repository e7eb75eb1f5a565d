"""Stage 1, resolve: turn a checkpoint reference into immutable content.

- a local directory or ``file://`` URL → sha256 over its file manifest (relative path, size, sha256 of bytes);
- ``hf://org/name@revision`` → the commit sha through huggingface_hub (honouring ``HF_HUB_OFFLINE`` and the
  local Hub cache); the digest is derived from repo and commit, never from a branch name;
- ``s3://bucket/prefix`` → the objects downloaded once under ``KILN_HOME/checkpoints/s3`` and hashed like a
  local directory.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from kiln.digests import sha256_file, sha256_json
from kiln.errors import CheckpointNotFound, StorageUnavailable
from kiln.spec import local_path


@dataclass(frozen=True)
class ResolvedCheckpoint:
    ref: str
    kind: str  # local | hf | s3
    digest: str  # content digest: the only way a checkpoint enters a key
    local_dir: Path
    revision: str | None = None  # the Hub commit sha for hf://
    files: list[dict] = field(default_factory=list)

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


#: fingerprint → (digest, manifest), in front of the memo files: the service resolves the same folder on every
#: request for it, and re-reading and re-hashing its manifest would cost more than the fingerprint.
_MEMO: dict[str, tuple[str, list[dict]]] = {}


def _resolve_local(ref: str, cache_root: Path) -> tuple[ResolvedCheckpoint, bool]:
    path = local_path(ref)
    if not path.is_dir():
        raise CheckpointNotFound(f"{path} is not a directory", field="checkpoint",
                                 fix="give a directory holding config.json and *.safetensors")
    if not (path / "config.json").is_file():
        raise CheckpointNotFound(f"{path} has no config.json", field="checkpoint",
                                 fix="point at a Hugging Face format checkpoint directory")
    fingerprint = _fingerprint(path).split(":")[1]
    if (known := _MEMO.get(fingerprint)) is not None:
        return ResolvedCheckpoint(ref, "local", known[0], path, None, known[1]), True
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
    _MEMO[fingerprint] = (digest, files)
    return ResolvedCheckpoint(ref, "local", digest, path, None, files), was_cached


def _resolve_hf(ref: str) -> ResolvedCheckpoint:
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import (
        HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError,
    )

    repo, _, revision = ref[len("hf://"):].partition("@")
    revision = revision or "main"
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    try:
        if offline:
            local = Path(snapshot_download(repo, revision=revision, local_files_only=True))
            sha = local.name  # the cache lays snapshots out as snapshots/<commit sha>
        else:
            sha = HfApi().model_info(repo, revision=revision).sha
            local = Path(snapshot_download(repo, revision=sha))
    except (RepositoryNotFoundError, RevisionNotFoundError) as exc:
        raise CheckpointNotFound(f"{repo}@{revision} not found on the Hub ({type(exc).__name__})",
                                 field="checkpoint", fix="check the repo name and revision") from None
    except LocalEntryNotFoundError:
        raise CheckpointNotFound(f"{repo}@{revision} is not in the local Hub cache and HF_HUB_OFFLINE is set",
                                 field="checkpoint", fix="download it once online, or unset HF_HUB_OFFLINE") from None
    except HfHubHTTPError as exc:
        raise StorageUnavailable(f"the Hub answered {exc}") from None
    if not (local / "config.json").is_file():
        raise CheckpointNotFound(f"{repo}@{sha} has no config.json", field="checkpoint",
                                 fix="use a Hugging Face transformers checkpoint")
    return ResolvedCheckpoint(ref, "hf", sha256_json({"hf": repo, "commit": sha}), local, sha)


def _resolve_s3(ref: str, cache_root: Path, endpoint_url: str | None) -> ResolvedCheckpoint:
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError

    url = urlparse(ref)
    bucket, prefix = url.netloc, url.path.lstrip("/")
    prefix = prefix if not prefix or prefix.endswith("/") else prefix + "/"
    client = boto3.client("s3", endpoint_url=endpoint_url)
    try:
        listing = []
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            listing += [{"key": o["Key"], "size": o["Size"], "etag": o["ETag"]} for o in page.get("Contents", [])]
        if not any(o["key"] == prefix + "config.json" for o in listing):
            raise CheckpointNotFound(f"{ref} holds no config.json", field="checkpoint",
                                     fix="point at the prefix that holds the checkpoint's files")
        # The listing (keys, sizes, ETags) names the content cheaply; the download is hashed for the digest.
        listing_key = sha256_json(listing).split(":")[1]
        index = cache_root / "by-listing" / listing_key
        if index.is_file():
            local = Path(index.read_text())
            if local.is_dir():
                files = file_manifest(local)
                return ResolvedCheckpoint(ref, "s3", sha256_json({"files": files}), local, None, files)
        staging = cache_root / f"staging-{uuid.uuid4().hex}"
        for obj in listing:
            rel = obj["key"][len(prefix):]
            parts = rel.split("/")
            if not rel or rel.endswith("/"):
                continue  # folder marker objects
            if rel.startswith("/") or any(p in ("", ".", "..") for p in parts):
                raise CheckpointNotFound(f"{ref} holds an object key that escapes its prefix: {obj['key']!r}",
                                         field="checkpoint", fix="remove keys with '//', '.' or '..' segments")
            dest = staging / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            client.download_file(bucket, obj["key"], str(dest))
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "")
        if code in ("NoSuchBucket", "404", "AccessDenied", "403"):
            raise CheckpointNotFound(f"{ref}: {code}", field="checkpoint", fix="check the bucket, prefix and credentials") from None
        raise StorageUnavailable(f"S3 error reading {ref}: {code}") from None
    except BotoCoreError as exc:
        raise StorageUnavailable(f"S3 unreachable reading {ref}: {exc}") from None
    files = file_manifest(staging)
    digest = sha256_json({"files": files})
    final = cache_root / digest.split(":")[1]
    if final.exists():
        shutil.rmtree(staging)
    else:
        os.replace(staging, final)
    index.parent.mkdir(parents=True, exist_ok=True)
    index.write_text(str(final))
    return ResolvedCheckpoint(ref, "s3", digest, final, None, files)


def resolve_checkpoint(ref: str, *, cache_root: Path, s3_endpoint_url: str | None = None
                       ) -> tuple[ResolvedCheckpoint, bool]:
    """Resolve ``ref`` to content; the flag says whether a cached answer was used (a local directory whose
    file stats are unchanged is not re-hashed). Raises CheckpointNotFound (bad input) or StorageUnavailable."""
    if ref.startswith("hf://"):
        return _resolve_hf(ref), False
    if ref.startswith("s3://"):
        (cache_root / "s3").mkdir(parents=True, exist_ok=True)
        return _resolve_s3(ref, cache_root / "s3", s3_endpoint_url), False
    return _resolve_local(ref, cache_root)


def read_model_config(resolved: ResolvedCheckpoint) -> dict:
    return json.loads((resolved.local_dir / "config.json").read_text())

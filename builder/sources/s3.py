"""``s3://bucket/prefix`` (allowed buckets only): the identity is its listing (relative keys, sizes, ETags)
hashed, and only ``config.json`` is fetched. An ETag names one stored version of an object's bytes (S3 changes it
whenever the object is written), so the listing is the content's identity; the download is checked against it:
each object fetched ``If-Match`` its identified ETag into ``<cache>/s3/<digest>``. The client has the engine
store's retry and addressing settings (artifacts/s3.py)."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from builder.sources.base import MAX_CONFIG_BYTES, Access, ResolvedCheckpoint, SourceIO, parse_config, too_big
from kiln.digests import sha256_json
from kiln.errors import CheckpointNotFound, SpecError, StorageUnavailable
from kiln.sources import parse_s3_ref

#: The most objects an s3:// checkpoint may hold (the listing is read in the API process).
MAX_S3_OBJECTS = 10_000


def check_bucket(ref: str, buckets: list[str] | None) -> None:
    bucket, _ = parse_s3_ref(ref)
    if buckets is not None and bucket not in buckets:
        allowed = ", ".join(buckets) or "none are configured"
        raise SpecError(f"bucket {bucket!r} is not an allowed checkpoint bucket ({allowed})", field="checkpoint",
                        fix="use an allowed bucket, or add it to KILN_CHECKPOINT_BUCKETS on the service and workers")


def _client(endpoint_url: str | None) -> Any:
    """A client with the engine store's settings (standard retries, path-style addressing for a custom endpoint),
    from boto3's default session as before."""
    import boto3

    from artifacts.s3 import s3_client_config

    return boto3.client("s3", endpoint_url=endpoint_url, config=s3_client_config(endpoint_url))


def _s3_errors(ref: str, exc: Exception) -> Exception:
    """botocore's errors as Kiln's: a missing or forbidden bucket or key is the reference's fault (422), an object
    rewritten since it was listed too; anything else is S3 failing (503)."""
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


def _listing(client: Any, ref: str, bucket: str, prefix: str) -> list[dict]:
    files: list[dict] = []
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
    return sorted(files, key=lambda f: f["path"])


def identify(ref: str, access: Access) -> tuple[ResolvedCheckpoint, bool]:
    from botocore.exceptions import BotoCoreError, ClientError

    check_bucket(ref, access.buckets)
    bucket, prefix = parse_s3_ref(ref)
    client = _client(access.s3_endpoint_url)
    try:
        files = _listing(client, ref, bucket, prefix)
        config_entry = next((f for f in files if f["path"] == "config.json"), None)
        if config_entry is None:
            raise CheckpointNotFound(f"{ref} holds no config.json", field="checkpoint",
                                     fix="point at the prefix that holds the checkpoint's files")
        size = sum(f["size"] for f in files)
        if access.max_bytes is not None and size > access.max_bytes:
            raise too_big(ref, size, access.max_bytes)
        body = client.get_object(Bucket=bucket, Key=prefix + "config.json", IfMatch=config_entry["etag"])["Body"]
        data = body.read(MAX_CONFIG_BYTES + 1)
        body.close()
    except (ClientError, BotoCoreError) as exc:
        raise _s3_errors(ref, exc) from None
    config = parse_config(data, ref)
    # keys relative to the prefix, sizes and ETags: the same objects at another prefix are the same checkpoint
    return ResolvedCheckpoint(ref, "s3", sha256_json({"s3": files}), None, None, files, config, size), False


def materialize(resolved: ResolvedCheckpoint, access: Access) -> Path:
    from botocore.exceptions import BotoCoreError, ClientError

    check_bucket(resolved.ref, access.buckets)
    cache_root = access.cache_root / "s3"
    final = cache_root / resolved.digest.split(":")[1]
    if final.is_dir():
        return final
    if access.max_bytes is not None and (resolved.size or 0) > access.max_bytes:
        raise too_big(resolved.ref, resolved.size or 0, access.max_bytes)
    bucket, prefix = parse_s3_ref(resolved.ref)
    client = _client(access.s3_endpoint_url)
    cache_root.mkdir(parents=True, exist_ok=True)
    staging = cache_root / f"staging-{uuid.uuid4().hex}"
    try:
        for f in resolved.files:
            _download(client, resolved.ref, bucket, prefix, f, staging / f["path"])
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


def _download(client: Any, ref: str, bucket: str, prefix: str, f: dict, dest: Path) -> None:
    """Exactly the identified bytes (If-Match the listed ETag), never more than the listing said."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    body = client.get_object(Bucket=bucket, Key=prefix + f["path"], IfMatch=f["etag"])["Body"]
    written = 0
    with open(dest, "wb") as out:
        while chunk := body.read(1 << 20):
            written += len(chunk)
            if written > f["size"]:
                raise CheckpointNotFound(f"{ref}: {f['path']} is longer than listed", field="checkpoint",
                                         fix="submit the build again")
            out.write(chunk)
    body.close()
    if written != f["size"]:
        raise CheckpointNotFound(f"{ref}: {f['path']} is shorter than listed", field="checkpoint",
                                 fix="submit the build again")


IO = SourceIO(identify, materialize)

"""Multipart uploads and copies for :mod:`artifacts.s3`, kept apart so the store reads plainly.

Both helpers take a boto3 S3 client and let botocore errors out; :class:`~artifacts.s3.S3BlobStore`
translates them. Both abort their multipart upload on any failure, so no invisible parts are
left accruing storage charges (a bucket lifecycle rule on ``uploads/`` covers crashed processes).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import zlib
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Iterable
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError


def b64_sha256(data: bytes | bytearray) -> str:
    """The ``x-amz-checksum-sha256`` value of ``data``: S3 refuses the bytes if they differ."""
    return base64.b64encode(hashlib.sha256(data).digest()).decode()


def b64_crc32(data: bytes | bytearray) -> str:
    """The ``x-amz-checksum-crc32`` value of ``data`` (what boto3 sends by default)."""
    return base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode()


def is_precondition_failed(error: ClientError) -> bool:
    return error.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 412


UPLOAD_THREADS = 8


def _upload_part(client: Any, bucket: str, key: str, upload_id: str, number: int, data: bytes | bytearray, checksum: str) -> dict:
    answer = client.upload_part(Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=data,
                                ChecksumCRC32=checksum)
    return {"ETag": answer["ETag"], "PartNumber": number, "ChecksumCRC32": checksum}


class SourceChanged(Exception):
    """A part read for the upload differs from the same part read before (``expected_crcs``)."""


def upload_in_parts(
    client: Any, bucket: str, key: str, parts: Iterable[bytes | bytearray], decide: Callable[[str | None], bool], *,
    create_only: bool, expected_crcs: list[str] | None = None,
) -> tuple[str | None, int, bool]:
    """Upload ``parts`` as one multipart upload to ``key``, hashing them in the same pass.

    Every part carries its CRC32, which S3 checks: CRC32 guards a part against damage in transit as
    well as SHA-256 would, at half the CPU. Without ``expected_crcs`` the whole stream is hashed with
    SHA-256 on the way; once every part is up, ``decide(digest)`` says whether to complete (True) or
    abort (False), and may raise, which aborts. With ``expected_crcs`` (the parts' CRC32s from an
    earlier read whose SHA-256 the caller knows) each part is checked against its earlier self instead
    — :class:`SourceChanged`, and the upload aborted, if one differs — and ``decide`` gets None.
    With ``create_only`` the completion is conditional (``If-None-Match: *``) and a 412 (the key
    exists already) counts as success. Returns ``(digest or None, size, completed)``.
    """
    upload_id = client.create_multipart_upload(Bucket=bucket, Key=key, ChecksumAlgorithm="CRC32")["UploadId"]
    hasher = hashlib.sha256() if expected_crcs is None else None
    size, count, done = 0, 0, []
    try:
        # Parts go up on a few threads (boto3 clients are thread-safe) while this thread reads and checks the
        # next ones; at most 2 × UPLOAD_THREADS parts are held in memory.
        with ThreadPoolExecutor(UPLOAD_THREADS) as pool:
            pending: deque = deque()
            for count, data in enumerate(parts, start=1):
                crc = b64_crc32(data)
                if hasher is not None:
                    hasher.update(data)
                elif expected_crcs is not None and (count > len(expected_crcs) or crc != expected_crcs[count - 1]):
                    raise SourceChanged(f"part {count} differs from the first read")
                size += len(data)
                pending.append(pool.submit(_upload_part, client, bucket, key, upload_id, count, data, crc))
                if len(pending) >= 2 * UPLOAD_THREADS:
                    done.append(pending.popleft().result())
            done += [f.result() for f in pending]
        if expected_crcs is not None and count != len(expected_crcs):
            raise SourceChanged(f"{count} parts where the first read had {len(expected_crcs)}")
        digest = "sha256:" + hasher.hexdigest() if hasher is not None else None
        if not decide(digest):
            _abort(client, bucket, key, upload_id)
            return digest, size, False
        _complete(client, create_only, Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": done})
        return digest, size, True
    except BaseException:
        _abort(client, bucket, key, upload_id)
        raise


def copy_in_parts(client: Any, bucket: str, source_key: str, key: str, size: int, part_size: int) -> None:
    """Server-side copy of an object too large for one CopyObject, ``part_size`` bytes at a time.
    Completion is conditional: if ``key`` appeared meanwhile, the copy is dropped as a success."""
    upload_id = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    try:
        done = []
        for number, start in enumerate(range(0, size, part_size), start=1):
            end = min(start + part_size, size) - 1
            answer = client.upload_part_copy(
                Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number,
                CopySource={"Bucket": bucket, "Key": source_key}, CopySourceRange=f"bytes={start}-{end}",
            )  # fmt: skip
            done.append({"ETag": answer["CopyPartResult"]["ETag"], "PartNumber": number})
        _complete(client, True, Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": done})
    except BaseException:
        _abort(client, bucket, key, upload_id)
        raise


def _complete(client: Any, create_only: bool, **kwargs: Any) -> None:
    try:
        client.complete_multipart_upload(**kwargs, **({"IfNoneMatch": "*"} if create_only else {}))
    except ClientError as e:
        if not (create_only and is_precondition_failed(e)):
            raise
        # The key exists: the upload stays open after a 412 and must be aborted.
        _abort(client, kwargs["Bucket"], kwargs["Key"], kwargs["UploadId"])


def _abort(client: Any, bucket: str, key: str, upload_id: str) -> None:
    """Best effort: the error that made us abort matters more than one from the abort."""
    with contextlib.suppress(ClientError, BotoCoreError):
        client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)

"""A blob store in an S3 bucket (AWS S3, MinIO, or moto's server in tests), through boto3.

How a write is staged depends on what is known before the bytes move:

* **Digest known** (``put_bytes``, ``put_stream(expected_digest=...)``): after a
  HEAD says the blob is absent, the bytes go straight to the final key: one PUT up to
  :data:`PART_SIZE`, a multipart upload above it. A multipart upload is invisible until it is
  completed, and it is completed only if the bytes, hashed in the same pass, match the digest; so
  large files need no staging key and no server-side copy.
* **A source read twice** (``put_source``, ``put_file``: engine layers): the first read (``survey``,
  which a build makes ahead, beside validation) yields the digest and each part's CRC32; the upload
  goes straight to the final key as above, each part checked against its first read rather than
  the whole stream hashed again.
* **Digest unknown** (a plain ``put_stream``): up to :data:`PART_SIZE` the bytes are hashed in
  memory (that buffer is the staged copy) and PUT as above. A larger stream goes up as a
  multipart upload to a staging key under ``uploads/``; once hashed, an existing blob means the
  upload is aborted, otherwise it is completed, copied server-side to the final key (part by part
  above 5 GiB, the CopyObject limit) and the staging key deleted.

Creating a final key is conditional (``If-None-Match: *``); a 412 means another writer committed
the same bytes first, which is success. Every single PUT carries its SHA-256 checksum and every
multipart part its CRC32, so S3 refuses bytes damaged in transit. Retries are botocore's (standard
mode), not a loop here.
"""

from __future__ import annotations

import contextlib
import hashlib
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, BinaryIO
from urllib.parse import unquote, urlsplit

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, FlexibleChecksumError

from artifacts import paths
from artifacts.interfaces import BlobInfo, BlobStore, Survey, check_expected, check_range, url_refused
from artifacts.s3_multipart import (
    SourceChanged, b64_crc32, b64_sha256, copy_in_parts, is_precondition_failed, upload_in_parts,
)
from kiln.digests import CHUNK, parse_digest
from kiln.errors import BlobUnknown, DigestMismatch, StorageUnavailable

if TYPE_CHECKING:
    from kiln.settings import Settings

MiB = 1 << 20
PART_SIZE = 8 * MiB
COPY_LIMIT = 5 * 1024 * MiB  # the most one CopyObject may copy
COPY_PART_SIZE = 512 * MiB
_MISSING = {"NoSuchKey", "404", "NotFound"}


def s3_client_config(endpoint_url: str | None = None, *, max_attempts: int = 4) -> Config:
    """How Kiln talks to S3 (the engine store and ``s3://`` checkpoints alike): botocore standard-mode retries,
    path-style addressing for custom endpoints (MinIO, moto).

    Bodies are not SHA-256-signed (``UNSIGNED-PAYLOAD``), which botocore otherwise does on plain-HTTP
    endpoints (a MinIO in the same network): every write carries a checksum header that S3 verifies and
    the signature covers, and every read is checked against its digest, so hashing each body once more
    for the signature would only cost a second SHA-256 pass over every engine uploaded."""
    s3 = {"payload_signing_enabled": False, **({"addressing_style": "path"} if endpoint_url else {})}
    return Config(retries={"mode": "standard", "max_attempts": max_attempts}, s3=s3)


def make_s3_client(endpoint_url: str | None = None, *, max_attempts: int = 4) -> Any:
    """The client a store makes unless given one (:func:`s3_client_config`), in a session of its own;
    credentials and region from the environment."""
    config = s3_client_config(endpoint_url, max_attempts=max_attempts)
    return boto3.session.Session().client("s3", endpoint_url=endpoint_url, config=config)


@contextlib.contextmanager
def s3_errors(action: str, digest: str | None = None) -> Iterator[None]:
    """Translate botocore errors into domain errors (``from None``: no botocore above here)."""
    try:
        yield
    except ClientError as e:
        code = e.response.get("Error", {}).get("Code", "")
        if digest is not None and code in _MISSING:
            raise BlobUnknown(f"blob {digest} is not in the store") from None
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        raise StorageUnavailable(f"cannot {action}: S3 answered {code or status}") from None
    except FlexibleChecksumError:  # the bytes S3 sent do not match the checksum it stored
        raise DigestMismatch(f"cannot {action}: S3's stored checksum does not match the object") from None
    except BotoCoreError as e:
        raise StorageUnavailable(f"cannot {action}: {e}") from None


class S3BlobStore(BlobStore):
    """Blobs as objects under ``s3://bucket/prefix`` (laid out as :mod:`artifacts.paths` draws).

    ``part_size``, ``copy_limit`` and ``copy_part_size`` are class defaults that tests shrink.
    One limit of S3: a HEAD on a missing bucket is a bare 404, so ``stat``/``exists`` there say
    "no such blob"; writes and listings do report :class:`StorageUnavailable`."""

    part_size = PART_SIZE
    copy_limit = COPY_LIMIT
    copy_part_size = COPY_PART_SIZE

    def __init__(self, bucket: str, prefix: str = "", endpoint_url: str | None = None, client: Any = None):
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self._client = client if client is not None else make_s3_client(endpoint_url)

    @classmethod
    def from_url(cls, url: str, settings: Settings | None = None) -> S3BlobStore:
        """``s3://bucket/prefix``; the endpoint (MinIO, moto; unset: AWS) is ``settings.s3_endpoint_url``
        (``KILN_S3_ENDPOINT_URL``), credentials and region come from the environment (:func:`make_s3_client`)."""
        parts = urlsplit(url)
        if not parts.netloc or parts.query or parts.fragment:
            raise url_refused(f"{url!r} does not name a bucket")
        if settings is None:
            from kiln.settings import get_settings

            settings = get_settings()
        return cls(parts.netloc, unquote(parts.path).strip("/"), endpoint_url=settings.s3_endpoint_url)

    def __repr__(self) -> str:
        return f"S3BlobStore({self.url!r})"

    def _blob_key(self, digest: str) -> str:
        return paths.under(self.prefix, paths.blob_path(digest))

    # -- writing ---------------------------------------------------------------------------------
    def put_stream(self, stream: BinaryIO, *, expected_digest: str | None = None) -> BlobInfo:
        if existing := self._existing(expected_digest):
            return existing
        first = _read_full(stream, self.part_size)
        second = _read_full(stream, self.part_size) if len(first) == self.part_size else b""
        if not second:
            return self._put_small(first, expected_digest)
        parts = _parts((first, second), stream, self.part_size)
        return self._put_staged(parts) if expected_digest is None else self._put_known(parts, expected_digest)

    def survey(self, open_source: Callable[[], BinaryIO]) -> Survey:
        """SHA-256 (the digest) and each part's CRC32, in one read (:func:`_survey`)."""
        digest, crcs, size = _survey(open_source, self.part_size)
        return Survey(digest, size, self.part_size, tuple(crcs))

    def _put_surveyed(self, open_source: Callable[[], BinaryIO], survey: Survey) -> BlobInfo:
        """The upload (the second read) sends each part with its CRC32 from the survey after checking it
        against this read's, so the stored bytes are the ones the digest names without hashing them with
        SHA-256 a second time."""
        if survey.size <= self.part_size:  # one PUT, which hashes its bytes again anyway
            with open_source() as f:
                return self.put_stream(f, expected_digest=survey.digest)
        if survey.part_size != self.part_size:  # made for other parts: its CRC32s cannot check these
            survey = self.survey(open_source)
        if existing := self._existing(survey.digest):
            return existing
        with open_source() as f, s3_errors(f"store {survey.digest}"):
            try:
                upload_in_parts(self._client, self.bucket, self._blob_key(survey.digest),
                                _parts((), f, self.part_size), lambda _: True, create_only=True,
                                expected_crcs=list(survey.part_crcs))
            except SourceChanged as e:
                raise DigestMismatch(f"the source of {survey.digest} changed while it was stored ({e}); "
                                     "nothing was stored") from None
        return BlobInfo(survey.digest, survey.size)

    def _put_known(self, parts: Iterator[bytes | bytearray], digest: str) -> BlobInfo:
        """Multipart upload straight to the final key, completed only if the bytes match."""

        def matches(actual: str | None) -> bool:  # hashed on the way (no expected CRCs): never None here
            check_expected(digest, str(actual), self.url)
            return True

        with s3_errors(f"store {digest}"):
            _, size, _ = upload_in_parts(
                self._client, self.bucket, self._blob_key(digest), parts, matches, create_only=True
            )
        return BlobInfo(digest, size)

    def _put_small(self, data: bytes | bytearray, expected_digest: str | None) -> BlobInfo:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        check_expected(expected_digest, digest, self.url)
        if expected_digest is None and (existing := self._existing(digest)):
            return existing
        with s3_errors(f"store {digest}"):
            key, checksum = self._blob_key(digest), b64_sha256(data)
            self._create(self._client.put_object, Key=key, Body=data, ChecksumSHA256=checksum)
        return BlobInfo(digest, len(data))

    def _put_staged(self, parts: Iterator[bytes | bytearray]) -> BlobInfo:
        """Multipart upload to a staging key, then (unless the blob exists) copy into place."""
        staging = paths.under(self.prefix, paths.upload_path())
        try:
            with s3_errors("stage an upload"):
                hashed, size, completed = upload_in_parts(
                    self._client, self.bucket, staging, parts, lambda d: not self.exists(str(d)), create_only=False
                )
            digest = str(hashed)  # hashed on the way (no expected CRCs): never None here
            if not completed:  # aborted: an equal blob is already committed
                return self.stat(digest)
            with s3_errors(f"commit {digest}"):
                final = self._blob_key(digest)
                if size <= self.copy_limit:
                    # SHA256: S3 recomputes a whole-object checksum (equal to the digest) on the copy.
                    source = {"Bucket": self.bucket, "Key": staging}
                    self._create(self._client.copy_object, Key=final, CopySource=source, ChecksumAlgorithm="SHA256")
                else:
                    copy_in_parts(self._client, self.bucket, staging, final, size, self.copy_part_size)
            return BlobInfo(digest, size)
        finally:
            with contextlib.suppress(ClientError, BotoCoreError):
                self._client.delete_object(Bucket=self.bucket, Key=staging)

    def _create(self, call: Any, **kwargs: Any) -> None:
        """A conditional create (``If-None-Match: *``): 412, the key exists, is success."""
        try:
            call(Bucket=self.bucket, IfNoneMatch="*", **kwargs)
        except ClientError as e:
            if not is_precondition_failed(e):
                raise

    # -- reading ---------------------------------------------------------------------------------
    def open_range(self, digest: str, offset: int = 0, length: int | None = None) -> Iterator[bytes]:
        check_range(offset, length)
        key = self._blob_key(digest)
        if length == 0:  # no Range header can ask for nothing
            self.stat(digest)
            return iter(())
        ranged = {"Range": f"bytes={offset}-{'' if length is None else offset + length - 1}"}
        with s3_errors(f"read {digest}", digest):
            try:
                answer = self._client.get_object(Bucket=self.bucket, Key=key, **(ranged if offset or length else {}))
            except ClientError as e:
                if e.response.get("Error", {}).get("Code") != "InvalidRange":
                    raise
                return iter(())  # 416: the blob exists and the offset is at or past its end
        return _body_chunks(answer["Body"], digest)

    def stat(self, digest: str) -> BlobInfo:
        key = self._blob_key(digest)
        with s3_errors(f"stat {digest}", digest):
            return BlobInfo(digest, self._client.head_object(Bucket=self.bucket, Key=key)["ContentLength"])

    def list_digests(self) -> Iterator[str]:
        pages = self._client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=paths.under(self.prefix, paths.BLOBS_DIR) + "/"
        )
        with s3_errors("list blobs"):
            for page in pages:
                for item in page.get("Contents", []):
                    if digest := paths.digest_of_blob_path(paths.relative_to(self.prefix, item["Key"])):
                        yield digest

    # -- other -----------------------------------------------------------------------------------
    def delete(self, digest: str) -> None:
        key = self._blob_key(digest)
        with s3_errors(f"delete {digest}"):
            self._client.delete_object(Bucket=self.bucket, Key=key)

    def presigned_url(self, digest: str, expires_s: int = 300) -> str | None:
        key = self._blob_key(parse_digest(digest))
        with s3_errors(f"presign {digest}"):
            return self._client.generate_presigned_url(
                "get_object", Params={"Bucket": self.bucket, "Key": key}, ExpiresIn=expires_s
            )


def _read_full(stream: BinaryIO, size: int) -> bytearray:
    """Read ``size`` bytes, or fewer only at EOF (``read`` may return less on pipes and sockets);
    multipart parts other than the last must be full. Read into one buffer (one copy of the bytes,
    not three: engines are gigabytes)."""
    buf = bytearray(size)
    view, n = memoryview(buf), 0
    readinto = getattr(stream, "readinto", None)
    while n < size:
        if readinto is not None:
            got = readinto(view[n:])
        else:
            chunk = stream.read(size - n)
            view[n : n + len(chunk)] = chunk
            got = len(chunk)
        if not got:
            break
        n += got
    view.release()
    if n < size:
        del buf[n:]
    return buf


def _survey(open_source: Callable[[], BinaryIO], part_size: int) -> tuple[str, list[str], int]:
    """The first read of a source: its SHA-256 digest, each part's CRC32 and the size. Three threads
    share the work (reading or making the bytes, SHA-256, CRC32; hashlib and zlib let go of the GIL on
    large buffers), so the pass costs about one SHA-256 of the source rather than the sum of the three;
    at most three parts are held in memory."""
    hasher, size, stop = hashlib.sha256(), 0, threading.Event()
    parts: queue.Queue[bytearray | None] = queue.Queue(maxsize=2)

    def read() -> None:
        try:
            with open_source() as f:
                while not stop.is_set() and (part := _read_full(f, part_size)):
                    parts.put(part)
        finally:
            parts.put(None)  # also after an error, which ``reader.result()`` raises below

    with ThreadPoolExecutor(2, thread_name_prefix="kiln-survey") as pool:
        reader, crcs = pool.submit(read), []
        try:
            while (part := parts.get()) is not None:
                crcs.append(pool.submit(b64_crc32, part))
                hasher.update(part)
                size += len(part)
        except BaseException:  # let the reader finish instead of blocking on a full queue
            stop.set()
            while parts.get() is not None:
                pass
            raise
        reader.result()
        return "sha256:" + hasher.hexdigest(), [c.result() for c in crcs], size


def _parts(head: tuple[bytes | bytearray, ...], stream: BinaryIO, part_size: int) -> Iterator[bytes | bytearray]:
    yield from head
    while part := _read_full(stream, part_size):
        yield part


def _body_chunks(body: Any, digest: str) -> Iterator[bytes]:
    with contextlib.closing(body), s3_errors(f"read {digest}", digest):
        yield from body.iter_chunks(CHUNK)

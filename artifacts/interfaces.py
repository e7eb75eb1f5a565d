"""The storage contract: a content-addressed blob store.

Every artifact Kiln keeps (engine layers, image configs, manifests, reports) is a blob named by
the sha256 of its bytes. Backends (:class:`~artifacts.local.LocalBlobStore`,
:class:`~artifacts.s3.S3BlobStore`) implement :class:`BlobStore` and pass one shared conformance
suite (``tests/unit/artifacts/test_blobstore_conformance.py``).

The rules every backend keeps:

* **Stage, verify, commit.** A write goes to a staging place first (a temp file, a multipart
  upload, or a staging key), the digest is computed in the same pass as the bytes move, and only
  then is the blob committed under ``blobs/sha256/<hex>`` (see :mod:`artifacts.paths`). A reader
  never sees a partial blob; a failed write removes its staging (only a crashed process leaves
  some under ``uploads/``, which holds nothing a reader can see).
* **Idempotent on digest.** Writing bytes whose digest is already stored succeeds and returns the
  stored blob's info; the bytes are not uploaded again when the digest is known before the upload.
* **Digests are checked.** Every ``digest`` argument must be ``sha256:<64 lowercase hex>``, else
  :class:`~kiln.errors.InvalidDigest`. Reading a whole blob verifies it against its digest.
* **One set of errors.** OS and SDK errors are translated here, at the storage boundary:
  :class:`~kiln.errors.BlobUnknown` (no such blob), :class:`~kiln.errors.DigestMismatch` (bytes do
  not hash to their name), :class:`~kiln.errors.StorageUnavailable` (the store cannot be reached or
  failed). Nothing above this package sees ``botocore`` or an ``OSError`` from the store. Errors
  raised by a caller's own stream propagate unchanged.
"""

from __future__ import annotations

import abc
import hashlib
import io
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from kiln.digests import CHUNK, parse_digest, sha256_bytes
from kiln.errors import BlobUnknown, DigestMismatch, SpecError, StorageUnavailable


@dataclass(frozen=True)
class BlobInfo:
    """A stored blob: its digest (``sha256:<hex>``) and its size in bytes."""

    digest: str
    size: int


@dataclass(frozen=True)
class Survey:
    """What the first read of a source learned (:meth:`BlobStore.survey`): its digest and size and, for a
    store that uploads in parts, each part's CRC32 at that store's ``part_size``."""

    digest: str
    size: int
    part_size: int | None = None
    part_crcs: tuple[str, ...] = ()


class BlobStore(abc.ABC):
    """A content-addressed blob store. Safe to share between threads; holds no open files."""

    url: str
    """The store URL it was opened from (``file:///…`` or ``s3://bucket/prefix``)."""

    # -- writing ---------------------------------------------------------------------------------
    @abc.abstractmethod
    def put_stream(self, stream: BinaryIO, *, expected_digest: str | None = None) -> BlobInfo:
        """Store everything ``stream`` yields until EOF and return the blob's info.

        With ``expected_digest``: if that blob is already stored, return at once without reading
        the stream; otherwise the bytes must hash to it, or :class:`DigestMismatch` is raised and
        nothing is committed. Without it, the staged copy is hashed and committed unless an equal
        blob already exists.
        """

    def put_source(self, open_source: Callable[[], BinaryIO], survey: Survey | None = None) -> BlobInfo:
        """Store the bytes of a source that can be opened and read more than once, giving the same bytes
        each time: a file, or an engine directory's tar made as it is read.

        The source is read once to learn its digest (:meth:`survey`; a local read is cheap next to an
        upload), so that a blob already in the store is never sent again, and once more as the upload,
        which is checked against the first read: a source that changed in between is refused with
        :class:`DigestMismatch` and nothing is committed. Here the check is :meth:`put_stream`'s
        (the second read hashed again); a backend may check more cheaply. Errors of the source itself
        propagate unchanged.

        ``survey``: a first read made earlier (a build surveys its engine layer while validation runs).
        If the blob it names is stored already, that is the answer and the source is not read; if the
        source no longer matches it, the source is surveyed afresh and stored as it is now.
        """
        if survey is not None:
            try:
                return self._put_surveyed(open_source, survey)
            except DigestMismatch:
                pass
        return self._put_surveyed(open_source, self.survey(open_source))

    def survey(self, open_source: Callable[[], BinaryIO]) -> Survey:
        """The first read of :meth:`put_source` on its own, to be made ahead of the upload."""
        hasher, size = hashlib.sha256(), 0
        with open_source() as f:
            for chunk in iter(lambda: f.read(CHUNK), b""):
                hasher.update(chunk)
                size += len(chunk)
        return Survey("sha256:" + hasher.hexdigest(), size)

    def _put_surveyed(self, open_source: Callable[[], BinaryIO], survey: Survey) -> BlobInfo:
        """The second read: store the source as the blob ``survey`` names, or raise :class:`DigestMismatch`."""
        with open_source() as f:
            return self.put_stream(f, expected_digest=survey.digest)

    def put_file(self, path: Path) -> BlobInfo:
        """Store the file at ``path`` (:meth:`put_source`). Errors opening it propagate as ``OSError``."""
        return self.put_source(lambda: open(path, "rb"))

    def put_bytes(self, data: bytes) -> BlobInfo:
        """Store ``data``; a no-op (but for one existence check) when it is already stored."""
        return self.put_stream(io.BytesIO(data), expected_digest=sha256_bytes(data))

    # -- reading ---------------------------------------------------------------------------------
    @abc.abstractmethod
    def open_range(self, digest: str, offset: int = 0, length: int | None = None) -> Iterator[bytes]:
        """Yield the bytes ``[offset, offset + length)`` of a blob in chunks, unverified.

        Meant for streaming and HTTP ``Range`` requests, where the client verifies. The blob is
        looked up before this returns (:class:`BlobUnknown` is raised by the call, not by the
        first ``next``). ``length=None`` reads to the end; a range past the end is clipped, and an
        ``offset`` at or past the end yields nothing. Negative values raise ``ValueError``.
        Consume or close the iterator: it holds an open file or connection.
        """

    def get_bytes(self, digest: str) -> bytes:
        """The whole blob, verified against its digest (:class:`DigestMismatch` if corrupted).
        A read the store cuts short (:class:`StorageUnavailable`) is retried twice with backoff."""
        for attempt in range(3):
            try:
                data = b"".join(self.open_range(digest))
                break
            except StorageUnavailable:
                if attempt == 2:
                    raise
                time.sleep(0.2 * 2**attempt)
        actual = sha256_bytes(data)
        if actual != digest:
            raise DigestMismatch(f"blob {digest} in {self.url} is corrupted: its bytes hash to {actual}")
        return data

    @abc.abstractmethod
    def stat(self, digest: str) -> BlobInfo:
        """The info of a stored blob; :class:`BlobUnknown` if absent."""

    def exists(self, digest: str) -> bool:
        """Whether the blob is stored (its bytes are not checked; see :meth:`verify`)."""
        try:
            self.stat(digest)
        except BlobUnknown:
            return False
        return True

    @abc.abstractmethod
    def list_digests(self) -> Iterator[str]:
        """Every stored digest, in lexicographic order; staging entries are never listed."""

    def verify(self, digest: str) -> bool:
        """Re-hash the stored bytes: True if they match the digest, False if corrupted.

        :class:`BlobUnknown` if absent. Streams, so it is safe on blobs larger than memory.
        """
        hasher = hashlib.sha256()
        chunks = self.open_range(digest)
        try:
            for chunk in chunks:
                hasher.update(chunk)
        except DigestMismatch:  # a backend's own integrity check (an S3 checksum) failed first
            return False
        return "sha256:" + hasher.hexdigest() == digest

    # -- other -----------------------------------------------------------------------------------
    @abc.abstractmethod
    def delete(self, digest: str) -> None:
        """Remove a blob. Idempotent: deleting an absent blob succeeds."""

    @abc.abstractmethod
    def presigned_url(self, digest: str, expires_s: int = 300) -> str | None:
        """A URL a client may GET the blob from for ``expires_s`` seconds, or None where the
        backend has none (local). It is not checked that the blob exists."""

    def _existing(self, digest: str | None) -> BlobInfo | None:
        """The stored blob's info when ``digest`` is given and stored, else None."""
        if digest is None:
            return None
        try:
            return self.stat(parse_digest(digest, field="expected_digest"))
        except BlobUnknown:
            return None


def check_range(offset: int, length: int | None) -> None:
    """Refuse a negative ``offset`` or ``length`` (shared by every :meth:`BlobStore.open_range`)."""
    if offset < 0 or (length is not None and length < 0):
        raise ValueError(f"invalid range: offset={offset}, length={length}")


def check_expected(expected: str | None, actual: str, url: str) -> None:
    """Raise :class:`DigestMismatch` when staged bytes do not hash to the digest they were sent as."""
    if expected is not None and actual != expected:
        raise DigestMismatch(f"bytes sent to {url} as {expected} hash to {actual}; nothing was stored")


def url_refused(message: str) -> SpecError:
    """What a store's ``from_url`` raises for a URL it cannot open (:func:`artifacts.factory.open_store` adds
    the fix naming every form a store URL may take)."""
    return SpecError(message, field="store_url")

"""A blob store in a local directory: the embedded default, and what tests run everywhere.

A write goes to a temp file in ``uploads/`` (same filesystem as ``blobs/``), is hashed as it is
written, fsynced, made read-only and moved into place with ``os.replace``, which is atomic: a
reader sees the whole blob or none. The directory is fsynced too, so a committed blob survives a
power cut.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO
from urllib.parse import unquote, urlsplit

from artifacts import paths
from artifacts.interfaces import BlobInfo, BlobStore, check_expected, check_range, url_refused
from kiln.digests import CHUNK, parse_digest
from kiln.errors import BlobUnknown, StorageUnavailable

if TYPE_CHECKING:
    from kiln.settings import Settings


@contextlib.contextmanager
def _storage_errors(action: str, digest: str | None = None) -> Iterator[None]:
    """Translate OS errors of the store's own files into domain errors."""
    try:
        yield
    except FileNotFoundError:
        if digest is None:
            raise StorageUnavailable(f"cannot {action}: a store directory is missing") from None
        raise BlobUnknown(f"blob {digest} is not in the store") from None
    except OSError as e:
        raise StorageUnavailable(f"cannot {action}: {e.strerror or e}") from None


class LocalBlobStore(BlobStore):
    """Blobs as read-only files under ``root`` (laid out as :mod:`artifacts.paths` draws)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root).resolve()
        self.url = self.root.as_uri()
        with _storage_errors(f"create the store at {self.root}"):
            for sub in (paths.BLOBS_DIR, paths.UPLOADS_DIR):
                (self.root / sub).mkdir(parents=True, exist_ok=True)

    @classmethod
    def from_url(cls, url: str, settings: Settings | None = None) -> LocalBlobStore:
        """``file:///abs/path`` (or ``file://localhost/abs/path``), or a plain directory path (``~`` expanded);
        it reads no settings."""
        parts = urlsplit(url)
        if parts.scheme != "file":
            return cls(Path(url).expanduser())
        path = unquote(parts.path)
        if parts.netloc not in ("", "localhost") or not path.startswith("/"):
            raise url_refused(f"{url!r} is not a local absolute path")
        return cls(Path(path))

    def __repr__(self) -> str:
        return f"LocalBlobStore({str(self.root)!r})"

    def _blob(self, digest: str) -> Path:
        return self.root / paths.blob_path(digest)

    def put_stream(self, stream: BinaryIO, *, expected_digest: str | None = None) -> BlobInfo:
        if existing := self._existing(expected_digest):
            return existing
        staging = self.root / paths.upload_path()
        hasher, size = hashlib.sha256(), 0
        try:
            with _storage_errors("stage an upload"):
                out = open(staging, "xb")
            with out:
                # The caller's stream is read outside the translation: its errors are its own.
                for chunk in iter(lambda: stream.read(CHUNK), b""):
                    hasher.update(chunk)
                    size += len(chunk)
                    with _storage_errors("write an upload"):
                        out.write(chunk)
                with _storage_errors("flush an upload"):
                    out.flush()
                    os.fsync(out.fileno())
            digest = "sha256:" + hasher.hexdigest()
            check_expected(expected_digest, digest, self.url)
            final = self._blob(digest)
            if not final.exists():  # an equal blob is already committed: keep it, drop ours
                with _storage_errors(f"commit {digest}"):
                    os.chmod(staging, 0o444)
                    os.replace(staging, final)
                    _fsync_dir(final.parent)
            return BlobInfo(digest, size)
        finally:
            staging.unlink(missing_ok=True)  # gone already after a commit

    def open_range(self, digest: str, offset: int = 0, length: int | None = None) -> Iterator[bytes]:
        check_range(offset, length)
        with _storage_errors(f"read {digest}", digest):
            f = open(self._blob(digest), "rb")
        return _read_range(f, offset, length, digest)

    def stat(self, digest: str) -> BlobInfo:
        with _storage_errors(f"stat {digest}", digest):
            return BlobInfo(digest, self._blob(digest).stat().st_size)

    def delete(self, digest: str) -> None:
        with _storage_errors(f"delete {digest}"):
            self._blob(digest).unlink(missing_ok=True)

    def list_digests(self) -> Iterator[str]:
        with _storage_errors("list blobs"):
            names = sorted(os.listdir(self.root / paths.BLOBS_DIR))
        for name in names:
            if digest := paths.digest_of_blob_path(f"{paths.BLOBS_DIR}/{name}"):
                yield digest

    def presigned_url(self, digest: str, expires_s: int = 300) -> str | None:
        parse_digest(digest)
        return None


def _read_range(f: BinaryIO, offset: int, length: int | None, digest: str) -> Iterator[bytes]:
    with f, _storage_errors(f"read {digest}"):
        f.seek(offset)
        remaining = length
        while remaining is None or remaining > 0:
            chunk = f.read(CHUNK if remaining is None else min(CHUNK, remaining))
            if not chunk:
                return
            if remaining is not None:
                remaining -= len(chunk)
            yield chunk


def _fsync_dir(directory: Path) -> None:
    """Make a rename durable: fsync the directory that holds the new name."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

"""A local, bounded, content-addressed cache of the blobs ``kiln pull --server`` downloads.

Laid out as a store is (:mod:`artifacts.paths`): ``<root>/blobs/sha256/<hex>`` for a blob, ``<root>/uploads/<id>``
for one being written. A blob is downloaded into ``uploads/`` (verified there by the caller: digest and size),
fsynced, made read-only and renamed into place, so no half-written blob is ever visible under its name, and two
pulls writing the same blob each rename whole, equal bytes. A name is never trusted: :meth:`BlobCache.open`
hashes the file it opened before handing it out, and a file that does not hash to its name (or is not the size its
descriptor says) is removed, so the caller downloads it again. The file handed out stays readable while it is open,
even if another pull evicts the name meanwhile.

The cache is bounded: after a pull, least recently used blobs (by mtime, refreshed on every use) are removed until
the rest fit ``max_bytes``; a blob larger than the whole budget is never kept. Uploads a crashed pull left behind are
removed once a day old.
"""

from __future__ import annotations

import hashlib
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from artifacts import paths
from kiln.digests import CHUNK
from kiln.errors import StorageUnavailable

#: an upload untouched this long belongs to a pull that died
STALE_UPLOAD_S = 24 * 3600


class BlobCache:
    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root, self.max_bytes = Path(root), max_bytes
        self.blobs, self.uploads = self.root / paths.BLOBS_DIR, self.root / paths.UPLOADS_DIR
        try:
            for d in (self.blobs, self.uploads):
                d.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StorageUnavailable(f"cannot create the pull blob cache at {self.root}: {exc.strerror or exc}",
                                     fix="set KILN_PULL_CACHE_DIR to a writable folder, or pull with --no-cache"
                                     ) from None

    def __repr__(self) -> str:
        return f"BlobCache({str(self.root)!r}, max_bytes={self.max_bytes})"

    def path(self, digest: str) -> Path:
        return self.root / paths.blob_path(digest)

    def open(self, digest: str, size: int) -> BinaryIO | None:
        """The cached blob ``digest``, opened and checked now (``size`` bytes hashing to ``digest``), positioned at
        its start; None when it is not here. A file that does not match is removed (None: download it again)."""
        path = self.path(digest)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:  # absent (a symlink in its place is not followed, and a download replaces it)
            return None
        f = os.fdopen(fd, "rb")
        try:
            hasher, got = hashlib.sha256(), 0
            while chunk := f.read(CHUNK):
                got += len(chunk)
                if got > size:
                    break
                hasher.update(chunk)
            if got != size or "sha256:" + hasher.hexdigest() != digest:
                f.close()
                path.unlink(missing_ok=True)
                return None
            f.seek(0)
            try:
                os.utime(path)  # last used: what eviction orders by
            except OSError:
                pass
            return f
        except BaseException:
            f.close()
            raise

    def fits(self, size: int) -> bool:
        return size <= self.max_bytes

    def add(self, digest: str, write: Callable[[BinaryIO], None]) -> BinaryIO:
        """Write blob ``digest`` with ``write`` (which must raise unless what it wrote is that blob) into
        ``uploads/``, then rename it into place; returns the written file, open for reading at its start."""
        staging = self.uploads / str(uuid.uuid4())
        f = open(staging, "x+b")
        try:
            write(f)
            f.flush()
            os.fsync(f.fileno())
            os.chmod(staging, 0o444)
            final = self.path(digest)
            os.replace(staging, final)
            f.seek(0)
            return f
        except BaseException:
            f.close()
            staging.unlink(missing_ok=True)
            raise

    def evict(self) -> list[str]:
        """Remove least recently used blobs until the rest fit ``max_bytes`` (and stale uploads); their digests."""
        now, entries = time.time(), []
        try:  # a folder gone or unreadable leaves nothing to evict; it never fails the pull that called this
            uploads, blobs = list(self.uploads.iterdir()), list(self.blobs.iterdir())
        except OSError:
            return []
        for up in uploads:
            try:
                if now - up.stat().st_mtime > STALE_UPLOAD_S:
                    up.unlink()
            except OSError:
                pass
        for blob in blobs:
            try:
                st = blob.lstat()
            except OSError:
                continue
            entries.append((st.st_mtime, st.st_size, blob))
        entries.sort(key=lambda e: e[0])
        total = sum(size for _, size, _ in entries)
        removed = []
        for _, size, blob in entries:
            if total <= self.max_bytes:
                break
            try:
                blob.unlink(missing_ok=True)
            except OSError:
                continue
            total -= size
            removed.append(f"sha256:{blob.name}")
        return removed


"""Deterministic tar layers and their safe unpacking.

``tar_chunks`` (and ``write_tar``, which writes them to a file) makes the same bytes from the same
directory content on any machine, at any time, as any user: entries in sorted order, mtime 0, owner
0:0 with empty names, modes normalised to 0644/0755, PAX format. That is what makes an engine
image's digest a function of its files. Kiln's own records beside those files (:data:`INTERNAL_NAMES`, the stage
cache's ``.complete``) are never packed: they describe one worker's copy, not the engine.

``unpack_tar`` trusts nothing in the archive. It reads the tar as a stream (so a layer is hashed
while it is unpacked) and writes every file itself: only regular files and directories, with
relative names that stay inside the destination. Links and device files are refused rather than
neutralised, since an engine never contains them.
"""

from __future__ import annotations

import errno
import hashlib
import io
import os
import shutil
import stat
import tarfile
from collections.abc import Collection, Iterable, Iterator
from pathlib import Path, PurePosixPath
from typing import BinaryIO

_BUFSIZE = 1 << 20

STAGE_RECORD = ".complete"
"""The stage cache's record of a finished output (``builder/stagecache.py``), written in the output's folder."""
INTERNAL_NAMES = frozenset({STAGE_RECORD})
"""Top-level names in a packed folder that are Kiln's bookkeeping, not content: left out of every tar (a stage
output's blob, an engine image's layer) and of the engine files' signature (``artifacts/signing.py``)."""


def write_tar(src_dir: Path, dest: Path) -> str:
    """Write a deterministic, uncompressed tar of ``src_dir``'s content (not the directory itself, nor
    :data:`INTERNAL_NAMES`) to ``dest`` and return its digest. Refuses symlinks and anything else that is not
    a regular file or a directory."""
    hasher = hashlib.sha256()
    chunks = tar_chunks(src_dir)  # refuses before anything is written
    with open(dest, "wb") as out:
        for chunk in chunks:
            hasher.update(chunk)
            out.write(chunk)
    return "sha256:" + hasher.hexdigest()


def tar_chunks(src_dir: Path, names: Collection[str] | None = None) -> Iterator[bytes]:
    """The bytes of the deterministic tar of ``src_dir``'s content, in pieces of at most 1 MiB, made as they
    are read: what ``tarfile`` writes for the same entries (PAX headers from ``TarInfo.tobuf``, data padded to
    512-byte blocks, two zero blocks, the record padded to 10240 bytes), without writing the archive to disk.
    :data:`INTERNAL_NAMES` at the top of ``src_dir`` are left out; ``names``: only these top-level entries.
    The directory is walked (and anything not a regular file or a directory refused) before the first byte;
    a file that changes size meanwhile raises ``OSError``."""
    src_dir = Path(src_dir)
    if not src_dir.is_dir():
        raise NotADirectoryError(f"{src_dir} is not a directory")
    return _tar_chunks(list(_walk(src_dir, "", names)))


def _tar_chunks(entries) -> Iterator[bytes]:
    offset = 0
    for name, path, st in entries:
        info = tarfile.TarInfo(name)
        info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
        if stat.S_ISDIR(st.st_mode):
            info.type, info.mode = tarfile.DIRTYPE, 0o755
        else:
            info.mode = 0o755 if st.st_mode & stat.S_IXUSR else 0o644
            info.size = st.st_size
        header = info.tobuf(tarfile.PAX_FORMAT, tarfile.ENCODING, "surrogateescape")
        yield header
        offset += len(header)
        if info.isreg():
            left = info.size
            with open(path, "rb") as f:
                while left:
                    chunk = f.read(min(_BUFSIZE, left))
                    if not chunk:
                        raise OSError(f"{path} shrank while it was packed")
                    left -= len(chunk)
                    yield chunk
                if f.read(1):
                    raise OSError(f"{path} grew while it was packed")
            if pad := -info.size % tarfile.BLOCKSIZE:
                yield tarfile.NUL * pad
            offset += info.size + pad
    end = tarfile.BLOCKSIZE * 2
    yield tarfile.NUL * (end + -(offset + end) % tarfile.RECORDSIZE)


def _walk(directory: Path, prefix: str, names: Collection[str] | None = None) -> Iterator[tuple[str, Path, os.stat_result]]:
    """Depth first, children sorted by name, each directory before what it holds; Kiln's records left out, and at
    the top whatever ``names`` (when given) does not name."""
    for name in sorted(os.listdir(directory)):
        if not prefix and (name in INTERNAL_NAMES or (names is not None and name not in names)):
            continue
        path, rel = directory / name, f"{prefix}{name}"
        st = path.lstat()
        if stat.S_ISDIR(st.st_mode):
            yield rel, path, st
            yield from _walk(path, rel + "/")
        elif stat.S_ISREG(st.st_mode):
            yield rel, path, st
        else:
            kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a regular file or directory"
            raise ValueError(f"refusing to pack {path}: it is {kind}")


class ChunkReader(io.RawIOBase):
    """A read-only file over an iterator of chunks (a blob read from a store, a tar being made)."""

    def __init__(self, chunks: Iterable[bytes]) -> None:
        self._chunks = iter(chunks)
        self._buf = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, b: bytearray | memoryview) -> int:  # type: ignore[override]
        while not self._buf:
            chunk = next(self._chunks, None)
            if chunk is None:
                return 0
            self._take(chunk)
        n = min(len(b), len(self._buf))
        b[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n

    def _take(self, chunk: bytes) -> None:
        self._buf = memoryview(chunk)


class HashingReader(ChunkReader):
    """A :class:`ChunkReader` that hashes every byte it fetches, so a layer is verified in the same pass
    that unpacks it. :meth:`drain` hashes whatever was not read."""

    def __init__(self, chunks: Iterable[bytes]) -> None:
        super().__init__(chunks)
        self.hasher = hashlib.sha256()
        self.size = 0

    def drain(self) -> None:
        self._buf = memoryview(b"")
        for chunk in self._chunks:
            self._take(chunk)

    @property
    def digest(self) -> str:
        return "sha256:" + self.hasher.hexdigest()

    def _take(self, chunk: bytes) -> None:
        self.hasher.update(chunk)
        self.size += len(chunk)
        self._buf = memoryview(chunk)


def unpack_tar(stream: BinaryIO, dest: Path) -> None:
    """Unpack the tar read from ``stream`` into the existing directory ``dest``.

    Raises ``ValueError`` naming the member for an absolute name, a ``..`` component, a link, a device or FIFO,
    a sparse member (GNU or PAX: its holes would be written out, so a small verified layer could fill the disk),
    a file over a directory, a name already unpacked as a file (a duplicate, a directory of that name, a member
    under it) or one the filesystem cannot hold (too long); ``tarfile.TarError`` for a malformed archive. What
    was written before stays: callers unpack into a staging directory they remove on failure."""
    files: set[tuple[str, ...]] = set()  # the regular files unpacked so far
    with tarfile.open(fileobj=stream, mode="r|", bufsize=_BUFSIZE) as tar:
        for member in tar:
            if member.type == tarfile.GNUTYPE_SPARSE or member.issparse() or any(
                    k.startswith("GNU.sparse.") for k in member.pax_headers):
                raise ValueError(f"refusing {member.name!r}: sparse members are not unpacked")
            parts = _safe_parts(member.name)
            if any(parts[:i] in files for i in range(1, len(parts) + 1)):
                raise ValueError(f"refusing {member.name!r}: a file of that name or path is already unpacked")
            target = dest.joinpath(*parts)
            try:
                _unpack_member(tar, member, target)
            except OSError as exc:  # a name the filesystem refuses; a full disk and the like are not the archive's
                if exc.errno not in _NAME_ERRORS:
                    raise
                raise ValueError(f"refusing {member.name!r}: {exc.strerror}") from None
            if member.isreg():
                files.add(parts)


_NAME_ERRORS = frozenset({errno.ENAMETOOLONG, errno.EEXIST, errno.ENOTDIR, errno.EISDIR})


def _unpack_member(tar: tarfile.TarFile, member: tarfile.TarInfo, target: Path) -> None:
    if member.isdir():
        target.mkdir(mode=0o755, parents=True, exist_ok=True)
    elif member.isreg():
        target.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        if target.is_dir():
            raise ValueError(f"refusing {member.name!r}: it would replace a directory")
        source = tar.extractfile(member)
        assert source is not None  # a regular file always has content
        with open(target, "wb") as out:
            shutil.copyfileobj(source, out, _BUFSIZE)
        os.chmod(target, 0o755 if member.mode & stat.S_IXUSR else 0o644)
    else:
        raise ValueError(f"refusing {member.name!r}: only regular files and directories may be unpacked")


def _safe_parts(name: str) -> tuple[str, ...]:
    """The path components of a member name, refusing any that could leave the destination."""
    if name.startswith("/") or "\\" in name or "\x00" in name:
        raise ValueError(f"refusing {name!r}: not a relative POSIX path")
    parts = tuple(p for p in PurePosixPath(name).parts if p != ".")
    if ".." in parts:
        raise ValueError(f"refusing {name!r}: '..' leaves the destination")
    return parts

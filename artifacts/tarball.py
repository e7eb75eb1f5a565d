"""Deterministic tar layers and their safe unpacking.

``write_tar`` makes the same bytes from the same directory content on any machine, at any time,
as any user: entries in sorted order, mtime 0, owner 0:0 with empty names, modes normalised to
0644/0755, PAX format. That is what makes an engine image's digest a function of its files.

``unpack_tar`` trusts nothing in the archive. It reads the tar as a stream (so a layer is hashed
while it is unpacked) and writes every file itself: only regular files and directories, with
relative names that stay inside the destination. Links and device files are refused rather than
neutralised, since an engine never contains them.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import stat
import tarfile
from collections.abc import Iterable, Iterator
from pathlib import Path, PurePosixPath
from typing import BinaryIO

_BUFSIZE = 1 << 20


class _HashingWriter:
    """A file wrapper that hashes what is written through it (the tar's digest in the same pass)."""

    def __init__(self, f):
        self.f, self.h = f, hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.h.update(data)
        return self.f.write(data)

    def tell(self) -> int:
        return self.f.tell()


def write_tar(src_dir: Path, dest: Path) -> str:
    """Write a deterministic, uncompressed tar of ``src_dir``'s content (not the directory itself)
    to ``dest`` and return its digest. Refuses symlinks and anything else that is not a regular file
    or a directory."""
    src_dir = Path(src_dir)
    if not src_dir.is_dir():
        raise NotADirectoryError(f"{src_dir} is not a directory")
    entries = list(_walk(src_dir, ""))  # refuse before writing anything
    with open(dest, "wb") as raw:
        out = _HashingWriter(raw)
        _write_entries(out, entries)
    return "sha256:" + out.h.hexdigest()


def _write_entries(out, entries) -> None:
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, path, st in entries:
            info = tarfile.TarInfo(name)
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            if stat.S_ISDIR(st.st_mode):
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            else:
                info.mode = 0o755 if st.st_mode & stat.S_IXUSR else 0o644
                info.size = st.st_size
                with open(path, "rb") as f:
                    tar.addfile(info, f)


def _walk(directory: Path, prefix: str) -> Iterator[tuple[str, Path, os.stat_result]]:
    """Depth first, children sorted by name, each directory before what it holds."""
    for name in sorted(os.listdir(directory)):
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


class HashingReader(io.RawIOBase):
    """A read-only file over an iterator of chunks that hashes every byte it fetches, so a layer is
    verified in the same pass that unpacks it. :meth:`drain` hashes whatever was not read."""

    def __init__(self, chunks: Iterable[bytes]) -> None:
        self._chunks = iter(chunks)
        self._buf = memoryview(b"")
        self.hasher = hashlib.sha256()
        self.size = 0

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

    Raises ``ValueError`` for an absolute name, a ``..`` component, a link, a device or FIFO,
    or a file over a directory; ``tarfile.TarError`` for a malformed archive."""
    with tarfile.open(fileobj=stream, mode="r|", bufsize=_BUFSIZE) as tar:
        for member in tar:
            target = dest.joinpath(*_safe_parts(member.name))
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

"""Stage outputs (the quantized checkpoint, the compiled engine) kept in the blob store, so any worker on any
machine reuses them; the worker's disk holds only a bounded cache of them.

Where things are:

* **In the store**: the output directory as one deterministic tar blob (:func:`~artifacts.tarball.tar_chunks`; for
  a compile output of one layer these are the very bytes of the engine image's layer, so publishing it uploads
  nothing again; a kernel-and-weights engine is published as three layers, artifacts/oci.py ``engine_layers``).
  The blob holds the output's files only, never ``.complete``: the stage record is this disk's bookkeeping (the
  database row is the store's), and it would make the engine layer differ from one build of the same key to the
  next.
* **In the database**: ``stage_outputs`` maps the stage key to that blob's digest (the store is addressed by digest
  only, and every worker reaches the database). The row is written after the blob, so a row never names a
  missing blob; ``kiln gc`` drops rows no engine needs (``builder/gc.py``).
* **Produced once**: a build that finds neither claims the key first (``stage_claims``); builds needing the same
  output meanwhile, on any worker, wait for it to appear in the store (``builder/claims.py``).
* **On the worker's disk** (``KILN_HOME/cache/<stage>/<key hex>``, with ``.complete`` holding the stage record):
  a miss there downloads the blob, unpacks it into a staging folder while hashing it, checks the digest and renames
  the folder into place. Entries are evicted least recently used first once their total passes
  ``KILN_CACHE_MAX_BYTES``, never one a build is using.

"In use" is a shared ``flock`` on the entry's directory, held from lookup until the build ends
(:meth:`StageCache.release`); eviction takes an exclusive lock without waiting and skips what it cannot lock, so
it works across the worker's processes and threads. A staging folder is locked exclusively while it is filled:
one whose lock can be taken belonged to a process that died, and is removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import tarfile
import time
import uuid
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import BinaryIO, cast

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from artifacts.interfaces import BlobStore
from artifacts.tarball import STAGE_RECORD, ChunkReader, HashingReader, tar_chunks, unpack_tar
from builder.claims import StageClaims
from kiln.errors import BlobUnknown
from kiln.tables import StageOutput

log = logging.getLogger(__name__)

#: kernel: compiled code without weights (builder/backends/aot_inductor.py), shared by the engines of its kernel key;
#: reference: the unquantized model's results (validation/reference.py)
STAGES = ("quantize", "kernel", "compile", "reference")
COMPLETE = STAGE_RECORD  # never packed (artifacts.tarball.INTERNAL_NAMES)


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _open_dir(path: Path) -> int | None:
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except (FileNotFoundError, NotADirectoryError):
        return None


def _try_lock(fd: int, kind: int) -> bool:
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _same(path: Path, fd: int) -> bool:
    """Whether ``path`` still names the directory open as ``fd`` (eviction renames it away first)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    fst = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)


def dir_size(path: Path) -> int:
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except FileNotFoundError:
                pass
    return total


class StageCache:
    """The stage outputs of one build's worth of work: :meth:`get` an output (local, else from the store, else
    produced and stored), then :meth:`release` what the build held."""

    #: how often a build waiting for another worker's output looks for it
    WAIT_POLL_S = 1.0

    def __init__(self, root: Path, store: BlobStore | None, sessions: sessionmaker[Session], *, max_bytes: int,
                 claims: StageClaims | None = None):
        self.root, self.store, self.sessions, self.max_bytes = Path(root), store, sessions, max_bytes
        self.claims = claims if claims is not None else (StageClaims(sessions) if sessions is not None else None)
        self._pins: list[int] = []

    def path(self, stage: str, key: str) -> Path:
        if stage not in STAGES:
            raise ValueError(f"unknown stage {stage!r}")
        return self.root / stage / key.split(":", 1)[1]

    def where(self, stage: str, key: str) -> str | None:
        """``"local"``, ``"store"`` or None: where the output for ``key`` is now (nothing is fetched)."""
        if (self.path(stage, key) / COMPLETE).is_file():
            return "local"
        with self.sessions() as s:
            return "store" if s.get(StageOutput, key) is not None else None

    # -- the one entry point ---------------------------------------------------------------------
    def get(self, stage: str, key: str, produce: Callable[[Path], dict]) -> tuple[Path, dict | None]:
        """The output directory for ``key``, held until :meth:`release`, and the stage record when it was
        produced here (None when it was reused). ``produce`` writes a fresh output into the folder it is given."""
        final = self.path(stage, key)
        if self._reuse(stage, key, final):
            return final, None
        # another build (any worker) may be producing it right now: one producer per key (builder/claims.py)
        while self.claims is not None and not self.claims.try_claim(key):
            time.sleep(self.WAIT_POLL_S)
            if self._reuse(stage, key, final):
                return final, None
        with self.claims.renewing(key) if self.claims is not None else contextlib.nullcontext():
            if self._reuse(stage, key, final):  # the holder before us finished between our look and our claim
                return final, None
            return final, self._produce_and_store(stage, key, final, produce)

    def _reuse(self, stage: str, key: str, final: Path) -> bool:
        if self._pin(final):
            self._used(stage, key, final)
            return True
        if self._download(stage, key, final) and self._pin(final):
            self._used(stage, key, final, stored=True)
            return True
        return False

    def _produce_and_store(self, stage: str, key: str, final: Path, produce: Callable[[Path], dict]) -> dict:
        record = self._produce(final, produce)
        if not self._pin(final):  # only an eviction racing this very call could remove it; say so loudly
            raise RuntimeError(f"stage output {final} vanished as it was made")
        self._upload(stage, key, final)
        self.evict()
        return record

    def release(self) -> None:
        """Unpin every output this cache handed out (the build is over) and evict down to the budget."""
        if not self._pins:
            return
        while self._pins:
            os.close(self._pins.pop())
        self.evict()

    # -- local entries ---------------------------------------------------------------------------
    def _pin(self, final: Path) -> bool:
        fd = _open_dir(final)
        if fd is None:
            return False
        fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while an eviction holds it, a moment
        if _same(final, fd) and (final / COMPLETE).is_file():
            os.utime(final)  # last used: what eviction orders by
            self._pins.append(fd)
            return True
        os.close(fd)
        return False

    def _staging(self, stage_root: Path) -> tuple[Path, int]:
        stage_root.mkdir(parents=True, exist_ok=True)
        staging = stage_root / f".staging-{uuid.uuid4().hex}"
        staging.mkdir()
        fd = os.open(staging, os.O_RDONLY | os.O_DIRECTORY)
        fcntl.flock(fd, fcntl.LOCK_EX)  # alive while locked (see _sweep_leftovers)
        return staging, fd

    def _commit(self, staging: Path, final: Path) -> None:
        """Rename a filled staging folder into place (an equal entry that got there first wins)."""
        if final.exists() and not (final / COMPLETE).is_file():
            self._remove_entry(final)  # an incomplete folder an older Kiln left after a crash
        try:
            os.rename(staging, final)
        except OSError:
            if not (final / COMPLETE).is_file():
                raise

    def _produce(self, final: Path, produce: Callable[[Path], dict]) -> dict:
        staging, fd = self._staging(final.parent)
        try:
            out = staging / "out"  # produce() wants a folder that does not exist yet
            record = produce(out)
            (out / COMPLETE).write_text(json.dumps(record, sort_keys=True))
            self._commit(out, final)
            return record
        finally:
            shutil.rmtree(staging, ignore_errors=True)
            os.close(fd)

    # -- the store -------------------------------------------------------------------------------
    def _download(self, stage: str, key: str, final: Path) -> bool:
        with self.sessions() as s:
            row = s.get(StageOutput, key)
            digest = row.digest if row is not None else None
        if digest is None or self.store is None:
            return False
        staging, fd = self._staging(final.parent)
        try:
            out = staging / "out"
            out.mkdir()
            reader = HashingReader(self.store.open_range(digest))
            try:
                unpack_tar(cast(BinaryIO, reader), out)  # a binary file object
                reader.drain()
            finally:
                reader.close()
            if reader.digest != digest:
                log.warning("stored %s output %s (%s) does not match its digest; producing it again", stage, key, digest)
                return False
            # a blob an older Kiln stored holds its producer's record; the digest, checked, is the record here
            (out / COMPLETE).write_text(json.dumps({"fetched": digest}, sort_keys=True))
            self._commit(out, final)
            log.info("%s output %s fetched from the store (%s, %d bytes)", stage, key, digest, reader.size)
            self.evict(keep=final)
            return True
        except BlobUnknown:  # GC collected it after we read the row: a miss
            return False
        except (ValueError, tarfile.TarError) as exc:
            log.warning("stored %s output %s (%s) is not a valid tar (%s); producing it again", stage, key, digest, exc)
            return False
        finally:
            shutil.rmtree(staging, ignore_errors=True)
            os.close(fd)

    def _upload(self, stage: str, key: str, final: Path) -> None:
        if self.store is None:
            return
        info = self.store.put_source(lambda: cast(BinaryIO, ChunkReader(tar_chunks(final))))  # a binary file object
        with self.sessions() as s:
            s.add(StageOutput(key=key, stage=stage, digest=info.digest, size=info.size, created_at=_now(),
                              last_used_at=_now()))
            try:
                s.commit()
            except IntegrityError:  # another worker stored the same key first: its copy answers
                s.rollback()
                self._touch(s, key)

    def _used(self, stage: str, key: str, final: Path, *, stored: bool = False) -> None:
        """Record the use; a local entry the store does not know (made before the store kept stage outputs, or
        collected by GC since) is stored again, so the next worker need not recompute it."""
        with self.sessions() as s:
            if self._touch(s, key) or stored:
                return
        self._upload(stage, key, final)

    @staticmethod
    def _touch(session: Session, key: str) -> bool:
        row = session.get(StageOutput, key)
        if row is None:
            return False
        row.last_used_at = _now()
        session.commit()
        return True

    # -- eviction --------------------------------------------------------------------------------
    def entries(self) -> list[tuple[float, int, Path]]:
        """(last used, size, path) of every complete local entry, least recently used first."""
        found = []
        for stage in STAGES:
            folder = self.root / stage
            if not folder.is_dir():
                continue
            for entry in folder.iterdir():
                if entry.name.startswith("."):
                    continue
                try:
                    found.append((entry.stat().st_mtime, dir_size(entry), entry))
                except FileNotFoundError:
                    pass
        return sorted(found, key=lambda e: e[0])

    def evict(self, keep: Path | None = None) -> list[Path]:
        """Remove least recently used entries until the cache fits its budget; entries in use stay."""
        self._sweep_leftovers()
        entries = self.entries()
        total = sum(size for _, size, _ in entries)
        removed = []
        for _, size, path in entries:
            if total <= self.max_bytes:
                break
            if path == keep or not self._remove_entry(path):
                continue
            total -= size
            removed.append(path)
        if total > self.max_bytes:
            log.info("stage cache %s holds %d bytes in use, over its %d byte budget", self.root, total, self.max_bytes)
        return removed

    def _remove_entry(self, path: Path) -> bool:
        fd = _open_dir(path)
        if fd is None:
            return False
        try:
            if not _try_lock(fd, fcntl.LOCK_EX) or not _same(path, fd):
                return False  # in use by a build (or already gone)
            trash = path.parent / f".trash-{uuid.uuid4().hex}"
            os.rename(path, trash)  # out of sight while we still hold the lock: a later pin finds nothing
        finally:
            os.close(fd)
        shutil.rmtree(trash, ignore_errors=True)
        return True

    def _sweep_leftovers(self) -> None:
        """Staging folders of dead processes, and trash a crash left behind."""
        for stage in STAGES:
            folder = self.root / stage
            if not folder.is_dir():
                continue
            for entry in folder.iterdir():
                if entry.name.startswith(".trash-"):
                    shutil.rmtree(entry, ignore_errors=True)
                elif entry.name.startswith(".staging-"):
                    fd = _open_dir(entry)
                    if fd is None:
                        continue
                    try:
                        dead = _try_lock(fd, fcntl.LOCK_EX)
                    finally:
                        os.close(fd)
                    if dead:
                        shutil.rmtree(entry, ignore_errors=True)

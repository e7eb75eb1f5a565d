"""Blob leases: a build that dedupes against a stored blob and a GC that sweeps that blob never both win.

The store skips an upload when the blob is already there (that is dedupe), so a writer may come to rely on a blob
GC has found unreferenced, before the writer's manifest or index row references it. Both sides therefore claim the
digest in the database (``blob_leases``) first, each committing its own row before reading the other's:

* a **writer** (every put a build makes, through :class:`LeasedStore`) commits a ``use`` lease on the digest, then
  waits while a ``sweep`` lease on it is live; only then does the store look at whether the blob exists;
* **GC** (:func:`condemn`) commits a ``sweep`` lease on an unreferenced digest, then reads the live ``use`` leases
  on it: if there is one it keeps the blob, otherwise it deletes it and drops its sweep lease.

Whichever commits second sees the first one's row, so either GC keeps the blob or the writer waits until GC has
deleted it and then uploads it afresh. A ``use`` lease holds while its build runs (at most ``lease_ttl_s``, so a
killed writer's leases lapse). When the build ends its references are committed and the lease is *released*: it
then binds only GC plans made before the release (their lists of references predate the build's index rows), and
is purged after ``gc_grace_s``; GC refuses to sweep a plan older than that (``builder/gc.py``). A GC planned after
a build ended collects what that build left unreferenced at once.
"""

from __future__ import annotations

import hashlib
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from typing import Any, BinaryIO, cast

from sqlalchemy import CursorResult, delete, or_, select, update
from sqlalchemy.orm import Session, sessionmaker

from artifacts.interfaces import BlobInfo, BlobStore, Survey
from kiln.digests import CHUNK, parse_digest
from kiln.tables import BlobLease

USE, SWEEP = "use", "sweep"
#: How long a GC's claim on one blob lives: it deletes the blob right after claiming it, so a writer waits at most
#: this long behind a GC that died mid-sweep.
SWEEP_TTL_S = 60.0
#: A release counts as before a plan only this long before the plan's start: the writer's and GC's wall clocks are
#: compared (NTP keeps them within milliseconds; this covers a worse clock).
CLOCK_MARGIN = timedelta(seconds=2)


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _live(session: Session, digest: str, purpose: str, now: datetime, since: datetime | None = None) -> list[BlobLease]:
    """Unexpired leases on ``digest``; with ``since`` (a GC plan's start), released ones count only when they were
    released after it."""
    query = select(BlobLease).where(BlobLease.digest == digest, BlobLease.purpose == purpose, BlobLease.expires_at > now)
    if since is not None:
        query = query.where(or_(BlobLease.released_at.is_(None), BlobLease.released_at > since - CLOCK_MARGIN))
    return list(session.scalars(query))


class BlobLeases:
    """The ``use`` leases of one holder (one build)."""

    def __init__(self, sessions: sessionmaker[Session], *, ttl_s: float, grace_s: float, holder: str | None = None,
                 poll_s: float = 0.05) -> None:
        self.sessions, self.ttl_s, self.grace_s, self.poll_s = sessions, ttl_s, grace_s, poll_s
        self.holder = holder or f"build-{uuid.uuid4().hex}"
        self.digests: set[str] = set()

    def acquire(self, digest: str) -> None:
        """Claim ``digest`` before relying on it; returns once no GC is sweeping it (the blob may then be gone)."""
        digest = parse_digest(digest)
        with self.sessions() as s:
            s.merge(BlobLease(digest=digest, holder=self.holder, purpose=USE, released_at=None,
                              expires_at=_now() + timedelta(seconds=self.ttl_s)))
            s.commit()
            self.digests.add(digest)
            while _live(s, digest, SWEEP, _now()):  # a GC claimed it first: let it finish, then upload afresh
                s.rollback()
                time.sleep(self.poll_s)

    def release(self) -> None:
        """The build is over (its references are committed): its leases bind only GC plans made before now, and
        are purged after the grace period."""
        if not self.digests:
            return
        now = _now()
        with self.sessions() as s:
            s.execute(update(BlobLease).where(BlobLease.holder == self.holder, BlobLease.released_at.is_(None))
                      .values(released_at=now, expires_at=now + timedelta(seconds=self.grace_s)))
            s.commit()
        self.digests.clear()


def condemn(sessions: sessionmaker[Session], digest: str, holder: str, since: datetime) -> bool:
    """GC's claim before deleting ``digest``, for a plan started at ``since``: True when no writer holds it (delete
    it, then :func:`absolve`); False when one does (the claim is withdrawn and the blob kept)."""
    with sessions() as s:
        s.merge(BlobLease(digest=digest, holder=holder, purpose=SWEEP,
                          expires_at=_now() + timedelta(seconds=SWEEP_TTL_S)))
        s.commit()
        if not _live(s, digest, USE, _now(), since):
            return True
    absolve(sessions, digest, holder)
    return False


def absolve(sessions: sessionmaker[Session], digest: str, holder: str) -> None:
    """Drop GC's claim on ``digest`` (after deleting the blob, or when keeping it)."""
    with sessions() as s:
        s.execute(delete(BlobLease).where(BlobLease.digest == digest, BlobLease.holder == holder))
        s.commit()


def purge_expired(sessions: sessionmaker[Session]) -> int:
    with sessions() as s:
        result = s.execute(delete(BlobLease).where(BlobLease.expires_at <= _now()))
        n = cast(CursorResult, result).rowcount  # a DELETE's result is a cursor result: it has a row count
        s.commit()
    return n


def leased_digests(session: Session, since: datetime) -> set[str]:
    """Digests some writer holds for a GC plan started at ``since`` (kept whatever the plan says)."""
    return set(session.scalars(select(BlobLease.digest).where(
        BlobLease.purpose == USE, BlobLease.expires_at > _now(),
        or_(BlobLease.released_at.is_(None), BlobLease.released_at > since - CLOCK_MARGIN))))


class LeasedStore(BlobStore):
    """A store whose every write claims its digest (:meth:`BlobLeases.acquire`) before the store may dedupe
    against a blob already there. Reads and deletes pass straight through."""

    def __init__(self, inner: BlobStore, leases: BlobLeases) -> None:
        self.inner, self.leases, self.url = inner, leases, inner.url

    def __repr__(self) -> str:
        return f"LeasedStore({self.inner!r})"

    def __getattr__(self, name: str) -> Any:  # backend specifics (part size, client) of the wrapped store
        return getattr(self.inner, name)

    def put_stream(self, stream: BinaryIO, *, expected_digest: str | None = None) -> BlobInfo:
        if expected_digest is not None:
            self.leases.acquire(expected_digest)
            return self.inner.put_stream(stream, expected_digest=expected_digest)
        # The digest must be known (and claimed) before the store looks for an equal blob: spool it first.
        with tempfile.TemporaryFile() as spool:
            hasher = hashlib.sha256()
            for chunk in iter(lambda: stream.read(CHUNK), b""):
                hasher.update(chunk)
                spool.write(chunk)
            spool.seek(0)
            return self.put_stream(spool, expected_digest="sha256:" + hasher.hexdigest())

    def put_source(self, open_source: Callable[[], BinaryIO], survey: Survey | None = None) -> BlobInfo:
        survey = survey or self.inner.survey(open_source)
        self.leases.acquire(survey.digest)
        info = self.inner.put_source(open_source, survey)
        if info.digest != survey.digest:  # the source changed since its survey and was stored as it is now
            self.leases.acquire(info.digest)
            if not self.inner.exists(info.digest):
                info = self.put_source(open_source)
        return info

    def survey(self, open_source: Callable[[], BinaryIO]) -> Survey:
        return self.inner.survey(open_source)

    def open_range(self, digest: str, offset: int = 0, length: int | None = None) -> Iterator[bytes]:
        return self.inner.open_range(digest, offset, length)

    def get_bytes(self, digest: str) -> bytes:
        return self.inner.get_bytes(digest)

    def stat(self, digest: str) -> BlobInfo:
        return self.inner.stat(digest)

    def exists(self, digest: str) -> bool:
        return self.inner.exists(digest)

    def verify(self, digest: str) -> bool:
        return self.inner.verify(digest)

    def list_digests(self) -> Iterator[str]:
        return self.inner.list_digests()

    def delete(self, digest: str) -> None:
        self.inner.delete(digest)

    def presigned_url(self, digest: str, expires_s: int = 300) -> str | None:
        return self.inner.presigned_url(digest, expires_s)

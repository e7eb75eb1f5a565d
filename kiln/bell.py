"""Waking a build's event-stream readers when its events are committed, instead of having them poll.

A build's events are rows (``build_events``) written by whichever process runs it (a worker, the reconciler, the
API on cancel). A reader of ``GET /v1/builds/{id}/events`` takes a :meth:`Bell.ticket`, reads the rows after its
last one, and, if the build has not ended, awaits :meth:`Bell.wait` — which returns as soon as something may have
been committed since the ticket, or after ``timeout`` (a safety net; the reader then reads again):

- **PostgreSQL**: every transaction that adds an event also sends ``NOTIFY kiln_build_events, '<build id>'``
  (:func:`install`, an SQLAlchemy flush hook, so no writer can forget it). PostgreSQL delivers it at commit, and
  only if the transaction commits. Each API process holds one ``LISTEN`` connection and wakes the readers of
  that build.
- **SQLite** (embedded): every commit appends to the database's write-ahead log, so a reader watches the
  database and WAL files' size and modification time (a ``stat`` every :data:`SQLITE_WATCH_S`, no query).

Either way a reader wakes within milliseconds of the commit; a lost notification (the LISTEN connection
dropped) costs at most ``timeout``.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import event, text
from sqlalchemy.orm import Session

log = logging.getLogger(__name__)

CHANNEL = "kiln_build_events"
#: how often an embedded-database reader looks at the database files
SQLITE_WATCH_S = 0.02


def install() -> None:
    """Make every session that adds a build event notify PostgreSQL listeners (idempotent; a no-op on SQLite)."""
    if not event.contains(Session, "after_flush", _notify_new_events):
        event.listen(Session, "after_flush", _notify_new_events)


def _notify_new_events(session: Session, _flush_context) -> None:
    from kiln.tables import BuildEvent

    ids = {o.build_id for o in session.new if isinstance(o, BuildEvent)}
    if not ids:
        return
    conn = session.connection()
    if conn.dialect.name != "postgresql":
        return
    for build_id in sorted(ids):  # delivered at commit; duplicates within a transaction are folded
        conn.execute(text("SELECT pg_notify(:channel, :id)"), {"channel": CHANNEL, "id": build_id})


@dataclass
class Ticket:
    build_id: str
    mark: object


class Bell:
    """One per API process (``app.state.bell``); see the module docstring."""

    def __init__(self, db_url: str):
        self.db_url = db_url
        self._files: list[Path] = []
        if db_url.startswith("sqlite"):
            path = db_url.split("///", 1)[-1]
            if path and path != ":memory:":
                self._files = [Path(path), Path(path + "-wal")]
        self._pg = db_url.startswith("postgresql")
        self._waiters: dict[str, set[asyncio.Event]] = {}
        self._listener: asyncio.Task | None = None
        self._listening = False

    # -- what a reader calls ----------------------------------------------------------------------------------
    def ticket(self, build_id: str) -> Ticket:
        """Take before reading the rows: anything committed after this wakes :meth:`wait`."""
        if self._pg:
            self._ensure_listener()
            waiter = asyncio.Event()
            self._waiters.setdefault(build_id, set()).add(waiter)
            return Ticket(build_id, waiter)
        return Ticket(build_id, self._sqlite_mark())

    async def wait(self, ticket: Ticket, timeout: float) -> None:
        try:
            if isinstance(ticket.mark, asyncio.Event):
                if self._listening:
                    await asyncio.wait_for(ticket.mark.wait(), timeout)
                else:  # no LISTEN connection (yet, or lost): fall back to reading again shortly
                    await asyncio.sleep(min(timeout, 0.3))
            elif self._files:
                loop = asyncio.get_running_loop()
                deadline = loop.time() + timeout
                while self._sqlite_mark() == ticket.mark and loop.time() < deadline:
                    await asyncio.sleep(SQLITE_WATCH_S)
            else:
                await asyncio.sleep(min(timeout, 0.3))
        except asyncio.TimeoutError:
            pass
        finally:
            if isinstance(ticket.mark, asyncio.Event):
                self._waiters.get(ticket.build_id, set()).discard(ticket.mark)
                if not self._waiters.get(ticket.build_id):
                    self._waiters.pop(ticket.build_id, None)

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.cancel()
            try:
                await self._listener
            except (asyncio.CancelledError, Exception):
                pass
            self._listener = None

    # -- SQLite ---------------------------------------------------------------------------------------------
    def _sqlite_mark(self) -> tuple:
        mark: list[tuple[int, int] | None] = []
        for f in self._files:
            try:
                st = os.stat(f)
                mark.append((st.st_size, st.st_mtime_ns))
            except FileNotFoundError:
                mark.append(None)
        return tuple(mark)

    # -- PostgreSQL -----------------------------------------------------------------------------------------
    def _ensure_listener(self) -> None:
        if self._listener is None or self._listener.done():
            self._listener = asyncio.get_running_loop().create_task(self._listen())

    async def _listen(self) -> None:
        import psycopg
        from sqlalchemy.engine import make_url

        url = make_url(self.db_url).set(drivername="postgresql")
        dsn = url.render_as_string(hide_password=False)
        while True:
            try:
                async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
                    await conn.execute(f"LISTEN {CHANNEL}")
                    self._listening = True
                    self._ring_all()  # anything committed while not listening
                    async for note in conn.notifies():
                        for waiter in list(self._waiters.get(note.payload, ())):
                            waiter.set()
            except asyncio.CancelledError:
                self._listening = False
                raise
            except Exception as exc:  # server restarted, connection dropped: readers fall back, then retry
                log.warning("event notifications unavailable (%s: %s); retrying", type(exc).__name__, exc)
            self._listening = False
            self._ring_all()
            await asyncio.sleep(1.0)

    def _ring_all(self) -> None:
        for waiters in self._waiters.values():
            for waiter in waiters:
                waiter.set()

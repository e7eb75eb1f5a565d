"""Handing builds to the workers: the one module that sends Celery tasks, and only once the transaction that
wrote the build's row has committed.

A caller asks for a send inside its session's transaction (:func:`send_after_commit`); the message goes when
that transaction commits (an SQLAlchemy ``after_commit`` hook on every session) and is dropped if it rolls back,
or if the session is closed without committing. So no call site can hand a worker a build id that it would not
find (or one whose row says something the transaction then took back). A send that fails (the broker is down)
leaves the build ``queued`` with the reason on its row; the reconciler sends it again (workers/reconcile.py).

``tests/unit/workers/test_enqueue.py`` fails if any other module calls ``.delay(``, ``.apply_async(`` or
``.send_task(``."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

from sqlalchemy import event
from sqlalchemy.orm import Session, SessionTransaction
from sqlalchemy.orm.attributes import set_committed_value
from sqlalchemy.orm.util import identity_key

from kiln.tables import Build

log = logging.getLogger(__name__)

#: sends a build id to a queue (the broker's side only: :func:`celery_enqueue`, or a test's recorder)
Enqueue = Callable[[str, str], None]
#: where a session keeps the sends its transaction has asked for (``Session.info``)
PENDING = "kiln.pending_sends"


@dataclass
class Send:
    """One requested send; after the commit, ``sent`` or ``error`` says how it went."""

    build_id: str
    queue: str
    enqueue: Enqueue
    transaction: SessionTransaction | None
    sent: bool = False
    error: Exception | None = None


def celery_enqueue(build_id: str, queue: str) -> None:
    """The broker's side of a send: ``kiln.run_build(build_id)`` on ``queue``. Call it through
    :func:`send_after_commit`, never directly."""
    from workers.tasks import run_build

    run_build.apply_async(args=[build_id], queue=queue)


def send_after_commit(session: Session, build_id: str, queue: str, enqueue: Enqueue) -> Send:
    """Send ``build_id`` to ``queue`` (through ``enqueue``) when ``session``'s transaction commits; never if it
    rolls back (a savepoint's rollback drops what was asked inside it)."""
    install()
    if not session.in_transaction():
        session.begin()  # so that a rollback before anything is written drops it too
    send = Send(build_id, queue, enqueue, session.get_nested_transaction() or session.get_transaction())
    session.info.setdefault(PENDING, []).append(send)
    return send


def install() -> None:
    """The session hooks (idempotent)."""
    for name, hook in (("after_commit", _send_pending), ("after_soft_rollback", _drop_rolled_back),
                       ("after_transaction_end", _drop_uncommitted)):
        if not event.contains(Session, name, hook):
            event.listen(Session, name, hook)


def _send_pending(session: Session) -> None:
    if session.in_nested_transaction():  # a savepoint released: its sends wait for the outer commit
        return
    for send in session.info.pop(PENDING, []):
        try:
            send.enqueue(send.build_id, send.queue)
            send.sent = True
        except Exception as exc:  # broker down: the build stays queued; the reconciler sends it again
            send.error = exc
            _note_unsent(session, send, exc)


def _drop_rolled_back(session: Session, previous_transaction: SessionTransaction) -> None:
    def inside(t: SessionTransaction | None) -> bool:
        while t is not None:
            if t is previous_transaction:
                return True
            t = t.parent
        return False

    if PENDING in session.info:
        session.info[PENDING] = [s for s in session.info[PENDING] if not inside(s.transaction)]


def _drop_uncommitted(session: Session, transaction: SessionTransaction) -> None:
    if transaction.parent is None:  # the outermost transaction ended: what it did not send is never sent
        session.info.pop(PENDING, None)


def _note_unsent(session: Session, send: Send, exc: Exception) -> None:
    """The reason on the build's row (written in a session of its own: this one's transaction has ended), and on
    the caller's copy of the row if this session holds one."""

    reason = f"not yet handed to the broker ({type(exc).__name__}: {exc}); it will be re-enqueued"
    log.warning("build %s: %s", send.build_id, reason)
    with Session(session.get_bind()) as other:
        row = other.get(Build, send.build_id)
        if row is not None:
            row.reason = reason
            other.commit()
    mine = session.identity_map.get(identity_key(Build, send.build_id))
    if mine is not None:
        set_committed_value(mine, "reason", reason)

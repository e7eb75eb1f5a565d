"""The reconciler: the database is the truth about builds, the broker only a delivery mechanism. It runs in
every worker (at start and every few seconds) and repairs what the broker lost:

- a build ``running`` on a worker whose heartbeat stopped (killed, machine lost) goes back to ``queued`` and is
  enqueued again; it resumes from the stage cache;
- ``queued`` builds of this worker's queues are enqueued again when the broker's queue is empty (Redis restarted
  or flushed), since their messages are gone.

Re-enqueueing can only duplicate a message, never lose one, and duplicates are harmless: a build is claimed
atomically by exactly one worker (workers/runner.py)."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta, timezone

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from kiln.tables import Build, Worker
from kiln.states import move_build_if_unchanged
from workers.enqueue import Enqueue, Send, send_after_commit
from workers.liveness import is_live

log = logging.getLogger(__name__)


def reclaim_orphans(sessions: sessionmaker[Session], enqueue: Enqueue) -> list[str]:
    """Running builds whose worker is dead → queued again (each reset is one atomic update, sent when it
    commits). A send the broker refused is left on the row as its reason and raised once the others are done."""
    sends = []
    with sessions() as s:
        running = s.scalars(select(Build).where(Build.status == "running")).all()
        for b in running:
            if b.status != "running":  # re-read after the previous commit: it finished or moved meanwhile
                continue
            w = s.get(Worker, b.worker) if b.worker else None
            if w is not None and is_live(w):
                continue
            worker, build_id, queue = b.worker, b.id, b.queue
            if move_build_if_unchanged(s, b, "queued", reason=f"worker {worker} stopped; re-enqueued"):
                sends.append(send_after_commit(s, build_id, queue, enqueue))
            s.commit()
    return _sent(sends)


def requeue_lost(sessions: sessionmaker[Session], queues: list[str], enqueue: Enqueue, broker_depth, *,
                 min_age_s: float = 5.0) -> list[str]:
    """Queued builds of ``queues`` whose broker queue is empty (their messages were lost) → enqueued again."""
    cutoff = datetime.now(timezone.utc) - timedelta(seconds=min_age_s)
    sends = []
    with sessions() as s:
        rows = s.scalars(select(Build).where(Build.status == "queued", Build.queue.in_(queues))).all()
        for b in rows:
            created = b.created_at if b.created_at.tzinfo else b.created_at.replace(tzinfo=timezone.utc)
            if created > cutoff:
                continue
            depth = broker_depth(b.queue)
            if depth == 0:
                sends.append(send_after_commit(s, b.id, b.queue, enqueue))
        s.commit()  # nothing written: the rows were committed before; this sends
    return _sent(sends)


def _sent(sends: list[Send]) -> list[str]:
    failed = [send.error for send in sends if send.error is not None]
    if failed:
        raise failed[0]
    return [send.build_id for send in sends if send.sent]


def redis_depth(app):
    """LLEN of a Celery queue on a Redis broker; None (unknown) for other brokers."""
    def depth(queue: str) -> int | None:
        if not str(app.conf.broker_url).startswith(("redis://", "rediss://")):
            return None
        with app.connection_for_write() as conn:
            return int(conn.default_channel.client.llen(queue))
    return depth

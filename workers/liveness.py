"""Workers in the database: registration, heartbeats, and which queues have a live consumer."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from sqlalchemy import select
from sqlalchemy.orm import Session

from kiln.models import Worker

import os

HEARTBEAT_S = float(os.environ.get("KILN_HEARTBEAT_S") or 5)  # empty: unset, as for every setting
LIVE_WINDOW_S = float(os.environ.get("KILN_WORKER_LIVE_WINDOW_S") or 30)


def _aware(ts: datetime) -> datetime:
    return ts if ts.tzinfo else ts.replace(tzinfo=timezone.utc)  # SQLite returns naive datetimes


def is_live(worker, now: datetime | None = None) -> bool:
    now = now or datetime.now(timezone.utc)
    return _aware(worker.last_heartbeat) >= now - timedelta(seconds=LIVE_WINDOW_S)


def register(session: Session, name: str, capabilities: dict) -> None:
    now = datetime.now(timezone.utc)
    row = session.get(Worker, name)
    if row is None:
        session.add(Worker(name=name, queues=capabilities["queues"], capabilities=capabilities,
                           started_at=now, last_heartbeat=now))
    else:
        row.queues, row.capabilities, row.started_at, row.last_heartbeat = capabilities["queues"], capabilities, now, now
    session.commit()


def heartbeat(session: Session, name: str) -> None:
    row = session.get(Worker, name)
    if row is not None:
        row.last_heartbeat = datetime.now(timezone.utc)
        session.commit()


def workers_for(workers: Session | list, queue: str) -> tuple[list, list]:
    """(live, all) workers that consume ``queue``, from a session or from rows already read (Worker objects or
    rows with ``queues`` and ``last_heartbeat``)."""
    if isinstance(workers, Session):
        workers = workers.scalars(select(Worker)).all()
    rows = [w for w in workers if queue in (w.queues or [])]
    return [w for w in rows if is_live(w)], rows


def waiting_reason(workers: Session | list, queue: str, backend: str, target: str) -> str:
    live, _ = workers_for(workers, queue)
    if not live:
        return (f"waiting for a worker that builds {backend} engines for {target} (queue {queue}); "
                "no such worker is live")
    return f"waiting for a free worker on queue {queue} ({len(live)} live)"

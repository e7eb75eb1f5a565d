"""Workers in the database: registration, heartbeats, and which queues have a live consumer; and the worker's own
record of its heartbeat loop in KILN_HOME, which ``kiln worker-probe`` reads (a Kubernetes pod's exec probes)."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from kiln.tables import Worker

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


#: in the worker's KILN_HOME (each worker pod has its own): its name, when its heartbeat loop last turned (``beat``)
#: and when a heartbeat last reached the database (``db``), as Unix times
BEAT_FILE = "worker-heartbeat.json"
PROBES = ("live", "ready")


def record_beat(home: Path, name: str, db_at: float | None, now: float | None = None) -> None:
    """Each turn of the heartbeat loop, whether or not the database answered (written whole, then renamed)."""
    path = Path(home) / BEAT_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{BEAT_FILE}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"name": name, "beat": time.time() if now is None else now, "db": db_at}))
    os.replace(tmp, path)


def probe(home: Path, check: str, now: float | None = None) -> str | None:
    """None if the worker whose KILN_HOME is ``home`` passes ``check``, else why not (one line).

    ``live``: its heartbeat loop turned within LIVE_WINDOW_S: the process is not wedged, whatever the database
    and broker do (a liveness probe that failed with them would restart every worker, running builds and all,
    whenever PostgreSQL blinked). ``ready``: also a heartbeat reached the database within LIVE_WINDOW_S, which is
    when the API lists the worker as live (``is_live``) and builds are routed to its queues."""
    if check not in PROBES:
        raise ValueError(f"check must be one of {PROBES}, not {check!r}")
    path = Path(home) / BEAT_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return f"no worker heartbeat in {path}: `kiln worker` has not started with KILN_HOME={home}"
    except (OSError, ValueError) as exc:
        return f"unreadable worker heartbeat {path}: {exc}"
    now = time.time() if now is None else now
    age = now - float(data.get("beat") or 0)
    if age > LIVE_WINDOW_S:
        return f"worker {data.get('name')}: heartbeat loop last turned {age:.0f}s ago (> {LIVE_WINDOW_S:.0f}s)"
    if check == "ready":
        if data.get("db") is None:
            return f"worker {data.get('name')}: no heartbeat has reached the database yet"
        db_age = now - float(data["db"])
        if db_age > LIVE_WINDOW_S:
            return (f"worker {data.get('name')}: last heartbeat in the database {db_age:.0f}s ago "
                    f"(> {LIVE_WINDOW_S:.0f}s): the API does not list it as live")
    return None


def workers_for(workers: Session | Sequence[Any], queue: str) -> tuple[list, list]:
    """(live, all) workers that consume ``queue``, from a session or from rows already read (Worker objects or
    rows with ``queues`` and ``last_heartbeat``)."""
    read = workers.scalars(select(Worker)).all() if isinstance(workers, Session) else workers
    rows = [w for w in read if queue in (w.queues or [])]
    return [w for w in rows if is_live(w)], rows


def waiting_reason(workers: Session | Sequence[Any], queue: str, backend: str | None, target: str | None) -> str:
    live, _ = workers_for(workers, queue)
    if not live:
        return (f"waiting for a worker that builds {backend} engines for {target} (queue {queue}); "
                "no such worker is live")
    return f"waiting for a free worker on queue {queue} ({len(live)} live)"

"""/v1/workers: who can build what, and whether they are alive."""

from __future__ import annotations

from fastapi import APIRouter
from sqlalchemy import select

from api.deps import SessionDep
from kiln.tables import Worker
from workers.liveness import is_live

router = APIRouter(prefix="/v1/workers", tags=["workers"])


@router.get("")
def list_workers(session: SessionDep):
    """Workers with their queues, capabilities and last heartbeat."""
    rows = session.scalars(select(Worker).order_by(Worker.name))
    return {"workers": [{"name": w.name, "queues": w.queues, "capabilities": w.capabilities, "live": is_live(w),
                         "last_heartbeat": w.last_heartbeat.isoformat(), "started_at": w.started_at.isoformat()}
                        for w in rows]}

"""Liveness and readiness."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sqlalchemy import text

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz():
    """The process is up."""
    return {"status": "ok"}


@router.get("/readyz")
def readyz(request: Request):
    """Database and broker reachable."""
    checks = {}
    try:
        with request.app.state.sessions() as s:
            s.execute(text("SELECT 1"))
        checks["database"] = "ok"
    except Exception as exc:
        checks["database"] = f"unreachable: {type(exc).__name__}"
    checks["broker"] = request.app.state.broker_check()
    ready = all(v == "ok" for v in checks.values())
    return JSONResponse({"status": "ready" if ready else "not ready", "checks": checks}, status_code=200 if ready else 503)

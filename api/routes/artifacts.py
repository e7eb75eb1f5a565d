"""/v1/artifacts: published engines and their provenance."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Body, Query, Request
from sqlalchemy import or_, select

from api.deps import SessionDep
from kiln.errors import SpecError
from kiln.states import move_artifact
from api.schemas import artifact_read
from kiln.digests import parse_digest
from kiln.errors import ArtifactUnknown
from kiln.tables import Artifact, EngineName

router = APIRouter(prefix="/v1/artifacts", tags=["artifacts"])


@router.get("")
def list_artifacts(session: SessionDep, model: str | None = Query(None, max_length=255),
                   status: str | None = Query(None, pattern="^(fresh|stale|revoked|rejected)$"),
                   precision: str | None = Query(None, max_length=16), target: str | None = Query(None, max_length=16),
                   backend: str | None = Query(None, max_length=32), limit: int = Query(50, ge=1, le=500),
                   offset: int = Query(0, ge=0, le=1_000_000)):
    """Engines, newest first, filtered by model, status, precision, target and backend."""
    q = select(Artifact)
    if model is not None:  # engines it published and engines named in it from another repository
        q = q.where(or_(Artifact.repository == model,
                        Artifact.digest.in_(select(EngineName.digest).where(EngineName.repository == model))))
    for column, value in ((Artifact.status, status), (Artifact.precision, precision),
                          (Artifact.target, target), (Artifact.backend, backend)):
        if value is not None:
            q = q.where(column == value)
    rows = list(session.scalars(q.order_by(Artifact.created_at.desc()).offset(offset).limit(limit)))
    return {"artifacts": [a.summary() for a in rows], "limit": limit, "offset": offset}


@router.get("/{digest}")
def get_artifact(digest: str, session: SessionDep, request: Request):
    """One engine: state, provenance, validation report, and whether and by which key it is signed."""
    row = session.get(Artifact, parse_digest(digest))
    if row is None:
        raise ArtifactUnknown(f"no engine {digest}", field="digest", fix="list engines with GET /v1/artifacts")
    from api.routes.keys import trusted_fingerprints
    from api.admission import signature_summary

    return {**artifact_read(row),
            "signature": signature_summary(session, row.digest, trusted_fingerprints(request.app))}


@router.post("/{digest}/revoke")
def revoke_artifact(digest: str, session: SessionDep, body: Any = Body(None)):
    """Withdraw an engine: never resolved or tagged again (still pullable by digest, marked revoked)."""
    reason = body.get("reason") if isinstance(body, dict) else None
    if not isinstance(reason, str) or not reason.strip():
        raise SpecError("a reason is required", field="reason", fix='send {"reason": "why this engine is withdrawn"}')
    row = session.get(Artifact, parse_digest(digest))
    if row is None:
        raise ArtifactUnknown(f"no engine {digest}", field="digest", fix="list engines with GET /v1/artifacts")
    move_artifact(session, row, "revoked", reason=reason.strip()[:1000])  # a revoked engine: 409
    session.commit()
    return artifact_read(row)

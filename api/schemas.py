"""Response shapes (separate from the ORM models)."""

from __future__ import annotations

from kiln.tables import Artifact, Build


def build_read(b: Build, *, reason: str | None = None, cache_hit: bool = False) -> dict:
    return {
        "id": b.id, "status": b.status, "stage": b.stage, "stages": b.stages or [], "build_key": b.build_key,
        "progress": b.progress if b.status == "running" else None,
        "request_key": b.request_key, "digest": b.digest, "queue": b.queue, "worker": b.worker,
        "error": b.error, "reason": reason if reason is not None else b.reason, "cancel_requested": b.cancel_requested,
        "attempts": b.attempts, "spec": b.spec, "cache_hit": cache_hit,
        "created_at": _iso(b.created_at), "started_at": _iso(b.started_at), "finished_at": _iso(b.finished_at),
    }


def artifact_answer(a: Artifact, producer: Build | None) -> dict:
    """A request answered by an already-built artifact."""
    body = build_read(producer, cache_hit=True) if producer else {
        "id": None, "stage": None, "stages": [], "progress": None, "queue": None, "worker": None, "error": None, "reason": None,
        "cancel_requested": False, "attempts": 0, "spec": None, "request_key": a.request_key,
        "created_at": _iso(a.created_at), "started_at": None, "finished_at": None, "cache_hit": True}
    body.update({"status": "succeeded" if a.status != "rejected" else "failed", "build_key": a.build_key,
                 "digest": a.digest, "artifact": a.summary()})
    if a.status == "rejected":
        body["reason"] = "validation"
    return body


def artifact_read(a: Artifact) -> dict:
    return {**a.summary(), "provenance": a.provenance, "validation": a.validation}


def _iso(ts) -> str | None:
    return ts.isoformat() if ts else None

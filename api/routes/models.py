"""/v1/models (tracked models), the Hugging Face webhook, and /v1/resolve (which engine to deploy)."""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Body, Header, Query, Request
from sqlalchemy import select
from starlette.concurrency import run_in_threadpool

from api.bodies import SafeJSONResponse as JSONResponse  # a bad stored float is null, not a 500
from api.deps import SessionDep, SessionsDep, SettingsDep
from api.schemas import artifact_answer, build_read
from kiln import errors as e
from kiln.errors import SpecError
from kiln.tables import TrackedModel
from workers.freshness import models_for_webhook, refresh_model, register_model, webhook_secret_ok
from api.resolution import Resolution, resolve_engine

router = APIRouter(tags=["models"])
MAX_WEBHOOK_BYTES = 1 << 20


def model_read(m: TrackedModel) -> dict:
    return {"name": m.name, "checkpoint": m.checkpoint, "hf_repo": m.hf_repo, "branch": m.branch,
            "head_sha": m.head_sha, "matrix": m.matrix, "gates": m.gates,
            "updated_at": m.updated_at.isoformat() if m.updated_at else None}


def refresh_read(r) -> dict:
    builds = [artifact_answer(b.artifact, b.build) if b.artifact else build_read(b.build) for b in r.builds]
    return {"model": model_read(r.model), "moved": r.moved, "previous_head": r.old_head, "builds": builds}


@router.get("/v1/support")
def support(session: SessionDep):
    """The support matrix: family × precision × backend, with the reason for each gap, and what ran where — each
    row's ``verified``: validated engines in this registry per target (count, latest), what the test suite builds
    (kiln/verified.py) — and the recipes; the document ``kiln models --json`` prints."""
    from kiln.recipes import recipe_table
    from kiln.runtimes import support_table
    from kiln.verified import support_report

    return {**support_report(session), "recipes": recipe_table(), "runtime_support": support_table()}


@router.put("/v1/models/{model:path}")
def put_model(model: str, request: Request, settings: SettingsDep, sessions: SessionsDep, body: Any = Body(None)):
    """Track a model: {"checkpoint": "hf://org/name@branch", "matrix": [{precision, profile, target, backend}]}."""
    return refresh_read(register_model(settings, sessions, model, body, request.app.state.enqueue))


@router.get("/v1/models")
def list_models(session: SessionDep):
    """Tracked models and their current heads."""
    return {"models": [model_read(m) for m in session.scalars(select(TrackedModel).order_by(TrackedModel.name))]}


@router.post("/v1/models/{model:path}/refresh")
def refresh(model: str, request: Request, settings: SettingsDep, sessions: SessionsDep):
    """Poll the tracked branch (for sources without webhooks)."""
    return refresh_read(refresh_model(settings, sessions, model, request.app.state.enqueue))


@router.get("/v1/models/{model:path}")
def get_model(model: str, session: SessionDep):
    """One tracked model."""
    row = session.get(TrackedModel, model)
    if row is None:
        raise e.ModelUnknown(f"{model!r} is not tracked", field="model", fix="register it with PUT /v1/models/{model}")
    return model_read(row)


@router.post("/v1/webhooks/huggingface")
async def huggingface_webhook(request: Request, settings: SettingsDep, sessions: SessionsDep,
                              x_webhook_secret: str | None = Header(None)):
    """The Hub's webhook: a moved tracked branch marks old engines stale and builds the new head."""
    if not webhook_secret_ok(settings.webhook_secret, x_webhook_secret):
        raise e.Unauthorized("missing or wrong webhook secret", field="X-Webhook-Secret",
                             fix="set the secret configured as KILN_WEBHOOK_SECRET in the Hub webhook")
    raw = await request.body()
    if len(raw) > MAX_WEBHOOK_BYTES:
        raise e.PayloadTooLarge("payload over 1 MiB", field="body", fix="send the Hub's payload")
    try:
        payload = json.loads(raw)
    except ValueError:
        raise SpecError("the body is not JSON", field="body", fix="send the Hub's JSON payload") from None
    names = models_for_webhook(sessions, payload)
    results = []
    for name in names:
        r = await run_in_threadpool(refresh_model, settings, sessions, name, request.app.state.enqueue)
        results.append({"model": name, "moved": r.moved, "head_sha": r.model.head_sha, "previous_head": r.old_head,
                        "builds": [b.build.id if b.build else None for b in r.builds]})
    return {"handled": results}


@router.get("/v1/resolve")
async def resolve(request: Request, model: str = Query(..., max_length=255), precision: str = Query(..., max_length=16),
                  profile: str = Query(..., max_length=64), target: str = Query(..., max_length=32),
                  backend: str = Query(..., max_length=32), runtime: str | None = Query(None, max_length=255),
                  registry: str | None = Query(None, max_length=512)):
    """Exactly one servable engine for (model, precision, profile, target, backend[, runtime]), or why not; with
    ``registry`` (``host[:port][/path]``), also its copy Kiln pushed there (``replica``), or why there is none."""
    # The hottest read of the service: one hop to a thread for the whole lookup (a session dependency would
    # cost two more), on an autocommit connection (one statement, no BEGIN/ROLLBACK round trips).
    r, replica = await run_in_threadpool(_resolve, request.app, registry, model=model, precision=precision,
                                         profile=profile, target=target, backend=backend, runtime=runtime)
    if r.artifact is None:
        raise r.error()
    a = r.artifact
    body = {"digest": a.digest, "repository": a.repository, "tag": a.tag, "status": a.status,
            "reference": f"{a.repository}@{a.digest}", "provenance": a.provenance, "signature": r.signature}
    return JSONResponse({**body, "replica": replica} if registry is not None else body)


def _resolve(app, registry: str | None, **query) -> tuple[Resolution, str | None]:
    from api.routes.keys import trusted_fingerprints
    from api.admission import signature_summary
    from workers.replicas import replica_reference

    with app.state.read_engine.connect() as conn:
        r = resolve_engine(conn, **query)
        replica = None
        if r.artifact is not None:  # whether and by which key the answer is signed (an indexed read)
            r.signature = signature_summary(conn, r.artifact.digest, trusted_fingerprints(app))
            if registry is not None:
                replica = replica_reference(conn, r.artifact.digest, query["model"], registry)
        return r, replica

"""/v1/builds: submit (one spec or a matrix), plan without submitting, list, show, follow (server-sent events), cancel."""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Body, Query, Request
from sqlalchemy import func, select
from sse_starlette import EventSourceResponse, ServerSentEvent

from api.bodies import SafeJSONResponse as JSONResponse  # a bad stored float is null, not a 500
from api.deps import SessionDep, SessionsDep, SettingsDep
from api.schemas import artifact_answer, build_read
from kiln.errors import BuildUnknown
from kiln.tables import TERMINAL, Build, BuildEvent
from kiln.document import document_schema, is_matrix, parse_document
from kiln.states import request_cancel
from workers.liveness import waiting_reason
from workers.submit import plan_many, submit_many

router = APIRouter(prefix="/v1/builds", tags=["builds"])
#: the request body's schema (kiln/document.py, the same document kiln build -f reads); app.py adds its definitions
#: to the OpenAPI components
BODY_SCHEMA = document_schema(ref_prefix="#/components/schemas/")
SPEC_BODY = {"oneOf": BODY_SCHEMA["oneOf"]}


@router.post("", status_code=202, openapi_extra={"requestBody": {"required": True, "content": {
    "application/json": {"schema": SPEC_BODY}}}}, responses={200: {"description": "already built or building"},
                                                             202: {"description": "queued"}})
def create_builds(request: Request, settings: SettingsDep, sessions: SessionsDep, body: Any = Body(None)):
    """Submit a build spec, or {"matrix": [specs]} (optionally with "defaults": {spec fields}): the document of
    kiln build -f (kiln/document.py), every entry checked before any is submitted."""
    specs = parse_document(body, settings.roots, where="body")
    answers, created = [], False
    for result in submit_many(settings, sessions, specs, request.app.state.enqueue,
                              reads=request.app.state.read_sessions):
        created |= result.outcome == "created"
        if result.artifact is not None:  # existing-artifact
            answers.append(artifact_answer(result.artifact, result.build))
        else:
            assert result.build is not None  # created or existing-build: the build is the answer
            answers.append(build_read(result.build))
    payload = {"builds": answers} if is_matrix(body) else answers[0]
    return JSONResponse(payload, status_code=202 if created else 200)


@router.post("/plan", openapi_extra={"requestBody": {"required": True, "content": {
    "application/json": {"schema": SPEC_BODY}}}})
def plan_builds(request: Request, settings: SettingsDep, sessions: SessionsDep, body: Any = Body(None)):
    """What ``POST /v1/builds`` would do with the same body, doing none of it (kiln build --server URL --dry-run):
    each spec's plan (keys, checkpoint, toolchain, gates, stage outputs cached, compile commands) and its
    ``submission`` (the engine that would answer it, the build it would join, or the queue a new build would wait
    on), ``{"plans": [...]}`` for a matrix. Refused as the submission would be; nothing is queued. A route of its
    own, not a flag of the submission: a server that does not know it answers 405 instead of queueing a build."""
    plans = plan_many(settings, sessions, parse_document(body, settings.roots, where="body"),
                      reads=request.app.state.read_sessions)
    return {"plans": plans} if is_matrix(body) else plans[0]


@router.get("")
def list_builds(session: SessionDep, status: str | None = Query(None, pattern="^(queued|running|succeeded|failed|cancelled)$"),
                model: str | None = Query(None, max_length=255), limit: int = Query(50, ge=1, le=500),
                offset: int = Query(0, ge=0, le=1_000_000)):
    """Builds, newest first, filtered by status and model name."""
    where = []  # filtered and paged in SQL: a call reads one page, not the table
    if status:
        where.append(Build.status == status)
    if model:
        where.append(Build.spec["model_name"].as_string() == model)
    total = session.scalar(select(func.count()).select_from(Build).where(*where))
    page = session.scalars(select(Build).where(*where).order_by(Build.created_at.desc(), Build.id)
                           .offset(offset).limit(limit))
    return {"builds": [build_read(b) for b in page], "total": total, "limit": limit, "offset": offset}


def _get(session, build_id: str) -> Build:
    row = session.get(Build, build_id) if len(build_id) <= 32 else None
    if row is None:
        raise BuildUnknown(f"no build {build_id!r}", field="id", fix="list builds with GET /v1/builds")
    return row


def _reason(session, b: Build) -> str | None:
    if b.status == "queued" and not (b.reason or "").startswith(("not yet handed", "retrying")):
        return waiting_reason(session, b.queue, b.spec.get("backend"), b.spec.get("target"))
    return b.reason


@router.get("/{build_id}")
def get_build(build_id: str, session: SessionDep):
    """One build: status, current stage, per-stage timings and cache hits, digest, error and reason."""
    b = _get(session, build_id)
    return build_read(b, reason=_reason(session, b))


@router.post("/{build_id}/cancel")
def cancel_build(build_id: str, session: SessionDep):
    """Cancel: a queued build stops at once, a running one at its next stage boundary."""
    b = _get(session, build_id)
    request_cancel(session, b)  # a finished build: 409 invalid_transition
    session.commit()
    return JSONResponse(build_read(b), status_code=202 if b.status == "running" else 200)


#: a reader re-reads at least this often even if no notification came (kiln/bell.py)
EVENTS_WAKE_AT_LEAST_S = 2.0
#: a comment line this often while nothing happens, so a proxy with an idle timeout (ingress-nginx and AWS ALB: 60 s)
#: never sees an idle stream
EVENTS_KEEPALIVE_S = 5.0
#: how long a client waits before reconnecting (the SSE ``retry:`` field, sent with the first event)
EVENTS_RETRY_MS = 1000


@router.get("/{build_id}/events")
async def build_events(build_id: str, request: Request, sessions: SessionsDep):
    """Server-sent events: stage changes and status changes, until the build finishes, then an ``end`` event. The
    stream is pushed: the reader wakes when the build's events are committed (kiln/bell.py), not on a timer. Each
    event carries its id; a client that reconnects with ``Last-Event-ID`` gets only what it has not seen. A keep-alive
    comment goes out every few seconds."""
    with sessions() as s:
        _get(s, build_id)
    try:
        last = int(request.headers.get("last-event-id", "0"))
    except ValueError:
        last = 0

    bell = request.app.state.bell

    async def stream():
        nonlocal last
        yield ServerSentEvent(comment="kiln build events", retry=EVENTS_RETRY_MS)
        while True:
            ticket = bell.ticket(build_id)  # before the read: a commit after it wakes the wait below
            with sessions() as s:
                events = list(s.scalars(select(BuildEvent).where(BuildEvent.build_id == build_id, BuildEvent.id > last)
                                        .order_by(BuildEvent.id)))
                status = s.get(Build, build_id).status
            for e in events:
                last = e.id
                yield ServerSentEvent(json.dumps(e.data, sort_keys=True), id=str(e.id), event=e.kind)
            if status in TERMINAL and not events:
                yield ServerSentEvent(json.dumps({"status": status}), id=str(last), event="end")
                return
            await bell.wait(ticket, timeout=EVENTS_WAKE_AT_LEAST_S)

    # EventSourceResponse ends the generator when the client goes away, and sends the keep-alive comments
    return EventSourceResponse(stream(), ping=EVENTS_KEEPALIVE_S, sep="\n",
                               headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

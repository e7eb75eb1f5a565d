"""Submitting builds (the service side): answer from an existing artifact when its BuildKey is already built,
join the identical build that is queued or running (the database's unique ``active_key`` decides, not timing),
or create the build row, commit, and only then enqueue it."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Callable

from sqlalchemy import bindparam, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, defer, sessionmaker

from builder.pipeline import Builder
from kiln.keys import build_key
from kiln.models import Artifact, Build, Worker
from kiln.settings import Settings
from kiln.spec import BuildSpec
from kiln.states import create_build
from workers.capabilities import queue_name, routing_queues
from workers.registry import is_live, waiting_reason, workers_for

Enqueue = Callable[[str, str], None]


@dataclass
class Submitted:
    outcome: str  # created | existing-build | existing-artifact
    build: Build | None
    artifact: Artifact | None = None


def candidate_keys(workers: list, prepared, queue: str) -> set[str]:
    """BuildKeys the workers serving ``queue`` would compute (live ones first, else any known, else ours)."""
    live, known = workers_for(workers, queue)
    toolchains = [w.capabilities.get("toolchains", {}).get(queue) for w in (live or known)]
    keys = {build_key(prepared.resolved.digest, prepared.spec, tc, prepared.gates, prepared.data)
            for tc in toolchains if tc}
    return keys or {prepared.build_key}


def choose_queue(workers: list, spec: BuildSpec) -> str:
    """The queue for ``spec``: for TensorRT-LLM engines the newest versioned queue (toolchain in the name) that
    a worker serves, else the generic queue, where the build waits for a capable worker."""
    advertised = {q for w in ([w for w in workers if is_live(w)] or workers) for q in (w.queues or [])}
    candidates = routing_queues(spec.backend, spec.target, spec.tp_size, advertised)
    return candidates[0] if candidates else queue_name(spec.backend, spec.target, tp_size=spec.tp_size)


#: What routing and dedupe need of the workers (plain rows, not ORM objects: read on every request).
WORKERS = select(Worker.name, Worker.queues, Worker.capabilities, Worker.last_heartbeat)
#: Every engine with one of the BuildKeys (not revoked), newest first, each with the first build that produced
#: it: one statement answers a whole matrix.
#: (The engine's provenance is not read: an answer carries the engine's summary, and the provenance — spec,
#: toolchain, the checkpoint's file list — is the largest JSON column to parse.)
EXISTING = (select(Artifact, Build).outerjoin(Build, Build.digest == Artifact.digest)
            .where(Artifact.build_key.in_(bindparam("keys", expanding=True)), Artifact.status != "revoked")
            .order_by(Artifact.created_at.desc(), Build.created_at).options(defer(Artifact.provenance)))


def submit(settings: Settings, sessions: sessionmaker[Session], spec: BuildSpec, enqueue: Enqueue, *,
           reads: sessionmaker[Session] | None = None) -> Submitted:
    """One spec; see :func:`submit_many`."""
    return submit_many(settings, sessions, [spec], enqueue, reads=reads)[0]


def submit_many(settings: Settings, sessions: sessionmaker[Session], specs: list[BuildSpec], enqueue: Enqueue, *,
                reads: sessionmaker[Session] | None = None) -> list[Submitted]:
    """Submit specs (one request, or a matrix), answered in order. Those whose engine exists are answered from
    the database by two statements whatever their number — the workers (routing and their toolchains' keys) and
    the engines with any of the candidate keys —, never from a process-local cache (a revoke by another API
    process is seen at once). ``reads``: sessions on autocommit connections where the caller has them (the API:
    no transaction for the lookups). The rest are created one by one, each committed before it is enqueued."""
    builder = Builder(settings, None, sessions)
    identified: dict = {}  # this request's checkpoint identities: a matrix identifies each checkpoint once
    prepared = [builder.prepare(spec, check_environment=False, identified=identified)[0] for spec in specs]
    with (reads or sessions)() as session:
        workers = session.execute(WORKERS).all()
        queues = [choose_queue(workers, spec) for spec in specs]
        candidates = [candidate_keys(workers, p, q) for p, q in zip(prepared, queues)]
        rows = session.execute(EXISTING, {"keys": sorted(set().union(*candidates))}).all()
    newest: dict[str, tuple] = {}
    for row in rows:  # newest first: the first row of a key is its answer
        newest.setdefault(row.Artifact.build_key, row)
    out: list[Submitted] = []
    for spec, p, queue, keys in zip(specs, prepared, queues, candidates):
        found = [newest[k] for k in keys if k in newest]
        if found:
            row = max(found, key=lambda r: r.Artifact.created_at)
            out.append(Submitted("existing-artifact", row.Build, row.Artifact))
        else:
            out.append(_create(sessions, spec, p, queue, workers, enqueue))
    return out


def _create(sessions, spec: BuildSpec, prepared, queue: str, workers, enqueue: Enqueue) -> Submitted:
    build = Build(id=uuid.uuid4().hex, request_key=prepared.request_key, active_key=prepared.request_key,
                  spec=spec.model_dump(), queue=queue, status="queued", stages=[], attempts=0,
                  cancel_requested=False, reason=waiting_reason(workers, queue, spec.backend, spec.target))
    with sessions() as session:
        try:
            create_build(session, build)
            session.commit()
        except IntegrityError:
            session.rollback()
            existing = session.scalars(select(Build).where(Build.active_key == prepared.request_key)).first()
            if existing is not None:
                return Submitted("existing-build", existing)
            raise
    enqueue_after_commit(sessions, build, enqueue)
    return Submitted("created", build)


def enqueue_after_commit(sessions: sessionmaker[Session], build: Build, enqueue: Enqueue) -> None:
    """The row is committed: a worker that receives the message always finds it."""
    try:
        enqueue(build.id, build.queue)
    except Exception as exc:  # broker down: the build stays queued; the reconciler re-enqueues it
        with sessions() as session:
            row = session.get(Build, build.id)
            row.reason = f"not yet handed to the broker ({type(exc).__name__}: {exc}); it will be re-enqueued"
            session.commit()
            build.reason = row.reason


def celery_enqueue(build_id: str, queue: str) -> None:
    from workers.tasks import run_build

    run_build.apply_async(args=[build_id], queue=queue)

"""Submitting builds (the service side): answer from an existing artifact when its BuildKey is already built,
join the identical build that is queued or running (the database's unique ``active_key`` decides, not timing),
or create the build row and ask for its send, which goes when that row commits (workers/enqueue.py)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import bindparam, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, defer, sessionmaker

from builder.pipeline import Builder
from builder.publish import name_in_repository
from kiln.digests import sha256_json
from kiln.keys import build_key
from kiln.errors import SpecError
from kiln.tables import Artifact, Build, TrackedModel, Worker
from kiln.settings import Settings
from kiln.spec import BuildSpec, looser_than, parse_spec
from kiln.states import create_build
from validation.gates import effective_gates
from validation.validate import judge_naming
from workers.capabilities import routing_queues
from workers.enqueue import Enqueue, send_after_commit
from workers.liveness import is_live, waiting_reason, workers_for


@dataclass
class Submitted:
    outcome: str  # created | existing-build | existing-artifact
    build: Build | None
    artifact: Artifact | None = None


def candidate_keys(workers: Sequence[Any], prepared, queue: str) -> set[str]:
    """BuildKeys the workers serving ``queue`` would compute (live ones first, else any known, else ours)."""
    live, known = workers_for(workers, queue)
    toolchains = [w.capabilities.get("toolchains", {}).get(queue) for w in (live or known)]
    keys = {build_key(prepared.resolved.digest, prepared.spec, tc, prepared.gates, prepared.data)
            for tc in toolchains if tc}
    return keys or {prepared.build_key}


def choose_queue(workers: Sequence[Any], spec: BuildSpec) -> str:
    """The queue for ``spec``: for TensorRT-LLM engines the newest versioned queue (toolchain in the name) that
    a worker serves, else the generic queue, where the build waits for a capable worker."""
    advertised = {q for w in ([w for w in workers if is_live(w)] or workers) for q in (w.queues or [])}
    return routing_queues(spec.backend, spec.target, spec.tp_size, advertised)[0]  # the generic queue is last


#: What routing and dedupe need of the workers (plain rows, not ORM objects: read on every request).
WORKERS = select(Worker.name, Worker.queues, Worker.capabilities, Worker.last_heartbeat)
#: Every engine with one of the BuildKeys (not revoked), newest first, each with the first build that produced
#: it: one statement answers a whole matrix.
#: (The engine's provenance is not read: an answer carries the engine's summary, and the provenance — spec,
#: toolchain, the checkpoint's file list — is the largest JSON column to parse.)
EXISTING = (select(Artifact, Build).outerjoin(Build, Build.digest == Artifact.digest)
            .where(Artifact.build_key.in_(bindparam("keys", expanding=True)), Artifact.status != "revoked")
            .order_by(Artifact.created_at.desc(), Build.created_at).options(defer(Artifact.provenance)))
#: the tracked models among a request's repositories (their matrices are the baseline a build is judged against)
TRACKED = (select(TrackedModel.name, TrackedModel.matrix, TrackedModel.gates)
           .where(TrackedModel.name.in_(bindparam("names", expanding=True))))


def _variant(spec: BuildSpec) -> tuple:
    return spec.precision, spec.kv_cache, spec.target, spec.backend, spec.batch_profile, spec.tp_size


def check_strictness(settings: Settings, spec: BuildSpec, model) -> None:
    """A build of a tracked model is judged at least as strictly as the model's matrix entry for its variant
    (gates and evaluation), unless it gives an ``override_reason`` (parse_spec holds every build to the
    precision's defaults the same way). Raises SpecError naming the looser field."""
    if model is None or (spec.override_reason or "").strip():
        return
    refusals = []  # one list per matrix entry of this variant; a spec as strict as any one of them passes
    for entry in model.matrix or []:
        try:
            base = parse_spec({**entry, "gates": {**(model.gates or {}), **entry.get("gates", {})},
                               "model_name": model.name, "checkpoint": spec.checkpoint}, settings.roots)
        except SpecError:
            continue
        if _variant(base) != _variant(spec):
            continue
        refusals.append(looser_than({"gates": effective_gates(spec.precision, spec.gates),
                                     "evaluation": spec.evaluation},
                                    effective_gates(base.precision, base.gates), base.evaluation.model_dump(),
                                    f"{model.name}'s tracked matrix"))
    if refusals and all(refusals):
        errs = refusals[0]
        raise SpecError(errs[0]["message"], field=errs[0]["field"], fix=errs[0]["fix"], details=errs)


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
    builder = Builder(settings, None, sessions)  # type: ignore[arg-type]  # prepare() reads no blob store
    prepared, queues, workers, answers = _decide(builder, settings, sessions, specs, reads)
    out: list[Submitted] = []
    for spec, p, queue, row in zip(specs, prepared, queues, answers):
        if row is None:
            out.append(_create(sessions, spec, p, queue, workers, enqueue))
            continue
        artifact = row.Artifact
        if artifact.repository != spec.model_name:  # the same engine, asked for under another repository
            artifact = name_in_repository(sessions, artifact.digest, str(spec.model_name))  # parse_spec set it
        out.append(Submitted("existing-artifact", row.Build, artifact))
    return out


def plan_many(settings: Settings, sessions: sessionmaker[Session], specs: list[BuildSpec], *,
              reads: sessionmaker[Session] | None = None) -> list[dict]:
    """What :func:`submit_many` would do with ``specs``, doing none of it (``POST /v1/builds/plan``,
    ``kiln build --server URL --dry-run``): each spec's plan (Builder.describe: keys, checkpoint, toolchain, gates,
    stage outputs cached, compile commands) and its ``submission``: ``existing-artifact`` (the engine that would
    answer), ``existing-build`` (the identical build it would join) or ``new-build`` (the queue and why it would
    wait). Refused as a submission would be (SpecError, ValidationFailed); nothing is written or enqueued."""
    builder = Builder(settings, None, sessions)  # type: ignore[arg-type]  # prepare() reads no blob store
    prepared, queues, workers, answers = _decide(builder, settings, sessions, specs, reads)
    plans = []
    with (reads or sessions)() as session:
        for spec, p, queue, row in zip(specs, prepared, queues, answers):
            plan = builder.describe(p)
            submission: dict[str, Any] = {"queue": queue}
            if row is not None:
                plan["cached"]["artifact"] = row.Artifact.digest
                submission.update(outcome="existing-artifact", digest=row.Artifact.digest,
                                  build=row.Build.id if row.Build is not None else None)
            else:
                build = session.execute(select(Build.id, Build.status)
                                        .where(Build.active_key == _active_key(spec, p))).first()
                if build is not None:
                    submission.update(outcome="existing-build", build=build.id, status=build.status)
                else:
                    submission.update(outcome="new-build", reason=waiting_reason(workers, queue, spec.backend,
                                                                                 spec.target))
            plans.append({**plan, "submission": submission})
    return plans


def _decide(builder: Builder, settings: Settings, sessions: sessionmaker[Session], specs: list[BuildSpec],
            reads: sessionmaker[Session] | None) -> tuple[list, list[str], Sequence[Any], list[Any]]:
    """Every spec prepared, routed, answered from an existing engine where one has its key, and judged (a
    tracked model's strictness, another repository's engine named here) — before anything is written:
    (prepared, queues, workers, answers), an answer being the existing (Artifact, Build) row or None."""
    identified: dict = {}  # this request's checkpoint identities: a matrix identifies each checkpoint once
    prepared = [builder.prepare(spec, check_environment=False, identified=identified)[0] for spec in specs]
    with (reads or sessions)() as session:
        workers: Sequence[Any] = session.connection().execute(WORKERS).all()  # plain rows: no ORM loading
        queues = [choose_queue(workers, spec) for spec in specs]
        candidates = [candidate_keys(workers, p, q) for p, q in zip(prepared, queues)]
        rows: Sequence[Any] = session.execute(EXISTING, {"keys": sorted(set().union(*candidates))}).all()
    newest: dict[str, Any] = {}
    for row in rows:  # newest first: the first row of a key is its answer
        newest.setdefault(row.Artifact.build_key, row)
    answers: list[Any] = []
    for keys in candidates:
        found = [newest[k] for k in keys if k in newest]
        answers.append(max(found, key=lambda r: r.Artifact.created_at) if found else None)
    # A spec that will write (a new build, or another repository's engine named here, either of which can move
    # a tag) is judged against its tracked model's matrix first — all of them before anything is written.
    writes = [spec for spec, row in zip(specs, answers) if row is None or row.Artifact.repository != spec.model_name]
    if writes:
        with (reads or sessions)() as session:
            tracked = {m.name: m for m in session.execute(TRACKED, {"names": sorted({s.model_name for s in writes if s.model_name})})}
        for spec in writes:
            check_strictness(settings, spec, tracked.get(spec.model_name))
    for spec, p, row in zip(specs, prepared, answers):  # and one named here, by its metrics against ours
        if row is not None and row.Artifact.repository != spec.model_name:
            judge_naming(sessions, spec, p.data, row.Artifact, p.gates)
    return prepared, queues, workers, answers


def _active_key(spec: BuildSpec, prepared) -> str:
    # identical requests for one repository share a build; another repository's request is its own build
    # (its stages come from the stage cache; its engine, if equal, is named in both — builder/publish.py)
    return sha256_json({"request": prepared.request_key, "repository": spec.model_name})


def _create(sessions, spec: BuildSpec, prepared, queue: str, workers, enqueue: Enqueue) -> Submitted:
    active = _active_key(spec, prepared)
    build = Build(id=uuid.uuid4().hex, request_key=prepared.request_key, active_key=active,
                  spec=spec.model_dump(), queue=queue, status="queued", stages=[], attempts=0,
                  cancel_requested=False, reason=waiting_reason(workers, queue, spec.backend, spec.target))
    with sessions() as session:
        try:
            create_build(session, build)
            send_after_commit(session, build.id, build.queue, enqueue)  # sent when the row commits, not before
            session.commit()
        except IntegrityError:
            session.rollback()  # the identical build exists (a send asked for is dropped with the row)
            existing = session.scalars(select(Build).where(Build.active_key == active)).first()
            if existing is not None:
                return Submitted("existing-build", existing)
            raise
    return Submitted("created", build)

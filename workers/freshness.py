"""Freshness: tracked models follow a Hugging Face branch. When its head moves (webhook or poll), engines of
the old head become stale, tags stop pointing at them, and the registered matrix is built for the new head.

The head is always re-resolved from the Hub (or the local Hub cache offline), never taken from a webhook
payload, so replayed and out-of-order deliveries are harmless: they can only confirm the current head."""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from sqlalchemy import or_, select
from sqlalchemy.orm import Session, sessionmaker

from builder.pipeline import evaluation_tasks
from builder.resolve import latest_revision
from kiln.errors import SpecError
from kiln.tables import Artifact, ModelEvent, Tag, TrackedModel, utcnow
from kiln.settings import Settings
from kiln.sources import TRACKED, tracked_parts
from kiln.spec import MODEL_NAME_RE, parse_spec
from kiln.states import move_artifact, remove_tag
from validation.taskfile import TaskPolicy
from workers.submit import Enqueue, Submitted, check_strictness, submit

MATRIX_FIELDS = {"precision", "profile", "target", "backend", "kv_cache", "tp_size", "calibration", "evaluation", "gates",
                 "override_reason"}


@dataclass
class Refresh:
    model: TrackedModel
    moved: bool
    old_head: str | None
    builds: list[Submitted]


def parse_tracked_checkpoint(ref: object) -> tuple[str, str]:
    """``(repository, branch)`` of the reference a tracked model follows (kiln/sources.py TRACKED)."""
    return tracked_parts(ref)


def check_model_name(name: str) -> None:
    if not isinstance(name, str) or len(name) > 255 or not MODEL_NAME_RE.fullmatch(name):
        raise SpecError(f"{name!r} is not a valid model name", field="model",
                        fix="use lowercase letters, digits, '.', '_', '-' and '/' separators, e.g. acme/tiny")


def head_of(settings: Settings, repo: str, branch: str) -> str:
    return latest_revision(TRACKED.format(repo, branch), cache_root=settings.cache_dir / "resolve")


def mark_stale(session: Session, model: TrackedModel) -> int:
    """Engines of ``model`` built from anything but its head become stale; tags stop naming them."""
    rows = session.scalars(select(Artifact).where(Artifact.repository == model.name, Artifact.status == "fresh",
                                                  or_(Artifact.checkpoint_revision.is_(None), Artifact.checkpoint_revision != model.head_sha))).all()
    why = f"{model.hf_repo}@{model.branch} moved to {model.head_sha}"
    for a in rows:
        move_artifact(session, a, "stale", reason=why)
    # engines another repository published and this one names: stale for this model alone (they may be fresh
    # for their publisher), so only this repository's tags stop naming them
    named = (select(Tag).join(Artifact, Artifact.digest == Tag.digest)
             .where(Tag.repository == model.name, Artifact.repository != model.name,
                    or_(Artifact.checkpoint_revision.is_(None), Artifact.checkpoint_revision != model.head_sha)))
    for tag in session.scalars(named).all():
        remove_tag(session, model.name, tag.name, reason=f"stale for {model.name}: {why}")
    return len(rows)


def build_matrix(settings: Settings, sessions: sessionmaker[Session], model: TrackedModel,
                 enqueue: Enqueue) -> list[Submitted]:
    out = []
    for entry in model.matrix:
        spec = parse_spec({**entry, "gates": {**model.gates, **entry.get("gates", {})}, "model_name": model.name,
                           "checkpoint": TRACKED.format(model.hf_repo, model.head_sha)}, settings.roots)
        out.append(submit(settings, sessions, spec, enqueue))
    return out


def register_model(settings: Settings, sessions: sessionmaker[Session], name: str, body: dict,
                   enqueue: Enqueue) -> Refresh:
    """PUT /v1/models/{name}: validate every matrix entry before anything is written, then track and build."""
    check_model_name(name)
    if not isinstance(body, dict):
        raise SpecError("the body must be a JSON object", field="body", fix='send {"checkpoint": ..., "matrix": [...]}')
    repo, branch = parse_tracked_checkpoint(body.get("checkpoint"))
    matrix, gates = body.get("matrix"), body.get("gates") or {}
    if not isinstance(matrix, list) or not 1 <= len(matrix) <= 64:
        raise SpecError("matrix must list 1 to 64 entries", field="matrix", fix="give [{precision, profile, target, backend}, ...]")
    if not isinstance(gates, dict):
        raise SpecError("gates must be an object", field="gates", fix='e.g. {"max_ppl_increase_pct": 2.0}')
    reason = body.get("override_reason")
    if reason is not None and (not isinstance(reason, str) or len(reason) > 2000):
        raise SpecError("must be a string of at most 2000 characters", field="override_reason",
                        fix="say why the matrix may judge engines more leniently than the one it replaces")
    specs, policy = [], TaskPolicy.of(settings)
    for i, entry in enumerate(matrix):
        extra = set(entry) - MATRIX_FIELDS if isinstance(entry, dict) else {"(not an object)"}
        if extra:
            raise SpecError(f"unknown fields {sorted(extra)}", field=f"matrix.{i}", fix=f"use only {sorted(MATRIX_FIELDS)}")
        if not isinstance(entry.get("gates", {}), dict):
            raise SpecError("gates must be an object", field=f"matrix.{i}.gates", fix='e.g. {"max_ppl_increase_pct": 2.0}')
        try:  # the same rules a build applies, checked now (a placeholder sha: only the shape matters here)
            specs.append(parse_spec({**entry, "model_name": name, "checkpoint": TRACKED.format(repo, "0" * 40),
                                     "gates": {**gates, **entry.get("gates", {})}}, settings.roots))
            evaluation_tasks(specs[-1], policy)  # its task files, as data (a refused one must store nothing)
        except SpecError as exc:
            raise SpecError(exc.message, field=f"matrix.{i}.{exc.field}", fix=exc.fix) from None
    reason = (reason or "").strip() or None
    with sessions() as s:
        replaced = s.get(TrackedModel, name)
        if replaced is not None and reason is None:
            _no_looser(settings, specs, replaced)
    head = head_of(settings, repo, branch)
    with sessions() as s:
        model = s.get(TrackedModel, name)
        old = model.head_sha if model else None
        if model is None:
            model = TrackedModel(name=name, created_at=utcnow())
            s.add(model)
        model.checkpoint, model.hf_repo, model.branch, model.head_sha = body["checkpoint"], repo, branch, head
        model.matrix, model.gates, model.updated_at = matrix, gates, utcnow()
        s.add(ModelEvent(model=name, checkpoint=body["checkpoint"], matrix=matrix, gates=gates, override_reason=reason,
                         created_at=model.updated_at))
        mark_stale(s, model)
        s.commit()
    return Refresh(model, old is not None and old != head, old, build_matrix(settings, sessions, model, enqueue))


def _no_looser(settings: Settings, specs: list, replaced: TrackedModel) -> None:
    """A matrix entry judged more leniently than the stored matrix's entry for its variant (gates, evaluation) is
    refused, as a build of the tracked model would be (:func:`workers.submit.check_strictness`), unless the
    entry or the request gives an ``override_reason`` (the request's is recorded in ``model_events``)."""
    for i, spec in enumerate(specs):
        try:
            check_strictness(settings, spec, replaced)
        except SpecError as exc:
            raise SpecError(f"{exc.message}: the new matrix loosens the one it replaces", field=f"matrix.{i}.{exc.field}",
                            fix=f"{exc.fix}; or give the request an override_reason (recorded with the model's "
                                "history)") from None


def _tracked(s: Session, name: str) -> TrackedModel:
    model = s.get(TrackedModel, name)
    if model is None:
        from kiln.errors import ArtifactUnknown

        raise ArtifactUnknown(f"model {name!r} is not tracked", field="model", fix="register it with PUT /v1/models/{model}")
    return model


def refresh_model(settings: Settings, sessions: sessionmaker[Session], name: str, enqueue: Enqueue) -> Refresh:
    """Re-resolve the tracked branch; when it moved, mark stale and build the matrix for the new head."""
    with sessions() as s:
        model = _tracked(s, name)
        repo, branch = str(model.hf_repo), str(model.branch)  # register_model sets both
    head = head_of(settings, repo, branch)
    with sessions() as s:
        model = _tracked(s, name)  # read again: it may have been unregistered while the branch was read
        old = model.head_sha
        moved = head != old
        if moved:
            model.head_sha, model.updated_at = head, utcnow()
            mark_stale(s, model)
        s.commit()
    # Building is idempotent (equal keys answer from the registry or join the running build), so a refresh
    # that finds the head unchanged still (re)submits the matrix: a build lost earlier is started again.
    return Refresh(model, moved, old, build_matrix(settings, sessions, model, enqueue))


def webhook_secret_ok(expected: str | None, given: str | None) -> bool:
    """Constant-time comparison (of digests, so lengths leak nothing either)."""
    if not expected or given is None:
        return False
    return hmac.compare_digest(hashlib.sha256(expected.encode()).digest(), hashlib.sha256(given.encode()).digest())


def models_for_webhook(sessions: sessionmaker[Session], payload: dict) -> list[str]:
    """Tracked models that a Hub ``repo.content`` event concerns (by repo name and updated branch)."""
    if not isinstance(payload, dict):
        raise SpecError("the payload must be a JSON object", field="body", fix="send the Hub's webhook payload")
    event, repo = payload.get("event"), payload.get("repo")
    if not isinstance(event, dict) or not isinstance(repo, dict) or not isinstance(repo.get("name"), str):
        raise SpecError("not a Hugging Face webhook payload", field="event",
                        fix="expected {event: {scope, action}, repo: {name, headSha}, updatedRefs: [...]}")
    if event.get("scope") != "repo.content":
        return []
    refs = payload.get("updatedRefs")
    branches = None
    if isinstance(refs, list):
        branches = {r["ref"].removeprefix("refs/heads/") for r in refs if isinstance(r, dict) and isinstance(r.get("ref"), str)}
    with sessions() as s:
        rows = s.scalars(select(TrackedModel).where(TrackedModel.hf_repo == repo["name"])).all()
        return [m.name for m in rows if branches is None or m.branch in branches or not branches]

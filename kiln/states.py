"""The index's state machines: the one module that changes a build's status, an engine's status or a tag.

Every writer (submit, the runner, the reconciler, the cancel and revoke routes, freshness, publish) goes through
these functions; each checks that the transition is allowed (else :class:`~kiln.errors.InvalidTransition`) and
writes its event (:class:`BuildEvent` for builds, :class:`TagEvent` for tags) in the caller's transaction. The
caller commits, so a status and its event are one commit.

Builds::

    queued ──claim──▶ running ──▶ succeeded | failed | cancelled
      │  ◀──requeue───┘  (worker lost; storage error, to be retried)
      └──▶ cancelled | failed  (cancelled while queued; retries exhausted)

Engines: published as ``fresh``, ``stale`` (its tracked branch moved while it built) or ``rejected`` (failed
validation); ``fresh → stale`` when the head moves; ``fresh | stale | rejected → revoked`` by an operator.
``revoked`` is final. A tag names only a ``fresh`` engine: an engine that leaves ``fresh`` loses its tags, in
every repository that names it (:func:`name_engine`; a repository other than the publisher's loses its tag
alone when its own tracked head moves, workers/freshness.py)."""

from __future__ import annotations

from datetime import datetime, timezone

from typing import cast

from sqlalchemy import CursorResult, select, update
from sqlalchemy.orm import Session

from kiln.errors import InvalidTransition
from kiln.tables import TERMINAL, Artifact, Build, BuildEvent, EngineName, Tag, TagEvent, TrackedModel

BUILD_TRANSITIONS: dict[str, frozenset[str]] = {
    "queued": frozenset({"running", "cancelled", "failed"}),
    "running": frozenset({"queued", "succeeded", "failed", "cancelled"}),
    "succeeded": frozenset(),
    "failed": frozenset(),
    "cancelled": frozenset(),
}
ARTIFACT_INITIAL = frozenset({"fresh", "stale", "rejected"})
ARTIFACT_TRANSITIONS: dict[str, frozenset[str]] = {
    "fresh": frozenset({"stale", "revoked"}),
    "stale": frozenset({"revoked"}),
    "rejected": frozenset({"revoked"}),
    "revoked": frozenset(),
}
#: what an event says besides the status (only these fields of a transition are recorded)
EVENT_FIELDS = ("digest", "reason", "error", "worker")


def _now() -> datetime:
    return datetime.now(timezone.utc)


def check_build_transition(current: str, to: str, build_id: str) -> None:
    if to not in BUILD_TRANSITIONS.get(current, frozenset()):
        allowed = sorted(BUILD_TRANSITIONS.get(current, ()))
        raise InvalidTransition(f"build {build_id} is {current}; it cannot become {to}", field="status",
                                fix=f"a {current} build can become {', '.join(allowed)}" if allowed
                                else f"a {current} build is final; submit a new build")


def _status_event(build_id: str, to: str, fields: dict) -> BuildEvent:
    return BuildEvent(build_id=build_id, kind="status",
                      data={"status": to, **{k: v for k, v in fields.items() if k in EVENT_FIELDS and v is not None}})


def _entry_fields(to: str) -> dict:
    """What entering ``to`` implies: a running build has started; a finished one releases its request key."""
    if to == "running":
        return {"started_at": _now(), "reason": None}
    if to in TERMINAL:
        return {"finished_at": _now(), "active_key": None}
    return {}


# -- builds ------------------------------------------------------------------------------------------------
def create_build(session: Session, build: Build) -> Build:
    """Add a new build as ``queued`` with its first event. Caller commits (the unique ``active_key`` decides
    between identical concurrent submissions)."""
    if build.status != "queued":
        raise InvalidTransition(f"a new build starts queued, not {build.status}", field="status",
                                fix="create builds as queued")
    session.add(build)
    session.flush()
    session.add(_status_event(build.id, "queued", {"reason": build.reason}))
    return build


def move_build(session: Session, build: Build, to: str, **fields) -> Build:
    """Move ``build`` (a row of ``session``) to ``to`` with ``fields`` (reason, error, digest, ...) and record
    the event. Raises InvalidTransition when ``build``'s status cannot become ``to``. Caller commits."""
    check_build_transition(build.status, to, build.id)
    for key, value in {**_entry_fields(to), **fields}.items():
        setattr(build, key, value)
    build.status = to
    session.add(_status_event(build.id, to, fields))
    return build


def move_build_if_unchanged(session: Session, build: Build, to: str, **fields) -> bool:
    """Move ``build`` to ``to`` only if its row still has the status and attempt count read in ``build``, in one
    atomic update: of two workers (or reconcilers) acting on the same read, exactly one wins. Returns whether
    this one did; the loser changes nothing. Claiming (``to="running"``) counts an attempt. Caller commits."""
    check_build_transition(build.status, to, build.id)
    values = {**_entry_fields(to), **fields, "status": to}
    if to == "running":
        values["attempts"] = (build.attempts or 0) + 1
    result = session.execute(update(Build).where(Build.id == build.id, Build.status == build.status,
                                                 Build.attempts == build.attempts).values(**values)
                             .execution_options(synchronize_session=False))
    done = cast(CursorResult, result).rowcount  # an UPDATE's result is a cursor result: it has a row count
    if done:
        session.add(_status_event(build.id, to, fields))
    session.expire(build)  # the row changed under the ORM object (here or elsewhere): read it afresh
    return bool(done)


def request_cancel(session: Session, build: Build) -> Build:
    """Cancel ``build``: a queued one is cancelled at once; a running one is flagged and stops at its next stage
    boundary (the runner moves it). A finished build raises InvalidTransition. Caller commits."""
    if build.status in TERMINAL:
        raise InvalidTransition(f"build {build.id} is already {build.status}", field="status", fix="nothing to cancel")
    build.cancel_requested = True
    session.flush()  # the flag first: a worker that claims the build from now on sees it
    if build.status == "queued":
        # atomic: a worker claiming it at this moment wins, and then stops at its first stage boundary
        move_build_if_unchanged(session, build, "cancelled", reason="cancelled while queued")
    return build


# -- engines and tags ---------------------------------------------------------------------------------------
def initial_artifact_status(*, passed: bool, stale: bool) -> str:
    """The status an engine is published with."""
    if not passed:
        return "rejected"
    return "stale" if stale else "fresh"


def add_artifact(session: Session, artifact: Artifact, *, reason: str) -> Artifact:
    """Index a newly published engine; a fresh one takes its tag. Caller commits."""
    if artifact.status not in ARTIFACT_INITIAL:
        raise InvalidTransition(f"an engine is published {', '.join(sorted(ARTIFACT_INITIAL))}, not {artifact.status}",
                                field="status", fix="publish it as fresh, stale or rejected")
    session.add(artifact)
    if artifact.status == "fresh":
        point_tag(session, artifact.repository, artifact.tag, artifact, reason=reason)
    return artifact


def move_artifact(session: Session, artifact: Artifact, to: str, *, reason: str) -> Artifact:
    """``fresh → stale``, ``* → revoked``; the engine stops being named by any tag. Caller commits."""
    allowed = ARTIFACT_TRANSITIONS.get(artifact.status, frozenset())
    if to not in allowed:
        raise InvalidTransition(f"engine {artifact.digest} is {artifact.status}; it cannot become {to}",
                                field="status", fix=f"a {artifact.status} engine can become {', '.join(sorted(allowed))}"
                                if allowed else f"a {artifact.status} engine is final")
    artifact.status, artifact.status_reason = to, reason
    # every repository's tags: an engine named in several repositories (EngineName) leaves all of them
    for tag in session.scalars(select(Tag).where(Tag.digest == artifact.digest)).all():
        remove_tag(session, tag.repository, tag.name, reason=f"{to}: {reason}")
    return artifact


def named_in(session: Session, artifact: Artifact, repository: str) -> bool:
    """Whether ``repository`` names ``artifact``: the repository that published it, or one it was named in."""
    return artifact.repository == repository or session.get(EngineName, (repository, artifact.digest)) is not None


def name_engine(session: Session, artifact: Artifact, repository: str, *, reason: str) -> bool:
    """Name ``artifact`` in ``repository`` too, and point that repository's tag for its variant at it when it
    is servable there: fresh, and built from ``repository``'s tracked head if it tracks one. A name that exists
    already moves no tag unless the repository has none for the variant (a repeated request never moves a tag
    back from the repository's own newer engine). The engine's and the model's rows are read again under a lock
    after this transaction's first write, so that a concurrent revoke, staling or head move is always seen by
    one side (PostgreSQL: the row locks; SQLite: its write lock). Returns whether the tag names it. Caller
    commits."""
    if artifact.repository == repository:
        return False  # its own repository: publish tagged it
    if session.get(EngineName, (repository, artifact.digest)) is None:
        session.add(EngineName(repository=repository, digest=artifact.digest, reason=reason))
        session.flush()
    elif (tag := session.get(Tag, (repository, artifact.tag))) is not None:
        return tag.digest == artifact.digest
    else:  # a write before the checks below (SQLite's write lock), as the insert above is
        session.execute(update(EngineName).where(EngineName.repository == repository,
                                                 EngineName.digest == artifact.digest)
                        .values(reason=EngineName.reason))
    locked = session.get(Artifact, artifact.digest, with_for_update=True, populate_existing=True)
    if locked is None or locked.status != "fresh":
        return False
    model = session.get(TrackedModel, repository, with_for_update=True, populate_existing=True)
    if model is not None and model.head_sha is not None and model.head_sha != locked.checkpoint_revision:
        return False
    point_tag(session, repository, locked.tag, locked, reason=reason)
    return True


def point_tag(session: Session, repository: str, name: str, artifact: Artifact, *, reason: str) -> None:
    """Point ``repository:name`` at ``artifact``, which must be a fresh engine named in that repository;
    records the move (nothing when the tag already names it). Caller commits."""
    if artifact.status != "fresh" or not named_in(session, artifact, repository):
        raise InvalidTransition(f"{repository}:{name} can name only a fresh engine named in {repository}; "
                                f"{artifact.digest} is a {artifact.status} engine of {artifact.repository}",
                                field="tag", fix="tag a fresh engine of this repository")
    _set_tag(session, repository, name, artifact.digest, reason)


def remove_tag(session: Session, repository: str, name: str, *, reason: str) -> None:
    """Remove ``repository:name`` (nothing when there is no such tag), recording the move. Caller commits."""
    _set_tag(session, repository, name, None, reason)


def _set_tag(session: Session, repository: str, name: str, digest: str | None, reason: str) -> None:
    tag = session.get(Tag, (repository, name))
    old = tag.digest if tag else None
    if old == digest:
        return
    if digest is None:
        session.delete(tag)
    elif tag is None:
        session.add(Tag(repository=repository, name=name, digest=digest, updated_at=_now()))
    else:
        tag.digest, tag.updated_at = digest, _now()
    session.add(TagEvent(repository=repository, name=name, old_digest=old, new_digest=digest, reason=reason))

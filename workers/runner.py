"""Running one build row on a worker: the same Builder the CLI uses, with stage events recorded in the
database (for ``GET /v1/builds/{id}`` and its event stream) and cancellation checked at stage boundaries.

A redelivered message (worker killed, broker replay) finds the row's state: a finished build is left alone, and
an interrupted one runs again, resuming from the stage cache (finished quantize/compile outputs are reused)."""

from __future__ import annotations

import logging
from sqlalchemy.orm import Session, sessionmaker

from builder.pipeline import STAGES, Builder
from kiln.errors import BuildCancelled, KilnError, StorageUnavailable
from kiln.tables import TERMINAL, Build, BuildEvent
from kiln.settings import Settings
from kiln.spec import parse_spec
from kiln.states import move_build, move_build_if_unchanged
from workers.services import build_services

log = logging.getLogger(__name__)


class EventRecorder:
    """A build's events into its rows: each as a ``build_events`` row (the event stream), the stage and progress
    on the build (GET /v1/builds/{id}, the dashboard). Progress events come at most once a second a stage."""
    def __init__(self, sessions: sessionmaker[Session], build_id: str):
        self.sessions, self.build_id = sessions, build_id

    def __call__(self, kind: str, data: dict) -> None:
        with self.sessions() as s:
            s.add(BuildEvent(build_id=self.build_id, kind=kind, data=data))
            row = s.get(Build, self.build_id)
            if kind == "progress" and row is not None:
                row.progress = data
            if kind == "stage" and row is not None:
                row.stage, row.progress = data["name"], None
                if data["state"] == "finished":
                    row.stages = [st for st in (row.stages or []) if st["name"] != data["name"]] + [
                        {"name": data["name"], "status": data["status"], "seconds": round(data["seconds"], 3)}]
            s.commit()


def redact(value, settings: Settings):
    """``value`` (an error dict, a message) with the worker's own paths named, not shown: its home (cache,
    staging folders), the temporary directory, the working directory and ``$HOME`` become ``$KILN_HOME``,
    ``$TMPDIR``, ``$PWD`` and ``~``. Whoever reads a build (``artifacts:read``) learns what failed, not where this
    machine keeps things (a path under one of them, a checkpoint's among them, is shown under its name)."""
    import os
    import tempfile

    if isinstance(value, dict):
        return {k: redact(v, settings) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v, settings) for v in value]
    if not isinstance(value, str):
        return value
    places = [(str(settings.home_dir), "$KILN_HOME"),  # resolved (kiln/settings.py), as the paths built from it
              (os.path.realpath(tempfile.gettempdir()), "$TMPDIR"), (tempfile.gettempdir(), "$TMPDIR"),
              (os.getcwd(), "$PWD"), (os.path.expanduser("~"), "~")]
    for path, name in sorted(places, key=lambda p: -len(p[0])):  # the longest first: home may lie under /tmp
        if len(path) > 1:
            value = value.replace(path, name)
    return value


def _finish(sessions, build_id: str, status: str, **fields) -> None:
    with sessions() as s:
        move_build(s, s.get(Build, build_id), status, **fields)
        s.commit()


def after_storage_error(sessions, build_id: str, exc: StorageUnavailable, *, last_try: bool) -> str:
    """The store failed mid-build: back to ``queued`` for the task's retry, or, on its last try, ``failed``
    with the reason (on every broker: nothing is left queued with no message to run it)."""
    with sessions() as s:
        row = s.get(Build, build_id)
        if row.status != "running":  # the reconciler took it back meanwhile: whoever runs it next decides
            return row.status
        if last_try:
            move_build(s, row, "failed", reason=f"storage unavailable; gave up after {row.attempts} attempts: {exc}",
                       error=exc.to_dict())
        else:
            move_build(s, row, "queued", reason=f"retrying after a storage error: {exc}")
        s.commit()
        return row.status


def _alive(session: Session, name: str) -> bool:
    from kiln.tables import Worker
    from workers.liveness import is_live

    w = session.get(Worker, name)
    return w is not None and is_live(w)


def run_build(build_id: str, settings: Settings, worker_name: str, *, last_try: bool = False) -> str:
    """Run build ``build_id``; returns its final status. A StorageUnavailable propagates (the task retries it)
    unless ``last_try``: then the build fails, naming the storage error."""
    services = build_services(settings)
    sessions = services.sessions
    with sessions() as s:
        row = s.get(Build, build_id)
        if row is None:
            log.warning("build %s does not exist; message dropped", build_id)
            return "missing"
        if row.status in TERMINAL:
            return row.status
        if row.status == "running" and row.worker and row.worker != worker_name and _alive(s, row.worker):
            log.info("build %s is running on live worker %s; duplicate message dropped", build_id, row.worker)
            return "running"
        if row.cancel_requested:
            s.close()
            _finish(sessions, build_id, "cancelled", reason="cancelled before it started")
            return "cancelled"
        # Claim it atomically: the update matches only the state we read (attempts is the version), so of two
        # workers handed the same build (a redelivered or re-enqueued message) exactly one proceeds.
        if not move_build_if_unchanged(s, row, "running", worker=worker_name):
            s.rollback()
            return "claimed-elsewhere"
        spec_data = row.spec
        s.commit()

    def cancelled() -> bool:
        with sessions() as s2:
            row = s2.get(Build, build_id)
            return row is None or bool(row.cancel_requested)  # a build whose row is gone has nobody to build for

    store = services.store
    builder = Builder(settings, store, sessions, on_event=EventRecorder(sessions, build_id), should_cancel=cancelled)
    try:
        outcome = builder.build(parse_spec(spec_data, settings.roots))
    except BuildCancelled:
        _finish(sessions, build_id, "cancelled", reason="cancelled at a stage boundary; nothing was published")
        return "cancelled"
    except StorageUnavailable as exc:
        if after_storage_error(sessions, build_id, exc, last_try=last_try) == "failed":
            return "failed"
        raise
    except KilnError as exc:
        _finish(sessions, build_id, "failed", error=redact(exc.to_dict(), settings), reason=exc.code)
        return "failed"
    except Exception as exc:  # a bug or a library crash: recorded (the full trace in the worker's log), not retried
        log.exception("build %s crashed", build_id)
        _finish(sessions, build_id, "failed", error=redact({"code": "internal_error",
                                                            "message": f"{type(exc).__name__}: {exc}"}, settings),
                reason="internal_error")
        return "failed"
    stages = [{"name": s.name, "status": s.status, "seconds": round(s.seconds, 3)} for s in outcome.stages]
    assert [s["name"] for s in stages] == list(STAGES)
    if outcome.status == "succeeded":
        from workers.replication import replicate

        assert outcome.digest is not None  # a succeeded build has its engine
        replicate(settings, store, sessions, build_id, outcome.digest)  # KILN_REPLICATE_TO; never fails the build
        _finish(sessions, build_id, "succeeded", digest=outcome.digest, build_key=outcome.build_key, stages=stages,
                stage=None)
    else:
        _finish(sessions, build_id, "failed", digest=outcome.digest, build_key=outcome.build_key, stages=stages,
                reason="validation", error={"code": "validation_failed",
                                            "message": "the engine failed validation; stored as rejected"})
    return outcome.status

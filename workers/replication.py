"""``KILN_REPLICATE_TO``: after a build succeeds, its engine is pushed with its referrers to that registry
(``host[:port][/prefix]``: the engine lands at ``<prefix>/<repository>:<tag>``, by digest and tagged), before the
build is marked succeeded, so whoever waits on the build finds it there. A push that fails is recorded in the
build's events (``replication_failed``, the error as ``kiln push`` would print it) and does not fail the build:
the engine is published in Kiln either way, and ``kiln push`` copies it later (what the registry has is not sent
again). A push that succeeds is recorded as ``replicated`` (the reference, the referrers' path)."""

from __future__ import annotations

import logging

from sqlalchemy.orm import Session, sessionmaker

from artifacts.interfaces import BlobStore
from artifacts.push import parse_destination
from builder.replicate import push_engine
from kiln.errors import ArtifactUnknown, KilnError
from kiln.tables import Artifact, BuildEvent
from kiln.settings import Settings

log = logging.getLogger(__name__)


def replication_destination(replicate_to: str, repository: str, tag: str) -> str:
    """``host[:port][/prefix]`` and an engine's repository and tag → ``host[:port][/prefix]/repository:tag``
    (checked: :class:`~kiln.errors.NameInvalid` naming ``replicate_to``)."""
    dest = f"{replicate_to.strip().rstrip('/')}/{repository}:{tag}"
    parse_destination(dest, field="replicate_to")
    return dest


def replicate(settings: Settings, store: BlobStore, sessions: sessionmaker[Session], build_id: str,
              digest: str) -> dict | None:
    """Push engine ``digest`` to ``KILN_REPLICATE_TO`` and record the outcome as an event of ``build_id``; the
    event's data, or None when replication is off. Never raises for a failed push."""
    if not settings.replicate_to:
        return None
    from workers.runner import redact

    dest = None
    try:
        with sessions() as s:
            row = s.get(Artifact, digest)
            if row is None:  # revoked and collected before its push began
                raise ArtifactUnknown(f"engine {digest} is no longer in this registry", field="digest",
                                      fix="nothing to replicate")
            repository, tag = row.repository, row.tag
        dest = replication_destination(settings.replicate_to, repository, tag)
        result = push_engine(store, sessions, digest, dest, insecure=settings.replicate_insecure,
                             auths=settings.registry_auths)
        kind, data = "replicated", {"dest": dest, "reference": result.reference,
                                    "referrers": len(result.referrers), "referrers_api": result.referrers_api,
                                    "blobs_sent": result.blobs_sent}
    except KilnError as exc:
        kind, data = "replication_failed", {"dest": dest or settings.replicate_to,
                                            "error": redact(exc.to_dict(), settings)}
    except Exception as exc:  # a bug or a library error: recorded like the rest, the trace in the worker's log
        log.exception("replicating %s to %s crashed", digest, dest or settings.replicate_to)
        kind, data = "replication_failed", {"dest": dest or settings.replicate_to, "error": redact(
            {"code": "internal_error", "message": f"{type(exc).__name__}: {exc}"}, settings)}
    if kind == "replication_failed":
        log.warning("build %s: replicating %s to %s failed: %s", build_id, digest, data["dest"], data["error"])
    with sessions() as s:
        s.add(BuildEvent(build_id=build_id, kind=kind, data=data))
        s.commit()
    return data

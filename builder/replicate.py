"""Copying a published engine, with its referrers, to a standard registry: ``kiln push`` (api/cli_push.py). The
engine's index row says which referrers it has (provenance, validation report, signature, signed provenance);
:mod:`artifacts.push` sends them. A push that succeeds is recorded (:class:`~kiln.tables.Replica`): admission then
judges ``host/repository@digest`` as this engine, and ``kiln resolve --registry`` prints it."""

from __future__ import annotations

from collections.abc import Callable

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from artifacts.interfaces import BlobStore
from artifacts.push import PushResult, Registry, open_registry, parse_destination, push_image, registry_host
from kiln.errors import EngineRevoked, ValidationFailed
from kiln.tables import Artifact, Referrer, Replica, utcnow


def referrers_of(session: Session, digest: str) -> list[str]:
    """The digests of the referrers whose subject is ``digest``, in the order they were published."""
    return list(session.scalars(select(Referrer.digest).where(Referrer.subject == digest)
                                .order_by(Referrer.created_at, Referrer.digest)))


def record_replica(session: Session, result: PushResult, model: str) -> Replica:
    """Record (or refresh) that ``result``'s engine is at its destination, standing for the Kiln repository
    ``model``; the caller commits."""
    dest = result.destination
    key = (result.digest, registry_host(dest.host), dest.repository)
    row = session.get(Replica, key)
    if row is None:
        row = Replica(digest=key[0], host=key[1], repository=key[2], model=model)
        session.add(row)
    row.model, row.tag, row.pushed_at = model, dest.tag or row.tag, utcnow()
    return row


def push_engine(store: BlobStore, sessions: sessionmaker[Session], digest: str, dest: str, *,
                insecure: bool = False, auths: str | None = None, registry: Registry | None = None, on_step: Callable[[str], None] | None = None,
                model: str | None = None) -> PushResult:
    """Push the engine ``digest`` and all its referrers to ``dest`` (``host[:port]/repository[:tag]``), then record
    the replica (:func:`record_replica`; ``model``: the Kiln repository it stands for, default the one that
    published it). A revoked engine (:class:`EngineRevoked`) or a rejected one (:class:`ValidationFailed`) is
    refused: the target is the registry a cluster pulls from. ``auths``: ``KILN_REGISTRY_AUTHS``, whose entry for
    the destination's host (else the docker config's) is the only credential sent there
    (:func:`~artifacts.push.credentials_for`)."""
    target = parse_destination(dest)
    with sessions() as session:
        row = session.get(Artifact, digest)
        if row is None:
            from kiln.errors import ArtifactUnknown

            raise ArtifactUnknown(f"no engine {digest} in this registry", field="digest")
        if row.status == "revoked":
            raise EngineRevoked(f"engine {digest} is revoked ({row.status_reason or 'no reason given'}); "
                                "it is not pushed", field="digest", fix="push a fresh engine")
        if row.status == "rejected":
            raise ValidationFailed(f"engine {digest} failed validation ({row.status_reason or 'rejected'}); "
                                   "it is not pushed", field="digest", fix="push a validated engine")
        refs = referrers_of(session, digest)
        model = model or row.repository
    own = registry is None
    if registry is None:
        registry = open_registry(target.host, insecure=insecure, auths=auths)
    try:
        result = push_image(store, registry, target, digest, refs, on_step=on_step)
    finally:
        if own:
            registry.close()
    with sessions() as session:
        record_replica(session, result, model)
        session.commit()
    return result

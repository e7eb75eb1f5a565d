"""Garbage collection with retention. Never deletes what a tag, a fresh engine (anything resolve may return)
or an active build needs. Index rows go first, then the blobs no kept manifest reaches, so a reader never
finds an index row whose blobs are gone."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from artifacts.interfaces import BlobStore
from artifacts.oci import read_manifest
from kiln.errors import BlobUnknown
from kiln.models import Artifact, Build, Referrer, Tag


@dataclass
class GCPlan:
    artifacts: list[str] = field(default_factory=list)
    referrers: list[str] = field(default_factory=list)
    blobs: list[str] = field(default_factory=list)
    bytes: int = 0
    deferred: str | None = None

    def to_dict(self) -> dict:
        return {"artifacts": self.artifacts, "referrers": self.referrers, "blobs": self.blobs, "bytes": self.bytes,
                "deferred": self.deferred}


def _aware(ts: datetime) -> datetime:
    return ts if ts.tzinfo else ts.replace(tzinfo=timezone.utc)


def _reachable(store: BlobStore, manifest_digest: str) -> set[str]:
    try:
        m = read_manifest(store, manifest_digest)
    except BlobUnknown:
        return {manifest_digest}
    return {manifest_digest, m["config"]["digest"], *(layer["digest"] for layer in m.get("layers", []))}


def plan_gc(session: Session, store: BlobStore, *, keep: int = 2, older_than: timedelta = timedelta(days=7)) -> GCPlan:
    now = datetime.now(timezone.utc)
    tagged = {t.digest for t in session.scalars(select(Tag))}
    rows = session.scalars(select(Artifact).order_by(Artifact.created_at.desc())).all()
    seen: dict[tuple[str, str], int] = {}
    plan, kept = GCPlan(), []
    for a in rows:
        slot = (a.repository, a.tag)
        seen[slot] = seen.get(slot, 0) + 1
        removable = (a.status in ("stale", "revoked", "rejected") and a.digest not in tagged
                     and seen[slot] > keep and _aware(a.created_at) < now - older_than)
        (plan.artifacts if removable else kept).append(a.digest)
    gone = set(plan.artifacts)
    refs = session.scalars(select(Referrer)).all()
    plan.referrers = [r.digest for r in refs if r.subject in gone]
    needed: set[str] = set()
    for digest in kept:
        needed |= _reachable(store, digest)
    for r in refs:
        if r.subject not in gone:
            needed |= _reachable(store, r.digest)
    active = session.scalars(select(Build).where(Build.status.in_(("queued", "running")))).first()
    if active is not None:
        # a running publish may be relying on a blob that already exists; sweep blobs when it is done
        plan.deferred = f"blob sweep deferred: build {active.id} is {active.status}"
        return plan
    for digest in store.list_digests():
        if digest not in needed:
            plan.blobs.append(digest)
            plan.bytes += store.stat(digest).size
    return plan


def run_gc(sessions: sessionmaker[Session], store: BlobStore, *, dry_run: bool, keep: int = 2,
           older_than: timedelta = timedelta(days=7)) -> GCPlan:
    with sessions() as s:
        plan = plan_gc(s, store, keep=keep, older_than=older_than)
        if dry_run:
            return plan
        for d in plan.referrers:
            s.delete(s.get(Referrer, d))
        for d in plan.artifacts:
            s.delete(s.get(Artifact, d))
        s.commit()
    for d in plan.blobs:
        store.delete(d)
    return plan

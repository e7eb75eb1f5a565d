"""Garbage collection with retention. Never deletes what a tag, a fresh engine (anything resolve may return)
or a running build needs. Index rows go first, then the blobs no kept manifest, kept stage output or live lease
reaches, so a reader never finds an index row whose blobs are gone.

Safe while builds run: a writer claims every digest it stores before the store may dedupe against it, and GC
claims each blob before deleting it (``builder/leases.py``); a build's claims bind the plans made before it ended,
and a plan older than the grace period is not swept.
Stage outputs (``stage_outputs`` rows: quantized checkpoints, kernels and compiled engines in the store) are kept
while a fresh or tagged engine was built from them or a build used them within the grace period."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from artifacts.interfaces import BlobStore
from artifacts.oci import read_manifest
from builder.leases import absolve, condemn, leased_digests, purge_expired
from kiln.errors import BlobUnknown
from kiln.tables import Artifact, Referrer, StageOutput, Tag

DEFAULT_GRACE = timedelta(hours=1)


@dataclass
class GCPlan:
    artifacts: list[str] = field(default_factory=list)
    referrers: list[str] = field(default_factory=list)
    stage_outputs: list[str] = field(default_factory=list)  # stage keys whose stored output goes
    blobs: list[str] = field(default_factory=list)
    bytes: int = 0
    leased: list[str] = field(default_factory=list)  # unreferenced blobs kept because a build holds them
    deferred: str | None = None
    sizes: dict[str, int] = field(default_factory=dict, repr=False)
    made_at: float = field(default_factory=time.monotonic, repr=False)
    started: datetime = field(default_factory=lambda: datetime.now(timezone.utc), repr=False)  # before any read

    def to_dict(self) -> dict:
        return {"artifacts": self.artifacts, "referrers": self.referrers, "stage_outputs": self.stage_outputs,
                "blobs": self.blobs, "bytes": self.bytes, "leased": self.leased, "deferred": self.deferred}


def _aware(ts: datetime) -> datetime:
    return ts if ts.tzinfo else ts.replace(tzinfo=timezone.utc)


def _reachable(store: BlobStore, manifest_digest: str) -> set[str]:
    try:
        m = read_manifest(store, manifest_digest)
    except BlobUnknown:
        return {manifest_digest}
    return {manifest_digest, m["config"]["digest"], *(layer["digest"] for layer in m.get("layers", []))}


def missing_blobs(session: Session, store: BlobStore) -> list[tuple[str, str]]:
    """(digest, who needs it) for every blob an index row, referrer or stage output names that the store lacks:
    what GC must never cause (``kiln fsck`` reports them)."""
    present = set(store.list_digests())
    needs: list[tuple[str, str]] = []
    for a in session.scalars(select(Artifact)):
        needs += [(d, f"engine {a.digest}") for d in sorted(_reachable(store, a.digest))]
    for r in session.scalars(select(Referrer)):
        needs += [(d, f"referrer {r.digest} of {r.subject}") for d in sorted(_reachable(store, r.digest))]
    for out in session.scalars(select(StageOutput)):
        needs.append((out.digest, f"{out.stage} output {out.key}"))
    return [(d, who) for d, who in needs if d not in present]


def plan_gc(session: Session, store: BlobStore, *, keep: int = 2, older_than: timedelta = timedelta(days=7),
            grace: timedelta = DEFAULT_GRACE) -> GCPlan:
    plan = GCPlan()
    now = plan.started
    tagged = {t.digest for t in session.scalars(select(Tag))}
    rows = session.scalars(select(Artifact).order_by(Artifact.created_at.desc())).all()
    seen: dict[tuple[str, str], int] = {}
    kept: list[Artifact] = []
    for a in rows:
        slot = (a.repository, a.tag)
        seen[slot] = seen.get(slot, 0) + 1
        removable = (a.status in ("stale", "revoked", "rejected") and a.digest not in tagged
                     and seen[slot] > keep and _aware(a.created_at) < now - older_than)
        if removable:
            plan.artifacts.append(a.digest)
        else:
            kept.append(a)
    gone = set(plan.artifacts)
    refs = session.scalars(select(Referrer)).all()
    plan.referrers = [r.digest for r in refs if r.subject in gone]
    needed: set[str] = set()
    for a in kept:
        needed |= _reachable(store, a.digest)
    for r in refs:
        if r.subject not in gone:
            needed |= _reachable(store, r.digest)
    # stage outputs a servable engine was built from (a profile-only rebuild reuses them), or recently used
    wanted = {(a.provenance or {}).get(k) for a in kept if a.status == "fresh" or a.digest in tagged
              for k in ("quantize_key", "kernel_key", "compile_key", "reference_key")}
    for out in session.scalars(select(StageOutput)):
        if out.key in wanted or _aware(out.last_used_at) > now - grace:
            needed.add(out.digest)
        else:
            plan.stage_outputs.append(out.key)
    held = leased_digests(session, plan.started)
    for digest in store.list_digests():
        if digest in needed:
            continue
        if digest in held:
            plan.leased.append(digest)
            continue
        plan.blobs.append(digest)
        plan.sizes[digest] = store.stat(digest).size
    plan.bytes = sum(plan.sizes.values())
    return plan


def run_gc(sessions: sessionmaker[Session], store: BlobStore, *, dry_run: bool, keep: int = 2,
           older_than: timedelta = timedelta(days=7), grace: timedelta = DEFAULT_GRACE) -> GCPlan:
    with sessions() as s:
        plan = plan_gc(s, store, keep=keep, older_than=older_than, grace=grace)
        if dry_run:
            return plan
        for d in plan.referrers:
            s.delete(s.get(Referrer, d))
        for d in plan.artifacts:
            s.delete(s.get(Artifact, d))
        for k in plan.stage_outputs:
            s.delete(s.get(StageOutput, k))
        s.commit()
    sweep(sessions, store, plan, grace=grace)
    return plan


def sweep(sessions: sessionmaker[Session], store: BlobStore, plan: GCPlan, *, grace: timedelta = DEFAULT_GRACE) -> None:
    """Delete the plan's blobs, each claimed first; those a build holds are kept (moved to ``plan.leased``)."""
    if time.monotonic() - plan.made_at > grace.total_seconds():
        # a writer's lease may have lapsed since this plan listed its references: plan again instead
        plan.deferred = f"blob sweep skipped: the plan is older than the {grace} grace period; run gc again"
        plan.blobs, plan.bytes = [], 0
        return
    purge_expired(sessions)
    holder = f"gc-{uuid.uuid4().hex}"
    swept = []
    for digest in plan.blobs:
        if not condemn(sessions, digest, holder, plan.started):
            plan.leased.append(digest)
            continue
        try:
            store.delete(digest)
        finally:
            absolve(sessions, digest, holder)
        swept.append(digest)
    plan.blobs = swept
    plan.bytes = sum(plan.sizes[d] for d in swept)

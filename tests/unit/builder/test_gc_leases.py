"""GC while builds publish: a publish that dedupes against a blob GC planned to sweep keeps it (blob leases), a
writer that comes second waits for the sweep and uploads afresh, and stage outputs no engine needs are collected.
Deterministic interleavings on a real SQLite database (real migrations) and a real local store, through the
real publish."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from sqlalchemy import select

from artifacts.local import LocalBlobStore
from artifacts.oci import EMPTY_DESCRIPTOR, read_manifest
from builder.gc import missing_blobs, plan_gc, run_gc, sweep
from builder import leases as leases_module
from builder.leases import BlobLeases, LeasedStore, absolve, condemn
from builder.publish import publish
from kiln import db
from kiln.tables import Artifact, BlobLease, Referrer, StageOutput, utcnow
from kiln.spec import parse_spec
from tests.conftest import REPO, TINY


@pytest.fixture
def sessions(tmp_path):
    url = f"sqlite:///{tmp_path / 'kiln.db'}"
    db.upgrade(url)
    return db.session_factory(url)


@pytest.fixture
def store(tmp_path):
    return LocalBlobStore(tmp_path / "store")


@pytest.fixture
def engine_dir(tmp_path):
    d = tmp_path / "engine"
    d.mkdir()
    (d / "model.bin").write_bytes(bytes(range(256)) * 64)
    (d / "engine.json").write_text('{"format": "test"}')
    return d


SPEC = parse_spec({"checkpoint": str(TINY), "precision": "fp8", "backend": "checkpoint"}, [REPO])


def publish_engine(store, sessions, engine_dir, n: int, *, passed: bool = True, extra: dict | None = None):
    provenance = {"created": f"2026-12-01T00:00:{n:02d}Z", "checkpoint": {"ref": str(TINY), "digest": "sha256:" + "c" * 64,
                                                                         "revision": None},
                  "toolchain": {}, "build_key": f"sha256:{n:064x}", **(extra or {})}
    return publish(store, sessions, engine_dir, spec=SPEC, build_key=f"sha256:{n:064x}", provenance=provenance,
                   validation={"passed": passed})


def reachable(store, digest: str) -> set[str]:
    m = read_manifest(store, digest)
    return {digest, m["config"]["digest"], *(layer["digest"] for layer in m["layers"])}


def make_collectable(sessions, digest: str) -> None:
    with sessions() as s:
        row = s.get(Artifact, digest)
        row.status, row.created_at = "rejected", utcnow() - timedelta(days=30)
        s.commit()


def race(store, sessions, engine_dir, writer_store):
    """GC plans while engine 1's blobs are unreferenced; engine 2 (same files: same layer) is then published
    through ``writer_store``; then GC sweeps its plan."""
    first = publish_engine(store, sessions, engine_dir, 1, passed=False)
    make_collectable(sessions, first.digest)
    layer = read_manifest(store, first.digest)["layers"][0]["digest"]
    with sessions() as s:
        plan = plan_gc(s, store, keep=0, older_than=timedelta(0))
        for d in plan.referrers:
            s.delete(s.get(Referrer, d))
        s.delete(s.get(Artifact, first.digest))
        s.commit()
    assert first.digest in plan.artifacts and layer in plan.blobs  # the layer is doomed by the plan
    second = publish_engine(writer_store, sessions, engine_dir, 2)  # dedupes against the doomed layer
    assert read_manifest(store, second.digest)["layers"][0]["digest"] == layer
    sweep(sessions, store, plan)
    return plan, second, layer


def test_a_publish_that_dedupes_against_a_blob_gc_planned_to_sweep_keeps_it(store, sessions, engine_dir):
    leases = BlobLeases(sessions, ttl_s=3600, grace_s=3600)
    plan, second, layer = race(store, sessions, engine_dir, LeasedStore(store, leases))
    assert layer in plan.leased and layer not in plan.blobs
    assert all(store.exists(d) for d in reachable(store, second.digest))
    assert first_manifest_gone(plan, store)
    with sessions() as s:
        assert missing_blobs(s, store) == []
    leases.release()  # the build ended: its references are committed; a GC planned from now on sees them
    later = run_gc(sessions, store, dry_run=False, keep=0, older_than=timedelta(0))
    assert layer not in later.blobs and all(store.exists(d) for d in reachable(store, second.digest))


def first_manifest_gone(plan, store) -> bool:
    return all(not store.exists(d) for d in plan.blobs) and bool(plan.blobs)


def test_without_leases_the_same_interleaving_breaks_the_engine(store, sessions, engine_dir):
    """The control: the race is real. A writer that does not lease loses its layer to the sweep."""
    plan, second, layer = race(store, sessions, engine_dir, store)
    assert layer in plan.blobs and not store.exists(layer)
    with sessions() as s:  # and fsck's check says so (the referrers' shared empty config went too)
        missing = missing_blobs(s, store)
    assert (layer, f"engine {second.digest}") in missing and {d for d, _ in missing} == {layer, EMPTY_DESCRIPTOR["digest"]}


def test_a_writer_that_comes_second_waits_for_the_sweep_and_uploads_afresh(store, sessions):
    blob = store.put_bytes(b"shared bytes")
    assert condemn(sessions, blob.digest, "gc-test", utcnow())  # GC claimed it first: nobody holds it
    leases = BlobLeases(sessions, ttl_s=3600, grace_s=3600)
    writer = LeasedStore(store, leases)
    done = threading.Event()
    thread = threading.Thread(target=lambda: (writer.put_bytes(b"shared bytes"), done.set()))
    thread.start()
    assert not done.wait(0.5)  # it does not rely on the blob while GC holds it
    store.delete(blob.digest)
    absolve(sessions, blob.digest, "gc-test")
    thread.join(10)
    assert done.is_set() and store.get_bytes(blob.digest) == b"shared bytes"  # uploaded again, not assumed
    with sessions() as s:
        assert s.get(BlobLease, (blob.digest, leases.holder)).purpose == "use"


def test_gc_keeps_a_blob_a_writer_holds_and_a_plan_older_than_the_grace_period_sweeps_nothing(store, sessions):
    orphan = store.put_bytes(b"uploaded, not yet referenced")
    leases = BlobLeases(sessions, ttl_s=3600, grace_s=3600)
    leases.acquire(orphan.digest)
    plan = run_gc(sessions, store, dry_run=False)
    assert orphan.digest in plan.leased and store.exists(orphan.digest)
    assert not condemn(sessions, orphan.digest, "gc-test", utcnow())  # and a sweep claim is withdrawn at once
    with sessions() as s:
        assert s.scalars(select(BlobLease).where(BlobLease.purpose == "sweep")).first() is None

    leases.release()  # its build ended having referenced nothing
    soon = run_gc(sessions, store, dry_run=False)  # within the clock margin: still counted as before the release
    assert orphan.digest in soon.leased and store.exists(orphan.digest)
    leases_module.CLOCK_MARGIN = timedelta(0)  # (restored by the fixture) a GC planned after the release takes it
    later = run_gc(sessions, store, dry_run=False)
    assert orphan.digest in later.blobs and not store.exists(orphan.digest)

    stray = store.put_bytes(b"nobody's")
    with sessions() as s:
        plan = plan_gc(s, store)
    assert stray.digest in plan.blobs
    plan.made_at -= 2 * 3600  # the plan took longer than the grace period: a writer's lease may have lapsed since
    sweep(sessions, store, plan, grace=timedelta(hours=1))
    assert plan.blobs == [] and "grace period" in plan.deferred and store.exists(stray.digest)


@pytest.fixture(autouse=True)
def _clock_margin():
    saved = leases_module.CLOCK_MARGIN
    yield
    leases_module.CLOCK_MARGIN = saved


def test_a_released_lease_binds_the_plans_made_before_its_build_ended_and_no_later_one(store, sessions):
    leases_module.CLOCK_MARGIN = timedelta(0)
    blob = store.put_bytes(b"relied on by a build that ended after the plan")
    with sessions() as s:
        before = plan_gc(s, store)
    assert blob.digest in before.blobs  # planned while nobody held it
    leases = BlobLeases(sessions, ttl_s=3600, grace_s=3600)
    leases.acquire(blob.digest)  # a build dedupes against it, records its references, ends
    leases.release()
    sweep(sessions, store, before)  # this plan's references predate that build's: it must not sweep the blob
    assert blob.digest in before.leased and store.exists(blob.digest)
    with sessions() as s:
        after = plan_gc(s, store)
    assert blob.digest in after.blobs  # a plan made after the build ended sees its references (none here)


def test_stage_outputs_no_engine_needs_are_collected_after_the_grace_period(store, sessions, engine_dir):
    old, recent, wanted = (store.put_bytes(f"stage output {n}".encode()) for n in range(3))
    keys = {name: f"sha256:{c * 64}" for name, c in (("old", "1"), ("recent", "2"), ("wanted", "3"))}
    with sessions() as s:
        long_ago = utcnow() - timedelta(days=2)
        s.add_all([StageOutput(key=keys["old"], stage="quantize", digest=old.digest, size=old.size,
                               created_at=long_ago, last_used_at=long_ago),
                   StageOutput(key=keys["recent"], stage="compile", digest=recent.digest, size=recent.size,
                               created_at=long_ago, last_used_at=utcnow()),
                   StageOutput(key=keys["wanted"], stage="quantize", digest=wanted.digest, size=wanted.size,
                               created_at=long_ago, last_used_at=long_ago)])
        s.commit()
    fresh = publish_engine(store, sessions, engine_dir, 3, extra={"quantize_key": keys["wanted"]})
    plan = run_gc(sessions, store, dry_run=False, keep=0, older_than=timedelta(0))
    assert plan.stage_outputs == [keys["old"]] and old.digest in plan.blobs and not store.exists(old.digest)
    assert store.exists(recent.digest) and store.exists(wanted.digest)
    with sessions() as s:
        assert {r.key for r in s.scalars(select(StageOutput))} == {keys["recent"], keys["wanted"]}
    assert all(store.exists(d) for d in reachable(store, fresh.digest))

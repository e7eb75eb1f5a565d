"""GC retention over engines published by the real publish into a real local store and SQLite index: what is
kept (tagged, fresh, the newest ``keep`` of a slot, young ones, blobs any kept manifest reaches) and what goes."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest

from artifacts.factory import open_store
from artifacts.oci import read_manifest
from builder.gc import plan_gc, run_gc
from builder.publish import publish
from kiln import db
from kiln.tables import Artifact, Referrer
from kiln.settings import Settings
from kiln.spec import parse_spec
from kiln.states import move_artifact

N = iter(range(10**6))


@pytest.fixture
def env(tmp_path):
    settings = Settings(home=tmp_path / "home")
    db.upgrade(settings.db_url)
    return open_store(settings.store), db.session_factory(settings.db_url), tmp_path


def engine(env, *, passed=True, profile="latency", keys: dict | None = None) -> Artifact:
    store, sessions, tmp = env
    n = next(N)
    root = tmp / f"e{n}"
    root.mkdir()
    (root / "config.json").write_text(json.dumps({"n": n}))
    (root / "rank0.bin").write_bytes(str(n).encode() * 500)
    spec = parse_spec({"checkpoint": f"hf://acme/tiny@{'a' * 40}", "model_name": "acme/tiny", "precision": "fp8",
                       "profile": profile, "backend": "checkpoint"}, [])
    prov = {"created": "2026-01-01T00:00:00Z", "toolchain": {}, "checkpoint": {"ref": spec.checkpoint,
            "digest": "sha256:" + "c" * 64, "revision": "a" * 40}, **(keys or {})}
    return publish(store, sessions, root, spec=spec, build_key=f"sha256:{n:064x}", provenance=prov,
                   validation={"passed": passed})


def age(sessions, digest, days):
    with sessions() as s:
        a = s.get(Artifact, digest)
        a.created_at = a.created_at - timedelta(days=days)
        s.commit()


def stale(sessions, digest):
    with sessions() as s:
        move_artifact(s, s.get(Artifact, digest), "stale", reason="head moved")
        s.commit()


def blobs_of(store, digest) -> set[str]:
    m = read_manifest(store, digest)
    return {digest, m["config"]["digest"], *(layer["digest"] for layer in m["layers"])}


def test_keeps_fresh_tagged_young_and_the_newest_of_a_slot(env):
    store, sessions, _ = env
    old = [engine(env) for _ in range(4)]  # the last one published holds the tag
    for i, a in enumerate(old):
        age(sessions, a.digest, 30 - i)
    for a in old[:3]:
        stale(sessions, a.digest)
    rejected_young = engine(env, passed=False)
    plan = plan_gc(sessions(), store, keep=2, older_than=timedelta(days=7))
    # slot order, newest first: young rejected, old[3] (fresh, tagged) are the two kept; old[2..0] are stale
    assert set(plan.artifacts) == {old[2].digest, old[1].digest, old[0].digest}
    assert plan.deferred is None
    with sessions() as s:
        refs = [r for r in s.query(Referrer) if r.subject in plan.artifacts]
    assert set(plan.referrers) == {r.digest for r in refs} and {r.subject for r in refs} == set(plan.artifacts)
    kept = blobs_of(store, old[3].digest) | blobs_of(store, rejected_young.digest)
    assert not kept & set(plan.blobs)
    assert blobs_of(store, old[0].digest) <= set(plan.blobs) and plan.bytes == sum(store.stat(d).size for d in plan.blobs)
    assert plan.to_dict()["artifacts"] == plan.artifacts


def test_nothing_goes_while_young_or_within_keep(env):
    store, sessions, _ = env
    a, b = engine(env), engine(env)
    stale(sessions, a.digest)
    assert plan_gc(sessions(), store, keep=2).artifacts == []  # within keep
    age(sessions, a.digest, 1)
    assert plan_gc(sessions(), store, keep=1, older_than=timedelta(days=7)).artifacts == []  # young
    age(sessions, a.digest, 30)
    assert plan_gc(sessions(), store, keep=1, older_than=timedelta(days=7)).artifacts == [a.digest]
    age(sessions, b.digest, 30)
    assert plan_gc(sessions(), store, keep=0, older_than=timedelta(days=7)).artifacts == [a.digest]  # b is fresh


def test_run_gc_deletes_rows_then_blobs_and_dry_run_deletes_nothing(env):
    store, sessions, _ = env
    a, b = engine(env), engine(env)
    stale(sessions, a.digest)
    age(sessions, a.digest, 30)
    before = set(store.list_digests())
    dry = run_gc(sessions, store, dry_run=True, keep=1)
    assert dry.artifacts == [a.digest] and set(store.list_digests()) == before
    done = run_gc(sessions, store, dry_run=False, keep=1)
    assert done.blobs == dry.blobs and done.blobs
    with sessions() as s:
        assert s.get(Artifact, a.digest) is None and s.get(Artifact, b.digest) is not None
        assert not [r for r in s.query(Referrer) if r.subject == a.digest]
    assert set(store.list_digests()) == before - set(done.blobs)
    assert blobs_of(store, b.digest) <= set(store.list_digests())




def test_the_keep_count_is_per_slot_revoked_engines_go_and_the_report_names_everything(env):
    store, sessions, _ = env
    slot = [engine(env) for _ in range(5)]  # latency: the last one is fresh and tagged
    other = [engine(env, profile="throughput") for _ in range(2)]  # another slot, within its keep
    for i, a in enumerate(slot + other):
        age(sessions, a.digest, 30 - i)
    with sessions() as s:
        move_artifact(s, s.get(Artifact, slot[0].digest), "revoked", reason="bad")
        s.commit()
    for a in slot[1:4] + other[:1]:
        stale(sessions, a.digest)
    plan = plan_gc(sessions(), store, keep=3, older_than=timedelta(days=7))
    # latency, newest first: slot[4], slot[3], slot[2] are the three kept; slot[1] (stale) and slot[0] (revoked) go
    assert set(plan.artifacts) == {slot[1].digest, slot[0].digest}
    assert plan.to_dict() == {"artifacts": plan.artifacts, "referrers": plan.referrers,
                              "stage_outputs": plan.stage_outputs, "blobs": plan.blobs, "bytes": plan.bytes,
                              "leased": plan.leased, "deferred": None}
    assert plan.bytes == sum(store.stat(d).size for d in plan.blobs) > 0
    # run_gc passes its retention on: nothing is older than 40 days
    assert run_gc(sessions, store, dry_run=True, keep=3, older_than=timedelta(days=40)).artifacts == []


def test_a_sweep_reports_the_bytes_it_freed_and_a_plan_older_than_the_grace_period_sweeps_nothing(env):
    store, sessions, _ = env
    a, _b = engine(env), engine(env)
    stale(sessions, a.digest)
    age(sessions, a.digest, 30)
    late = run_gc(sessions, store, dry_run=False, keep=1, grace=timedelta(0))  # any plan is older than 0 s
    assert (late.blobs, late.bytes) == ([], 0) and "older than the 0:00:00 grace period" in late.deferred
    done = run_gc(sessions, store, dry_run=False, keep=1)
    assert done.blobs and done.bytes == sum(done.sizes[d] for d in done.blobs) and done.deferred is None


def test_fsck_names_every_missing_blob_of_every_engine_and_stage_output(env):
    from builder.gc import missing_blobs
    from kiln.tables import StageOutput

    store, sessions, _ = env
    a, b = engine(env), engine(env)
    gone = [read_manifest(store, a.digest)["config"]["digest"], read_manifest(store, b.digest)["config"]["digest"]]
    lost = "sha256:" + "e" * 64
    with sessions() as s:
        s.add(StageOutput(key="sha256:" + "f" * 64, stage="quantize", digest=lost, size=1))
        s.commit()
    for d in gone:
        store.delete(d)
    with sessions() as s:
        missing = missing_blobs(s, store)
    assert sorted(missing) == sorted([(gone[0], f"engine {a.digest}"), (gone[1], f"engine {b.digest}"),
                                      (lost, f"quantize output sha256:{'f' * 64}")])


def test_stage_outputs_a_fresh_or_tagged_engine_was_built_from_are_kept_the_others_go_after_the_grace_period(env):
    from datetime import datetime, timezone

    from kiln.tables import StageOutput

    store, sessions, _ = env
    k = {name: f"sha256:{i:064x}" for i, name in enumerate(["q_old", "c_old", "q_new", "c_new", "q_stale", "c_stale"])}
    old = engine(env, keys={"quantize_key": k["q_old"], "compile_key": k["c_old"]})
    engine(env, keys={"quantize_key": k["q_new"], "compile_key": k["c_new"]})  # takes the tag: old is fresh, untagged
    gone = engine(env, profile="throughput", keys={"quantize_key": k["q_stale"], "compile_key": k["c_stale"]})
    stale(sessions, gone.digest)  # stale, untagged, but within keep: kept, its stage outputs not wanted
    with sessions() as s:
        assert s.get(Artifact, old.digest).status == "fresh"
        used = datetime.now(timezone.utc) - timedelta(hours=2)
        for name, key in k.items():
            s.add(StageOutput(key=key, stage=name[0] == "q" and "quantize" or "compile", digest=key, size=1,
                              last_used_at=used))
        s.commit()
    plan = plan_gc(sessions(), store, keep=2, older_than=timedelta(days=7))
    assert sorted(plan.stage_outputs) == sorted([k["q_stale"], k["c_stale"]])
    # run_gc passes the grace period on: used two hours ago is recent within a day
    assert run_gc(sessions, store, dry_run=True, keep=2, grace=timedelta(days=1)).stage_outputs == []

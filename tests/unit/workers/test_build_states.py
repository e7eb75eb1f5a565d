"""Build coordination on a real SQLite index with the real migrations; only the broker is faked (``Broker``
records what would be enqueued, and checks that the build row was committed first). Submit and dedupe across
toolchains, routing, the runner's transitions, cancel then resubmit, the reconciler, retries exhausted, and the
state machines of kiln/states.py."""

from __future__ import annotations

import json
import shutil
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from api.app import create_app
from builder.pipeline import Builder
from builder.publish import publish
from kiln import db
from kiln.errors import InvalidTransition, StorageUnavailable
from kiln.digests import sha256_json
from kiln.keys import build_key
from kiln.tables import Artifact, Build, BuildEvent, Tag, TagEvent, Worker
from kiln.settings import Settings
from kiln.spec import parse_spec
from kiln.states import move_artifact, move_build, move_build_if_unchanged, point_tag, request_cancel
from workers import runner
from workers.reconcile import reclaim_orphans, requeue_lost
from workers.submit import choose_queue, submit

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "examples" / "tiny-llama"
CPU = {"checkpoint": str(TINY), "model_name": "acme/tiny", "precision": "fp8", "target": "cpu",
       "backend": "aot-inductor", "calibration": {"samples": 8, "seq_len": 64}}
TRT = {**CPU, "target": "sm90", "backend": "trtllm-engine"}
TC_OLD = {"tensorrt_llm": "1.2.0", "tensorrt": "10.11.0"}
TC_NEW = {"tensorrt_llm": "1.2.1", "tensorrt": "10.13.3"}


class Broker:
    """The fake broker: remembers messages; a message for a row not yet committed is a bug (enqueue after commit)."""

    def __init__(self, sessions):
        self.sessions, self.sent, self.down = sessions, [], False

    def __call__(self, build_id: str, queue: str) -> None:
        if self.down:
            raise ConnectionError("broker unreachable")
        with self.sessions() as s:
            assert s.get(Build, build_id) is not None, "enqueued before the build row was committed"
        self.sent.append((build_id, queue))


@pytest.fixture
def env(tmp_path):
    settings = Settings(home=tmp_path / "home", checkpoint_roots=f"{REPO}:{tmp_path}")
    db.upgrade(settings.db_url)
    sessions = db.session_factory(settings.db_url)
    return settings, sessions, Broker(sessions)


def spec_of(settings, data):
    return parse_spec(data, settings.roots)


def add_worker(sessions, name, queues, toolchains=None, *, live=True):
    beat = datetime.now(timezone.utc) - (timedelta(0) if live else timedelta(hours=1))
    with sessions() as s:
        s.add(Worker(name=name, queues=queues, capabilities={"queues": queues, "toolchains": toolchains or {}},
                     started_at=beat, last_heartbeat=beat))
        s.commit()


def engine_dir(root: Path, seed: str) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({"seed": seed}))
    (root / "rank0.bin").write_bytes(seed.encode() * 100)
    return root


def publish_for(settings, sessions, spec, key: str, tmp: Path, *, passed=True, revision=None) -> Artifact:
    from artifacts.factory import open_store

    seed = key[-12:] + str(passed)
    prov = {"created": "2026-01-01T00:00:00Z", "toolchain": {}, "checkpoint": {"ref": spec.checkpoint,
            "digest": "sha256:" + "c" * 64, "revision": revision}}
    return publish(open_store(settings.store), sessions, engine_dir(tmp / seed, seed), spec=spec, build_key=key,
                   provenance=prov, validation={"passed": passed})


def prepared(settings, sessions, spec):
    return Builder(settings, None, sessions).prepare(spec, check_environment=False)[0]


def statuses(sessions, build_id):
    with sessions() as s:
        return [e.data["status"] for e in s.scalars(select(BuildEvent).where(
            BuildEvent.build_id == build_id, BuildEvent.kind == "status").order_by(BuildEvent.id))]


def row(sessions, build_id) -> Build:
    with sessions() as s:
        b = s.get(Build, build_id)
        s.expunge(b)
        return b


# -- submit, dedupe, routing ---------------------------------------------------------------------------------
def test_submit_creates_once_then_joins_the_active_build(env):
    settings, sessions, broker = env
    spec = spec_of(settings, CPU)
    first = submit(settings, sessions, spec, broker)
    assert first.outcome == "created" and broker.sent == [(first.build.id, "kiln.aot-inductor.cpu")]
    b = row(sessions, first.build.id)
    assert (b.status, b.request_key) == ("queued", prepared(settings, sessions, spec).request_key)
    # identical requests for one repository share the build: the active key is the request's in that repository
    assert b.active_key == sha256_json({"request": b.request_key, "repository": spec.model_name})
    second = submit(settings, sessions, spec, broker)
    assert second.outcome == "existing-build" and second.build.id == first.build.id
    assert len(broker.sent) == 1
    assert statuses(sessions, first.build.id) == ["queued"]


def test_a_different_spec_is_a_different_build(env):
    settings, sessions, broker = env
    a = submit(settings, sessions, spec_of(settings, CPU), broker)
    b = submit(settings, sessions, spec_of(settings, {**CPU, "profile": "throughput"}), broker)
    assert a.outcome == b.outcome == "created" and a.build.id != b.build.id and len(broker.sent) == 2


def test_submit_answers_from_an_engine_built_with_a_live_workers_toolchain(env, tmp_path):
    settings, sessions, broker = env
    spec = spec_of(settings, TRT)
    p = prepared(settings, sessions, spec)
    queue_new = "kiln.trtllm-engine.sm90.trtllm-1.2.1.trt-10.13.3"
    add_worker(sessions, "gpu-new", ["kiln.trtllm-engine.sm90", queue_new],
               {"kiln.trtllm-engine.sm90": TC_NEW, queue_new: TC_NEW})
    key_old = build_key(p.resolved.digest, spec, TC_OLD, p.gates, p.data)
    key_new = build_key(p.resolved.digest, spec, TC_NEW, p.gates, p.data)
    assert key_old != key_new
    publish_for(settings, sessions, spec, key_old, tmp_path)  # an engine no live worker's toolchain would make
    made = submit(settings, sessions, spec, broker)
    assert made.outcome == "created" and made.build.queue == queue_new
    with sessions() as s:
        request_cancel(s, s.get(Build, made.build.id))
        s.commit()
    engine = publish_for(settings, sessions, spec, key_new, tmp_path)
    found = submit(settings, sessions, spec, broker)
    assert found.outcome == "existing-artifact" and found.artifact.digest == engine.digest
    assert len(broker.sent) == 1


def test_a_matrix_is_answered_by_two_statements_whatever_its_size_each_entry_by_its_own_engine(env, tmp_path):
    """A matrix of existing engines is answered from the database (never a process-local cache) by the same two
    reads as one request: the workers, and the engines with any entry's candidate keys. Each entry gets the engine
    of its own key; an entry whose engine was revoked, and one never built, are created (in order)."""
    from sqlalchemy import event

    from workers.submit import submit_many

    settings, sessions, broker = env
    entries = [{**CPU, "profile": p, "precision": q} for p in ("latency", "balanced", "throughput")
               for q in ("fp8", "nvfp4")]
    specs = [spec_of(settings, e) for e in entries]
    engines = [publish_for(settings, sessions, sp, prepared(settings, sessions, sp).build_key, tmp_path / str(i))
               for i, sp in enumerate(specs[:4])]
    with sessions() as s:
        move_artifact(s, s.get(Artifact, engines[3].digest), "revoked", reason="bad")
        s.commit()
    reads = db.session_factory(settings.db_url)
    seen = []
    engine = reads.kw["bind"]
    listener = lambda *a: seen.append(a[2])  # noqa: E731  (the statement)
    event.listen(engine, "before_cursor_execute", listener)
    try:
        existing = submit_many(settings, sessions, specs[:3], broker, reads=reads)
        lookups = len(seen)
        answers = submit_many(settings, sessions, specs, broker, reads=reads)
    finally:
        event.remove(engine, "before_cursor_execute", listener)
    assert lookups == 2 and all(st.lstrip().upper().startswith("SELECT") for st in seen[:2])
    assert [a.outcome for a in existing] == ["existing-artifact"] * 3
    assert [a.artifact.digest for a in existing] == [e.digest for e in engines[:3]]
    assert [a.outcome for a in answers] == ["existing-artifact"] * 3 + ["created"] * 3
    assert [a.artifact.digest for a in answers[:3]] == [e.digest for e in engines[:3]]
    assert [b for b, _ in broker.sent] == [a.build.id for a in answers[3:]]
    assert len({a.build.id for a in answers[3:]}) == 3


def test_a_revoked_engine_does_not_answer_a_submit(env, tmp_path):
    settings, sessions, broker = env
    spec = spec_of(settings, CPU)
    engine = publish_for(settings, sessions, spec, prepared(settings, sessions, spec).build_key, tmp_path)
    assert submit(settings, sessions, spec, broker).outcome == "existing-artifact"
    with sessions() as s:
        move_artifact(s, s.get(Artifact, engine.digest), "revoked", reason="bad")
        s.commit()
    assert submit(settings, sessions, spec, broker).outcome == "created"


def test_routing_prefers_the_newest_versioned_queue_of_live_workers(env):
    settings, sessions, _ = env
    spec = spec_of(settings, TRT)
    generic = "kiln.trtllm-engine.sm90"
    old, new = f"{generic}.trtllm-1.2.0.trt-10.11.0", f"{generic}.trtllm-1.2.1.trt-10.13.3"
    assert choose_queue([], spec) == generic
    add_worker(sessions, "dead-new", [generic, new], live=False)
    add_worker(sessions, "live-old", [generic, old])
    with sessions() as s:
        workers = s.scalars(select(Worker)).all()
        assert choose_queue(workers, spec) == old  # a dead worker's queue is not chosen while one is live
        s.get(Worker, "live-old").last_heartbeat = datetime.now(timezone.utc) - timedelta(hours=1)
        s.commit()
        assert choose_queue(s.scalars(select(Worker)).all(), spec) == new  # none live: any known
    assert choose_queue([], spec_of(settings, CPU)) == "kiln.aot-inductor.cpu"


def test_a_build_with_no_live_worker_says_so(env):
    settings, sessions, broker = env
    made = submit(settings, sessions, spec_of(settings, TRT), broker)
    assert made.build.queue == "kiln.trtllm-engine.sm90"
    assert row(sessions, made.build.id).reason == ("waiting for a worker that builds trtllm-engine engines for sm90 "
                                                   "(queue kiln.trtllm-engine.sm90); no such worker is live")
    b = row(sessions, made.build.id)
    assert (b.stages, b.attempts, b.cancel_requested) == ([], 0, False)


def test_broker_down_leaves_the_build_queued_with_the_reason(env):
    settings, sessions, broker = env
    broker.down = True
    made = submit(settings, sessions, spec_of(settings, CPU), broker)
    b = row(sessions, made.build.id)
    assert made.outcome == "created" and b.status == "queued"
    assert b.reason == made.build.reason == ("not yet handed to the broker (ConnectionError: broker unreachable); "
                                             "it will be re-enqueued")


# -- cancel then resubmit (through the API) ------------------------------------------------------------------
def test_cancel_then_resubmit_makes_a_new_build(env):
    settings, sessions, broker = env
    client = TestClient(create_app(settings, enqueue=broker))
    r = client.post("/v1/builds", json=CPU)
    assert r.status_code == 202, r.text
    first = r.json()["id"]
    again = client.post("/v1/builds", json=CPU).json()
    assert again["id"] == first
    c = client.post(f"/v1/builds/{first}/cancel")
    assert c.status_code == 200 and c.json()["status"] == "cancelled"
    b = row(sessions, first)
    assert (b.status, b.active_key, b.cancel_requested, b.reason) == ("cancelled", None, True, "cancelled while queued")
    assert b.finished_at is not None
    twice = client.post(f"/v1/builds/{first}/cancel")
    assert twice.status_code == 409 and twice.json()["error"] == {
        "code": "invalid_transition", "field": "status", "message": f"build {first} is already cancelled",
        "fix": "nothing to cancel"}
    new = client.post("/v1/builds", json=CPU).json()
    assert new["id"] != first and new["status"] == "queued"
    assert [q for _, q in broker.sent] == ["kiln.aot-inductor.cpu"] * 2
    assert statuses(sessions, first) == ["queued", "cancelled"]


def test_cancel_of_a_running_build_flags_it_and_the_runner_stops_it(env):
    settings, sessions, broker = env
    made = submit(settings, sessions, spec_of(settings, CPU), broker)
    with sessions() as s:
        assert move_build_if_unchanged(s, s.get(Build, made.build.id), "running", worker="w1")
        s.commit()
    with sessions() as s:
        b = request_cancel(s, s.get(Build, made.build.id))
        s.commit()
        assert (b.status, b.cancel_requested) == ("running", True)
    # the worker died; its redelivered message finds the flag
    assert runner.run_build(made.build.id, settings, "w2") == "cancelled"
    b = row(sessions, made.build.id)
    assert (b.status, b.active_key, b.reason) == ("cancelled", None, "cancelled before it started")


# -- the runner -----------------------------------------------------------------------------------------------
def test_runner_claims_runs_and_finishes_from_an_existing_engine(env, tmp_path):
    settings, sessions, broker = env
    spec = spec_of(settings, CPU)
    made = submit(settings, sessions, spec, broker)
    engine = publish_for(settings, sessions, spec, prepared(settings, sessions, spec).build_key, tmp_path)
    assert runner.run_build(made.build.id, settings, "w1") == "succeeded"
    b = row(sessions, made.build.id)
    assert (b.status, b.digest, b.worker, b.attempts, b.active_key) == ("succeeded", engine.digest, "w1", 1, None)
    assert b.started_at is not None and b.finished_at is not None and b.stage is None
    assert [st["name"] for st in b.stages] == ["resolve", "quantize", "compile", "validate", "publish"]
    assert all(set(st) == {"name", "status", "seconds"} and isinstance(st["seconds"], float)
               and st["seconds"] == round(st["seconds"], 3) for st in b.stages)
    assert b.build_key == prepared(settings, sessions, spec).build_key
    assert statuses(sessions, b.id) == ["queued", "running", "succeeded"]
    assert b.reason is None and b.error is None
    with sessions() as s:
        data = [e.data for e in s.scalars(select(BuildEvent).where(BuildEvent.build_id == b.id,
                                                                   BuildEvent.kind == "status").order_by(BuildEvent.id))]
    assert data[1] == {"status": "running", "worker": "w1"} and data[2] == {"status": "succeeded", "digest": engine.digest}
    assert data[0]["status"] == "queued" and set(data[0]) == {"status", "reason"}
    # the next identical request is answered by this engine, with the build that produced it
    again = submit(settings, sessions, spec, broker)
    assert (again.outcome, again.artifact.digest, again.build.id) == ("existing-artifact", engine.digest, b.id)
    # a redelivered message leaves a finished build alone
    assert runner.run_build(made.build.id, settings, "w2") == "succeeded"
    assert row(sessions, b.id).worker == "w1" and statuses(sessions, b.id) == ["queued", "running", "succeeded"]


def test_runner_reports_a_rejected_engine_as_failed_validation(env, tmp_path):
    settings, sessions, broker = env
    spec = spec_of(settings, CPU)
    made = submit(settings, sessions, spec, broker)
    key = prepared(settings, sessions, spec).build_key
    rejected = publish_for(settings, sessions, spec, key, tmp_path, passed=False)
    assert runner.run_build(made.build.id, settings, "w1") == "failed"
    b = row(sessions, made.build.id)
    assert (b.status, b.reason, b.digest, b.build_key) == ("failed", "validation", rejected.digest, key)
    assert b.error == {"code": "validation_failed", "message": "the engine failed validation; stored as rejected"}
    assert [(st["name"], st["status"]) for st in b.stages] == [("resolve", "cached")] + [
        (n, "cached") for n in ("quantize", "compile", "validate", "publish")]
    assert all(st["seconds"] == round(st["seconds"], 3) for st in b.stages)


def test_runner_fails_a_build_whose_checkpoint_is_gone(env, tmp_path):
    settings, sessions, broker = env
    ckpt = tmp_path / "ckpt"
    shutil.copytree(TINY, ckpt)
    made = submit(settings, sessions, spec_of(settings, {**CPU, "checkpoint": str(ckpt)}), broker)
    shutil.rmtree(ckpt)
    assert runner.run_build(made.build.id, settings, "w1") == "failed"
    b = row(sessions, made.build.id)
    assert b.status == "failed" and b.reason == b.error["code"] and b.active_key is None
    assert statuses(sessions, b.id) == ["queued", "running", "failed"]


def test_runner_leaves_a_build_running_on_another_live_worker(env, caplog):
    import logging

    settings, sessions, broker = env
    caplog.set_level(logging.INFO, logger="workers.runner")
    made = submit(settings, sessions, spec_of(settings, CPU), broker)
    add_worker(sessions, "w1", ["kiln.aot-inductor.cpu"])
    with sessions() as s:
        assert move_build_if_unchanged(s, s.get(Build, made.build.id), "running", worker="w1")
        s.commit()
    assert runner.run_build(made.build.id, settings, "w2") == "running"
    assert f"build {made.build.id} is running on live worker w1; duplicate message dropped" in caplog.messages
    b = row(sessions, made.build.id)
    assert (b.worker, b.attempts) == ("w1", 1)
    assert statuses(sessions, made.build.id) == ["queued", "running"]
    assert runner.run_build("0" * 32, settings, "w2") == "missing"
    assert f"build {'0' * 32} does not exist; message dropped" in caplog.messages


def test_of_two_claims_on_one_read_exactly_one_wins(env):
    settings, sessions, broker = env
    made = submit(settings, sessions, spec_of(settings, CPU), broker)
    s1, s2 = sessions(), sessions()
    b1, b2 = s1.get(Build, made.build.id), s2.get(Build, made.build.id)
    assert move_build_if_unchanged(s1, b1, "running", worker="w1")
    s1.commit()
    assert not move_build_if_unchanged(s2, b2, "running", worker="w2")
    s2.commit()
    s1.close(), s2.close()
    b = row(sessions, made.build.id)
    assert (b.worker, b.attempts) == ("w1", 1) and statuses(sessions, b.id) == ["queued", "running"]


def test_a_storage_error_requeues_then_the_last_try_fails_the_build(env):
    settings, sessions, broker = env
    made = submit(settings, sessions, spec_of(settings, CPU), broker)
    with sessions() as s:
        move_build_if_unchanged(s, s.get(Build, made.build.id), "running", worker="w1")
        s.commit()
    err = StorageUnavailable("the store answered 503")
    assert runner.after_storage_error(sessions, made.build.id, err, last_try=False) == "queued"
    b = row(sessions, made.build.id)
    assert b.status == "queued" and b.reason.startswith("retrying after a storage error") and b.active_key
    with sessions() as s:
        move_build_if_unchanged(s, s.get(Build, made.build.id), "running", worker="w1")
        s.commit()
    assert runner.after_storage_error(sessions, made.build.id, err, last_try=True) == "failed"
    b = row(sessions, made.build.id)
    assert (b.status, b.active_key, b.error["code"]) == ("failed", None, "storage_unavailable")
    assert "gave up after 2 attempts" in b.reason and "503" in b.reason
    with sessions() as s:
        last = s.scalars(select(BuildEvent).where(BuildEvent.build_id == b.id).order_by(BuildEvent.id.desc())).first()
    assert last.data == {"status": "failed", "reason": b.reason, "error": b.error}
    assert statuses(sessions, b.id) == ["queued", "running", "queued", "running", "failed"]


def test_the_task_fails_the_build_on_its_last_retry(monkeypatch):
    from workers import tasks
    from workers.celery_app import BUILD_MAX_RETRIES, retry_delay_s

    calls = []
    monkeypatch.setattr(tasks, "run_build_row", lambda build_id, settings, worker, *, last_try: calls.append(last_try)
                        or "failed")
    assert tasks.run_build.max_retries == BUILD_MAX_RETRIES and tasks.run_build.acks_late
    tasks.run_build.apply(args=["b1"], retries=BUILD_MAX_RETRIES - 1)
    tasks.run_build.apply(args=["b1"], retries=BUILD_MAX_RETRIES)
    assert calls == [False, True]
    assert [retry_delay_s(n) for n in range(8)] == [5, 10, 20, 40, 80, 160, 300, 300]


# -- the reconciler -------------------------------------------------------------------------------------------
def test_reconciler_requeues_builds_of_dead_workers_only(env):
    settings, sessions, broker = env
    dead = submit(settings, sessions, spec_of(settings, CPU), broker).build.id
    alive = submit(settings, sessions, spec_of(settings, {**CPU, "profile": "throughput"}), broker).build.id
    add_worker(sessions, "gone", ["kiln.aot-inductor.cpu"], live=False)
    add_worker(sessions, "here", ["kiln.aot-inductor.cpu"])
    with sessions() as s:
        move_build_if_unchanged(s, s.get(Build, dead), "running", worker="gone")
        move_build_if_unchanged(s, s.get(Build, alive), "running", worker="here")
        s.commit()
    broker.sent.clear()
    assert reclaim_orphans(sessions, broker) == [dead]
    assert broker.sent == [(dead, "kiln.aot-inductor.cpu")]
    assert row(sessions, dead).status == "queued" and "worker gone stopped" in row(sessions, dead).reason
    assert row(sessions, alive).status == "running"
    assert reclaim_orphans(sessions, broker) == []  # idempotent
    assert statuses(sessions, dead) == ["queued", "running", "queued"]


def test_reconciler_requeues_old_queued_builds_only_when_the_broker_queue_is_empty(env):
    settings, sessions, broker = env
    b = submit(settings, sessions, spec_of(settings, CPU), broker).build.id
    broker.sent.clear()
    q = ["kiln.aot-inductor.cpu"]
    assert requeue_lost(sessions, q, broker, lambda queue: 0, min_age_s=3600) == []  # too young
    assert requeue_lost(sessions, q, broker, lambda queue: 1, min_age_s=0) == []  # its message is there
    assert requeue_lost(sessions, q, broker, lambda queue: None, min_age_s=0) == []  # depth unknown
    assert requeue_lost(sessions, ["kiln.other"], broker, lambda queue: 0, min_age_s=0) == []
    assert broker.sent == []
    assert requeue_lost(sessions, q, broker, lambda queue: 0, min_age_s=0) == [b]
    assert broker.sent == [(b, "kiln.aot-inductor.cpu")]


# -- the state machines ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("frm,to,fix", [
    ("queued", "succeeded", "a queued build can become cancelled, failed, running"),
    ("queued", "queued", "a queued build can become cancelled, failed, running"),
    ("running", "running", "a running build can become cancelled, failed, queued, succeeded"),
    ("succeeded", "failed", "a succeeded build is final; submit a new build"),
    ("failed", "queued", "a failed build is final; submit a new build"),
    ("cancelled", "running", "a cancelled build is final; submit a new build")])
def test_invalid_build_transitions_raise_and_change_nothing(env, frm, to, fix):
    settings, sessions, broker = env
    made = submit(settings, sessions, spec_of(settings, CPU), broker)
    with sessions() as s:
        b = s.get(Build, made.build.id)
        b.status = frm
        s.commit()
        with pytest.raises(InvalidTransition) as e:
            move_build(s, b, to)
        assert (e.value.field, e.value.message, e.value.fix) == (
            "status", f"build {b.id} is {frm}; it cannot become {to}", fix)
        with pytest.raises(InvalidTransition):
            move_build_if_unchanged(s, b, to)
        s.rollback()
    assert row(sessions, made.build.id).status == frm and statuses(sessions, made.build.id) == ["queued"]


def test_engine_transitions_and_tags(env, tmp_path):
    settings, sessions, _ = env
    spec = spec_of(settings, CPU)
    fresh = publish_for(settings, sessions, spec, "sha256:" + "1" * 64, tmp_path)
    rejected = publish_for(settings, sessions, spec, "sha256:" + "2" * 64, tmp_path, passed=False)
    assert (fresh.status, rejected.status) == ("fresh", "rejected")
    with sessions() as s:
        assert s.get(Tag, ("acme/tiny", fresh.tag)).digest == fresh.digest
        with pytest.raises(InvalidTransition) as e:
            point_tag(s, "acme/tiny", "other", s.get(Artifact, rejected.digest), reason="x")
        assert e.value.field == "tag"
        with pytest.raises(InvalidTransition):
            point_tag(s, "acme/other", "t", s.get(Artifact, fresh.digest), reason="x")
        with pytest.raises(InvalidTransition):
            move_artifact(s, s.get(Artifact, rejected.digest), "stale", reason="x")
        move_artifact(s, s.get(Artifact, fresh.digest), "stale", reason="head moved")
        s.commit()
        assert s.get(Tag, ("acme/tiny", fresh.tag)) is None
        events = s.scalars(select(TagEvent).order_by(TagEvent.id)).all()
        assert [(e.old_digest, e.new_digest) for e in events] == [(None, fresh.digest), (fresh.digest, None)]
        assert events[1].reason == "stale: head moved"
        with pytest.raises(InvalidTransition):
            point_tag(s, "acme/tiny", fresh.tag, s.get(Artifact, fresh.digest), reason="x")
        move_artifact(s, s.get(Artifact, fresh.digest), "revoked", reason="bad")
        s.commit()
        with pytest.raises(InvalidTransition) as e:
            move_artifact(s, s.get(Artifact, fresh.digest), "revoked", reason="again")
        assert "final" in e.value.fix
        a = s.get(Artifact, fresh.digest)
        assert (a.status, a.status_reason) == ("revoked", "bad")


def test_revoke_route_untags_and_refuses_a_second_revoke(env, tmp_path):
    settings, sessions, broker = env
    engine = publish_for(settings, sessions, spec_of(settings, CPU), "sha256:" + "3" * 64, tmp_path)
    client = TestClient(create_app(settings, enqueue=broker))
    r = client.post(f"/v1/artifacts/{engine.digest}/revoke", json={"reason": "  leaks  "})
    assert r.status_code == 200 and r.json()["status"] == "revoked"
    with sessions() as s:
        assert s.get(Tag, ("acme/tiny", engine.tag)) is None
        assert s.get(Artifact, engine.digest).status_reason == "leaks"
        assert s.scalars(select(TagEvent).order_by(TagEvent.id.desc())).first().reason == "revoked: leaks"
    again = client.post(f"/v1/artifacts/{engine.digest}/revoke", json={"reason": "again"})
    assert again.status_code == 409 and again.json()["error"] == {
        "code": "invalid_transition", "field": "status", "message": f"engine {engine.digest} is revoked; it cannot "
        "become revoked", "fix": "a revoked engine is final"}


def test_engine_transition_errors_say_what_is_allowed(env, tmp_path):
    from kiln.states import add_artifact, initial_artifact_status

    settings, sessions, _ = env
    spec = spec_of(settings, CPU)
    fresh = publish_for(settings, sessions, spec, "sha256:" + "4" * 64, tmp_path)
    rejected = publish_for(settings, sessions, spec, "sha256:" + "5" * 64, tmp_path, passed=False)
    assert [initial_artifact_status(passed=p, stale=st) for p, st in ((True, False), (True, True), (False, False),
                                                                     (False, True))] == ["fresh", "stale", "rejected",
                                                                                         "rejected"]
    with sessions() as s:
        with pytest.raises(InvalidTransition) as e:
            move_artifact(s, s.get(Artifact, rejected.digest), "stale", reason="x")
        assert (e.value.field, e.value.message, e.value.fix) == (
            "status", f"engine {rejected.digest} is rejected; it cannot become stale", "a rejected engine can become revoked")
        with pytest.raises(InvalidTransition) as e:
            move_artifact(s, s.get(Artifact, fresh.digest), "fresh", reason="x")
        assert e.value.fix == "a fresh engine can become revoked, stale"
        with pytest.raises(InvalidTransition) as e:
            point_tag(s, "acme/tiny", "other", s.get(Artifact, rejected.digest), reason="x")
        assert (e.value.field, e.value.fix) == ("tag", "tag a fresh engine of this repository")
        assert e.value.message == (f"acme/tiny:other can name only a fresh engine named in acme/tiny; {rejected.digest} is "
                                   "a rejected engine of acme/tiny")
        revoked = Artifact(**{c.name: getattr(s.get(Artifact, fresh.digest), c.name)
                              for c in Artifact.__table__.columns})
        revoked.digest, revoked.build_key, revoked.status = "sha256:" + "6" * 64, "sha256:" + "7" * 64, "revoked"
        with pytest.raises(InvalidTransition) as e:
            add_artifact(s, revoked, reason="x")
        assert (e.value.field, e.value.message, e.value.fix) == (
            "status", "an engine is published fresh, rejected, stale, not revoked", "publish it as fresh, stale or rejected")
        s.rollback()
        # a tag already naming the engine: pointing it again records nothing
        before = s.query(TagEvent).count()
        point_tag(s, "acme/tiny", fresh.tag, s.get(Artifact, fresh.digest), reason="again")
        s.commit()
        assert s.query(TagEvent).count() == before
        # moving an existing tag to another fresh engine records old → new
        other = publish_for(settings, sessions, spec, "sha256:" + "8" * 64, tmp_path)
        with sessions() as s2:
            last = s2.scalars(select(TagEvent).order_by(TagEvent.id.desc())).first()
            assert (last.old_digest, last.new_digest, last.reason) == (fresh.digest, other.digest,
                                                                      f"published {'sha256:' + '8' * 64}")
            assert s2.get(Tag, ("acme/tiny", fresh.tag)).digest == other.digest


def test_a_stale_read_cannot_resurrect_a_finished_build(env):
    settings, sessions, broker = env
    made = submit(settings, sessions, spec_of(settings, CPU), broker)
    with sessions() as s:
        move_build_if_unchanged(s, s.get(Build, made.build.id), "running", worker="w1")
        s.commit()
    reconciler = sessions()
    seen = reconciler.get(Build, made.build.id)  # read as running, attempt 1
    assert seen.status == "running"
    with sessions() as s:
        move_build(s, s.get(Build, made.build.id), "failed", reason="boom")  # same attempt count
        s.commit()
    assert not move_build_if_unchanged(reconciler, seen, "queued", reason="worker lost")
    reconciler.commit()
    reconciler.close()
    assert row(sessions, made.build.id).status == "failed"


def test_a_stale_read_cannot_claim_a_build_claimed_and_requeued_since(env):
    settings, sessions, broker = env
    made = submit(settings, sessions, spec_of(settings, CPU), broker)
    late = sessions()
    seen = late.get(Build, made.build.id)  # read as queued, attempt 0
    with sessions() as s:
        assert move_build_if_unchanged(s, s.get(Build, made.build.id), "running", worker="w1")
        s.commit()
    with sessions() as s:
        move_build(s, s.get(Build, made.build.id), "queued", reason="retrying")  # queued again, attempt 1
        s.commit()
    assert not move_build_if_unchanged(late, seen, "running", worker="w2")
    late.commit()
    late.close()
    b = row(sessions, made.build.id)
    assert (b.status, b.worker, b.attempts) == ("queued", "w1", 1)


def test_the_atomic_move_refuses_like_the_plain_one(env):
    from kiln.states import check_build_transition

    settings, sessions, broker = env
    made = submit(settings, sessions, spec_of(settings, CPU), broker)
    with sessions() as s:
        b = s.get(Build, made.build.id)
        with pytest.raises(InvalidTransition) as e:
            move_build_if_unchanged(s, b, "succeeded")
        assert e.value.message == f"build {b.id} is queued; it cannot become succeeded"
    with pytest.raises(InvalidTransition) as e:  # a status the machine does not know is final
        check_build_transition("archived", "running", "b1")
    assert (e.value.message, e.value.fix) == ("build b1 is archived; it cannot become running",
                                              "a archived build is final; submit a new build")


def test_an_engine_leaving_fresh_loses_only_its_own_tags(env, tmp_path):
    settings, sessions, _ = env
    latency = publish_for(settings, sessions, spec_of(settings, CPU), "sha256:" + "a" * 64, tmp_path)
    throughput = publish_for(settings, sessions, spec_of(settings, {**CPU, "profile": "throughput"}),
                             "sha256:" + "b" * 64, tmp_path)
    assert latency.tag != throughput.tag
    with sessions() as s:
        move_artifact(s, s.get(Artifact, latency.digest), "stale", reason="head moved")
        s.commit()
        assert s.get(Tag, ("acme/tiny", latency.tag)) is None
        assert s.get(Tag, ("acme/tiny", throughput.tag)).digest == throughput.digest
        a = s.get(Artifact, throughput.digest)
        a.status = "archived"  # a status this version does not know: final
        with pytest.raises(InvalidTransition) as e:
            move_artifact(s, a, "revoked", reason="x")
        assert e.value.fix == "a archived engine is final"
        s.rollback()


def test_a_failed_builds_recorded_error_names_the_workers_places_not_its_paths(env, tmp_path, monkeypatch):
    """What ``artifacts:read`` sees of a failure: no absolute path of the worker's home, temp dir, cwd or $HOME."""
    import os
    import tempfile

    from kiln.errors import StageFailed

    settings, sessions, broker = env
    home = str(settings.home_dir)
    made = submit(settings, sessions, spec_of(settings, CPU), broker)
    cache = f"{home}/cache/compile/.staging-1/out"
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    monkeypatch.chdir(tmp_path)

    def crash(self, spec):
        raise StageFailed(f"AOTInductor compile failed writing {cache}/model.pt2 "
                          f"(scratch {tempfile.gettempdir()}/torchinductor_x, cwd {os.getcwd()}, ~ {tmp_path / 'user'}/x)")

    monkeypatch.setattr(Builder, "build", crash)
    assert runner.run_build(made.build.id, settings, "w1") == "failed"
    err = row(sessions, made.build.id).error
    assert err["code"] == "stage_failed"
    assert "$KILN_HOME/cache/compile/.staging-1/out/model.pt2" in err["message"]
    for leaked in (home, str(tmp_path), tempfile.gettempdir() + "/"):
        assert leaked not in json.dumps(err), (leaked, err)


def test_dedupe_uses_the_toolchains_of_known_workers_when_none_is_live_and_answers_with_the_newest_engine(env, tmp_path):
    from workers.submit import candidate_keys

    settings, sessions, broker = env
    spec = spec_of(settings, TRT)
    p = prepared(settings, sessions, spec)
    generic = "kiln.trtllm-engine.sm90"
    add_worker(sessions, "plain", [generic])  # live, advertising no toolchains at all
    with sessions() as s:
        assert candidate_keys(s.scalars(select(Worker)).all(), p, generic) == {p.build_key}
        s.get(Worker, "plain").last_heartbeat = datetime.now(timezone.utc) - timedelta(hours=1)
        s.commit()
    add_worker(sessions, "old", [generic], {generic: TC_OLD}, live=False)
    add_worker(sessions, "new", [generic], {generic: TC_NEW}, live=False)
    key_old = build_key(p.resolved.digest, spec, TC_OLD, p.gates, p.data)
    key_new = build_key(p.resolved.digest, spec, TC_NEW, p.gates, p.data)
    with sessions() as s:  # no worker is live: every known worker's toolchain counts
        assert candidate_keys(s.scalars(select(Worker)).all(), p, generic) == {key_old, key_new}
    publish_for(settings, sessions, spec, key_new, tmp_path / "n")
    newer = publish_for(settings, sessions, spec, key_old, tmp_path / "o")  # published second: the newest
    with sessions() as s:
        s.get(Artifact, newer.digest).created_at = datetime.now(timezone.utc) + timedelta(seconds=1)
        s.commit()
    found = submit(settings, sessions, spec, broker)
    assert (found.outcome, found.artifact.digest) == ("existing-artifact", newer.digest)


def test_a_tracked_models_gates_and_each_matrix_entry_are_the_baseline(env):
    from kiln.errors import SpecError
    from kiln.tables import TrackedModel

    settings, sessions, broker = env
    other = {"precision": "fp8", "target": "cpu", "backend": "aot-inductor", "profile": "throughput"}
    broken = {"precision": "fp8", "target": "sm70"}  # an entry no longer valid: skipped, the others still count
    mine = {"precision": "fp8", "target": "cpu", "backend": "aot-inductor", "profile": "latency",
            "calibration": CPU["calibration"]}  # no gates of its own: the model's apply
    with sessions() as s:
        s.add(TrackedModel(name="acme/tiny", checkpoint="hf://acme/tiny@main", hf_repo="acme/tiny", branch="main",
                           head_sha=None, matrix=[broken, other, mine],
                           gates={"max_mean_kl": 0.02, "min_top1_agreement": 0.9}))
        s.commit()
    with pytest.raises(SpecError) as e:
        submit(settings, sessions, spec_of(settings, CPU), broker)
    assert [d["field"] for d in e.value.details] == ["gates.max_mean_kl", "gates.min_top1_agreement"]
    assert e.value.details[0]["message"] == "0.1 is looser than acme/tiny's tracked matrix (0.02)"  # fp8's default
    assert broker.sent == []
    strict = {**CPU, "gates": {"max_mean_kl": 0.02, "min_top1_agreement": 0.9}}
    assert submit(settings, sessions, spec_of(settings, strict), broker).outcome == "created"


def test_a_matrix_identifies_each_checkpoint_once(env, monkeypatch):
    """Spy on the real identify (it still runs): a matrix of six entries on one checkpoint reads it once."""
    from builder import pipeline
    from workers.submit import submit_many

    settings, sessions, broker = env
    calls = []
    real = pipeline.identify_checkpoint
    monkeypatch.setattr(pipeline, "identify_checkpoint", lambda ref, **kw: calls.append(ref) or real(ref, **kw))
    specs = [spec_of(settings, {**CPU, "profile": p, "precision": q}) for p in ("latency", "balanced", "throughput")
             for q in ("fp8", "nvfp4")]
    assert [a.outcome for a in submit_many(settings, sessions, specs, broker)] == ["created"] * 6
    assert calls == [str(TINY)]


def test_a_new_build_must_start_queued_and_nothing_is_written_otherwise(env):
    from kiln.states import create_build

    _, sessions, _ = env
    with sessions() as s:
        with pytest.raises(InvalidTransition) as e:
            create_build(s, Build(id="b" * 32, request_key="sha256:" + "a" * 64, queue="q", status="running", spec={}))
        assert (e.value.message, e.value.field, e.value.fix) == (
            "a new build starts queued, not running", "status", "create builds as queued")
        assert s.query(Build).count() == 0 and s.query(BuildEvent).count() == 0

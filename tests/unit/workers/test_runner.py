"""The runner's branches driven through the real Builder, stage cache, local store and SQLite index: a cancel
that arrives while a stage runs, a storage error mid-stage (retried, then failing the build on the last try), a
domain error and a crash, and the duplicate messages it must drop.

The quantize stage is replaced by a named fake (``fake_quantize``) that writes a small output and does what a
concurrent actor would do at that moment (an operator's cancel; the store failing): ModelOpt's calibration is
not under test here, the runner's coordination around it is."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import func, select

from kiln.errors import StageFailed, StorageUnavailable
from kiln.tables import Artifact, Build, BuildEvent, StageOutput
from kiln.states import move_build_if_unchanged, request_cancel
from tests.unit.workers.test_build_states import (CPU, Broker, add_worker, env, prepared, row,  # noqa: F401
                                                  spec_of, statuses)
from workers import runner
from workers.submit import submit


def stage_events(sessions, build_id):
    with sessions() as s:
        return [(e.data["name"], e.data["state"]) for e in s.scalars(
            select(BuildEvent).where(BuildEvent.build_id == build_id, BuildEvent.kind == "stage").order_by(BuildEvent.id))]


def fake_quantize(monkeypatch, action):
    """Replace ModelOpt's calibration with a small output written after ``action()`` (which may raise)."""
    def quantize(checkpoint_dir, spec, calib_text, out_dir):
        action()
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text("{}")
        return {"fake": True}
    monkeypatch.setattr("builder.quantize.quantize", quantize)


def test_a_cancel_during_a_stage_stops_the_build_at_the_next_boundary_with_its_stages_recorded(env, monkeypatch):
    settings, sessions, broker = env
    made = submit(settings, sessions, spec_of(settings, CPU), broker)

    def operator_cancels():  # the cancel route's effect on a running build: the flag only
        with sessions() as s:
            b = request_cancel(s, s.get(Build, made.build.id))
            s.commit()
            assert b.status == "running"

    fake_quantize(monkeypatch, operator_cancels)
    assert runner.run_build(made.build.id, settings, "w1") == "cancelled"
    b = row(sessions, made.build.id)
    assert (b.status, b.reason, b.active_key, b.worker) == (
        "cancelled", "cancelled at a stage boundary; nothing was published", None, "w1")
    assert statuses(sessions, b.id) == ["queued", "running", "cancelled"]
    assert stage_events(sessions, b.id) == [("resolve", "started"), ("resolve", "finished"),
                                            ("quantize", "started"), ("quantize", "finished")]
    # resolve: the checkpoint was identified at submit (its manifest cached); quantize ran here
    assert [(st["name"], st["status"]) for st in b.stages] == [("resolve", "cached"), ("quantize", "ran")]
    assert all(isinstance(st["seconds"], float) and st["seconds"] == round(st["seconds"], 3) for st in b.stages)
    assert b.stage == "quantize"
    with sessions() as s:
        assert s.scalar(select(func.count()).select_from(Artifact)) == 0
        # the finished quantize output went to the store: a resubmitted build reuses it
        out = s.get(StageOutput, prepared(settings, sessions, spec_of(settings, CPU)).quantize_key)
        assert out is not None and out.stage == "quantize"


def test_a_storage_error_mid_stage_requeues_the_build_then_fails_it_on_the_last_try(env, monkeypatch):
    settings, sessions, broker = env
    made = submit(settings, sessions, spec_of(settings, CPU), broker)

    def store_fails():
        raise StorageUnavailable("the store answered 503")

    fake_quantize(monkeypatch, store_fails)
    with pytest.raises(StorageUnavailable):  # the task retries it
        runner.run_build(made.build.id, settings, "w1")
    b = row(sessions, made.build.id)
    assert (b.status, b.reason) == ("queued", "retrying after a storage error: the store answered 503")
    assert runner.run_build(made.build.id, settings, "w1", last_try=True) == "failed"
    b = row(sessions, made.build.id)
    assert (b.status, b.error["code"], b.active_key) == ("failed", "storage_unavailable", None)
    assert b.reason == "storage unavailable; gave up after 2 attempts: the store answered 503"
    assert statuses(sessions, b.id) == ["queued", "running", "queued", "running", "failed"]


def test_a_domain_error_fails_the_build_with_its_code_and_a_crash_as_an_internal_error(env, monkeypatch, caplog):
    settings, sessions, broker = env
    first = submit(settings, sessions, spec_of(settings, CPU), broker)

    def stage_fails():
        raise StageFailed("calibration diverged", field="calibration", fix="use more samples")

    fake_quantize(monkeypatch, stage_fails)
    assert runner.run_build(first.build.id, settings, "w1") == "failed"
    b = row(sessions, first.build.id)
    assert (b.status, b.reason, b.error) == ("failed", "stage_failed", StageFailed(
        "calibration diverged", field="calibration", fix="use more samples").to_dict())

    second = submit(settings, sessions, spec_of(settings, {**CPU, "profile": "throughput"}), broker)

    def crashes():
        raise ZeroDivisionError("division by zero")

    fake_quantize(monkeypatch, crashes)
    caplog.set_level(logging.ERROR, logger="workers.runner")
    assert runner.run_build(second.build.id, settings, "w1") == "failed"
    assert f"build {second.build.id} crashed" in caplog.messages  # the full trace goes to the worker's log
    b = row(sessions, second.build.id)
    assert (b.status, b.reason, b.error) == ("failed", "internal_error", {
        "code": "internal_error", "message": "ZeroDivisionError: division by zero"})


def test_redact_names_each_place_longest_first_in_every_value_and_leaves_the_root_alone(tmp_path, monkeypatch):
    import tempfile

    from kiln.settings import Settings

    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    assert runner.redact(f"see {tmp_path}/user/.cache", Settings(home=home)) == "see ~/.cache"  # $HOME is ~
    monkeypatch.setenv("HOME", "/")  # a service user whose home is / : "/" is no place to name
    monkeypatch.chdir("/")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the home lies under the temporary directory
    settings = Settings(home=home)
    message = f"wrote {home}/cache/x, {home}/cache/y and {tmp_path}/scratch; read /etc/passwd"
    expected = "wrote $KILN_HOME/cache/x, $KILN_HOME/cache/y and $TMPDIR/scratch; read /etc/passwd"
    assert runner.redact(message, settings) == expected
    assert runner.redact({"message": message, "details": [message, 3, None]}, settings) == {
        "message": expected, "details": [expected, 3, None]}
    (home / "cache").mkdir()
    monkeypatch.chdir(home / "cache")  # the working directory lies under the home: the longer place wins
    assert runner.redact(f"{home}/cache/x {home}/y", settings) == "$PWD/x $KILN_HOME/y"


# -- the reconciler, one build after another ----------------------------------------------------------------------
def _running(sessions, build_id, worker):
    with sessions() as s:
        assert move_build_if_unchanged(s, s.get(Build, build_id), "running", worker=worker)
        s.commit()


def test_the_reconciler_goes_on_past_a_build_it_leaves_alone(env):
    from workers.reconcile import reclaim_orphans, requeue_lost

    settings, sessions, broker = env
    ids = [submit(settings, sessions, spec_of(settings, {**CPU, "profile": p}), broker).build.id
           for p in ("latency", "balanced", "throughput")]
    add_worker(sessions, "here", ["kiln.aot-inductor.cpu"])
    add_worker(sessions, "gone", ["kiln.aot-inductor.cpu"], live=False)
    _running(sessions, ids[0], "here")  # first in the table: left alone, the next still reclaimed
    _running(sessions, ids[1], "gone")
    broker.sent.clear()
    assert reclaim_orphans(sessions, broker) == [ids[1]]
    # queued builds: the running one is not re-enqueued, the old queued ones are, each asked for by its queue
    with sessions() as s:
        young = s.get(Build, ids[1])
        young.created_at = datetime.now(timezone.utc)  # re-queued just now: first of the two, and too young
        old = s.get(Build, ids[2])
        old.created_at = datetime.now(timezone.utc) - timedelta(seconds=5.5)  # older than the default 5 s
        s.get(Build, ids[0]).created_at = old.created_at  # as old, but running: not re-enqueued
        s.commit()
    asked = []
    depth = lambda queue: asked.append(queue) or 0  # noqa: E731
    broker.sent.clear()
    assert requeue_lost(sessions, ["kiln.aot-inductor.cpu"], broker, depth) == [ids[2]]
    assert broker.sent == [(ids[2], "kiln.aot-inductor.cpu")] and asked == ["kiln.aot-inductor.cpu"]


# -- the worker registry ------------------------------------------------------------------------------------------
def test_the_registry_registers_beats_and_says_who_serves_a_queue(env):
    from kiln.tables import Worker
    from workers import liveness as registry

    settings, sessions, _ = env
    q = "kiln.aot-inductor.cpu"
    with sessions() as s:
        assert registry.waiting_reason(s, q, "aot-inductor", "cpu") == (
            f"waiting for a worker that builds aot-inductor engines for cpu (queue {q}); no such worker is live")
        caps = {"queues": [q], "toolchains": {q: {"torch": "2.13.0"}}}
        before = datetime.now(timezone.utc)
        registry.register(s, "w1", caps)
        registry.register(s, "w2", {"queues": ["kiln.checkpoint.cpu"], "toolchains": {}})
        w1 = s.get(Worker, "w1")
        assert (w1.queues, w1.capabilities) == ([q], caps)
        assert registry._aware(w1.started_at) == registry._aware(w1.last_heartbeat) >= before - timedelta(seconds=1)
        w1.last_heartbeat = datetime.now(timezone.utc) - timedelta(hours=1)
        s.commit()
        live, known = registry.workers_for(s, q)  # from a session
        assert (live, [w.name for w in known]) == ([], ["w1"])
        registry.heartbeat(s, "w1")
        registry.heartbeat(s, "nobody")  # an unknown worker's beat changes nothing
        live, known = registry.workers_for(s, q)
        assert [w.name for w in live] == ["w1"] and registry.is_live(s.get(Worker, "w1"))
        assert registry.waiting_reason(s, q, "aot-inductor", "cpu") == f"waiting for a free worker on queue {q} (1 live)"
        registry.register(s, "w1", {"queues": ["kiln.checkpoint.cpu"], "toolchains": {"x": {}}})  # re-registers
        assert (s.get(Worker, "w1").queues, registry.workers_for(s, q)) == (["kiln.checkpoint.cpu"], ([], []))
        assert s.get(Worker, "nobody") is None

"""Faults survived, nothing lost, nothing duplicated — against the real stack: PostgreSQL, Redis, worker
processes killed by signal, the broker emptied, the database made unreachable."""

from __future__ import annotations

import concurrent.futures
import json
import signal
import time

import pytest
import redis
import sqlalchemy as sa

from scripts.devstack import PG, Stack, postgres_database, redis_url, tiny_spec

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(tmp_path_factory, redis_server):
    with postgres_database() as db_url:
        home = tmp_path_factory.mktemp("faults") / "kiln"
        s = Stack(home, {"KILN_DATABASE_URL": db_url, "KILN_BROKER_URL": redis_url(redis_server),
                         "KILN_HEARTBEAT_S": "1", "KILN_WORKER_LIVE_WINDOW_S": "4"})
        assert s.kiln("db", "upgrade").returncode == 0
        s.db_url = db_url
        try:
            s.start_api()
            yield s
        finally:
            s.close()


def count(stack, sql: str, **params) -> int:
    engine = sa.create_engine(stack.db_url)
    with engine.connect() as c:
        n = c.execute(sa.text(sql), params).scalar()
    engine.dispose()
    return n


def test_kill_9_of_a_worker_mid_stage_completes_once_on_another(stack):
    stack.start_worker("victim")
    spec = tiny_spec(backend="aot-inductor", gates={"max_mean_kl": 0.44})
    build = stack.post("/v1/builds", spec).json()
    deadline = time.time() + 180
    while time.time() < deadline:  # wait until it is inside the compile stage (quantize finished)
        b = stack.get(f"/v1/builds/{build['id']}").json()
        if b["stage"] == "compile":
            break
        time.sleep(0.2)
    else:
        raise AssertionError(f"never reached compile: {b}")
    stack.stop("victim", sig=signal.SIGKILL)  # the whole process group: Celery's main process and its child
    time.sleep(1)
    assert stack.get(f"/v1/builds/{build['id']}").json()["status"] == "running"
    stack.start_worker("rescuer")
    done = stack.wait_build(build["id"], timeout=300)
    assert done["status"] == "succeeded" and done["worker"] == "rescuer" and done["attempts"] == 2, done
    stages = {s["name"]: s["status"] for s in done["stages"]}
    # resumed from the last finished stage on a worker with another disk: quantize came from the store
    assert stages["quantize"] == "cached" and stages["compile"] == "ran", stages
    engine = sa.create_engine(stack.db_url)
    with engine.connect() as c:
        provenance = c.execute(sa.text("SELECT provenance FROM artifacts WHERE build_key = :k"),
                               {"k": done["build_key"]}).scalar()
    engine.dispose()
    qkey = (provenance if isinstance(provenance, dict) else json.loads(provenance))["quantize_key"].split(":")[1]
    victim, rescuer = stack.worker_home("victim") / "cache", stack.worker_home("rescuer") / "cache"
    assert (victim / "quantize" / qkey / ".complete").is_file()  # made there, before the kill
    assert (rescuer / "quantize" / qkey / ".complete").is_file()  # fetched here, from the store
    assert count(stack, "SELECT count(*) FROM stage_outputs WHERE key = :k", k=f"sha256:{qkey}") == 1
    assert count(stack, "SELECT count(*) FROM artifacts WHERE build_key = :k", k=done["build_key"]) == 1
    stack.stop("rescuer")


def test_redis_emptied_with_builds_queued_loses_none(stack):
    spec = tiny_spec(gates={"max_mean_kl": 0.45})
    build = stack.post("/v1/builds", spec).json()
    assert build["status"] == "queued"
    redis.Redis.from_url(stack.env["KILN_BROKER_URL"]).flushdb()  # the message is gone
    stack.start_worker("after-flush", "--queues", "kiln.checkpoint.cpu")
    done = stack.wait_build(build["id"], timeout=240)
    assert done["status"] == "succeeded"
    # and while a worker runs: flush again with a new build queued behind nothing
    second = stack.post("/v1/builds", tiny_spec(gates={"max_mean_kl": 0.46})).json()
    redis.Redis.from_url(stack.env["KILN_BROKER_URL"]).flushdb()
    assert stack.wait_build(second["id"], timeout=240)["status"] == "succeeded"
    stack.stop("after-flush")


def test_one_hundred_concurrent_identical_requests_make_one_build(stack):
    spec = tiny_spec(gates={"max_mean_kl": 0.47})
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(lambda _: stack.post("/v1/builds", spec), range(100)))
    assert {a.status_code for a in answers} <= {200, 202}
    assert len({a.json()["id"] for a in answers}) == 1
    assert count(stack, "SELECT count(*) FROM builds WHERE request_key = :k", k=answers[0].json()["request_key"]) == 1
    stack.post(f"/v1/builds/{answers[0].json()['id']}/cancel", None)


def test_database_unreachable_answers_503_and_recovers(stack):
    name = stack.db_url.rsplit("/", 1)[1]
    admin = sa.create_engine(f"{PG}/postgres", isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(sa.text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false'))
        c.execute(sa.text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :n"), {"n": name})
    try:
        r = stack.get("/v1/builds")
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "database_unavailable"
        assert stack.get("/readyz").status_code == 503
    finally:
        with admin.connect() as c:
            c.execute(sa.text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true'))
        admin.dispose()
    deadline = time.time() + 30
    while stack.get("/v1/builds").status_code != 200:
        assert time.time() < deadline, "the API did not recover"
        time.sleep(0.5)
    assert stack.get("/readyz").status_code == 200

"""The distributed service against the real stack on this machine: PostgreSQL, Redis, ``kiln api`` and
``kiln worker`` processes (Celery, prefork), building the shipped model for real."""

from __future__ import annotations

import concurrent.futures
import json
import time
import uuid
from contextlib import contextmanager

import pytest
import sqlalchemy as sa

from tests.integration import api_checks
from scripts.devstack import Stack, postgres_database, redis_url, tiny_spec

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """An S3 server over real HTTP (moto) holding the engine store."""
    import boto3

    from tests.s3server import moto_s3

    creds = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}
    with moto_s3() as endpoint:
        boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="test", aws_secret_access_key="test",
                     region_name="us-east-1").create_bucket(Bucket="kiln")
        yield {"KILN_STORE_URL": "s3://kiln/engines", "KILN_S3_ENDPOINT_URL": endpoint, **creds}


@contextmanager
def service(tmp_path_factory, s3, redis_server, *workers: tuple[str, str]):
    """A database, API and the given (name, queue) workers of their own, on the module's S3 server."""
    with postgres_database() as db_url:
        home = tmp_path_factory.mktemp("service") / "kiln"
        store = {**s3, "KILN_STORE_URL": f"s3://kiln/engines-{uuid.uuid4().hex[:8]}"}
        s = Stack(home, {"KILN_DATABASE_URL": db_url, "KILN_BROKER_URL": redis_url(redis_server), **store})
        s.s3 = store
        up = s.kiln("db", "upgrade")
        assert up.returncode == 0, up.stderr
        s.db_url = db_url
        try:
            s.start_api()
            for name, queue in workers:
                s.start_worker(name, "--queues", queue)
            yield s
        finally:
            s.close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory, s3, redis_server):
    """One worker per queue: aot-inductor builds and checkpoint builds run on different workers."""
    with service(tmp_path_factory, s3, redis_server, ("w-aot", "kiln.aot-inductor.cpu"),
                 ("w-ckpt", "kiln.checkpoint.cpu")) as s:
        yield s


def test_health(stack):
    api_checks.health(stack)
    workers = stack.get("/v1/workers").json()["workers"]
    w = next(w for w in workers if w["name"] == "w-aot")
    assert w["live"] and w["queues"] == ["kiln.aot-inductor.cpu"]
    assert w["capabilities"]["toolchains"]["kiln.aot-inductor.cpu"]["torch"].startswith("2.")


def test_a_build_no_worker_serves_waits_with_a_reason_then_runs_when_one_starts(tmp_path_factory, s3, redis_server):
    with service(tmp_path_factory, s3, redis_server) as stack:  # its own: no checkpoint worker until it starts one
        waits_then_runs(stack)


def waits_then_runs(stack):
    r = stack.post("/v1/builds", tiny_spec())
    assert r.status_code == 202
    build = r.json()
    time.sleep(3)
    waiting = stack.get(f"/v1/builds/{build['id']}").json()
    assert waiting["status"] == "queued"
    assert "kiln.checkpoint.cpu" in waiting["reason"] and "no such worker is live" in waiting["reason"]
    stack.start_worker("w-ckpt", "--queues", "kiln.checkpoint.cpu")
    done = stack.wait_build(build["id"])
    assert done["status"] == "succeeded" and done["worker"] == "w-ckpt", done


def test_trtllm_build_waits_for_a_gpu_worker(stack):
    r = stack.post("/v1/builds", tiny_spec(backend="trtllm-engine", target="h100"))
    assert r.status_code == 202
    time.sleep(2)
    b = stack.get(f"/v1/builds/{r.json()['id']}").json()
    assert b["status"] == "queued" and "kiln.trtllm-engine.sm90" in b["reason"]
    assert stack.post(f"/v1/builds/{b['id']}/cancel", None).json()["status"] == "cancelled"


def test_submit_follow_events_query_and_dedupe(stack):
    done = api_checks.submit_follow_and_query(stack, tiny_spec(gates={"max_mean_kl": 0.5}))
    import boto3

    client = boto3.client("s3", endpoint_url=stack.s3["KILN_S3_ENDPOINT_URL"], aws_access_key_id="test",
                          aws_secret_access_key="test", region_name="us-east-1")
    prefix = stack.s3["KILN_STORE_URL"].removeprefix("s3://kiln/") + "/"  # each service has a store of its own
    keys = {o["Key"] for o in client.list_objects_v2(Bucket="kiln", Prefix=prefix)["Contents"]}
    assert f"{prefix}blobs/sha256/{done['digest'].split(':')[1]}" in keys  # published to S3 over HTTP


def test_bad_requests(stack):
    api_checks.bad_requests_are_4xx_with_json(stack)


def test_twenty_concurrent_identical_submissions_make_one_build(stack):
    spec = tiny_spec(gates={"max_mean_kl": 0.41})
    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        answers = list(pool.map(lambda _: stack.post("/v1/builds", spec), range(20)))
    assert all(a.status_code in (200, 202) for a in answers), [a.text for a in answers]
    ids = {a.json()["id"] for a in answers}
    assert len(ids) == 1
    assert sum(a.status_code == 202 for a in answers) == 1
    engine = sa.create_engine(stack.db_url)
    with engine.connect() as c:
        n = c.execute(sa.text("SELECT count(*) FROM builds WHERE request_key = :k"),
                      {"k": answers[0].json()["request_key"]}).scalar()
    engine.dispose()
    assert n == 1
    assert stack.wait_build(ids.pop())["status"] == "succeeded"


def test_cancel_a_running_build_publishes_nothing(stack):
    spec = tiny_spec(backend="aot-inductor", gates={"max_mean_kl": 0.42})
    build = stack.post("/v1/builds", spec).json()
    stack.wait_build(build["id"], states=("running",), timeout=120)
    r = stack.post(f"/v1/builds/{build['id']}/cancel", None)
    assert r.status_code == 202 and r.json()["cancel_requested"] is True
    done = stack.wait_build(build["id"])
    assert done["status"] == "cancelled" and done["digest"] is None
    arts = stack.get("/v1/artifacts?backend=aot-inductor").json()["artifacts"]
    assert not [a for a in arts if a["build_key"] == done["build_key"]]
    again = stack.post(f"/v1/builds/{build['id']}/cancel", None)
    assert again.status_code == 409 and again.json()["error"]["field"] == "status"


def test_cli_drives_the_remote_service(stack):
    base = ["build", str(tiny_spec()["checkpoint"]), "--backend", "checkpoint", "--calib-samples", "8",
            "--calib-seq-len", "64", "--eval-max-tokens", "1024",
            "--override-reason", "a test build: a short evaluation", "--server", stack.url, "--json"]
    ok = stack.kiln(*base, "--gate", "max_mean_kl=0.43")
    assert ok.returncode == 0, ok.stderr
    out = json.loads(ok.stdout.strip().splitlines()[-1])
    assert out["status"] == "succeeded" and out["validation"]["passed"] is True
    assert [s["name"] for s in out["stages"]] == ["resolve", "quantize", "compile", "validate", "publish"]
    assert "publish" in ok.stderr  # stage lines streamed from the server
    bad = stack.kiln(*base, "--gate", "min_top1_agreement=1.5")
    assert bad.returncode == 1, bad.stderr
    assert json.loads(bad.stdout.strip().splitlines()[-1])["status"] == "failed"
    invalid = stack.kiln(*base, "--precision", "int4")
    assert invalid.returncode == 2 and "precision" in invalid.stderr


def test_migrations_up_and_down_on_postgres(tmp_path):
    with postgres_database() as url:
        s = Stack(tmp_path / "kiln", {"KILN_DATABASE_URL": url})
        engine = sa.create_engine(url)
        assert s.kiln("db", "upgrade").returncode == 0
        assert {"artifacts", "builds", "build_events", "workers", "alembic_version"} <= set(sa.inspect(engine).get_table_names())
        down = s.kiln("db", "downgrade", "base")
        assert down.returncode == 0, down.stderr
        assert set(sa.inspect(engine).get_table_names()) <= {"alembic_version"}
        assert s.kiln("db", "upgrade").returncode == 0
        engine.dispose()


def test_a_finetune_built_through_the_service_reuses_its_base_kernel(stack):
    """Issue 44 through the service: the API and a Celery worker build the tiny model, then a fine-tune of it
    (other weights, same architecture); the second build's compile is ``reused`` (the base's kernel, loaded with
    its own weights) and its engine shares the base's kernel layer."""
    from tests.unit.builder.test_refit import perturbed_copy

    small = {"profile": {"max_batch_size": 1, "max_input_len": 64, "max_seq_len": 64, "max_num_tokens": 64},
             "evaluation": {"seq_len": 64, "max_tokens": 1024}, "backend": "aot-inductor"}
    tuned_dir = perturbed_copy(stack.home.parent / "tiny-finetune")  # under the stack's checkpoint roots
    done = []
    for checkpoint in (tiny_spec()["checkpoint"], str(tuned_dir)):
        r = stack.post("/v1/builds", tiny_spec(checkpoint=checkpoint, **small))
        assert r.status_code == 202, r.text
        done.append(stack.wait_build(r.json()["id"], timeout=900))
    base, tuned = done
    assert base["status"] == tuned["status"] == "succeeded", (base, tuned)
    status = [{s["name"]: s["status"] for s in b["stages"]} for b in done]
    assert status[0]["compile"] == "ran" and status[1]["compile"] == "reused" and status[1]["quantize"] == "ran"
    arts = [stack.get(f"/v1/artifacts/{b['digest']}").json() for b in done]
    assert arts[0]["provenance"]["kernel_key"] == arts[1]["provenance"]["kernel_key"]
    assert base["digest"] != tuned["digest"]

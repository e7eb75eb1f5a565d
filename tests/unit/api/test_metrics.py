"""/metrics: values read from the database at scrape time (builds, stage durations, queues, cache hits, workers,
engines) and the in-process resolve latency histogram, scraped through the app and parsed with
prometheus_client's own parser."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from api.app import create_app
from api.routes.metrics import STAGE_BUCKETS, cache_hits, stage_histograms
from kiln import db
from kiln.tables import Artifact, Build, Worker
from kiln.settings import Settings


def stages(*triples) -> list[dict]:
    return [{"name": n, "status": s, "seconds": t} for n, s, t in triples]


FULL = stages(("resolve", "ran", 0.05), ("quantize", "ran", 7.0), ("compile", "ran", 31.0), ("validate", "ran", 1.7),
              ("publish", "ran", 0.04))
CACHED = stages(("resolve", "ran", 0.02), ("quantize", "cached", 0.0), ("compile", "cached", 0.0),
                ("validate", "cached", 0.0), ("publish", "cached", 0.0))
PROFILE_ONLY = stages(("resolve", "ran", 0.03), ("quantize", "cached", 0.001), ("compile", "ran", 28.0),
                      ("validate", "ran", 2.0), ("publish", "ran", 0.05))


class Env:
    def __init__(self, tmp: Path):
        self.settings = Settings(home=tmp / "home")
        db.upgrade(self.settings.db_url)
        self.app = create_app(self.settings, enqueue=lambda *a, **k: None)
        self.sessions = self.app.state.sessions
        self.client = TestClient(self.app)

    def build(self, status: str, queue: str = "kiln.aot-inductor.cpu", stage_list=None) -> None:
        with self.sessions() as s:
            s.add(Build(id=uuid.uuid4().hex, request_key="sha256:" + uuid.uuid4().hex * 2, spec={}, queue=queue,
                        status=status, stages=stage_list or [], attempts=0, cancel_requested=False))
            s.commit()

    def artifact(self, status: str) -> None:
        d = "sha256:" + uuid.uuid4().hex * 2
        with self.sessions() as s:
            s.add(Artifact(digest=d, build_key=d, repository="acme/tiny", tag="fp8-cpu-latency", status=status,
                           precision="fp8", target="cpu", profile="latency", backend="checkpoint",
                           checkpoint_ref="hf://acme/tiny@main", checkpoint_digest=d, size=1, provenance={},
                           validation={}))
            s.commit()

    def worker(self, name: str, heartbeat: datetime, queues: list[str]) -> None:
        with self.sessions() as s:
            s.add(Worker(name=name, queues=queues, capabilities={}, started_at=heartbeat, last_heartbeat=heartbeat))
            s.commit()

    def scrape(self) -> dict:
        r = self.client.get("/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        return {fam.name: fam for fam in text_string_to_metric_families(r.text)}


def values(family, name: str | None = None, **match) -> dict:
    """{label value (or label tuple): sample value} for samples named ``name`` (default: the family's)."""
    out = {}
    for s in family.samples:
        if s.name != (name or family.name) or any(s.labels.get(k) != v for k, v in match.items()):
            continue
        key = tuple(v for k, v in sorted(s.labels.items()) if k not in match)
        out[key[0] if len(key) == 1 else key] = s.value
    return out


@pytest.fixture
def env(tmp_path) -> Env:
    e = Env(tmp_path)
    for st in (FULL, CACHED, PROFILE_ONLY):
        e.build("succeeded", stage_list=st)
    e.build("failed", stage_list=stages(("resolve", "ran", 0.2), ("quantize", "ran", 700.0)))
    e.build("running", stage_list=stages(("resolve", "ran", 0.01), ("quantize", "cached", 0.0)))  # not finished
    e.build("queued")
    e.build("queued")
    e.build("queued", queue="kiln.trtllm-engine.sm90")
    e.build("cancelled")
    for status in ("fresh", "fresh", "stale", "rejected"):
        e.artifact(status)
    now = datetime.now(timezone.utc)  # at setup: a module-level time would be old after slow tests
    e.worker("live-1", now, ["kiln.aot-inductor.cpu", "kiln.checkpoint.cpu"])
    e.worker("gone-1", now - timedelta(minutes=10), ["kiln.aot-inductor.sm90"])
    return e


def test_builds_by_status(env):
    m = env.scrape()
    assert m["kiln_builds"].type == "gauge"
    assert values(m["kiln_builds"]) == {"queued": 3, "running": 1, "succeeded": 3, "failed": 1, "cancelled": 1}


def test_stage_duration_histogram_from_finished_builds(env):
    h = env.scrape()["kiln_stage_duration_seconds"]
    assert h.type == "histogram"
    count = values(h, "kiln_stage_duration_seconds_count")
    # ran stages of finished builds only: the running build's and cached stages are not durations of work
    assert count == {"resolve": 4, "quantize": 2, "compile": 2, "validate": 2, "publish": 2}
    total = values(h, "kiln_stage_duration_seconds_sum")
    assert total["compile"] == pytest.approx(59.0) and total["quantize"] == pytest.approx(707.0)
    quant = values(h, "kiln_stage_duration_seconds_bucket", stage="quantize")
    assert quant["5.0"] == 0 and quant["10.0"] == 1 and quant["600.0"] == 1 and quant["1800.0"] == 2 and quant["+Inf"] == 2
    compile_ = values(h, "kiln_stage_duration_seconds_bucket", stage="compile")
    assert compile_["10.0"] == 0 and compile_["30.0"] == 1 and compile_["60.0"] == 2
    assert len(compile_) == len(STAGE_BUCKETS)
    resolve = values(h, "kiln_stage_duration_seconds_bucket", stage="resolve")
    assert resolve["0.1"] == 3 and resolve["0.5"] == 4


def test_queue_depth_per_queue(env):
    q = values(env.scrape()["kiln_queue_depth"])
    # queued builds per queue, and 0 for queues a worker consumes with nothing waiting
    assert q == {"kiln.aot-inductor.cpu": 2, "kiln.trtllm-engine.sm90": 1, "kiln.checkpoint.cpu": 0,
                 "kiln.aot-inductor.sm90": 0}


def test_cache_hits_per_stage(env):
    c = env.scrape()["kiln_cache_hits"]
    assert c.type == "counter"
    hits = values(c, "kiln_cache_hits_total")
    assert hits == {"resolve": 0, "quantize": 3, "compile": 1, "validate": 1, "publish": 1}


def test_workers_live_and_artifacts(env):
    m = env.scrape()
    assert values(m["kiln_workers_live"]) == {(): 1}
    assert values(m["kiln_artifacts"]) == {"fresh": 2, "stale": 1, "revoked": 0, "rejected": 1}
    assert "kiln_broker_queue_length" not in m  # the SQLite broker: no Redis lists to measure


def test_values_follow_the_database_between_scrapes(env):
    env.build("queued")
    env.artifact("revoked")
    m = env.scrape()
    assert values(m["kiln_builds"])["queued"] == 4
    assert values(m["kiln_artifacts"])["revoked"] == 1
    other = TestClient(create_app(env.settings, enqueue=lambda *a, **k: None))  # another replica: same numbers
    assert values({f.name: f for f in text_string_to_metric_families(other.get("/metrics").text)}["kiln_builds"]) == \
        values(m["kiln_builds"])


def test_resolve_latency_histogram(env):
    def count() -> float:
        return values(env.scrape()["kiln_resolve_latency_seconds"], "kiln_resolve_latency_seconds_count")[()]

    assert count() == 0
    query = "/v1/resolve?model=acme/tiny&precision=fp8&profile=latency&target=cpu&backend=checkpoint"
    assert env.client.get(query).status_code in (200, 404, 409)
    env.client.get(query)
    env.client.get("/v1/builds")  # other routes are not observed
    assert count() == 2
    h = env.scrape()["kiln_resolve_latency_seconds"]
    assert h.type == "histogram" and values(h, "kiln_resolve_latency_seconds_bucket")["+Inf"] == 2
    assert values(h, "kiln_resolve_latency_seconds_sum")[()] > 0


def test_empty_database_reports_zeros(tmp_path):
    m = Env(tmp_path).scrape()
    assert set(values(m["kiln_builds"]).values()) == {0}
    assert values(m["kiln_stage_duration_seconds"], "kiln_stage_duration_seconds_count")["compile"] == 0
    assert values(m["kiln_workers_live"]) == {(): 0}
    assert values(m["kiln_queue_depth"]) == {}


def test_pure_helpers_ignore_malformed_stage_records():
    lists = [FULL, None, [{"name": "compile"}, "junk", {"name": "compile", "status": "ran", "seconds": "x"}], CACHED]
    hist = stage_histograms(lists)
    assert hist["compile"][0][-1] == 1 and hist["compile"][1] == 31.0
    assert cache_hits(lists) == {"quantize": 1, "compile": 1, "validate": 1, "publish": 1}


def test_a_scrape_reads_only_the_builds_finished_since_the_last(env):
    from sqlalchemy import event

    from kiln import db as kdb

    first = values(env.scrape()["kiln_stage_duration_seconds"], "kiln_stage_duration_seconds_count")
    engine = kdb.get_engine(env.settings.db_url)
    reads: list[str] = []

    def record(conn, cursor, statement, params, context, executemany):
        if "FROM builds" in statement and "stages" in statement and "status IN" in statement:
            reads.append(statement)

    event.listen(engine, "after_cursor_execute", record)
    try:
        again = values(env.scrape()["kiln_stage_duration_seconds"], "kiln_stage_duration_seconds_count")
        env.build("succeeded", stage_list=FULL)
        after = values(env.scrape()["kiln_stage_duration_seconds"], "kiln_stage_duration_seconds_count")
    finally:
        event.remove(engine, "after_cursor_execute", record)
    assert again == first  # nothing counted twice
    assert after == {k: v + 1 for k, v in first.items()}  # the new build, counted once
    # each later scrape asks only for builds finished after a bound (not the whole table)
    assert len(reads) == 2 and all("coalesce(builds.finished_at, builds.created_at) >" in r for r in reads), reads

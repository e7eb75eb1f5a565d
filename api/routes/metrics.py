"""/metrics in the Prometheus text format.

Everything about builds, queues, workers and engines is read from the database at scrape time (a custom
collector), so every API replica reports the same true values for all processes — workers included — and a
restarted API loses nothing; stage durations and cache hits of finished builds are counted once per process
(each scrape reads only the builds finished since the last). Only ``kiln_resolve_latency_seconds`` is in-process: it times ``GET /v1/resolve``
in this API process (an ASGI middleware; sum it over replicas)."""

from __future__ import annotations

import threading
import time
from datetime import datetime, timedelta
from typing import Iterable

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import func, select

from kiln.tables import BUILD_STATES, TERMINAL, Artifact, Build, Worker

router = APIRouter(tags=["metrics"])

ARTIFACT_STATES = ("fresh", "stale", "revoked", "rejected")
STAGES = ("resolve", "quantize", "compile", "validate", "publish")
# seconds: a cached resolve takes milliseconds, a TensorRT-LLM engine build of a large model an hour
STAGE_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, float("inf"))
RESOLVE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, float("inf"))
RESOLVE_PATH = "/v1/resolve"


def stage_histograms(stage_lists: Iterable[list], buckets=STAGE_BUCKETS) -> dict[str, tuple[list[int], float]]:
    """Per stage: cumulative bucket counts and the sum of seconds over the stages that ran (cached stages did
    no work and are counted by kiln_cache_hits_total instead)."""
    out: dict[str, tuple[list[int], float]] = {}
    for stages in stage_lists:
        for s in stages or []:
            if not isinstance(s, dict) or s.get("status") != "ran" or not isinstance(s.get("seconds"), (int, float)):
                continue
            counts, total = out.get(s.get("name", "?"), ([0] * len(buckets), 0.0))
            for i, le in enumerate(buckets):
                if s["seconds"] <= le:
                    counts[i] += 1
            out[s.get("name", "?")] = (counts, total + float(s["seconds"]))
    return out


def cache_hits(stage_lists: Iterable[list]) -> dict[str, int]:
    hits: dict[str, int] = {}
    for stages in stage_lists:
        for s in stages or []:
            if isinstance(s, dict) and s.get("status") == "cached":
                hits[s.get("name", "?")] = hits.get(s.get("name", "?"), 0) + 1
    return hits


def _le(v: float) -> str:
    return "+Inf" if v == float("inf") else repr(float(v))


#: Builds finishing this close to the last one seen are read again (commits land out of finishing order).
OVERLAP = timedelta(minutes=2)


class KilnCollector(Collector):
    """Reads the index at scrape time; ``state`` is the app's state (sessions, settings).

    Stage durations and cache hits of finished builds are kept as counters in this process: a scrape reads only
    the builds that finished since the previous one (the first scrape reads them all, once), so an open
    ``/metrics`` costs the same however many builds the table holds."""

    def __init__(self, state):
        self.state = state
        self._lock = threading.Lock()
        self._hist: dict[str, tuple[list[int], float]] = {}
        self._hits: dict[str, int] = {}
        self._seen: dict[str, datetime] = {}  # builds counted that finished within OVERLAP of the mark
        self._mark: datetime | None = None

    def _count_finished(self, session) -> None:
        when = func.coalesce(Build.finished_at, Build.created_at)
        q = select(Build.id, Build.stages, when.label("when")).where(Build.status.in_(TERMINAL))
        with self._lock:
            if self._mark is not None:
                q = q.where(when > self._mark - OVERLAP)
            rows = [r for r in session.execute(q).all() if r.id not in self._seen]
            for stage, (counts, total) in stage_histograms(r.stages for r in rows).items():
                old, old_total = self._hist.get(stage, ([0] * len(STAGE_BUCKETS), 0.0))
                self._hist[stage] = ([a + b for a, b in zip(old, counts)], old_total + total)
            for stage, n in cache_hits(r.stages for r in rows).items():
                self._hits[stage] = self._hits.get(stage, 0) + n
            for r in rows:
                self._seen[r.id] = r.when
                self._mark = r.when if self._mark is None or r.when > self._mark else self._mark
            if self._mark is not None:
                self._seen = {k: v for k, v in self._seen.items() if v > self._mark - OVERLAP}

    def describe(self):  # no collect at registration time (the database may not be reachable yet)
        return []

    def collect(self):
        from workers.liveness import is_live

        with self.state.sessions() as s:
            builds = dict(s.execute(select(Build.status, func.count()).group_by(Build.status)).all())
            queued = dict(s.execute(select(Build.queue, func.count()).where(Build.status == "queued")
                                    .group_by(Build.queue)).all())
            self._count_finished(s)
            running = [row[0] for row in s.execute(select(Build.stages).where(Build.status == "running"))]
            workers = list(s.scalars(select(Worker)))
            artifacts = dict(s.execute(select(Artifact.status, func.count()).group_by(Artifact.status)).all())

        g = GaugeMetricFamily("kiln_builds", "Builds by status (from the database).", labels=["status"])
        for status in sorted(set(BUILD_STATES) | set(builds)):
            g.add_metric([status], builds.get(status, 0))
        yield g

        h = HistogramMetricFamily("kiln_stage_duration_seconds",
                                  "Seconds each pipeline stage ran, over finished builds (cached stages excluded).",
                                  labels=["stage"])
        hist = self._hist
        for stage in sorted(set(STAGES) | set(hist), key=lambda n: (STAGES.index(n) if n in STAGES else 99, n)):
            counts, total = hist.get(stage, ([0] * len(STAGE_BUCKETS), 0.0))
            h.add_metric([stage], [(_le(le), c) for le, c in zip(STAGE_BUCKETS, counts)], total)
        yield h

        q = GaugeMetricFamily("kiln_queue_depth", "Queued builds per queue (from the database).", labels=["queue"])
        queues = set(queued) | {name for w in workers for name in (w.queues or [])}
        for name in sorted(queues):
            q.add_metric([name], queued.get(name, 0))
        yield q

        broker = self._broker_lengths(queues)
        if broker is not None:
            b = GaugeMetricFamily("kiln_broker_queue_length", "Messages waiting in the Redis broker (LLEN).",
                                  labels=["queue"])
            for name, n in sorted(broker.items()):
                b.add_metric([name], n)
            yield b

        c = CounterMetricFamily("kiln_cache_hits", "Stages answered from the cache (stage status cached).",
                                labels=["stage"])
        hits = dict(self._hits)
        for stage, n in cache_hits(running).items():
            hits[stage] = hits.get(stage, 0) + n
        for stage in sorted(set(STAGES) | set(hits), key=lambda n: (STAGES.index(n) if n in STAGES else 99, n)):
            c.add_metric([stage], hits.get(stage, 0))
        yield c

        yield GaugeMetricFamily("kiln_workers_live", "Workers with a recent heartbeat.",
                                value=sum(1 for w in workers if is_live(w)))

        a = GaugeMetricFamily("kiln_artifacts", "Engines in the index by status.", labels=["status"])
        for status in sorted(set(ARTIFACT_STATES) | set(artifacts)):
            a.add_metric([status], artifacts.get(status, 0))
        yield a

    def _broker_lengths(self, queues: set[str]) -> dict[str, int] | None:
        settings = getattr(self.state, "settings", None)
        url = getattr(settings, "broker", "") or ""
        if not url.startswith(("redis://", "rediss://")) or not queues:
            return None
        try:
            import redis

            client = redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=0.5)
            try:
                return {q: int(client.llen(q)) for q in queues}
            finally:
                client.close()
        except Exception:  # the broker being down must not break the scrape; /readyz reports it
            return None


class ResolveTimer:
    """Pure ASGI middleware: observes the latency of ``GET /v1/resolve`` (any answer) in a histogram."""

    def __init__(self, app, histogram: Histogram):
        self.app, self.histogram = app, histogram

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") != RESOLVE_PATH:
            return await self.app(scope, receive, send)
        t = time.perf_counter()
        try:
            await self.app(scope, receive, send)
        finally:
            self.histogram.observe(time.perf_counter() - t)


def install(app: FastAPI) -> None:
    """One registry per app (tests build many apps): the database collector and the resolve timer."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(KilnCollector(app.state))
    histogram = Histogram("kiln_resolve_latency_seconds", "Latency of GET /v1/resolve in this API process.",
                          buckets=RESOLVE_BUCKETS, registry=registry)
    app.state.metrics_registry = registry
    app.add_middleware(ResolveTimer, histogram=histogram)


@router.get("/metrics", include_in_schema=False)
def metrics(request: Request) -> Response:
    """Prometheus text exposition."""
    registry = getattr(request.app.state, "metrics_registry", None)
    if registry is None:  # the router without install(): database metrics only
        registry = CollectorRegistry(auto_describe=False)
        registry.register(KilnCollector(request.app.state))
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

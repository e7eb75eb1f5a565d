"""Soak: a matrix of builds on three workers that share no disk, while workers are killed (SIGKILL, the whole
process group) at random stages and restarted, Redis is restarted once (its queue lost: nothing persisted) and
``kiln gc`` runs mid-way. Then it checks what must hold however the faults fell:

- every build ends in a terminal state, and exactly once (one terminal status event per build);
- no engine is published twice (one index row per build key; no tag moved twice to one digest);
- ``kiln fsck`` finds no blob corrupted and none missing that an engine, referrer or stage output needs.

The real stack: a PostgreSQL database of its own, a ``redis-server`` of its own on a free port (never a shared
one), ``kiln api`` and three ``kiln worker`` processes, each worker with its own KILN_HOME, one local store.

    python bench/soak.py [--builds 6] [--kills 3] [--seed 1] [--timeout 1800]

Prints one JSON summary and exits 1 if a check failed. Small defaults: the dev machines have 2 shared cores."""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scripts.devstack import Stack, free_port, postgres_database  # noqa: E402

TERMINAL = ("succeeded", "failed", "cancelled")
KILL_STAGES = ("quantize", "compile", "validate", "publish")
WORKERS = ("soak-w1", "soak-w2", "soak-w3")


class Redis:
    """A redis-server of our own: no persistence, so a restart empties the broker."""

    def __init__(self, base: Path) -> None:
        self.port, self.dir, self.proc = free_port(), base / "redis", None
        self.dir.mkdir()
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", str(self.dir)],
                                     stdout=open(self.dir / "log", "a"), stderr=subprocess.STDOUT)
        deadline = time.time() + 20
        while subprocess.run(["redis-cli", "-p", str(self.port), "ping"], capture_output=True,
                             text=True).stdout.strip() != "PONG":
            if time.time() > deadline:
                raise SystemExit("redis-server did not start")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)
        self.proc = None


def matrix(n: int) -> list[dict]:
    """``n`` distinct builds of the shipped tiny model: FP8 and NVFP4 × two small profiles × gate variants (the
    gates change the build key, not the stage keys: later builds reuse stage outputs from the store)."""
    profiles = [{"name": "soak-a", "max_batch_size": 1, "max_input_len": 32, "max_seq_len": 64, "max_num_tokens": 64},
                {"name": "soak-b", "max_batch_size": 2, "max_input_len": 32, "max_seq_len": 64, "max_num_tokens": 128}]
    specs = []
    for i in range(n):
        precision = ("fp8", "nvfp4")[i % 2]
        specs.append({"checkpoint": str(ROOT / "examples" / "tiny-llama"), "precision": precision,
                      "backend": "checkpoint", "profile": profiles[(i // 2) % 2],
                      "calibration": {"samples": 8, "seq_len": 64}, "evaluation": {"max_tokens": 512},
                      "gates": {"max_mean_kl": 0.5 + i / 100, "max_ppl_increase_pct": 50},
                      "override_reason": "a soak build: a short evaluation, loose gates for distinct keys"})
    return specs


def sql(url: str, query: str, **params) -> list:
    import sqlalchemy as sa

    engine = sa.create_engine(url)
    with engine.connect() as c:
        rows = c.execute(sa.text(query), params).all()
    engine.dispose()
    return rows


def soak(args: argparse.Namespace, base: Path) -> dict:
    rng = random.Random(args.seed)
    redis = Redis(base)
    redis.start()
    try:
        with postgres_database() as db_url:
            stack = Stack(base / "kiln", {"KILN_DATABASE_URL": db_url, "KILN_BROKER_URL": redis.url,
                                          "KILN_HEARTBEAT_S": "1", "KILN_WORKER_LIVE_WINDOW_S": "4"})
            stack.home.mkdir(parents=True)
            if stack.kiln("db", "upgrade").returncode != 0:
                raise SystemExit("db upgrade failed")
            try:
                return run(args, rng, stack, redis, db_url)
            finally:
                stack.close()
    finally:
        redis.stop()


def run(args, rng: random.Random, stack: Stack, redis: Redis, db_url: str) -> dict:
    t0 = time.time()
    stack.start_api()
    for name in WORKERS:
        stack.start_worker(name)
    ids = []
    for spec in matrix(args.builds):
        r = stack.post("/v1/builds", spec)
        if r.status_code not in (200, 202):
            raise SystemExit(f"submit answered {r.status_code}: {r.text}")
        ids.append(r.json()["id"])

    kills: list[dict] = []
    faults: list[str] = []
    redis_at = rng.randrange(args.kills + 1)  # Redis restarts once, after this many kills
    gc_thread: threading.Thread | None = None
    gc_result: dict = {}
    deadline = t0 + args.timeout
    slot = 0
    while time.time() < deadline:
        builds = [stack.get(f"/v1/builds/{i}").json() for i in ids]
        if all(b["status"] in TERMINAL for b in builds):
            break
        running = any(b["status"] == "running" for b in builds)
        if slot == redis_at and running:
            redis.stop()
            time.sleep(1)
            redis.start()
            faults.append(f"redis restarted at {time.time() - t0:.0f}s")
            redis_at = -1
        if gc_thread is None and running and (slot >= 1 or time.time() - t0 > 60):  # GC while builds run (default grace: stage outputs stay)
            def gc() -> None:
                p = stack.kiln("gc", "--keep", "0", "--older-than-days", "0")
                gc_result.update(rc=p.returncode, out=p.stdout.strip(), err=p.stderr.strip()[-500:])
            gc_thread = threading.Thread(target=gc)
            gc_thread.start()
            faults.append(f"gc started at {time.time() - t0:.0f}s")
        if len(kills) < args.kills:
            target = rng.choice(KILL_STAGES)
            victim = next((b for b in builds if b["status"] == "running" and b.get("stage") == target
                           and b.get("worker") in stack.procs), None)
            if victim is None and time.time() - t0 > 30 * (len(kills) + 1):  # that stage is rare: any running one
                victim = next((b for b in builds if b["status"] == "running" and b.get("worker") in stack.procs), None)
            if victim is not None:
                name = victim["worker"]
                stack.stop(name, sig=signal.SIGKILL)
                kills.append({"worker": name, "build": victim["id"], "stage": victim.get("stage"),
                              "at_s": round(time.time() - t0)})
                slot += 1
                time.sleep(rng.uniform(0.5, 3))
                stack.start_worker(name)  # the same home: a container restarted on its own volume
        time.sleep(0.5)
    if gc_thread is not None:
        gc_thread.join(300)

    builds = [stack.get(f"/v1/builds/{i}").json() for i in ids]
    terminal_events = {i: sql(db_url, "SELECT data FROM build_events WHERE build_id = :b AND kind = 'status'", b=i)
                       for i in ids}
    once = {i: sum(1 for (d,) in rows if (d if isinstance(d, dict) else json.loads(d))["status"] in TERMINAL)
            for i, rows in terminal_events.items()}
    dup_keys = sql(db_url, "SELECT build_key, count(*) FROM artifacts GROUP BY build_key HAVING count(*) > 1")
    dup_tags = sql(db_url, "SELECT new_digest, count(*) FROM tag_events WHERE new_digest IS NOT NULL "
                           "GROUP BY repository, name, new_digest HAVING count(*) > 1")
    fsck = stack.kiln("fsck")
    stage_status: dict[str, dict[str, int]] = {}
    for b in builds:
        for st in b.get("stages") or []:
            stage_status.setdefault(st["name"], {}).setdefault(st["status"], 0)
            stage_status[st["name"]][st["status"]] += 1
    checks = {
        "all_terminal": all(b["status"] in TERMINAL for b in builds),
        "terminal_exactly_once": all(n == 1 for n in once.values()),
        "no_engine_published_twice": not dup_keys and not dup_tags,
        "fsck_clean": fsck.returncode == 0 and "0 corrupted, 0 missing" in fsck.stdout,
        "gc_ok": gc_result.get("rc", 0) == 0,
    }
    return {
        "seconds": round(time.time() - t0), "builds": len(ids), "seed": args.seed,
        "statuses": {s: sum(1 for b in builds if b["status"] == s) for s in {b["status"] for b in builds}},
        "attempts": sorted(b.get("attempts") or 0 for b in builds), "kills": kills, "faults": faults,
        "stage_status": stage_status, "gc": gc_result.get("out"), "fsck": fsck.stdout.strip().splitlines()[-1:],
        "checks": checks, "passed": all(checks.values()),
        "stuck": [{"id": b["id"], "status": b["status"], "reason": b.get("reason")} for b in builds
                  if b["status"] not in TERMINAL],
        "terminal_events": {i: n for i, n in once.items() if n != 1},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--builds", type=int, default=6)
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=1800, help="seconds before unfinished builds count as stuck")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs, homes, store)")
    args = ap.parse_args()
    if not shutil.which("redis-server"):
        raise SystemExit("needs redis-server on PATH (Debian package redis-server)")
    base = Path(tempfile.mkdtemp(prefix="kiln-soak-"))
    try:
        summary = soak(args, base)
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    summary["workdir"] = str(base) if args.keep else None
    print(json.dumps(summary, indent=1))
    sys.exit(0 if summary["passed"] else 1)


if __name__ == "__main__":
    main()

"""Service benchmarks on the real stack (PostgreSQL on 127.0.0.1, ``kiln api`` processes, wrk as the load
generator), each printed as a ratio against a bare handler on the same server:

- resolve requests/s and p99 latency with 100,000 artifacts in PostgreSQL under load (wrk -t2 -c16), against
  GET /healthz;
- the identical-rebuild answer (POST /v1/builds of an already-built spec → 200 with the artifact): its answer
  time (median latency, one request at a time on one keep-alive connection) against a resolve hit's and a bare
  GET's on the same connection, and its requests/s under the same load;
- a 64-entry matrix whose engines all exist (POST /v1/builds {"matrix": [...]}), one request at a time.

Targets (issue 17): the identical-rebuild answer ≤ 1.5 × a resolve hit at one connection (both prove freshness
with an indexed read of the database); the 64-entry matrix ≤ 50 ms.

Each figure is the median of ``--repeat`` wrk runs.

    python bench/service_bench.py [--artifacts 100000] [--seconds 5] [--repeat 3] [--api-workers 2]

Needs wrk (Debian package) and a PostgreSQL that accepts postgres@127.0.0.1 (the dev/CI machines have both)."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
PG = os.environ.get("KILN_BENCH_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432")


def wrk(url: str, seconds: int, *, script: str | None = None, connections: int = 16) -> dict[str, float]:
    """One wrk run: requests/s and the median and 99th percentile latency (ms)."""
    threads = min(2, connections)
    cmd = ["wrk", f"-t{threads}", f"-c{connections}", f"-d{seconds}s", "--latency", url]
    if script:
        cmd[1:1] = ["-s", script]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if non2xx:
        raise SystemExit(f"wrk saw {non2xx.group(1)} error responses for {url}:\n{out}")

    def ms(pct: str) -> float:
        m = re.search(pct + r"%\s+([\d.]+)(us|ms|s)\b", out)
        return float(m.group(1)) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[m.group(2)]

    return {"rps": float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1)), "p50": ms("50"), "p99": ms("99")}


def median_wrk(url: str, seconds: int, repeat: int, **kw) -> dict[str, float]:
    runs = [wrk(url, seconds, **kw) for _ in range(repeat)]
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


#: an engine row; a BuildKey already indexed (the one real engine) is left as it is
INSERT_ARTIFACT = (
    "INSERT INTO artifacts (digest, build_key, repository, tag, status, precision, target, profile, backend, "
    "checkpoint_ref, checkpoint_digest, checkpoint_revision, size, provenance, validation, created_at) VALUES "
    "(:digest, :build_key, :repository, :tag, :status, :precision, :target, :profile, :backend, :checkpoint_ref,"
    " :checkpoint_digest, :checkpoint_revision, :size, CAST(:provenance AS JSON), CAST(:validation AS JSON), now())"
    " ON CONFLICT (build_key) DO NOTHING")


def seed(url: str, n: int) -> None:
    """n artifact rows over n/100 models (100 engine variants each), one tracked head per model."""
    import sqlalchemy as sa

    engine = sa.create_engine(url)
    rows, models = [], []
    from kiln.precisions import PRECISIONS
    from kiln.targets import CPU, TARGETS

    precisions, targets, profiles = list(PRECISIONS), [CPU, *TARGETS], ["latency", "balanced", "throughput"]
    for i in range(n):
        model = f"bench/model-{i // 100}"
        np_, nt = len(precisions), len(targets)
        p, t, pr = precisions[i % np_], targets[(i // np_) % nt], profiles[(i // (np_ * nt)) % 3]
        rev = "head" if (i // 30) % 3 == 0 else f"old-{i % 7}"
        rows.append({"digest": f"sha256:{i:064x}", "build_key": f"sha256:{i + 10**9:064x}", "repository": model,
                     "tag": f"{p}-{t}-{pr}", "status": "fresh" if rev == "head" else "stale", "precision": p,
                     "target": t, "profile": pr, "backend": "aot-inductor", "checkpoint_ref": "hf://bench/m",
                     "checkpoint_digest": f"sha256:{i:064x}", "checkpoint_revision": rev, "size": 1,
                     "provenance": json.dumps({"toolchain": {"torch": "2.13.0"}}), "validation": "{}"})
        if i % 100 == 0:
            models.append({"name": model, "checkpoint": "hf://bench/m@main", "hf_repo": "bench/m", "branch": "main",
                           "head_sha": "head", "matrix": "[]", "gates": "{}"})
    with engine.begin() as c:
        c.execute(sa.text(INSERT_ARTIFACT), rows)
        c.execute(sa.text("INSERT INTO models (name, checkpoint, hf_repo, branch, head_sha, matrix, gates, created_at, "
                          "updated_at) VALUES (:name, :checkpoint, :hf_repo, :branch, :head_sha, CAST(:matrix AS JSON), "
                          "CAST(:gates AS JSON), now(), now())"), models)
    engine.dispose()


def matrix_specs(checkpoint: Path) -> list[dict]:
    """Valid specs of one checkpoint (targets × backends × precisions × profiles × KV cache)."""
    from kiln.errors import SpecError
    from kiln.spec import parse_spec

    out = []
    from kiln.backends import BACKENDS
    from kiln.kvcache import KV_CACHES
    from kiln.precisions import PRECISIONS
    from kiln.targets import CPU, TARGETS

    for target in (CPU, *TARGETS):
        for backend in (b.name for b in BACKENDS.values() if not b.gpu_only):  # what this machine can build
            for precision in PRECISIONS:
                for profile in ("latency", "balanced", "throughput"):
                    for kv in KV_CACHES:
                        spec = {"checkpoint": str(checkpoint), "precision": precision, "backend": backend,
                                "target": target, "profile": profile, "kv_cache": kv,
                                "calibration": {"samples": 8, "seq_len": 64}, "evaluation": {"max_tokens": 1024},
                                "override_reason": "a benchmark build: a short evaluation"}
                        try:
                            parse_spec(spec, [ROOT])
                        except SpecError:
                            continue
                        out.append(spec)
    return out


def seed_matrix(url: str, env: dict, specs: list[dict], n: int) -> list[dict]:
    """``n`` of ``specs`` with distinct BuildKeys (a checkpoint artifact's key has no batch profile in it), each
    given an engine row under the BuildKey the API computes for it (no workers registered: the API's own
    toolchain), so that a matrix of them is answered entirely from the registry. Returns those specs."""
    import sqlalchemy as sa

    from builder.pipeline import Builder
    from kiln.settings import Settings
    from kiln.spec import parse_spec

    settings = Settings(home=Path(env["KILN_HOME"]), database_url=env["KILN_DATABASE_URL"],
                        checkpoint_roots=env["KILN_CHECKPOINT_ROOTS"])
    builder = Builder(settings, None, None)
    rows, chosen, keys = [], [], set()
    for i, raw in enumerate(specs):
        spec = parse_spec(raw, settings.roots)
        key = builder.prepare(spec, check_environment=False)[0].build_key
        if key in keys:
            continue
        keys.add(key)
        chosen.append(raw)
        digest = f"sha256:{i + 7 * 10**9:064x}"
        # in the repository the request names (the checkpoint's default model name): an engine of another
        # repository would be named in this one on every request (a write per entry, issue 13)
        rows.append({"digest": digest, "build_key": key, "repository": spec.model_name,
                     "tag": f"m{i}", "precision": spec.precision, "target": spec.target, "profile": raw["profile"],
                     "backend": spec.backend, "status": "fresh", "checkpoint_ref": "local", "checkpoint_digest": digest,
                     "checkpoint_revision": None, "size": 1, "provenance": "{}", "validation": "{}"})
        if len(chosen) == n:
            break
    if len(chosen) < n:
        raise SystemExit(f"only {len(chosen)} distinct matrix entries")
    engine = sa.create_engine(url)
    with engine.begin() as c:
        c.execute(sa.text(INSERT_ARTIFACT), rows)
    engine.dispose()
    return chosen


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--artifacts", type=int, default=100_000)
    ap.add_argument("--seconds", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--api-workers", type=int, default=2)
    args = ap.parse_args()
    if not shutil.which("wrk"):
        raise SystemExit("wrk is not installed (apt-get install wrk)")
    import sqlalchemy as sa

    name = f"kiln_bench_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(f"{PG}/postgres", isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(sa.text(f'CREATE DATABASE "{name}"'))
    home = Path(tempfile.mkdtemp(prefix="kiln-bench-"))
    env = {**os.environ, "KILN_HOME": str(home), "KILN_DATABASE_URL": f"{PG}/{name}", "KILN_CHECKPOINT_ROOTS": str(ROOT)}
    api = None
    try:
        subprocess.run([sys.executable, "-m", "api.cli", "db", "upgrade"], env=env, check=True, cwd=ROOT)
        t = time.perf_counter()
        seed(f"{PG}/{name}", args.artifacts)
        print(f"seeded {args.artifacts:,} artifacts in {time.perf_counter() - t:.1f}s")
        # one real engine, so that an identical rebuild has something to answer with
        quick = ["build", "examples/tiny-llama", "--backend", "checkpoint", "--calib-samples", "8", "--calib-seq-len",
                 "64", "--eval-max-tokens", "1024", "--override-reason", "a benchmark build: a short evaluation",
                 "--json"]
        subprocess.run([sys.executable, "-m", "api.cli", *quick], env=env, check=True, cwd=ROOT, capture_output=True)
        port = 18000 + os.getpid() % 1000
        api = subprocess.Popen([sys.executable, "-m", "api.cli", "api", "--port", str(port), "--workers",
                                str(args.api_workers)], env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
        base = f"http://127.0.0.1:{port}"
        import httpx

        for _ in range(600):  # a loaded machine takes a while to import the API
            try:
                if httpx.get(base + "/healthz").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        resolve = base + f"/v1/resolve?model=bench/model-{min(417, args.artifacts // 100 - 1)}&precision=fp8&profile=latency&target=cpu&backend=aot-inductor"
        assert httpx.get(resolve).status_code == 200, httpx.get(resolve).text
        spec = {"checkpoint": str(ROOT / "examples" / "tiny-llama"), "precision": "fp8", "backend": "checkpoint",
                "calibration": {"samples": 8, "seq_len": 64}, "evaluation": {"max_tokens": 1024},
                "override_reason": "a benchmark build: a short evaluation"}
        answer = httpx.post(base + "/v1/builds", json=spec)
        assert answer.status_code == 200 and answer.json()["cache_hit"], answer.text
        lua = home / "post.lua"
        lua.write_text('wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
                       f"wrk.body = {json.dumps(json.dumps(spec))}\n")
        specs = seed_matrix(f"{PG}/{name}", env, matrix_specs(ROOT / "examples" / "tiny-llama"), 64)
        answer = httpx.post(base + "/v1/builds", json={"matrix": specs}, timeout=60)
        assert answer.status_code == 200 and all(b["cache_hit"] for b in answer.json()["builds"]), answer.text[:2000]
        matrix_lua = home / "matrix.lua"
        matrix_lua.write_text('wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
                              f"wrk.body = {json.dumps(json.dumps({'matrix': specs}))}\n")
        for url, script in ((base + "/healthz", None), (resolve, None), (base + "/v1/builds", str(lua)),
                            (base + "/v1/builds", str(matrix_lua))):
            wrk(url, 2, script=script)  # warm up: pools filled, statements prepared on every connection
        n, r = args.seconds, args.repeat
        bare, res = median_wrk(base + "/healthz", n, r), median_wrk(resolve, n, r)
        noop = median_wrk(base + "/v1/builds", n, r, script=str(lua))
        bare1 = median_wrk(base + "/healthz", n, r, connections=1)
        res1 = median_wrk(resolve, n, r, connections=1)
        noop1 = median_wrk(base + "/v1/builds", n, r, script=str(lua), connections=1)
        matrix1 = median_wrk(base + "/v1/builds", n, r, script=str(matrix_lua), connections=1)
        print(f"api workers {args.api_workers}; medians of {r} wrk runs of {n}s; 2 cores shared by server and load")
        print("under load (wrk -t2 -c16):")
        print(f"  bare GET /healthz:        {bare['rps']:8.0f} req/s  p99 {bare['p99']:6.1f} ms")
        print(f"  resolve ({args.artifacts:,} artifacts): {res['rps']:8.0f} req/s  p99 {res['p99']:6.1f} ms  -> {res['rps'] / bare['rps']:.2f} x bare")
        print(f"  identical rebuild (POST): {noop['rps']:8.0f} req/s  p99 {noop['p99']:6.1f} ms  -> {noop['rps'] / bare['rps']:.2f} x bare")
        print("one request at a time (wrk -t1 -c1, keep-alive):")
        print(f"  bare GET /healthz:        median {bare1['p50'] * 1e3:6.0f} us")
        print(f"  resolve hit:              median {res1['p50'] * 1e3:6.0f} us")
        print(f"  identical rebuild (POST): median {noop1['p50'] * 1e3:6.0f} us  -> "
              f"{noop1['p50'] / res1['p50']:.2f} x a resolve hit (target <= 1.5), {noop1['p50'] / bare1['p50']:.2f} x a bare GET")
        print(f"  64-entry matrix, all built: median {matrix1['p50']:6.1f} ms (target <= 50 ms)")
    finally:
        if api:
            api.terminate()
            api.wait(30)
        with admin.connect() as c:
            c.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()

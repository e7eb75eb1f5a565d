"""A real Kiln stack as processes, for the integration tests and the soak bench: a PostgreSQL database of its own,
a database of a ``redis-server`` of its own (started on a free port by tests/integration/conftest.py, or by
bench/soak.py; never the shared Redis), ``kiln api`` (uvicorn) and ``kiln worker`` (Celery) subprocesses, and HTTP
helpers. It lives outside tests/ so that bench/ need not import the tests (pyproject's import contracts)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent

PG = os.environ.get("KILN_TEST_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def postgres_database():
    """A fresh database, dropped afterwards; yields its SQLAlchemy URL."""
    import sqlalchemy as sa

    name = f"kiln_test_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(f"{PG}/postgres", isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(sa.text(f'CREATE DATABASE "{name}"'))
    try:
        yield f"{PG}/{name}"
    finally:
        from kiln.db import get_engine

        get_engine.cache_clear()
        with admin.connect() as c:
            c.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


class RedisServer:
    """A ``redis-server`` of the test session's own, on a free port, without persistence: tests may flush its
    databases (each takes a new one); nobody else's keys live there."""

    def __init__(self, log: Path):
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}"
        self._log = open(log, "w")
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no"], stdout=self._log, stderr=subprocess.STDOUT)
        self._next = iter(range(16))
        import redis

        deadline = time.monotonic() + 20
        while True:
            try:
                redis.Redis.from_url(self.url).ping()
                return
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server did not start on port {self.port} (see {log})") from None
                time.sleep(0.05)

    def database(self) -> str:
        """The URL of a database no earlier test used (16 per server)."""
        return f"{self.url}/{next(self._next)}"

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def redis_url(server: RedisServer) -> str:
    """A Redis database of the suite's own server that no other test uses."""
    return server.database()


class Stack:
    """The API (and the CLI) with ``home`` as KILN_HOME; every worker with a KILN_HOME of its own (as each container
    or GPU node has its own disk), so the database, broker and store are always named explicitly: those given in
    ``env``, else the embedded defaults under ``home``, shared by all."""

    def __init__(self, home: Path, env: dict[str, str]):
        shared = {"KILN_DATABASE_URL": f"sqlite:///{home / 'kiln.db'}",
                  "KILN_BROKER_URL": f"sqla+sqlite:///{home / 'broker.db'}", "KILN_STORE_URL": f"file://{home / 'store'}"}
        self.home, self.env = home, {**os.environ, **shared, **env, "KILN_HOME": str(home),
                                     "KILN_CHECKPOINT_ROOTS": f"{REPO}{os.pathsep}{home.parent}"}
        self.procs: dict[str, subprocess.Popen] = {}
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    def kiln(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "api.cli", *args], cwd=REPO, env=self.env,
                              capture_output=True, text=True, timeout=timeout)

    def worker_home(self, name: str) -> Path:
        """The KILN_HOME of worker ``name`` (its stage cache lives there, nowhere else)."""
        return self.home.parent / f"home-{name}"

    def start(self, name: str, *args: str, home: Path | None = None) -> subprocess.Popen:
        log = open(self.home.parent / f"{name}.log", "w")
        env = self.env if home is None else {**self.env, "KILN_HOME": str(home)}
        proc = subprocess.Popen([sys.executable, "-m", "api.cli", *args], cwd=REPO, env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        return (self.home.parent / f"{name}.log").read_text()

    def start_api(self) -> None:
        self.start("api", "api", "--port", str(self.port))
        self.wait_http("/healthz")

    def start_worker(self, name: str, *args: str) -> None:
        self.start(name, "worker", "--name", name, *args, home=self.worker_home(name))
        deadline = time.time() + 60
        while time.time() < deadline:
            workers = httpx.get(f"{self.url}/v1/workers").json()["workers"]
            if any(w["name"] == name and w["live"] for w in workers) and "ready" in self.log(name):
                return
            time.sleep(0.5)
        raise AssertionError(f"worker {name} did not start:\n{self.log(name)}")

    def wait_http(self, path: str, timeout: float = 60) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                if httpx.get(self.url + path, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise AssertionError(f"{path} never answered:\n" + "\n".join(self.log(n) for n in self.procs))

    def stop(self, name: str, sig: int = signal.SIGTERM) -> None:
        proc = self.procs.pop(name)
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def close(self) -> None:
        for name in list(self.procs):
            self.stop(name)

    # -- HTTP helpers --------------------------------------------------------------------------------
    def post(self, path: str, body) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=120)

    def put(self, path: str, body) -> httpx.Response:
        return httpx.put(self.url + path, json=body, timeout=120)

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.url + path, timeout=30)

    def wait_build(self, build_id: str, states=("succeeded", "failed", "cancelled"), timeout: float = 300) -> dict:
        deadline = time.time() + timeout
        while time.time() < deadline:
            b = self.get(f"/v1/builds/{build_id}").json()
            if b["status"] in states:
                return b
            time.sleep(0.5)
        raise AssertionError(f"build {build_id} stuck in {b['status']}:\n" + "\n".join(self.log(n) for n in self.procs))


@contextmanager
def served(home: Path, env: dict[str, str] | None = None):
    """``kiln serve`` (the embedded default: SQLite, SQLite broker, local store) with extra environment."""
    s = Stack(home, env or {})
    for var in ("KILN_DATABASE_URL", "KILN_BROKER_URL", "KILN_STORE_URL"):
        s.env.pop(var, None)
    s.start("serve", "serve", "--port", str(s.port))
    try:
        s.wait_http("/healthz")
        yield s
    finally:
        s.close()


def tiny_spec(**overrides) -> dict:
    """A quick build of the shipped model: checkpoint backend, a short evaluation text."""
    spec = {"checkpoint": str(REPO / "examples" / "tiny-llama"), "precision": "fp8", "profile": "latency",
            "backend": "checkpoint", "calibration": {"samples": 8, "seq_len": 64},
            "evaluation": {"max_tokens": 1024}, "override_reason": "a test build: a short evaluation"}
    spec.update(overrides)
    return spec

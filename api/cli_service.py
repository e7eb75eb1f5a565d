"""``kiln api``, ``kiln worker``, ``kiln serve``: the service's processes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import click

from api.cli_base import main
from kiln.errors import SpecError


def _upgrade_embedded_db() -> None:
    from kiln import db
    from kiln.settings import get_settings

    url = get_settings().db_url
    if url.startswith("sqlite"):
        db.upgrade(url)


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=int)
@click.option("--workers", default=1, show_default=True, type=int, help="uvicorn worker processes")
@click.option("--ssl-certfile", type=click.Path(exists=True, dir_okay=False),
              help="serve HTTPS with this certificate (PEM; e.g. for the Kubernetes admission webhook)")
@click.option("--ssl-keyfile", type=click.Path(exists=True, dir_okay=False), help="the certificate's private key (PEM)")
def api(host: str, port: int, workers: int, ssl_certfile: str | None, ssl_keyfile: str | None) -> None:
    """Run the HTTP API (uvicorn)."""
    import uvicorn

    from kiln.errors import SpecError

    if bool(ssl_certfile) != bool(ssl_keyfile):
        raise SpecError("--ssl-certfile and --ssl-keyfile go together", field="ssl_keyfile" if ssl_certfile
                        else "ssl_certfile", fix="give both (the certificate and its key), or neither for HTTP")
    _upgrade_embedded_db()
    uvicorn.run("api.app:create_app", factory=True, host=host, port=port, workers=workers, log_level="info",
                access_log=workers == 1, ssl_certfile=ssl_certfile, ssl_keyfile=ssl_keyfile, **proxy_options())


def proxy_options() -> dict:
    """uvicorn honours X-Forwarded-For from 127.0.0.1 by default: a client of a proxy on the same host would choose
    its own address (the one failed token checks are counted against). Only KILN_FORWARDED_ALLOW_IPS's proxies."""
    from kiln.settings import Settings

    allow = Settings().forwarded_allow_ips
    return {"proxy_headers": True, "forwarded_allow_ips": allow} if allow else {"proxy_headers": False}


def _heartbeat_loop(name: str, queues: list[str], stop: threading.Event) -> None:
    """Heartbeats, and the reconciler every few beats (see workers/reconcile.py)."""
    from workers.celery_app import app
    from workers.reconcile import reclaim_orphans, redis_depth, requeue_lost
    from workers.liveness import HEARTBEAT_S, heartbeat, record_beat
    from workers.services import build_services

    services = build_services()
    settings, sessions = services.settings, services.sessions
    beats, db_at = 0, time.time()  # registered just before this loop started
    while not stop.wait(HEARTBEAT_S):
        beats += 1
        try:
            try:
                with sessions() as s:
                    heartbeat(s, name)
                db_at = time.time()
            finally:
                record_beat(settings.home_dir, name, db_at)  # for `kiln worker-probe`: the loop turned, database or not
            if beats % 2 == 0:
                for build_id in reclaim_orphans(sessions, services.enqueue):
                    click.echo(f"kiln worker {name}: re-enqueued {build_id} (its worker stopped)", err=True)
                for build_id in requeue_lost(sessions, queues, services.enqueue, redis_depth(app)):
                    click.echo(f"kiln worker {name}: re-enqueued {build_id} (its message was lost)", err=True)
        except Exception as exc:  # the database or broker may be briefly away; the next beat retries
            click.echo(f"kiln worker: heartbeat/reconcile failed: {exc}", err=True)


def requeue_waiting(queues: list[str]) -> int:
    """At start: re-enqueue every queued build of these queues (their messages may be lost, e.g. the broker was
    emptied). Duplicate messages are harmless: a build is claimed atomically by exactly one worker."""
    from workers.reconcile import requeue_lost
    from workers.services import build_services

    services = build_services()
    return len(requeue_lost(services.sessions, queues, services.enqueue, lambda queue: 0, min_age_s=0))


@main.command()
@click.option("--queues", help="serve only these queues (comma separated); default: all this machine can build")
@click.option("--concurrency", default=1, show_default=True, type=int, help="builds at once")
@click.option("--name", help="worker name (default: host-pid)")
def worker(queues: str | None, concurrency: int, name: str | None) -> None:
    """Run a Celery build worker on the queues this machine can serve."""
    from kiln.settings import get_settings
    from workers.capabilities import detect
    from workers.liveness import record_beat, register
    from workers.services import build_services

    get_settings()  # a refused setting (a shipped placeholder) stops the worker before anything else
    if concurrency < 1:
        raise SpecError(f"--concurrency must be at least 1, not {concurrency}", field="concurrency",
                        fix="give the number of builds this worker runs at once, e.g. --concurrency 1")
    caps = detect()
    chosen = caps["queues"]
    if queues:
        chosen = [q.strip() for q in queues.split(",") if q.strip()]
        unknown = [q for q in chosen if q not in caps["queues"]]
        if unknown:
            raise SpecError(f"this machine cannot build for {', '.join(unknown)}", field="queues",
                            fix=f"choose from: {', '.join(caps['queues'])}")
        caps = {**caps, "queues": chosen, "toolchains": {q: caps["toolchains"][q] for q in chosen}}
    services = build_services(upgrade_embedded=True)
    name = name or f"{socket.gethostname()}-{os.getpid()}"
    os.environ["KILN_WORKER_NAME"] = name
    os.environ["KILN_WORKER_CONCURRENCY"] = str(concurrency)  # each pool process's share of the cores (workers/tasks.py)
    with services.sessions() as s:
        register(s, name, caps)
    record_beat(services.settings.home_dir, name, time.time())
    stop = threading.Event()
    threading.Thread(target=_heartbeat_loop, args=(name, chosen, stop), daemon=True).start()
    click.echo(f"kiln worker {name}: queues {', '.join(chosen)}", err=True)
    from workers.celery_app import app

    requeued = requeue_waiting(chosen)
    if requeued:
        click.echo(f"kiln worker {name}: re-enqueued {requeued} waiting build(s)", err=True)
    try:
        app.worker_main(["worker", "-Q", ",".join(chosen), "-c", str(concurrency), "-n", f"{name}@%h",
                         "-l", "INFO", "-P", "prefork", "--without-gossip", "--without-mingle"])
    finally:
        stop.set()


@main.command("worker-probe")
@click.argument("check", type=click.Choice(["live", "ready"]))
def worker_probe(check: str) -> None:
    """Exit 0 if the `kiln worker` of this KILN_HOME is live (its heartbeat loop turned within
    KILN_WORKER_LIVE_WINDOW_S) or ready (and its heartbeat reached the database within it); else one line and exit
    1. For a pod's exec probes: it reads a file the worker writes, and asks no server."""
    from kiln.settings import get_settings
    from workers.liveness import probe

    why = probe(get_settings().home_dir, check)
    if why:
        click.echo(f"kiln worker-probe: {check}: {why}", err=True)
        sys.exit(1)
    click.echo(f"kiln worker-probe: {check}: ok")


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=int)
def serve(host: str, port: int) -> None:
    """The embedded default: the API and one worker together (SQLite, SQLite broker, local store; no servers)."""
    _upgrade_embedded_db()
    child = subprocess.Popen([sys.executable, "-m", "api.cli", "worker"], env=os.environ.copy())
    try:
        time.sleep(0.5)
        if child.poll() is not None:
            raise click.ClickException("the worker did not start")
        import uvicorn

        from api.app import create_app

        # uvicorn re-raises the SIGTERM it caught once it has shut down; by default that kills this process
        # before the finally below stops the worker. Raised as SystemExit instead, the finally runs.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        uvicorn.run(create_app(), host=host, port=port, log_level="info", **proxy_options())
    finally:
        child.send_signal(signal.SIGTERM)
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()

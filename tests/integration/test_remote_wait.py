"""``kiln build --server … --wait`` through a network that misbehaves, against a real ``kiln serve``: a TCP proxy in
this file sits between the CLI and the server and cuts connections the way ingress proxies and load balancers do —
when idle for a while, after a fixed lifetime, or by refusing the event stream outright. The build's stage lines must
come through once each, the wait must end with the build, and a wait with ``--timeout`` must give up with exit 4."""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from api.progress import HEARTBEAT_LINE
from scripts.devstack import served as embedded
from tests.conftest import REPO

pytestmark = pytest.mark.slow

STAGES = ("resolve", "quantize", "compile", "validate", "publish")


class CuttingProxy:
    """Forwards 127.0.0.1:<port> to the server; cuts a connection idle for ``idle`` seconds, any connection older
    than ``life`` seconds, or, with ``refuse``, closes every connection whose request line contains that text.
    With ``lose``, the first request whose request line contains that text reaches the server, and its connection
    is cut when the server's answer starts: the server did the work, the client never hears of it."""

    def __init__(self, upstream: int, *, idle: float | None = None, life: float | None = None,
                 refuse: bytes | None = None, lose: bytes | None = None):
        self.upstream, self.idle, self.life, self.refuse, self.lose = upstream, idle, life, refuse, lose
        self.cuts = {"idle": 0, "life": 0, "refused": 0, "lost": 0}
        self.longest_quiet = 0.0  # the longest time a stream from the server sent nothing, while it stayed open
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self.closed:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._pipe, args=(conn,), daemon=True).start()

    def _pipe(self, client: socket.socket) -> None:
        upstream = socket.create_connection(("127.0.0.1", self.upstream))
        born = heard = time.monotonic()
        losing = False  # this connection carries the request whose answer is lost
        try:
            while not self.closed:
                ready, _, _ = select.select([client, upstream], [], [], 0.1)
                now = time.monotonic()
                if self.idle is not None and now - heard > self.idle:
                    self.cuts["idle"] += 1
                    return
                if self.life is not None and now - born > self.life:
                    self.cuts["life"] += 1
                    return
                for sock in ready:
                    data = sock.recv(65536)
                    if not data:
                        return
                    if sock is client and self.refuse and self.refuse in data.split(b"\r\n", 1)[0]:
                        self.cuts["refused"] += 1
                        return
                    if sock is client and self.lose and not self.cuts["lost"] and self.lose in data.split(b"\r\n", 1)[0]:
                        losing = True
                    if sock is upstream and losing:
                        self.cuts["lost"] += 1
                        return
                    if sock is upstream:
                        self.longest_quiet = max(self.longest_quiet, now - heard)
                    heard = now
                    (upstream if sock is client else client).sendall(data)
        except OSError:
            return
        finally:
            client.close()
            upstream.close()

    def close(self) -> None:
        self.closed = True
        self.server.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with embedded(tmp_path_factory.mktemp("remote-wait") / "kiln", {}) as s:
        yield s


def kiln_build(served, server: str, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    tiny = REPO / "examples" / "tiny-llama"
    argv = [sys.executable, "-m", "api.cli", "build", str(tiny), "--server", server, "--model-name", "acme/wait",
            "--override-reason", "a test build: a short evaluation", "--eval-max-tokens", "1024", *args]
    env = {**served.env, "PYTHONPATH": str(REPO), "KILN_TOKEN": ""}
    return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def test_a_wait_survives_a_proxy_that_cuts_every_connection_after_3s(served):
    proxy = CuttingProxy(served.port, life=3.0)
    try:
        proc = kiln_build(served, proxy.url, "--backend", "checkpoint", "--calib-samples", "8", "--calib-seq-len", "64")
    finally:
        proxy.close()
    assert proc.returncode == 0, proc.stderr + served.log("serve")[-3000:]
    assert proxy.cuts["life"] >= 1, "the build ended before the proxy cut anything: the test proved nothing"
    assert "reconnecting" in proc.stderr
    # a stage's heartbeat ("validate  peak memory at …  10.0 s", when a stage outlasts the heartbeat interval on a
    # busy machine) is progress, not the stage's result line
    lines = [line for line in proc.stderr.splitlines() if not HEARTBEAT_LINE.match(line)]
    for stage in STAGES:  # every stage's line once: a resumed stream neither loses nor repeats an event
        assert sum(1 for line in lines if line.split()[:1] == [stage]) == 1, proc.stderr
    assert "PASSED" in proc.stdout


def test_a_submission_whose_answer_is_lost_is_asked_again_and_joins_the_build_it_made(served):
    # the POST reaches the server, which creates and queues the build; the proxy cuts the connection as the answer
    # starts (an ingress's lifetime limit, a load balancer restarting). Asked again, the identical request is
    # answered with that same build: one build on the server, followed to its end.
    proxy = CuttingProxy(served.port, lose=b"POST /v1/builds")
    try:
        proc = kiln_build(served, proxy.url, "--backend", "checkpoint", "--calib-samples", "6", "--calib-seq-len", "64",
                          "--model-name", "acme/lost-answer")
    finally:
        proxy.close()
    assert proxy.cuts["lost"] == 1, proxy.cuts
    assert proc.returncode == 0, proc.stderr + served.log("serve")[-3000:]
    assert "the answer to the submission was cut (RemoteProtocolError); asking again" in proc.stderr
    builds = httpx.get(f"{served.url}/v1/builds", params={"model": "acme/lost-answer"}).json()
    assert builds["total"] == 1 and builds["builds"][0]["status"] == "succeeded", builds
    assert "PASSED" in proc.stdout


def test_keep_alives_hold_a_quiet_stream_open_through_an_idle_timeout_and_timeout_gives_up_with_exit_4(served):
    # a build no worker can take (this server's embedded worker builds for the CPU; nothing serves TensorRT-LLM
    # engines): it stays queued, its stream has nothing to say, and only the keep-alives cross the proxy
    proxy = CuttingProxy(served.port, idle=10.0)
    t0 = time.monotonic()
    try:
        proc = kiln_build(served, proxy.url, "--backend", "trtllm-engine", "--target", "h100", "--timeout", "16")
    finally:
        proxy.close()
    took = time.monotonic() - t0
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert 16 <= took < 60
    # keep-alives every 5 s: the longest silence stays under the proxy's 10 s idle limit, with room for a server
    # slowed by the builds the other test worker runs
    assert proxy.cuts["idle"] == 0 and 0 < proxy.longest_quiet < 9.0, (proxy.cuts, proxy.longest_quiet)
    err = proc.stderr.strip().splitlines()
    assert any(line.strip().startswith("queued: ") and "worker" in line for line in err), proc.stderr
    assert "had not finished after 16s" in err[-1] and "timeout" in err[-1] and "cancel" in err[-1]
    build_id = next(w for w in err[0].split() if len(w) >= 16)  # "build <id> queued on <server>"
    listed = httpx.get(f"{served.url}/v1/builds/{build_id}").json()
    assert listed["status"] == "queued"  # giving up the wait leaves the build be
    httpx.post(f"{served.url}/v1/builds/{build_id}/cancel")


def test_a_wait_falls_back_to_polling_when_the_event_stream_never_comes(served, monkeypatch, capsys):
    import api.remote as remote

    monkeypatch.setattr(remote, "FIRST_BACKOFF_S", 0.05)
    monkeypatch.setattr(remote, "MAX_BACKOFF_S", 0.1)
    monkeypatch.setattr(remote, "POLL_S", 0.5)
    monkeypatch.setenv("KILN_TOKEN", "")
    proxy = CuttingProxy(served.port, refuse=b"/events")
    spec = {"checkpoint": str(REPO / "examples" / "tiny-llama"), "precision": "fp8", "backend": "checkpoint",
            "calibration": {"samples": 4, "seq_len": 64}, "evaluation": {"max_tokens": 1024},
            "model_name": "acme/wait", "override_reason": "a test build: a short evaluation"}
    try:
        out = remote.remote_build(proxy.url, spec, wait=True, as_json=True, progress=lambda *a: None,
                                  summary=lambda out: None, timeout=900)
    finally:
        proxy.close()
    assert out["status"] == "succeeded" and out["digest"].startswith("sha256:")
    assert proxy.cuts["refused"] == remote.RECONNECT_TRIES + 1
    assert "polling the build" in capsys.readouterr().err


def test_timeout_without_a_remote_wait_is_refused_before_any_work(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "KILN_HOME": str(tmp_path / "home")}
    proc = subprocess.run([sys.executable, "-m", "api.cli", "build", str(REPO / "examples" / "tiny-llama"),
                           "--timeout", "5"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "timeout" in proc.stderr, proc.stderr
    assert not (tmp_path / "home").exists() or not any((tmp_path / "home").rglob("*.safetensors"))


"""The embedded default, ``kiln serve``: API and a worker on SQLite, a SQLite broker and the local store —
no servers — passing the same API checks as the distributed stack."""

from __future__ import annotations

import pytest

from tests.integration import api_checks
from scripts.devstack import tiny_spec
from scripts.devstack import served as embedded

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with embedded(tmp_path_factory.mktemp("serve") / "kiln", {}) as s:
        yield s


def test_embedded_health_and_defaults(served):
    api_checks.health(served)
    assert (served.home / "kiln.db").is_file()


def test_embedded_build_end_to_end(served):
    done = api_checks.submit_follow_and_query(served, tiny_spec())
    blobs = list((served.home / "store").rglob("sha256/*"))
    assert any(done["digest"].endswith(p.name) for p in blobs)


def test_embedded_bad_requests(served):
    api_checks.bad_requests_are_4xx_with_json(served)


def test_sigterm_to_kiln_serve_stops_its_worker(tmp_path):
    """A process manager signals the serve process alone (not its group): the worker must not outlive it."""
    import os
    import signal
    import time
    from pathlib import Path

    with embedded(tmp_path / "kiln") as s:
        proc = s.procs["serve"]
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        assert children, "kiln serve started no worker"
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
        deadline = time.time() + 60
        alive = children
        while alive and time.time() < deadline:
            alive = [c for c in children if Path(f"/proc/{c}").exists()
                     and Path(f"/proc/{c}/stat").read_text().split(")")[-1].split()[0] != "Z"]
            time.sleep(0.5)
        assert not alive, f"the worker {alive} outlived kiln serve:\n{s.log('serve')[-2000:]}"


def test_a_running_build_shows_what_its_stage_is_doing_and_a_finished_one_does_not(served):
    import time

    spec = tiny_spec(calibration={"samples": 12, "seq_len": 64})  # not the build above: this one runs its stages
    build = served.post("/v1/builds", spec).json()
    seen, deadline = [], time.time() + 600
    while time.time() < deadline:
        b = served.get(f"/v1/builds/{build['id']}").json()
        if b["status"] in ("succeeded", "failed", "cancelled"):
            break
        if b["progress"]:
            seen.append((b["stage"], b["progress"]))
        time.sleep(0.1)
    assert b["status"] == "succeeded" and b["progress"] is None, b
    assert seen and all(stage == p["stage"] for stage, p in seen), seen
    assert {p["step"] for _, p in seen} & {"calibration batch", "evaluation window", "reference window",
                                          "throughput point", "decode latency batch size"}, seen

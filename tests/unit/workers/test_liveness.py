"""workers/liveness.py's heartbeat file and ``kiln worker-probe``: what a worker pod's exec probes run. Live: the
heartbeat loop turned within the live window, whatever the database does; ready: a heartbeat also reached the
database within it (when GET /v1/workers lists the worker as live)."""

from __future__ import annotations

import json
import threading
import time

import pytest
from click.testing import CliRunner

import workers.liveness as liveness
from api.cli import main as kiln_main
from workers.liveness import BEAT_FILE, LIVE_WINDOW_S, probe, record_beat


def test_a_fresh_beat_is_live_and_ready(tmp_path):
    record_beat(tmp_path, "w-1", db_at=1000.0, now=1000.0)
    assert json.loads((tmp_path / BEAT_FILE).read_text()) == {"name": "w-1", "beat": 1000.0, "db": 1000.0}
    assert probe(tmp_path, "live", now=1001.0) is None
    assert probe(tmp_path, "ready", now=1001.0) is None


def test_a_stopped_loop_is_neither_live_nor_ready(tmp_path):
    record_beat(tmp_path, "w-1", db_at=1000.0, now=1000.0)
    later = 1000.0 + LIVE_WINDOW_S + 1
    for check in ("live", "ready"):
        why = probe(tmp_path, check, now=later)
        assert why and "w-1" in why and "heartbeat loop last turned" in why


def test_a_database_outage_leaves_the_worker_live_but_not_ready(tmp_path):
    """A liveness probe that failed with PostgreSQL would restart every worker, running builds and all."""
    record_beat(tmp_path, "w-1", db_at=1000.0, now=1000.0 + LIVE_WINDOW_S + 5)
    now = 1000.0 + LIVE_WINDOW_S + 6
    assert probe(tmp_path, "live", now=now) is None
    assert "the API does not list it as live" in probe(tmp_path, "ready", now=now)
    record_beat(tmp_path, "w-1", db_at=None, now=now)
    assert probe(tmp_path, "live", now=now) is None
    assert "no heartbeat has reached the database" in probe(tmp_path, "ready", now=now)


def test_no_file_or_a_bad_one_fails_naming_the_file(tmp_path):
    for check in ("live", "ready"):
        assert str(tmp_path / BEAT_FILE) in probe(tmp_path, check)
    (tmp_path / BEAT_FILE).write_text("{not json")
    assert "unreadable worker heartbeat" in probe(tmp_path, "live")
    with pytest.raises(ValueError, match="live"):
        probe(tmp_path, "alive")


def test_the_heartbeat_loop_records_a_beat_when_the_database_fails(monkeypatch, tmp_path):
    """The loop (api/cli_service.py) writes the file on every turn; the database time moves only on success."""
    from api.cli_service import _heartbeat_loop
    from kiln.settings import get_settings

    home = get_settings().home_dir
    monkeypatch.setattr(liveness, "HEARTBEAT_S", 0.05)
    ok = threading.Event()

    def heartbeat(session, name):
        if not ok.is_set():
            raise RuntimeError("database unreachable")

    monkeypatch.setattr(liveness, "heartbeat", heartbeat)
    stop = threading.Event()
    t = threading.Thread(target=_heartbeat_loop, args=("w-loop", [], stop), daemon=True)
    t.start()
    try:
        first = wait_until(lambda: read(home))
        assert first["name"] == "w-loop"
        later = wait_until(lambda: (b := read(home)) and b["beat"] > first["beat"] + 0.1 and b)  # a few failed turns
        assert later["db"] == first["db"], "a failed heartbeat must not move the database time"
        assert probe(home, "live") is None
        ok.set()
        moved = wait_until(lambda: (b := read(home)) and b["db"] > first["db"] and b)
        assert moved["db"] >= later["beat"]
        assert probe(home, "ready") is None
    finally:
        stop.set()
        t.join(5)


def read(home):
    try:
        return json.loads((home / BEAT_FILE).read_text())
    except FileNotFoundError:
        return None


def wait_until(check, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if got := check():
            return got
        time.sleep(0.02)
    raise AssertionError(f"not within {timeout}s")


def test_kiln_worker_probe_exits_0_or_1_with_one_line(tmp_path, monkeypatch):
    from kiln.settings import get_settings

    home = get_settings().home_dir
    runner = CliRunner()
    missing = runner.invoke(kiln_main, ["worker-probe", "live"])
    assert missing.exit_code == 1
    assert missing.output.strip().count("\n") == 0 and "kiln worker-probe: live: no worker heartbeat" in missing.output
    record_beat(home, "w-2", db_at=None)
    assert runner.invoke(kiln_main, ["worker-probe", "live"]).exit_code == 0
    not_ready = runner.invoke(kiln_main, ["worker-probe", "ready"])
    assert not_ready.exit_code == 1 and "no heartbeat has reached the database" in not_ready.output
    record_beat(home, "w-2", db_at=time.time())
    ready = runner.invoke(kiln_main, ["worker-probe", "ready"])
    assert ready.exit_code == 0 and ready.output.strip() == "kiln worker-probe: ready: ok"
    assert runner.invoke(kiln_main, ["worker-probe", "alive"]).exit_code == 2  # click: a bad choice

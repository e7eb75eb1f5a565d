"""api/progress.py: what a person sees of a build's progress, on a terminal and in a CI log."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from api.progress import HEARTBEAT_S, Progress
from builder.pipeline import Builder


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def events(stage: str, steps: int, every: float, clock: Clock):
    yield "stage", {"name": stage, "state": "started"}
    for i in range(1, steps + 1):
        clock.now += every
        yield "progress", {"stage": stage, "step": "evaluation window", "i": i, "n": steps, "elapsed": 0}
    yield "stage", {"name": stage, "state": "finished", "status": "ran", "seconds": steps * every}


def test_a_ci_log_gets_a_heartbeat_line_every_ten_seconds_and_the_stage_line(capsys):
    clock = Clock()
    p = Progress(quiet=False, tty=False, clock=clock)
    for kind, data in events("validate", 64, 1.0, clock):  # 64 s of windows, one a second
        p(kind, data)
    err = capsys.readouterr().err.splitlines()
    beats = [line for line in err if "evaluation window" in line]
    assert len(beats) == int(64 // HEARTBEAT_S)
    assert beats[0] == "  validate  evaluation window 10/64  10.0 s"
    assert err[-1].split() == ["validate", "ran", "1", "min", "04", "s"]


def test_a_quick_stage_prints_no_heartbeat(capsys):
    clock = Clock()
    p = Progress(quiet=False, tty=False, clock=clock)
    for kind, data in events("compile", 5, 1.0, clock):
        p(kind, data)
    assert capsys.readouterr().err.splitlines() == ["  compile   ran        5.00 s"]


def test_progress_of_another_stage_or_when_quiet_prints_nothing(capsys):
    clock = Clock()
    p = Progress(quiet=False, tty=False, clock=clock)
    p("stage", {"name": "validate", "state": "started"})
    clock.now += 60
    p("progress", {"stage": "compile", "step": "torch.export", "i": None, "n": None})
    q = Progress(quiet=True, tty=False, clock=clock)
    for kind, data in events("validate", 30, 1.0, clock):
        q(kind, data)
    assert capsys.readouterr().err == ""


def test_a_terminal_gets_one_live_line_that_is_replaced_then_the_stage_line(monkeypatch):
    shown = []

    class FakeLive:  # rich's Live, recorded (what it renders is rich's business)
        def __init__(self, text, **kw):
            shown.append(("start", str(text)))

        def start(self):
            pass

        def update(self, text):
            shown.append(("update", str(text)))

        def stop(self):
            shown.append(("stop", None))

    import rich.live

    monkeypatch.setattr(rich.live, "Live", FakeLive)
    clock = Clock()
    p = Progress(quiet=False, tty=True, clock=clock)
    for kind, data in events("validate", 3, 2.0, clock):
        p(kind, data)
    assert shown == [("start", "  validate  … running"), ("update", "  validate  evaluation window 1/3  2.00 s"),
                     ("update", "  validate  evaluation window 2/3  4.00 s"), ("update", "  validate  evaluation window 3/3  6.00 s"),
                     ("stop", None)]
    assert p.live is None


# windows every 0.1 s over 2.9 s: the first at once, then at 1.1 s and 2.1 s; every 1.5 s: each one
@pytest.mark.parametrize("gap,expected", [(0.1, 1 + 3), (1.5, 1 + 29)])
def test_the_pipeline_sends_at_most_one_progress_event_a_second_and_every_new_step(monkeypatch, gap, expected):
    sent = []
    now = [0.0]
    monkeypatch.setattr("builder.pipeline.time.perf_counter", lambda: now[0])
    fake = SimpleNamespace(on_event=lambda kind, data: sent.append((kind, data)), PROGRESS_EVERY_S=1.0)
    sink = Builder._progress_sink(fake, "validate", 0.0)
    sink("reference window", 1, 1)
    for i in range(1, 30):
        now[0] += gap
        sink("evaluation window", i, 29)
    assert all(kind == "progress" and d["stage"] == "validate" for kind, d in sent)
    assert sent[0][1]["step"] == "reference window" and sent[1][1]["step"] == "evaluation window"
    assert len(sent) == expected



def test_the_heartbeat_goes_on_while_a_stage_reports_nothing(capsys):
    """A C++ compile reports once and then nothing for minutes: the log still shows it alive every 10 s."""
    clock = Clock()
    p = Progress(quiet=False, tty=False, clock=clock, ticker=False)
    p("stage", {"name": "compile", "state": "started"})
    for _ in range(25):
        clock.now += 1.0
        p.tick()
        if clock.now == 112.0:
            p("progress", {"stage": "compile", "step": "AOTInductor compile", "i": None, "n": None})
    assert capsys.readouterr().err.splitlines() == ["  compile   running  10.0 s", "  compile   AOTInductor compile  20.0 s"]


def test_the_ticker_thread_prints_without_events_and_stops_with_the_stage(monkeypatch, capsys):
    import time

    monkeypatch.setattr("api.progress.HEARTBEAT_S", 0.0)
    p = Progress(quiet=False, tty=False)  # the real clock: the ticker thread runs
    p("stage", {"name": "compile", "state": "started"})
    time.sleep(1.5)
    p("stage", {"name": "compile", "state": "finished", "status": "ran", "seconds": 1.5})
    time.sleep(1.2)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("  compile   running  ") and lines[-1].split()[:2] == ["compile", "ran"]


def test_heartbeat_line_matches_what_tick_prints_and_not_a_finished_stage(capsys):
    from api.progress import HEARTBEAT_LINE

    clock = Clock()
    p = Progress(quiet=False, tty=False, clock=clock, ticker=False)
    for kind, data in events("validate", 64, 1.0, clock):
        p(kind, data)
    lines = capsys.readouterr().err.splitlines()
    beats = [m.group(1, 2) for line in lines if (m := HEARTBEAT_LINE.match(line))]
    assert beats and all(stage == "validate" and step.startswith("evaluation window ") for stage, step in beats)
    assert len(beats) == len(lines) - 1 and not HEARTBEAT_LINE.match(lines[-1])  # the stage line is not a beat

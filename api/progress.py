"""Build progress for people, on stderr: one line per finished stage, and inside a long stage what it is doing now
(``validate  evaluation window 37/128  41.0 s``). On a terminal the current step is a live line (rich) that updates
in place; elsewhere (a CI log) a plain heartbeat line goes out at most every ``HEARTBEAT_S`` seconds while a stage
runs, so a log shows a build alive without a line per window. Fed by the pipeline's events in a local build and by
the event stream with ``--server``: the same lines either way."""

from __future__ import annotations

import atexit
import re
import sys
import threading
import time
from typing import Any

import click

from kiln.progress import describe
from kiln.units import duration

#: a plain (non-terminal) progress line at most this often per stage
HEARTBEAT_S = 10.0
#: a heartbeat line as :meth:`Progress.tick` prints it — ``  validate  evaluation window 37/128  41.0 s`` — with the
#: stage and the step as groups 1 and 2 (a finished stage's line, ``  compile   ran  23.8 s``, is not one)
HEARTBEAT_LINE = re.compile(r"^  (resolve|quantize|compile|validate|publish) +(?!ran |cached |skip )(\S.*?)  "
                            r"(\d[\d.]* (ms|s)|\d+ min \d+ s)$")


class Progress:
    """``ticker``: a thread that keeps the heartbeat going while a stage reports nothing (a C++ compile, a long
    library call); tests drive :meth:`tick` with their own clock instead."""

    def __init__(self, quiet: bool, *, tty: bool | None = None, clock=time.monotonic, ticker: bool | None = None):
        self.quiet = quiet
        self.tty = sys.stderr.isatty() if tty is None else tty
        self.clock = clock
        self.ticker = (clock is time.monotonic) if ticker is None else ticker
        self.stage: str | None = None
        self.step: dict | None = None  # the stage's latest progress event
        self.started_at = 0.0
        self.said_at = 0.0
        self.live: Any = None  # a rich Live line on a terminal, made when the first line is shown
        self.stopped = threading.Event()

    def __call__(self, kind: str, data: dict) -> None:
        if self.quiet:
            return
        if kind == "stage":
            self._stage(data)
        elif kind == "progress":
            self._progress(data)

    def _stage(self, data: dict) -> None:
        name = data["name"]
        if data["state"] == "started":
            self.stage, self.step, self.started_at, self.said_at = name, None, self.clock(), self.clock()
            self._show(f"{name:<9} … running")
            if self.ticker and not self.tty:
                self.stopped = threading.Event()
                threading.Thread(target=self._tick_until, args=(self.stopped,), daemon=True).start()
            return
        self.stopped.set()
        self._stop()
        self.stage = None
        mark = {"ran": "ran   ", "cached": "cached", "reused": "reused", "skipped": "skip  "}.get(data["status"], data["status"])
        click.echo(f"  {name:<9} {mark} {duration(data['seconds']):>10}", err=True)

    def _progress(self, data: dict) -> None:
        if data.get("stage") != self.stage:
            return
        self.step = data
        if self.tty:
            self._show(self._line())
        else:
            self.tick()

    def _line(self) -> str:
        what = describe(self.step) if self.step else "running"
        return f"{self.stage:<9} {what}  {duration(self.clock() - self.started_at)}"

    def tick(self) -> None:
        """A plain heartbeat line, if a stage runs and none was printed for ``HEARTBEAT_S`` seconds."""
        stage = self.stage
        if stage is not None and not self.tty and self.clock() - self.said_at >= HEARTBEAT_S:
            self.said_at = self.clock()
            click.echo(f"  {self._line()}", err=True)

    def _tick_until(self, stopped: threading.Event) -> None:
        while not stopped.wait(1.0):
            self.tick()

    def _show(self, line: str) -> None:
        if not self.tty:
            return
        from rich.console import Console
        from rich.live import Live
        from rich.text import Text

        text = Text(f"  {line}")
        if self.live is None:
            self.live = Live(text, console=Console(stderr=True), transient=True, refresh_per_second=4)
            self.live.start()
            atexit.register(self._stop)  # a build that fails inside a stage leaves no live line (or hidden cursor)
        else:
            self.live.update(text)

    def _stop(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None

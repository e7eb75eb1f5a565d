"""Progress inside a stage: what a long step is doing now (calibration batch 3/4, evaluation window 37/128,
throughput point 2/5). Code deep in a stage calls :func:`report`; whoever runs the stage decides where it goes by
installing a sink with :func:`reporting` (the pipeline turns reports into ``progress`` build events; nothing is
installed in library use, and a report is then a no-op). A context variable, so concurrent builds in one process
(threads, tasks) each report to their own sink and no stage takes a callback parameter it only passes on."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

#: (what, i, n): ``i`` of ``n`` done, both None for a step without a count
Sink = Callable[[str, "int | None", "int | None"], None]

_sink: ContextVar[Sink | None] = ContextVar("kiln_progress_sink", default=None)


def report(what: str, i: int | None = None, n: int | None = None) -> None:
    """Say what the current step is doing; ``i`` of ``n`` done when it counts."""
    sink = _sink.get()
    if sink is not None:
        sink(what, i, n)


@contextmanager
def reporting(sink: Sink) -> Iterator[None]:
    """Send :func:`report` calls made inside the block (in this context) to ``sink``."""
    token = _sink.set(sink)
    try:
        yield
    finally:
        _sink.reset(token)


def describe(data: dict) -> str:
    """A progress event's words: ``evaluation window 37/128`` or ``torch.export``."""
    what = data.get("step") or ""
    if data.get("i") is not None and data.get("n"):
        return f"{what} {data['i']}/{data['n']}"
    return what

"""kiln/progress.py: reports reach the sink installed around them, and nothing else."""

from __future__ import annotations

import threading

from kiln.progress import describe, report, reporting


def test_a_report_without_a_sink_is_a_no_op():
    report("evaluation window", 1, 2)  # nothing installed: nothing to call, nothing raised


def test_reports_reach_the_innermost_sink_and_only_inside_its_block():
    outer, inner = [], []
    with reporting(lambda *a: outer.append(a)):
        report("a", 1, 3)
        with reporting(lambda *a: inner.append(a)):
            report("b")
        report("c", 3, 3)
    report("d")
    assert outer == [("a", 1, 3), ("c", 3, 3)] and inner == [("b", None, None)]


def test_a_thread_reports_to_its_own_sink():
    seen: dict[str, list] = {"x": [], "y": []}

    def work(name):
        with reporting(lambda *a: seen[name].append(a)):
            for i in range(50):
                report(name, i, 50)

    threads = [threading.Thread(target=work, args=(n,)) for n in seen]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(len(v) == 50 and {a[0] for a in v} == {k} for k, v in seen.items())


def test_describe():
    assert describe({"step": "evaluation window", "i": 37, "n": 128}) == "evaluation window 37/128"
    assert describe({"step": "torch.export", "i": None, "n": None}) == "torch.export"

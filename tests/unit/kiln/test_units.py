"""kiln/units.py, the one formatter, and its JavaScript twin api/static/units.js (run by node on the same table of
inputs: the same strings)."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from pathlib import Path

import pytest

from kiln import units as u
from validation import gates

REPO = Path(__file__).resolve().parents[3]
INF, NAN = math.inf, math.nan


def test_bytes_iec_boundaries():
    assert [u.bytes_iec(n) for n in (0, 1, 512, 1023, 1024, 1536, 1023.4, 1023.6)] == [
        "0 B", "1 B", "512 B", "1023 B", "1.00 KiB", "1.50 KiB", "1023 B", "1.00 KiB"]
    assert u.bytes_iec(1.5 * 2**30) == "1.50 GiB" and u.bytes_iec(44453888.0) == "42.4 MiB"
    assert u.bytes_iec(1.89571e10) == "17.7 GiB" and u.bytes_iec(80e9) == "74.5 GiB"
    assert u.bytes_iec(1023.5 * 1024) == "1.00 MiB"  # rounds up to the next unit, not "1024 KiB"
    assert u.bytes_iec(1000 * 1024) == "1000 KiB" and u.bytes_iec(3 * 2**40) == "3.00 TiB"
    assert u.bytes_iec(-2048) == "-2.00 KiB" and u.bytes_iec(None) == "—" and u.bytes_iec(INF) == "∞"


def test_durations_across_units():
    assert [u.duration(s) for s in (0, 0.000412, 0.0123, 0.85, 0.9996, 1.0, 12.34, 59.94, 59.96)] == [
        "0 s", "0.412 ms", "12.3 ms", "850 ms", "1.00 s", "1.00 s", "12.3 s", "59.9 s", "1 min 00 s"]
    assert [u.duration(s) for s in (245, 3599.4, 3599.6, 3720, 86400 + 61)] == [
        "4 min 05 s", "59 min 59 s", "1 h 00 min", "1 h 02 min", "24 h 01 min"]
    assert u.duration(-5) == "-5.00 s" and u.duration(None) == "—" and u.duration(NAN) == "NaN"


def test_percent_points_fraction_count_rate_number():
    assert [u.percent(x) for x in (3.5, 0.3365, -1.2, 0, -0.001, 0.125)] == [
        "+3.50%", "+0.34%", "-1.20%", "+0.00%", "+0.00%", "+0.13%"]  # half away from zero, no "-0.00"
    assert u.percent(3.5, signed=False) == "3.50%" and u.percent(-INF) == "−∞"
    assert u.points(1.2) == "+1.20 pts" and u.points(-0.5) == "-0.50 pts"
    assert u.fraction(0.9424) == "94.2%" and u.fraction(0.85) == "85.0%" and u.fraction(1) == "100.0%"
    assert u.count(30307.4) == "30,307" and u.count(-1234567) == "-1,234,567" and u.count(999) == "999"
    assert u.rate(30307.4) == "30,307 tokens/s" and u.rate(1.0) == "1.00 tokens/s" and u.rate(150.6) == "151 tokens/s"
    assert [u.number(x) for x in (0.0077, 41.264, 0.006941, 0.05, 2048, 3.0, 123456.7, 0, 9.99996)] == [
        "0.0077", "41.26", "0.006941", "0.05", "2,048", "3", "123,457", "0", "10"]
    assert u.number(True) == "yes" and u.display("text") == "text" and u.display(None) == "—"
    assert u.bytes_iec("<img>") == "<img>" and u.percent("n/a") == "n/a"  # what is not a number stays text


def _every_gate() -> set[str]:
    names = set(gates.REGRESSION_GATES) | {gates.MEMORY_GATE, gates.TASK_GATE}
    for defaults in gates.DEFAULT_GATES.values():
        names |= set(defaults)
    # the gates evaluate() reads a value for (its table of metrics)
    names |= {"max_ppl_increase_pct", "min_top1_agreement", "max_mean_kl", "min_throughput_tps"}
    return names


def test_every_gate_has_a_label_and_a_unit():
    missing = _every_gate() - set(u.GATES)
    assert not missing, f"gates without an entry in kiln.units.GATES: {sorted(missing)}"
    assert all(kind in u.KINDS for _, kind in u.GATES.values())


def test_every_gate_validation_judges_is_in_the_table():
    """A gate verdict from validation/gates.evaluate() for every default gate names a gate of the table."""
    metrics = {"ppl_increase_pct": 1.0, "top1_agreement": 0.9, "mean_kl": 0.01, "peak_memory_bytes": 2**20,
               "throughput": [{"batch_size": 1, "seq_len": 8, "tokens_per_s": 10.0}],
               "tasks": [{"task": "t", "drop_pts": 1.0, "interval": None}]}
    for precision in gates.DEFAULT_GATES:
        judged, _ = gates.judged_gates(gates.effective_gates(precision, {}), "sm90")
        for v in gates.evaluate(metrics, judged):
            assert v["name"] in u.GATES and not u.gate_line(v).startswith(v["name"])


def test_gate_lines():
    assert u.gate_line({"name": "max_peak_memory_bytes", "value": 44453888.0, "threshold": 1.89571e10,
                        "passed": True}) == "peak memory 42.4 MiB ≤ 17.7 GiB  pass"
    assert u.gate_line({"name": "min_top1_agreement", "value": 0.9424, "threshold": 0.85, "passed": True,
                        "interval": [0.9284, 0.9564], "confidence": 0.993, "decision": "pass"}) == \
        "top-1 agreement 94.2% [92.8%, 95.6%] (99.3%) ≥ 85.0%  pass"
    assert u.gate_line({"name": "max_ppl_increase_pct", "value": 2.9, "threshold": 3.0, "passed": False,
                        "interval": [2.1, 3.7], "confidence": 0.99, "decision": "undecided"}) == \
        "perplexity increase +2.90% [+2.10%, +3.70%] (99.0%) ≤ +3.00%  UNDECIDED (evaluate more to decide)"
    assert u.gate_line({"name": "min_throughput_tps", "value": 30307.0, "threshold": 1.0, "passed": True}) == \
        "throughput 30,307 tokens/s ≥ 1.00 tokens/s  pass"
    assert u.gate_line({"name": "max_task_accuracy_drop_pts", "task": "arc", "value": 4.0, "threshold": 3.0,
                        "passed": False}) == "task accuracy drop [arc] +4.00 pts ≤ +3.00 pts  FAIL"
    assert u.gate_line({"name": "max_mean_kl", "seq_len": 512, "value": 0.07, "threshold": 0.05,
                        "passed": False}) == "mean KL [512-token windows] 0.07 ≤ 0.05  FAIL"
    assert u.gate_line({"name": "max_peak_memory_bytes", "value": INF, "threshold": 8e9, "passed": False}) == \
        "peak memory ∞ ≤ 7.45 GiB  FAIL"
    assert u.gate_line({"name": "max_new_thing", "value": 0.5, "threshold": 1, "passed": True}) == \
        "max_new_thing 0.5 ≤ 1  pass"


# -- the JavaScript twin ---------------------------------------------------------------------------------------
NUMBERS = [0, 1, -1, 0.5, 0.125, 0.000412, 0.0077, 0.006941, 0.00845, 0.05, 0.85, 0.9424, 0.993, 0.9996, 1.0,
           1.5, 2.5, 3.0, 3.5, -0.001, -1.2, 9.99996, 12.34, 41.264, 59.94, 59.96, 99.95, 150.6, 245, 512, 1000,
           1023, 1023.4, 1023.5, 1023.6, 1024, 1536, 2048, 3599.4, 3599.6, 3720, 9999.5, 30307.4, 87461,
           1000 * 1024, 1023.5 * 1024, 44453888.0, 1.5 * 2**30, 1.89571e10, 80e9, 3 * 2**40, 1.2e15, -2048,
           -1234567, 0.1 + 0.2, 1 / 3, 2 / 3, 1e-7, "<b>x</b>", True, INF, -INF, NAN, None]
FUNCS = {"bytes_iec": "bytesIec", "duration": "duration", "percent": "percent", "fraction": "fraction",
         "points": "points", "count": "count", "number": "number", "rate": "rate", "display": "display"}
GATE_CASES = [
    {"name": name, "value": value, "threshold": threshold, "passed": passed, **extra}
    for name in u.GATES
    for value, threshold, passed, extra in (
        (0.3365, 3.0, True, {}), (44453888.0, 1.89571e10, True, {}), (INF, 0.85, False, {}),
        (2.9, 3.0, False, {"interval": [2.1, 3.7], "confidence": 0.99, "decision": "undecided"}),
        (0.9424, 0.85, True, {"interval": [0.9284, 0.9564], "confidence": 0.993, "decision": "pass", "task": "arc"}),
        (0.031, 0.05, True, {"interval": [0.027, 0.035], "confidence": 0.986, "decision": "pass", "seq_len": 4096}),
    )
] + [{"name": "max_unknown", "value": 0.5, "threshold": 1, "passed": True}, {"name": "min_x", "passed": False}]

JS = """
const U = require(process.argv[1]);
const revive = (k, v) => v === "__inf__" ? Infinity : v === "__-inf__" ? -Infinity : v === "__nan__" ? NaN : v;
const cases = JSON.parse(require("fs").readFileSync(0, "utf8"), revive);
const out = cases.map(([fn, args]) => U[fn](...args));
process.stdout.write(JSON.stringify(out));
"""


def _encode(v):
    if isinstance(v, float) and not math.isfinite(v):
        return "__nan__" if math.isnan(v) else ("__inf__" if v > 0 else "__-inf__")
    if isinstance(v, dict):
        return {k: _encode(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_encode(x) for x in v]
    return v


def test_the_javascript_twin_gives_the_same_strings():
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed: api/static/units.js cannot be run (apt-get install nodejs)")
    cases = [(py, js, [x]) for py, js in FUNCS.items() for x in NUMBERS]
    cases += [("percent", "percent", [x, False]) for x in NUMBERS]
    cases += [("gate_line", "gateLine", [g]) for g in GATE_CASES]
    cases += [("gate_value", "gateValue", [g["name"], g.get("value")]) for g in GATE_CASES]
    cases += [("significant", "significant", [x, d]) for x in NUMBERS[:-6] for d in (3, 4)]
    got = json.loads(subprocess.run(
        [node, "-e", JS, str(REPO / "api" / "static" / "units.js")],
        input=json.dumps(_encode([[js, args] for _, js, args in cases])), capture_output=True, text=True,
        check=True, timeout=60).stdout)
    want = [getattr(u, py)(*args) for py, _, args in cases]
    diffs = [(py, args, w, g) for (py, _, args), w, g in zip(cases, want, got) if w != g]
    assert not diffs, diffs[:20]
    assert len(got) == len(cases)

"""Reports: the JSON document carries the metrics under their plain names and every gate's verdict; the HTML page
puts the verdict first and draws its charts as inline SVG (no script, no external asset); JUnit XML has one
testcase per gate. Built from a real validation of the shipped tiny Llama's FP8 export."""

from __future__ import annotations

import copy
import json
import math
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from kiln.datasets import load_text
from kiln.spec import parse_spec
from validation.gates import effective_gates
from validation.report import REPORT_TYPE, SCHEMA, document_for_row, render, render_html, render_junit, \
    report_document, to_json
from validation.runners import CheckpointRunner, open_reference
from validation.validate import validate

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "examples" / "tiny-llama"
DIGEST = "sha256:" + "d" * 64
PREV = "sha256:" + "a" * 64
PROFILE = {"max_batch_size": 2, "max_input_len": 64, "max_seq_len": 96, "max_num_tokens": 128}


@pytest.fixture(scope="module")
def real(fp8_export):
    """A real validation of the FP8 export (checkpoint backend), peak memory from a fresh child process."""
    spec = parse_spec({"checkpoint": str(TINY), "precision": "fp8", "backend": "checkpoint", "profile": PROFILE,
                       "evaluation": {"max_tokens": 1024}, "override_reason": "a unit test: a shorter evaluation"}, [REPO])
    heldout = load_text("kiln:heldout", field="evaluation.dataset", roots=[REPO])[0]
    validation = validate(CheckpointRunner(fp8_export / "hf"), open_reference(TINY), TINY, heldout, spec,
                          effective_gates("fp8", {}), 2048, engine_source=("checkpoint", fp8_export / "hf"))
    provenance = {"created": "2026-01-02T03:04:05Z", "kiln": "0.test", "recipe": "kiln-recipe-1",
                  "spec": spec.model_dump(), "build_key": "sha256:" + "b" * 64,
                  "checkpoint": {"ref": str(TINY), "digest": "sha256:" + "c" * 64, "revision": None},
                  "toolchain": {"torch": "2.13"}, "gates": effective_gates("fp8", {}), "data": {},
                  "stages": [{"name": "resolve", "status": "ran", "seconds": 0.02, "detail": {}},
                             {"name": "quantize", "status": "cached", "seconds": 0.0, "detail": {}},
                             {"name": "compile", "status": "ran", "seconds": 0.5, "detail": {}},
                             {"name": "validate", "status": "ran", "seconds": 3.25, "detail": {}}]}
    return provenance, validation


def doc_of(provenance, validation, **kw):
    return report_document(kw.get("digest", DIGEST), repository=kw.get("repository", "tiny-llama"),
                           tag=kw.get("tag", "fp8-cpu-custom-checkpoint"), provenance=provenance, validation=validation)


@pytest.fixture(scope="module")
def passing(real):
    return doc_of(*real)


@pytest.fixture(scope="module")
def failing(real):
    """The same engine judged by an impossible threshold and compared with a much faster previous engine."""
    provenance, validation = copy.deepcopy(real)
    for g in validation["gates"]:
        if g["name"] == "min_top1_agreement":
            g["threshold"], g["passed"] = 1.01, False
    validation["gates"].append({"name": "max_throughput_drop_pct", "threshold": 20.0, "value": 80.0,
                                "passed": False, "against": PREV})
    validation["not_judged"] = {"max_accuracy_regression_pct": "the previous engine was evaluated on other text"}
    validation["regression"] = {
        "previous": {"digest": PREV, "status": "fresh", "created_at": "2026-01-01T00:00:00+00:00",
                     "perplexity": 41.0, "ppl_increase_pct": 0.2, "top1_agreement": 0.97, "mean_kl": 0.005,
                     "peak_tokens_per_s": 1e6},
        "thresholds": {"max_throughput_drop_pct": 20.0, "max_accuracy_regression_pct": 1.0},
        "throughput_drop_pct": 80.0, "accuracy_regression_pct": None, "override_reason": None,
        "throughput": {"previous_peak_tokens_per_s": 1e6, "peak_tokens_per_s": 2e5, "rechecked": True},
        "not_judged": validation["not_judged"]}
    validation["passed"] = False
    validation["metrics"]["perplexity"] = math.inf
    return doc_of(provenance, validation, repository="evil<script>alert(1)</script>")


# -- the real measurements -------------------------------------------------------------------------
def test_the_real_validation_measured_the_whole_envelope(real):
    _, v = real
    m, c = v["metrics"], v["conditions"]
    assert v["passed"], v["gates"]
    assert {(p["batch_size"], p["seq_len"]) for p in m["throughput"]} == {(1, 64), (2, 64), (1, 16), (1, 32), (1, 96)}
    assert [p["batch_size"] for p in m["latency"]] == [1, 2]
    assert all(p["prompt_len"] + p["new_tokens"] <= 96 and p["new_tokens"] == 16 for p in m["latency"])
    assert m["ttft_ms"] > 0 and m["tpot_ms"] > 0
    assert c["latency"]["kv_cache"] is True  # the checkpoint runner decodes with transformers' KV cache
    # a fresh process: the engine's weights (1.4 M parameters, fp32 once dequantized) and the corner's logits
    # (2 × 96 × 2048 floats) at least, far from the runtime's own ~300 MB
    assert 2 * 96 * 2048 * 4 < m["peak_memory_bytes"] < 300e6
    assert c["memory"]["corner"] == {"batch_size": 2, "seq_len": 96} and "fresh child process" in c["memory"]["method"]
    assert c["memory"]["runtime_bytes"] > 50e6 and c["memory"]["hwm_reset"] is True
    assert [g["name"] for g in v["gates"]][-1] == "max_peak_memory_bytes"
    assert "75%" in c["gate_sources"]["max_peak_memory_bytes"]
    assert set(v["not_judged"]) == {"max_throughput_drop_pct", "max_accuracy_regression_pct",  # no previous engine
                                    "max_task_accuracy_drop_pts"}  # no tasks


# -- JSON ------------------------------------------------------------------------------------------
def test_json_carries_the_metrics_under_their_names(passing, real):
    doc = json.loads(to_json(passing))
    m = real[1]["metrics"]
    for name in ("perplexity", "reference_perplexity", "top1_agreement", "ttft_ms", "tpot_ms", "peak_memory_bytes"):
        assert doc[name] == m[name], name
    assert doc["throughput"] and all({"batch_size", "seq_len", "tokens_per_s"} <= set(p) for p in doc["throughput"])
    assert doc["gates"] and all(set(g) >= {"name", "threshold", "value", "passed"} for g in doc["gates"])
    assert doc["verdict"] == "pass" and doc["passed"] is True and doc["failed_gates"] == []
    assert doc["digest"] == DIGEST and doc["engine"]["digest"] == DIGEST and doc["schema"] == SCHEMA
    assert doc["spec"]["precision"] == "fp8" and doc["spec"]["backend"] == "checkpoint"
    assert doc["spec"]["profile"]["max_seq_len"] == 96 and doc["spec"]["checkpoint_content"]["digest"]
    assert doc["conditions"]["latency"]["kv_cache"] is True and doc["conditions"]["memory"]["method"]
    assert [s["name"] for s in doc["stages"]] == ["resolve", "quantize", "compile", "validate"]
    assert REPORT_TYPE == "application/vnd.kiln.validation-report.v1+json"


def test_json_is_strict_and_names_infinities(failing):
    text = to_json(failing)

    def refuse(token):
        raise AssertionError(f"non-standard JSON token {token}")

    doc = json.loads(text, parse_constant=refuse)
    assert doc["perplexity"] == "Infinity" and doc["verdict"] == "fail"
    assert doc["failed_gates"] == ["min_top1_agreement", "max_throughput_drop_pct"]


def test_the_document_is_a_pure_function_of_the_index_row(real):
    """What publish attaches and what `kiln report` prints from the database row are the same bytes."""
    provenance, validation = real
    stored = json.loads(json.dumps({"p": provenance, "v": validation}))  # a JSON column's round trip

    class Row:
        digest, repository, tag = DIGEST, "tiny-llama", "fp8-cpu-custom-checkpoint"
        provenance, validation = stored["p"], stored["v"]

    assert to_json(document_for_row(Row)) == to_json(doc_of(provenance, validation))
    assert render(document_for_row(Row), "json") == to_json(doc_of(provenance, validation))


# -- HTML ------------------------------------------------------------------------------------------
def body_of(html: str) -> str:
    return html.split("<body>", 1)[1]


def svgs(html: str) -> dict[str, ET.Element]:
    out = {}
    for m in re.finditer(r"<svg\b.*?</svg>", html, re.S):
        el = ET.fromstring(m.group(0))  # each chart is well-formed XML
        out[el.get("id")] = el
    return out


def test_html_puts_the_verdict_first_and_draws_every_chart(passing):
    html = render_html(passing, status="fresh")
    assert html.startswith("<!DOCTYPE html>")
    first = body_of(html).lstrip()
    assert first.startswith('<header class="verdict pass" id="verdict"><div class="big">PASS</div>')
    assert first.index("PASS") < first.index("<svg") and first.index("PASS") < first.index("<table")
    charts = svgs(html)
    assert {"chart-throughput", "chart-throughput-seq", "chart-accuracy", "chart-memory", "chart-timeline"} <= set(charts)
    ns = "{http://www.w3.org/2000/svg}"
    assert len(charts["chart-throughput"].findall(f"{ns}rect")) == 2  # batch 1 and 2 at max_input_len
    assert len(charts["chart-timeline"].findall(f"{ns}rect")) == 4  # one bar per stage
    assert len(charts["chart-accuracy"].findall(f"{ns}rect")) == 2  # reference and this engine (no previous)
    assert "TPOT" in html and "index status: fresh" in html and "interval" in html


def test_html_is_self_contained(passing, failing):
    for doc in (passing, failing):
        html = render_html(doc)
        assert "<script" not in html.lower().replace("&lt;script", "")
        assert not re.search(r"""(src|href)\s*=""", html, re.I)
        assert not re.search(r"url\(", html) and "@import" not in html
        assert "http" not in html.replace('xmlns="http://www.w3.org/2000/svg"', "").replace('<meta http-equiv=', "")


def test_html_of_a_failed_engine_says_fail_first_and_why(failing):
    html = render_html(failing)
    first = body_of(html).lstrip()
    assert first.startswith('<header class="verdict fail" id="verdict"><div class="big">FAIL</div>')
    assert "<b>min_top1_agreement</b>" in html and "<b>max_throughput_drop_pct</b>" in html
    assert "alert(1)" in html and "<script>alert" not in html  # escaped, not executed
    charts = svgs(html)
    assert len(charts["chart-accuracy"].findall("{http://www.w3.org/2000/svg}rect")) == 3  # with the previous engine
    assert PREV in html and "re-measured" in html and "not judged: the previous engine was evaluated" in html


# -- JUnit -----------------------------------------------------------------------------------------
def test_junit_has_one_testcase_per_gate_and_failures_for_failed_gates(passing, failing):
    for doc in (passing, failing):
        root = ET.fromstring(render_junit(doc).split("\n", 1)[1])
        [suite] = root.findall("testsuite")
        cases = suite.findall("testcase")
        names = [c.get("name") for c in cases]
        assert names == [g["name"] for g in doc["gates"]] + list(doc["not_judged"])
        failed = {c.get("name") for c in cases if c.find("failure") is not None}
        assert failed == {g["name"] for g in doc["gates"] if not g["passed"]}
        skipped = {c.get("name") for c in cases if c.find("skipped") is not None}
        assert skipped == set(doc["not_judged"])
        assert int(suite.get("tests")) == len(cases) and int(suite.get("failures")) == len(failed)
        assert int(suite.get("skipped")) == len(skipped) and root.get("failures") == suite.get("failures")
        props = {p.get("name"): p.get("value") for p in suite.find("properties")}
        assert props["digest"] == DIGEST and props["verdict"] == doc["verdict"]
    root = ET.fromstring(render_junit(failing).split("\n", 1)[1])
    failure = root.find(".//testcase[@name='max_throughput_drop_pct']/failure")
    assert PREV in failure.text and failure.get("type") == "GateFailed"


def test_every_format_renders_an_engine_validated_before_reports_existed():
    legacy = doc_of({"spec": {"precision": "fp8"}}, {"passed": True, "metrics": {"perplexity": 40.0}, "gates": []})
    assert json.loads(render(legacy, "json"))["ttft_ms"] is None
    assert "PASS" in render(legacy, "html")
    assert ET.fromstring(render(legacy, "junit").split("\n", 1)[1]).get("tests") == "0"
    with pytest.raises(ValueError):
        render(legacy, "pdf")


def test_html_escapes_every_cell_and_carries_the_report_csp(passing):
    """``kiln report --format html`` writes what the server sent: metric values went into table cells unescaped."""
    import copy

    from validation.report import REPORT_CSP

    evil = '<img src=x onerror="alert(1)">'
    doc = copy.deepcopy(passing)
    doc["throughput"] = [{**p, "tokens_per_s_best": evil, "reps": evil} for p in doc.get("throughput") or []]
    doc["latency"] = [{"batch_size": evil, "prompt_len": 1, "new_tokens": 1, "ttft_ms": evil, "tpot_ms": 1.0}]
    doc["conditions"] = {**(doc.get("conditions") or {}), evil: evil}
    doc["toolchain"] = {evil: evil}
    doc["spec"] = {**(doc.get("spec") or {}), "model_name": evil}
    doc["gates"] = [{**g, "value": evil} for g in doc.get("gates") or []]
    doc["regression"] = {"previous": {"digest": evil, "status": evil, "created_at": evil, "ppl_increase_pct": 1.0},
                         "throughput": {"previous_peak_tokens_per_s": evil, "peak_tokens_per_s": evil},
                         "throughput_drop_pct": evil, "accuracy_regression_pct": evil, "thresholds": {evil: 1.0}}
    html = render_html(doc)
    assert "<img" not in html and "&lt;img src=x" in html
    head = html.split("</head>", 1)[0]
    assert f'<meta http-equiv="Content-Security-Policy" content="{REPORT_CSP}">' in head


def test_the_report_shows_every_rung_the_ladder_tried_escaped(real):
    provenance, validation = copy.deepcopy(real)
    validation["recipe"] = {"requested": "auto", "built": "fp8-pcpt", "ladder": [
        {"recipe": "fp8", "passed": False, "judged_on": "engine", "seconds": {"validate": 12.5},
         "metrics": {"ppl_increase_pct": 3.51, "top1_agreement": 0.86, "mean_kl": 0.065},
         "gates": [{"name": "max_ppl_increase_pct", "passed": False}, {"name": "<script>x</script>", "passed": False},
                   {"name": "max_mean_kl", "passed": False, "decision": "undecided"}]},
        {"recipe": "fp8-pcpt", "passed": True, "judged_on": "screen", "seconds": {"quantize": 4.0, "screen": 9.0},
         "metrics": {"ppl_increase_pct": 1.19, "top1_agreement": 0.87, "mean_kl": 0.054}, "gates": []}]}
    doc = doc_of(provenance, validation)
    assert doc["quantization"]["built"] == "fp8-pcpt" and len(doc["quantization"]["ladder"]) == 2
    html = render_html(doc)
    section = html[html.index("<h2>Recipe</h2>"):]
    section = section[:section.index("<h2>", 5)]
    assert "fp8-pcpt" in section and "requested <code>auto</code>" in section
    assert section.count("<tr>") == 3  # the header and one row per rung
    assert "FAIL perplexity increase, &lt;script&gt;x&lt;/script&gt;; undecided mean KL" in section and "3.51" in section and "screen 9.00 s" in section
    assert "<script>" not in section and "&lt;script&gt;" in section


def test_html_says_when_tpot_was_not_measured(passing):
    doc = json.loads(json.dumps(passing))
    doc["conditions"]["latency"] = {"kv_cache": False, "tpot": "not measured: this engine has no KV cache"}
    assert "TPOT not measured: this engine has no KV cache" in render_html(doc)


def test_an_undecided_gate_shows_its_interval_and_fails_in_every_format(passing):
    doc = json.loads(json.dumps(passing))
    gate = next(g for g in doc["gates"] if g["name"] == "max_ppl_increase_pct")
    gate.update(value=2.9, interval=[2.1, 3.7], confidence=0.99, decision="undecided", passed=False)
    doc["passed"], doc["verdict"] = False, "fail"
    html = render_html(doc)
    assert "[+2.10%, +3.70%] (99.0%)" in html and "UNDECIDED" in html
    junit = ET.fromstring(render_junit(doc))
    [case] = [c for c in junit.iter("testcase") if c.get("name") == "max_ppl_increase_pct"]
    failure = case.find("failure")
    assert failure is not None and "interval [+2.10%, +3.70%] (99.0%): UNDECIDED" in failure.text


def test_every_number_a_person_reads_goes_through_kiln_units():
    """IEC bytes, percentages, rates and durations in the HTML and in JUnit's messages; the JSON stays raw."""
    from validation.accuracy import GATE_METRIC
    from validation.report import _GATE_OF_METRIC

    assert _GATE_OF_METRIC == {metric: gate for gate, metric in GATE_METRIC.items()}
    validation = {"passed": False, "metrics": {
        "ppl_increase_pct": 0.3365, "top1_agreement": 0.9424, "mean_kl": 0.0077, "tokens": 2048,
        "peak_memory_bytes": 44453888.0, "throughput": [{"batch_size": 1, "seq_len": 64, "tokens_per_s": 30307.4,
                                                         "seconds_median": 0.00211}],
        "latency": [{"batch_size": 1, "prompt_len": 48, "new_tokens": 16, "ttft_ms": 12.34, "tpot_ms": 3.2}]},
        "gates": [{"name": "max_peak_memory_bytes", "value": 44453888.0, "threshold": 1.89571e10, "passed": True},
                  {"name": "min_top1_agreement", "value": 0.9424, "threshold": 0.95, "passed": False}]}
    doc = doc_of({"stages": [{"name": "validate", "status": "ran", "seconds": 245.0}]}, validation)
    html = render_html(doc)
    for text in ("42.4 MiB", "≤ 17.7 GiB", "94.2%", "≥ 95.0%", "30,307 tokens/s", "2.11 ms", "12.3 ms",
                 "on 2,048 held-out tokens", "+0.34%", "4 min 05 s", "peak memory <code>max_peak_memory_bytes</code>"):
        assert text in html, text
    assert "e+" not in body_of(html) and "MB" not in html
    junit = ET.fromstring(render_junit(doc).split("\n", 1)[1])
    failure = junit.find(".//testcase[@name='min_top1_agreement']/failure")
    assert failure.get("message") == "min_top1_agreement (top-1 agreement): value 94.2% violates threshold 95.0%"
    out = junit.find(".//testcase[@name='max_peak_memory_bytes']/system-out")
    assert out.text == "max_peak_memory_bytes (peak memory): value 42.4 MiB ≤ threshold 17.7 GiB"
    assert json.loads(to_json(doc))["gates"][0]["value"] == 44453888.0  # machines get the raw value


def test_the_task_table_says_how_many_items_sequential_evaluation_ran():
    from validation.report import _tasks_section

    task = {"task": "cloze", "items": 64, "total": 200, "engine_accuracy": 0.78, "reference_accuracy": 0.79,
            "drop_pts": 1.0, "interval": {"low": -2.0, "high": 4.0, "confidence": 0.987}, "mde_pts": 5.0,
            "unpaired_items_needed": 900, "engine_only_correct": 2, "reference_only_correct": 3}
    html = "".join(_tasks_section([task]))
    assert "64 of 200" in html and "(98.7%)" in html
    assert "64 of" not in "".join(_tasks_section([{**task, "total": 64}]))

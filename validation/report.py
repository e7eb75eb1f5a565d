"""Validation reports: one document per engine, rendered as JSON (machines), HTML (people) or JUnit XML (CI).

The document is a pure function of the engine's index row (digest, repository, tag, provenance, validation), so
``kiln report <digest> --format json`` prints byte for byte the report that publish attached to the engine image
as a referrer (artifactType :data:`REPORT_TYPE`).

Non-finite numbers (the perplexity of a broken engine, the memory of a probe the kernel killed) are written as the
strings ``"Infinity"``, ``"-Infinity"`` and ``"NaN"``, so the JSON stays strict.
"""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET
from html import escape
from collections.abc import Sequence
from typing import Any

from kiln import units
from validation import svg

REPORT_TYPE = "application/vnd.kiln.validation-report.v1+json"
SCHEMA = "kiln.validation-report.v1"
FORMATS = ("json", "html", "junit")
METRICS = ("perplexity", "reference_perplexity", "ppl_increase_pct", "top1_agreement", "mean_kl", "throughput",
           "ttft_ms", "tpot_ms", "latency", "peak_memory_bytes", "intervals", "mde", "sequential", "tasks",
           "long_windows")
SPEC_FIELDS = ("model_name", "checkpoint", "precision", "kv_cache", "target", "backend", "tp_size", "profile",
               "calibration", "evaluation", "gates", "override_reason")


# -- the document ----------------------------------------------------------------------------------
def report_document(digest: str, *, repository: str, tag: str, provenance: dict, validation: dict) -> dict:
    """The report of engine ``digest``: verdict, metrics under their plain names, every gate's verdict, the
    regression comparison, the conditions of each measurement, the spec summary and the stage timeline."""
    provenance, validation = provenance or {}, validation or {}
    metrics = validation.get("metrics") or {}
    gates = validation.get("gates") or []
    spec = provenance.get("spec") or {}
    passed = bool(validation.get("passed"))
    memory = next((g for g in gates if g["name"] == "max_peak_memory_bytes"), None)
    doc: dict[str, Any] = {
        "schema": SCHEMA,
        "digest": digest,
        "engine": {"digest": digest, "repository": repository, "tag": tag, "build_key": provenance.get("build_key"),
                   "created": provenance.get("created"), "kiln": provenance.get("kiln"),
                   "recipe": provenance.get("recipe")},
        "spec": {**{k: spec.get(k) for k in SPEC_FIELDS}, "checkpoint_content": provenance.get("checkpoint")},
        "verdict": "pass" if passed else "fail",
        "passed": passed,
        "failed_gates": [g["name"] for g in gates if not g.get("passed")],
        **{k: metrics.get(k) for k in METRICS},
        "peak_tokens_per_s": max((p["tokens_per_s"] for p in metrics.get("throughput") or []), default=None),
        "memory_budget_bytes": memory["threshold"] if memory else None,
        "eval_tokens": metrics.get("tokens"),
        "gates": gates,
        "not_judged": dict(validation.get("not_judged")
                           or ((validation.get("regression") or {}).get("not_judged") or {})),
        "regression": validation.get("regression"),
        # the recipe built and, when --recipe auto climbed its ladder, every rung tried (builder/ladder.py)
        "quantization": validation.get("recipe") or provenance.get("quantization"),
        "conditions": validation.get("conditions") or {},
        "stages": [{"name": s.get("name"), "status": s.get("status"), "seconds": s.get("seconds", 0.0)}
                   for s in provenance.get("stages") or []],
        "toolchain": provenance.get("toolchain") or {},
    }
    return doc


def document_for_row(row) -> dict:
    """The report of an :class:`kiln.tables.Artifact` index row."""
    return report_document(row.digest, repository=row.repository, tag=row.tag, provenance=row.provenance,
                           validation=row.validation)


def _strict(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {str(k): _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    return value


def to_json(doc: dict) -> str:
    """Strict, canonical-looking JSON (sorted keys, two-space indent, trailing newline)."""
    return json.dumps(_strict(doc), sort_keys=True, indent=2, allow_nan=False, ensure_ascii=False) + "\n"


def render(doc: dict, fmt: str, *, status: str | None = None) -> str:
    if fmt == "json":
        return to_json(doc)
    if fmt == "html":
        return render_html(doc, status=status)
    if fmt == "junit":
        return render_junit(doc)
    raise ValueError(f"unknown report format {fmt!r}; use one of {', '.join(FORMATS)}")


# -- formatting helpers: every number through kiln.units -------------------------------------------------------
_fmt = units.display
#: the window metric each accuracy gate is decided on (validation.accuracy.GATE_METRIC, which imports torch)
_GATE_OF_METRIC = {"ppl_increase_pct": "max_ppl_increase_pct", "top1_agreement": "min_top1_agreement",
                   "mean_kl": "max_mean_kl"}


def _ms(v: Any) -> str:
    """A time stored in milliseconds."""
    return units.duration(v / 1000) if isinstance(v, (int, float)) and not isinstance(v, bool) else units.display(v)


def _gate_name(g: dict) -> str:
    if g.get("task"):
        return f"{g['name']}[{g['task']}]"
    return f"{g['name']}@{g['seq_len']}" if g.get("seq_len") else str(g["name"])


def _interval(g: dict) -> str:
    """``[+2.10%, +3.70%] (99.0%)``: the interval the gate was decided on, at its confidence."""
    return units.gate_interval(g) or "—"


def _not_judged(doc: dict) -> dict[str, str]:
    return dict(doc.get("not_judged") or {})


# -- HTML ------------------------------------------------------------------------------------------
CSS = """
body{font-family:system-ui,sans-serif;margin:0 auto;max-width:980px;padding:0 16px 40px;color:#1a202c}
.verdict{margin:16px 0;padding:18px 24px;border-radius:8px;color:#fff}
.verdict .big{font-size:56px;font-weight:800;letter-spacing:2px;line-height:1}
.verdict.pass{background:#2f855a}.verdict.fail{background:#c53030}
table{border-collapse:collapse;margin:8px 0 16px;font-size:14px}
th,td{border-bottom:1px solid #e2e8f0;padding:4px 10px;text-align:left;vertical-align:top}
td.num{text-align:right;font-variant-numeric:tabular-nums}
.pass-cell{color:#2f855a;font-weight:700}.fail-cell{color:#c53030;font-weight:700}.skip-cell{color:#718096}
.note{background:#fffaf0;border-left:4px solid #b7791f;padding:6px 10px;font-size:14px}
code{font-size:13px}h2{margin-top:28px;border-bottom:2px solid #edf2f7}
svg{display:block;margin:8px 0;max-width:100%;height:auto}
"""


class _Html(str):
    """A table cell that is markup already, its text parts escaped where it was made."""


def _table(headers: list[str], rows: Sequence[Sequence[Any]], num_cols: tuple[int, ...] = ()) -> str:
    """Every cell is escaped, except :class:`_Html` ones: metric values come from the server (``kiln report``)."""
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = []
    for row in rows:
        cells = []
        for i, cell in enumerate(row):
            cls = ' class="num"' if i in num_cols else ""
            cells.append(f"<td{cls}>{cell if isinstance(cell, _Html) else escape(str(cell))}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _flatten(d: Any, prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    if isinstance(d, dict):
        for k in sorted(d):
            out += _flatten(d[k], f"{prefix}{k}.")
    else:
        out.append((prefix.rstrip("."), d))
    return out


#: The report page runs no script and loads nothing: the server's report route sends this policy, and the page
#: carries it too, for a file written by ``kiln report --format html`` / ``kiln build --report-html``.
REPORT_CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:; frame-ancestors 'none'"
CSP_META = f'<meta http-equiv="Content-Security-Policy" content="{REPORT_CSP}">'


def _verdict_section(doc: dict, name: str, status: str | None) -> list[str]:
    """The verdict banner, the title, the engine's identity and the failed gates."""
    e = doc.get("engine") or {}
    passed = doc.get("verdict") == "pass"
    gates = doc.get("gates") or []
    judged_ok = sum(1 for g in gates if g.get("passed"))
    parts = [f'<header class="verdict {"pass" if passed else "fail"}" id="verdict">'
             f'<div class="big">{"PASS" if passed else "FAIL"}</div>'
             f'<div>{judged_ok} of {len(gates)} gates passed · {escape(name)}'
             + (f" · index status: {escape(status)}" if status else "") + "</div></header>"]
    parts.append(f"<h1>Validation report: {escape(name)}</h1>")
    parts.append(f"<p>engine <code>{escape(str(doc.get('digest')))}</code><br>build key "
                 f"<code>{escape(str(e.get('build_key')))}</code><br>built {escape(str(e.get('created')))} by kiln "
                 f"{escape(str(e.get('kiln')))} ({escape(str(e.get('recipe')))})</p>")
    failed = [g for g in gates if not g.get("passed")]
    if failed:
        items = "".join(f"<li><b>{escape(g['name'])}</b> ({escape(units.gate_label(g['name']))}): "
                        f"{escape(units.gate_value(g['name'], g.get('value')))} is not {units.gate_op(g['name'])} "
                        f"{escape(units.gate_value(g['name'], g.get('threshold')))}</li>" for g in failed)
        parts.append(f"<p>Failed gates:</p><ul>{items}</ul>")

    return parts


def _gates_section(doc: dict) -> list[str]:
    """Every gate with its value, interval, threshold and decision; the ones not judged and why."""
    gates = doc.get("gates") or []
    parts: list[str] = []
    # gates
    rows = []
    for g in gates:
        ok = g.get("passed")
        extra = f" (against <code>{escape(str(g['against'])[:19])}…</code>)" if g.get("against") else ""
        label = units.gate_label(g["name"]) + units.gate_subject(g)
        rows.append([_Html(f"{escape(label)} <code>{escape(_gate_name(g))}</code>" + extra),
                     units.gate_value(g["name"], g.get("value")), _interval(g),
                     f"{units.gate_op(g['name'])} {units.gate_value(g['name'], g.get('threshold'))}",
                     _Html(f'<span class="{"pass-cell" if ok else "fail-cell"}">{escape(units.gate_decision(g))}'
                           '</span>')])
    for gname, why in _not_judged(doc).items():
        rows.append([f"{units.gate_label(gname)} ({gname})", "—", "", "", _Html(f'<span class="skip-cell">not judged: {escape(str(why))}</span>')])
    parts.append("<h2>Gates</h2>" + _table(["gate", "value", "interval", "threshold", "verdict"], rows, (1,)))
    parts.append(_sequential_note(doc))
    parts += _recipe_section(doc.get("quantization") or {})

    return parts


def _accuracy_section(doc: dict) -> list[str]:
    """Perplexity charts against the reference (and the previous engine), agreement, detectable change, tasks."""
    gates = doc.get("gates") or []
    parts: list[str] = []
    # accuracy
    reg = doc.get("regression") or {}
    prev = reg.get("previous") or None
    acc_rows = [("reference (unquantized)", doc.get("reference_perplexity"), "reference"),
                ("this engine", doc.get("perplexity"), "engine")]
    if prev:
        acc_rows.append((f"previous {str(prev.get('digest'))[7:19]}", prev.get("perplexity"), "previous"))
    parts.append("<h2>Accuracy</h2>" + svg.hbar_chart("chart-accuracy", "Perplexity on held-out text (lower is better)",
                                                       acc_rows))
    ppl_gate = next((g for g in gates if g["name"] == "max_ppl_increase_pct"), None)
    delta_rows = [("this engine", doc.get("ppl_increase_pct"), "engine")]
    if prev:
        delta_rows.append((f"previous {str(prev.get('digest'))[7:19]}", prev.get("ppl_increase_pct"), "previous"))
    if ppl_gate:
        delta_rows.append(("gate (at most)", ppl_gate["threshold"], "reference"))
    parts.append(svg.hbar_chart("chart-accuracy-delta", "Perplexity increase over the reference", delta_rows,
                                fmt=units.percent))
    parts.append(f"<p>top-1 agreement with the reference {escape(units.fraction(doc.get('top1_agreement')))}, mean "
                 f"per-token KL {escape(units.number(doc.get('mean_kl')))}, on {escape(units.count(doc.get('eval_tokens')))} "
                 "held-out tokens.</p>")
    parts += _windows_section(doc)
    parts += _detectable_section(doc)
    parts += _tasks_section(doc.get("tasks") or [])
    if prev:
        parts.append(_table(["", "this engine", "previous engine"], [
            ["perplexity", _fmt(doc.get("perplexity")), _fmt(prev.get("perplexity"))],
            ["increase over the reference", units.percent(doc.get("ppl_increase_pct")),
             units.percent(prev.get("ppl_increase_pct"))],
            ["top-1 agreement", units.fraction(doc.get("top1_agreement")), units.fraction(prev.get("top1_agreement"))],
            ["mean KL", _fmt(doc.get("mean_kl")), _fmt(prev.get("mean_kl"))],
        ], (1, 2)))

    return parts


def _throughput_section(doc: dict) -> list[str]:
    parts: list[str] = []
    # throughput
    points = doc.get("throughput") or []
    profile = (doc.get("spec") or {}).get("profile") or {}
    inp = profile.get("max_input_len") if isinstance(profile, dict) else None
    by_batch = [p for p in points if p.get("seq_len") == inp] or [p for p in points if p.get("seq_len") == max(
        (q.get("seq_len", 0) for q in points), default=0)]
    by_batch = sorted(by_batch, key=lambda p: p["batch_size"])
    parts.append("<h2>Throughput</h2>" + svg.vbar_chart(
        "chart-throughput", f"Forward tokens/s by batch size (sequence {by_batch[0]['seq_len'] if by_batch else '—'})",
        [str(p["batch_size"]) for p in by_batch], [p["tokens_per_s"] for p in by_batch], unit="tokens/s",
        x_label="batch size"))
    by_seq = sorted((p for p in points if p.get("batch_size") == 1), key=lambda p: p["seq_len"])
    if by_seq:
        parts.append(svg.vbar_chart("chart-throughput-seq", "Forward tokens/s by sequence length (batch 1)",
                                    [str(p["seq_len"]) for p in by_seq], [p["tokens_per_s"] for p in by_seq],
                                    unit="tokens/s", x_label="sequence length", color="#4c51bf"))
    parts.append(_table(["batch", "sequence", "throughput (median)", "throughput (best)", "time (median)", "spread",
                         "reps"],
                        [[_fmt(p.get("batch_size")), _fmt(p.get("seq_len")), units.rate(p.get("tokens_per_s")),
                          units.rate(p.get("tokens_per_s_best")), units.duration(p.get("seconds_median")),
                          units.duration(p.get("seconds_spread")), _fmt(p.get("reps"))] for p in points],
                        (0, 1, 2, 3, 4, 5, 6)))

    return parts


def _latency_section(doc: dict) -> list[str]:
    parts: list[str] = []
    # latency
    cond = doc.get("conditions") or {}
    lat_cond = cond.get("latency") or {}
    parts.append("<h2>Generation latency</h2>")
    if lat_cond.get("tpot"):
        parts.append(f'<p class="note">TPOT {escape(lat_cond["tpot"])}.</p>')
    parts.append(_table(["batch", "prompt", "new tokens", "TTFT", "TPOT", "decode", "reps"],
                        [[_fmt(p.get("batch_size")), _fmt(p.get("prompt_len")), _fmt(p.get("new_tokens")),
                          _ms(p.get("ttft_ms")), _ms(p.get("tpot_ms")), units.rate(p.get("decode_tokens_per_s")),
                          _fmt(p.get("reps"))] for p in doc.get("latency") or []], (0, 1, 2, 3, 4, 5, 6)))

    return parts


def _memory_section(doc: dict) -> list[str]:
    cond = doc.get("conditions") or {}
    parts: list[str] = []
    # memory
    mem_cond = cond.get("memory") or {}
    budget = doc.get("memory_budget_bytes")
    mem_rows = [("peak at the corner", doc.get("peak_memory_bytes"), "engine")]
    if budget is not None:
        mem_rows.append(("budget", budget, "reference"))
    corner = mem_cond.get("corner") or {}
    parts.append("<h2>Peak memory</h2>" + svg.hbar_chart(
        "chart-memory", f"Peak memory at batch {corner.get('batch_size', '—')} × sequence {corner.get('seq_len', '—')}",
        [(label, v if isinstance(v, (int, float)) else None, c) for label, v, c in mem_rows], fmt=units.bytes_iec))
    parts.append(f"<p>peak {escape(units.bytes_iec(doc.get('peak_memory_bytes')))} of a budget of "
                 f"{escape(units.bytes_iec(budget))} "
                 f"({escape(str((cond.get('gate_sources') or {}).get('max_peak_memory_bytes', '')))}). Measured by: "
                 f"{escape(str(mem_cond.get('method') or '—'))}.</p>")

    return parts


def _regression_section(doc: dict) -> list[str]:
    reg = doc.get("regression") or {}
    prev = reg.get("previous") or None
    parts: list[str] = []
    # regression
    parts.append("<h2>Regression against the previous engine</h2>")
    if prev:
        t = reg.get("throughput") or {}
        parts.append(_table(["", "value"], [
            ["previous engine", _Html(f"<code>{escape(str(prev.get('digest')))}</code> "
                                      f"({escape(str(prev.get('status')))}, {escape(str(prev.get('created_at')))})")],
            ["peak throughput, previous → now (best of reps)",
             f"{units.rate(t.get('previous_peak_tokens_per_s'))} → {units.rate(t.get('peak_tokens_per_s'))}"
             + (" (re-measured)" if t.get("rechecked") else "")],
            ["throughput drop", units.percent(reg.get("throughput_drop_pct"))],
            ["perplexity increase, previous → now",
             f"{units.percent(prev.get('ppl_increase_pct'))} → {units.percent(doc.get('ppl_increase_pct'))}"],
            ["perplexity increase change (percentage points)", units.points(reg.get("accuracy_regression_pct"))],
            ["thresholds", ", ".join(f"{units.gate_label(k)} {units.gate_value(k, v)}"
                                     for k, v in (reg.get("thresholds") or {}).items())],
        ]))
    else:
        parts.append("<p>No previous validated engine of this target: nothing to compare with.</p>")
    if reg.get("override_reason"):
        parts.append(f'<p class="note">Override reason: {escape(str(reg["override_reason"]))}</p>')

    return parts


def _build_sections(doc: dict) -> list[str]:
    """The stage timeline, the conditions, the build spec and the toolchain."""
    cond = doc.get("conditions") or {}
    parts: list[str] = []
    # timeline
    stages = doc.get("stages") or []
    parts.append("<h2>Stage timeline</h2>" + svg.timeline(
        "chart-timeline", "Build stages (seconds)",
        [(s.get("name") or "?", float(s.get("seconds") or 0.0), s.get("status") or "") for s in stages]))

    # conditions and spec
    parts.append("<h2>Conditions</h2>" + _table(["condition", "value"], [
        [k, _fmt(v) if not isinstance(v, (list, tuple)) else json.dumps(v)] for k, v in _flatten(cond)]))
    parts.append("<h2>Build spec</h2>" + _table(["field", "value"], [
        [k, _fmt(v) if not isinstance(v, (list, tuple)) else json.dumps(v)] for k, v in _flatten(doc.get("spec") or {})]))
    parts.append("<h2>Toolchain</h2>" + _table(["tool", "version"], [
        [k, str(v)] for k, v in sorted((doc.get("toolchain") or {}).items())]))

    return parts


def render_html(doc: dict, *, status: str | None = None) -> str:
    """A self-contained page: the verdict first, then gates, charts (inline SVG) and the conditions."""
    e = doc.get("engine") or {}
    passed = doc.get("verdict") == "pass"
    name = f"{e.get('repository')}:{e.get('tag')}"
    parts = _verdict_section(doc, name, status)
    parts += _gates_section(doc)
    parts += _accuracy_section(doc)
    parts += _throughput_section(doc)
    parts += _latency_section(doc)
    parts += _memory_section(doc)
    parts += _regression_section(doc)
    parts += _build_sections(doc)
    title = f"{'PASS' if passed else 'FAIL'} — Kiln validation report {name}"
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">" + CSP_META +
            f"<title>{escape(title)}</title><style>{CSS}</style></head>\n<body>\n" + "\n".join(parts)
            + "\n</body></html>\n")


def _recipe_section(q: dict) -> list[str]:
    """The recipe built; with ``--recipe auto``, one row per rung the ladder tried."""
    if not q:
        return []
    out = [f"<h2>Recipe</h2><p>built with <code>{escape(str(q.get('built')))}</code> "
           f"(requested <code>{escape(str(q.get('requested')))}</code>)</p>"]
    rungs = q.get("ladder") or []
    if rungs:
        rows = []
        for r in rungs:
            m = r.get("metrics") or {}
            rows.append([r.get("recipe"), units.percent(m.get("ppl_increase_pct")),
                         units.fraction(m.get("top1_agreement")), units.number(m.get("mean_kl")), r.get("judged_on"),
                         units.rung_verdict(r),
                         ", ".join(f"{k} {units.duration(v)}" for k, v in (r.get("seconds") or {}).items())])
        out.append(_table(["rung", "perplexity increase", "top-1 agreement", "mean KL", "judged on", "verdict", "time"],
                          rows, (1, 2, 3)))
    return out


def _windows_section(doc: dict) -> list[str]:
    """The window lengths evaluated (the positions each covers, against the model's sliding window), and the text
    convention: what every window starts with."""
    acc = (doc.get("conditions") or {}).get("accuracy") or {}
    rows = [[_fmt(doc.get("seq_len") or acc.get("seq_len")), "0–" + str((acc.get("seq_len") or 1) - 1),
             _fmt((doc.get("sequential") or {}).get("windows")), units.percent(doc.get("ppl_increase_pct")),
             units.fraction(doc.get("top1_agreement")), _fmt(doc.get("mean_kl"))]]
    for longer in doc.get("long_windows") or []:
        n = longer.get("seq_len") or 0
        rows.append([_fmt(n), f"0–{n - 1}", _fmt(longer.get("windows")) if longer.get("evaluated") else
                     f"not evaluated: {longer.get('why')}", units.percent(longer.get("ppl_increase_pct")),
                     units.fraction(longer.get("top1_agreement")), _fmt(longer.get("mean_kl"))])
    window = acc.get("sliding_window")
    text = acc.get("text") or {}
    starts = " ".join(text.get("prefix_tokens") or []) or "the text itself (the tokenizer adds nothing before a text)"
    note = (f"<p>Every window starts with {escape(starts)}; what the tokenizer puts before a text is conditioned on "
            "and never scored." + (f" The model's sliding attention window is {window} tokens." if window else "")
            + "</p>")
    return [_table(["window length", "positions", "windows", "perplexity increase", "top-1 agreement", "mean KL"],
                   rows, (0, 2, 3, 4, 5)), note]


def _sequential_note(doc: dict) -> str:
    seq = doc.get("sequential") or {}
    if not seq:
        return ""
    looks = seq.get("looks") or []
    text = (f"Evaluated {_fmt(seq.get('windows'))} of {_fmt(seq.get('of'))} windows in a fixed random order"
            + (", stopped once every accuracy gate was decided" if seq.get("stopped_early") else "")
            + f". Looks planned at {', '.join(str(x) for x in looks)} windows; each end of each look's interval is a "
            f"one-sided bound at {units.fraction(seq.get('confidence_per_look'))}, so that all looks together err with probability ≤ "
            f"{_fmt(seq.get('alpha'))}. UNDECIDED: the interval straddles the threshold, so this evaluation cannot "
            "tell; it does not pass.")
    return f'<p class="note">{escape(text)}</p>'


def _detectable_section(doc: dict) -> list[str]:
    """Each window metric's interval and the smallest change the evaluation could have detected (paired), with the
    windows an unpaired comparison would need for the same."""
    intervals, mde = doc.get("intervals") or {}, doc.get("mde") or {}
    if not intervals:
        return []
    rows = []
    for name, iv in intervals.items():
        m = mde.get(name) or {}
        gate = _GATE_OF_METRIC.get(name, name)

        def show(v: Any, gate: str = gate) -> str:
            return units.gate_value(gate, v)
        rows.append([units.gate_label(gate), show(iv.get("value")), f"[{show(iv.get('low'))}, {show(iv.get('high'))}]",
                     show(m.get("paired")), _fmt(m.get("windows")), _fmt(m.get("unpaired_windows_needed"))])
    return [_table(["metric", "value", "bounds (one-sided, at the last look's confidence)", "smallest detectable change (paired)", "windows",
                    "windows an unpaired test would need"], rows, (1, 3, 4, 5))]


def _tasks_section(tasks: list[dict]) -> list[str]:
    if not tasks:
        return []
    rows = [[t.get("task"), _items(t), units.fraction(t.get("engine_accuracy")),
             units.fraction(t.get("reference_accuracy")), units.points(t.get("drop_pts")),
             f"[{units.points((t.get('interval') or {}).get('low'))}, "
             f"{units.points((t.get('interval') or {}).get('high'))}]"
             + (f" ({units.fraction((t.get('interval') or {}).get('confidence'))})"
                if isinstance((t.get('interval') or {}).get('confidence'), (int, float)) else ""),
             units.points(t.get("mde_pts")), _fmt(t.get("unpaired_items_needed")),
             f"{_fmt(t.get('engine_only_correct'))} / {_fmt(t.get('reference_only_correct'))}"] for t in tasks]
    return ["<h2>Tasks</h2>", _table(
        ["task", "items evaluated", "engine accuracy", "reference accuracy", "drop", "interval",
         "smallest detectable drop", "items an unpaired test would need", "only engine / only reference right"],
        rows, (1, 2, 3, 4, 6, 7))]


def _items(t: dict) -> str:
    """``64 of 200`` (sequential evaluation stopped once the task gate was decided) or ``200``."""
    n, total = t.get("items"), t.get("total")
    return f"{_fmt(n)} of {_fmt(total)}" if isinstance(total, int) and total != n else _fmt(n)


def render_junit(doc: dict) -> str:
    """One ``<testcase>`` per gate: a ``<failure>`` for a failed gate, ``<skipped>`` for a regression gate that
    could not be judged (no previous engine, different conditions)."""
    e = doc.get("engine") or {}
    gates = doc.get("gates") or []
    not_judged = _not_judged(doc)
    failures = sum(1 for g in gates if not g.get("passed"))
    suite_name = f"kiln.validation.{e.get('repository')}:{e.get('tag')}"
    validate_s = next((s["seconds"] for s in doc.get("stages") or [] if s.get("name") == "validate"), 0.0)
    root = ET.Element("testsuites", name="kiln validation", tests=str(len(gates) + len(not_judged)),
                      failures=str(failures), errors="0", skipped=str(len(not_judged)), time=f"{validate_s:.3f}")
    suite = ET.SubElement(root, "testsuite", name=suite_name, tests=str(len(gates) + len(not_judged)),
                          failures=str(failures), errors="0", skipped=str(len(not_judged)), time=f"{validate_s:.3f}")
    if e.get("created"):
        suite.set("timestamp", str(e["created"]).rstrip("Z"))
    props = ET.SubElement(suite, "properties")
    for k, v in (("digest", doc.get("digest")), ("build_key", e.get("build_key")), ("verdict", doc.get("verdict")),
                 ("repository", e.get("repository")), ("tag", e.get("tag"))):
        ET.SubElement(props, "property", name=k, value=str(v))
    for g in gates:
        case = ET.SubElement(suite, "testcase", classname=suite_name, name=_gate_name(g), time="0")
        op = units.gate_op(g["name"])
        detail = (f"{_gate_name(g)} ({units.gate_label(g['name'])}): value "
                  f"{units.gate_value(g['name'], g.get('value'))} {op} threshold "
                  f"{units.gate_value(g['name'], g.get('threshold'))}")
        if g.get("interval"):
            detail += f", interval {_interval(g)}: {units.gate_decision(g)}"
        if g.get("against"):
            detail += f" (against the previous engine {g['against']})"
        if not g.get("passed"):
            failure = ET.SubElement(case, "failure", message=detail.replace(f" {op} ", " violates "),
                                    type="GateFailed")
            failure.text = detail
        else:
            ET.SubElement(case, "system-out").text = detail
    for gname, why in not_judged.items():
        case = ET.SubElement(suite, "testcase", classname=suite_name, name=gname, time="0")
        ET.SubElement(case, "skipped", message=why)
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"

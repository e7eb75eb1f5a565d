"""The operator dashboard (``GET /``: static HTML + JavaScript polling the JSON API, no build step), the data it
needs beyond the other routers (``GET /v1/tags``, throughput charts as server-side SVG, the engine's validation
report page) and ``POST /v1/fit`` (does an engine's envelope still fit the traffic? see validation/fit.py)."""

from __future__ import annotations

import html
import math
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Body, Query
from fastapi.responses import FileResponse, HTMLResponse, Response
from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from api.deps import SessionDep
from kiln import units
from kiln.digests import parse_digest
from kiln.errors import ArtifactUnknown, SpecError
from kiln.tables import Artifact, EngineName, Tag
from kiln.spec import PROFILES
from validation import fit as fitting
from validation.report import REPORT_CSP, document_for_row, render_html
from api.resolution import servable_grid

STATIC = Path(__file__).resolve().parent.parent / "static"
router = APIRouter(tags=["dashboard"])
MAX_FIT_REQUESTS = 200_000
MAX_TREND = 200  # engines per model in a trend, the newest
#: The dashboard runs only its own script and style, talks only to this server, and is never framed.
DASHBOARD_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' blob: data:; "
                 "connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'")
PAGE_HEADERS = {"X-Frame-Options": "DENY", "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}


# -- pages ------------------------------------------------------------------------------------------------------
@router.get("/", include_in_schema=False)
def dashboard() -> FileResponse:
    """The dashboard: builds, engines per model and target, one engine's page (``/#/engine/<digest>``)."""
    return FileResponse(STATIC / "index.html", media_type="text/html; charset=utf-8",
                        headers={"Cache-Control": "no-cache", "Content-Security-Policy": DASHBOARD_CSP, **PAGE_HEADERS})


# -- tags -------------------------------------------------------------------------------------------------------
@router.get("/v1/tags")
def list_tags(session: SessionDep, model: str | None = Query(None, max_length=255),
              digest: str | None = Query(None, max_length=71)):
    """Tags (``<model>:<name>`` → digest), filtered by model and by the digest they point at."""
    q = select(Tag)
    if model is not None:
        q = q.where(Tag.repository == model)
    if digest is not None:
        q = q.where(Tag.digest == parse_digest(digest))
    rows = session.scalars(q.order_by(Tag.repository, Tag.name))
    return {"tags": [{"repository": t.repository, "name": t.name, "digest": t.digest,
                      "updated_at": t.updated_at.isoformat() if t.updated_at else None} for t in rows]}


# -- release views: a model's trend across builds, the servable grid ------------------------------------------------
def _finite(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def trend_metrics(validation: dict | None) -> dict:
    """The numbers a trend plots from one validation report: perplexity increase (%), mean KL, top-1 agreement,
    peak throughput (the highest tokens/s among the measured points), TTFT and TPOT (ms); None where absent."""
    m = (validation or {}).get("metrics") or {}
    tps = [t for p in m.get("throughput") or [] if isinstance(p, dict)
           if (t := _finite(p.get("tokens_per_s"))) is not None]
    return {"ppl_increase_pct": _finite(m.get("ppl_increase_pct")), "mean_kl": _finite(m.get("mean_kl")),
            "top1_agreement": _finite(m.get("top1_agreement")), "peak_tokens_per_s": max(tps) if tps else None,
            "ttft_ms": _finite(m.get("ttft_ms")), "tpot_ms": _finite(m.get("tpot_ms"))}


@router.get("/v1/trend")
def model_trend(session: SessionDep, model: str = Query(..., min_length=1, max_length=255)):
    """A model's engines (published in it or named there), oldest first (its newest MAX_TREND), each with its
    variant, state, verdict and the metrics a trend plots (see :func:`trend_metrics`)."""
    q = (select(Artifact).where(or_(Artifact.repository == model, Artifact.digest.in_(
        select(EngineName.digest).where(EngineName.repository == model))))
         .order_by(Artifact.created_at.desc()).limit(MAX_TREND))
    rows = list(session.scalars(q))[::-1]
    if not rows:
        raise ArtifactUnknown(f"no engines for model {model!r}", field="model",
                              fix="list engines with GET /v1/artifacts")
    return {"model": model, "engines": [
        {"digest": a.digest, "repository": a.repository, "tag": a.tag, "status": a.status, "precision": a.precision,
         "target": a.target, "profile": a.profile, "backend": a.backend,
         "checkpoint_revision": a.checkpoint_revision, "passed": (a.validation or {}).get("passed"),
         "created_at": a.created_at.isoformat() if a.created_at else None, "metrics": trend_metrics(a.validation)}
        for a in rows]}


@router.get("/v1/grid")
def grid(session: SessionDep, model: str | None = Query(None, min_length=1, max_length=255)):
    """What is servable now: per model, a precision × target grid whose every cell holds, for each variant
    (profile, backend) asked for or built, the engine ``GET /v1/resolve`` answers, or its code and reason for
    none (api/resolution.py's servable_grid)."""
    return {"models": servable_grid(session, model)}


# -- charts and the report ----------------------------------------------------------------------------------------
def _artifact(session: Session, digest: str) -> Artifact:
    row = session.get(Artifact, parse_digest(digest))
    if row is None:
        raise ArtifactUnknown(f"no engine {digest}", field="digest", fix="list engines with GET /v1/artifacts")
    return row


def throughput_series(points: list[dict], by: str) -> tuple[list[tuple[int, float]], str]:
    """``by=batch``: tokens/s against batch size at the sequence length measured with the most batch sizes (the
    longest on a tie); ``by=seq``: against sequence length at the batch size measured with the most sequence
    lengths (the smallest on a tie). Returns the series and what was held fixed."""
    pts = [p for p in points if isinstance(p, dict) and all(isinstance(p.get(k), (int, float))
                                                             for k in ("batch_size", "seq_len", "tokens_per_s"))]
    if not pts:
        return [], ""
    def count(key: str, value) -> int:
        return sum(1 for p in pts if p[key] == value)

    if by == "batch":
        seq = max({p["seq_len"] for p in pts}, key=lambda v: (count("seq_len", v), v))
        chosen = {p["batch_size"]: p["tokens_per_s"] for p in pts if p["seq_len"] == seq}
        fixed = f"sequence length {seq}"
    else:
        batch = max({p["batch_size"] for p in pts}, key=lambda v: (count("batch_size", v), -v))
        chosen = {p["seq_len"]: p["tokens_per_s"] for p in pts if p["batch_size"] == batch}
        fixed = f"batch size {batch}"
    return sorted((int(x), float(y)) for x, y in chosen.items()), fixed


def _nice_max(v: float) -> float:
    if v <= 0 or not math.isfinite(v):
        return 1.0
    exp = 10 ** math.floor(math.log10(v))
    for m in (1, 2, 2.5, 5, 10):
        if m * exp >= v:
            return m * exp
    return 10 * exp


def _fmt(v: float) -> str:
    if v >= 1e6:
        return f"{v / 1e6:g}M"
    if v >= 1e3:
        return f"{v / 1e3:g}k"
    return f"{v:g}"


def svg_chart(series: list[tuple[int, float]], *, title: str, x_label: str, y_label: str,
              width: int = 520, height: int = 280) -> str:
    """A small line chart (categorical x, linear y from 0) as a standalone SVG document."""
    e = html.escape
    left, right, top, bottom = 64, 16, 44, 48
    pw, ph = width - left - right, height - top - bottom
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
           f'font-family="system-ui, sans-serif" font-size="12" role="img" aria-label="{e(title)}">',
           f'<rect width="{width}" height="{height}" fill="#ffffff"/>',
           f'<text x="{left}" y="20" font-size="14" font-weight="600" fill="#1f2933">{e(title)}</text>']
    if not series:
        out.append(f'<text x="{width / 2}" y="{height / 2}" text-anchor="middle" fill="#616e7c">no throughput points</text>')
        return "".join(out) + "</svg>"
    ymax = _nice_max(max(y for _, y in series) * 1.05)
    for i in range(5):
        v = ymax * i / 4
        y = top + ph - ph * i / 4
        out.append(f'<line x1="{left}" x2="{left + pw}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e4e7eb"/>')
        out.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end" fill="#616e7c">{_fmt(v)}</text>')
    n = len(series)
    xs = [left + pw * (i + 0.5) / n for i in range(n)]
    ys = [top + ph - ph * y / ymax for _, y in series]
    out.append(f'<line x1="{left}" x2="{left + pw}" y1="{top + ph}" y2="{top + ph}" stroke="#9aa5b1"/>')
    for (xv, yv), x, y in zip(series, xs, ys):
        out.append(f'<text x="{x:.1f}" y="{top + ph + 16}" text-anchor="middle" fill="#3e4c59">{xv}</text>')
    if n > 1:
        pts = " ".join(f"{x:.1f},{y:.1f}" for x, y in zip(xs, ys))
        out.append(f'<polyline points="{pts}" fill="none" stroke="#2563eb" stroke-width="2"/>')
    for (xv, yv), x, y in zip(series, xs, ys):
        out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="4" fill="#2563eb"><title>{xv}: {units.rate(yv)}</title></circle>')
        out.append(f'<text x="{x:.1f}" y="{y - 8:.1f}" text-anchor="middle" fill="#1f2933">{units.count(yv)}</text>')
    out.append(f'<text x="{left + pw / 2}" y="{height - 10}" text-anchor="middle" fill="#3e4c59">{e(x_label)}</text>')
    out.append(f'<text transform="translate(14 {top + ph / 2}) rotate(-90)" text-anchor="middle" fill="#3e4c59">'
               f'{e(y_label)}</text>')
    return "".join(out) + "</svg>"


def throughput_svg(validation: dict, by: str) -> str:
    points = ((validation or {}).get("metrics") or {}).get("throughput") or []
    series, fixed = throughput_series(points, by)
    what = "batch size" if by == "batch" else "sequence length"
    title = f"Prefill throughput vs {what}" + (f" ({fixed})" if fixed else "")
    return svg_chart(series, title=title, x_label=what, y_label="tokens/s")


@router.get("/v1/artifacts/{digest}/throughput.svg", response_class=Response,
            responses={200: {"content": {"image/svg+xml": {}}}})
def throughput_chart(digest: str, session: SessionDep, by: str = Query("batch", pattern="^(batch|seq)$")):
    """The validation's throughput points as an SVG line chart (tokens/s against batch size or sequence length)."""
    row = _artifact(session, digest)
    return Response(throughput_svg(row.validation, by), media_type="image/svg+xml",
                    headers={"Cache-Control": "public, max-age=31536000, immutable"})  # a digest's report never changes


@router.get("/v1/artifacts/{digest}/report.html", response_class=HTMLResponse)
def report_html(digest: str, session: SessionDep):
    """The engine's validation report as one self-contained HTML page with its charts (server-side SVG): the
    same page as ``kiln report DIGEST --format html`` (validation/report.py)."""
    row = _artifact(session, digest)
    page = render_html(document_for_row(row), status=row.status)  # which carries the policy itself
    return HTMLResponse(page, headers={"Content-Security-Policy": REPORT_CSP, "Cache-Control": "no-cache",
                                       **PAGE_HEADERS})


# -- fit ----------------------------------------------------------------------------------------------------------
def engine_envelope(a: Artifact) -> dict:
    """An engine's identity and its batch profile limits (from the build spec in its provenance)."""
    prof = ((a.provenance or {}).get("spec") or {}).get("profile")
    if not isinstance(prof, dict) and a.profile in PROFILES:
        prof = PROFILES[a.profile].model_dump()
    return {"digest": a.digest, "repository": a.repository, "tag": a.tag, "status": a.status, "target": a.target,
            "precision": a.precision, "backend": a.backend,
            "profile": {"name": a.profile, **{k: (prof or {}).get(k) for k in fitting.ENVELOPE_FIELDS}}}


def fresh_engines(session: Session, model: str) -> list[dict]:
    rows = session.scalars(select(Artifact).where(Artifact.repository == model, Artifact.status == "fresh")
                           .order_by(Artifact.created_at.desc()))
    return [engine_envelope(a) for a in rows]


def _traffic(value: Any) -> list[fitting.Request]:
    if isinstance(value, str):
        return fitting.parse_jsonl(value.splitlines())
    if isinstance(value, list):
        if len(value) > MAX_FIT_REQUESTS:
            raise SpecError(f"more than {MAX_FIT_REQUESTS:,} requests", field="traffic",
                            fix="sample the traffic, or run kiln fit locally")
        return fitting.parse_records(value)
    raise SpecError("traffic must be a list of requests or a JSON-lines string", field="traffic",
                    fix='send {"traffic": [{"prompt_tokens": 120, "output_tokens": 80, "arrival_s": 0.5}, ...]}')


@router.post("/v1/fit", openapi_extra={"requestBody": {"required": True, "content": {"application/json": {"schema": {
    "type": "object", "required": ["traffic"], "properties": {
        "traffic": {"oneOf": [{"type": "array", "items": {"type": "object"}}, {"type": "string"}]},
        "model": {"type": "string"}, "threshold": {"type": "number"},
        "prefill_tps": {"type": "number"}, "decode_tps": {"type": "number"}}}}}}})
def fit_traffic(session: SessionDep, body: Any = Body(None)):
    """Which share of a traffic sample each named profile (and each fresh engine of ``model``) covers, the best
    profile, a suggested envelope, and the engines whose envelope no longer fits (coverage < threshold)."""
    if not isinstance(body, dict) or "traffic" not in body:
        raise SpecError("the body must be a JSON object with traffic", field="traffic",
                        fix='send {"traffic": [...], "model": "acme/tiny", "threshold": 0.95}')
    unknown = sorted(set(body) - {"traffic", "model", "threshold", "prefill_tps", "decode_tps"})
    if unknown:
        raise SpecError(f"unknown field {unknown[0]!r}", field=unknown[0],
                        fix="use traffic, model, threshold, prefill_tps, decode_tps")
    requests = _traffic(body["traffic"])
    threshold = fitting.check_threshold(body.get("threshold", fitting.DEFAULT_THRESHOLD))
    service = fitting.ServiceModel(body.get("prefill_tps", fitting.DEFAULT_PREFILL_TPS),
                                   body.get("decode_tps", fitting.DEFAULT_DECODE_TPS))
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not model or len(model) > 255):
        raise SpecError(f"{model!r} is not a model name", field="model", fix="give the engine repository, e.g. acme/tiny")
    engines = fresh_engines(session, model) if model else []
    return {"model": model, **fitting.analyze(requests, engines=engines, threshold=threshold, model=service)}

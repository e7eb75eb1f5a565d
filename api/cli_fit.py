"""``kiln fit --traffic FILE``: does the build envelope still fit the traffic? (see validation/fit.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import click

from api.cli_base import main
from kiln import units
from kiln.errors import SpecError, ValidationFailed
from validation import fit as fitting


def _pct(v: float | None) -> str:
    return "n/a" if v is None else units.fraction(v)


def _limits(lim: dict) -> str:
    return f"{lim['max_batch_size']}/{lim['max_input_len']}/{lim['max_seq_len']}/{lim['max_num_tokens']}"


def print_report(report: dict, model: str | None) -> None:
    t, c = report["traffic"], report["traffic"]["concurrency"]
    s = report["service_model"]
    n = units.number
    click.echo(f"traffic: {units.count(t['requests'])} request{'s' if t['requests'] != 1 else ''} over "
               f"{units.duration(t['window_s'])}; prompt p50 {n(t['prompt_tokens']['p50'])} "
               f"/ p95 {n(t['prompt_tokens']['p95'])} / max {n(t['prompt_tokens']['max'])}; prompt+output p95 "
               f"{n(t['total_tokens']['p95'])} / max {n(t['total_tokens']['max'])}; concurrency mean {n(c['mean'])}, "
               f"p95 {n(c['p95'])}, peak {n(c['peak'])}")
    click.echo(f"  (a request holds a batch slot for its duration_s, else prompt/{n(s['prefill_tps'])} + "
               f"output/{n(s['decode_tps'])} s; "
               f"threshold {units.fraction(report['threshold'])})")
    click.echo(f"{'profile':<12} {'batch/input/seq/tokens':<22} {'lengths':>8} {'batch':>8} {'coverage':>9}")
    for p in report["profiles"]:
        mark = "  <- best" if p["name"] == report["best_profile"] else ""
        click.echo(f"{p['name']:<12} {_limits(p['limits']):<22} {_pct(p['length_coverage']):>8} "
                   f"{_pct(p['batch_coverage']):>8} {_pct(p['coverage']):>9}{mark}")
    click.echo(f"suggested envelope: max_batch_size {report['suggested']['max_batch_size']}, max_input_len "
               f"{report['suggested']['max_input_len']}, max_seq_len {report['suggested']['max_seq_len']}, "
               f"max_num_tokens {report['suggested']['max_num_tokens']}")
    if model is None:
        return
    engines = report["engines"]
    if not engines:
        click.echo(f"no fresh engines of {model}")
        return
    click.echo(f"fresh engines of {model}:")
    for e in engines:
        if e.get("error"):
            click.echo(f"  {e['digest'][:19]}…  {e['tag']:<28} cannot judge: {e['error']}")
            continue
        verdict = (f"DRIFT: below {units.fraction(report['threshold'])}, best profile now {report['best_profile']}"
                   if e["drifted"] else "fits")
        click.echo(f"  {e['digest'][:19]}…  {e['tag']:<28} {e['profile']:<10} {_limits(e['limits']):<18} "
                   f"lengths {_pct(e['length_coverage'])} batch {_pct(e['batch_coverage'])}  {verdict}")


def _remote_engines(server: str, model: str) -> list[dict]:
    """The model's fresh engines and their limits from a remote Kiln (the traffic stays on this machine)."""
    import httpx

    from api.remote import server_root

    token = os.environ.get("KILN_TOKEN")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with httpx.Client(base_url=server_root(server), timeout=30, headers=headers) as client:
        resp = client.get("/v1/artifacts", params={"model": model, "status": "fresh", "limit": 500})
        if resp.status_code != 200:
            raise SpecError(f"{server} answered {resp.status_code}: {resp.text[:200]}", field="server",
                            fix="check the URL and KILN_TOKEN")
        out = []
        for a in resp.json()["artifacts"]:
            full = client.get(f"/v1/artifacts/{a['digest']}").json()
            prof = ((full.get("provenance") or {}).get("spec") or {}).get("profile") or {}
            out.append({k: a.get(k) for k in ("digest", "repository", "tag", "status", "target", "precision", "backend")}
                       | {"profile": {"name": a.get("profile"), **{k: prof.get(k) for k in fitting.ENVELOPE_FIELDS}}})
        return out


def _local_engines(model: str) -> list[dict]:
    from api.cli_base import _context
    from api.routes.dashboard import fresh_engines

    _, _, sessions = _context()
    with sessions() as s:
        return fresh_engines(s, model)


@main.command("fit")
@click.option("--traffic", "traffic", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help='JSON lines: {"prompt_tokens": int, "output_tokens": int, "arrival_s": float} per request')
@click.option("--model", "model", help="judge this model's fresh engines from the index")
@click.option("--threshold", default="95%", show_default=True, help="coverage below this is drift (0.95 or 95%)")
@click.option("--prefill-tps", default=fitting.DEFAULT_PREFILL_TPS, show_default=True, type=float,
              help="prompt tokens/s of one request's prefill (concurrency model)")
@click.option("--decode-tps", default=fitting.DEFAULT_DECODE_TPS, show_default=True, type=float,
              help="generated tokens/s per sequence, 1/TPOT (concurrency model)")
@click.option("--server", help="read the engines from a remote Kiln (http://host:8000; token from KILN_TOKEN)")
@click.option("--fail-on-drift", is_flag=True, help="exit 1 when an engine drifted below the threshold")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def fit_command(traffic: Path, model: str | None, threshold: str, prefill_tps: float, decode_tps: float,
                server: str | None, fail_on_drift: bool, as_json: bool) -> None:
    """Which share of a traffic sample each batch profile (and each fresh engine of --model) covers, the best
    named profile, and engines whose envelope no longer fits the traffic (silent profile drift)."""
    if not traffic.is_file():
        raise SpecError(f"{traffic} is not a file", field="traffic", fix="give a JSON-lines traffic sample")
    share = fitting.parse_threshold(threshold)
    with traffic.open(encoding="utf-8") as f:
        requests = fitting.parse_jsonl(f)
    engines = []
    if model:
        engines = _remote_engines(server, model) if server else _local_engines(model)
    report = fitting.analyze(requests, engines=engines, threshold=share,
                             model=fitting.ServiceModel(prefill_tps, decode_tps))
    report = {"model": model, **report}
    if as_json:
        click.echo(json.dumps(report, sort_keys=True))
    else:
        print_report(report, model)
    if fail_on_drift and report["drifted"]:
        raise ValidationFailed(f"{len(report['drifted'])} engine(s) of {model} cover less than "
                               f"{share * 100:g}% of the traffic; best profile: {report['best_profile']}")

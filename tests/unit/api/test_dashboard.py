"""The dashboard's server side: the page and its static files, /v1/tags, the throughput SVG and the report page,
POST /v1/fit, and ``kiln fit`` (local index and --json). The page in a real browser: tests/integration/test_dashboard.py."""

from __future__ import annotations

import json
import random
import uuid
import xml.etree.ElementTree as ET

import pytest
from click.testing import CliRunner
from fastapi.testclient import TestClient

from api.app import create_app
from api.cli import main
from api.routes.dashboard import STATIC, svg_chart, throughput_series
from kiln import db
from kiln.tables import Artifact, Tag
from kiln.settings import Settings, get_settings
from kiln.spec import PROFILES

SVG = "{http://www.w3.org/2000/svg}"
POINTS = [{"batch_size": b, "seq_len": s, "tokens_per_s": tps, "seconds_median": 0.01}
          for b, s, tps in ((1, 256, 20000.0), (2, 256, 36000.0), (4, 256, 50000.0), (8, 256, 61000.0),
                            (1, 64, 9000.0), (1, 128, 15000.0))]
VALIDATION = {"passed": True, "metrics": {"perplexity": 39.49, "reference_perplexity": 39.35, "ppl_increase_pct": 0.36,
                                          "top1_agreement": 0.936, "mean_kl": 0.008, "tokens": 1024, "throughput": POINTS},
              "gates": [{"name": "max_ppl_increase_pct", "value": 0.36, "threshold": 3.0, "passed": True},
                        {"name": "min_top1_agreement", "value": 0.936, "threshold": 0.85, "passed": True}]}


def add_engine(sessions, *, model="acme/tiny", profile="latency", status="fresh", limits=None, validation=None,
               tag=None) -> str:
    d = "sha256:" + uuid.uuid4().hex * 2
    prof = limits or PROFILES[profile].model_dump()
    with sessions() as s:
        s.add(Artifact(digest=d, build_key=d, repository=model, tag=f"fp8-cpu-{profile}-checkpoint", status=status,
                       precision="fp8", target="cpu", profile=profile, backend="checkpoint",
                       checkpoint_ref=f"hf://{model}@main", checkpoint_digest=d, checkpoint_revision="a" * 40,
                       size=5_000_000, provenance={"spec": {"profile": prof}, "toolchain": {"torch": "2.13"}},
                       validation=validation if validation is not None else VALIDATION))
        if tag:
            s.add(Tag(repository=model, name=tag, digest=d))
        s.commit()
    return d


@pytest.fixture
def app_env(tmp_path):
    settings = Settings(home=tmp_path / "home")
    db.upgrade(settings.db_url)
    app = create_app(settings, enqueue=lambda *a, **k: None)
    return TestClient(app), app.state.sessions


def bursts_jsonl(seed: int) -> list[str]:
    """4 bursts of 10 simultaneous 1-second requests, 10 s apart (see tests/unit/validation/test_fit.py): batch 1
    covers 27 of 31 seconds."""
    rows = [{"prompt_tokens": 64, "output_tokens": 64, "arrival_s": 10.0 * b, "duration_s": 1.0}
            for b in range(4) for _ in range(10)]
    random.Random(seed).shuffle(rows)
    return [json.dumps(r) for r in rows]


# -- page and static files ----------------------------------------------------------------------------------------
def test_root_serves_the_dashboard_and_its_static_files(app_env):
    client, _ = app_env
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<script src="/static/dashboard.js">' in page.text and "/static/dashboard.css" in page.text
    js = client.get("/static/dashboard.js")
    assert js.status_code == 200 and "javascript" in js.headers["content-type"]
    assert client.get("/static/dashboard.css").headers["content-type"].startswith("text/css")
    assert client.get("/static/nothing.js").status_code == 404


def test_static_files_reference_nothing_outside_the_api():
    for p in STATIC.iterdir():
        text = p.read_text()
        assert "http://" not in text.replace("http://www.w3.org", "") and "https://" not in text, p
        assert ".innerHTML" not in text, f"{p}: API values must go in as text"


def test_the_dashboard_formats_numbers_only_through_units_js(app_env):
    """units.js (the twin of kiln/units.py) loads before dashboard.js, which keeps no number formatter of its own."""
    client, _ = app_env
    page = client.get("/").text
    assert page.index('<script src="/static/units.js">') < page.index('<script src="/static/dashboard.js">')
    assert "KilnUnits" in client.get("/static/units.js").text
    js = (STATIC / "dashboard.js").read_text()
    for own in ("toFixed", "toPrecision", "toLocaleString", '"KB"', '"MB"', '"GB"', "Math.round(p."):
        assert own not in js, own


def test_static_files_are_package_data():
    import tomllib

    data = tomllib.loads((STATIC.parent.parent / "pyproject.toml").read_text())
    assert "static/*" in data["tool"]["setuptools"]["package-data"]["api"]


# -- tags -----------------------------------------------------------------------------------------------------------
def test_tags_filtered_by_model_and_digest(app_env):
    client, sessions = app_env
    a = add_engine(sessions, tag="fp8-cpu-latency-checkpoint")
    b = add_engine(sessions, model="acme/other", tag="fp8-cpu-latency-checkpoint")
    add_engine(sessions, model="acme/other", profile="balanced")
    assert {t["digest"] for t in client.get("/v1/tags").json()["tags"]} == {a, b}
    only = client.get("/v1/tags", params={"model": "acme/tiny"}).json()["tags"]
    assert [(t["repository"], t["name"], t["digest"]) for t in only] == [("acme/tiny", "fp8-cpu-latency-checkpoint", a)]
    assert [t["digest"] for t in client.get("/v1/tags", params={"digest": b}).json()["tags"]] == [b]
    assert client.get("/v1/tags", params={"digest": "sha256:nothex"}).status_code == 400


# -- charts and report ----------------------------------------------------------------------------------------------
def test_throughput_series():
    by_batch, fixed = throughput_series(POINTS, "batch")
    assert by_batch == [(1, 20000.0), (2, 36000.0), (4, 50000.0), (8, 61000.0)] and fixed == "sequence length 256"
    by_seq, fixed = throughput_series(POINTS, "seq")
    assert by_seq == [(64, 9000.0), (128, 15000.0), (256, 20000.0)] and fixed == "batch size 1"
    assert throughput_series([{"batch_size": "x"}], "batch") == ([], "")
    # a single longer probe at batch 1 (max_seq_len) does not hide the batch sweep at max_input_len
    with_probe = POINTS + [{"batch_size": 1, "seq_len": 512, "tokens_per_s": 18000.0}]
    assert throughput_series(with_probe, "batch")[0] == by_batch
    assert throughput_series(with_probe, "seq")[0] == by_seq + [(512, 18000.0)]


def test_throughput_svg_is_well_formed(app_env):
    client, sessions = app_env
    d = add_engine(sessions)
    r = client.get(f"/v1/artifacts/{d}/throughput.svg")
    assert r.status_code == 200 and r.headers["content-type"].startswith("image/svg+xml")
    root = ET.fromstring(r.content)
    assert root.tag == f"{SVG}svg"
    assert len(root.findall(f"{SVG}circle")) == 4 and root.find(f"{SVG}polyline") is not None
    texts = [t.text for t in root.iter(f"{SVG}text")]
    assert "Prefill throughput vs batch size (sequence length 256)" in texts and "61,000" in texts
    seq = ET.fromstring(client.get(f"/v1/artifacts/{d}/throughput.svg?by=seq").content)
    assert len(seq.findall(f"{SVG}circle")) == 3
    assert client.get(f"/v1/artifacts/{d}/throughput.svg?by=nope").status_code == 422
    assert client.get(f"/v1/artifacts/sha256:{'0' * 64}/throughput.svg").status_code == 404


def test_chart_without_points_and_with_hostile_text():
    empty = ET.fromstring(svg_chart([], title="t", x_label="x", y_label="y"))
    assert "no throughput points" in [t.text for t in empty.iter(f"{SVG}text")]
    odd = ET.fromstring(svg_chart([(1, 5.0)], title='<script>"&', x_label="x", y_label="y"))
    assert '<script>"&' in [t.text for t in odd.iter(f"{SVG}text")]  # escaped in the markup, intact as text


def test_report_page(app_env):
    client, sessions = app_env
    d = add_engine(sessions)
    r = client.get(f"/v1/artifacts/{d}/report.html")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert d in r.text and "PASS" in r.text and "max_ppl_increase_pct" in r.text and r.text.count("<svg") >= 2
    assert "<script" not in r.text and "default-src 'none'" in r.headers["content-security-policy"]
    failed = add_engine(sessions, status="rejected", validation={"passed": False})
    assert "FAIL" in client.get(f"/v1/artifacts/{failed}/report.html").text
    assert client.get(f"/v1/artifacts/sha256:{'0' * 64}/report.html").status_code == 404


# -- POST /v1/fit ---------------------------------------------------------------------------------------------------
def test_fit_endpoint_flags_drifted_engines(app_env):
    client, sessions = app_env
    latency = add_engine(sessions, profile="latency")
    throughput = add_engine(sessions, profile="throughput")
    add_engine(sessions, profile="balanced", status="stale")  # not fresh: not judged
    traffic = [json.loads(line) for line in bursts_jsonl(1)]
    r = client.post("/v1/fit", json={"traffic": traffic, "model": "acme/tiny"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "acme/tiny" and body["best_profile"] == "throughput" and body["threshold"] == 0.95
    engines = {e["digest"]: e for e in body["engines"]}
    assert set(engines) == {latency, throughput}
    assert engines[latency]["drifted"] is True and engines[latency]["batch_coverage"] == 27 / 31
    assert engines[throughput]["drifted"] is False and engines[throughput]["coverage"] == 1.0
    assert body["drifted"] == [latency]
    # a JSON-lines string works too, and a lower threshold accepts batch 1
    r = client.post("/v1/fit", json={"traffic": "\n".join(bursts_jsonl(2)), "model": "acme/tiny", "threshold": 0.85})
    assert r.status_code == 200 and r.json()["drifted"] == [] and r.json()["best_profile"] == "latency"


def test_fit_endpoint_custom_engine_limits_and_service_model(app_env):
    client, sessions = app_env
    limits = {"name": "custom", "max_batch_size": 2, "max_input_len": 100, "max_seq_len": 200, "max_num_tokens": 200}
    d = add_engine(sessions, profile="custom", limits=limits)
    # prefill 100 tok/s + decode 10 tok/s: each of the first three holds a slot 2 s ([0,2), [1,3), [1,3)); the
    # fourth [2, 2.5). In flight: 1 on [0,1), 3 on [1,2.5), 2 on [2.5,3): ≤ 2 for 1.5 s of 3
    traffic = [{"prompt_tokens": 100, "output_tokens": 10, "arrival_s": t} for t in (0.0, 1.0, 1.0)]
    traffic.append({"prompt_tokens": 150, "output_tokens": 10, "arrival_s": 2.0, "duration_s": 0.5})  # prompt too long
    body = client.post("/v1/fit", json={"traffic": traffic, "model": "acme/tiny", "prefill_tps": 100,
                                        "decode_tps": 10}).json()
    (e,) = body["engines"]
    assert e["digest"] == d and e["limits"] == {k: v for k, v in limits.items() if k != "name"}
    assert e["length_coverage"] == 3 / 4 and e["batch_coverage"] == 1.5 / 3 and e["drifted"] is True
    assert body["traffic"]["window_s"] == 3.0 and body["traffic"]["concurrency"]["peak"] == 3


@pytest.mark.parametrize("payload, field", [
    ({}, "traffic"), ([1], "traffic"), ({"traffic": 5}, "traffic"), ({"traffic": []}, "traffic"),
    ({"traffic": [{"prompt_tokens": 1}]}, "traffic.output_tokens"),
    ({"traffic": [{"prompt_tokens": 1, "output_tokens": 1, "arrival_s": 0}], "threshold": 2}, "threshold"),
    ({"traffic": [{"prompt_tokens": 1, "output_tokens": 1, "arrival_s": 0}], "decode_tps": 0}, "decode_tps"),
    ({"traffic": [{"prompt_tokens": 1, "output_tokens": 1, "arrival_s": 0}], "model": 3}, "model"),
    ({"traffic": [{"prompt_tokens": 1, "output_tokens": 1, "arrival_s": 0}], "profile": "x"}, "profile"),
])
def test_fit_endpoint_bad_input_names_the_field(app_env, payload, field):
    client, _ = app_env
    r = client.post("/v1/fit", json=payload)
    assert r.status_code == 422 and r.json()["error"]["field"] == field, r.text


# -- kiln fit -------------------------------------------------------------------------------------------------------
@pytest.fixture
def local_index():
    settings = get_settings()  # KILN_HOME from the autouse fixture
    db.upgrade(settings.db_url)
    return db.session_factory(settings.db_url)


def test_cli_fit_json_and_drift_exit(local_index, tmp_path):
    latency = add_engine(local_index, profile="latency")
    traffic = tmp_path / "traffic.jsonl"
    traffic.write_text("\n".join(bursts_jsonl(3)) + "\n")
    runner = CliRunner()
    r = runner.invoke(main, ["fit", "--traffic", str(traffic), "--model", "acme/tiny", "--json"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.output.strip().splitlines()[-1])
    assert report["drifted"] == [latency] and report["best_profile"] == "throughput"
    assert report["engines"][0]["batch_coverage"] == 27 / 31
    r = runner.invoke(main, ["fit", "--traffic", str(traffic), "--model", "acme/tiny", "--fail-on-drift"])
    assert r.exit_code == 1
    assert "DRIFT" in r.output and "<- best" in r.output and "kiln: error:" in r.output
    r = runner.invoke(main, ["fit", "--traffic", str(traffic), "--model", "acme/tiny", "--threshold", "85%",
                             "--fail-on-drift"])
    assert r.exit_code == 0 and "fits" in r.output


def test_cli_fit_without_model_and_bad_files(local_index, tmp_path):
    traffic = tmp_path / "t.jsonl"
    traffic.write_text('{"prompt_tokens": 10, "output_tokens": 10, "arrival_s": 0}\n')
    r = CliRunner().invoke(main, ["fit", "--traffic", str(traffic)])
    assert r.exit_code == 0 and "latency" in r.output and "suggested envelope" in r.output
    traffic.write_text('{"prompt_tokens": 10, "output_tokens": 10, "arrival_s": 0}\n{"prompt_tokens": 10}\n')
    r = CliRunner().invoke(main, ["fit", "--traffic", str(traffic)])
    assert r.exit_code == 2 and "line 2 has no output_tokens" in r.output
    r = CliRunner().invoke(main, ["fit", "--traffic", str(tmp_path / "missing.jsonl")])
    assert r.exit_code == 2 and "traffic" in r.output
    r = CliRunner().invoke(main, ["fit", "--traffic", str(traffic), "--threshold", "2"])
    assert r.exit_code == 2 and "threshold" in r.output


def test_cli_fit_model_without_fresh_engines(local_index, tmp_path):
    add_engine(local_index, status="stale")
    traffic = tmp_path / "t.jsonl"
    traffic.write_text('{"prompt_tokens": 10, "output_tokens": 10, "arrival_s": 0}\n')
    r = CliRunner().invoke(main, ["fit", "--traffic", str(traffic), "--model", "acme/tiny"])
    assert r.exit_code == 0 and "no fresh engines of acme/tiny" in r.output


def test_page_is_open_and_data_needs_a_token_when_auth_is_required(tmp_path):
    settings = Settings(home=tmp_path / "home", bootstrap_token="kiln_test_token")
    db.upgrade(settings.db_url)
    app = create_app(settings, enqueue=lambda *a, **k: None)
    client = TestClient(app)
    d = add_engine(app.state.sessions)
    assert client.get("/").status_code == 200 and client.get("/static/dashboard.js").status_code == 200
    assert client.get("/metrics").status_code == 200
    assert client.get("/v1/tags").status_code == 401  # the page then asks for a token
    auth = {"Authorization": "Bearer kiln_test_token"}
    assert client.get("/v1/tags", headers=auth).status_code == 200
    assert client.get(f"/v1/artifacts/{d}/throughput.svg", headers=auth).status_code == 200


def test_pages_carry_a_content_security_policy_and_refuse_framing(app_env):
    client, sessions = app_env
    page = client.get("/")
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp and "unsafe-inline" not in csp
    assert page.headers["x-frame-options"] == "DENY" and page.headers["x-content-type-options"] == "nosniff"
    d = add_engine(sessions)
    report = client.get(f"/v1/artifacts/{d}/report.html")
    assert "frame-ancestors 'none'" in report.headers["content-security-policy"]
    assert report.headers["x-frame-options"] == "DENY"
    # opened from a blob: URL the headers are gone: the page carries its policy itself
    assert f'<meta http-equiv="Content-Security-Policy" content="{report.headers["content-security-policy"]}">' in report.text


def test_docs_loading_cdn_scripts_are_off_unless_asked_for(tmp_path):
    settings = Settings(home=tmp_path / "home")
    db.upgrade(settings.db_url)
    client = TestClient(create_app(settings, enqueue=lambda *a, **k: None))
    assert client.get("/docs").status_code == 404 and client.get("/redoc").status_code == 404
    assert client.get("/openapi.json").status_code == 200
    on = TestClient(create_app(Settings(home=tmp_path / "home", api_docs=True), enqueue=lambda *a, **k: None))
    assert on.get("/docs").status_code == 200


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_fit_refuses_non_finite_token_counts_with_422(app_env, value):
    """A non-finite token count was int()'d: ValueError / OverflowError, a 500. In a JSON body the middleware
    refuses it; in a JSON-lines string (or a body behind a UTF-8 BOM, which json.loads reads too) it got through."""
    client, _ = app_env
    line = f'{{"prompt_tokens": {value}, "output_tokens": 1, "arrival_s": 0}}'
    r = client.post("/v1/fit", json={"traffic": line})
    assert r.status_code == 422 and r.json()["error"]["field"] == "traffic.prompt_tokens", r.text
    raw = f'{{"traffic": [{line}]}}'.encode()
    for body in (raw, b"\xef\xbb\xbf" + raw, b" \xef\xbb\xbf" + raw):
        r = client.post("/v1/fit", content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 422, r.text
        assert r.json()["error"]["fix"] == "give a finite number (JSON has no NaN or Infinity)"


def test_a_body_behind_a_bom_is_held_to_the_depth_limit():
    from api.bodies import MAX_JSON_DEPTH, json_body_problem

    deep = b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1)
    assert json_body_problem(deep) is not None
    assert json_body_problem(b"\xef\xbb\xbf" + deep)["message"].startswith("JSON nested deeper")


# -- release views: trend and servable grid -------------------------------------------------------------------------
def test_trend_lists_a_models_engines_oldest_first_with_the_indexed_metrics(app_env):
    client, sessions = app_env
    slower = {**VALIDATION, "metrics": {**VALIDATION["metrics"], "ppl_increase_pct": 1.25, "mean_kl": 0.02,
                                        "ttft_ms": 41.5, "throughput": POINTS[:2]}}
    first = add_engine(sessions, status="stale", validation=slower)
    second = add_engine(sessions, tag="latest")
    add_engine(sessions, model="acme/other")
    body = client.get("/v1/trend", params={"model": "acme/tiny"}).json()
    assert [e["digest"] for e in body["engines"]] == [first, second]
    old, new = body["engines"]
    assert old["status"] == "stale" and old["metrics"] == {
        "ppl_increase_pct": 1.25, "mean_kl": 0.02, "top1_agreement": 0.936, "peak_tokens_per_s": 36000.0,
        "ttft_ms": 41.5, "tpot_ms": None}
    for e in body["engines"]:  # the same numbers as the engine's own report
        m = client.get(f"/v1/artifacts/{e['digest']}").json()["validation"]["metrics"]
        assert e["metrics"]["ppl_increase_pct"] == m["ppl_increase_pct"] and e["metrics"]["mean_kl"] == m["mean_kl"]
        assert e["metrics"]["peak_tokens_per_s"] == max(p["tokens_per_s"] for p in m["throughput"])
    assert new["passed"] is True and new["precision"] == "fp8" and new["target"] == "cpu"
    r = client.get("/v1/trend", params={"model": "acme/none"})
    assert r.status_code == 404 and r.json()["error"]["field"] == "model"


def test_grid_cells_answer_what_resolve_answers(app_env):
    from kiln.tables import TrackedModel

    client, sessions = app_env
    fresh = add_engine(sessions)  # fp8 cpu latency checkpoint: servable
    add_engine(sessions, profile="throughput", status="stale")  # fp8 cpu throughput: only stale
    with sessions() as s:  # tracked, asking also for nvfp4 on sm100, never built
        s.add(TrackedModel(name="acme/tiny", checkpoint="hf://acme/tiny@main", hf_repo="acme/tiny", branch="main",
                           head_sha=None, matrix=[{"precision": "nvfp4", "profile": "latency", "target": "b200",
                                                   "backend": "checkpoint"}], gates={}))
        s.commit()
    (m,) = client.get("/v1/grid", params={"model": "acme/tiny"}).json()["models"]
    assert m["model"] == "acme/tiny" and m["precisions"] == ["fp8", "nvfp4"] and m["targets"] == ["cpu", "sm100"]
    cells = {(c["precision"], c["target"]): c for c in m["cells"]}
    assert len(cells) == 4
    cpu = cells["fp8", "cpu"]
    assert cpu["servable"] and cpu["engines"] == [
        {"profile": "latency", "backend": "checkpoint", "digest": fresh, "tag": "fp8-cpu-latency-checkpoint"}]
    (stale,) = cpu["reasons"]
    q = {"model": "acme/tiny", "precision": "fp8", "profile": "throughput", "target": "cpu", "backend": "checkpoint"}
    r = client.get("/v1/resolve", params=q)
    assert r.status_code == 409 and stale["code"] == r.json()["error"]["code"] == "stale_only"
    assert stale["reason"] == r.json()["error"]["message"]
    assert client.get("/v1/resolve", params={**q, "profile": "latency"}).json()["digest"] == fresh
    (unbuilt,) = cells["nvfp4", "sm100"]["reasons"]
    r = client.get("/v1/resolve", params={**q, "precision": "nvfp4", "profile": "latency", "target": "sm100"})
    assert not cells["nvfp4", "sm100"]["servable"] and unbuilt["reason"] == r.json()["error"]["message"]
    assert cells["fp8", "sm100"]["reasons"][0]["code"] == "not_built" and not cells["fp8", "sm100"]["engines"]
    everything = client.get("/v1/grid").json()["models"]
    assert [x["model"] for x in everything] == ["acme/tiny"]

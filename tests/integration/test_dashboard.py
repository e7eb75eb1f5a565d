"""The dashboard in a real headless Chromium against ``kiln serve`` with one engine built through the API: the
page's JavaScript renders the build and the engine, the engine's page its validation and charts; plus /metrics
and ``kiln fit`` over that real index.

Needs Chromium (Debian: ``apt-get install -y chromium``); skipped with a message when it is not installed.
Set KILN_DASHBOARD_SCREENSHOTS=<dir> to keep the screenshots."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
from html.parser import HTMLParser
from urllib.parse import urlencode

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kiln import units
from scripts.devstack import Stack, tiny_spec

pytestmark = pytest.mark.slow

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
         "--disable-dev-shm-usage"]


def browser() -> str:
    for name in BROWSERS:
        if path := shutil.which(name):
            return path
    pytest.skip("headless Chromium is not installed (Debian: apt-get install -y chromium); the dashboard's "
                "browser test needs it")


def chromium(profile_dir, *args: str, timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run([browser(), *FLAGS, f"--user-data-dir={profile_dir}", *args], capture_output=True,
                          timeout=timeout)


def dump_dom(profile_dir, url: str) -> str:
    r = chromium(profile_dir, "--virtual-time-budget=5000", "--dump-dom", url)
    assert r.returncode == 0, r.stderr.decode(errors="replace")[-2000:]
    return r.stdout.decode()


def screenshot(profile_dir, url: str, out, size: str = "1280,900") -> bytes:
    r = chromium(profile_dir, "--virtual-time-budget=5000", f"--window-size={size}", f"--screenshot={out}", url)
    assert r.returncode == 0 and out.is_file(), r.stderr.decode(errors="replace")[-2000:]
    keep = os.environ.get("KILN_DASHBOARD_SCREENSHOTS")
    if keep:
        os.makedirs(keep, exist_ok=True)
        shutil.copy(out, os.path.join(keep, out.name))
    return out.read_bytes()


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", "not a PNG"
    return struct.unpack(">II", data[16:24])


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    browser()  # skip before building anything
    s = Stack(tmp_path_factory.mktemp("dash") / "kiln", {})
    for var in ("KILN_DATABASE_URL", "KILN_BROKER_URL", "KILN_STORE_URL", "KILN_BOOTSTRAP_TOKEN", "KILN_AUTH"):
        s.env.pop(var, None)
    s.start("serve", "serve", "--port", str(s.port))
    try:
        s.wait_http("/healthz")
        r = s.post("/v1/builds", tiny_spec())
        assert r.status_code in (200, 202), r.text
        done = s.wait_build(r.json()["id"])
        assert done["status"] == "succeeded", done
        s.build = done
        r = s.post("/v1/builds", tiny_spec(profile="throughput"))  # a second engine: compare, trend, grid
        assert r.status_code in (200, 202), r.text
        second = s.wait_build(r.json()["id"])
        assert second["status"] == "succeeded", second
        s.second = second
        yield s
    finally:
        s.close()


def test_dashboard_shows_the_build_and_the_engine(served, tmp_path):
    build, digest = served.build, served.build["digest"]
    dom = dump_dom(tmp_path / "profile", served.url + "/")
    assert f'data-build="{build["id"]}"' in dom and build["id"][:12] in dom  # the build row, rendered by the JS
    assert f'data-digest="{digest}"' in dom and digest[:19] in dom  # its engine in the builds and engines tables
    assert "succeeded" in dom and 'data-model="tiny-llama"' in dom and "fresh" in dom
    assert "tiny-llama:fp8-cpu-latency-checkpoint" in dom  # the tag
    assert "Loading…" not in dom and 'id="error" class="banner" hidden' in dom

    png = screenshot(tmp_path / "profile", served.url + "/", tmp_path / "dashboard.png")
    assert png_size(png) == (1280, 900) and len(png) > 20_000  # a rendered page, not a blank one


def test_engine_page_shows_validation_and_charts(served, tmp_path):
    digest = served.build["digest"]
    url = f"{served.url}/#/engine/{digest}"
    dom = dump_dom(tmp_path / "profile", url)
    assert f'id="engine" data-digest="{digest}"' in dom
    assert "max_ppl_increase_pct" in dom and "top-1 agreement" in dom and f"kiln pull tiny-llama@{digest} ./engine --server {served.url}" in dom
    assert dom.count("data-chart=") == 2 and "/report.html" in dom
    png = screenshot(tmp_path / "profile", url, tmp_path / "engine.png", size="1280,1400")
    assert png_size(png) == (1280, 1400) and len(png) > 20_000
    svg = served.get(f"/v1/artifacts/{digest}/throughput.svg")
    assert svg.status_code == 200 and b"<circle" in svg.content
    report = served.get(f"/v1/artifacts/{digest}/report.html")  # what the page links to
    assert report.status_code == 200 and digest in report.text and "<svg" in report.text


def test_metrics_over_the_real_index(served):
    text = served.get("/metrics").text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    builds = {s.labels["status"]: s.value for s in fams["kiln_builds"].samples}
    assert builds["succeeded"] >= 1
    counts = {s.labels["stage"]: s.value for s in fams["kiln_stage_duration_seconds"].samples
              if s.name.endswith("_count")}
    assert counts["quantize"] + fams_value(fams, "kiln_cache_hits", "quantize") >= 1
    assert fams_value(fams, "kiln_workers_live") == 1
    assert {s.labels["status"]: s.value for s in fams["kiln_artifacts"].samples}["fresh"] >= 1


def fams_value(fams, name: str, stage: str | None = None) -> float:
    for s in fams[name].samples:
        if stage is None or s.labels.get("stage") == stage:
            if s.name in (name, name + "_total"):
                return s.value
    raise AssertionError(f"{name} {stage} not scraped")


def test_kiln_fit_against_the_built_engine(served, tmp_path):
    traffic = tmp_path / "traffic.jsonl"
    # 20 requests, one at a time, all within the latency profile (input 256, sequence 512)
    traffic.write_text("".join(json.dumps({"prompt_tokens": 100 + i, "output_tokens": 50, "arrival_s": 10.0 * i})
                               + "\n" for i in range(20)))
    r = served.kiln("fit", "--traffic", str(traffic), "--model", "tiny-llama", "--json", "--server", served.url)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout.strip().splitlines()[-1])
    engines = {e["digest"]: e for e in report["engines"]}  # the latency engine and the throughput one
    assert set(engines) == {served.build["digest"], served.second["digest"]}
    assert engines[served.build["digest"]]["coverage"] == 1.0 and report["drifted"] == []
    # the same traffic twice as long: over max_seq_len 512 → drift, and the CLI can fail a pipeline on it
    traffic.write_text("".join(json.dumps({"prompt_tokens": 200, "output_tokens": 400, "arrival_s": 10.0 * i})
                               + "\n" for i in range(20)))
    r = served.kiln("fit", "--traffic", str(traffic), "--model", "tiny-llama", "--fail-on-drift")
    assert r.returncode == 1 and "DRIFT" in r.stdout, r.stdout + r.stderr


# -- release views: compare, trend, grid --------------------------------------------------------------------------
class Node:
    def __init__(self, tag: str, attrs: dict):
        self.tag, self.attrs, self.children = tag, attrs, []

    def get(self, name: str):
        return self.attrs.get(name)

    def text(self) -> str:
        return " ".join("".join(c if isinstance(c, str) else c.text() + " " for c in self.children).split())

    def find(self, tag: str | None = None, **attrs) -> list["Node"]:
        """Descendants with this tag and these attribute values (``data_x`` is ``data-x``; True: present)."""
        out = []
        for c in self.children:
            if isinstance(c, Node):
                if (tag in (None, c.tag) and all((k.replace("_", "-") in c.attrs) if v is True
                                                  else c.attrs.get(k.replace("_", "-")) == v for k, v in attrs.items())):
                    out.append(c)
                out.extend(c.find(tag, **attrs))
        return out


def parse(dom: str) -> Node:
    """The rendered DOM (Chromium's --dump-dom) as a small tree, to read cells by their data- attributes."""
    void = {"meta", "link", "input", "br", "img", "hr", "col", "source", "wbr"}
    root = Node("#root", {})
    stack = [root]

    class P(HTMLParser):
        def handle_starttag(self, tag, attrs):
            node = Node(tag, dict((k, v or "") for k, v in attrs))
            stack[-1].children.append(node)
            if tag not in void:
                stack.append(node)

        def handle_endtag(self, tag):
            for i in range(len(stack) - 1, 0, -1):
                if stack[i].tag == tag:
                    del stack[i:]
                    break

        def handle_data(self, data):
            stack[-1].children.append(data)

    P().feed(dom)
    return root


def cells(row: Node) -> list[str]:
    return [td.text() for td in row.find("td")]


def test_compare_page_puts_two_engines_side_by_side(served, tmp_path):
    a, b = served.build["digest"], served.second["digest"]
    url = f"{served.url}/#/compare?a={a}&b={b}"
    dom = dump_dom(tmp_path / "profile", url)
    assert f'data-a="{a}"' in dom and f'data-b="{b}"' in dom
    ma = served.get(f"/v1/artifacts/{a}").json()
    mb = served.get(f"/v1/artifacts/{b}").json()
    va, vb = ma["validation"]["metrics"], mb["validation"]["metrics"]
    (table,) = parse(dom).find("table", id="compare-metrics")
    for key, fmt in (("ppl_increase_pct", units.percent), ("mean_kl", units.number),
                     ("top1_agreement", units.fraction)):
        (row,) = table.find("tr", data_metric=key)
        assert cells(row)[:2] == [fmt(va[key]), fmt(vb[key])], (key, cells(row))
    (peak,) = table.find("tr", data_metric="peak_tokens_per_s")
    assert cells(peak)[:2] == [units.rate(max(p["tokens_per_s"] for p in v["throughput"])) for v in (va, vb)]
    (gates,) = parse(dom).find("tr", data_gate="max_ppl_increase_pct")
    gates = cells(gates)
    gate = next(g for g in ma["validation"]["gates"] if g["name"] == "max_ppl_increase_pct")
    assert gates[1] == units.gate_value(gate["name"], gate["value"]) and gates[3] in ("pass", "fail")
    # the profile differs (latency vs throughput): highlighted; the checkpoint digest does not
    (prov,) = parse(dom).find("table", id="compare-provenance")
    differs = [r.get("data-field") for r in prov.find("tr", data_section="engine", **{"class": "differs"})]
    assert "profile" in differs and "checkpoint.digest" not in differs and "tag" in differs
    # the provenance as a readable diff: one row per flattened field (toolchain.torch, stages.quantize.status),
    # A's and B's value as text; a row is marked (≠ and highlighted) exactly where the values differ
    rows = {r.get("data-field"): r for r in prov.find("tr", data_section="provenance")}
    pa, pb = ma["provenance"], mb["provenance"]
    for name in pa["toolchain"]:
        assert cells(rows[f"toolchain.{name}"])[1:] == [f"toolchain.{name}", str(pa["toolchain"][name]),
                                                        str(pb["toolchain"][name])]
    assert "stages.quantize.status" in rows and "spec.precision" in rows
    assert cells(rows["build_key"])[2:] == [pa["build_key"], pb["build_key"]]
    for field, r in rows.items():
        mark, _, a_value, b_value = cells(r)
        assert (mark == "≠") == (r.get("class") == "differs") == (a_value != b_value), (field, cells(r))
    assert rows["build_key"].get("class") == "differs" and rows["checkpoint.digest"].get("class") is None
    differing = [f for f, r in rows.items() if r.get("class") == "differs"]
    assert any(f == "spec.profile" or f.startswith("spec.profile.") for f in differing), differing
    # the raw JSON stays one click away, closed
    (raw,) = parse(dom).find("details", id="compare-raw")
    assert "open" not in raw.attrs and "provenance (raw JSON)" in raw.text() and pa["build_key"] in raw.text()
    png = screenshot(tmp_path / "profile", url, tmp_path / "compare.png", size="1280,1400")
    assert png_size(png) == (1280, 1400) and len(png) > 20_000


HOSTILE = '<script>document.title="pwned"</script><img src=x onerror="document.title=1">'


def test_compare_page_shows_hostile_provenance_as_text(served, tmp_path):
    """Provenance is whatever a build's spec and toolchain said: a value with HTML in it is shown as text, in its
    cell, and becomes no element of the page."""
    from kiln import db
    from kiln.tables import Artifact

    sessions = db.session_factory(f"sqlite:///{served.home / 'kiln.db'}")
    digest = "sha256:" + "e" * 64
    with sessions() as s:
        src = s.get(Artifact, served.second["digest"])
        fields = {c.name: getattr(src, c.name) for c in Artifact.__table__.columns}
        s.add(Artifact(**{**fields, "digest": digest, "build_key": digest, "repository": "hostile/model",
                          "provenance": {**src.provenance, "toolchain": {**src.provenance["toolchain"], "torch": HOSTILE},
                                         "<b>note</b>": {"nested": HOSTILE}}}))
        s.commit()
    try:
        dom = dump_dom(tmp_path / "profile", f"{served.url}/#/compare?a={served.build['digest']}&b={digest}")
        page = parse(dom)
        rows = {r.get("data-field"): r for r in page.find("tr", data_section="provenance")}
        assert cells(rows["toolchain.torch"])[0] == "≠" and cells(rows["toolchain.torch"])[3] == HOSTILE
        assert cells(rows["<b>note</b>.nested"])[2:] == ["—", HOSTILE]  # only B has it
        assert len(page.find("script")) == 2  # the page's own two scripts, no injected one
        assert not page.find("img", src="x")
        assert {b.text() for b in page.find("b")} <= {"A", "B"}  # the side labels only: no <b> made from the key
        assert "&lt;script&gt;" in dom and "<title>pwned" not in dom
    finally:
        with sessions() as s:
            s.delete(s.get(Artifact, digest))
            s.commit()


def test_support_says_what_ran_where_after_the_real_builds(served):
    """GET /v1/support and `kiln models --json` over the same index: the row the two real builds above are of
    (Llama, FP8, checkpoint backend, on cpu) is built, with both engines; a row nothing built is not."""
    api = served.get("/v1/support").json()

    def row(family, precision, backend):
        return next(r["verified"] for r in api["support"]
                    if (r["family"], r["precision"], r["backend"]) == (family, precision, backend))

    built = row("llama", "fp8", "checkpoint")
    assert built["state"] == "built" and built["engines"] == 2 and list(built["targets"]) == ["cpu"]
    assert built["targets"]["cpu"]["engines"] == 2 and built["latest"] == built["targets"]["cpu"]["latest"]
    assert row("llama", "fp8", "aot-inductor")["state"] == "test suite"  # the suite builds it; not in this index
    assert row("llama", "fp8", "trtllm-engine")["state"] == "never built"
    r = served.kiln("models", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == api  # the CLI reads the same index and says the same


def test_trend_page_charts_the_models_metrics_across_builds(served, tmp_path):
    url = f"{served.url}/#/trend/tiny-llama"
    dom = dump_dom(tmp_path / "profile", url)
    trend = served.get("/v1/trend?model=tiny-llama").json()["engines"]
    assert [e["digest"] for e in trend] == [served.build["digest"], served.second["digest"]]  # oldest first
    assert dom.count("data-trend=") == 4 and dom.count("<circle") >= 2 * 3  # ppl, KL, throughput at least
    for e in trend:
        m = e["metrics"]
        (table,) = parse(dom).find("table", id="trend-table")
        (row,) = table.find("tr", data_digest=e["digest"])
        cell = {td.get("data-metric"): td.text() for td in row.find("td", data_metric=True)}
        assert cell["ppl_increase_pct"] == units.percent(m["ppl_increase_pct"])
        assert cell["mean_kl"] == units.number(m["mean_kl"])
        assert cell["peak_tokens_per_s"] == units.rate(m["peak_tokens_per_s"])
        assert cell["ttft_ms"] == (units.duration(m["ttft_ms"] / 1000) if m["ttft_ms"] is not None else "—")
    assert "compare with previous" not in dom or "#/compare?a=" in dom
    png = screenshot(tmp_path / "profile", url, tmp_path / "trend.png", size="1280,1100")
    assert png_size(png) == (1280, 1100) and len(png) > 20_000


def test_grid_page_shows_what_is_servable_and_why_not(served, tmp_path):
    url = f"{served.url}/#/grid"
    dom = dump_dom(tmp_path / "profile", url)
    (model,) = [m for m in served.get("/v1/grid").json()["models"] if m["model"] == "tiny-llama"]
    (cell,) = model["cells"]  # fp8 × cpu, two profiles, both fresh
    (td,) = parse(dom).find("td", data_cell="tiny-llama|fp8|cpu")
    assert td.get("class") == "servable"
    assert sorted(a.get("data-digest") for a in td.find("a")) == sorted(e["digest"] for e in cell["engines"]) == sorted(
        [served.build["digest"], served.second["digest"]])
    for e in cell["engines"]:  # the same engine resolve answers
        q = {"model": "tiny-llama", "precision": "fp8", "profile": e["profile"], "target": "cpu", "backend": "checkpoint"}
        assert served.get("/v1/resolve?" + urlencode(q)).json()["digest"] == e["digest"]
    png = screenshot(tmp_path / "profile", url, tmp_path / "grid.png")
    assert png_size(png) == (1280, 900) and len(png) > 20_000


def test_a_server_with_engines_but_no_builds_says_they_were_built_elsewhere(tmp_path):
    """Engines published by a local `kiln build` have no build row on the server: the builds table says so and
    counts them, rather than "No builds yet" beside a listed engine."""
    from tests.engines import publish_tiny

    browser()
    home = tmp_path / "kiln"
    _, _, row = publish_tiny(home, key=b"built elsewhere", files={"config.json": b"{}", "weights.bin": b"\0" * 64})
    s = Stack(home, {})
    for var in ("KILN_DATABASE_URL", "KILN_BROKER_URL", "KILN_STORE_URL", "KILN_BOOTSTRAP_TOKEN", "KILN_AUTH"):
        s.env.pop(var, None)
    s.start("serve", "serve", "--port", str(s.port))
    try:
        s.wait_http("/healthz")
        dom = dump_dom(tmp_path / "profile", s.url + "/")
    finally:
        s.close()
    assert f'data-digest="{row.digest}"' in dom  # the engine is listed
    empty = dom.split('id="builds-empty"', 1)[1].split("</p>", 1)[0]
    assert "1 engine was built elsewhere (kiln build) and published" in empty
    assert "No builds yet" not in dom

"""The whole route table with a ``builds:write`` token and a hostile task folder (issue 45, docs/security.md
"Evaluation task files"): every route of the app (read from ``app.routes``, so a new route is swept without a
change here) is called with every hostile task file of tests/hostile_tasks.py, and checkpoint, dataset and path
values that point outside the checkpoint roots, wherever a body, a path or a query can carry them. Whatever the
answer: no hostile code ran (no marker file), no planted secret (the bootstrap token in the environment, the
token and webhook secrets, a file outside the roots) is in any reply, no reply is a 5xx, every 4xx is Kiln's JSON
error, a refused request writes nothing, and a route that needs more than ``builds:write`` answers 403."""

from __future__ import annotations

import os
import re
from urllib.parse import quote

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from api.app import create_app
from kiln import db
from kiln.settings import Settings
from tests.conftest import REPO, TINY
from tests.hostile_tasks import ATTACKS, SECRET, layout
from tests.hubcache import add_snapshot, commit_sha, set_ref
from tests.unit.api.test_route_scopes import SAMPLE, expected_scope, routes

TOKEN_SECRET = "kiln-token-secret-5e21a7"
WEBHOOK_SECRET = "kiln-webhook-secret-c08d44"
SPEC = {"checkpoint": str(TINY), "precision": "fp8", "backend": "checkpoint",
        "calibration": {"samples": 8, "seq_len": 64}, "evaluation": {"max_tokens": 1024},
        "override_reason": "a test build: a short evaluation"}
ENTRY = {k: v for k, v in SPEC.items() if k not in ("checkpoint",)}


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """acme/tiny in an offline Hub cache, so that tracked-model registrations reach their matrix's task checks."""
    import huggingface_hub.constants as hf_constants

    hub = tmp_path / "hf" / "hub"
    add_snapshot(hub, "acme/tiny", commit_sha(1))
    set_ref(hub, "acme/tiny", "main", commit_sha(1))
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    return hub


@pytest.fixture
def hostile(tmp_path, monkeypatch, hub):
    """One folder per attack (its task file, its marker, a folder outside the roots holding a planted secret file),
    an app whose roots are the repository (for the tiny checkpoint) and the attacks' folders, and its tokens."""
    monkeypatch.setenv("KILN_BOOTSTRAP_TOKEN", SECRET)  # what a task once read from the API's environment
    cases, tasks = [], []
    for attack in ATTACKS:
        case = layout(tmp_path / attack.__name__)
        tasks.append(attack(case))
        (case.outside / "secret.txt").write_text(SECRET + "\n")
        (case.outside / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "x": "%s"}' % SECRET)
        cases.append(case)
    settings = Settings(home=tmp_path / "home", auth="required", bootstrap_token=SECRET, token_secret=TOKEN_SECRET,
                        webhook_secret=WEBHOOK_SECRET,
                        checkpoint_roots=os.pathsep.join([str(REPO)] + [str(c.roots) for c in cases]))
    db.upgrade(settings.db_url)
    client = TestClient(create_app(settings, enqueue=lambda *a: None), raise_server_exceptions=False)
    tokens = {}
    for scope in ("builds:write", "admin"):
        r = client.post("/v1/tokens", json={"name": scope, "scopes": [scope]},
                        headers={"Authorization": f"Bearer {SECRET}"})
        assert r.status_code == 201, r.text
        tokens[scope] = r.json()["token"]
    return client, tokens, cases, tasks, sa.create_engine(settings.db_url)


def written(engine) -> tuple:
    """What a request could have written: builds, tracked models (and their matrices), their history, tokens."""
    with engine.connect() as c:
        return tuple(tuple(c.execute(sa.text(q)).all()) for q in (
            "SELECT id FROM builds ORDER BY id", "SELECT name, matrix, updated_at FROM models ORDER BY name",
            "SELECT count(*) FROM model_events", "SELECT count(*) FROM api_tokens", "SELECT count(*) FROM artifacts"))


def hostile_paths(cases, tasks) -> list[str]:
    """Every path a request could name to reach a hostile file: the task files, their folders (a model folder that
    came with its own task YAMLs), what lies outside the roots, and the same through ``..`` and ``file://``."""
    outside = cases[0].outside
    return [*map(str, tasks), str(cases[0].task.parent), str(outside), str(outside / "secret.txt"),
            f"file://{outside}", str(cases[0].roots / ".." / "outside" / "secret.txt"), "/etc/passwd"]


def bodies(cases, tasks) -> list:
    """Request bodies carrying the hostile files in every field that names a file — build specs (alone and in a
    matrix), a tracked model's registration — and the other routes' shapes."""
    paths = hostile_paths(cases, tasks)
    out: list = []
    for task in tasks:
        spec = {**SPEC, "evaluation": {**SPEC["evaluation"], "tasks": [str(task)]}}
        entry = {**ENTRY, "evaluation": spec["evaluation"]}
        out += [spec, {"matrix": [spec]},
                {"checkpoint": "hf://acme/tiny@main", "matrix": [entry], "override_reason": "a hostile sweep"}]
    for path in paths:
        out += [{**SPEC, "checkpoint": path},
                {**SPEC, "calibration": {**SPEC["calibration"], "dataset": path}},
                {**SPEC, "evaluation": {**SPEC["evaluation"], "dataset": path}},
                {"checkpoint": path, "matrix": [ENTRY]}]
    out += [{"repo": {"type": "model", "name": "acme/tiny", "headSha": commit_sha(2)},
             "event": {"action": "update", "scope": "repo.content"}, "updatedRefs": [{"ref": "refs/heads/main"}]},
            {"traffic": [{"prompt_tokens": 128, "output_tokens": 16, "path": paths[0]}]},
            {"kind": "AdmissionReview", "request": {"uid": "x", "object": {"spec": {"containers": [
                {"image": f"kiln.example.com/acme/tiny@sha256:{'0' * 64}", "args": paths}]}}}}]
    return out


def urls(path: str, route, paths: list[str]) -> list[str]:
    """The route's path with sample values, then with each hostile path in every path parameter, then every query
    parameter it declares set to a hostile path."""
    def fill(value):
        return re.sub(r"\{(\w+)(?::\w+)?\}", lambda m: value if value is not None else SAMPLE.get(m[1], "x"), path)

    out = [fill(None)]
    if "{" in path:
        out += [fill(quote(p, safe="")) for p in paths] + [fill(quote(p.lstrip("/"), safe="/")) for p in paths[:3]]
    queries = [q.alias for q in getattr(getattr(route, "dependant", None), "query_params", [])]
    if queries:
        out += ["%s?%s" % (fill(None), "&".join(f"{q}={quote(p, safe='')}" for q in queries)) for p in paths]
    return out


def app_routes(app):
    """(method, path template, route object) of every route, writes first so that reads see what writes left."""
    objects = {}

    def walk(items):
        for r in items:
            if hasattr(r, "effective_candidates"):
                walk(r.effective_candidates())
            elif getattr(r, "methods", None):
                for m in r.methods:
                    objects.setdefault((m, getattr(r, "path_format", r.path)), r)
    walk(app.routes)
    found = [(m, p, objects.get((m, p))) for m, p in routes(app)]
    return sorted(found, key=lambda f: (f[0] in ("GET", "HEAD"), f[1], f[0]))


def stored(engine) -> str:
    """The specs of builds and the matrices of tracked models and their history, as text."""
    with engine.connect() as c:
        return "\n".join(str(row) for q in ("SELECT spec FROM builds", "SELECT checkpoint, matrix FROM models",
                                            "SELECT checkpoint, matrix FROM model_events")
                         for row in c.execute(sa.text(q)).all())


def test_every_route_with_a_write_token_and_hostile_files_runs_nothing_and_tells_nothing(hostile):
    client, tokens, cases, tasks, engine = hostile
    secrets = [SECRET, TOKEN_SECRET, WEBHOOK_SECRET, tokens["admin"]]
    paths, payloads = hostile_paths(cases, tasks), bodies(cases, tasks)
    # what the server must refuse wherever it is named: every hostile file but the Jinja tasks (their templates
    # are rendered only on a worker, in a sandbox: tests/unit/validation/test_task_safety.py) and every path
    # outside the roots or beside a task
    refused = [p for p in paths if "jinja" not in p]
    headers = {"Authorization": f"Bearer {tokens['builds:write']}"}
    seen, accepted = set(), 0
    for method, path, route in app_routes(client.app):
        if path.startswith("/static") or path.endswith("/events"):
            continue  # files of the dashboard; a stream (its scope: test_route_scopes.py), open until its build ends
        need = expected_scope(method, path)
        for n, url in enumerate(urls(path, route, paths)):  # every body with the sample path, one with the others
            writes = method in ("POST", "PUT", "PATCH", "DELETE")
            for body in (payloads[:1 if n else None] if writes else [None]):
                before = written(engine)
                r = client.request(method, url, headers=headers, json=body)
                what = f"{method} {url} {str(body)[:160]}"
                ran = [str(c.marker) for c in cases if c.marker.exists()]
                assert not ran, f"{what}: hostile code ran ({ran})"
                leaked = [s for s in secrets if s in r.text or s in str(r.headers)]
                assert not leaked, f"{what} → {r.status_code}: a secret in the reply: {r.text[:300]}"
                assert r.status_code < 500, f"{what} → {r.status_code}: {r.text[:300]}"
                if need == "admin":
                    assert r.status_code == 403, f"{what} needs admin but answered {r.status_code}"
                kept = [p for p in refused if p in stored(engine)]
                assert not kept, f"{what} → {r.status_code}: a build or tracked model now names {kept}"
                if r.status_code >= 400:
                    assert written(engine) == before, f"{what} → {r.status_code} but wrote: {r.text[:300]}"
                if 400 <= r.status_code < 500 and method != "HEAD":
                    error = r.json()
                    assert "error" in error or "errors" in error, f"{what} → {r.status_code}: {r.text[:300]}"
                if r.headers.get("content-type", "").startswith("application/json") and r.content:
                    r.json()
                accepted += r.status_code in (200, 201, 202)
                seen.add((method, path))
    assert len(seen) > 30 and accepted > 10
    # the task checks answered some builds (the Jinja attacks: their templates are rendered only on a worker, in
    # a sandbox) and refused the others; still nothing ran and the stored builds hold no secret
    listing = client.get("/v1/builds?limit=500", headers=headers)
    assert listing.status_code == 200 and listing.json()["builds"]
    assert not any(s in listing.text for s in secrets)

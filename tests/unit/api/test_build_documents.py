"""POST /v1/builds takes the build document of ``kiln build -f`` (kiln/document.py): one spec, or a matrix with
optional defaults, every entry checked before any is submitted, each error naming ``matrix.<entry>.<field>``."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from kiln import db
from kiln.settings import Settings
from tests.conftest import REPO, TINY

CHEAP = {"calibration": {"samples": 8, "seq_len": 64}, "evaluation": {"max_tokens": 1024},
         "override_reason": "a test build: a short evaluation"}


@pytest.fixture
def client(tmp_path):
    s = Settings(home=tmp_path / "home", checkpoint_roots=str(REPO))
    db.upgrade(s.db_url)
    queued: list = []
    c = TestClient(create_app(s, enqueue=lambda *a: queued.append(a)))
    c.queued = queued
    return c


def test_a_matrix_with_defaults_is_submitted_entry_by_entry(client):
    r = client.post("/v1/builds", json={"defaults": {"checkpoint": str(TINY), "backend": "checkpoint", **CHEAP},
                                        "matrix": [{"precision": "fp8"}, {"precision": "nvfp4"}]})
    assert r.status_code == 202, r.text
    builds = r.json()["builds"]
    assert [b["spec"]["precision"] for b in builds] == ["fp8", "nvfp4"]
    assert all(b["spec"]["backend"] == "checkpoint" and b["spec"]["calibration"]["samples"] == 8 for b in builds)


def test_one_bad_entry_is_a_422_naming_it_and_nothing_is_submitted(client):
    r = client.post("/v1/builds", json={"defaults": {"checkpoint": str(TINY)},
                                        "matrix": [{"precision": "fp8"}, {"precision": "int3"}]})
    assert r.status_code == 422 and r.json()["error"]["field"] == "matrix.1.precision"
    r = client.post("/v1/builds", json={"defaults": {"checkpoint": str(TINY), "target": "a100"},
                                        "matrix": [{"precision": "fp8"}]})
    assert r.status_code == 422 and r.json()["error"]["field"] == "matrix.0.target"
    assert "(from defaults)" in r.json()["error"]["message"]
    r = client.post("/v1/builds", json={"matrix": [{"precision": "fp8", "checkpoint": str(TINY)}], "target": "cpu"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "target"
    assert client.post("/v1/builds", json=[1, 2]).json()["error"]["field"] == "body"
    assert client.get("/v1/builds").json()["total"] == 0 and client.queued == []


def test_the_openapi_body_is_the_published_document_schema(client):
    from kiln.document import document_schema

    doc = client.get("/openapi.json").json()
    body = doc["paths"]["/v1/builds"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["oneOf"] == document_schema("#/components/schemas/")["oneOf"]
    schemas = doc["components"]["schemas"]
    assert schemas["BuildSpec"]["required"] == ["checkpoint", "precision"] and "required" not in schemas["BuildSpecEntry"]

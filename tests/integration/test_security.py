"""Tokens and scopes on the embedded service: 401 without a token, 403 with too narrow a scope, tokens shown
once and stored hashed, OCI-style Basic auth on /v2, request size limits, and no secret in the logs."""

from __future__ import annotations

import base64
import hashlib

import httpx
import pytest
import sqlalchemy as sa

from tests.integration.stack import Stack, tiny_spec
from tests.integration.stack import served as embedded

pytestmark = pytest.mark.slow
BOOT = "kiln-bootstrap-for-tests-0123456789"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with embedded(tmp_path_factory.mktemp("sec") / "kiln", {"KILN_BOOTSTRAP_TOKEN": BOOT, "KILN_WEBHOOK_SECRET": "whsec"}) as s:
        yield s


def call(s, method, path, token=None, **kw):
    headers = kw.pop("headers", {})
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return httpx.request(method, s.url + path, headers=headers, timeout=60, **kw)


def test_tokens_and_scopes(served):
    assert call(served, "GET", "/healthz").status_code == 200
    r = call(served, "GET", "/v1/builds")
    assert r.status_code == 401 and r.json()["error"]["field"] == "Authorization" and "WWW-Authenticate" in r.headers
    assert call(served, "GET", "/v1/builds", token="kiln_wrong").status_code == 401

    made = {}
    for name, scopes in (("ci", ["builds:write"]), ("deployer", ["artifacts:read"])):
        r = call(served, "POST", "/v1/tokens", token=BOOT, json={"name": name, "scopes": scopes})
        assert r.status_code == 201 and r.json()["token"].startswith("kiln_")
        made[name] = r.json()
    listed = call(served, "GET", "/v1/tokens", token=BOOT).json()["tokens"]
    assert all("token" not in t for t in listed) and {t["name"] for t in listed} >= {"bootstrap", "ci", "deployer"}

    ci, deployer = made["ci"]["token"], made["deployer"]["token"]
    assert call(served, "GET", "/v1/artifacts", token=deployer).status_code == 200
    r = call(served, "POST", "/v1/builds", token=deployer, json=tiny_spec())
    assert r.status_code == 403 and "builds:write" in r.json()["error"]["message"]
    assert call(served, "POST", "/v1/tokens", token=ci, json={"name": "x", "scopes": ["admin"]}).status_code == 403
    built = call(served, "POST", "/v1/builds", token=ci, json=tiny_spec())
    assert built.status_code == 202
    assert call(served, "GET", f"/v1/builds/{built.json()['id']}", token=ci).status_code == 200

    # OCI clients send Basic with the token as the password
    basic = base64.b64encode(f"anyone:{deployer}".encode()).decode()
    assert call(served, "GET", "/v2/", headers={"Authorization": f"Basic {basic}"}).status_code == 200
    r = call(served, "GET", "/v2/")
    assert r.status_code == 401 and r.json()["errors"][0]["code"] == "UNAUTHORIZED"

    # stored hashed, never in clear; revoked tokens stop working
    engine = sa.create_engine(f"sqlite:///{served.home / 'kiln.db'}")
    with engine.connect() as c:
        stored = [row[0] for row in c.execute(sa.text("SELECT token_sha256 FROM api_tokens"))]
    engine.dispose()
    assert hashlib.sha256(ci.encode()).hexdigest() in stored and ci not in stored
    assert call(served, "DELETE", f"/v1/tokens/{made['deployer']['id']}", token=BOOT).status_code == 200
    assert call(served, "GET", "/v1/artifacts", token=deployer).status_code == 401

    r = call(served, "POST", "/v1/tokens", token=BOOT, json={"name": "x", "scopes": ["root"]})
    assert r.status_code == 422 and r.json()["error"]["field"] == "scopes"

    # no secret ever in the logs
    log = served.log("serve")
    assert BOOT not in log and ci not in log and deployer not in log


def test_limits_and_webhook_secret(served):
    r = call(served, "POST", "/v1/builds", token=BOOT, content=b"{" + b" " * (2 << 20) + b"}",
             headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["field"] == "body"
    r = call(served, "POST", "/v1/webhooks/huggingface", json={}, headers={"X-Webhook-Secret": "wrong"})
    assert r.status_code == 401
    r = call(served, "POST", "/v1/webhooks/huggingface", content=b"not json", headers={"X-Webhook-Secret": "whsec"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "body"
    r = call(served, "POST", "/v1/webhooks/huggingface", json={"event": "x"}, headers={"X-Webhook-Secret": "whsec"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "event"
    r = call(served, "POST", "/v1/builds", token=BOOT, json=tiny_spec(checkpoint="/etc"))
    assert r.status_code == 422 and r.json()["error"]["field"] == "checkpoint"
    r = call(served, "POST", "/v1/builds", token=BOOT, json=tiny_spec(checkpoint=str(served.home.parent / ".." / ".." / "etc")))
    assert r.status_code == 422 and r.json()["error"]["field"] == "checkpoint"

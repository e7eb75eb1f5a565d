"""Every route of the app needs the scope this table says, checked over real requests with real tokens: a route
added without an entry here fails, and so does a route whose scope check is weakened."""

from __future__ import annotations

import re

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from kiln import db
from kiln.settings import Settings

#: (method, path template) → the scope a request needs (None: open). HEAD routes follow their GET.
EXPECTED = {
    ("GET", "/healthz"): None, ("GET", "/readyz"): None, ("GET", "/metrics"): None,
    ("GET", "/openapi.json"): None, ("GET", "/"): None, ("POST", "/v1/webhooks/huggingface"): None,
    ("POST", "/v1/builds"): "builds:write", ("GET", "/v1/builds"): "artifacts:read",
    ("POST", "/v1/builds/plan"): "builds:write",  # a submission's checks (the checkpoint identified), not its writes
    ("GET", "/v1/builds/{build_id}"): "artifacts:read", ("POST", "/v1/builds/{build_id}/cancel"): "builds:write",
    ("GET", "/v1/builds/{build_id}/events"): "artifacts:read",
    ("GET", "/v1/artifacts"): "artifacts:read", ("GET", "/v1/artifacts/{digest}"): "artifacts:read",
    ("POST", "/v1/artifacts/{digest}/revoke"): "admin",
    ("POST", "/v1/tokens"): "admin", ("GET", "/v1/tokens"): "admin", ("DELETE", "/v1/tokens/{token_id}"): "admin",
    ("GET", "/v1/artifacts/{digest}/report.html"): "artifacts:read",
    ("GET", "/v1/artifacts/{digest}/throughput.svg"): "artifacts:read",
    ("GET", "/v1/models"): "artifacts:read", ("GET", "/v1/models/{model}"): "artifacts:read",
    ("PUT", "/v1/models/{model}"): "builds:write", ("POST", "/v1/models/{model}/refresh"): "builds:write",
    ("GET", "/v1/resolve"): "artifacts:read", ("GET", "/v1/tags"): "artifacts:read",
    ("GET", "/v1/workers"): "artifacts:read", ("POST", "/v1/fit"): "artifacts:read",
    ("GET", "/v1/trend"): "artifacts:read", ("GET", "/v1/grid"): "artifacts:read",
    ("GET", "/v1/keys"): "artifacts:read", ("GET", "/v1/support"): "artifacts:read",
    ("POST", "/v1/admission/validate"): "artifacts:read",  # the admission webhook only reads
    ("GET", "/v2/"): "artifacts:read", ("GET", "/v2/_catalog"): "artifacts:read",
    ("GET", "/v2/{name}/blobs/{digest}"): "artifacts:read", ("GET", "/v2/{name}/manifests/{reference}"): "artifacts:read",
    ("GET", "/v2/{name}/referrers/{digest}"): "artifacts:read", ("GET", "/v2/{name}/tags/list"): "artifacts:read",
    # the registry is read-only: other methods reach the catch-all (answered UNSUPPORTED) only with a write scope
    ("GET", "/v2/{rest}"): "artifacts:read", ("POST", "/v2/{rest}"): "builds:write",
    ("PUT", "/v2/{rest}"): "builds:write", ("PATCH", "/v2/{rest}"): "builds:write",
    ("DELETE", "/v2/{rest}"): "builds:write",
}
SAMPLE = {"build_id": "0" * 32, "digest": "sha256:" + "0" * 64, "token_id": "0" * 32, "name": "acme/tiny",
          "reference": "latest", "model": "acme/tiny", "rest": "x/uploads/"}
BELOW = {"artifacts:read": None, "builds:write": "artifacts:read", "admin": "builds:write"}
BOOT = "kiln_bootstrap_token_for_scope_tests_0123456789"


def routes(app):
    """(method, path template) of every route, through included routers; HEAD only where it is its own route."""
    def walk(items):
        for r in items:
            if hasattr(r, "effective_candidates"):
                yield from walk(r.effective_candidates())
            elif getattr(r, "methods", None):
                for m in r.methods:
                    if m != "HEAD" or "GET" not in r.methods:
                        yield m, r.path_format if hasattr(r, "path_format") else r.path
    return sorted(set(walk(app.routes)))


def denied(r) -> bool:
    """The auth middleware refused the request (not the handler: the webhook answers 401 to a bad secret)."""
    if r.status_code not in (401, 403):
        return False
    body = r.json()
    if "errors" in body:
        return body["errors"][0]["code"] in ("UNAUTHORIZED", "DENIED")
    return body["error"].get("field") == "Authorization"


def concrete(path: str) -> str:
    return re.sub(r"\{(\w+)(?::\w+)?\}", lambda m: SAMPLE.get(m[1], "x"), path)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    home = tmp_path_factory.mktemp("scopes")
    settings = Settings(home=home, auth="required", bootstrap_token=BOOT)
    db.upgrade(settings.db_url)
    client = TestClient(create_app(settings, enqueue=lambda *a: None))
    tokens = {}
    for scope in ("artifacts:read", "builds:write", "admin"):
        r = client.post("/v1/tokens", json={"name": scope, "scopes": [scope]}, headers={"Authorization": f"Bearer {BOOT}"})
        assert r.status_code == 201, r.text
        tokens[scope] = r.json()["token"]
    return client, tokens


def expected_scope(method: str, path: str):
    if path.startswith("/static"):
        return None
    assert (method, path) in EXPECTED, f"{method} {path} is a new route: add its scope to EXPECTED"
    return EXPECTED[(method, path)]


def test_every_route_is_in_the_table(env):
    client, _ = env
    found = routes(client.app)
    assert len(found) > 20
    for method, path in found:
        expected_scope(method, path)
    stale = set(EXPECTED) - {(m, p) for m, p in found}
    assert not stale, f"EXPECTED names routes that no longer exist: {sorted(stale)}"


def test_each_route_needs_exactly_its_scope(env):
    client, tokens = env
    for method, path in routes(client.app):
        if path.startswith("/static"):
            continue
        need, url = expected_scope(method, path), concrete(path)
        if path.endswith("/events"):
            continue  # a stream; its scope is checked by the middleware before the body (below, without a token)
        if need is None:
            r = client.request(method, url)
            assert not denied(r), f"{method} {path} is open but answered {r.status_code}"
            continue
        r = client.request(method, url)
        assert r.status_code == 401 and denied(r), f"{method} {path} without a token answered {r.status_code}"
        if BELOW[need] is not None:
            r = client.request(method, url, headers={"Authorization": f"Bearer {tokens[BELOW[need]]}"})
            assert r.status_code == 403 and denied(r), f"{method} {path} with only {BELOW[need]} answered {r.status_code}"
        r = client.request(method, url, headers={"Authorization": f"Bearer {tokens[need]}"})
        assert not denied(r), f"{method} {path} with {need} answered {r.status_code}: {r.text}"


def test_event_stream_needs_read_scope(env):
    client, tokens = env
    url = concrete("/v1/builds/{build_id}/events")
    assert client.get(url).status_code == 401
    assert client.get(url, headers={"Authorization": f"Bearer {tokens['artifacts:read']}"}).status_code == 404


def router_refused(r) -> bool:
    """Answered by the router itself (no route matched, or not with this method): no handler ran."""
    code = r.json().get("error", {}).get("code")
    return (r.status_code, code) in ((404, "endpoint_unknown"), (405, "method_not_allowed"))


@pytest.mark.parametrize("suffix", ["%0A", "%00", "/", ";"])
def test_a_suffix_never_lowers_the_scope(env, suffix):
    """``$`` in a route's pattern matches before a final newline: ``POST …/revoke%0A`` reached the admin-only
    revoke handler with a builds:write token while the scope was read off the path's end. With any suffix, a
    request with the scope below its route's is refused (by the scope check, as a bad path, or by the router)."""
    client, tokens = env
    for method, path in routes(client.app):
        need = expected_scope(method, path)
        if need is None or path.endswith("/events"):
            continue
        below = BELOW[need]
        headers = {"Authorization": f"Bearer {tokens[below]}"} if below else {}
        r = client.request(method, concrete(path) + suffix, headers=headers)
        if suffix in ("%0A", "%00"):
            assert r.status_code == 400, f"{method} {path}{suffix} answered {r.status_code}: {r.text}"
            continue
        assert denied(r) or router_refused(r), \
            f"{method} {path}{suffix} with {below or 'no token'} answered {r.status_code}: {r.text}"


def test_control_characters_in_a_path_are_refused(env):
    client, tokens = env
    r = client.post(concrete("/v1/artifacts/{digest}/revoke") + "%0A",
                    headers={"Authorization": f"Bearer {tokens['builds:write']}"})
    assert r.status_code == 400 and r.json()["error"]["field"] == "path"
    r = client.get("/v2/acme/tiny/manifests/latest%0D")
    assert r.status_code == 400 and r.json()["errors"][0]["code"] == "NAME_INVALID"


def test_the_matched_route_decides_the_scope(env, monkeypatch):
    """Without the bad-path refusal, the route's own check still holds: ``…/revoke%0A`` matches the revoke route,
    and the revoke route needs admin whatever the path's end says."""
    from api import auth

    client, tokens = env
    monkeypatch.setattr(auth, "control_characters", lambda path: False, raising=False)
    url = concrete("/v1/artifacts/{digest}/revoke") + "%0A"
    r = client.post(url, headers={"Authorization": f"Bearer {tokens['builds:write']}"})
    assert r.status_code == 403 and denied(r), r.text
    assert "admin" in r.json()["error"]["message"]
    r = client.post(url, headers={"Authorization": f"Bearer {tokens['admin']}"})
    assert not denied(r)

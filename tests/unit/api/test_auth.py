"""Tokens and their checks over a real app and SQLite index: what a refused request is answered (the body a
client reads, on /v1 and on /v2), how tokens are sent, created, listed and revoked, which scopes imply which,
anonymous reads, the body size limit."""

from __future__ import annotations

import base64

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.auth import bearer_or_basic, required_scope, token_hash
from kiln import db
from kiln.tables import ApiToken
from kiln.settings import Settings

BOOT = "kiln_bootstrap_for_auth_tests_0123456789abcdef"
WWW = 'Basic realm="kiln"'  # /v2: Basic only, a Bearer realm is a token-service URL to registry clients (issue 13)
API_WWW = 'Bearer realm="kiln"'  # /v1: never Basic, which opens a browser's login box over the dashboard


def app_for(tmp_path, **settings):
    s = Settings(home=tmp_path / "home", **settings)
    db.upgrade(s.db_url)
    return TestClient(create_app(s, enqueue=lambda *a: None))


@pytest.fixture
def client(tmp_path):
    return app_for(tmp_path, auth="required", bootstrap_token=BOOT)


def bearer(token):
    return {"Authorization": f"Bearer {token}"}


def make_token(client, *scopes, name="t"):
    r = client.post("/v1/tokens", json={"name": name, "scopes": list(scopes)}, headers=bearer(BOOT))
    assert r.status_code == 201, r.text
    return r.json()


def test_a_missing_token_is_401_with_the_challenge_and_the_fix(client):
    r = client.get("/v1/artifacts")
    assert r.status_code == 401 and r.headers["WWW-Authenticate"] == API_WWW
    assert r.json() == {"error": {"code": "unauthorized", "field": "Authorization", "message": "a token is required",
                                  "fix": "send Authorization: Bearer <token>"}}
    v2 = client.get("/v2/")
    assert v2.status_code == 401 and v2.headers["WWW-Authenticate"] == WWW
    assert v2.json() == {"errors": [{"code": "UNAUTHORIZED", "message": "a token is required",
                                     "detail": "send Authorization: Bearer <token>"}]}


@pytest.mark.parametrize("method,path,headers", [
    ("GET", "/v1/artifacts", {}), ("GET", "/v1/tags", {}), ("GET", "/v1/builds", bearer("kiln_nope")),
    ("POST", "/v1/builds", {}), ("GET", "/v1/artifacts/sha256:" + "a" * 64 + "/report.html", {}),
])
def test_no_401_outside_v2_carries_a_basic_challenge(client, method, path, headers):
    # a browser answers a Basic challenge with its login box, over the dashboard whose requests these are
    r = client.request(method, path, headers=headers)
    assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
    assert "basic" not in r.headers.get("WWW-Authenticate", "").lower()
    v2 = client.request(method, "/v2/", headers=headers)  # what OCI clients need stays
    assert v2.status_code == 401 and v2.headers["WWW-Authenticate"] == WWW


def test_an_unknown_token_is_401(client):
    r = client.get("/v1/artifacts", headers=bearer("kiln_nope"))
    assert r.status_code == 401 and r.json()["error"] == {
        "code": "unauthorized", "field": "Authorization", "message": "unknown or revoked token",
        "fix": "ask an admin for a token"}


def test_a_token_without_the_scope_is_403_naming_it(client):
    read = make_token(client, "artifacts:read")["token"]
    r = client.post("/v1/builds", json={}, headers=bearer(read))
    assert r.status_code == 403 and "WWW-Authenticate" not in r.headers
    assert r.json() == {"error": {"code": "forbidden", "field": "Authorization",
                                  "message": "this token lacks the builds:write scope",
                                  "fix": "use a token with builds:write (it has artifacts:read)"}}
    v2 = client.delete("/v2/acme/tiny/manifests/latest", headers=bearer(read))
    assert v2.status_code == 403 and v2.json()["errors"][0]["code"] == "DENIED"


def test_scopes_imply_reading_and_admin_implies_all(client):
    write = make_token(client, "builds:write")["token"]
    assert client.get("/v1/artifacts", headers=bearer(write)).status_code == 200
    assert client.get("/v1/tokens", headers=bearer(write)).status_code == 403
    admin = make_token(client, "admin")["token"]
    assert client.get("/v1/tokens", headers=bearer(admin)).status_code == 200
    assert client.post("/v1/builds", json={}, headers=bearer(admin)).status_code == 422  # past auth


def test_tokens_are_stored_hashed_listed_without_secrets_and_revoked(client, tmp_path):
    made = make_token(client, "artifacts:read", "artifacts:read", name="  ci  ")
    assert made["token"].startswith("kiln_") and made["scopes"] == ["artifacts:read"] and made["name"] == "ci"
    assert made["revoked"] is False and made["created_at"]
    sessions = client.app.state.sessions
    with sessions() as s:
        row = s.get(ApiToken, made["id"])
        assert row.token_sha256 == token_hash(made["token"]) and made["token"] not in str(row.__dict__)
    listed = client.get("/v1/tokens", headers=bearer(BOOT)).json()["tokens"]
    assert {t["name"] for t in listed} == {"bootstrap", "ci"} and all("token" not in t for t in listed)
    assert client.get("/v1/artifacts", headers=bearer(made["token"])).status_code == 200
    gone = client.delete(f"/v1/tokens/{made['id']}", headers=bearer(BOOT))
    assert gone.status_code == 200 and gone.json()["revoked"] is True
    assert client.get("/v1/artifacts", headers=bearer(made["token"])).status_code == 401
    again = client.delete(f"/v1/tokens/{made['id']}", headers=bearer(BOOT)).json()
    assert again["revoked"] is True
    missing = client.delete("/v1/tokens/nope", headers=bearer(BOOT))
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "token_unknown"


@pytest.mark.parametrize("body,field", [(None, "name"), ({"name": " "}, "name"), ({"name": "x"}, "scopes"),
                                        ({"name": "x", "scopes": []}, "scopes"),
                                        ({"name": "x", "scopes": ["root"]}, "scopes"),
                                        ({"name": "x", "scopes": "admin"}, "scopes")])
def test_bad_token_requests_name_the_field(client, body, field):
    r = client.post("/v1/tokens", json=body, headers=bearer(BOOT))
    assert r.status_code == 422 and r.json()["error"]["field"] == field and r.json()["error"]["fix"]


def test_the_bootstrap_token_is_created_once(tmp_path):
    app_for(tmp_path, auth="required", bootstrap_token=BOOT)
    client = app_for(tmp_path, auth="required", bootstrap_token=BOOT)
    with client.app.state.sessions() as s:
        rows = s.query(ApiToken).all()
    assert [(r.name, r.scopes) for r in rows] == [("bootstrap", ["admin"])]


def test_basic_auth_carries_the_token_as_password(client):
    basic = base64.b64encode(f"anyone:{BOOT}".encode()).decode()
    assert client.get("/v2/", headers={"Authorization": f"Basic {basic}"}).status_code == 200
    assert bearer_or_basic(f"Bearer  {BOOT} ") == BOOT and bearer_or_basic(f"bearer {BOOT}") == BOOT
    assert bearer_or_basic(f"basic {basic}") == BOOT
    assert bearer_or_basic("Bearer ") is None and bearer_or_basic(None) is None and bearer_or_basic("") is None
    assert bearer_or_basic("Basic !!!") is None and bearer_or_basic("Token x") is None
    assert bearer_or_basic("Basic " + base64.b64encode(b"user-only").decode()) is None


def test_open_paths_and_anonymous_reads(tmp_path):
    anon = app_for(tmp_path, auth="required", bootstrap_token=BOOT, anonymous_read=True)
    assert anon.get("/v1/artifacts").status_code == 200
    assert anon.post("/v1/builds", json={}).status_code == 401
    assert anon.get("/static/dashboard.css").status_code == 200
    assert required_scope("GET", "/static/dashboard.js") is None and required_scope("GET", "/") is None
    assert required_scope("GET", "/v1/fit") == "artifacts:read" and required_scope("POST", "/v1/fit") == "artifacts:read"
    assert required_scope("OPTIONS", "/v1/builds") == "artifacts:read"
    assert required_scope("POST", "/v1/tokens/x") == "admin" and required_scope("GET", "/v1/tokensx") == "admin"


def test_static_files_are_open_when_auth_is_required(client):
    assert client.get("/static/dashboard.css").status_code == 200
    assert client.get("/static/nope.css").status_code == 404


def test_without_auth_nothing_is_checked_but_the_body_limit(tmp_path):
    open_app = app_for(tmp_path, max_body_bytes=100)
    assert open_app.get("/v1/tokens").status_code == 200
    big = open_app.post("/v1/builds", content=b"x" * 101, headers={"Content-Type": "application/json"})
    assert big.status_code == 413 and big.json() == {"error": {"code": "too_large", "field": "body",
                                                              "message": "body over 100 bytes",
                                                              "fix": "send a smaller request"}}
    assert open_app.post("/v1/builds", content=b"x" * 100).status_code == 422


def test_a_database_error_while_checking_a_token_is_503_naming_it(client):
    from sqlalchemy import text

    with client.app.state.sessions() as s:  # the token table is gone: every lookup fails in the driver
        s.execute(text("DROP TABLE api_tokens"))
        s.commit()
    r = client.get("/v1/artifacts", headers=bearer(BOOT))
    assert r.status_code == 503 and r.json() == {"error": {
        "code": "database_unavailable", "field": "database", "message": "the database is unreachable (OperationalError)",
        "fix": "retry shortly; Kiln reconnects by itself"}}


def test_a_token_with_a_scope_this_version_does_not_know_keeps_the_others(client):
    import uuid

    from kiln.tables import utcnow

    with client.app.state.sessions() as s:  # e.g. written by a newer version
        s.add(ApiToken(id=uuid.uuid4().hex, name="old", token_sha256=token_hash("kiln_legacy"),
                       scopes=["models:write", "artifacts:read"], created_at=utcnow(), issued_with_auth=True))
        s.commit()
    assert client.get("/v1/artifacts", headers=bearer("kiln_legacy")).status_code == 200
    r = client.post("/v1/builds", json={}, headers=bearer("kiln_legacy"))
    assert r.status_code == 403 and "models:write, artifacts:read" in r.json()["error"]["fix"]


def test_head_requests_need_only_the_read_scope(client):
    read = make_token(client, "artifacts:read")["token"]
    assert client.head("/v1/artifacts", headers=bearer(read)).status_code == 405  # past auth; no HEAD route
    assert client.head("/v2/", headers=bearer(read)).status_code == 200
    assert client.head("/v1/artifacts").status_code == 401


def test_lifespan_events_pass_through_the_middleware(tmp_path):
    s = Settings(home=tmp_path / "home", auth="required", bootstrap_token=BOOT)
    db.upgrade(s.db_url)
    with TestClient(create_app(s, enqueue=lambda *a: None)) as client:  # startup and shutdown go through it
        assert client.get("/healthz").status_code == 200
        assert client.get("/v1/artifacts", headers=bearer(BOOT)).status_code == 200


def test_tokens_are_stored_keyed_by_the_servers_secret_and_found_by_either_hash():
    import hashlib
    import hmac

    from api.auth import token_hashes

    plain = hashlib.sha256(b"kiln_t").hexdigest()
    keyed = hmac.new(b"s3cret", b"kiln_t", hashlib.sha256).hexdigest()
    assert token_hashes("kiln_t", "s3cret") == [keyed, plain]  # new rows are keyed; rows from before, plain
    assert token_hashes("kiln_t", None) == token_hashes("kiln_t", "") == [plain]
    assert (token_hash("kiln_t", "s3cret"), token_hash("kiln_t")) == (keyed, plain)


def test_with_a_secret_the_bootstrap_and_new_tokens_are_stored_keyed_and_old_plain_rows_still_work(tmp_path):
    import uuid

    from kiln.tables import utcnow

    client = app_for(tmp_path, auth="required", bootstrap_token=BOOT, token_secret="s3cret")
    made = make_token(client, "artifacts:read")
    with client.app.state.sessions() as s:
        stored = {r.name: r.token_sha256 for r in s.query(ApiToken)}
        s.add(ApiToken(id=uuid.uuid4().hex, name="old", token_sha256=token_hash("kiln_old"), scopes=["artifacts:read"],
                       created_at=utcnow(), issued_with_auth=True))
        s.commit()
    assert stored == {"bootstrap": token_hash(BOOT, "s3cret"), "t": token_hash(made["token"], "s3cret")}
    assert client.get("/v1/artifacts", headers=bearer(made["token"])).status_code == 200
    assert client.get("/v1/artifacts", headers=bearer("kiln_old")).status_code == 200


@pytest.mark.parametrize("name,scopes,upgraded", [("bootstrap", ["admin"], True), ("ci", ["admin"], False),
                                                  ("bootstrap", ["artifacts:read"], False)])
def test_a_bootstrap_row_minted_while_auth_was_off_is_the_operators_only_if_it_is_the_bootstrap(tmp_path, name,
                                                                                             scopes, upgraded):
    import uuid

    from kiln.tables import utcnow

    s_ = Settings(home=tmp_path / "home")
    db.upgrade(s_.db_url)
    sessions = db.session_factory(s_.db_url)
    with sessions() as s:  # the same secret, stored while auth was off (anyone could mint then)
        s.add(ApiToken(id=uuid.uuid4().hex, name=name, token_sha256=token_hash(BOOT), scopes=scopes,
                       created_at=utcnow(), issued_with_auth=False))
        s.commit()
    client = app_for(tmp_path, auth="required", bootstrap_token=BOOT)
    with client.app.state.sessions() as s:
        assert [(r.name, r.issued_with_auth) for r in s.query(ApiToken)] == [(name, upgraded)]
    assert client.get("/v1/artifacts", headers=bearer(BOOT)).status_code == (200 if upgraded else 401)


def test_a_token_is_listed_and_revoked_with_every_field_but_its_secret(client):
    from datetime import datetime

    made = make_token(client, "artifacts:read", name="ci")
    listed = {t["name"]: t for t in client.get("/v1/tokens", headers=bearer(BOOT)).json()["tokens"]}
    ci = listed["ci"]
    assert set(ci) == {"id", "name", "scopes", "created_at", "expires_at", "revoked"}
    assert (ci["id"], ci["scopes"], ci["expires_at"], ci["revoked"]) == (made["id"], ["artifacts:read"], None, False)
    datetime.fromisoformat(ci["created_at"])
    revoked = client.delete(f"/v1/tokens/{made['id']}", headers=bearer(BOOT)).json()
    assert (revoked["id"], revoked["revoked"]) == (made["id"], True)
    expiring = client.post("/v1/tokens", json={"name": "x", "scopes": ["artifacts:read"], "expires_in_days": 2},
                           headers=bearer(BOOT)).json()
    left = datetime.fromisoformat(expiring["expires_at"]) - datetime.fromisoformat(expiring["created_at"])
    assert 2 * 86400 - 5 < left.total_seconds() < 2 * 86400 + 5


def test_the_failure_record_forgets_everyone_only_past_ten_thousand_addresses(client):
    from api.auth import AuthMiddleware

    m = AuthMiddleware(None, kiln_app=client.app)
    m.failures = {f"10.0.{i // 256}.{i % 256}": None for i in range(10_000)}
    m._failed("192.0.2.1")  # 10,000 known: kept, one more added
    assert len(m.failures) == 10_001 and len(m.failures["192.0.2.1"]) == 1
    m._failed("192.0.2.2")  # over 10,000: forgotten, then this one recorded
    assert list(m.failures) == ["192.0.2.2"]
    m._failed("192.0.2.2")
    assert len(m.failures["192.0.2.2"]) == 2


def test_a_registry_client_is_told_the_registry_api_version_when_refused(client):
    v2 = client.get("/v2/")
    assert (v2.status_code, v2.headers["Docker-Distribution-API-Version"]) == (401, "registry/2.0")
    assert "Docker-Distribution-API-Version" not in client.get("/v1/artifacts").headers


def test_an_expired_token_is_refused_like_an_unknown_one(client):
    import uuid
    from datetime import timedelta

    from kiln.tables import utcnow

    with client.app.state.sessions() as s:
        for name, days in (("expired", -1), ("valid", 1)):
            s.add(ApiToken(id=uuid.uuid4().hex, name=name, token_sha256=token_hash(f"kiln_{name}"),
                           scopes=["artifacts:read"], created_at=utcnow(), issued_with_auth=True,
                           expires_at=utcnow() + timedelta(days=days)))
        s.commit()
    r = client.get("/v1/artifacts", headers=bearer("kiln_expired"))
    assert r.status_code == 401 and r.json()["error"]["message"] == "unknown or revoked token"
    assert client.get("/v1/artifacts", headers=bearer("kiln_valid")).status_code == 200


def test_ten_failed_token_checks_from_an_address_are_answered_429_for_the_window(client):
    from api.auth import FAILURE_WINDOW_S, MAX_FAILURES

    assert (MAX_FAILURES, FAILURE_WINDOW_S) == (10, 60.0)
    for _ in range(MAX_FAILURES):
        assert client.get("/v1/artifacts", headers=bearer("kiln_wrong")).status_code == 401
    r = client.get("/v1/artifacts", headers=bearer("kiln_wrong"))
    assert (r.status_code, r.headers["Retry-After"]) == (429, "60")
    assert r.json() == {"error": {"code": "too_many_failures", "field": "Authorization",
                                  "message": "too many failed token checks from this address",
                                  "fix": "wait 60 s and use a valid token"}}
    assert client.get("/v1/artifacts").status_code == 401  # no token sent: not a token check, not throttled


def test_nine_failures_are_not_throttled_and_failures_older_than_the_window_are_forgotten(client):
    import time
    from collections import deque

    from api.auth import AuthMiddleware

    for _ in range(9):
        client.get("/v1/artifacts", headers=bearer("kiln_wrong"))
    assert client.get("/v1/artifacts", headers=bearer(BOOT)).status_code == 200
    m = AuthMiddleware(None, kiln_app=client.app)
    now = time.monotonic()
    m.failures["a"] = deque([now - 61] * 10 + [now - 1])
    m.failures["b"] = deque([now - 59] * 10)
    assert (m._throttled("a"), len(m.failures["a"])) == (False, 1)
    assert (m._throttled("b"), m._throttled("nobody")) == (True, False)


def test_a_declared_body_over_the_limit_is_refused_413_before_any_token_check(tmp_path):
    client = app_for(tmp_path, auth="required", bootstrap_token=BOOT, max_body_bytes=100)
    r = client.post("/v1/builds", content=b"x" * 101, headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "too_large"  # no token sent: still 413, not 401


def test_with_anonymous_reads_a_sent_token_is_still_checked(tmp_path):
    anon = app_for(tmp_path, auth="required", bootstrap_token=BOOT, anonymous_read=True)
    assert anon.get("/v1/artifacts").status_code == 200
    assert anon.get("/v1/artifacts", headers=bearer("kiln_wrong")).status_code == 401


def test_failed_token_checks_are_counted_per_client_address(tmp_path):
    s = Settings(home=tmp_path / "home", auth="required", bootstrap_token=BOOT)
    db.upgrade(s.db_url)
    app = create_app(s, enqueue=lambda *a: None)
    noisy = TestClient(app, client=("192.0.2.7", 40000))
    other = TestClient(app, client=("192.0.2.8", 40000))  # same port, another address
    for _ in range(10):
        noisy.get("/v1/artifacts", headers=bearer("kiln_wrong"))
    assert noisy.get("/v1/artifacts", headers=bearer("kiln_wrong")).status_code == 429
    assert other.get("/v1/artifacts", headers=bearer("kiln_wrong")).status_code == 401


def test_a_valid_token_from_a_throttled_address_is_served(client):
    """Bad tokens from an address (a shared NAT, a proxy) never lock out the valid ones sent from it: admin
    routes and /v2 pulls included; a token lacking the scope is still 403, not 429."""
    read = make_token(client, "artifacts:read")["token"]
    for _ in range(11):
        client.get("/v1/artifacts", headers=bearer("kiln_wrong"))
    assert client.get("/v1/artifacts", headers=bearer("kiln_wrong")).status_code == 429
    assert client.get("/v1/tokens", headers=bearer(BOOT)).status_code == 200
    assert client.get("/v2/", headers=bearer(read)).status_code == 200
    assert client.get("/v1/tokens", headers=bearer(read)).status_code == 403
    assert client.get("/v1/artifacts", headers=bearer("kiln_wrong")).status_code == 429


@pytest.mark.parametrize("allow,expected", [(None, {"proxy_headers": False}),
                                            ("10.0.0.5", {"proxy_headers": True, "forwarded_allow_ips": "10.0.0.5"})])
def test_the_api_takes_x_forwarded_for_only_from_configured_proxies(monkeypatch, tmp_path, allow, expected):
    """uvicorn trusts X-Forwarded-For from 127.0.0.1 by default: a local proxy's clients would then choose the
    address their failed token checks are counted against. `kiln api` trusts none unless
    KILN_FORWARDED_ALLOW_IPS names the proxies."""
    import uvicorn
    from click.testing import CliRunner

    from api import cli_service

    seen = {}
    monkeypatch.setattr(uvicorn, "run", lambda *a, **kw: seen.update(kw))
    monkeypatch.setattr(cli_service, "_upgrade_embedded_db", lambda: None)
    monkeypatch.setenv("KILN_HOME", str(tmp_path))
    monkeypatch.delenv("KILN_FORWARDED_ALLOW_IPS", raising=False)
    if allow:
        monkeypatch.setenv("KILN_FORWARDED_ALLOW_IPS", allow)
    r = CliRunner().invoke(cli_service.api, [])
    assert r.exit_code == 0, r.output
    assert {k: seen[k] for k in expected} == expected
    if not allow:
        assert "forwarded_allow_ips" not in seen or not seen["forwarded_allow_ips"]


def test_anonymous_admission_opens_the_webhook_alone(tmp_path):
    """KILN_ANONYMOUS_ADMISSION: the API server may call POST /v1/admission/validate without a token; every other
    route (resolve, artifacts, /v2 pulls) still needs one."""
    anon = app_for(tmp_path, auth="required", bootstrap_token=BOOT, anonymous_admission=True, registry_hosts="kiln.example")
    review = {"kind": "AdmissionReview", "apiVersion": "admission.k8s.io/v1",
              "request": {"uid": "u1", "kind": {"kind": "Pod"}, "operation": "CREATE",
                          "object": {"spec": {"containers": [{"name": "c", "image": "busybox:1.36"}]}}}}
    r = anon.post("/v1/admission/validate", json=review)
    assert r.status_code == 200 and r.json()["response"]["allowed"] is True
    for method, path in (("GET", "/v1/artifacts"), ("GET", "/v2/"), ("GET", "/v2/acme/tiny/tags/list"),
                         ("POST", "/v1/fit"), ("GET", "/v1/admission/validate")):
        r = anon.request(method, path)
        assert r.status_code in (401, 405), f"{method} {path} answered {r.status_code} without a token"
    assert anon.get("/v1/artifacts", headers={"Authorization": f"Bearer {BOOT}"}).status_code == 200

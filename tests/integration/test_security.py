"""Tokens and scopes on the embedded service: 401 without a token, 403 with too narrow a scope, tokens shown
once and stored hashed, OCI-style Basic auth on /v2, request size limits, and no secret in the logs."""

from __future__ import annotations

import base64
import hashlib
import json

import httpx
import pytest
import sqlalchemy as sa

from tests.hubcache import add_snapshot, commit_sha, set_ref
from scripts.devstack import Stack, tiny_spec
from scripts.devstack import served as embedded

pytestmark = pytest.mark.slow
BOOT = "kiln-bootstrap-for-tests-0123456789"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("sec")
    hub = root / "hf" / "hub"  # a real Hub cache, used offline (as in the review's reproduction)
    add_snapshot(hub, "acme/tiny", commit_sha(1))
    set_ref(hub, "acme/tiny", "main", commit_sha(1))
    env = {"KILN_BOOTSTRAP_TOKEN": BOOT, "KILN_WEBHOOK_SECRET": "whsec", "HF_HUB_OFFLINE": "1",
           "HF_HOME": str(root / "hf"), "HF_HUB_CACHE": str(hub)}
    with embedded(root / "kiln", env) as s:
        s.hub = hub
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
    # Basic only (a Bearer realm is a token service's URL to registry clients), and the registry's version header
    assert r.headers["WWW-Authenticate"] == 'Basic realm="kiln"'
    assert r.headers["Docker-Distribution-API-Version"] == "registry/2.0"
    assert call(served, "GET", "/v2/", token=deployer).status_code == 200  # Bearer <token> still accepted

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


# -- High 1: an hf:// revision is a ref name or a commit, never a path -------------------------------------
def test_hf_revisions_that_are_paths_are_one_422(served):
    outside = served.home.parent / "outside" / ("3" * 40)  # a checkpoint directory outside every root
    outside.mkdir(parents=True)
    (outside / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    refs = served.hub / "models--acme--tiny" / "refs"
    (refs / "nested").mkdir()
    answers = set()
    for revision in ("/etc", "../../x", str(outside), "../" * 12 + str(outside).lstrip("/"), "main/x", "nested",
                     "no-such-branch"):
        r = call(served, "POST", "/v1/builds", token=BOOT, json=tiny_spec(checkpoint=f"hf://acme/tiny@{revision}"))
        assert r.status_code == 422 and r.json()["error"]["field"] == "checkpoint", (revision, r.text)
        answers.add(r.json()["error"]["code"])
    assert len(answers) <= 2  # a path (invalid_spec) or a missing ref (checkpoint_not_found): nothing in between
    for repo in ("../..", "acme/..", "..%2f.."):
        r = call(served, "POST", "/v1/builds", token=BOOT, json=tiny_spec(checkpoint=f"hf://{repo}@main"))
        assert r.status_code == 422 and r.json()["error"]["field"] == "checkpoint", (repo, r.text)
    assert not any("Traceback" in line for line in served.log("serve").splitlines()[-200:])


# -- High 2: with auth off no token can be minted; tokens minted while it was off are never honoured ------
def test_auth_off_mints_nothing_and_its_tokens_never_work(tmp_path):
    home = tmp_path / "kiln"
    with embedded(home, {"KILN_AUTH": "off"}) as s:
        r = call(s, "POST", "/v1/tokens", json={"name": "anyone", "scopes": ["admin"]})
        assert r.status_code == 403 and r.json()["error"]["field"] == "KILN_AUTH"
    # a token an older version minted while auth was off, as it stored it
    old_token = "kiln_minted-while-auth-was-off"
    engine = sa.create_engine(f"sqlite:///{home / 'kiln.db'}")
    with engine.begin() as c:
        c.execute(sa.text("INSERT INTO api_tokens (id, name, token_sha256, scopes, created_at) "
                          "VALUES ('old', 'anyone', :h, '[\"admin\"]', '2026-01-01 00:00:00')"),
                  {"h": hashlib.sha256(old_token.encode()).hexdigest()})
    engine.dispose()
    with embedded(home, {"KILN_BOOTSTRAP_TOKEN": BOOT}) as s:
        assert call(s, "GET", "/v1/tokens", token=old_token).status_code == 401
        assert call(s, "GET", "/v1/builds", token=old_token).status_code == 401
        assert call(s, "GET", "/v1/tokens", token=BOOT).status_code == 200
        made = call(s, "POST", "/v1/tokens", token=BOOT, json={"name": "ci", "scopes": ["builds:write"]})
        assert made.status_code == 201 and call(s, "GET", "/v1/builds", token=made.json()["token"]).status_code == 200


# -- Medium 3: non-finite numbers are refused everywhere; a bad stored row breaks no listing -------------
def test_non_finite_numbers_are_422_naming_the_field(served):
    spec = json.dumps(tiny_spec(gates={"max_mean_kl": 0.5}))
    for bad in ("Infinity", "-Infinity", "NaN", "1e999"):
        r = call(served, "POST", "/v1/builds", token=BOOT, content=spec.replace("0.5", bad),
                 headers={"content-type": "application/json"})
        assert r.status_code == 422 and r.json()["error"]["field"] == "gates.max_mean_kl", (bad, r.text)
    r = call(served, "POST", "/v1/builds", token=BOOT, content='{"matrix": [%s]}' % spec.replace("0.5", "Infinity"),
             headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "matrix.0.gates.max_mean_kl"
    r = call(served, "PUT", "/v1/models/acme/tiny", token=BOOT, headers={"content-type": "application/json"},
             content='{"checkpoint": "hf://acme/tiny@main", "gates": {"max_mean_kl": NaN}, "matrix": [{"precision": "fp8"}]}')
    assert r.status_code == 422 and r.json()["error"]["field"] == "gates.max_mean_kl"
    r = call(served, "POST", "/v1/fit", token=BOOT, content='{"traffic": [{"prompt_tokens": Infinity}]}',
             headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "traffic.0.prompt_tokens"
    assert call(served, "GET", "/v1/builds", token=BOOT).status_code == 200


# -- Low: a write token cannot judge an engine more leniently and move a tag without a recorded reason ----------
def test_a_looser_or_shorter_judgement_without_a_reason_is_a_422_naming_the_field_and_starts_nothing(served):
    def build_ids():  # ids only: an earlier test's build may still be running, its status moving
        return sorted(b["id"] for b in call(served, "GET", "/v1/builds", token=BOOT).json()["builds"])

    before = build_ids()
    for spec, field in ((tiny_spec(gates={"max_mean_kl": 0.5}), "gates.max_mean_kl"),
                        (tiny_spec(gates={"min_top1_agreement": 0.5}), "gates.min_top1_agreement"),
                        (tiny_spec(), "evaluation.max_tokens")):
        spec.pop("override_reason")
        r = call(served, "POST", "/v1/builds", token=BOOT, json=spec)
        assert r.status_code == 422 and r.json()["error"]["field"] == field, r.text
        assert "override_reason" in r.json()["error"]["fix"]
        r = call(served, "POST", "/v1/builds", token=BOOT, json={"matrix": [spec]})
        assert r.status_code == 422 and r.json()["error"]["field"] == f"matrix.0.{field}", r.text
    assert build_ids() == before


def test_a_non_finite_number_stored_earlier_breaks_no_listing(served):
    engine = sa.create_engine(f"sqlite:///{served.home / 'kiln.db'}")
    with engine.begin() as c:  # what an older version stored from {"gates": {"max_mean_kl": Infinity}}
        spec = json.dumps(tiny_spec(model_name="acme/bad", gates={"max_mean_kl": float("inf")}))
        c.execute(sa.text("INSERT INTO builds (id, request_key, spec, queue, status, stages, attempts, "
                          "cancel_requested, created_at) VALUES ('badrow', 'k', :spec, 'q', 'failed', '[]', 0, 0, "
                          "'2026-01-01 00:00:00')"), {"spec": spec})
        c.execute(sa.text("INSERT INTO models (name, checkpoint, hf_repo, branch, head_sha, matrix, gates, "
                          "created_at, updated_at) VALUES ('acme/bad', 'hf://acme/tiny@main', 'acme/tiny', 'main', :sha, "
                          "'[]', '{\"max_mean_kl\": Infinity}', '2026-01-01 00:00:00', '2026-01-01 00:00:00')"),
                  {"sha": commit_sha(1)})
    engine.dispose()
    r = call(served, "GET", "/v1/builds", token=BOOT)
    assert r.status_code == 200
    bad = next(b for b in r.json()["builds"] if b["id"] == "badrow")
    assert bad["spec"]["gates"]["max_mean_kl"] is None
    assert call(served, "GET", "/v1/builds/badrow", token=BOOT).status_code == 200
    r = call(served, "GET", "/v1/models", token=BOOT)
    assert r.status_code == 200 and any(m["name"] == "acme/bad" for m in r.json()["models"])


# -- Medium 4: the body limit counts the bytes received, chunked or not, on every route -----------------
def _chunks(total: int, size: int = 64 << 10):
    yield b'{"checkpoint": "'
    sent = 0
    while sent < total:
        yield b"x" * size
        sent += size
    yield b'"}'


def test_chunked_bodies_over_the_limit_are_413_before_parsing(served):
    for method, path, headers in (("POST", "/v1/builds", {}), ("POST", "/v1/fit", {}),
                                  ("PUT", "/v1/models/acme/tiny", {}),
                                  ("POST", "/v1/webhooks/huggingface", {"X-Webhook-Secret": "whsec"})):
        r = call(served, method, path, token=BOOT, content=_chunks(3 << 20),
                 headers={"content-type": "application/json", **headers})
        assert "content-length" not in r.request.headers and r.request.headers["transfer-encoding"] == "chunked"
        assert r.status_code == 413 and r.json()["error"]["field"] == "body", (path, r.status_code, r.text[:200])
    # under the limit, chunked bodies are read as usual
    r = call(served, "POST", "/v1/builds", token=BOOT, content=iter([b'{"precision": "fp8"', b"}"]),
             headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "checkpoint"


def test_deeply_nested_json_is_422(served):
    deep = "[" * 5000 + "]" * 5000
    r = call(served, "POST", "/v1/webhooks/huggingface", content=deep, headers={"X-Webhook-Secret": "whsec"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "body"
    r = call(served, "POST", "/v1/builds", token=BOOT, content='{"gates": ' + "[" * 100 + "]" * 100 + "}")
    assert r.status_code == 422


# -- Medium 6: the API identifies checkpoints cheaply and downloads none -----------------------------------
def test_the_api_downloads_no_checkpoint_and_reads_only_allowed_buckets(tmp_path):
    import boto3

    from tests.conftest import TINY
    from tests.s3server import CREDENTIALS, moto_s3

    with moto_s3() as endpoint:
        client = boto3.client("s3", endpoint_url=endpoint)
        for bucket in ("ckpts", "private"):
            client.create_bucket(Bucket=bucket)
            client.put_object(Bucket=bucket, Key="small/config.json", Body=(TINY / "config.json").read_bytes())
            client.put_object(Bucket=bucket, Key="small/model.safetensors", Body=b"w" * 4000)
        for path in TINY.iterdir():
            client.upload_file(str(path), "ckpts", f"tiny/{path.name}")
        home = tmp_path / "kiln"
        s = Stack(home, {"KILN_S3_ENDPOINT_URL": endpoint, "KILN_CHECKPOINT_BUCKETS": "ckpts",
                         "KILN_CHECKPOINT_MAX_BYTES": "100000", **CREDENTIALS})
        assert s.kiln("db", "upgrade").returncode == 0
        try:
            s.start_api()
            r = s.post("/v1/builds", tiny_spec(checkpoint="s3://ckpts/small"))
            assert r.status_code == 202 and r.json()["status"] == "queued", r.text
            assert not [p for p in tmp_path.rglob("*") if p.is_file() and p.read_bytes() == b"w" * 4000]
            r = s.post("/v1/builds", tiny_spec(checkpoint="s3://private/small"))
            assert r.status_code == 422 and r.json()["error"]["field"] == "checkpoint"
            assert "KILN_CHECKPOINT_BUCKETS" in r.json()["error"]["fix"]
            r = s.post("/v1/builds", tiny_spec(checkpoint="s3://ckpts/tiny"))  # 5 MB of weights, over the limit
            assert r.status_code == 422 and "KILN_CHECKPOINT_MAX_BYTES" in r.json()["error"]["fix"]
            assert not list(tmp_path.rglob("*.safetensors"))
        finally:
            s.close()


# -- Low: tokens stored keyed, expiring, and failed attempts rate-limited -------------------------------------
def test_tokens_are_keyed_hashes_expire_and_failures_are_throttled(tmp_path):
    import hmac
    import time

    secret = "token-secret-for-tests"
    with embedded(tmp_path / "kiln", {"KILN_BOOTSTRAP_TOKEN": BOOT, "KILN_TOKEN_SECRET": secret}) as s:
        made = call(s, "POST", "/v1/tokens", token=BOOT, json={"name": "short", "scopes": ["artifacts:read"],
                                                               "expires_in_days": 3 / 86400})
        assert made.status_code == 201 and made.json()["expires_at"]
        short = made.json()["token"]
        assert call(s, "GET", "/v1/artifacts", token=short).status_code == 200
        engine = sa.create_engine(f"sqlite:///{s.home / 'kiln.db'}")
        with engine.connect() as c:
            stored = {row[0] for row in c.execute(sa.text("SELECT token_sha256 FROM api_tokens"))}
        engine.dispose()
        keyed = hmac.new(secret.encode(), short.encode(), hashlib.sha256).hexdigest()
        assert keyed in stored and hashlib.sha256(short.encode()).hexdigest() not in stored
        time.sleep(4)
        assert call(s, "GET", "/v1/artifacts", token=short).status_code == 401  # expired
        bad = call(s, "POST", "/v1/tokens", token=BOOT, json={"name": "x", "scopes": ["admin"], "expires_in_days": -1})
        assert bad.status_code == 422 and bad.json()["error"]["field"] == "expires_in_days"
        answers = [call(s, "GET", "/v1/artifacts", token=f"kiln_guess{i}").status_code for i in range(12)]
        assert answers[:9] == [401] * 9 and answers[-1] == 429
        r = call(s, "GET", "/v1/artifacts", token=f"kiln_guess{99}")
        assert r.status_code == 429 and r.headers["Retry-After"]  # the address's guesses wait
        assert call(s, "GET", "/v1/artifacts", token=BOOT).status_code == 200  # a valid token is still served

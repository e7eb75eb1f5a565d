"""artifacts/push.py against a scripted registry (httpx.MockTransport): the referrers API path (no tag schema
written), Bearer and Basic auth, the order of pushes, a corrupted blob aborting its upload; destinations and
credentials. The real registry (distribution 2.8, the tag schema path) is tests/integration/test_registry_push.py."""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest

from artifacts.local import LocalBlobStore
from artifacts.oci import MEDIA_TYPE_IMAGE_INDEX, MEDIA_TYPE_IMAGE_MANIFEST, descriptor, push_engine_image, push_referrer
from artifacts.push import (Credentials, Registry, credentials_for, fallback_tag, parse_destination, push_image)
from kiln.errors import DigestMismatch, InvalidRequest, NameInvalid, RegistryDenied, RegistryUnavailable


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class FakeRegistry:
    """Just enough of the distribution API, in memory; ``referrers_api`` toggles the 1.1 endpoint, ``auth``
    demands ``Basic`` or ``Bearer`` (a token service at /token that wants Basic user:pw)."""

    def __init__(self, *, referrers_api: bool = True, auth: str | None = None) -> None:
        self.blobs: dict[str, bytes] = {}
        self.manifests: dict[str, bytes] = {}  # digest or tag -> bytes
        self.log: list[tuple[str, str]] = []
        self.referrers_api, self.auth = referrers_api, auth
        self.token_requests: list[dict] = []

    def handler(self, request: httpx.Request) -> httpx.Response:
        url = urlsplit(str(request.url))
        path, query = url.path, parse_qs(url.query)
        if path == "/token":
            self.token_requests.append({"query": query, "auth": request.headers.get("Authorization")})
            if request.headers.get("Authorization") != "Basic " + base64.b64encode(b"user:pw").decode():
                return httpx.Response(401)
            return httpx.Response(200, json={"token": "t0k"})
        if self.auth == "basic" and request.headers.get("Authorization") != \
                "Basic " + base64.b64encode(b"user:pw").decode():
            return httpx.Response(401, headers={"WWW-Authenticate": 'Basic realm="r"'})
        if self.auth == "bearer" and request.headers.get("Authorization") != "Bearer t0k":
            return httpx.Response(401, headers={"WWW-Authenticate": 'Bearer realm="https://reg.test/token",'
                                                'service="reg.test",scope="repository:m/e:pull,push"'})
        self.log.append((request.method, path))
        parts = path.split("/")
        if "/blobs/uploads/" in path and request.method == "POST":
            return httpx.Response(202, headers={"Location": "/v2/m/e/blobs/uploads/u1?_state=x"})
        if "/blobs/uploads/" in path and request.method == "PUT":
            data = request.read()
            digest = query["digest"][0]
            if sha(data) != digest:
                return httpx.Response(400, json={"errors": [{"code": "DIGEST_INVALID", "message": "no"}]})
            self.blobs[digest] = data
            return httpx.Response(201)
        if "/blobs/" in path:
            if parts[-1] not in self.blobs:
                return httpx.Response(404)
            return httpx.Response(200, content=self.blobs[parts[-1]] if request.method == "GET" else b"")
        if "/manifests/" in path and request.method == "PUT":
            data = request.read()
            self.manifests[parts[-1]] = data
            headers = {"Docker-Content-Digest": sha(data)}
            subject = json.loads(data).get("subject")
            if subject and self.referrers_api:
                headers["OCI-Subject"] = subject["digest"]
            return httpx.Response(201, headers=headers)
        if "/manifests/" in path:
            data = self.manifests.get(parts[-1])
            return httpx.Response(404) if data is None else httpx.Response(200, content=data)
        if "/referrers/" in path:
            if not self.referrers_api:
                return httpx.Response(404, text="404 page not found")
            listed = {d: json.loads(b) for d, b in self.manifests.items() if d.startswith("sha256:")}
            found = [{"digest": d, "mediaType": MEDIA_TYPE_IMAGE_MANIFEST,
                      "artifactType": m.get("artifactType") or m["config"]["mediaType"]}
                     for d, m in listed.items() if (m.get("subject") or {}).get("digest") == parts[-1]]
            return httpx.Response(200, json={"schemaVersion": 2, "mediaType": MEDIA_TYPE_IMAGE_INDEX,
                                             "manifests": found})
        return httpx.Response(404)

    def client(self, host: str = "reg.test", **kw) -> Registry:
        return Registry(host, client=httpx.Client(transport=httpx.MockTransport(self.handler)), **kw)


@pytest.fixture
def engine(tmp_path):
    store = LocalBlobStore(tmp_path / "store")
    src = tmp_path / "engine"
    src.mkdir()
    (src / "weights.bin").write_bytes(bytes(range(256)) * 9000)
    image = push_engine_image(store, src, annotations={}, labels={})
    subject = descriptor(MEDIA_TYPE_IMAGE_MANIFEST, image.digest, image.size)
    refs = [push_referrer(store, subject, artifact_type=f"application/x-{n}", payload=n.encode(),
                          payload_media_type="text/plain", annotations={"n": n}) for n in ("a", "b")]
    return store, image, refs


def test_referrers_api_registry_gets_no_tag_schema_index_and_the_tag_comes_last(engine):
    store, image, refs = engine
    reg = FakeRegistry(referrers_api=True)
    result = push_image(store, reg.client(), parse_destination("reg.test/m/e:v1"), image.digest, refs)
    assert result.referrers_api and [r["digest"] for r in result.referrers] == refs
    assert [r["artifactType"] for r in result.referrers] == ["application/x-a", "application/x-b"]
    assert fallback_tag(image.digest) not in reg.manifests
    assert reg.manifests[image.digest] == store.get_bytes(image.digest) == reg.manifests["v1"]
    puts = [p.rsplit("/", 1)[1] for m, p in reg.log if m == "PUT" and "/manifests/" in p]
    assert puts == [image.digest, *refs, "v1"]  # engine, its referrers, then the tag
    again = push_image(store, reg.client(), parse_destination("reg.test/m/e"), image.digest, refs)
    assert again.blobs_sent == 0 and again.blobs_present == 2 + 2 * 2


def test_without_a_referrers_api_the_tag_schema_index_is_merged_not_replaced(engine):
    store, image, refs = engine
    reg = FakeRegistry(referrers_api=False)
    other = {"mediaType": MEDIA_TYPE_IMAGE_MANIFEST, "digest": sha(b"someone else's"), "size": 3,
             "artifactType": "application/x-other"}
    tag = fallback_tag(image.digest)
    reg.manifests[tag] = json.dumps({"schemaVersion": 2, "mediaType": MEDIA_TYPE_IMAGE_INDEX,
                                     "manifests": [other]}).encode()
    result = push_image(store, reg.client(), parse_destination("reg.test/m/e"), image.digest, refs)
    assert not result.referrers_api and result.to_dict()["referrers_tag"] == tag
    index = json.loads(reg.manifests[tag])
    assert [m["digest"] for m in index["manifests"]] == [other["digest"], *refs]
    assert index["manifests"][1]["annotations"] == {"n": "a"}
    before = len([1 for m, p in reg.log if m == "PUT" and p.endswith(tag)])
    push_image(store, reg.client(), parse_destination("reg.test/m/e"), image.digest, refs)
    assert len([1 for m, p in reg.log if m == "PUT" and p.endswith(tag)]) == before  # nothing new: not rewritten


def test_bearer_challenge_fetches_a_token_with_the_credentials(engine):
    store, image, refs = engine
    reg = FakeRegistry(auth="bearer")
    client = reg.client(credentials=Credentials("user", "pw", "test"))
    push_image(store, client, parse_destination("reg.test/m/e"), image.digest, refs)
    assert reg.manifests[image.digest] == store.get_bytes(image.digest)
    assert reg.token_requests[0]["query"] == {"service": ["reg.test"], "scope": ["repository:m/e:pull,push"]}
    assert len(reg.token_requests) == 1  # the token is kept
    with pytest.raises(RegistryDenied, match="token service refused the credentials"):
        push_image(store, FakeRegistry(auth="bearer").client(credentials=Credentials("user", "bad")),
                   parse_destination("reg.test/m/e"), image.digest, refs)


def test_basic_challenge_needs_credentials(engine):
    store, image, refs = engine
    with pytest.raises(RegistryDenied, match="asks for credentials") as info:
        push_image(store, FakeRegistry(auth="basic").client(), parse_destination("reg.test/m/e"), image.digest, [])
    assert "docker login reg.test" in str(info.value)
    reg = FakeRegistry(auth="basic")
    push_image(store, reg.client(credentials=Credentials("user", "pw")), parse_destination("reg.test/m/e"),
               image.digest, refs)
    assert image.digest in reg.manifests


def test_a_corrupted_blob_aborts_its_upload_and_no_manifest_is_pushed(engine):
    store, image, refs = engine
    [layer] = image.layers
    path = Path(store.root) / "blobs" / "sha256" / layer.digest.split(":")[1]
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.chmod(0o644)
    path.write_bytes(bytes(data))
    reg = FakeRegistry()
    with pytest.raises(DigestMismatch, match="corrupted"):
        push_image(store, reg.client(), parse_destination("reg.test/m/e"), image.digest, refs)
    assert layer.digest not in reg.blobs and not reg.manifests


def test_server_errors_and_unreachable_hosts_are_environment_errors(engine):
    store, image, _ = engine

    def broken(request):
        return httpx.Response(503, json={"errors": [{"code": "UNAVAILABLE", "message": "down for repairs"}]})

    client = Registry("reg.test", client=httpx.Client(transport=httpx.MockTransport(broken)))
    with pytest.raises(RegistryUnavailable, match="down for repairs"):
        push_image(store, client, parse_destination("reg.test/m/e"), image.digest, [])

    def refused(request):
        raise httpx.ConnectError("refused")

    client = Registry("reg.test", client=httpx.Client(transport=httpx.MockTransport(refused)))
    with pytest.raises(RegistryUnavailable, match="cannot reach") as info:
        push_image(store, client, parse_destination("reg.test/m/e"), image.digest, [])
    assert "--insecure" in str(info.value)


def test_plain_http_only_for_loopback_or_insecure():
    assert Registry("localhost:5000").base == "http://localhost:5000"
    assert Registry("127.0.0.1:5000").base == "http://127.0.0.1:5000"
    assert Registry("[::1]:5000").base == "http://[::1]:5000"
    assert Registry("reg.example.com").base == "https://reg.example.com"
    assert Registry("10.0.0.5:5000").base == "https://10.0.0.5:5000"
    assert Registry("reg.example.com", insecure=True).base == "http://reg.example.com"


@pytest.mark.parametrize("text,host,repo,tag", [
    ("localhost:5000/llama", "localhost:5000", "llama", None),
    ("reg.example.com/team/models/llama:fp8-h100", "reg.example.com", "team/models/llama", "fp8-h100"),
    ("[::1]:5000/a/b:t", "[::1]:5000", "a/b", "t"),
    ("ghcr.io/acme/tiny", "ghcr.io", "acme/tiny", None),
])
def test_destinations(text, host, repo, tag):
    d = parse_destination(text)
    assert (d.host, d.repository, d.tag) == (host, repo, tag) and str(d) == text


@pytest.mark.parametrize("text", ["llama", "acme/tiny", "http://localhost:5000/x", "localhost:5000/x@sha256:ab",
                                  "reg.example.com/Upper", "reg.example.com/", "reg.example.com/x:bad/tag!",
                                  "reg.example.com/x:-t"])
def test_bad_destinations_are_refused_naming_dest(text):
    with pytest.raises(NameInvalid) as info:
        parse_destination(text)
    assert info.value.field == "dest"


def test_credentials_from_kiln_registry_auths_then_docker_config(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"auths": {
        "https://reg.example.com/v1/": {"auth": base64.b64encode(b"alice:s3cret:x").decode()},
        "localhost:5000": {"username": "bob", "password": "pw"}}}))
    got = credentials_for("reg.example.com", docker_config=config)
    assert (got.username, got.password, got.source) == ("alice", "s3cret:x", str(config))
    assert "s3cret" not in repr(got)
    assert credentials_for("localhost:5000", docker_config=config).username == "bob"
    assert credentials_for("other.example.com", docker_config=config) is None
    auths = json.dumps({"reg.example.com": {"username": "ci", "password": "tok"},
                        "other.example.com:5000": {"auth": base64.b64encode(b"o:pw").decode()}})
    env = credentials_for("reg.example.com", auths=auths, docker_config=config)
    assert env.username == "ci" and env.source == "KILN_REGISTRY_AUTHS"
    assert credentials_for("localhost:5000", auths=auths, docker_config=config).username == "bob"  # not in auths
    assert credentials_for("other.example.com:5000", auths=auths, docker_config=config).username == "o"
    assert credentials_for("other.example.com", auths=auths, docker_config=config) is None  # another port
    assert credentials_for("reg.example.com", docker_config=tmp_path / "absent.json") is None
    config.write_text("{not json")
    with pytest.raises(InvalidRequest):
        credentials_for("reg.example.com", docker_config=config)


@pytest.mark.parametrize("auth", [None, "basic", "bearer"])
@pytest.mark.parametrize("referrers_api", [True, False])
def test_pull_registry_finds_the_signature_by_either_referrers_path_with_auth(engine, tmp_path, monkeypatch, auth,
                                                                              referrers_api):
    """`kiln pull host/repo@digest` (api/pull.py pull_registry) over the registry's auth, finding the signature
    bundle through the referrers API or, without one, the tag schema `kiln push` wrote; credentials configured for
    another host are never used."""
    from api.pull import pull_registry
    from artifacts.signing import BUNDLE_TYPE

    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "no-docker"))
    store, image, refs = engine
    subject = descriptor(MEDIA_TYPE_IMAGE_MANIFEST, image.digest, image.size)
    sig = push_referrer(store, subject, artifact_type=BUNDLE_TYPE, payload=b"the bundle",
                        payload_media_type="application/json", annotations={})
    reg = FakeRegistry(referrers_api=referrers_api, auth=auth)
    push_image(store, reg.client(credentials=Credentials("user", "pw")), parse_destination("reg.test/m/e"),
               image.digest, [*refs, sig])
    assert (fallback_tag(image.digest) in reg.manifests) is not referrers_api
    transport = httpx.MockTransport(reg.handler)
    auths = json.dumps({"reg.test": {"username": "user", "password": "pw"}})
    got = pull_registry(f"reg.test/m/e@{image.digest}", tmp_path / "out", auths=auths, transport=transport,
                        cache=False, max_bytes=1 << 30)
    assert got.repository == "reg.test/m/e" and got.signed and not got.already
    assert (tmp_path / "out" / "model.sig").read_bytes() == b"the bundle"
    assert (tmp_path / "out" / "weights.bin").read_bytes() == bytes(range(256)) * 9000
    again = pull_registry(f"reg.test/m/e@{image.digest}", tmp_path / "out", auths=auths, transport=transport,
                          cache=False, max_bytes=1 << 30)
    assert again.already
    if auth is None:
        return
    elsewhere = json.dumps({"other.test": {"username": "user", "password": "pw"}})
    refused = "asks for credentials" if auth == "basic" else "refused an anonymous"
    with pytest.raises(RegistryDenied, match=refused):
        pull_registry(f"reg.test/m/e@{image.digest}", tmp_path / "x", auths=elsewhere, transport=transport,
                      cache=False, max_bytes=1 << 30)
    wrong = json.dumps({"reg.test": {"username": "user", "password": "bad"}})
    with pytest.raises(RegistryDenied, match="refused the credentials"):
        pull_registry(f"reg.test/m/e@{image.digest}", tmp_path / "x", auths=wrong, transport=transport,
                      cache=False, max_bytes=1 << 30)
    assert not (tmp_path / "x").exists()


def test_pull_registry_sends_no_credentials_where_a_blob_redirects(engine, tmp_path, monkeypatch):
    """A registry that redirects blob GETs to its storage (another origin, as S3-backed ones do): the blob is
    fetched there, verified by digest, and the registry's Authorization never goes with it."""
    from api.pull import pull_registry

    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "no-docker"))
    store, image, refs = engine
    reg = FakeRegistry(auth="basic")
    push_image(store, reg.client(credentials=Credentials("user", "pw")), parse_destination("reg.test/m/e"),
               image.digest, refs)
    storage_saw: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "storage.test":
            storage_saw.append(request.headers.get("Authorization"))
            return httpx.Response(200, content=reg.blobs[request.url.path.rsplit("/", 1)[1]])
        if request.method == "GET" and "/blobs/" in request.url.path and request.headers.get("Authorization"):
            return httpx.Response(307, headers={"Location": f"https://storage.test/b/{request.url.path.rsplit('/', 1)[1]}"})
        return reg.handler(request)

    got = pull_registry(f"reg.test/m/e@{image.digest}", tmp_path / "out", transport=httpx.MockTransport(handler),
                        auths=json.dumps({"reg.test": {"auth": base64.b64encode(b"user:pw").decode()}}),
                        cache=False, max_bytes=1 << 30)
    assert got.layers == 1 and (tmp_path / "out" / "weights.bin").exists()
    assert storage_saw and storage_saw == [None] * len(storage_saw)

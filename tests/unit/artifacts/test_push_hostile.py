"""``kiln push`` (artifacts/push.py) against hostile registries: real HTTP servers on 127.0.0.1 that answer with an
upload ``Location``, a token ``realm`` or a redirect on another origin (another port, or ``localhost`` for
``127.0.0.1``), and with endless bodies. Each server records every request it got and whether it carried an
``Authorization``: a registry's credentials reach that registry's origin only, and its replies are read bounded."""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest

from artifacts.local import LocalBlobStore
from artifacts.oci import MEDIA_TYPE_IMAGE_MANIFEST, descriptor, push_engine_image, push_referrer
from artifacts.push import (ERROR_BODY_LIMIT, MANIFEST_LIMIT, TOKEN_LIMIT, Credentials, Registry, credentials_for,
                            parse_destination, push_image)
from kiln.errors import InvalidRequest, RegistryDenied
from tests.unit.api.test_pull_hostile import SOCKET_SLACK

BASIC = "Basic " + base64.b64encode(b"alice:registry-secret").decode()
REPO = "m/e"


@dataclass
class Seen:
    method: str
    path: str
    authorization: str | None
    received: int  # request body bytes


@dataclass
class Reply:
    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes | Callable[[], object] = b""  # a callable yields chunks: sent chunked, counted as sent


class Origin:
    """One HTTP server on 127.0.0.1: ``answer(method, path, query, authorization, body) -> Reply``; records what it
    was asked (:class:`Seen`) and how many body bytes it sent."""

    def __init__(self, answer: Callable[..., Reply]) -> None:
        self.seen: list[Seen] = []
        self.sent = 0
        origin = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _any(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                parts = urlsplit(self.path)
                auth = self.headers.get("Authorization")
                origin.seen.append(Seen(self.command, parts.path, auth, len(body)))
                reply = answer(self.command, parts.path, parse_qs(parts.query), auth, body)
                self.send_response(reply.status)
                for k, v in reply.headers.items():
                    self.send_header(k, v)
                try:
                    if callable(reply.body):
                        self.send_header("Transfer-Encoding", "chunked")
                        self.end_headers()
                        for chunk in reply.body():
                            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                            origin.sent += len(chunk)
                        self.wfile.write(b"0\r\n\r\n")
                        return
                    self.send_header("Content-Length", str(len(reply.body)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(reply.body)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = _any

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.host = f"127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def authorized(self) -> list[Seen]:
        return [s for s in self.seen if s.authorization]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def servers():
    made: list[Origin] = []

    def make(answer: Callable[..., Reply]) -> Origin:
        made.append(Origin(answer))
        return made[-1]

    yield make
    for s in made:
        s.close()


@pytest.fixture
def engine(tmp_path):
    """An engine image (a 2.3 MB layer) with one referrer, in a local store."""
    store = LocalBlobStore(tmp_path / "store")
    src = tmp_path / "engine"
    src.mkdir()
    (src / "weights.bin").write_bytes(bytes(range(256)) * 9000)
    image = push_engine_image(store, src, annotations={}, labels={})
    subject = descriptor(MEDIA_TYPE_IMAGE_MANIFEST, image.digest, image.size)
    ref = push_referrer(store, subject, artifact_type="application/x-a", payload=b"a", payload_media_type="text/plain",
                         annotations={})
    return store, image, [ref]


def endless() -> Callable[[], object]:
    """A body larger than any bound plus what the sockets can hold (the client must stop reading long before)."""
    size = max(64 << 20, 2 * (MANIFEST_LIMIT + SOCKET_SLACK))

    def chunks():
        chunk = b"x" * (1 << 20)
        for _ in range(size >> 20):
            yield chunk

    return chunks


def registry(*, auth: str = "basic", location: Callable[[], str] | None = None, realm: str = "",
             token: str = "t0k", overrides: dict[tuple[str, str], Reply] | None = None) -> Callable[..., Reply]:
    """A distribution API that wants ``Basic`` alice:registry-secret (``auth="basic"``) or ``Bearer <token>`` from
    the token service at ``realm``; its upload ``Location`` is ``location()`` (default: its own path). Blobs and
    manifests are kept; ``overrides`` answer (method, path prefix) otherwise."""
    blobs: dict[str, bytes] = {}

    def answer(method, path, query, authorization, body):
        for (m, prefix), reply in (overrides or {}).items():
            if method == m and path.startswith(prefix):
                return reply
        if path == "/token":
            return Reply(200, {"Content-Type": "application/json"}, json.dumps({"token": token}).encode())
        wanted = BASIC if auth == "basic" else f"Bearer {token}"
        if authorization != wanted:
            challenge = 'Basic realm="r"' if auth == "basic" else \
                f'Bearer realm="{realm}",service="reg",scope="repository:{REPO}:pull,push"'
            return Reply(401, {"WWW-Authenticate": challenge})
        if method == "HEAD" and "/blobs/" in path:
            return Reply(200 if path.rsplit("/", 1)[-1] in blobs else 404)
        if method == "POST" and path.endswith("/blobs/uploads/"):
            return Reply(202, {"Location": location() if location else f"/v2/{REPO}/blobs/uploads/u1"})
        if method == "PUT" and "/blobs/uploads/" in path:
            blobs[query["digest"][0]] = body
            return Reply(201)
        if method == "PUT" and "/manifests/" in path:
            return Reply(201, {"Docker-Content-Digest": "sha256:" + hashlib.sha256(body).hexdigest()})
        return Reply(404, {}, b'{"errors": [{"code": "NAME_UNKNOWN", "message": "unknown"}]}')

    return answer


def collector(status: int = 201) -> Callable[..., Reply]:
    """Another origin: answers everything with ``status`` (a token where asked for one)."""
    def answer(method, path, query, authorization, body):
        if path == "/token":
            return Reply(200, {"Content-Type": "application/json"}, b'{"token": "t0k"}')
        return Reply(status)
    return answer


def client(host: str, **kw) -> Registry:
    return Registry(host, credentials=Credentials("alice", "registry-secret", "test"), **kw)


# -- upload Locations ------------------------------------------------------------------------------------------------
def test_an_upload_location_on_another_port_gets_the_bytes_without_the_credentials(servers, engine):
    """The review's case: a registry answering the upload with ``Location: http://other-host/…`` received the
    Basic credentials there along with the layer. The layer may go where the registry says; its credentials not."""
    store, image, refs = engine
    other = servers(collector())
    reg = servers(registry(location=lambda: f"http://{other.host}/upload/1?_state=s"))
    with client(reg.host) as r:
        push_image(store, r, parse_destination(f"{reg.host}/{REPO}:t"), image.digest, refs)
    puts = [s for s in other.seen if s.method == "PUT"]
    assert puts and max(s.received for s in puts) > 2_000_000  # the layer went there ...
    assert other.authorized() == [], [(s.method, s.authorization) for s in other.seen]  # ... the credentials not
    assert any(s.authorization == BASIC for s in reg.seen)  # the registry itself got them


def test_an_upload_location_on_localhost_is_another_origin_and_gets_no_credentials(servers, engine):
    """``localhost`` is not ``127.0.0.1`` (another origin, the same server): the upload goes there without
    Authorization; the server's 401 there is refused rather than answered with the registry's credentials."""
    store, image, refs = engine
    holder: dict[str, Origin] = {}
    reg = servers(registry(location=lambda: f"http://localhost:{holder['reg'].port}/v2/{REPO}/blobs/uploads/u2"))
    holder["reg"] = reg
    with client(reg.host) as r, pytest.raises(RegistryDenied, match="another origin") as info:
        push_image(store, r, parse_destination(f"{reg.host}/{REPO}"), image.digest, refs)
    assert info.value.field == "credentials"
    uploads = [s for s in reg.seen if s.path.endswith("/u2")]
    assert uploads and all(s.authorization is None for s in uploads)


# -- token realms ----------------------------------------------------------------------------------------------------
def test_a_token_realm_on_another_origin_gets_none_of_the_registrys_credentials(servers, engine):
    """The Bearer realm was fetched from any URL with the registry's Basic credentials. A realm on another origin
    is asked anonymously (or with that host's own credentials, below); the token it gives goes to the registry."""
    store, image, refs = engine
    tokens = servers(collector())
    reg = servers(registry(auth="bearer", realm=f"http://{tokens.host}/token"))
    with client(reg.host) as r:
        push_image(store, r, parse_destination(f"{reg.host}/{REPO}:t"), image.digest, refs)
    asked = [s for s in tokens.seen if s.path == "/token"]
    assert asked and tokens.authorized() == []
    assert all(s.authorization in (None, "Bearer t0k") for s in reg.seen)


def test_a_token_realm_on_another_host_gets_that_hosts_own_credentials(servers, engine):
    store, image, refs = engine
    tokens = servers(collector())
    reg = servers(registry(auth="bearer", realm=f"http://localhost:{tokens.port}/token"))
    auths = json.dumps({reg.host: {"username": "alice", "password": "registry-secret"},
                        f"localhost:{tokens.port}": {"username": "tok", "password": "token-service-secret"}})
    with Registry(reg.host, credentials=credentials_for(reg.host, auths=auths),
                  credentials_for_host=lambda h: credentials_for(h, auths=auths)) as r:
        push_image(store, r, parse_destination(f"{reg.host}/{REPO}"), image.digest, refs)
    sent = {s.authorization for s in tokens.seen}
    assert sent == {"Basic " + base64.b64encode(b"tok:token-service-secret").decode()}


def test_a_realm_on_the_registrys_own_origin_gets_its_credentials(servers, engine):
    store, image, refs = engine
    holder: dict[str, Origin] = {}

    def answer(method, path, query, authorization, body):
        if path == "/token":
            return Reply(200 if authorization == BASIC else 401, {}, b'{"token": "t0k"}')
        return registry(auth="bearer", realm=f"http://{holder['reg'].host}/token")(method, path, query,
                                                                                    authorization, body)

    holder["reg"] = reg = servers(answer)
    with client(reg.host) as r:
        push_image(store, r, parse_destination(f"{reg.host}/{REPO}"), image.digest, refs)
    assert [s.authorization for s in reg.seen if s.path == "/token"] == [BASIC]


# -- redirects -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("where", [("PUT", "/v2/m/e/manifests/"), ("HEAD", "/v2/m/e/blobs/"),
                                   ("POST", "/v2/m/e/blobs/uploads/")])
def test_redirects_are_not_followed(servers, engine, where):
    store, image, refs = engine
    other = servers(collector(200))
    reg = servers(registry(overrides={where: Reply(307, {"Location": f"http://{other.host}/elsewhere"})}))
    with client(reg.host) as r:
        if where[0] == "HEAD":  # a blob HEAD answered with a redirect: the blob is there (not followed to see)
            push_image(store, r, parse_destination(f"{reg.host}/{REPO}"), image.digest, refs)
        else:
            with pytest.raises(RegistryDenied, match="307"):
                push_image(store, r, parse_destination(f"{reg.host}/{REPO}"), image.digest, refs)
    assert other.seen == []


# -- https → http ----------------------------------------------------------------------------------------------------
def test_a_downgrade_from_https_to_plain_http_is_refused():
    """An https registry naming an http upload Location or token realm: refused, nothing sent there."""
    sent: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        if request.url.path == "/v2/m/e/blobs/uploads/":
            return httpx.Response(202, headers={"Location": "http://reg.test/v2/m/e/blobs/uploads/u1"})
        return httpx.Response(404)

    r = Registry("reg.test", credentials=Credentials("alice", "registry-secret"),
                 client=httpx.Client(transport=httpx.MockTransport(answer)))
    with pytest.raises(RegistryDenied, match="plain http") as info:
        r.upload_blob(REPO, "sha256:" + "0" * 64, 1, lambda: iter([b"x"]))
    assert "https" in info.value.message and [q.url.scheme for q in sent] == ["https"]

    sent.clear()

    def challenge(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(401, headers={"WWW-Authenticate": 'Bearer realm="http://reg.test/token"'})

    r = Registry("reg.test", credentials=Credentials("alice", "registry-secret"),
                 client=httpx.Client(transport=httpx.MockTransport(challenge)))
    with pytest.raises(RegistryDenied, match="plain http"):
        r.has_blob(REPO, "sha256:" + "0" * 64)
    assert [str(q.url) for q in sent] == [f"https://reg.test/v2/{REPO}/blobs/sha256:{'0' * 64}"]


# -- credentials per host --------------------------------------------------------------------------------------------
def test_configured_credentials_go_to_their_host_only(servers, engine, tmp_path):
    """``KILN_REGISTRY_USERNAME``/``_PASSWORD`` went to every destination host. ``KILN_REGISTRY_AUTHS`` names the
    host: another registry gets none (and a push there that needs them is refused, naming the host)."""
    store, image, refs = engine
    other = servers(registry())
    auths = json.dumps({"registry.example.com": {"username": "alice", "password": "registry-secret"}})
    config = tmp_path / "absent.json"
    assert credentials_for(other.host, auths=auths, docker_config=config) is None
    with Registry(other.host, credentials=credentials_for(other.host, auths=auths, docker_config=config)) as r, \
            pytest.raises(RegistryDenied, match="none are configured"):
        push_image(store, r, parse_destination(f"{other.host}/{REPO}"), image.digest, refs)
    assert other.authorized() == []
    got = credentials_for("Registry.Example.com.:443", auths=auths, docker_config=config)
    assert got is not None and (got.username, got.source) == ("alice", "KILN_REGISTRY_AUTHS")
    assert credentials_for("registry.example.com:5000", auths=auths, docker_config=config) is None
    for bad in ("[1, 2]", "not json", '{"h": "user:pw"}', '{"h": {"auth": "bm90IGJhc2U2NA"}}'):
        with pytest.raises(InvalidRequest) as info:
            credentials_for("h", auths=bad, docker_config=config)
        assert info.value.field == "KILN_REGISTRY_AUTHS" and "pw" not in info.value.message


def test_unscoped_registry_credentials_are_refused_when_settings_are_read(monkeypatch):
    from kiln.errors import SettingsInvalid
    from kiln.settings import Settings

    monkeypatch.setenv("KILN_REGISTRY_USERNAME", "ci")
    monkeypatch.setenv("KILN_REGISTRY_PASSWORD", "tok")
    with pytest.raises(SettingsInvalid) as info:
        Settings()
    assert info.value.field == "KILN_REGISTRY_USERNAME" and "KILN_REGISTRY_AUTHS" in info.value.fix
    assert "tok" not in str(info.value)


# -- bounded replies -------------------------------------------------------------------------------------------------
def _read_at_most(server: Origin, limit: int) -> None:
    assert server.sent <= limit + SOCKET_SLACK + (1 << 20), f"the client read {server.sent} bytes"


def test_an_endless_token_answer_is_refused_within_its_bound(servers, engine):
    store, image, refs = engine
    tokens = servers(lambda *a: Reply(200, {"Content-Type": "application/json"}, endless()))
    reg = servers(registry(auth="bearer", realm=f"http://{tokens.host}/token"))
    with client(reg.host) as r, pytest.raises(RegistryDenied, match="more than"):
        push_image(store, r, parse_destination(f"{reg.host}/{REPO}"), image.digest, refs)
    _read_at_most(tokens, TOKEN_LIMIT)


def test_an_endless_referrers_index_is_refused_within_its_bound(servers, engine):
    store, image, refs = engine
    reg = servers(registry(overrides={("GET", f"/v2/{REPO}/referrers/"): Reply(200, {}, endless())}))
    with client(reg.host) as r, pytest.raises(RegistryDenied, match="more than"):
        push_image(store, r, parse_destination(f"{reg.host}/{REPO}"), image.digest, refs)
    _read_at_most(reg, MANIFEST_LIMIT)


def test_an_endless_error_body_is_cut_and_quoted(servers, engine):
    store, image, refs = engine
    reg = servers(registry(overrides={("PUT", f"/v2/{REPO}/manifests/"): Reply(400, {}, endless())}))
    with client(reg.host) as r, pytest.raises(RegistryDenied, match="answered 400 to PUT") as info:
        push_image(store, r, parse_destination(f"{reg.host}/{REPO}"), image.digest, refs)
    assert len(info.value.message) < 1000
    _read_at_most(reg, ERROR_BODY_LIMIT)

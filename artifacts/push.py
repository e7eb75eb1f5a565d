"""Pushing an engine image, with its referrers, from Kiln's blob store to a standard OCI registry
(distribution-spec v1.1), so that a cluster pulls engines from the registry it already uses.

Order, so that the target never names a missing blob and a tag never points at an engine without its referrers:
the image's blobs (config, layers), its manifest by digest, each referrer's blobs and manifest (``subject``: the
engine), the referrers tag schema's index where the registry has no referrers API, and the tag last.

* **Blobs**: ``HEAD`` first (one the registry has is not sent again), then a monolithic upload (``POST``, then one
  ``PUT ?digest=`` streaming the bytes with their ``Content-Length``). Every blob is hashed as it is read from the
  store; the last chunk is held back until the hash is checked, so a corrupted blob raises
  :class:`~kiln.errors.DigestMismatch` before the registry has the whole of it (the upload is aborted, nothing is
  committed there).
* **Manifests** are sent as the exact bytes stored (so their digests are Kiln's), by digest, with their
  ``mediaType`` as ``Content-Type``; the registry's ``Docker-Content-Digest`` is checked.
* **Referrers**: a registry that answers ``GET /v2/<name>/referrers/<digest>`` with ``200`` (or that answers a
  referrer's push with ``OCI-Subject``) lists them itself. One that answers ``404`` (CNCF distribution 2.8, Docker
  Hub before 1.1) gets the spec's *referrers tag schema*: an image index tagged ``sha256-<hex of the subject>``
  listing them, read first and merged, so referrers pushed by others are kept.
* **Auth**: anonymous, then on a ``401`` its ``WWW-Authenticate`` challenge: ``Basic`` (the credentials), or
  ``Bearer realm=…,service=…,scope=…`` (a token fetched from the realm, with the credentials as Basic auth when
  there are any). Credentials are chosen per registry host (:func:`credentials_for`): the host's entry in
  ``KILN_REGISTRY_AUTHS`` (JSON, the docker config's ``auths`` shape), else in the docker config
  (``$DOCKER_CONFIG/config.json``, default ``~/.docker``).
* **Credentials stay with their origin**: an ``Authorization`` header (Basic, or the Bearer token) goes only to the
  registry's own origin (scheme, host, port). An upload ``Location`` on another origin gets the bytes without it
  (and a ``401`` from there is refused); redirects are not followed; a token realm on another host gets that
  host's own credentials, if any are configured, never the registry's. A ``Location`` or realm that turns https
  into plain http is refused (:class:`~kiln.errors.RegistryDenied`).
* **Replies are read bounded**, as they arrive: manifests and referrer indexes 4 MiB, token answers 1 MiB, any other
  body (errors, bodies not used) is read to 64 KiB and the rest left unread.
* **Transport**: https, except for ``localhost``/``127.0.0.1``/``::1`` or with ``insecure=True``: plain http.
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urljoin, urlsplit, urlunsplit

import httpx

from artifacts.interfaces import BlobStore
from artifacts.oci import MEDIA_TYPE_IMAGE_INDEX, MEDIA_TYPE_IMAGE_MANIFEST
from kiln.digests import canonical_json, parse_digest, sha256_bytes
from kiln.errors import DigestMismatch, InvalidRequest, NameInvalid, RegistryDenied, RegistryUnavailable

LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
REPOSITORY_RE = re.compile(rf"{_COMPONENT}(?:/{_COMPONENT})*")  # the distribution-spec's <name>
TAG_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
_HOST_RE = re.compile(r"(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?)(?::[0-9]{1,5})?")
DEST_FIX = "write host[:port]/repository[:tag], e.g. registry.example.com/models/llama or localhost:5000/llama:fp8"
AUTHS_SETTING = "KILN_REGISTRY_AUTHS"
CREDENTIALS_FIX = ("run `docker login {host}`, or set KILN_REGISTRY_AUTHS to "
                   "'{{\"{host}\": {{\"username\": \"…\", \"password\": \"…\"}}}}'")
MANIFEST_ACCEPT = ", ".join((MEDIA_TYPE_IMAGE_MANIFEST, MEDIA_TYPE_IMAGE_INDEX))
MANIFEST_LIMIT = 4 << 20  # the distribution-spec lets registries refuse manifests over 4 MiB; so do we
TOKEN_LIMIT = 1 << 20  # a token service's JSON answer (JWTs are kilobytes)
ERROR_BODY_LIMIT = 64 << 10  # an error body is read only to quote it; a body Kiln does not use, no further
_CHUNK = 64 << 10


# -- where to ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Destination:
    """``host[:port]/repository[:tag]``: where an engine is pushed."""

    host: str
    repository: str
    tag: str | None = None

    def __str__(self) -> str:
        return f"{self.host}/{self.repository}" + (f":{self.tag}" if self.tag else "")

    @property
    def hostname(self) -> str:
        return urlsplit(f"//{self.host}").hostname or self.host


def parse_destination(text: str, *, field: str = "dest") -> Destination:
    """``host[:port]/repository[:tag]`` → :class:`Destination`; :class:`NameInvalid` naming ``field`` otherwise.
    The host is required (no default registry: an engine is never pushed somewhere not named); a digest is not
    taken (the digest pushed is the engine's own)."""
    text = text.strip()
    if "://" in text:
        raise NameInvalid(f"{text!r} has a scheme; the destination is a reference, not a URL", field=field,
                          fix=DEST_FIX + " (plain http: --insecure)")
    if "@" in text:
        raise NameInvalid(f"{text!r} names a digest; the engine's digest is the one pushed", field=field,
                          fix=DEST_FIX)
    host, sep, rest = text.partition("/")
    if not sep or not rest or not _HOST_RE.fullmatch(host) or not (
            "." in host or ":" in host or host == "localhost"):
        raise NameInvalid(f"{text!r} does not start with a registry host", field=field, fix=DEST_FIX)
    repository, tag = rest, None
    head, colon, tail = rest.rpartition(":")
    if colon and "/" not in tail:
        repository, tag = head, tail
        if not TAG_RE.fullmatch(tag):
            raise NameInvalid(f"{tag!r} is not a tag (letters, digits, '_', '.', '-'; at most 128)", field=field,
                              fix=DEST_FIX)
    if not REPOSITORY_RE.fullmatch(repository) or len(repository) > 255:
        raise NameInvalid(f"{repository!r} is not a repository name (lowercase components separated by '/')",
                          field=field, fix=DEST_FIX)
    return Destination(host, repository, tag)


REFERENCE_FIX = "write host[:port]/repository@sha256:<64 hex>, as `kiln push` prints it"


def is_registry_reference(text: str) -> bool:
    """Whether ``text`` names a registry host before its repository (``host[:port]/…``): a first component with a
    ``.`` or a ``:``, or ``localhost`` (the rule container runtimes use); ``acme/tiny@sha256:…`` is a Kiln name."""
    first, slash, _ = text.strip().partition("/")
    return bool(slash) and ("." in first or ":" in first or first == "localhost")


def parse_reference(text: str, *, field: str = "ref") -> tuple[Destination, str]:
    """``host[:port]/repository@sha256:<hex>`` → (where, digest); :class:`NameInvalid` naming ``field`` otherwise.
    A pull from a registry is by digest only (a tag before the digest is dropped: the digest pins the engine)."""
    name, at, digest = text.strip().rpartition("@")
    if not at:
        raise NameInvalid(f"{text.strip()!r} names no digest: an engine is pulled from a registry by digest",
                          field=field, fix=REFERENCE_FIX)
    target = parse_destination(name, field=field)
    return Destination(target.host, target.repository), parse_digest(digest, field=field)


def registry_host(host: str) -> str:
    """One spelling per registry host, as a container runtime reaches it: lower case, no trailing dot on the
    name, the port as a number (``:0443`` is ``:443``) and no ``:443`` (HTTPS's default port:
    ``kiln.example.com:443`` is ``kiln.example.com``)."""
    host = host.strip().lower()
    name, colon, port = host.rpartition(":")
    if not colon or not port.isascii() or not port.isdigit() or (name.startswith("[") != name.endswith("]")):
        name, port = host, ""  # no port (an IPv6 address without brackets has colons of its own)
    name = name.rstrip(".")
    number = int(port) if port else 443
    return name if number == 443 else f"{name}:{number}"


def is_local(hostname: str) -> bool:
    if hostname in LOCAL_HOSTS:
        return True
    try:
        return ipaddress.ip_address(hostname).is_loopback
    except ValueError:
        return False


# -- credentials -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Credentials:
    username: str
    password: str = field(repr=False)
    source: str = ""  # where they came from, for messages (never the secret)

    def basic(self) -> str:
        return "Basic " + base64.b64encode(f"{self.username}:{self.password}".encode()).decode()


def docker_config_path() -> Path:
    return Path(os.environ.get("DOCKER_CONFIG") or Path("~/.docker").expanduser()) / "config.json"


def _auth_key_host(key: str) -> str:
    """An ``auths`` key (``host``, ``https://host``, ``https://host/v1/``) → ``host[:port]`` in
    :func:`registry_host`'s spelling."""
    if "://" in key:
        key = urlsplit(key).netloc
    return registry_host(key.split("/", 1)[0])


def _entry_credentials(entry: Any, host: str, source: str, field: str) -> Credentials | None:
    """One ``auths`` entry: ``auth`` (base64 ``user:password``), or ``username`` and ``password``."""
    if not isinstance(entry, dict):
        return None
    if isinstance(entry.get("auth"), str) and entry["auth"]:
        try:
            user, sep, secret = base64.b64decode(entry["auth"], validate=True).decode().partition(":")
        except (ValueError, UnicodeDecodeError):
            sep = ""
        if not sep:
            raise InvalidRequest(f"{source} has an 'auth' for {host} that is not base64 user:password", field=field,
                                 fix=CREDENTIALS_FIX.format(host=host))
        return Credentials(user, secret, source)
    if entry.get("username") and entry.get("password"):
        return Credentials(str(entry["username"]), str(entry["password"]), source)
    return None


def _lookup(auths: Any, host: str, source: str, field: str) -> Credentials | None:
    want = registry_host(host)
    for key, entry in auths.items() if isinstance(auths, dict) else ():
        if isinstance(key, str) and _auth_key_host(key) == want:
            found = _entry_credentials(entry, host, source, field)
            if found is not None:
                return found
    return None


def parse_auths(text: str | None) -> dict[str, Any]:
    """``KILN_REGISTRY_AUTHS``: a JSON object in the docker config's ``auths`` shape, ``{"host[:port]": {"username":
    …, "password": …} | {"auth": base64 user:password}}``; :class:`InvalidRequest` naming the setting otherwise
    (the message never quotes it: it holds secrets)."""
    if not text or not text.strip():
        return {}
    try:
        auths = json.loads(text)
    except ValueError:
        auths = None
    if not isinstance(auths, dict) or not all(isinstance(v, dict) for v in auths.values()):
        raise InvalidRequest(f"{AUTHS_SETTING} is not a JSON object of host → {{username, password}} or {{auth}}",
                             field=AUTHS_SETTING,
                             fix='write {"registry.example.com": {"username": "…", "password": "…"}}')
    return auths


def credentials_for(host: str, *, auths: str | None = None, docker_config: Path | None = None) -> Credentials | None:
    """The credentials for registry ``host`` (``host[:port]``, compared in :func:`registry_host`'s spelling) and for
    no other: its entry in ``auths`` (``KILN_REGISTRY_AUTHS``, :func:`parse_auths`), else the docker config's
    ``auths`` entry for it (``auth``: base64 ``user:password``, or ``username`` and ``password``), else None
    (anonymous). Credential helpers (``credsStore``, ``credHelpers``) and ``identitytoken`` entries are not read."""
    found = _lookup(parse_auths(auths), host, AUTHS_SETTING, AUTHS_SETTING)
    if found is not None:
        return found
    path = docker_config or docker_config_path()
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise InvalidRequest(f"the docker config {path} is unreadable ({type(exc).__name__})", field="docker_config",
                             fix=f"fix or remove it, or set {AUTHS_SETTING}") from None
    return _lookup(config.get("auths") if isinstance(config, dict) else None, host, str(path), "docker_config")


def open_registry(host: str, *, insecure: bool = False, auths: str | None = None,
                  client: httpx.Client | None = None) -> Registry:
    """A :class:`Registry` client for ``host`` with its own credentials (:func:`credentials_for`), and for a token
    realm on another host that host's own: the one place pushes and pulls choose what is sent where."""
    return Registry(host, insecure=insecure, credentials=credentials_for(host, auths=auths),
                    credentials_for_host=lambda other: credentials_for(other, auths=auths), client=client)


# -- the client --------------------------------------------------------------------------------------------------
def _challenge(header: str) -> tuple[str, dict[str, str]]:
    """``Bearer realm="…",service="…",scope="…"`` → ``("bearer", {realm, service, scope})``."""
    scheme, _, rest = header.strip().partition(" ")
    params = {k.lower(): v for k, v in re.findall(r'([A-Za-z_]+)\s*=\s*"([^"]*)"', rest)}
    params.update({k.lower(): v for k, v in re.findall(r'([A-Za-z_]+)\s*=\s*([^",\s]+)', rest)
                   if k.lower() not in params})
    return scheme.lower(), params


Body = bytes | Callable[[], Iterator[bytes]] | None


def origin(url: str) -> tuple[str, str, int]:
    """(scheme, host, port) of an absolute URL: what the same-origin rule compares (a host without case or a
    trailing dot, the scheme's default port filled in)."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    try:
        port = parts.port
    except ValueError:
        port = None
    return scheme, (parts.hostname or "").rstrip(".").lower(), port or (443 if scheme == "https" else 80)


def _shown(url: str) -> str:
    """A URL for a message: scheme, host and path only (an upload URL's query may hold the registry's state)."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, parts.path, "", ""))


def _read_bounded(resp: httpx.Response, limit: int) -> tuple[bytes, bool]:
    """Up to ``limit`` bytes of a streamed response's body, and whether it had more (what is past the bound is
    never read). A content-encoded body is not decoded (one small gzip chunk can inflate to any size): it reads as
    empty and over the bound."""
    if resp.headers.get("content-encoding", "identity").strip().lower() not in ("", "identity"):
        return b"", True
    parts, got = [], 0
    try:
        chunks: Iterator[bytes] = resp.iter_raw(_CHUNK)
        for chunk in chunks:
            parts.append(chunk)
            got += len(chunk)
            if got > limit:
                break
    except httpx.StreamConsumed:  # a response built in memory (an in-process transport): its bytes are all here
        parts, got = [resp.content], len(resp.content)
    data = b"".join(parts)
    return data[:limit], got > limit


class Registry:
    """An OCI distribution API client for one registry host, with its auth (see the module's doc).
    ``credentials`` are this host's; ``credentials_for_host`` (``host[:port]`` → credentials or None) gives those of
    another host, asked only for a token realm there."""

    def __init__(self, host: str, *, insecure: bool = False, credentials: Credentials | None = None,
                 credentials_for_host: Callable[[str], Credentials | None] | None = None,
                 client: httpx.Client | None = None, timeout: float = 300.0) -> None:
        self.host = host
        hostname = urlsplit(f"//{host}").hostname or host
        self.base = f"{'http' if insecure or is_local(hostname) else 'https'}://{host}"
        self.credentials = credentials
        self.credentials_for_host = credentials_for_host
        self.client = client or httpx.Client(timeout=httpx.Timeout(timeout, connect=30.0))
        self._authorization: str | None = None

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> Registry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- where requests go
    def _same_origin(self, url: str, what: str) -> bool:
        """Whether ``url`` is this registry's origin, so may carry its ``Authorization``. A scheme other than http(s),
        or plain http where the registry is spoken to over https, is refused."""
        scheme = urlsplit(url).scheme.lower()
        if scheme not in ("http", "https"):
            raise RegistryDenied(f"{self.host} named {what} at {_shown(url)!r}, not an http(s) URL", field="dest",
                                 fix="use a registry that implements the distribution API")
        if scheme == "http" and self.base.startswith("https://"):
            raise RegistryDenied(f"{self.host} sent {what} to plain http ({_shown(url)}) from https: refused (the "
                                 "bytes and any token would cross the network unencrypted)", field="dest",
                                 fix=f"configure {self.host} to name https URLs (its external URL or proxy headers)")
        return origin(url) == origin(self.base)

    def _send(self, method: str, url: str, headers: dict[str, str], content: Any, limit: int, *, whole: bool,
              what: str) -> httpx.Response:
        """One request, never following a redirect, its reply read bounded (:func:`_read_bounded`): a reply Kiln
        needs ``whole`` is refused past ``limit``; any other is cut there. The reply comes back read."""
        request = self.client.build_request(method, url, headers={"Accept-Encoding": "identity", **headers},
                                            content=content)
        resp = self.client.send(request, stream=True, follow_redirects=False)
        try:
            body, more = _read_bounded(resp, limit)
        finally:
            resp.close()
        if more and whole and 200 <= resp.status_code < 300:
            raise RegistryDenied(f"{self.host} answered {what} with more than {limit} bytes (or an encoded body): "
                                 "refused unread", field="dest", fix="use a registry that serves OCI manifests")
        return httpx.Response(resp.status_code, headers=resp.headers, content=body, request=request)

    # -- requests and auth
    def request(self, method: str, url: str, *, repository: str, headers: dict[str, str] | None = None,
                body: Body = None, ok: tuple[int, ...] = (200,), missing: tuple[int, ...] = (),
                limit: int = ERROR_BODY_LIMIT, whole: bool = False) -> httpx.Response:
        """One request, authenticated on a ``401`` and sent again once. A status in ``ok`` or ``missing`` is
        returned; any other is raised as the domain error it means. ``url``: a path on the registry, or an absolute
        URL it named (an upload ``Location``), which gets the registry's ``Authorization`` only on its origin.
        The reply is read to ``limit`` bytes (``whole``: refused past it)."""
        url = url if "://" in url else self.base + url
        own = self._same_origin(url, f"{method} {urlsplit(url).path}")
        for attempt in (1, 2):
            send = dict(headers or {})
            if self._authorization and own:
                send["Authorization"] = self._authorization
            content = body() if callable(body) else body
            try:
                resp = self._send(method, url, send, content, limit, whole=whole, what=f"{method} {urlsplit(url).path}")
            except httpx.TransportError as exc:
                https = url.startswith("https://")
                raise RegistryUnavailable(
                    f"cannot reach {self.host} ({type(exc).__name__}: {exc})", field="dest",
                    fix=("is it a plain-http registry? then pass --insecure" if https else
                         "check the host and port, and that the registry is running")) from None
            if resp.status_code == 401 and attempt == 1:
                if not own:
                    raise RegistryDenied(f"{self.host} sent {method} to another origin ({_shown(url)}), which asked "
                                         f"for credentials: {self.host}'s are sent to {self.host} only",
                                         field="credentials", fix=f"use a registry that keeps uploads on {self.host}")
                self._authenticate(resp, repository)
                continue
            if resp.status_code in ok or resp.status_code in missing:
                return resp
            raise self._error(method, url, resp)
        raise AssertionError("unreachable")

    def _authenticate(self, resp: httpx.Response, repository: str) -> None:
        scheme, params = _challenge(resp.headers.get("WWW-Authenticate", ""))
        creds = self.credentials
        if scheme == "basic":
            if creds is None:
                raise RegistryDenied(f"{self.host} asks for credentials and none are configured for it",
                                     field="credentials", fix=CREDENTIALS_FIX.format(host=self.host))
            self._authorization = creds.basic()
            return
        if scheme != "bearer" or not params.get("realm"):
            raise RegistryDenied(f"{self.host} answered 401 with a challenge Kiln does not speak "
                                 f"({resp.headers.get('WWW-Authenticate', 'none')!r})", field="credentials",
                                 fix=CREDENTIALS_FIX.format(host=self.host))
        realm = params["realm"]
        if not self._same_origin(realm, "its token service"):
            # another host's token service: that host's own credentials, never this registry's
            realm_host = urlsplit(realm).netloc.rpartition("@")[2]
            creds = self.credentials_for_host(realm_host) if self.credentials_for_host else None
        query = {"service": params.get("service", self.host),
                 "scope": params.get("scope") or f"repository:{repository}:pull,push"}
        headers = {"Authorization": creds.basic()} if creds else {}
        url = httpx.URL(realm).copy_merge_params({k: v for k, v in query.items() if v})
        try:
            token_resp = self._send("GET", str(url), headers, None, TOKEN_LIMIT, whole=True,
                                    what="a token request")
        except httpx.TransportError as exc:
            raise RegistryUnavailable(f"cannot reach {self.host}'s token service {_shown(realm)} "
                                      f"({type(exc).__name__})", field="dest", fix="check the network") from None
        if token_resp.status_code in (401, 403):
            raise RegistryDenied(f"{self.host}'s token service refused "
                                 + (f"the credentials from {creds.source}" if creds else "an anonymous token"),
                                 field="credentials", fix=CREDENTIALS_FIX.format(host=self.host))
        if token_resp.status_code != 200:
            raise self._error("GET", realm, token_resp)
        try:
            data = token_resp.json()
            token = data.get("token") or data.get("access_token")
        except (ValueError, AttributeError):
            token = None
        if not isinstance(token, str) or not token:
            raise RegistryDenied(f"{self.host}'s token service answered no token", field="credentials",
                                 fix=CREDENTIALS_FIX.format(host=self.host))
        self._authorization = f"Bearer {token}"

    def _error(self, method: str, url: str, resp: httpx.Response) -> Exception:
        path = urlsplit(url).path
        said = ""
        try:
            errors = json.loads(resp.content[:ERROR_BODY_LIMIT]).get("errors") or []
            said = "; ".join(f"{x.get('code')}: {x.get('message')}" for x in errors if isinstance(x, dict))[:500]
        except (ValueError, AttributeError):
            said = resp.content[:200].decode("utf-8", "replace").strip() if method != "HEAD" else ""
        what = f"{self.host} answered {resp.status_code} to {method} {path}" + (f" ({said})" if said else "")
        if resp.status_code >= 500 or resp.status_code == 429:
            return RegistryUnavailable(what, field="dest", fix="retry later; the push resumes (blobs it has are "
                                                               "not sent again)")
        if resp.status_code == 401:
            return RegistryDenied(what, field="credentials", fix=CREDENTIALS_FIX.format(host=self.host))
        if resp.status_code == 403:
            return RegistryDenied(what, field="credentials",
                                  fix=f"use credentials that may push to {self.host}")
        return RegistryDenied(what, field="dest", fix="check the repository name and that the registry takes "
                                                      "OCI image manifests")

    # -- the distribution API
    def has_blob(self, repository: str, digest: str) -> bool:
        resp = self.request("HEAD", f"/v2/{repository}/blobs/{digest}", repository=repository,
                            ok=(200, 307, 302), missing=(404,))
        return resp.status_code != 404

    def upload_blob(self, repository: str, digest: str, size: int, chunks: Callable[[], Iterator[bytes]]) -> None:
        start = self.request("POST", f"/v2/{repository}/blobs/uploads/", repository=repository, ok=(202,),
                             headers={"Content-Length": "0"})
        location = start.headers.get("Location")
        if not location:
            raise RegistryDenied(f"{self.host} started an upload without a Location", field="dest",
                                 fix="use a registry that implements the distribution API")
        parts = urlsplit(urljoin(self.base + "/", location))
        query = (parts.query + "&" if parts.query else "") + urlencode({"digest": digest})
        url = urlunsplit((parts.scheme, parts.netloc, parts.path, query, ""))
        self.request("PUT", url, repository=repository, body=chunks, ok=(201, 204),
                     headers={"Content-Type": "application/octet-stream", "Content-Length": str(size)})

    def get_manifest(self, repository: str, reference: str, accept: str = MANIFEST_ACCEPT) -> bytes | None:
        resp = self.request("GET", f"/v2/{repository}/manifests/{reference}", repository=repository,
                            headers={"Accept": accept}, missing=(404,), limit=MANIFEST_LIMIT, whole=True)
        return None if resp.status_code == 404 else resp.content

    def put_manifest(self, repository: str, reference: str, data: bytes, media_type: str) -> httpx.Response:
        resp = self.request("PUT", f"/v2/{repository}/manifests/{reference}", repository=repository, body=data,
                            headers={"Content-Type": media_type}, ok=(201, 200))
        said = resp.headers.get("Docker-Content-Digest")
        if said and said != sha256_bytes(data):
            raise DigestMismatch(f"{self.host} stored the manifest pushed as {sha256_bytes(data)} under {said}",
                                 field="dest", fix="use a registry that keeps manifests byte for byte")
        return resp

    def referrers(self, repository: str, digest: str) -> dict[str, Any] | None:
        """The referrers API's index for ``digest``, or None where the registry has no referrers API (``404``)."""
        resp = self.request("GET", f"/v2/{repository}/referrers/{digest}", repository=repository,
                            headers={"Accept": MEDIA_TYPE_IMAGE_INDEX}, missing=(404,), limit=MANIFEST_LIMIT,
                            whole=True)
        if resp.status_code == 404:
            return None
        try:
            index = resp.json()
        except ValueError:
            return None
        return index if isinstance(index, dict) and isinstance(index.get("manifests"), list) else None


class RegistryAuth(httpx.Auth):
    """A :class:`Registry`'s auth for another ``httpx.Client`` (a pull's, which streams blobs): its ``Authorization``
    (Basic, or a Bearer token fetched by :meth:`Registry._authenticate`) is sent only to the registry's own origin
    (httpx drops it on a redirect elsewhere); a ``401`` from there is answered once; a ``401`` after that, or a
    ``403``, is :class:`~kiln.errors.RegistryDenied` naming the credentials."""

    def __init__(self, registry: Registry, repository: str) -> None:
        self.registry = registry
        self.repository = repository

    def _own(self, url: httpx.URL) -> bool:
        return origin(str(url)) == origin(self.registry.base)

    def auth_flow(self, request: httpx.Request) -> Any:
        registry = self.registry
        own = self._own(request.url)
        if own and registry._authorization:
            request.headers["Authorization"] = registry._authorization
        response = yield request
        if not own or not self._own(response.request.url):
            return  # a redirect elsewhere (a blob's storage): no credentials went there, none are offered
        what = f"{request.method} {request.url.path}"
        if response.status_code == 401 and "Authorization" not in request.headers:
            registry._authenticate(response, self.repository)
            request.headers["Authorization"] = registry._authorization or ""
            response = yield request
        creds = registry.credentials
        if response.status_code == 401:
            raise RegistryDenied(f"{registry.host} refused " + (f"the credentials from {creds.source}" if creds else
                                                                 "an anonymous pull") + f" ({what})",
                                 field="credentials", fix=CREDENTIALS_FIX.format(host=registry.host))
        if response.status_code == 403:
            raise RegistryDenied(f"{registry.host} answered 403 to {what}: "
                                 + (f"the credentials from {creds.source} may not pull" if creds else
                                    "anonymous pulls are not allowed"),
                                 field="credentials", fix=f"use credentials that may pull from {registry.host}: "
                                                          + CREDENTIALS_FIX.format(host=registry.host))


# -- pushing -----------------------------------------------------------------------------------------------------
@dataclass
class PushResult:
    destination: Destination
    digest: str
    referrers: list[dict[str, Any]]  # the referrers' descriptors, as a referrers index lists them
    referrers_api: bool  # the registry lists them itself; False: the referrers tag schema's index was written
    blobs_sent: int = 0
    blobs_present: int = 0
    bytes_sent: int = 0

    @property
    def reference(self) -> str:
        return f"{self.destination.host}/{self.destination.repository}@{self.digest}"

    def to_dict(self) -> dict[str, Any]:
        return {"destination": str(self.destination), "reference": self.reference, "digest": self.digest,
                "tag": self.destination.tag, "referrers": self.referrers, "referrers_api": self.referrers_api,
                "referrers_tag": None if self.referrers_api or not self.referrers else fallback_tag(self.digest),
                "blobs_sent": self.blobs_sent, "blobs_present": self.blobs_present, "bytes_sent": self.bytes_sent}


def fallback_tag(digest: str) -> str:
    """The referrers tag schema's tag for ``digest``: ``sha256-<hex>``."""
    return parse_digest(digest).replace(":", "-")


def verified_chunks(store: BlobStore, digest: str, size: int) -> Callable[[], Iterator[bytes]]:
    """The blob's bytes from the store, hashed as they are read; the last chunk is yielded only once the whole
    blob is checked against ``digest`` and ``size`` (else :class:`DigestMismatch`, which aborts the upload)."""

    def chunks() -> Iterator[bytes]:
        hasher, seen, held = hashlib.sha256(), 0, None
        for chunk in store.open_range(digest):
            if not chunk:
                continue
            hasher.update(chunk)
            seen += len(chunk)
            if seen > size:
                raise DigestMismatch(f"blob {digest} in the store is over its descriptor's {size} bytes")
            if held is not None:
                yield held
            held = chunk
        if seen != size or "sha256:" + hasher.hexdigest() != digest:
            raise DigestMismatch(f"blob {digest} in the store is corrupted: {seen} bytes hashing to "
                                 f"sha256:{hasher.hexdigest()}", fix="run kiln fsck")
        if held is not None:
            yield held

    return chunks


def _manifest(store: BlobStore, digest: str) -> tuple[bytes, dict[str, Any]]:
    data = store.get_bytes(digest)  # verified
    manifest = json.loads(data)
    if not isinstance(manifest, dict) or manifest.get("mediaType", MEDIA_TYPE_IMAGE_MANIFEST) != \
            MEDIA_TYPE_IMAGE_MANIFEST:
        raise ValueError(f"{digest} is not an OCI image manifest")
    return data, manifest


def push_image(store: BlobStore, registry: Registry, dest: Destination, digest: str, referrers: list[str],
               *, on_step: Callable[[str], None] | None = None) -> PushResult:
    """Push the image ``digest`` and the referrer manifests ``referrers`` (whose ``subject`` must be it) from
    ``store`` to ``dest`` through ``registry`` (see the module's doc for the order and the referrers' paths)."""
    say = on_step or (lambda _text: None)
    repo = dest.repository
    result = PushResult(dest, parse_digest(digest), [], True)

    def push_blobs(manifest: dict[str, Any]) -> None:
        for desc in [manifest["config"], *manifest.get("layers", [])]:
            blob, size = parse_digest(desc["digest"]), int(desc["size"])
            if registry.has_blob(repo, blob):
                result.blobs_present += 1
                continue
            registry.upload_blob(repo, blob, size, verified_chunks(store, blob, size))
            result.blobs_sent += 1
            result.bytes_sent += size
            say(f"sent blob {blob} ({size} bytes)")

    data, manifest = _manifest(store, digest)
    push_blobs(manifest)
    registry.put_manifest(repo, digest, data, MEDIA_TYPE_IMAGE_MANIFEST)
    say(f"pushed manifest {digest}")
    subject_header = False
    for ref in referrers:
        ref_data, ref_manifest = _manifest(store, ref)
        if (ref_manifest.get("subject") or {}).get("digest") != digest:
            raise ValueError(f"referrer {ref} does not name {digest} as its subject")
        push_blobs(ref_manifest)
        resp = registry.put_manifest(repo, ref, ref_data, MEDIA_TYPE_IMAGE_MANIFEST)
        subject_header = subject_header or resp.headers.get("OCI-Subject") == digest
        desc: dict[str, Any] = {"mediaType": MEDIA_TYPE_IMAGE_MANIFEST, "digest": ref, "size": len(ref_data),
                                "artifactType": ref_manifest.get("artifactType") or ref_manifest["config"]["mediaType"]}
        if ref_manifest.get("annotations"):
            desc["annotations"] = ref_manifest["annotations"]
        result.referrers.append(desc)
        say(f"pushed referrer {ref} ({desc['artifactType']})")
    if result.referrers:
        result.referrers_api = subject_header or registry.referrers(repo, digest) is not None
        if not result.referrers_api:
            _update_fallback_index(registry, repo, digest, result.referrers)
            say(f"{dest.host} has no referrers API: listed them under the tag {fallback_tag(digest)}")
    if dest.tag:
        registry.put_manifest(repo, dest.tag, data, MEDIA_TYPE_IMAGE_MANIFEST)
        say(f"tagged {dest}")
    return result


def _update_fallback_index(registry: Registry, repo: str, digest: str, descriptors: list[dict[str, Any]]) -> None:
    """Merge ``descriptors`` into the referrers tag schema's index of ``digest`` (kept: what others listed)."""
    tag = fallback_tag(digest)
    existing = registry.get_manifest(repo, tag, MEDIA_TYPE_IMAGE_INDEX)
    manifests: list[dict[str, Any]] = []
    if existing is not None:
        try:
            index = json.loads(existing)
            manifests = [m for m in index.get("manifests", []) if isinstance(m, dict)]
        except (ValueError, AttributeError):
            manifests = []  # not an index: replaced, as the spec's clients do
    listed = {m.get("digest") for m in manifests}
    added = [d for d in descriptors if d["digest"] not in listed]
    if existing is not None and not added:
        return
    index = {"schemaVersion": 2, "mediaType": MEDIA_TYPE_IMAGE_INDEX, "manifests": manifests + added}
    registry.put_manifest(repo, tag, canonical_json(index), MEDIA_TYPE_IMAGE_INDEX)

"""/v2: the read side of the OCI Distribution API (distribution-spec v1.1), so that standard OCI clients (skopeo,
oras, crane, containerd) pull engines by digest and verify every byte themselves.

Served: ``GET /v2/``, ``GET|HEAD /v2/<name>/manifests/<tag|digest>``, ``GET|HEAD /v2/<name>/blobs/<digest>``
(with ``Range``), ``GET /v2/<name>/tags/list``, ``GET /v2/<name>/referrers/<digest>``, ``GET /v2/_catalog``.
Pushing is not: every write method under ``/v2`` answers ``405 UNSUPPORTED``.

What may be served is decided by the index rows, never by the store alone:

* a manifest by digest is an engine (``artifacts`` row) or a referrer (``referrers`` row) *of that repository*;
* a tag comes from the ``tags`` table;
* an engine whose status is ``rejected`` (and everything attached to it) is never served; a ``revoked`` engine's
  manifest is refused (``403 DENIED`` with the reason) unless an admin asks for it with ``?allow=revoked``;
  ``stale`` engines stay pullable by digest (pinned rollbacks), never by tag; every engine manifest response
  says its status in the ``Kiln-Engine-Status`` header;
* a blob is served only when a servable manifest of that repository names it (config, layer, or the manifest
  itself); one that only a revoked engine names is refused like that engine's manifest (``403 DENIED``). Manifests are immutable, so what each one names is cached per process (an LRU keyed by store and
  manifest digest).

Errors are domain errors (``kiln/errors.py``), answered by the one error table (``api/errors.py``) with the spec's
body, ``{"errors": [{"code", "message", "detail"}]}``, and its codes; only here: the rest of the API keeps its
``{"error": {...}}`` shape.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from sqlalchemy import or_, select, true, union, union_all
from sqlalchemy.orm import Session

from api.errors import API_VERSION_HEADER, error_response
from artifacts.interfaces import BlobStore
from artifacts.oci import MEDIA_TYPE_IMAGE_INDEX, MEDIA_TYPE_IMAGE_MANIFEST
from kiln.digests import DIGEST_RE
from kiln import errors as e
from kiln.tables import Artifact, EngineName, Referrer, Tag
from kiln.states import named_in

REDIRECT_BLOBS = False
"""When True, ``GET`` of a blob answers ``307`` to the store's presigned URL where it has one (S3), so that
bytes flow from the store rather than through the API. Off: every byte goes through this process."""
REDIRECT_EXPIRES_S = 300

STATUS_HEADER = "Kiln-Engine-Status"
MAX_PAGE = 1000
"""The most entries one page of ``tags/list`` or ``_catalog`` holds; a larger ``n`` is answered with this many
and a ``Link`` to the next page, as the spec allows."""

# distribution-spec: <name> and <reference> (tag) grammars
NAME_RE = re.compile(r"[a-z0-9]+(?:(?:\.|_|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:\.|_|__|-+)[a-z0-9]+)*)*")
TAG_RE = re.compile(r"[a-zA-Z0-9_][a-zA-Z0-9._-]{0,127}")
NAME_MAX = 255
RANGE_RE = re.compile(r"bytes=(\d{0,20})-(\d{0,20})")  # longer numbers: no range this server serves (ignored)


class OCIRoute(APIRoute):
    """Answers every error of the /v2 routes in the spec's format and stamps the API version header."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                response = await handler(request)
            except e.KilnError as exc:
                return error_response(exc, request)
            response.headers.update(API_VERSION_HEADER)
            return response

        return route


router = APIRouter(prefix="/v2", tags=["oci"], route_class=OCIRoute)


# -- checks ----------------------------------------------------------------------------------------------------
def _check_name(name: str) -> str:
    if len(name) > NAME_MAX or not NAME_RE.fullmatch(name):
        raise e.NameInvalid(f"invalid repository name {name!r}", field="name",
                            detail={"name": name, "rule": f"{NAME_RE.pattern}, at most {NAME_MAX} characters"})
    return name


def _check_digest(value: str) -> str:
    if not DIGEST_RE.fullmatch(value):
        raise e.InvalidDigest(f"{value!r} is not a digest this registry serves", field="digest",
                              fix="use the form sha256:<64 lowercase hex digits>",
                              detail={"digest": value, "fix": "use the form sha256:<64 lowercase hex digits>"})
    return value


def _page_size(request: Request) -> int | None:
    raw = request.query_params.get("n")
    if raw is None or raw == "":
        return None
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 12:
        raise e.InvalidPageSize(f"n={raw!r} is not a non-negative integer", field="n", detail={"n": raw})
    return min(int(raw), MAX_PAGE)


def _paginate(request: Request, names: list[str], path: str, key: str, extra: dict | None = None) -> Response:
    """One page of ``names`` (sorted, after ``last``, at most ``n``) with a ``Link`` to the next one."""
    n, last = _page_size(request), request.query_params.get("last")
    names = sorted(set(names))
    if last is not None:
        names = [x for x in names if x > last]
    headers = {}
    if n is not None and len(names) > n:
        names = names[:n]
        if names:
            headers["Link"] = f'<{path}?n={n}&last={quote(names[-1], safe="")}>; rel="next"'
    return JSONResponse({**(extra or {}), key: names}, headers=headers)


# -- the index: what may be served -----------------------------------------------------------------------------
def _sessions(request: Request):
    return request.app.state.sessions


def _store(request: Request) -> BlobStore:
    return request.app.state.store


def _named(name: str):
    """The digests of the engines ``name`` names: those it published and those named in it (EngineName)."""
    return union_all(select(Artifact.digest).where(Artifact.repository == name),
                     select(EngineName.digest).where(EngineName.repository == name))


def _repository_known(session: Session, name: str) -> bool:
    """A repository exists for /v2 when it names at least one engine that may be served."""
    q = select(Artifact.digest).where(Artifact.digest.in_(_named(name)), Artifact.status != "rejected").limit(1)
    return session.scalar(q) is not None


def _unknown_name(name: str) -> e.NameUnknown:
    return e.NameUnknown(f"repository {name!r} is not known to this registry", field="name", detail={"name": name})


def _rejected(digest: str, subject: str | None = None) -> e.ManifestUnknown:
    if subject is None:
        message = f"engine {digest} was rejected (it failed validation) and is never served"
    else:
        message = f"{digest} is attached to engine {subject}, which was rejected (it failed validation): never served"
    return e.ManifestUnknown(message, detail={"digest": digest, "status": "rejected",
                                              **({"subject": subject} if subject else {})})


@dataclass(frozen=True)
class _Found:
    digest: str
    status: str | None  # the engine's status; None for a referrer
    reason: str | None = None


def _manifest_by_digest(session: Session, name: str, digest: str) -> _Found:
    art = session.get(Artifact, digest)
    if art is not None and named_in(session, art, name):
        if art.status == "rejected":
            raise _rejected(digest)
        return _Found(digest, art.status, art.status_reason)
    ref = session.get(Referrer, digest)
    subject = session.get(Artifact, ref.subject) if ref is not None else None
    if ref is not None and (ref.repository == name or (subject is not None and named_in(session, subject, name))):
        if subject is not None and subject.status == "rejected":
            raise _rejected(digest, ref.subject)
        return _Found(digest, None)
    if not _repository_known(session, name):
        raise _unknown_name(name)
    raise e.ManifestUnknown(f"no manifest {digest} in repository {name!r}", detail={"name": name, "digest": digest})


def _manifest_by_tag(session: Session, name: str, tag_name: str) -> _Found:
    if not TAG_RE.fullmatch(tag_name):
        # no manifest can have this name (distribution-spec error codes only: there is no TAG_INVALID)
        raise e.ManifestUnknown(f"{tag_name!r} is neither a tag nor a digest",
                                detail={"reference": tag_name, "rule": TAG_RE.pattern})
    tag = session.get(Tag, (name, tag_name))
    art = session.get(Artifact, tag.digest) if tag is not None else None
    if art is None or not named_in(session, art, name):
        if not _repository_known(session, name):
            raise _unknown_name(name)
        raise e.ManifestUnknown(f"no tag {tag_name!r} in repository {name!r}", detail={"name": name, "tag": tag_name})
    if art.status == "rejected":
        raise _rejected(art.digest)
    if art.status == "stale":  # a tag never serves a stale engine (pinned rollbacks pull it by digest)
        raise e.ManifestUnknown(f"tag {tag_name!r} of {name!r} names no fresh engine",
                                detail={"name": name, "tag": tag_name})
    return _Found(art.digest, art.status, art.status_reason)  # a revoked one is DENIED by the caller


def _servable_manifests(session: Session, name: str) -> tuple[list[str], dict[str, str | None]]:
    """Digests of the manifests of ``name`` whose blobs may be served — engines neither rejected nor revoked,
    the referrers of engines not rejected — and the revoked engines (digest → reason), whose blobs are
    refused as their manifests are."""
    named = _named(name)
    engines = session.execute(select(Artifact.digest, Artifact.status, Artifact.status_reason)
                              .where(Artifact.digest.in_(named), Artifact.status != "rejected")).all()
    q = (select(Referrer.digest).outerjoin(Artifact, Artifact.digest == Referrer.subject)
         .where(or_(Referrer.repository == name, Referrer.subject.in_(named)),
                or_(Artifact.status.is_(None), Artifact.status != "rejected")))
    revoked = {a.digest: a.status_reason for a in engines if a.status == "revoked"}
    return [a.digest for a in engines if a.status != "revoked"] + list(session.scalars(q)), revoked


def _revoked(digest: str, reason: str | None) -> e.EngineRevoked:
    fix = f"pull a fresh engine; an admin may fetch it with ?{REVOKED_QUERY}"
    return e.EngineRevoked(f"engine {digest} was revoked: {reason or 'no reason recorded'}", fix=fix,
                           detail={"digest": digest, "status": "revoked", "reason": reason, "fix": fix})


# -- manifests, cached ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Manifest:
    data: bytes
    media_type: str
    names: frozenset[str]  # the digests it names (config, layers) and its own


class _ManifestCache:
    """A thread-safe LRU of stored manifests keyed by (store URL, digest): a manifest never changes."""

    def __init__(self, maxsize: int = 1024):
        self.maxsize = maxsize
        self._items: OrderedDict[tuple[str, str], _Manifest] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, store: BlobStore, digest: str) -> _Manifest:
        key = (store.url, digest)
        with self._lock:
            if (hit := self._items.get(key)) is not None:
                self._items.move_to_end(key)
                return hit
        item = _load_manifest(store, digest)  # outside the lock: a store read may be slow
        with self._lock:
            self._items[key] = item
            self._items.move_to_end(key)
            while len(self._items) > self.maxsize:
                self._items.popitem(last=False)
        return item

    def clear(self) -> None:
        with self._lock:
            self._items.clear()


MANIFESTS = _ManifestCache()


def _load_manifest(store: BlobStore, digest: str) -> _Manifest:
    data = store.get_bytes(digest)  # verified against its digest
    try:
        manifest = json.loads(data)
    except ValueError:
        manifest = None
    if not isinstance(manifest, dict):
        raise e.ManifestCorrupt(f"{digest} is indexed as a manifest but is not JSON", detail={"digest": digest})
    names = {digest}
    for desc in [manifest.get("config") or {}, *manifest.get("layers", []), *manifest.get("blobs", [])]:
        if isinstance(desc, dict) and isinstance(desc.get("digest"), str):
            names.add(desc["digest"])
    return _Manifest(data, manifest.get("mediaType") or MEDIA_TYPE_IMAGE_MANIFEST, frozenset(names))


# -- routes ------------------------------------------------------------------------------------------------------
@router.api_route("/", methods=["GET", "HEAD"], summary="API version check")
def base() -> Response:
    """``200 {}``: this server speaks the distribution API (no authentication)."""
    return JSONResponse({})


@router.get("/_catalog", summary="Repositories")
def catalog(request: Request) -> Response:
    """Repositories that hold at least one servable engine, sorted, paginated with ``n`` and ``last``."""
    with _sessions(request)() as s:
        servable = Artifact.status != "rejected"
        names = list(s.scalars(union(select(Artifact.repository).where(servable),
                                     select(EngineName.repository).join(Artifact, Artifact.digest == EngineName.digest)
                                     .where(servable))))
    return _paginate(request, names, "/v2/_catalog", "repositories")


@router.api_route("/{name:path}/manifests/{reference}", methods=["GET", "HEAD"], summary="Manifest by tag or digest")
def manifest(name: str, reference: str, request: Request) -> Response:
    """The manifest bytes exactly as stored, ``Content-Type`` its ``mediaType``, ``Docker-Content-Digest`` its
    digest; engine manifests carry ``Kiln-Engine-Status`` (fresh, stale or revoked)."""
    _check_name(name)
    with _sessions(request)() as s:
        if ":" in reference:
            found = _manifest_by_digest(s, name, _check_digest(reference))
        else:
            found = _manifest_by_tag(s, name, reference)
    if found.status == "revoked" and not _admin_asks_for_revoked(request):
        raise _revoked(found.digest, found.reason)
    item = MANIFESTS.get(_store(request), found.digest)
    headers = {"Docker-Content-Digest": found.digest, "ETag": f'"{found.digest}"',
               "Content-Length": str(len(item.data))}
    if found.status is not None:
        headers[STATUS_HEADER] = found.status
    if request.method == "HEAD":
        return Response(status_code=200, headers=headers, media_type=item.media_type)
    return Response(item.data, headers=headers, media_type=item.media_type)


REVOKED_QUERY = "allow=revoked"


def _admin_asks_for_revoked(request: Request) -> bool:
    """A revoked engine is known bad: served only to an admin who asks for it by name (``?allow=revoked``)."""
    return request.query_params.get("allow") == "revoked" and "admin" in getattr(request.state, "scopes", set())


def _parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """``(first, last)`` inclusive for one ``bytes=`` range; None to serve the whole blob (no header, or one this
    server ignores: another unit, several ranges). Raises ``416`` when the range cannot be satisfied."""
    if not header:
        return None
    m = RANGE_RE.fullmatch(header.strip().replace(" ", ""))
    if m is None or (m.group(1) == "" and m.group(2) == ""):
        return None
    unsatisfiable = e.RangeNotSatisfiable(f"range {header!r} cannot be satisfied for a blob of {size} bytes",
                                          field="Range", detail={"range": header, "size": size},
                                          headers={"Content-Range": f"bytes */{size}"})
    if m.group(1) == "":  # suffix: the last N bytes
        n = int(m.group(2))
        if n == 0 or size == 0:
            raise unsatisfiable
        return max(0, size - n), size - 1
    first = int(m.group(1))
    last = int(m.group(2)) if m.group(2) else size - 1
    if first >= size or last < first:
        raise unsatisfiable
    return first, min(last, size - 1)


@router.api_route("/{name:path}/blobs/{digest}", methods=["GET", "HEAD"], summary="Blob, with Range")
def blob(name: str, digest: str, request: Request) -> Response:
    """The blob's bytes streamed from the store (``Range: bytes=a-b`` answers ``206``). Only blobs that a
    servable manifest of ``name`` names are served."""
    _check_name(name)
    _check_digest(digest)
    store = _store(request)
    with _sessions(request)() as s:
        manifests, revoked = _servable_manifests(s, name)
    if not manifests and not revoked:
        raise _unknown_name(name)
    if not any(digest in MANIFESTS.get(store, m).names for m in manifests):
        # only a revoked engine names it (its manifest, config or a layer): refused as that manifest is
        withdrawn = next((m for m in revoked if digest in MANIFESTS.get(store, m).names), None)
        if withdrawn is None:
            raise e.BlobUnknown(f"no blob {digest} in repository {name!r}", detail={"name": name, "digest": digest})
        if not _admin_asks_for_revoked(request):
            raise _revoked(withdrawn, revoked[withdrawn])
    size = store.stat(digest).size
    headers = {"Docker-Content-Digest": digest, "ETag": f'"{digest}"', "Accept-Ranges": "bytes"}
    media_type = "application/octet-stream"
    redirect = REDIRECT_BLOBS or request.app.state.settings.redirect_blobs
    if request.method == "GET" and redirect and (url := store.presigned_url(digest, REDIRECT_EXPIRES_S)):
        return Response(status_code=307, headers={**headers, "Location": url})
    span = _parse_range(request.headers.get("range"), size)
    if span is None:
        status, offset, length = 200, 0, size
    else:
        status, offset, length = 206, span[0], span[1] - span[0] + 1
        headers["Content-Range"] = f"bytes {span[0]}-{span[1]}/{size}"
    headers["Content-Length"] = str(length)
    if request.method == "HEAD":
        return Response(status_code=status, headers=headers, media_type=media_type)
    chunks = store.open_range(digest, offset, length)  # BlobUnknown here, before any byte is sent
    return StreamingResponse(chunks, status_code=status, headers=headers, media_type=media_type)


@router.get("/{name:path}/tags/list", summary="Tags")
def tags_list(name: str, request: Request) -> Response:
    """Tags of ``name`` that point at a servable engine, sorted, paginated with ``n`` and ``last``."""
    _check_name(name)
    with _sessions(request)() as s:
        if not _repository_known(s, name):
            raise _unknown_name(name)
        names = list(s.scalars(select(Tag.name).join(Artifact, Artifact.digest == Tag.digest)
                               .where(Tag.repository == name, Artifact.status != "rejected")))
    return _paginate(request, names, f"/v2/{name}/tags/list", "tags", {"name": name})


@router.get("/{name:path}/referrers/{digest}", summary="Referrers of a manifest")
def referrers(name: str, digest: str, request: Request) -> Response:
    """An image index of the manifests whose ``subject`` is ``digest`` (provenance and validation reports,
    signatures), filtered by the ``artifactType`` query parameter when given. Never 404: an unknown subject
    has no referrers."""
    _check_name(name)
    _check_digest(digest)
    wanted = request.query_params.get("artifactType")
    with _sessions(request)() as s:
        subject = s.get(Artifact, digest)
        here = Referrer.repository == name
        if subject is not None and named_in(s, subject, name):
            here = true()  # an engine named here from another repository brings its referrers
        rows = [] if subject is not None and subject.status == "rejected" else list(s.scalars(
            select(Referrer).where(Referrer.subject == digest, here)
            .order_by(Referrer.created_at, Referrer.digest)))
    descriptors = []
    for r in rows:
        if wanted and r.artifact_type != wanted:
            continue
        d: dict[str, Any] = {"mediaType": MEDIA_TYPE_IMAGE_MANIFEST, "digest": r.digest, "size": r.size,
                             "artifactType": r.artifact_type}
        if r.annotations:
            d["annotations"] = dict(r.annotations)
        descriptors.append(d)
    headers = {"OCI-Filters-Applied": "artifactType"} if wanted else {}
    index = {"schemaVersion": 2, "mediaType": MEDIA_TYPE_IMAGE_INDEX, "manifests": descriptors}
    return JSONResponse(index, headers=headers, media_type=MEDIA_TYPE_IMAGE_INDEX)


@router.api_route("/{rest:path}", methods=["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE"],
                  include_in_schema=False)
def unsupported(rest: str, request: Request) -> Response:
    """Pushes, deletes and unknown /v2 paths: this registry is read-only."""
    if request.method in ("GET", "HEAD"):
        raise e.EndpointUnknown(f"/v2/{rest} is not an endpoint of this registry",
                                detail={"served": ["/v2/", "/v2/_catalog", "/v2/<name>/manifests/<reference>",
                                                   "/v2/<name>/blobs/<digest>", "/v2/<name>/tags/list",
                                                   "/v2/<name>/referrers/<digest>"]})
    raise e.MethodNotAllowed(f"{request.method} is not supported: this registry is read-only (no push)",
                             detail={"method": request.method}, headers={"Allow": "GET, HEAD"})

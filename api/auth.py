"""API tokens and scopes, enforced for every request in one middleware.

Scopes: ``artifacts:read`` (deployers: resolve, artifacts, /v2 pulls), ``builds:write`` (CI: submit, cancel,
register models; includes reading), ``admin`` (tokens, revoke, everything). Tokens are stored as hashes
(HMAC-SHA256 keyed with ``KILN_TOKEN_SECRET`` when set), may expire, and an address with too many failed token
checks has its further failures answered 429 for a minute (a valid token from it is still served). What each scope reveals: docs/security.md. /v2 accepts them the way OCI clients send them: ``Bearer <token>`` or Basic with the token as password.
Health endpoints are open; the Hugging Face webhook authenticates with its own secret.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time
import uuid
from collections import deque
from datetime import timedelta, timezone
from typing import Any

from fastapi import APIRouter, Body, Request
from sqlalchemy import select
from starlette.requests import Request as ScopeRequest

from api.deps import SessionDep, SettingsDep
from api.errors import database_unavailable, error_response
from kiln import errors as e
from kiln.errors import SpecError
from kiln.tables import ApiToken, utcnow

SCOPES = ("artifacts:read", "builds:write", "admin")
IMPLIES = {"admin": set(SCOPES), "builds:write": {"builds:write", "artifacts:read"}, "artifacts:read": {"artifacts:read"}}
ADMISSION = "/v1/admission/validate"
OPEN = ("/healthz", "/readyz", "/v1/webhooks/huggingface", "/openapi.json", "/docs", "/redoc", "/metrics")
router = APIRouter(prefix="/v1/tokens", tags=["tokens"])


def token_hashes(token: str, secret: str | None) -> list[str]:
    """What a stored token may look like: HMAC-SHA256 keyed with the server's secret (when one is set) and the
    plain SHA-256 that rows stored before it use. The first one is what new tokens are stored as."""
    plain = hashlib.sha256(token.encode()).hexdigest()
    if not secret:
        return [plain]
    return [hmac.new(secret.encode(), token.encode(), hashlib.sha256).hexdigest(), plain]


def token_hash(token: str, secret: str | None = None) -> str:
    return token_hashes(token, secret)[0]


#: Failed token checks allowed per client address and window before its further failures are answered 429.
MAX_FAILURES, FAILURE_WINDOW_S = 10, 60.0


def required_scope(method: str, path: str) -> str | None:
    """The scope a request needs; None for open endpoints. ``path`` is a route's path template
    (``/v1/artifacts/{digest}/revoke``) when the request matched one — that decides (:func:`route_scope`) — and
    the request's own path for the early check in :class:`AuthMiddleware`."""
    if path in OPEN or path.startswith("/static/") or path == "/":
        return None
    if path.startswith("/v1/tokens") or path.endswith("/revoke"):
        return "admin"
    if method in ("GET", "HEAD", "OPTIONS"):
        return "artifacts:read"
    if path.startswith("/v1/fit") or path == ADMISSION:  # reads only: a read token suffices
        return "artifacts:read"
    return "builds:write"


def anonymous_ok(settings, method: str, path: str, need: str | None) -> bool:
    """A request without a token may pass: ``KILN_ANONYMOUS_READ`` opens every ``artifacts:read`` route,
    ``KILN_ANONYMOUS_ADMISSION`` the admission webhook alone."""
    if settings.anonymous_admission and method == "POST" and path == ADMISSION:
        return True
    return need == "artifacts:read" and settings.anonymous_read


def control_characters(path: str) -> bool:
    """A path holding a control character (``%0A``, ``%00``, …): no route's name has one, and a regular
    expression's ``$`` matches before a final newline, so such a path is refused, never routed."""
    return any(ord(c) < 0x20 or ord(c) == 0x7F for c in path)


async def route_scope(request: Request) -> None:
    """The scope check that decides, run for every API route once it is matched (an app-wide dependency): the
    scope comes from the matched route's path template, never from the path as the client spelled it."""
    template = getattr(request.scope.get("route"), "path_format", None)
    if template is None:
        return
    need = required_scope(request.method, template)
    if need is None or need in request.state.scopes:
        return
    if request.state.anonymous and anonymous_ok(request.app.state.settings, request.method, template, need):
        return
    if request.state.anonymous:
        raise _unauthorized("a token is required", "send Authorization: Bearer <token>")
    raise _forbidden(f"this token lacks the {need} scope", f"use a token with {need}")


def bearer_or_basic(header: str | None) -> str | None:
    if not header:
        return None
    kind, _, value = header.partition(" ")
    if kind.lower() == "bearer":
        return value.strip() or None
    if kind.lower() == "basic":
        try:
            return base64.b64decode(value.strip()).decode().partition(":")[2] or None
        except (ValueError, UnicodeDecodeError):
            return None
    return None


def _unauthorized(message: str, fix: str) -> e.Unauthorized:
    # detail: the OCI body (/v2) carries the fix as its detail
    return e.Unauthorized(message, field="Authorization", fix=fix, detail=fix)


def _forbidden(message: str, fix: str) -> e.Forbidden:
    return e.Forbidden(message, field="Authorization", fix=fix, detail=fix)


def _refuse(exc: e.KilnError, scope, receive, send):
    """The table's answer to ``exc``, sent from a pure ASGI middleware (before any route)."""
    return error_response(exc, ScopeRequest(scope))(scope, receive, send)


class AuthMiddleware:
    """Pure ASGI (no per-request task or body wrapping, unlike ``@app.middleware``): a declared
    ``Content-Length`` over the limit is refused at once, then token and scope checks when auth is required;
    the bytes actually received are counted by :class:`api.bodies.BodyLimitMiddleware`, inside this one."""

    def __init__(self, app, kiln_app):
        self.app, self.kiln_app = app, kiln_app
        self.settings = kiln_app.state.settings
        self.failures: dict[str, deque] = {}  # client address → times of its recent failed token checks

    def _throttled(self, client: str) -> bool:
        times = self.failures.get(client)
        if not times:
            return False
        while times and times[0] < time.monotonic() - FAILURE_WINDOW_S:
            times.popleft()
        return len(times) >= MAX_FAILURES

    def _failed(self, client: str) -> None:
        if len(self.failures) > 10_000:  # bounded memory: forget everyone rather than grow
            self.failures.clear()
        self.failures.setdefault(client, deque()).append(time.monotonic())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]
                   if k in (b"content-length", b"authorization")}
        path, settings = scope["path"], self.settings
        if control_characters(path):
            fix = "remove it (no Kiln path has one)"
            return await _refuse(e.InvalidPath("the path holds a control character", field="path", fix=fix,
                                               detail=fix), scope, receive, send)
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > settings.max_body_bytes:
            return await _refuse(e.PayloadTooLarge(f"body over {settings.max_body_bytes} bytes", field="body",
                                                   fix="send a smaller request"), scope, receive, send)
        # what the caller may do, for routes that answer differently to admins (request.state.scopes)
        # (request.state.anonymous: let through without a token checked; route_scope checks the route again)
        state = scope.setdefault("state", {})
        state["anonymous"] = False
        if not settings.auth_required:
            state["scopes"] = set(SCOPES)  # single user: no tokens at all
            return await self.app(scope, receive, send)
        # An early check by the path as written (before the body is read); route_scope decides by the route.
        need = required_scope(scope["method"], path)
        state["scopes"] = set()
        if need is None or (not headers.get("authorization") and anonymous_ok(settings, scope["method"], path, need)):
            state["anonymous"] = not headers.get("authorization")
            return await self.app(scope, receive, send)
        # The token is checked first: a valid one is served even from a throttled address (one client's bad
        # tokens never lock out another behind the same address); only failures are counted and throttled.
        client = (scope.get("client") or ("?",))[0]
        denied, granted = await self._check(headers.get("authorization"), need)
        if denied is not None:
            if isinstance(denied, e.Unauthorized) and headers.get("authorization"):
                if self._throttled(client):
                    return await _refuse(e.RateLimited(
                        "too many failed token checks from this address", field="Authorization",
                        fix=f"wait {int(FAILURE_WINDOW_S)} s and use a valid token",
                        headers={"Retry-After": str(int(FAILURE_WINDOW_S))}), scope, receive, send)
                self._failed(client)
            return await _refuse(denied, scope, receive, send)
        state["scopes"] = granted
        return await self.app(scope, receive, send)

    async def _check(self, authorization: str | None, need: str) -> tuple[e.KilnError | None, set]:
        """The refusal of a request (None: none) and the scopes its token grants."""
        from sqlalchemy.exc import DBAPIError
        from starlette.concurrency import run_in_threadpool

        token = bearer_or_basic(authorization)
        if token is None:
            return _unauthorized("a token is required", "send Authorization: Bearer <token>"), set()
        try:
            row = await run_in_threadpool(_lookup, self.kiln_app, token)
        except DBAPIError as exc:
            return database_unavailable(exc), set()
        if row is None:
            return _unauthorized("unknown or revoked token", "ask an admin for a token"), set()
        granted = set().union(*(IMPLIES.get(s, set()) for s in row.scopes))
        if need not in granted:
            return _forbidden(f"this token lacks the {need} scope",
                              f"use a token with {need} (it has {', '.join(row.scopes)})"), granted
        return None, granted


def install(app) -> None:
    """The middleware (early checks); the app passes ``route_scope`` as its dependency when it is created
    (api/app.py), so every route, included ones too, has it, and answers what it raises with the error table."""
    from api.bodies import BodyLimitMiddleware

    settings = app.state.settings

    # inside the auth check (a request without a token is refused before its body is read)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(AuthMiddleware, kiln_app=app)
    if settings.bootstrap_token:
        with app.state.sessions() as s:
            hashes = token_hashes(settings.bootstrap_token, settings.token_secret)
            digest = hashes[0]
            row = s.scalars(select(ApiToken).where(ApiToken.token_sha256.in_(hashes))).first()
            if row is None:
                s.add(ApiToken(id=uuid.uuid4().hex, name="bootstrap", token_sha256=digest, scopes=["admin"],
                               created_at=utcnow(), issued_with_auth=True))
            elif not row.issued_with_auth and row.name == "bootstrap" and row.scopes == ["admin"]:
                row.issued_with_auth = True  # the operator's own secret, from the environment
            s.commit()


def _lookup(app, token: str) -> ApiToken | None:
    with app.state.sessions() as s:
        hashes = token_hashes(token, app.state.settings.token_secret)
        row = s.scalars(select(ApiToken).where(ApiToken.token_sha256.in_(hashes))).first()
        if row is None or row.revoked_at is not None or not row.issued_with_auth:
            return None  # unknown, revoked, or minted while auth was off (when anyone could)
        expires = row.expires_at
        if expires is not None and (expires if expires.tzinfo else expires.replace(tzinfo=timezone.utc)) <= utcnow():
            return None
        return row


def token_read(t: ApiToken) -> dict:
    return {"id": t.id, "name": t.name, "scopes": t.scopes, "created_at": t.created_at.isoformat(),
            "expires_at": t.expires_at.isoformat() if t.expires_at else None, "revoked": t.revoked_at is not None}


@router.post("", status_code=201)
def create_token(session: SessionDep, settings: SettingsDep, body: Any = Body(None)):
    """Create a token (admin). The token is in this response only."""
    if not settings.auth_required:  # nobody is authenticated: a token minted now would be anyone's
        raise e.AuthOff("tokens are not required on this server, so none can be minted", field="KILN_AUTH",
                        fix="start the API with KILN_AUTH=required and KILN_BOOTSTRAP_TOKEN, "
                            "then mint tokens with the bootstrap token")
    if not isinstance(body, dict) or not isinstance(body.get("name"), str) or not body["name"].strip():
        raise SpecError("a name is required", field="name", fix='send {"name": "ci", "scopes": ["builds:write"]}')
    scopes = body.get("scopes")
    if not isinstance(scopes, list) or not scopes or any(s not in SCOPES for s in scopes):
        raise SpecError(f"scopes must be a non-empty list of {', '.join(SCOPES)}", field="scopes",
                        fix='e.g. ["artifacts:read"]')
    days = body.get("expires_in_days")
    if days is not None and (isinstance(days, bool) or not isinstance(days, (int, float)) or not 0 < days <= 3650):
        raise SpecError(f"{days!r} is not a number of days from 0 to 3650", field="expires_in_days",
                        fix="e.g. 90, or leave it out for a token that does not expire")
    token = "kiln_" + secrets.token_urlsafe(32)
    row = ApiToken(id=uuid.uuid4().hex, name=body["name"].strip()[:255], token_sha256=token_hash(token, settings.token_secret),
                   scopes=sorted(set(scopes)), created_at=utcnow(), issued_with_auth=True,
                   expires_at=utcnow() + timedelta(days=days) if days is not None else None)
    session.add(row)
    session.commit()
    return {**token_read(row), "token": token}


@router.get("")
def list_tokens(session: SessionDep):
    """Tokens (admin), without their secrets."""
    return {"tokens": [token_read(t) for t in session.scalars(select(ApiToken).order_by(ApiToken.created_at))]}


@router.delete("/{token_id}")
def revoke_token(token_id: str, session: SessionDep):
    """Revoke a token (admin)."""
    row = session.get(ApiToken, token_id[:32])
    if row is None:
        raise e.TokenUnknown(f"no token {token_id!r}", field="id", fix="list tokens with GET /v1/tokens")
    row.revoked_at = row.revoked_at or utcnow()
    session.commit()
    return token_read(row)

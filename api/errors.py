"""The one error table: every domain error class (``kiln/errors.py``) → its HTTP status, CLI exit code and OCI
error code, and :func:`error_response`, the only builder of an error answer in the API.

Exit codes: 0 success, 1 validation failed (or content that does not verify), 2 bad input (including requests
refused as sent: credentials, scopes, unknown names), 3 environment or internal error, 4 a wait that timed out
(the build goes on).

Every class has its own row (``tests/unit/api/test_error_table.py`` checks it, and that no route, middleware or
handler builds an error answer by hand). Under ``/v2`` the answer is the distribution-spec's body,
``{"errors": [{"code", "message", "detail"}]}``, with the row's OCI code; a row without one (the spec has no code
for it: internal and environment errors, /v1-only errors) is answered ``UNKNOWN``, Docker Registry's code for
anything else. Everywhere else it is ``{"error": {"code", "message", "field", "fix"}}`` (``errors`` too when a
request has several problems)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kiln import errors as e

if TYPE_CHECKING:  # the CLI reads the table without the web framework (the kiln-client install has none)
    from starlette.exceptions import HTTPException
    from starlette.requests import Request
    from starlette.responses import Response

#: The distribution-spec's error codes (v1.1, "Error Codes"); the only OCI codes a row may name.
OCI_CODES = frozenset({"BLOB_UNKNOWN", "BLOB_UPLOAD_INVALID", "BLOB_UPLOAD_UNKNOWN", "DIGEST_INVALID",
                       "MANIFEST_BLOB_UNKNOWN", "MANIFEST_INVALID", "MANIFEST_UNKNOWN", "NAME_INVALID",
                       "NAME_UNKNOWN", "SIZE_INVALID", "UNAUTHORIZED", "DENIED", "UNSUPPORTED", "TOOMANYREQUESTS"})
#: What /v2 answers for a row without an OCI code.
OCI_FALLBACK = "UNKNOWN"
EXIT_CODES = frozenset({1, 2, 3, 4})
OCI_PREFIX = "/v2"
API_VERSION_HEADER = {"Docker-Distribution-API-Version": "registry/2.0"}
# Under /v2, Basic only: registry clients read a Bearer realm as the URL of a token service and would send the
# user's credentials there. "Authorization: Bearer <token>" is still accepted.
OCI_CHALLENGE = (("WWW-Authenticate", 'Basic realm="kiln"'),)
# Everywhere else, Bearer: a Basic challenge makes a browser open its login box over the dashboard, whose
# requests go to /v1 (the JSON body says what to send).
CHALLENGE = (("WWW-Authenticate", 'Bearer realm="kiln"'),)


@dataclass(frozen=True)
class Row:
    status: int  # HTTP status
    exit: int  # CLI exit code
    oci: str | None = None  # distribution-spec error code, under /v2
    headers: tuple[tuple[str, str], ...] = ()  # headers every answer of this error carries
    oci_headers: tuple[tuple[str, str], ...] = ()  # under /v2, these instead of the same-named ones of headers


TABLE: dict[type[e.KilnError], Row] = {
    # bad input
    e.SpecError: Row(422, 2),
    e.CheckpointNotFound: Row(422, 2),
    e.InvalidDigest: Row(400, 2, "DIGEST_INVALID"),
    e.InvalidRequest: Row(422, 2, "UNSUPPORTED"),
    e.BodyUnreadable: Row(400, 2, "UNSUPPORTED"),
    e.InvalidPath: Row(400, 2, "NAME_INVALID"),
    e.PayloadTooLarge: Row(413, 2, "SIZE_INVALID"),
    e.NameInvalid: Row(400, 2, "NAME_INVALID"),
    e.InvalidPageSize: Row(400, 2, "UNSUPPORTED"),
    e.RangeNotSatisfiable: Row(416, 2, "UNSUPPORTED"),
    e.EndpointUnknown: Row(404, 2, "UNSUPPORTED"),
    e.MethodNotAllowed: Row(405, 2, "UNSUPPORTED"),
    e.InvalidTransition: Row(409, 2),
    # access
    e.Unauthorized: Row(401, 2, "UNAUTHORIZED", CHALLENGE, OCI_CHALLENGE),
    e.Forbidden: Row(403, 2, "DENIED"),
    e.AuthOff: Row(403, 2, "DENIED"),
    e.RateLimited: Row(429, 3, "TOOMANYREQUESTS"),
    e.EngineRevoked: Row(403, 2, "DENIED"),
    # missing things
    e.BlobUnknown: Row(404, 2, "BLOB_UNKNOWN"),
    e.ArtifactUnknown: Row(404, 2),
    e.BuildUnknown: Row(404, 2),
    e.ModelUnknown: Row(404, 2),
    e.TokenUnknown: Row(404, 2),
    e.NameUnknown: Row(404, 2, "NAME_UNKNOWN"),
    e.ManifestUnknown: Row(404, 2, "MANIFEST_UNKNOWN"),
    e.NotBuilt: Row(404, 2),
    e.StillBuilding: Row(404, 2),
    e.NoneServable: Row(404, 2),
    e.StaleOnly: Row(409, 2),
    e.IncompatibleRuntime: Row(409, 2),
    # verdicts and content
    e.ValidationFailed: Row(422, 1),
    e.SignatureInvalid: Row(422, 1),
    e.UnsafeLayer: Row(422, 1),
    e.BuildCancelled: Row(409, 3),
    e.WaitTimedOut: Row(504, 4),
    # integrity, environment, internal
    e.DigestMismatch: Row(502, 3),
    e.ManifestCorrupt: Row(500, 3),
    e.ToolchainMissing: Row(503, 3),
    e.StorageUnavailable: Row(503, 3),
    e.DatabaseUnavailable: Row(503, 3, None, (("Retry-After", "5"),)),
    e.SettingsInvalid: Row(500, 2),
    e.RegistryUnavailable: Row(502, 3),
    e.RegistryDenied: Row(502, 2),
    e.StageFailed: Row(500, 3),
    e.KilnError: Row(500, 3),
}


def row(exc: BaseException) -> Row:
    """The row of ``exc``'s class, or of its nearest ancestor that has one (anything else: KilnError's)."""
    for cls in type(exc).__mro__:
        if cls in TABLE:
            return TABLE[cls]
    return TABLE[e.KilnError]


def http_status(exc: BaseException) -> int:
    return row(exc).status


def exit_code(exc: BaseException) -> int:
    return row(exc).exit


def oci_detail(exc: e.KilnError):
    if exc.detail is not None:
        return exc.detail
    return {k: v for k, v in (("kiln_code", exc.code), ("field", exc.field), ("fix", exc.fix)) if v is not None}


def error_response(exc: e.KilnError, request: Request | None = None) -> Response:
    """The answer to ``exc``: status and headers from its row (under /v2 its OCI headers over them); under /v2
    the distribution-spec body with the row's OCI code (no body for ``HEAD``: the status says it), elsewhere ``{"error": exc.to_dict()}``."""
    from starlette.responses import JSONResponse, Response

    r = row(exc)
    oci = request is not None and request.scope.get("path", "").startswith(OCI_PREFIX)
    headers = {**dict(r.headers), **(dict(r.oci_headers) if oci else {}), **exc.headers}
    if oci:
        headers.update(API_VERSION_HEADER)
        if request is not None and request.method == "HEAD":
            return Response(status_code=r.status, headers=headers)
        body = {"errors": [{"code": r.oci or OCI_FALLBACK, "message": exc.message, "detail": oci_detail(exc)}]}
        return JSONResponse(body, status_code=r.status, headers=headers)
    return JSONResponse({"error": exc.to_dict()}, status_code=r.status, headers=headers)


# -- errors the framework and libraries raise, as domain errors ------------------------------------------------
def database_unavailable(exc: Exception) -> e.DatabaseUnavailable:
    return e.DatabaseUnavailable(f"the database is unreachable ({type(getattr(exc, 'orig', exc)).__name__})",
                                 field="database", fix="retry shortly; Kiln reconnects by itself")


def framework_error(exc: HTTPException) -> e.KilnError:
    """The domain error for what the framework refuses itself: no route (404), not with this method (405), a
    body it cannot read (any other status)."""
    detail = str(exc.detail)
    if exc.status_code == 404:
        return e.EndpointUnknown(detail, fix="see GET /openapi.json")
    if exc.status_code == 405:
        allow = (exc.headers or {}).get("Allow")
        return e.MethodNotAllowed(detail, fix=f"use {allow}" if allow else "see GET /openapi.json",
                                  headers={"Allow": allow} if allow else None)
    return e.BodyUnreadable(detail, field="body", fix="send a well-formed body",
                            headers=dict(exc.headers) if exc.headers else None)

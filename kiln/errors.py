"""Domain errors. Raised in the core and at the edge alike, translated to HTTP statuses, CLI exit codes and OCI
error codes only in one table (``api/errors.py``): every class here has its own row there, and its own ``code``
(a stable string, unique among them). Errors about user input name the ``field`` at fault and say how to fix it.
No answer to a failed request is built anywhere else: a route, a middleware or the CLI raises one of these."""

from __future__ import annotations


class KilnError(Exception):
    """Base of every error Kiln raises on purpose."""

    code = "internal_error"

    def __init__(self, message: str, *, field: str | None = None, fix: str | None = None,
                 details: list[dict] | None = None, detail: object = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.field = field
        self.fix = fix
        self.details = details or []
        #: the ``detail`` of the OCI error body (under /v2); None: the code, field and fix (api/errors.py)
        self.detail = detail
        #: HTTP headers its answer carries besides its row's (``Retry-After``, ``Allow``, ``Content-Range``)
        self.headers = dict(headers or {})

    def __str__(self) -> str:
        text = f"{self.field}: {self.message}" if self.field else self.message
        return f"{text} ({self.fix})" if self.fix else text

    def to_dict(self) -> dict:
        body: dict[str, object] = {"code": self.code, "message": self.message}
        if self.field:
            body["field"] = self.field
        if self.fix:
            body["fix"] = self.fix
        if len(self.details) > 1:
            body["errors"] = self.details
        return body


# -- bad input -------------------------------------------------------------------------------------
class SpecError(KilnError):
    """A build spec breaks a rule; ``field`` names the field (dotted path), ``fix`` says what to do."""

    code = "invalid_spec"


class CheckpointNotFound(KilnError):
    """The checkpoint reference does not resolve (missing directory, unknown repo or revision)."""

    code = "checkpoint_not_found"


class InvalidDigest(KilnError):
    """A string that should be ``sha256:<64 hex>`` is not."""

    code = "invalid_digest"


class InvalidRequest(KilnError):
    """A request the API cannot take as sent: a parameter or body that breaks the route's schema, a JSON body
    with a non-finite number or nested too deeply. ``details`` lists every problem when there are several."""

    code = "invalid_request"


class BodyUnreadable(KilnError):
    """The framework could not read the request body at all (e.g. a malformed form or multipart body)."""

    code = "body_unreadable"


class InvalidPath(KilnError):
    """A request path holding a control character: no route has one, so it is refused, never routed."""

    code = "invalid_path"


class PayloadTooLarge(KilnError):
    """A request body over the limit (``KILN_MAX_BODY_BYTES``, or the webhook's own)."""

    code = "too_large"


class NameInvalid(KilnError):
    """/v2: a repository name that breaks the distribution-spec grammar."""

    code = "name_invalid"


class InvalidPageSize(KilnError):
    """/v2: ``n`` (page size of ``tags/list`` or ``_catalog``) is not a non-negative integer."""

    code = "page_size_invalid"


class RangeNotSatisfiable(KilnError):
    """/v2: a blob ``Range`` that cannot be satisfied."""

    code = "range_unsatisfiable"


class EndpointUnknown(KilnError):
    """No endpoint has this path (answered by the router, or /v2's catch-all)."""

    code = "endpoint_unknown"


class MethodNotAllowed(KilnError):
    """The endpoint exists but not with this method (/v2 is read-only: every write method)."""

    code = "method_not_allowed"


# -- access ----------------------------------------------------------------------------------------
class Unauthorized(KilnError):
    """No credentials, or unknown, revoked or expired ones (a token; the webhook's secret)."""

    code = "unauthorized"


class Forbidden(KilnError):
    """Known credentials without the scope the request needs."""

    code = "forbidden"


class AuthOff(Forbidden):
    """Tokens cannot be minted on a server that requires none (anyone could mint one)."""

    code = "auth_off"


class RateLimited(KilnError):
    """Too many failed token checks from one address: refused for a while (``Retry-After``)."""

    code = "too_many_failures"


class EngineRevoked(KilnError):
    """/v2: the engine (or a blob only it names) was revoked; served only to an admin who asks for it."""

    code = "engine_revoked"


# -- missing things --------------------------------------------------------------------------------
class BlobUnknown(KilnError):
    code = "blob_unknown"


class ArtifactUnknown(KilnError):
    code = "artifact_unknown"


class BuildUnknown(ArtifactUnknown):
    code = "build_unknown"


class ModelUnknown(KilnError):
    """The model is not tracked (``PUT /v1/models/{model}`` tracks it)."""

    code = "model_unknown"


class TokenUnknown(KilnError):
    code = "token_unknown"


class NameUnknown(KilnError):
    """/v2: the repository names no engine that may be served."""

    code = "name_unknown"


class ManifestUnknown(KilnError):
    """/v2: no such tag or manifest in the repository, or one that is never served (rejected, a stale tag)."""

    code = "manifest_unknown"


# what ``resolve`` answers when no engine may be deployed (api/resolution.py names them by code)
class NotBuilt(ArtifactUnknown):
    """No engine for the asked combination has been built."""

    code = "not_built"


class StillBuilding(ArtifactUnknown):
    """No fresh engine yet; a build for it is queued or running."""

    code = "building"


class NoneServable(ArtifactUnknown):
    """Engines exist but none may be served (rejected, revoked)."""

    code = "none_servable"


class StaleOnly(ArtifactUnknown):
    """Only stale engines (of an older checkpoint revision) exist."""

    code = "stale_only"


class IncompatibleRuntime(ArtifactUnknown):
    """Fresh engines exist, but none loads on the asked runtime."""

    code = "incompatible_runtime"


# -- integrity -------------------------------------------------------------------------------------
class DigestMismatch(KilnError):
    """Bytes read or written do not hash to the digest that names them."""

    code = "digest_mismatch"


class UnsafeLayer(KilnError):
    """A pulled layer whose bytes are verified but whose archive breaks the unpack rules (links, ``..``,
    devices, sparse members, a signature file where the signature goes): bad content, refused like an engine
    that does not verify."""

    code = "unsafe_layer"


class ManifestCorrupt(KilnError):
    """A stored blob indexed as a manifest is not a JSON object."""

    code = "manifest_corrupt"


# -- verdicts --------------------------------------------------------------------------------------
class ValidationFailed(KilnError):
    """The engine was built but failed a validation gate; it is stored as ``rejected``."""

    code = "validation_failed"


class SignatureInvalid(KilnError):
    """An engine is not verified: unsigned, signed by a key not trusted, tampered with, or its provenance
    names other content (subject mismatch). The message says which."""

    code = "not_verified"


# -- environment -----------------------------------------------------------------------------------
class ToolchainMissing(KilnError):
    """A backend needs software this machine does not have (e.g. TensorRT-LLM, a GPU)."""

    code = "toolchain_missing"


class StorageUnavailable(KilnError):
    """The artifact store could not be reached or answered with a server error."""

    code = "storage_unavailable"


class RegistryUnavailable(KilnError):
    """``kiln push`` (or replication): the target registry could not be reached, or answered with a server error
    or ``429``. Nothing it holds is half-written: manifests are pushed only after their blobs."""

    code = "registry_unavailable"


class RegistryDenied(KilnError):
    """``kiln push`` (or replication): the target registry refused a request — credentials missing or wrong
    (``401``), no push permission (``403``), or content it does not take (another ``4xx``, its error quoted)."""

    code = "registry_denied"


class SettingsInvalid(KilnError):
    """A setting the process refuses to start with: a shipped placeholder left in place (``REPLACE-ME``), or a
    setting no longer read that would be unsafe to ignore; ``field`` names the environment variable."""

    code = "settings_invalid"


class DatabaseUnavailable(KilnError):
    """The index database could not be reached (connection refused, dropped, invalidated)."""

    code = "database_unavailable"


class StageFailed(KilnError):
    """A pipeline stage failed for a reason that is not bad input (library error, crash)."""

    code = "stage_failed"


class InvalidTransition(KilnError):
    """A status change the state machines (``kiln/states.py``) do not allow, e.g. revoking a revoked engine or
    cancelling a finished build."""

    code = "invalid_transition"


class WaitTimedOut(KilnError):
    """``--timeout`` passed while a build had not finished; the build itself goes on (cancel it to stop it)."""

    code = "wait_timed_out"


class BuildCancelled(KilnError):
    """The build was cancelled; nothing was published."""

    code = "cancelled"


def by_code(code: str | None) -> type[KilnError] | None:
    """The error class whose ``code`` is ``code`` (each code is one class's), or None."""
    todo, seen = [KilnError], set()
    while todo:
        cls = todo.pop()
        if cls.code == code:
            return cls
        seen.add(cls)
        todo.extend(c for c in cls.__subclasses__() if c not in seen)
    return None

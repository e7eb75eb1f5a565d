"""Domain errors. Raised in the core, translated to HTTP statuses and CLI exit codes only at the edge
(``api/errors.py``). Each error carries a stable ``code`` string; errors about user input name the
``field`` at fault and say how to fix it."""

from __future__ import annotations


class KilnError(Exception):
    """Base of every error Kiln raises on purpose."""

    code = "internal_error"

    def __init__(self, message: str, *, field: str | None = None, fix: str | None = None,
                 details: list[dict] | None = None):
        super().__init__(message)
        self.message = message
        self.field = field
        self.fix = fix
        self.details = details or []

    def __str__(self) -> str:
        text = f"{self.field}: {self.message}" if self.field else self.message
        return f"{text} ({self.fix})" if self.fix else text

    def to_dict(self) -> dict:
        body = {"code": self.code, "message": self.message}
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


# -- missing things --------------------------------------------------------------------------------
class BlobUnknown(KilnError):
    code = "blob_unknown"


class ArtifactUnknown(KilnError):
    code = "artifact_unknown"


# -- integrity -------------------------------------------------------------------------------------
class DigestMismatch(KilnError):
    """Bytes read or written do not hash to the digest that names them."""

    code = "digest_mismatch"


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

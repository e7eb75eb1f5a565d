"""The one table that maps domain errors to HTTP statuses and CLI exit codes (0 success, 1 validation failed,
2 bad input, 3 environment or internal error, 4 a wait timed out — the build goes on)."""

from __future__ import annotations

from kiln import errors as e

# error class → (HTTP status, CLI exit code); the first matching class in MRO order wins.
TABLE: dict[type[e.KilnError], tuple[int, int]] = {
    e.SpecError: (422, 2),
    e.CheckpointNotFound: (422, 2),
    e.InvalidDigest: (400, 2),
    e.BlobUnknown: (404, 2),
    e.ArtifactUnknown: (404, 2),
    e.ValidationFailed: (422, 1),
    e.SignatureInvalid: (422, 1),
    e.BuildCancelled: (409, 3),
    e.WaitTimedOut: (504, 4),
    e.InvalidTransition: (409, 2),
    e.DigestMismatch: (502, 3),
    e.ToolchainMissing: (503, 3),
    e.StorageUnavailable: (503, 3),
    e.StageFailed: (500, 3),
    e.KilnError: (500, 3),
}


def _lookup(exc: BaseException) -> tuple[int, int]:
    for cls in type(exc).__mro__:
        if cls in TABLE:
            return TABLE[cls]
    return 500, 3


def http_status(exc: BaseException) -> int:
    return _lookup(exc)[0]


def exit_code(exc: BaseException) -> int:
    return _lookup(exc)[1]

"""Which distribution of Kiln is installed: ``kiln`` (everything: builds, the service, its workers) or
``kiln-client`` (client/: only the commands a CI job needs against a server — ``build --server``, ``resolve``,
``pull``, ``verify``, ``report`` — without torch, ModelOpt, Celery or SQLAlchemy)."""

from __future__ import annotations

from functools import lru_cache
from importlib import metadata

from kiln.errors import ToolchainMissing

CLIENT_DISTRIBUTION = "kiln-client"
BUILD_FIX = "build with --server URL, or install kiln"
COMMAND_FIX = "use the command's --server URL where it has one, or install kiln"


def _installed(name: str) -> bool:
    try:
        metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return False
    return True


@lru_cache(maxsize=1)
def is_client() -> bool:
    """True where the kiln-client distribution is installed and the full one is not."""
    return _installed(CLIENT_DISTRIBUTION) and not _installed("kiln")


def client_refusal(what: str = "a local build", missing: str | None = None,
                   fix: str = BUILD_FIX) -> ToolchainMissing:
    """The one-line error (exit 3) for a command that needs the full install, run in the client install."""
    lacks = f" (it has no {missing})" if missing else ""
    return ToolchainMissing(f"this is the kiln-client install{lacks}: {what} needs the full kiln install", fix=fix)

"""Open a blob store from its URL: the one place configuration picks a backend.

:data:`STORES` maps a URL scheme to the class that serves it; each class parses its own URL and reads its own
settings (``from_url``: :class:`StoreFromUrl`). A new store is one class and one row
here; the conformance suite (``tests/unit/artifacts``) runs over every row."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module
from typing import TYPE_CHECKING, Protocol
from urllib.parse import urlsplit

from artifacts.interfaces import BlobStore
from kiln.errors import SpecError

if TYPE_CHECKING:
    from kiln.settings import Settings


class StoreFromUrl(Protocol):
    """What a registered store class has (a wrapper such as ``builder.leases.LeasedStore`` is not opened from a
    URL and has none)."""

    @classmethod
    def from_url(cls, url: str, settings: Settings | None) -> BlobStore:
        """The store ``url`` names (a URL of this class's scheme), configured from ``settings`` (None: the
        environment's, read only if this store needs any); a URL it cannot open raises
        :func:`artifacts.interfaces.url_refused`."""
        ...


@dataclass(frozen=True)
class StoreRow:
    """One scheme's store: its class as ``module:Class``, imported on first use (boto3 loads only for the stores
    that need it), and how its URLs are written (for the fix an unusable URL gets)."""

    cls: str
    forms: str


#: scheme → store. A URL without ``://`` is a plain directory path, served by :data:`PLAIN_PATH`'s row.
STORES: dict[str, StoreRow] = {
    "file": StoreRow("artifacts.local:LocalBlobStore", "file:///absolute/path, a plain directory path"),
    "s3": StoreRow("artifacts.s3:S3BlobStore", "s3://bucket/prefix"),
}
PLAIN_PATH = "file"

_forms = [row.forms for row in STORES.values()]
FIX = "use " + (", ".join(_forms[:-1]) + ", or " + _forms[-1] if len(_forms) > 1 else _forms[0])


def store_class(scheme: str) -> type[StoreFromUrl]:
    """The class registered for ``scheme`` (KeyError for an unregistered one)."""
    module, _, name = STORES[scheme].cls.partition(":")
    return getattr(import_module(module), name)


def open_store(url: str, settings: Settings | None = None) -> BlobStore:
    """``file:///abs/path`` or a plain path → :class:`~artifacts.local.LocalBlobStore`; ``s3://bucket/prefix`` →
    :class:`~artifacts.s3.S3BlobStore` (its endpoint from ``settings``, ``KILN_S3_ENDPOINT_URL``). ``settings``:
    what a store reads besides its URL; None: the environment's, read only by a store that needs them. Anything
    else raises :class:`SpecError` naming the ``store_url`` field."""
    if not isinstance(url, str) or not url.strip():
        raise SpecError("the store URL is empty", field="store_url", fix=FIX)
    scheme = urlsplit(url).scheme
    if scheme not in STORES:
        if "://" in url:
            raise SpecError(f"unsupported store URL scheme {scheme!r}", field="store_url", fix=FIX)
        scheme = PLAIN_PATH
    try:
        return store_class(scheme).from_url(url, settings)
    except SpecError as exc:  # a store's own refusal of its URL gets the fix naming every form
        if exc.field == "store_url" and exc.fix is None:
            exc.fix = FIX
        raise

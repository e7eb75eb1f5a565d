"""Open a blob store from its URL: the one place configuration picks a backend."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote, urlsplit

from artifacts.interfaces import BlobStore
from artifacts.local import LocalBlobStore
from kiln.errors import SpecError

_FIX = "use file:///absolute/path, a plain directory path, or s3://bucket/prefix"


def open_store(url: str, *, s3_endpoint_url: str | None = None) -> BlobStore:
    """``file:///abs/path`` or a plain path → :class:`LocalBlobStore`; ``s3://bucket/prefix`` →
    :class:`~artifacts.s3.S3BlobStore` (``s3_endpoint_url`` for MinIO or moto). Anything else
    raises :class:`SpecError` naming the ``store_url`` field."""
    if not isinstance(url, str) or not url.strip():
        raise SpecError("the store URL is empty", field="store_url", fix=_FIX)
    parts = urlsplit(url)
    if parts.scheme == "s3":
        if not parts.netloc or parts.query or parts.fragment:
            raise SpecError(f"{url!r} does not name a bucket", field="store_url", fix=_FIX)
        from artifacts.s3 import S3BlobStore  # boto3 loads only for stores that need it

        return S3BlobStore(parts.netloc, unquote(parts.path).strip("/"), endpoint_url=s3_endpoint_url)
    if parts.scheme == "file":
        path = unquote(parts.path)
        if parts.netloc not in ("", "localhost") or not path.startswith("/"):
            raise SpecError(f"{url!r} is not a local absolute path", field="store_url", fix=_FIX)
        return LocalBlobStore(Path(path))
    if "://" in url:
        raise SpecError(f"unsupported store URL scheme {parts.scheme!r}", field="store_url", fix=_FIX)
    return LocalBlobStore(Path(url).expanduser())

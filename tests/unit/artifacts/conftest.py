"""Fixtures for the artifacts tests: every registered blob store (``artifacts.factory.STORES``) behind one
``backend`` fixture, each opened from its URL as Kiln opens it (``open_store``). A scheme registered without a
harness here fails every conformance test for it.

S3 runs against moto's server over real HTTP on 127.0.0.1 (one server per session, one bucket
per test, state reset afterwards), so the tests exercise botocore's wire path, not a mock.
"""

from __future__ import annotations

import os
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from artifacts import paths
from artifacts.factory import STORES, open_store
from artifacts.interfaces import BlobStore
from kiln.settings import Settings

WRITES = {"PutObject", "CopyObject", "CreateMultipartUpload", "UploadPart", "UploadPartCopy", "CompleteMultipartUpload"}


@dataclass
class Backend:
    """A store plus the backdoors a conformance test needs to check what the store did."""

    name: str
    store: BlobStore
    corrupt: Callable[[str, bytes], None]  # overwrite a committed blob's bytes behind the store's back
    leftovers: Callable[[], list[str]]  # staging entries (temp files, keys, open multipart uploads)
    fingerprint: Callable[[str], Any]  # changes whenever the committed blob is written again
    calls: list[tuple[str, str | None]] = field(default_factory=list)  # S3 only: (operation, key)
    client: Any = None  # S3 only: the boto3 client the store uses
    settings: Settings | None = None  # what the store was opened with (open_store(store.url, settings))

    def writes(self) -> Counter[str]:
        return Counter(op for op, _ in self.calls if op in WRITES)


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    from tests.s3server import moto_s3

    with moto_s3() as endpoint:
        yield endpoint


def local_backend(root: Path) -> Backend:
    settings = Settings()
    store = open_store(root.as_uri(), settings)

    def corrupt(digest: str, data: bytes) -> None:
        path = root / paths.blob_path(digest)
        path.chmod(0o644)
        path.write_bytes(data)

    def fingerprint(digest: str) -> tuple[int, int]:
        st = (root / paths.blob_path(digest)).stat()
        return st.st_ino, st.st_mtime_ns

    return Backend("file", store, corrupt, lambda: os.listdir(root / paths.UPLOADS_DIR), fingerprint,
                   settings=settings)


def s3_backend(endpoint: str) -> Backend:
    bucket = f"kiln-{uuid.uuid4().hex[:12]}"
    settings = Settings(s3_endpoint_url=endpoint)
    store: Any = open_store(f"s3://{bucket}/engines/test", settings)
    client = store._client  # the client the store made (its endpoint from the settings)
    client.create_bucket(Bucket=bucket)
    backend = Backend("s3", store, lambda d, b: None, lambda: [], lambda d: None, client=client, settings=settings)

    def record(params: dict[str, Any], model: Any, **_: Any) -> None:
        backend.calls.append((model.name, params.get("Key")))

    def corrupt(digest: str, data: bytes) -> None:
        client.put_object(Bucket=bucket, Key=paths.under(store.prefix, paths.blob_path(digest)), Body=data)

    def leftovers() -> list[str]:
        staged = client.list_objects_v2(Bucket=bucket, Prefix=paths.under(store.prefix, paths.UPLOADS_DIR))
        uploads = client.list_multipart_uploads(Bucket=bucket)
        return [o["Key"] for o in staged.get("Contents", [])] + [u["Key"] for u in uploads.get("Uploads", [])]

    def fingerprint(digest: str) -> int:
        key = paths.under(store.prefix, paths.blob_path(digest))
        return sum(1 for op, k in backend.calls if op in WRITES and k == key)

    client.meta.events.register("before-parameter-build.s3", record)
    backend.corrupt, backend.leftovers, backend.fingerprint = corrupt, leftovers, fingerprint
    return backend


def s3_harness(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    endpoint = request.getfixturevalue("s3_endpoint")

    def reset() -> None:  # drop every bucket so that large test blobs do not pile up in the server's memory
        urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST")).close()

    request.addfinalizer(reset)
    return s3_backend(endpoint)


#: how the conformance suite opens each registered scheme's store and reaches behind it (keyed as ``STORES``)
HARNESSES: dict[str, Callable[[pytest.FixtureRequest, Path], Backend]] = {
    "file": lambda request, tmp_path: local_backend(tmp_path / "store"),
    "s3": s3_harness,
}


@pytest.fixture(params=sorted(STORES))
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    scheme = request.param
    if scheme not in HARNESSES:
        pytest.fail(f"store scheme {scheme!r} is registered (artifacts/factory.py STORES) but has no conformance "
                    "harness: add one to HARNESSES in tests/unit/artifacts/conftest.py")
    return HARNESSES[scheme](request, tmp_path)


@pytest.fixture
def store(backend: Backend) -> BlobStore:
    return backend.store

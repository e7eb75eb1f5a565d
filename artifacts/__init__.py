"""Artifacts: where Kiln keeps bytes. A content-addressed blob store (one contract, local and S3
backends) and engine images built on it as valid OCI images (layers, config, manifest, referrers).

Nothing here knows about builds, tags or the database; callers hand in bytes and get digests.
``S3BlobStore`` is imported lazily so that local deployments never load boto3.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from artifacts.factory import open_store
from artifacts.interfaces import BlobInfo, BlobStore
from artifacts.local import LocalBlobStore
from artifacts.oci import (
    EMPTY_DESCRIPTOR,
    MEDIA_TYPE_EMPTY,
    MEDIA_TYPE_IMAGE_CONFIG,
    MEDIA_TYPE_IMAGE_INDEX,
    MEDIA_TYPE_IMAGE_LAYER,
    MEDIA_TYPE_IMAGE_MANIFEST,
    EngineImage,
    descriptor,
    pull_image,
    push_engine_image,
    push_referrer,
    read_config,
    read_manifest,
)
from artifacts.tarball import write_tar

if TYPE_CHECKING:
    from artifacts.s3 import S3BlobStore

__all__ = [
    "EMPTY_DESCRIPTOR",
    "MEDIA_TYPE_EMPTY",
    "MEDIA_TYPE_IMAGE_CONFIG",
    "MEDIA_TYPE_IMAGE_INDEX",
    "MEDIA_TYPE_IMAGE_LAYER",
    "MEDIA_TYPE_IMAGE_MANIFEST",
    "BlobInfo",
    "BlobStore",
    "EngineImage",
    "LocalBlobStore",
    "S3BlobStore",
    "descriptor",
    "open_store",
    "pull_image",
    "push_engine_image",
    "push_referrer",
    "read_config",
    "read_manifest",
    "write_tar",
]


def __getattr__(name: str) -> Any:
    if name == "S3BlobStore":
        from artifacts.s3 import S3BlobStore

        return S3BlobStore
    raise AttributeError(f"module 'artifacts' has no attribute {name!r}")

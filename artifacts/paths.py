"""The storage layout, computed here and nowhere else.

Every backend lays out its root (a directory, or an S3 bucket plus key prefix) the same way::

    <root>/
    ├── blobs/
    │   └── sha256/
    │       ├── 4413…aff8a        a committed blob, named by the hex of its sha256 digest;
    │       └── …                 written once, never modified, removed only by delete()
    └── uploads/
        ├── 7f0c…-…-…             a write in progress (temp file, staging key or multipart
        └── …                     upload); gone once the write commits or fails

Digests are the only keys: nothing in the layout is named after a model, tag or build, so the
same bytes are stored once however many engines share them. ``uploads/`` holds nothing a
reader may see; on S3 a lifecycle rule on it (expire objects, abort incomplete multipart
uploads after a day) sweeps up after writers that crashed mid-write.
"""

from __future__ import annotations

import uuid

from kiln.digests import DIGEST_RE, hex_of

BLOBS_DIR = "blobs/sha256"
UPLOADS_DIR = "uploads"


def blob_path(digest: str) -> str:
    """Where the blob named ``digest`` lives, relative to the root (raises InvalidDigest)."""
    return f"{BLOBS_DIR}/{hex_of(digest)}"


def upload_path(upload_id: str | None = None) -> str:
    """A fresh staging location under ``uploads/`` (a new uuid unless ``upload_id`` is given)."""
    return f"{UPLOADS_DIR}/{upload_id or uuid.uuid4()}"


def digest_of_blob_path(path: str) -> str | None:
    """The digest a root-relative blob path names, or None for anything that is not a blob."""
    head, _, name = path.rpartition("/")
    digest = f"sha256:{name}"
    return digest if head == BLOBS_DIR and DIGEST_RE.match(digest) else None


def under(prefix: str, path: str) -> str:
    """``path`` below a key prefix (``""`` for the bucket root), as an S3 key."""
    prefix = prefix.strip("/")
    return f"{prefix}/{path}" if prefix else path


def relative_to(prefix: str, key: str) -> str:
    """Inverse of :func:`under`: the root-relative path of an S3 key."""
    prefix = prefix.strip("/")
    return key[len(prefix) + 1 :] if prefix and key.startswith(prefix + "/") else key

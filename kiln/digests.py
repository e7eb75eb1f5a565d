"""Digests: the only storage keys. ``sha256:<64 lowercase hex>`` everywhere."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, BinaryIO

from kiln.errors import InvalidDigest

DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
CHUNK = 1 << 20


def parse_digest(value: str, *, field: str = "digest") -> str:
    """Return ``value`` if it is a well-formed sha256 digest, else raise InvalidDigest naming ``field``."""
    if not isinstance(value, str) or not DIGEST_RE.fullmatch(value):
        raise InvalidDigest(
            f"{value!r} is not a digest", field=field, fix="use the form sha256:<64 lowercase hex digits>"
        )
    return value


def hex_of(digest: str) -> str:
    return parse_digest(digest).split(":", 1)[1]


def sha256_bytes(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def sha256_stream(stream: BinaryIO) -> tuple[str, int]:
    h, size = hashlib.sha256(), 0
    while chunk := stream.read(CHUNK):
        h.update(chunk)
        size += len(chunk)
    return "sha256:" + h.hexdigest(), size


def sha256_file(path: Path) -> tuple[str, int]:
    with open(path, "rb") as f:
        return sha256_stream(f)


def canonical_json(obj: Any) -> bytes:
    """The one JSON encoding that keys are computed over: sorted keys, no whitespace, UTF-8."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def sha256_json(obj: Any) -> str:
    return sha256_bytes(canonical_json(obj))

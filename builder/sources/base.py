"""What every checkpoint source's I/O shares: the identified checkpoint, what reading may use (:class:`Access`),
an I/O table entry (:class:`SourceIO`), and the config.json and size rules."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kiln.errors import CheckpointNotFound, SpecError
from kiln.settings import Settings

#: config.json is read whole (it is small); anything bigger is not a model config.
MAX_CONFIG_BYTES = 16 << 20


@dataclass(frozen=True)
class ResolvedCheckpoint:
    ref: str
    kind: str  # the source's kind (kiln/sources.py): local | hf | s3
    digest: str  # content digest: the only way a checkpoint enters a key
    local_dir: Path | None  # a local directory at once; hf / s3 only once materialized (on a worker)
    revision: str | None = None  # the Hub commit sha for hf://
    files: list[dict] = field(default_factory=list)
    config: dict = field(default_factory=dict, compare=False)  # the parsed config.json
    size: int | None = None  # total bytes, where the metadata says so

    def provenance(self) -> dict:
        return {"ref": self.ref, "kind": self.kind, "digest": self.digest, "revision": self.revision,
                "files": len(self.files)}


@dataclass(frozen=True)
class Access:
    """What reading a checkpoint may use, and how much: the resolve cache, the S3 endpoint, the allowed ``s3://``
    buckets (None: any) and the most bytes one checkpoint may hold (None: no limit)."""

    cache_root: Path
    s3_endpoint_url: str | None = None
    buckets: list[str] | None = None
    max_bytes: int | None = None

    @classmethod
    def from_settings(cls, settings: Settings) -> "Access":
        return cls(settings.cache_dir / "resolve", settings.s3_endpoint_url, settings.buckets,
                   settings.checkpoint_max_bytes)


@dataclass(frozen=True)
class SourceIO:
    """A source kind's reading. ``identify``: (the checkpoint, whether a cached answer was used), no weights read;
    ``materialize``: the local folder holding exactly the identified content (None: identify's ``local_dir``
    already is); ``latest``: the revision a moving reference names now (None: no tracked model follows it)."""

    identify: Callable[[str, Access], tuple[ResolvedCheckpoint, bool]]
    materialize: Callable[[ResolvedCheckpoint, Access], Path] | None
    latest: Callable[[str, Access], str] | None = None


def parse_config(data: bytes, where: str) -> dict:
    if len(data) > MAX_CONFIG_BYTES:
        raise CheckpointNotFound(f"{where}: config.json is over {MAX_CONFIG_BYTES} bytes", field="checkpoint",
                                 fix="point at a Hugging Face format checkpoint (config.json is a small JSON object)")
    try:
        config = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        config = None
    if not isinstance(config, dict):
        raise CheckpointNotFound(f"{where}: config.json is not a JSON object", field="checkpoint",
                                 fix="point at a Hugging Face format checkpoint directory")
    return config


def read_config_file(path: Path, where: str) -> dict:
    with open(path, "rb") as f:
        return parse_config(f.read(MAX_CONFIG_BYTES + 1), where)


def too_big(ref: str, size: int, limit: int) -> SpecError:
    return SpecError(f"{ref!r} holds {size:,} bytes, over the {limit:,}-byte checkpoint limit", field="checkpoint",
                     fix="build a smaller checkpoint, or raise KILN_CHECKPOINT_MAX_BYTES on the service and workers")

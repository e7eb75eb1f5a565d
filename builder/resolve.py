"""Stage 1, resolve: turn a checkpoint reference into immutable content, in two steps, each its source's
(kiln/sources.py names the kinds; builder/sources/ reads them, one module per kind, in :data:`SOURCE_IO`):

**Identify** (cheap; the API runs it for ``POST /v1/builds`` and the webhook, workers run it again): the content
digest and the parsed ``config.json`` (family and size rules are checked from it before anything is enqueued),
never the weights — a local directory's file manifest hashed, a Hub reference's commit, an S3 prefix's listing.

**Materialize** (workers only): the identified content on local disk, bounded by the configured maximum
checkpoint size: a Hub snapshot of exactly the identified commit, or the S3 objects fetched with ``If-Match``
their identified ETag into ``<cache>/s3/<digest>``.

**Latest** (freshness): the revision a moving reference (a tracked Hub branch) names now.
"""

from __future__ import annotations

import importlib
from dataclasses import replace
from pathlib import Path

from builder.sources.base import Access, ResolvedCheckpoint, SourceIO
from builder.sources.local import file_manifest, stat_entries
from kiln.settings import Settings
from kiln.errors import SpecError
from kiln.sources import SOURCES, TRACKED, source_of

__all__ = ["SOURCE_IO", "ResolvedCheckpoint", "checkpoint_args", "file_manifest", "identify_checkpoint",
           "latest_revision", "materialize_checkpoint", "read_model_config", "resolve_checkpoint", "stat_entries"]

#: each checkpoint source's reading, by its kind: ``builder/sources/<kind>.py``'s ``IO`` for every kind of
#: kiln/sources.py SOURCES (a new source is its row there and its module here, nothing in this file)
SOURCE_IO: dict[str, SourceIO] = {kind: importlib.import_module(f"builder.sources.{kind}").IO for kind in SOURCES}


def checkpoint_args(settings: Settings) -> dict:
    """The keyword arguments below, as ``settings`` configures them."""
    access = Access.from_settings(settings)
    return {"cache_root": access.cache_root, "s3_endpoint_url": access.s3_endpoint_url, "buckets": access.buckets,
            "max_bytes": access.max_bytes}


def identify_checkpoint(ref: str, *, cache_root: Path, s3_endpoint_url: str | None = None,
                        buckets: list[str] | None = None, max_bytes: int | None = None
                        ) -> tuple[ResolvedCheckpoint, bool]:
    """The content identity and parsed config.json of ``ref``, without downloading weights; the flag says
    whether a cached answer was used (a local directory whose file stats are unchanged is not re-hashed).
    ``buckets``: the allowed s3:// buckets (None: any). Raises SpecError / CheckpointNotFound (bad input, 422)
    or StorageUnavailable."""
    access = Access(cache_root, s3_endpoint_url, buckets, max_bytes)
    return SOURCE_IO[source_of(ref).kind].identify(ref, access)


def materialize_checkpoint(resolved: ResolvedCheckpoint, *, cache_root: Path, s3_endpoint_url: str | None = None,
                           buckets: list[str] | None = None, max_bytes: int | None = None) -> ResolvedCheckpoint:
    """``resolved`` with ``local_dir`` holding exactly its identified content (downloaded on first use)."""
    materialize = SOURCE_IO[resolved.kind].materialize
    if materialize is None:
        return resolved
    return replace(resolved, local_dir=materialize(resolved, Access(cache_root, s3_endpoint_url, buckets, max_bytes)))


def resolve_checkpoint(ref: str, *, cache_root: Path, s3_endpoint_url: str | None = None,
                       buckets: list[str] | None = None, max_bytes: int | None = None
                       ) -> tuple[ResolvedCheckpoint, bool]:
    """Identify, then materialize (what a worker does)."""
    resolved, cached = identify_checkpoint(ref, cache_root=cache_root, s3_endpoint_url=s3_endpoint_url,
                                           buckets=buckets, max_bytes=max_bytes)
    return materialize_checkpoint(resolved, cache_root=cache_root, s3_endpoint_url=s3_endpoint_url,
                                  buckets=buckets, max_bytes=max_bytes), cached


def latest_revision(ref: str, *, cache_root: Path, s3_endpoint_url: str | None = None,
                    buckets: list[str] | None = None, max_bytes: int | None = None) -> str:
    """The revision ``ref`` names now (a tracked model's head); a SpecError for a source no model can follow."""
    source = source_of(ref)
    latest = SOURCE_IO[source.kind].latest
    if latest is None:
        raise SpecError(f"{ref!r} has no revisions to follow", field="checkpoint",
                        fix=f"give {TRACKED.format('org/name', 'branch')}")
    return latest(ref, Access(cache_root, s3_endpoint_url, buckets, max_bytes))


def read_model_config(resolved: ResolvedCheckpoint) -> dict:
    return resolved.config

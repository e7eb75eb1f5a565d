"""What a person types for an engine, to its index row: the full digest (``sha256:…``, optionally
``model@sha256:…``), a unique prefix of it (8 hex digits or more, with or without ``sha256:``, as ``git`` and
``docker`` take), or a tag (``repository:tag``, the ``tags`` table's current engine). Used by every CLI command
that takes an engine (report, artifacts show, pull, verify, keys resign)."""

from __future__ import annotations

import re

from sqlalchemy import select
from sqlalchemy.orm import Session

from kiln.digests import DIGEST_RE
from kiln.errors import ArtifactUnknown, InvalidDigest
from kiln.tables import Artifact, EngineName, Tag

MIN_PREFIX = 8
_PREFIX = re.compile(r"(?:sha256:)?([0-9a-f]{%d,64})" % MIN_PREFIX)
FIX = "give the full digest, a unique prefix of 8+ hex digits, or repository:tag (see kiln artifacts list)"


def find_engine(session: Session, ref: str, *, field: str = "digest") -> Artifact:
    """The one engine ``ref`` names; ``ArtifactUnknown`` (none), ``InvalidDigest`` (not a reference, or a prefix
    that several engines share, listed)."""
    ref = ref.strip()
    repository, _, digest = ref.rpartition("@")
    if DIGEST_RE.fullmatch(digest):
        row = session.get(Artifact, digest)
        if row is None or (repository and row.repository != repository and not _named(session, repository, digest)):
            raise ArtifactUnknown(f"no engine {ref} in this registry", field=field, fix=FIX)
        return row
    if (m := _PREFIX.fullmatch(ref.lower())) is not None:
        hits = list(session.scalars(select(Artifact).where(Artifact.digest.like(f"sha256:{m.group(1)}%")).limit(6)))
        if len(hits) == 1:
            return hits[0]
        if hits:
            shown = ", ".join(f"{a.digest[:19]}… ({a.repository}:{a.tag})" for a in hits[:5])
            raise InvalidDigest(f"{ref!r} is the start of {len(hits) if len(hits) < 6 else 'more than 5'} engines' "
                                f"digests: {shown}", field=field, fix="give more hex digits")
        raise ArtifactUnknown(f"no engine's digest starts with {m.group(1)}", field=field, fix=FIX)
    repo, sep, tag = ref.rpartition(":")
    if sep and repo and tag and "/" not in tag:
        tagged = session.get(Tag, (repo, tag))
        if tagged is None:
            raise ArtifactUnknown(f"no tag {ref}: nothing fresh and validated is tagged so in this registry",
                                  field=field, fix=FIX)
        artifact = session.get(Artifact, tagged.digest)
        if artifact is None:  # the engine went (gc) between the two reads
            raise ArtifactUnknown(f"the tag {ref} named {tagged.digest}, which this registry no longer holds",
                                  field=field, fix=FIX)
        return artifact
    raise InvalidDigest(f"{ref!r} names no engine", field=field, fix=FIX)


def _named(session: Session, repository: str, digest: str) -> bool:
    return session.get(EngineName, (repository, digest)) is not None

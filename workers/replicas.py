"""Engines in other registries (:class:`~kiln.tables.Replica`, recorded by ``kiln push`` and ``KILN_REPLICATE_TO``):
what the admission webhook reads about a reference to a registry that is not this one, and which copy
``kiln resolve --registry`` prints.

Kiln never reads those registries. Content addressing makes a manifest digest the same bytes in every registry, so
what Kiln's index says of a digest (status, signatures, the head it was built from) is what it says of the copy;
what the other registry's tags or contents say is not trusted. ``KILN_TRUSTED_REGISTRIES`` (``host[:port][/path]``,
comma separated) names places whose every image is a Kiln engine copied by other means (a mirror, ``skopeo copy``):
references there are judged by digest like recorded copies."""

from __future__ import annotations

import re
from dataclasses import dataclass

from sqlalchemy import Connection, bindparam, exists, select
from sqlalchemy.orm import Session

from artifacts.push import REPOSITORY_RE, parse_destination, registry_host
from kiln.errors import ArtifactUnknown, NameInvalid
from kiln.tables import Artifact, Replica

PLACE_FIX = "write host[:port][/path], comma separated, e.g. registry.example.com/team/engines,localhost:5000"
#: a URL (scheme://…) where a registry place (host[:port][/path]) is wanted
URL_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


@dataclass(frozen=True)
class Place:
    """A registry host and a repository path under it (``""``: the whole host)."""

    host: str  # in admission's spelling (artifacts.push.registry_host)
    path: str = ""

    def covers(self, host: str, repository: str) -> bool:
        return registry_host(host) == self.host and (
            not self.path or repository == self.path or repository.startswith(self.path + "/"))

    def __str__(self) -> str:
        return f"{self.host}/{self.path}" if self.path else self.host


def parse_place(text: str, *, field: str) -> Place:
    """``host[:port][/path]`` → :class:`Place`; :class:`NameInvalid` naming ``field`` otherwise."""
    text = text.strip().rstrip("/")
    host, _, path = text.partition("/")
    if "@" in text or URL_SCHEME.match(text) or not host:
        raise NameInvalid(f"{text!r} is not host[:port][/path]", field=field, fix=PLACE_FIX)
    try:
        parse_destination(f"{host}/x", field=field)  # a destination host's rules (a dot, a port, or localhost)
    except NameInvalid:
        raise NameInvalid(f"{text!r} does not start with a registry host (one with a dot, a port, or localhost)",
                          field=field, fix=PLACE_FIX) from None
    if path and (not REPOSITORY_RE.fullmatch(path) or len(path) > 255):
        raise NameInvalid(f"{path!r} in {text!r} is not a repository path (lowercase components separated by '/'; "
                          "no tag)", field=field, fix=PLACE_FIX)
    return Place(registry_host(host), path)


def trusted_registries(configured: str | None) -> tuple[Place, ...]:
    """``KILN_TRUSTED_REGISTRIES``, parsed (:class:`NameInvalid` naming it for an entry that is not a place)."""
    return tuple(parse_place(p, field="KILN_TRUSTED_REGISTRIES") for p in (configured or "").split(",") if p.strip())


@dataclass(frozen=True)
class ReplicaFacts:
    """What Kiln knows of one reference to another registry."""

    place: bool  # Kiln pushed some engine to this host/repository: every image there is judged
    recorded: bool  # Kiln pushed this digest there
    model: str | None  # the Kiln repository the digest stands for there (the record's, else its publisher's);
    #                    None: the digest is no Kiln engine


def _facts_statement():
    r, a = Replica.__table__, Artifact.__table__
    here = (r.c.host == bindparam("host")) & (r.c.repository == bindparam("repository"))
    return select(exists().where(here).label("place"),
                  select(r.c.model).where(here, r.c.digest == bindparam("digest")).scalar_subquery().label("recorded"),
                  select(a.c.repository).where(a.c.digest == bindparam("digest")).scalar_subquery().label("publisher"))


FACTS = _facts_statement()
DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")


def replica_facts(session: Session, host: str, repository: str, digest: str | None) -> ReplicaFacts:
    """One indexed statement: whether ``host/repository`` is a place Kiln pushes engines to, and what ``digest``
    is there."""
    digest = digest if digest and DIGEST_RE.match(digest) else None
    row = session.execute(FACTS, {"host": registry_host(host), "repository": repository, "digest": digest}).one()
    return ReplicaFacts(bool(row.place), row.recorded is not None, row.recorded or row.publisher)


def replica_reference(session: Session | Connection, digest: str, model: str, registry: str) -> str:
    """``host/repository@digest``: the copy of engine ``digest`` (resolve's answer for ``model``) that Kiln pushed
    under ``registry`` (``host[:port][/path]``): the one in exactly that repository, else in ``<path>/<model>``
    (where ``KILN_REPLICATE_TO`` puts it), else the latest pushed. :class:`ArtifactUnknown` naming ``registry``
    when Kiln pushed it nowhere there."""
    place = parse_place(registry, field="registry")
    r = Replica.__table__
    rows = [row for row in session.execute(select(r.c.host, r.c.repository, r.c.pushed_at)
                                           .where(r.c.digest == digest, r.c.host == place.host))
            if place.covers(row.host, row.repository)]
    if not rows:
        dest = str(place) if place.path else f"{place}/{model}"
        raise ArtifactUnknown(f"the engine {digest} of {model} has not been pushed to {place} (Kiln has no record "
                              "of a copy there)", field="registry",
                              fix=f"run kiln push {model}@{digest} {dest} (or set KILN_REPLICATE_TO), then resolve "
                                  "again")
    nested = f"{place.path}/{model}" if place.path else model
    best = max(rows, key=lambda x: (x.repository == place.path, x.repository == nested, x.pushed_at))
    return f"{best.host}/{best.repository}@{digest}"

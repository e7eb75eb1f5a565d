"""Which engine should a deployer run? Exactly one that is validated, not revoked, built from the tracked
model's current head, for the asked target, and loadable by the asked runtime — or a reason why none is.
A stale engine is never returned, not even while its replacement is building."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Connection, and_, bindparam, case, literal, select, true, union_all
from sqlalchemy.orm import Session

from kiln.errors import ArtifactUnknown, SpecError, by_code
from kiln.tables import Artifact, Build, EngineName, TrackedModel
from kiln.spec import BACKENDS, PRECISIONS
from kiln.targets import normalize_target
from kiln.toolchain import cpu_incompatibility


@dataclass(frozen=True)
class Servable:
    """The engine resolve answers with: what a deployer needs to pull it, and what it was built from."""

    digest: str
    repository: str
    tag: str | None
    status: str
    precision: str
    profile: str
    target: str
    backend: str
    checkpoint_revision: str | None
    provenance: dict


@dataclass
class Resolution:
    artifact: Servable | None
    status: int  # 200, 404 (nothing servable), 409 (something exists but must not be served)
    code: str
    reason: str
    signature: dict | None = None  # {signed, trusted, key, keys} of the answer (api/routes/models.py fills it)

    def error(self) -> ArtifactUnknown:
        """Why no engine is answered, as the domain error its ``code`` names (its row in api/errors.py gives the
        same status as ``status``)."""
        cls = by_code(self.code)
        cls = cls if cls is not None and issubclass(cls, ArtifactUnknown) else ArtifactUnknown
        return cls(self.reason, field="model", fix="wait for the build, or register/refresh the model")


def parse_runtime(runtime: str | None) -> dict[str, str]:
    """``tensorrt_llm=1.2.1,tensorrt=10.13.3`` → {name: version}."""
    if not runtime:
        return {}
    out = {}
    for part in runtime.split(","):
        name, sep, version = part.strip().partition("=")
        if not sep or not name or not version:
            raise SpecError(f"{part!r} is not name=version", field="runtime", fix="write e.g. tensorrt_llm=1.2.1,tensorrt=10.13.3")
        out[name.strip()] = version.strip()
    return out


def incompatibility(provenance: dict | None, runtime: dict[str, str]) -> str | None:
    """Engines load only on the exact toolchain that built them (TensorRT plan files check the version) — except
    the CPU, where an engine loads on the CPU it was compiled for and on any that has all it needs: ``cpu`` is
    matched by :func:`kiln.toolchain.cpu_incompatibility` (an AVX512 ``.so`` never goes to an AVX2 runtime, an
    AVX2 one may go to an AVX512 runtime)."""
    tc = (provenance or {}).get("toolchain", {})
    bad = []
    for k, v in runtime.items():
        if k == "cpu" and tc.get(k):
            if (why := cpu_incompatibility(tc[k], v)) is not None:
                bad.append(f"cpu {tc[k]} (asked {v}: {why})")
        elif tc.get(k) != v:
            bad.append(f"{k} {tc.get(k, 'absent')} (asked {v})")
    return "built with " + ", ".join(bad) if bad else None


def _variant_statement():
    """One statement (one round trip, one snapshot): whether the model is tracked, its head, and the engines of
    one variant named in the repository (published there, or named there from another repository: EngineName),
    newest first. Provenance is read for fresh engines only and the validation report not at all: a model can
    have many stale engines, and resolve is the hottest read of the service. Built once, with bound parameters
    (building a statement costs more than running it)."""
    a, m, n = Artifact.__table__, TrackedModel.__table__, EngineName.__table__
    model = bindparam("model")
    variant = and_(a.c.precision == bindparam("precision"), a.c.profile == bindparam("profile"),
                   a.c.target == bindparam("target"), a.c.backend == bindparam("backend"))
    columns = (a.c.digest, a.c.tag, a.c.status, a.c.checkpoint_revision, a.c.created_at,
               case((a.c.status == "fresh", a.c.provenance)).label("provenance"))
    own = select(*columns).where(a.c.repository == model, variant)
    named = select(*columns).select_from(n.join(a, a.c.digest == n.c.digest)).where(n.c.repository == model, variant)
    e = union_all(own, named).subquery()
    anchor = select(literal(1).label("one")).subquery()  # one row, so that an unknown model still answers
    return (select(m.c.name, m.c.head_sha, e.c.digest, e.c.tag, e.c.status, e.c.checkpoint_revision, e.c.provenance)
            .select_from(anchor.outerjoin(m, m.c.name == model).outerjoin(e, true()))
            .order_by(e.c.created_at.desc()))


VARIANT = _variant_statement()
BUILDING = (select(Build.__table__.c.id, Build.__table__.c.status, Build.__table__.c.spec)
            .where(Build.__table__.c.status.in_(("queued", "running"))))


def resolve_engine(session: Session | Connection, *, model: str, precision: str, profile: str, target: str, backend: str,
                   runtime: str | None = None) -> Resolution:
    if precision not in PRECISIONS:
        raise SpecError(f"{precision!r} is not a precision", field="precision", fix=f"use one of {', '.join(PRECISIONS)}")
    if backend not in BACKENDS:
        raise SpecError(f"{backend!r} is not a backend", field="backend", fix=f"use one of {', '.join(BACKENDS)}")
    canonical, err = normalize_target(target)
    if err:
        raise SpecError(err["message"], field="target", fix=err["fix"])
    assert canonical is not None  # normalize_target answers a target or an error
    wanted = parse_runtime(runtime)
    rows = session.execute(VARIANT, {"model": model, "precision": precision, "profile": profile,
                                     "target": canonical, "backend": backend}).all()
    tracked, head = rows[0].name is not None, rows[0].head_sha
    rows = [r for r in rows if r.digest is not None]
    fresh = [a for a in rows if a.status == "fresh" and (head is None or a.checkpoint_revision == head)]
    compatible = [a for a in fresh if incompatibility(a.provenance, wanted) is None]
    if compatible:
        a = compatible[0]
        return Resolution(Servable(a.digest, model, a.tag, a.status, precision, profile, canonical, backend,
                                   a.checkpoint_revision, a.provenance or {}), 200, "ok", "fresh")
    what = f"{model} {precision} {profile} {canonical} {backend}"
    if fresh:
        return Resolution(None, 409, "incompatible_runtime",
                          f"fresh engines for {what} exist but none loads on {runtime}: "
                          + "; ".join(f"{a.digest[:19]}… {incompatibility(a.provenance, wanted)}" for a in fresh[:3]))
    building = _building(session, model, precision, canonical, backend, profile)
    if any(a.status in ("fresh", "stale") for a in rows):
        why = f"only stale engines for {what} (the head is {head})" if head else f"only stale engines for {what}"
        at_head = sorted({a.status for a in rows if head and a.checkpoint_revision == head} - {"stale"})
        if at_head:
            why += f"; the head's engines are {', '.join(at_head)}"
        return Resolution(None, 409, "stale_only", why + (f"; {building}" if building else "; no build is running"))
    if building:
        return Resolution(None, 404, "building", f"no fresh engine for {what} yet; {building}")
    if rows:
        states = sorted({a.status for a in rows})
        return Resolution(None, 404, "none_servable", f"engines for {what} exist but are {', '.join(states)}")
    return Resolution(None, 404, "not_built", f"no engine for {what} has been built"
                      + ("" if tracked else f"; model {model!r} is not tracked"))


def _building(session: Session | Connection, model: str, precision: str, target: str, backend: str,
              profile: str) -> str | None:
    for b in session.execute(BUILDING):
        s = b.spec or {}
        if (s.get("model_name"), s.get("precision"), s.get("target"), s.get("backend"),
                (s.get("profile") or {}).get("name")) == (model, precision, target, backend, profile):
            return f"build {b.id} is {b.status} for {s.get('checkpoint')}"
    return None


def _profile_name(profile) -> str | None:
    return profile.get("name") if isinstance(profile, dict) else profile


def servable_grid(session: Session, model: str | None = None) -> list[dict]:
    """What is servable now, per model × precision × target: for every cell, each variant (profile, backend) that
    the model's tracked matrix asks for or that has an engine, answered by :func:`resolve_engine` — its servable
    engine, or the code and reason resolve gives for none. A cell with no variant at all says so. Models are
    the tracked ones and every repository with an engine (published or named there); ``model`` keeps one."""
    variants: dict[str, dict[tuple[str, str], set[tuple[str, str]]]] = {}

    def add(repo: str, precision, target, profile, backend) -> None:
        if model is not None and repo != model:
            return
        cells = variants.setdefault(repo, {})
        if not all(isinstance(v, str) and v for v in (precision, target, profile, backend)):
            return
        canonical, err = normalize_target(target)
        cells.setdefault((precision, canonical or target), set()).add((profile, backend))  # None: err

    for m in session.scalars(select(TrackedModel)):
        if model in (None, m.name):
            variants.setdefault(m.name, {})  # a tracked model shows even before its first engine
        for e in m.matrix or []:
            if isinstance(e, dict):
                add(m.name, e.get("precision"), e.get("target"), _profile_name(e.get("profile", "latency")),
                    e.get("backend"))
    a, n = Artifact.__table__, EngineName.__table__
    own = select(a.c.repository, a.c.precision, a.c.target, a.c.profile, a.c.backend)
    named = select(n.c.repository, a.c.precision, a.c.target, a.c.profile, a.c.backend).select_from(
        n.join(a, a.c.digest == n.c.digest))
    for row in session.execute(union_all(own, named)).all():
        add(*row)

    out = []
    for name in sorted(variants):
        cells = variants[name]
        precisions = sorted({p for p, _ in cells}, key=lambda p: (list(PRECISIONS).index(p) if p in PRECISIONS else 99, p))
        targets = sorted({t for _, t in cells})
        rows = []
        for precision in precisions:
            for target in targets:
                engines: list[dict] = []
                reasons: list[dict] = []
                for profile, backend in sorted(cells.get((precision, target), ())):
                    try:
                        r = resolve_engine(session, model=name, precision=precision, profile=profile, target=target,
                                           backend=backend)
                    except SpecError as exc:
                        reasons.append({"profile": profile, "backend": backend, "code": exc.code, "reason": exc.message})
                        continue
                    if r.artifact is not None:
                        engines.append({"profile": profile, "backend": backend, "digest": r.artifact.digest,
                                        "tag": r.artifact.tag})
                    else:
                        reasons.append({"profile": profile, "backend": backend, "code": r.code, "reason": r.reason})
                if not engines and not reasons:
                    reasons.append({"profile": None, "backend": None, "code": "not_built",
                                    "reason": f"no engine for {name} {precision} {target} has been built, and the "
                                              "model's matrix asks for none"})
                rows.append({"precision": precision, "target": target, "servable": bool(engines),
                             "engines": engines, "reasons": reasons})
        out.append({"model": name, "precisions": precisions, "targets": targets, "cells": rows})
    return out

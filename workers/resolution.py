"""Which engine should a deployer run? Exactly one that is validated, not revoked, built from the tracked
model's current head, for the asked target, and loadable by the asked runtime — or a reason why none is.
A stale engine is never returned, not even while its replacement is building."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from kiln.errors import SpecError
from kiln.models import Artifact, Build, TrackedModel
from kiln.spec import BACKENDS, PRECISIONS, normalize_target


@dataclass
class Resolution:
    artifact: Artifact | None
    status: int  # 200, 404 (nothing servable), 409 (something exists but must not be served)
    code: str
    reason: str


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


def incompatibility(artifact: Artifact, runtime: dict[str, str]) -> str | None:
    """Engines load only on the exact toolchain that built them (TensorRT plan files check the version)."""
    tc = (artifact.provenance or {}).get("toolchain", {})
    bad = [f"{k} {tc.get(k, 'absent')} (asked {v})" for k, v in runtime.items() if tc.get(k) != v]
    return "built with " + ", ".join(bad) if bad else None


def resolve_engine(session: Session, *, model: str, precision: str, profile: str, target: str, backend: str,
                   runtime: str | None = None) -> Resolution:
    if precision not in PRECISIONS:
        raise SpecError(f"{precision!r} is not a precision", field="precision", fix=f"use one of {', '.join(PRECISIONS)}")
    if backend not in BACKENDS:
        raise SpecError(f"{backend!r} is not a backend", field="backend", fix=f"use one of {', '.join(BACKENDS)}")
    canonical, err = normalize_target(target)
    if err:
        raise SpecError(err["message"], field="target", fix=err["fix"])
    wanted = parse_runtime(runtime)
    tracked = session.get(TrackedModel, model)
    head = tracked.head_sha if tracked else None
    rows = session.scalars(select(Artifact).where(
        Artifact.repository == model, Artifact.precision == precision, Artifact.profile == profile,
        Artifact.target == canonical, Artifact.backend == backend).order_by(Artifact.created_at.desc())).all()
    what = f"{model} {precision} {profile} {canonical} {backend}"
    building = _building(session, model, precision, canonical, backend, profile)
    fresh = [a for a in rows if a.status == "fresh" and (head is None or a.checkpoint_revision == head)]
    compatible = [a for a in fresh if incompatibility(a, wanted) is None]
    if compatible:
        return Resolution(compatible[0], 200, "ok", "fresh")
    if fresh:
        return Resolution(None, 409, "incompatible_runtime",
                          f"fresh engines for {what} exist but none loads on {runtime}: "
                          + "; ".join(f"{a.digest[:19]}… {incompatibility(a, wanted)}" for a in fresh[:3]))
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


def _building(session: Session, model: str, precision: str, target: str, backend: str, profile: str) -> str | None:
    for b in session.scalars(select(Build).where(Build.status.in_(("queued", "running")))):
        s = b.spec or {}
        if (s.get("model_name"), s.get("precision"), s.get("target"), s.get("backend"),
                (s.get("profile") or {}).get("name")) == (model, precision, target, backend, profile):
            return f"build {b.id} is {b.status} for {s.get('checkpoint')}"
    return None

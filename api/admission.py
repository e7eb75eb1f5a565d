"""The admission decision: may this Pod (or workload's pod template) run the engine images it names?

Kubernetes sends an ``admission.k8s.io/v1`` AdmissionReview; :func:`review` answers one, echoing the request's
``uid``. Every image reference that names this registry — containers, init containers, ephemeral containers and
image volumes (``spec.volumes[].image.reference``) — is checked. Hosts are compared in one spelling
(:func:`registry_host`); with no ``KILN_REGISTRY_HOSTS`` every image is denied.

A reference to another registry is a *copy* of a Kiln engine (workers/replicas.py) when its digest is a Kiln engine,
or when it lies where Kiln pushed engines (a recorded ``kiln push`` / ``KILN_REPLICATE_TO`` repository) or in a
``KILN_TRUSTED_REGISTRIES`` place. A copy is judged by its digest, as Kiln's index knows it (the same digest is the
same bytes in every registry; the other registry is never read): by tag → always denied (Kiln cannot know where
another registry's tag points); a digest Kiln never published → denied; otherwise the verdicts below, with the
staleness of the Kiln repository the copy stands for; and a digest Kiln did not push to that repository, outside
the trusted places → denied. Any other reference (another registry's images) passes untouched.
Verdicts, per reference:

- by tag → denied (a tag can move under a running deployment), unless tags are allowed (then resolved once);
- unknown, rejected or revoked digest → denied, with the reason;
- stale (built from a checkpoint head the tracked branch has left) → denied, unless the pod carries
  ``kiln.dev/allow-stale: <reason>``, which is returned as a warning;
- built for another GPU architecture than the pod's node selection (``kiln.dev/sm`` or
  ``nvidia.com/gpu.product``, in ``nodeSelector`` or required node affinity) → denied;
- a ``cpu`` engine whose pod does not require nodes that can load it (the architecture, and node-feature-discovery's
  CPUID labels for what its code was compiled to use beyond AVX2: kiln/toolchain.node_requirements) → denied,
  naming the labels to select;
- unsigned, or signed by a key that is not trusted → denied.

The decision is a pure function of the review and the facts :func:`engine_facts` reads: one indexed statement per
reference (the engine row, the head of the tracked model the reference's repository is — the rule resolve
applies, whichever repository published the engine —, its signature referrers' key annotations). Crypto is not
redone here: the index names the key that signed at publish, and `kiln pull --verify-key` checks the bytes.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from sqlalchemy import and_, bindparam, select
from sqlalchemy.orm import Session

from artifacts.push import registry_host
from builder.attest import SIGNATURE_KEY_ANNOTATION, SIGNED_TYPES
from kiln.backends import BACKENDS
from kiln.tables import Artifact, Referrer, Tag, TrackedModel
from kiln.targets import PRODUCT_LABEL, SM_LABEL, sm_of_product
from kiln.toolchain import node_requirements
from workers.replicas import Place, ReplicaFacts

ALLOW_STALE = "kiln.dev/allow-stale"
WORKLOADS = {"Pod": (), "Deployment": ("spec", "template"), "StatefulSet": ("spec", "template"),
             "DaemonSet": ("spec", "template"), "ReplicaSet": ("spec", "template"), "Job": ("spec", "template"),
             "CronJob": ("spec", "jobTemplate", "spec", "template")}
DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")


@dataclass(frozen=True)
class EngineFacts:
    """What admission needs to know about one engine digest."""

    digest: str
    status: str  # fresh | stale | revoked | rejected
    reason: str | None
    target: str
    revision: str | None
    head: str | None  # the head of the repository the pod names (as resolve judges), None when it is untracked
    signed_by: frozenset[str] = field(default_factory=frozenset)  # keys that signed both files and provenance
    cpu: str | None = None  # the CPU a cpu engine was compiled on (its toolchain's ``cpu`` entry)


@dataclass(frozen=True)
class ImageRef:
    where: str  # e.g. "containers[0] (server)", "volumes[1] (engine)"
    reference: str
    host: str | None
    repository: str
    tag: str | None
    digest: str | None


def parse_reference(ref: str) -> tuple[str | None, str, str | None, str | None]:
    """``[host[:port]/]repo[:tag][@sha256:…]`` → (host, repository, tag, digest), as container runtimes split
    it (the first component is a host when it has a dot or a colon, or is ``localhost``)."""
    name, _, digest = ref.partition("@")
    host: str | None
    host, slash, rest = name.partition("/")
    if not slash or not ("." in host or ":" in host or host == "localhost"):
        host, rest = None, name
    repo, colon, tag = rest.rpartition(":")
    if not colon or "/" in tag:
        repo, tag = rest, ""
    return (host.lower() if host else None), repo, (tag or None), (digest or None)


def registry_hosts(configured: str | None) -> set[str]:
    """``KILN_REGISTRY_HOSTS`` (``host[:port]``, comma separated), each in :func:`registry_host`'s spelling."""
    return {registry_host(h) for h in (configured or "").split(",") if h.strip()}


def _dig(obj: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        obj = obj.get(key) if isinstance(obj, dict) else None
    return obj


def _list(value: Any) -> list:
    return value if isinstance(value, list) else []


def _dict(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


def pod_template(review_request: dict) -> tuple[dict, dict] | None:
    """(pod metadata, pod spec) of the request's object, or None for a kind that holds no pod."""
    kind = _dig(review_request, ("kind", "kind"))
    if not isinstance(kind, str) or kind not in WORKLOADS or not isinstance(review_request.get("object"), dict):
        return None
    template = _dig(review_request["object"], WORKLOADS[kind]) if WORKLOADS[kind] else review_request["object"]
    if not isinstance(template, dict):
        return None
    return _dict(template.get("metadata")), _dict(template.get("spec"))


def image_refs(spec: dict) -> Iterator[tuple[str, str]]:
    """(where, reference) for every image a pod spec names."""
    for group in ("initContainers", "containers", "ephemeralContainers"):
        for i, c in enumerate(_list(spec.get(group))):
            if isinstance(c, dict) and isinstance(c.get("image"), str):
                yield f"{group}[{i}] ({c.get('name', '?')})", c["image"]
    for i, v in enumerate(_list(spec.get("volumes"))):
        ref = _dig(v, ("image", "reference"))
        if isinstance(ref, str):
            yield f"volumes[{i}] ({_dict(v).get('name', '?')})", ref


def asked_sms(spec: dict) -> tuple[set[str], list[str]]:
    """The GPU architectures the pod's node selection allows (empty: no GPU constraint) and notes for labels
    that name GPUs this mapping does not know."""
    values: dict[str, list[str]] = {SM_LABEL: [], PRODUCT_LABEL: []}
    for k, v in _dict(spec.get("nodeSelector")).items():
        if k in values and isinstance(v, str):
            values[k].append(v)
    terms = _dig(spec, ("affinity", "nodeAffinity", "requiredDuringSchedulingIgnoredDuringExecution",
                        "nodeSelectorTerms"))
    for term in _list(terms):
        for expr in _list(_dict(term).get("matchExpressions")):
            if isinstance(expr, dict) and expr.get("key") in values and expr.get("operator") == "In":
                values[expr["key"]] += [v for v in _list(expr.get("values")) if isinstance(v, str)]
    sms, notes = {v.strip().lower() for v in values[SM_LABEL]}, []
    for product in values[PRODUCT_LABEL]:
        if (sm := sm_of_product(product)) is None:
            notes.append(f"{PRODUCT_LABEL}={product} is a GPU kiln does not know; its architecture is not checked")
        else:
            sms.add(sm)
    return sms, notes


def requires(spec: dict, label: str, value: str) -> bool:
    """Whether the pod's node selection admits only nodes with ``label=value``: in ``nodeSelector``, or in every
    term of its required node affinity (terms are alternatives; one without it would admit other nodes) by ``In``
    with only that value or, for NFD's ``true`` labels, ``Exists``."""
    if _dict(spec.get("nodeSelector")).get(label) == value:
        return True
    terms = _list(_dig(spec, ("affinity", "nodeAffinity", "requiredDuringSchedulingIgnoredDuringExecution",
                              "nodeSelectorTerms")))

    def term_requires(term) -> bool:
        for expr in _list(_dict(term).get("matchExpressions")):
            if not isinstance(expr, dict) or expr.get("key") != label:
                continue
            if expr.get("operator") == "In" and _list(expr.get("values")) == [value]:
                return True
            if expr.get("operator") == "Exists" and value == "true":
                return True
        return False

    return bool(terms) and all(term_requires(t) for t in terms)


def verdict(ref: ImageRef, facts: EngineFacts | None, *, sms: set[str], allow_stale: str | None,
            trusted: set[str], spec: dict | None = None) -> tuple[str | None, str | None]:
    """(denial, warning) for one reference of this registry."""
    what = f"{ref.where}: {ref.reference}"
    if facts is None:
        return f"{what}: no engine with this digest in the registry", None
    if facts.status == "rejected":
        return f"{what}: the engine failed validation (rejected){_why(facts.reason)}", None
    if facts.status == "revoked":
        return f"{what}: the engine is revoked{_why(facts.reason)}", None
    if not facts.signed_by:
        return f"{what}: the engine is unsigned", None
    if not facts.signed_by & trusted:
        return f"{what}: the engine is signed by {', '.join(sorted(facts.signed_by))}, not a trusted key", None
    if facts.target.startswith("sm") and sms and facts.target not in sms:
        return (f"{what}: the engine is built for {facts.target} but the pod selects "
                f"{', '.join(sorted(sms))} (engines load only on the architecture that built them)"), None
    if facts.target == "cpu" and facts.cpu:
        missing = {k: v for k, v in node_requirements(facts.cpu).items() if not requires(spec or {}, k, v)}
        if missing:
            return (f"{what}: the engine is compiled for {facts.cpu}; require nodes that can load it in the pod's "
                    f"nodeSelector: " + ", ".join(f"{k}: \"{v}\"" for k, v in missing.items())
                    + " (node-feature-discovery's CPUID labels; kubernetes.io/arch is the kubelet's)"), None
    stale = facts.status == "stale" or (facts.head is not None and facts.revision != facts.head)
    if stale:
        why = f"built from {facts.revision}, the tracked head is {facts.head}" if facts.head else "stale"
        if allow_stale:
            return None, f"{what} is stale ({why}); admitted by {ALLOW_STALE}: {allow_stale}"
        return f"{what}: the engine is stale ({why}); set the annotation {ALLOW_STALE}: <reason> to run it anyway", None
    return None, None


def copy_verdict(ref: ImageRef, replicas: Callable[[ImageRef], ReplicaFacts] | None, places: tuple[Place, ...],
                 lookup: Callable[[ImageRef], EngineFacts | None], **rules: Any) -> tuple[str | None, str | None]:
    """(denial, warning) for a reference to another registry: (None, None) when it is no copy of a Kiln engine
    (not Kiln's to judge), else judged as the module's doc says."""
    host = ref.host or "docker.io"
    if ref.host is None:  # Docker Hub, as container runtimes read it: docker.io, library/ for one component
        ref = replace(ref, host=host,
                      repository=ref.repository if "/" in ref.repository else f"library/{ref.repository}")
    place = next((p for p in places if p.covers(host, ref.repository)), None)
    facts = replicas(ref) if replicas is not None else ReplicaFacts(False, False, None)
    if place is None and not facts.place and facts.model is None:
        return None, None
    where = f"{registry_host(host)}/{ref.repository}"
    if ref.digest is None:
        return (f"{ref.where}: {ref.reference} names a Kiln engine in another registry by tag, which Kiln cannot "
                f"check (that registry's tag can move); use {where}@sha256:… (kiln resolve … --registry {where} "
                "prints it)"), None
    if not DIGEST_RE.match(ref.digest):
        return f"{ref.where}: {ref.reference} has a malformed digest", None
    if facts.model is None:
        return (f"{ref.where}: {ref.reference}: no Kiln engine has this digest ({where} is "
                f"{'a place Kiln pushes engines to' if facts.place else f'trusted for Kiln engines ({place})'}; "
                "only digests Kiln published are admitted)"), None
    as_engine = replace(ref, repository=facts.model, tag=None)  # judged as the Kiln repository it stands for
    denial, warning = verdict(as_engine, lookup(as_engine), **rules)
    if denial is None and not facts.recorded and place is None:
        return (f"{ref.where}: {ref.reference} is a Kiln engine ({facts.model}) that Kiln did not push to {where}; "
                f"run kiln push {ref.digest} {where}, or add the registry to KILN_TRUSTED_REGISTRIES"), None
    return denial, warning


def _why(reason: str | None) -> str:
    return f": {reason}" if reason else ""


def review(body: Any, *, hosts: set[str], allow_tags: bool, trusted: set[str],
           lookup: Callable[[ImageRef], EngineFacts | None],
           replicas: Callable[[ImageRef], ReplicaFacts] | None = None,
           trusted_registries: tuple[Place, ...] = ()) -> dict[str, Any]:
    """The AdmissionReview answering ``body``. ``hosts``: this registry's host names (:func:`registry_hosts`);
    a reference whose host is one of them in another spelling is judged the same; with none, every image is
    denied. ``lookup`` reads one reference's facts (by digest, or by tag when tags are allowed; its
    ``repository`` is the Kiln repository whose head judges staleness). ``replicas`` reads what Kiln knows of a
    reference to another registry (None: nothing, no copy is recorded); ``trusted_registries``:
    ``KILN_TRUSTED_REGISTRIES``. ``ValueError`` when ``body`` is not an AdmissionReview request."""
    if not isinstance(body, dict) or body.get("kind") != "AdmissionReview" or not isinstance(body.get("request"), dict):
        raise ValueError("not an AdmissionReview with a request")
    request = body["request"]
    uid = request.get("uid")
    if not isinstance(uid, str) or not uid:
        raise ValueError("request.uid is missing")
    denials, warnings = [], []
    found = pod_template(request) if request.get("operation", "CREATE") in ("CREATE", "UPDATE", "CONNECT") else None
    if found is not None:
        meta, spec = found
        annotations = {**_dict(_dig(request["object"], ("metadata", "annotations"))), **_dict(meta.get("annotations"))}
        allow_stale = str(annotations.get(ALLOW_STALE) or "").strip() or None
        sms, notes = asked_sms(spec)
        warnings += notes
        for where, reference in image_refs(spec):
            host, repository, tag, digest = parse_reference(reference)
            if not hosts:  # which references are this registry's is not known: none can be judged
                denials.append(f"{where}: {reference} cannot be checked: KILN_REGISTRY_HOSTS is not set on the "
                               "Kiln API, so the webhook does not know this registry's host names")
                continue
            ref = ImageRef(where, reference, host, repository, tag, digest)
            if host is None or registry_host(host) not in hosts:
                denial, warning = copy_verdict(ref, replicas, trusted_registries, lookup, sms=sms,
                                               allow_stale=allow_stale, trusted=trusted, spec=spec)
                denials += [denial] if denial else []
                warnings += [warning] if warning else []
                continue
            if digest is None and not allow_tags:
                denials.append(f"{where}: {reference} names an engine by tag; use {host}/{repository}@sha256:… "
                               "(a tag can move under a running deployment)")
                continue
            if digest is not None and not DIGEST_RE.match(digest):
                denials.append(f"{where}: {reference} has a malformed digest")
                continue
            denial, warning = verdict(ref, lookup(ref), sms=sms, allow_stale=allow_stale, trusted=trusted, spec=spec)
            if denial:
                denials.append(denial)
            if warning:
                warnings.append(warning)
    response: dict[str, Any] = {"uid": uid, "allowed": not denials}
    if denials:
        response["status"] = {"code": 403, "reason": "Forbidden",
                              "message": "kiln denied this pod: " + "; ".join(denials)}
    if warnings:
        response["warnings"] = [w[:1000] for w in warnings]
    version = body.get("apiVersion") if body.get("apiVersion") in ("admission.k8s.io/v1", "admission.k8s.io/v1beta1") \
        else "admission.k8s.io/v1"
    return {"apiVersion": version, "kind": "AdmissionReview",
            "response": response}


def _facts_statement():
    a, m, r = Artifact.__table__, TrackedModel.__table__, Referrer.__table__
    return (select(a.c.digest, a.c.status, a.c.status_reason, a.c.target, a.c.checkpoint_revision, m.c.head_sha,
                   r.c.artifact_type, r.c.annotations, a.c.backend,
                   a.c.provenance[("toolchain", "cpu")].as_string().label("cpu"))
            .select_from(a.outerjoin(m, m.c.name == bindparam("repository"))
                         .outerjoin(r, and_(r.c.subject == a.c.digest, r.c.artifact_type.in_(SIGNED_TYPES))))
            .where(a.c.digest == bindparam("digest")))


FACTS = _facts_statement()
TAG_DIGEST = select(Tag.__table__.c.digest).where(Tag.__table__.c.repository == bindparam("repository"),
                                                   Tag.__table__.c.name == bindparam("tag"))


def signed_keys(rows) -> frozenset[str]:
    """Keys that signed both the engine files and the provenance, from (artifact_type, annotations) rows."""
    by_type: dict[str, set[str]] = {t: set() for t in SIGNED_TYPES}
    for artifact_type, notes in rows:
        if artifact_type in by_type and isinstance(notes, dict) and notes.get(SIGNATURE_KEY_ANNOTATION):
            by_type[artifact_type].add(notes[SIGNATURE_KEY_ANNOTATION])
    return frozenset(set.intersection(*by_type.values()))


def engine_facts(session: Session, ref: ImageRef) -> EngineFacts | None:
    """The facts of one reference: one indexed statement (plus the tag's row when it names a tag)."""
    digest = ref.digest
    if digest is None:
        digest = session.execute(TAG_DIGEST, {"repository": ref.repository, "tag": ref.tag}).scalar()
        if digest is None:
            return None
    rows = session.execute(FACTS, {"digest": digest, "repository": ref.repository}).all()
    if not rows:
        return None
    first = rows[0]
    return EngineFacts(first.digest, first.status, first.status_reason, first.target, first.checkpoint_revision,
                       first.head_sha, signed_keys((r.artifact_type, r.annotations) for r in rows),
                       first.cpu if first.backend in BACKENDS and BACKENDS[first.backend].cpu_native else None)


def signature_summary(session: Session, digest: str, trusted: set[str]) -> dict[str, Any]:
    """``{signed, key, keys, trusted}`` of one engine, for /v1/artifacts and /v1/resolve."""
    rows = session.execute(select(Referrer.artifact_type, Referrer.annotations).where(
        Referrer.subject == digest, Referrer.artifact_type.in_(SIGNED_TYPES))).all()
    keys = signed_keys((r.artifact_type, r.annotations) for r in rows)
    good = sorted(keys & trusted)
    return {"signed": bool(keys), "trusted": bool(good), "key": good[0] if good else min(keys, default=None),
            "keys": sorted(keys)}

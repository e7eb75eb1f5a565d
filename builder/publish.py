"""Stage 5, publish: content-addressed blobs, then the manifest, then the referrer carrying provenance and the
validation report, then the index row — in that order, so nothing half-written is ever visible (a reader finds
an engine only through the index row, written last)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, cast

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from artifacts.interfaces import BlobStore, Survey
from artifacts.oci import MEDIA_TYPE_IMAGE_MANIFEST, descriptor, push_engine_image, push_referrer
from artifacts.signing import Signer, configured_signer
from builder.attest import sign_engine
from kiln.backends import BACKENDS, default_backend
from kiln.errors import ArtifactUnknown
from kiln.tables import Artifact, Referrer, TrackedModel
from kiln.sources import LOCAL, local_path, source_link, source_of, written_path
from kiln.spec import BuildSpec
from kiln.states import add_artifact, initial_artifact_status, move_artifact, name_engine
from kiln.targets import CPU
from kiln.toolchain import ABSENT
from validation.report import REPORT_TYPE, report_document, to_json
from validation.validate import judge_naming

PROVENANCE_TYPE = "application/vnd.kiln.provenance.v1+json"
ANNOTATION_PREFIX = "dev.kiln"


def tag_for(spec: BuildSpec) -> str:
    suffix = "" if spec.backend == default_backend(spec.target) else f"-{spec.backend}"
    return f"{spec.precision}-{spec.target}-{spec.batch_profile.name}{suffix}"


def _source_url(ref: str) -> str:
    """Where the checkpoint came from, as a URL a registry UI can link (its source's rule, kiln/sources.py); a
    local checkpoint as :func:`_public_ref`."""
    return _public_ref(ref) if source_of(ref) is LOCAL else source_link(ref)


def _public_ref(ref: str) -> str:
    """The checkpoint reference an engine's annotations show: a local checkpoint's folder name alone
    (``file:tiny``), never the worker's absolute path; other references as given."""
    return f"file:{local_path(ref).name}" if source_of(ref) is LOCAL else ref


def public_paths(spec: BuildSpec) -> dict[str, str]:
    """The absolute local paths a spec names — a local checkpoint, dataset and task files — each with the form an
    engine's published records show instead (``file:<name>``, as :func:`_public_ref`): what identifies them is
    their content digest, recorded beside them, not where they lay on the worker."""
    out = {}
    if source_of(spec.checkpoint) is LOCAL:
        out[str(local_path(spec.checkpoint))] = _public_ref(spec.checkpoint)
    for name in (spec.calibration.dataset, spec.evaluation.dataset, *spec.evaluation.tasks):
        if (written := written_path(name)) is not None:
            path = local_path(name)
            out[str(path)] = out.get(str(path)) or f"file:{path.name}"
            if written.rstrip("/") != str(path):  # as given (not resolved) too: the spec records it so
                out[written.rstrip("/")] = f"file:{path.name}"
    return out


def without_paths(doc: Any, paths: dict[str, str]) -> Any:
    """``doc`` (JSON-like) with every occurrence of each path of :func:`public_paths` — alone, as ``file://…`` or
    as the folder of a longer path — replaced by its public form, in every string, keys included."""
    if not paths:
        return doc
    pattern = re.compile("(?:file://)?(" + "|".join(re.escape(p) for p in sorted(paths, key=len, reverse=True))
                         + r")(?![^/\s\"',;:)\]}])")

    def scrub(value: Any) -> Any:
        if isinstance(value, str):
            return pattern.sub(lambda m: paths[m[1]], value)
        if isinstance(value, dict):
            return {scrub(k): scrub(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [scrub(v) for v in value]
        return value
    return scrub(doc)


def runtime_for(spec: BuildSpec, toolchain: dict) -> str:
    """What loads this engine, as its backend's descriptor says (``Backend.runtime``): the toolchain entries that
    bind it, in resolve's ``runtime=`` form (a TensorRT engine: TensorRT-LLM and TensorRT; an AOTInductor package:
    torch, and for a ``cpu`` one the CPU it needs, kiln/toolchain.py ``host_cpu``), or the runtimes with serving
    configs (a checkpoint)."""
    backend = BACKENDS[spec.backend]
    if backend.runtime:
        parts = [f"{name}={toolchain.get(name, ABSENT)}" for name in backend.runtime]
        if backend.cpu_native and spec.target == CPU and toolchain.get("cpu"):  # or a CPU with more features
            parts.append(f"cpu={toolchain['cpu']}")
        return ",".join(parts)
    from builder.serving import ANNOTATION_NAMES, served_by

    return ",".join(ANNOTATION_NAMES[r] for r in served_by(spec))


def annotations_for(spec: BuildSpec, build_key: str, provenance: dict, passed: bool) -> dict[str, str]:
    """Standard OCI annotations and Kiln's own, so a registry UI or a policy engine can read an engine's
    identity without Kiln (``org.opencontainers.image.revision`` is the checkpoint's commit, or its content
    digest where it has none)."""
    checkpoint = provenance["checkpoint"]
    return {
        "org.opencontainers.image.title": spec.model_name or "",
        "org.opencontainers.image.version": tag_for(spec),
        "org.opencontainers.image.created": provenance["created"],
        "org.opencontainers.image.source": _source_url(checkpoint["ref"]),
        "org.opencontainers.image.revision": checkpoint.get("revision") or checkpoint["digest"],
        f"{ANNOTATION_PREFIX}.engine.target": spec.target,
        f"{ANNOTATION_PREFIX}.engine.precision": spec.precision,
        f"{ANNOTATION_PREFIX}.engine.recipe": spec.rungs[0],  # the recipe built (a built spec names one)
        f"{ANNOTATION_PREFIX}.engine.profile": spec.batch_profile.name,
        f"{ANNOTATION_PREFIX}.engine.backend": spec.backend,
        f"{ANNOTATION_PREFIX}.engine.runtime": runtime_for(spec, provenance["toolchain"]),
        f"{ANNOTATION_PREFIX}.build-key": build_key,
        f"{ANNOTATION_PREFIX}.checkpoint.digest": provenance["checkpoint"]["digest"],
        f"{ANNOTATION_PREFIX}.checkpoint.ref": _public_ref(checkpoint["ref"]),
        f"{ANNOTATION_PREFIX}.precision": spec.precision,
        f"{ANNOTATION_PREFIX}.target": spec.target,
        f"{ANNOTATION_PREFIX}.backend": spec.backend,
        f"{ANNOTATION_PREFIX}.profile": json.dumps(spec.batch_profile.model_dump(), sort_keys=True),
        f"{ANNOTATION_PREFIX}.toolchain": json.dumps(provenance["toolchain"], sort_keys=True),
        f"{ANNOTATION_PREFIX}.validation.passed": str(passed).lower(),
    }


def is_stale_now(session: Session, repository: str, revision: str | None, *, lock: bool = False) -> bool:
    """True when ``repository`` is a tracked model whose head is no longer ``revision``. ``lock``: hold the
    model's row (FOR UPDATE; SQLite's write lock does the same) until the caller commits."""
    model = session.get(TrackedModel, repository, with_for_update=lock or None, populate_existing=lock)
    return model is not None and model.head_sha is not None and revision != model.head_sha


def rejection_reason(validation: dict) -> str:
    """Why an engine is rejected, in a line: the gates it failed, each with its value and threshold."""
    failed = [g for g in validation.get("gates") or [] if isinstance(g, dict) and not g.get("passed")]
    if not failed:
        return "validation did not pass"
    return "failed " + "; ".join(f"{g.get('name')}: {_num(g.get('value'))} against the threshold {_num(g.get('threshold'))}"
                                 for g in failed)


def _num(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def publish(store: BlobStore, sessions: sessionmaker[Session], engine_dir: Path, *, spec: BuildSpec,
            build_key: str, provenance: dict, validation: dict, request_key: str | None = None,
            layer_survey: dict[str, Survey] | None = None, signer: Signer | None = None) -> Artifact:
    repository = cast(str, spec.model_name)  # parse_spec sets it: the checkpoint's name unless the spec names one
    passed = bool(validation.get("passed"))
    annotations = annotations_for(spec, build_key, provenance, passed)
    # what the published records show of the worker's files: their names and digests, never their absolute paths
    paths = public_paths(spec)
    provenance, validation = without_paths(provenance, paths), without_paths(validation, paths)
    labels = {k: v for k, v in annotations.items() if k.startswith(ANNOTATION_PREFIX)}
    image = push_engine_image(store, engine_dir, annotations=annotations, labels=labels, layer_survey=layer_survey)
    payload = json.dumps({"provenance": provenance, "validation": validation}, sort_keys=True, indent=1).encode()
    ref_annotations = {f"{ANNOTATION_PREFIX}.build-key": build_key}
    ref_digest = push_referrer(store, descriptor(MEDIA_TYPE_IMAGE_MANIFEST, image.digest, image.size),
                               artifact_type=PROVENANCE_TYPE, payload=payload, payload_media_type=PROVENANCE_TYPE,
                               annotations=ref_annotations, title="provenance.json")
    report = to_json(report_document(image.digest, repository=repository, tag=tag_for(spec),
                                     provenance=provenance, validation=validation)).encode()
    report_digest = push_referrer(store, descriptor(MEDIA_TYPE_IMAGE_MANIFEST, image.digest, image.size),
                                  artifact_type=REPORT_TYPE, payload=report, payload_media_type=REPORT_TYPE,
                                  annotations=ref_annotations, title="report.json")
    signed = sign_engine(store, signer or configured_signer(), manifest_digest=image.digest, manifest_size=image.size,
                         layer_digests=[layer.digest for layer in image.layers], engine_dir=engine_dir,
                         repository=repository, provenance=provenance, validation=validation,
                         annotations=ref_annotations)
    row = Artifact(
        digest=image.digest, build_key=build_key, request_key=request_key, repository=repository, tag=tag_for(spec),
        precision=spec.precision, target=spec.target,
        profile=spec.batch_profile.name, backend=spec.backend, checkpoint_ref=_public_ref(spec.checkpoint),
        checkpoint_digest=provenance["checkpoint"]["digest"], checkpoint_revision=provenance["checkpoint"]["revision"],
        size=image.size + sum(layer.size for layer in image.layers), provenance=provenance, validation=validation,
    )
    with sessions() as session:
        try:  # any statement may meet the same key published first (autoflush): all of it is in the try
            # stale: the tracked branch moved while this engine was building
            row.status = initial_artifact_status(
                passed=passed, stale=is_stale_now(session, repository, provenance["checkpoint"]["revision"]))
            if row.status == "rejected":
                row.status_reason = rejection_reason(validation)
            add_artifact(session, row, reason=f"published {build_key}")  # a fresh engine takes its tag
            session.flush()
            # The head may have moved after the read above and before this transaction began to write (its
            # mark_stale then did not see this row): read it again, now that the row is written and the model's
            # row held, so that one of the two transactions always sees the other.
            if row.status == "fresh" and is_stale_now(session, repository, row.checkpoint_revision, lock=True):
                move_artifact(session, row, "stale", reason=f"the tracked branch moved while {build_key} published")
            session.add(Referrer(digest=ref_digest, subject=image.digest, repository=repository,
                                 artifact_type=PROVENANCE_TYPE, size=store.stat(ref_digest).size,
                                 annotations=ref_annotations))
            session.add(Referrer(digest=report_digest, subject=image.digest, repository=repository,
                                 artifact_type=REPORT_TYPE, size=store.stat(report_digest).size,
                                 annotations=ref_annotations))
            for ref in signed:  # the engine files' signature and the signed provenance (builder/attest.py)
                session.add(Referrer(subject=image.digest, repository=repository, **ref))
            session.commit()
            return row
        except IntegrityError:  # someone published the same key first: theirs answers (named here too)
            session.rollback()
            theirs = session.scalars(select(Artifact).where(Artifact.build_key == build_key)).one()
    if theirs.repository == repository:
        return theirs
    judge_naming(sessions, spec, provenance.get("data"), theirs, provenance.get("gates") or {})
    return name_in_repository(sessions, theirs.digest, repository)


def name_in_repository(sessions: sessionmaker[Session], digest: str, repository: str) -> Artifact:
    """Name the engine ``digest`` in ``repository`` too (and its tag there, when it is servable there): a
    build for ``repository`` whose BuildKey another repository's engine already has gets the same bytes under
    a second name, not an answer from the other repository alone."""
    for attempt in (1, 2):  # two requests naming it at once: the second finds the first's name and retries
        with sessions() as session:
            artifact = session.get(Artifact, digest)
            if artifact is None:  # collected since it was found
                raise ArtifactUnknown(f"engine {digest} was removed while it was being named in {repository}",
                                      field="checkpoint", fix="submit the build again")
            try:
                name_engine(session, artifact, repository, reason=f"the same build as {artifact.repository}@{digest}")
                session.commit()
            except IntegrityError:
                session.rollback()
                if attempt == 2:
                    raise
                continue
            session.refresh(artifact)
            session.expunge(artifact)
            return artifact
    raise AssertionError("unreachable")

"""Signing an engine at publish (and again on rotation): two referrers of the engine image, both made with the
configured key (:mod:`artifacts.signing`).

- **the engine files' signature**: an OpenSSF ``model_signing`` bundle over the files of the engine layer — what
  ``kiln pull`` writes as ``model.sig`` and ``model_signing verify key`` checks with no Kiln code;
- **the provenance**: an in-toto Statement v1 with a SLSA Provenance v1 predicate (subject: the manifest and
  layer digests; build definition: spec, checkpoint, datasets, toolchain; run details: Kiln version, worker,
  times; the validation summary and gate verdicts as a byproduct), signed as a DSSE envelope.

Each referrer's annotations name the key (``dev.kiln.signature.key``: its fingerprint), so the index can say
who signed an engine without reading a blob.
"""

from __future__ import annotations

import json
import socket
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from artifacts.interfaces import BlobStore
from artifacts.oci import MEDIA_TYPE_IMAGE_MANIFEST, descriptor, push_referrer
from artifacts.signing import (BUNDLE_TYPE, DSSE_TYPE, IN_TOTO_PAYLOAD_TYPE, SIGNATURE_FILE, SLSA_PROVENANCE,
                               STATEMENT_TYPE, Signer, dsse_sign)

SIGNATURE_KEY_ANNOTATION = "dev.kiln.signature.key"
SIGNED_TYPES = (BUNDLE_TYPE, IN_TOTO_PAYLOAD_TYPE)
BUILD_TYPE = "https://kiln.dev/engine-build/v1"


def _hex(digest: str | None) -> str | None:
    return digest.split(":", 1)[1] if isinstance(digest, str) and digest.startswith("sha256:") else None


def provenance_statement(manifest_digest: str, layer_digests: list[str], *, repository: str | None,
                         provenance: dict, validation: dict, worker: str | None = None,
                         signed_at: datetime | None = None) -> dict[str, Any]:
    """The in-toto Statement (SLSA Provenance v1) of one engine image. ``provenance`` is what the build recorded
    (tolerant of older, thinner records); ``validation`` its report."""
    ckpt = provenance.get("checkpoint") or {}
    deps: list[dict[str, Any]] = []
    ckpt_digest = {k: v for k, v in (("sha256", _hex(ckpt.get("digest"))), ("gitCommit", ckpt.get("revision")))
                   if v}
    deps.append({"uri": ckpt.get("ref"), "name": "checkpoint", "digest": ckpt_digest,
                 "annotations": {"kind": ckpt.get("kind"), "revision": ckpt.get("revision"), "files": ckpt.get("files")}})
    for role, digest in sorted((provenance.get("data") or {}).items()):
        spec_part = (provenance.get("spec") or {}).get("evaluation" if "eval" in role else "calibration") or {}
        deps.append({"uri": spec_part.get("dataset") or f"kiln:{role}", "name": f"dataset:{role}",
                     "digest": {"sha256": _hex(digest)} if _hex(digest) else {}})
    for name, version in sorted((provenance.get("toolchain") or {}).items()):
        deps.append({"uri": f"pkg:pypi/{name}@{version}", "name": f"toolchain:{name}", "annotations": {"version": version}})
    signed_at = signed_at or datetime.now(timezone.utc)
    finished = provenance.get("created")
    seconds = sum(float(s.get("seconds") or 0) for s in provenance.get("stages") or [] if isinstance(s, dict))
    started = None
    if isinstance(finished, str):
        try:
            started = (datetime.strptime(finished, "%Y-%m-%dT%H:%M:%SZ") - timedelta(seconds=seconds)).strftime(
                "%Y-%m-%dT%H:%M:%SZ")
        except ValueError:
            started = None
    gates = [{k: g.get(k) for k in ("name", "value", "threshold", "passed")}
             for g in validation.get("gates") or [] if isinstance(g, dict)]
    return {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": f"{repository or 'engine'}@manifest", "digest": {"sha256": _hex(manifest_digest)}}]
        + [{"name": f"layer{i}", "digest": {"sha256": _hex(d)}} for i, d in enumerate(layer_digests)],
        "predicateType": SLSA_PROVENANCE,
        "predicate": {
            "buildDefinition": {
                "buildType": BUILD_TYPE,
                "externalParameters": {"spec": provenance.get("spec"), "repository": repository},
                "internalParameters": {k: provenance.get(k) for k in ("build_key", "quantize_key", "compile_key",
                                                                       "recipe", "gates")},
                "resolvedDependencies": deps,
            },
            "runDetails": {
                "builder": {"id": f"https://kiln.dev/worker/{worker or socket.gethostname()}",
                            "version": {"kiln": str(provenance.get("kiln"))}},
                "metadata": {"invocationId": provenance.get("build_key"), "startedOn": started,
                             "finishedOn": finished},
                "byproducts": [{"name": "validation", "annotations": {
                    "passed": bool(validation.get("passed")), "metrics": validation.get("metrics") or {},
                    "gates": gates, "signedOn": signed_at.strftime("%Y-%m-%dT%H:%M:%SZ")}}],
            },
        },
    }


def sign_engine(store: BlobStore, signer: Signer, *, manifest_digest: str, manifest_size: int,
                layer_digests: list[str], engine_dir: Path, repository: str | None, provenance: dict,
                validation: dict, annotations: dict[str, str]) -> list[dict[str, Any]]:
    """Push the two signed referrers of an engine image whose files are ``engine_dir``; the rows to index
    (``digest, artifact_type, size, annotations``), in push order. The subject must be stored already."""
    subject = descriptor(MEDIA_TYPE_IMAGE_MANIFEST, manifest_digest, manifest_size)
    ann = {**annotations, SIGNATURE_KEY_ANNOTATION: signer.fingerprint}
    bundle = signer.sign_files(engine_dir)
    statement = provenance_statement(manifest_digest, layer_digests, repository=repository,
                                     provenance=provenance, validation=validation)
    payload = json.dumps(statement, sort_keys=True, separators=(",", ":")).encode()
    envelope = json.dumps(dsse_sign(signer, IN_TOTO_PAYLOAD_TYPE, payload), sort_keys=True).encode()
    rows = []
    for artifact_type, body, media_type, title in ((BUNDLE_TYPE, bundle, BUNDLE_TYPE, SIGNATURE_FILE),
                                                   (IN_TOTO_PAYLOAD_TYPE, envelope, DSSE_TYPE, "provenance.dsse.json")):
        digest = push_referrer(store, subject, artifact_type=artifact_type, payload=body,
                               payload_media_type=media_type, annotations=ann, title=title)
        rows.append({"digest": digest, "artifact_type": artifact_type, "size": store.stat(digest).size,
                     "annotations": ann})
    return rows

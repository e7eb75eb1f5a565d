"""An engine built from a local checkpoint names it, its dataset and its task files by folder or file name and
content digest in every published record, never by the worker's absolute path (docs/security.md): the manifest's
annotations, the engine layer, the provenance referrer, the signed provenance (DSSE), the report, the index row,
and what the API serves of them. A real build of examples/tiny-llama (checkpoint backend)."""

from __future__ import annotations

import base64
import gzip
import json
import shutil

import pytest
from fastapi.testclient import TestClient

from kiln.spec import parse_spec
from tests.conftest import TINY

pytestmark = pytest.mark.slow
PLACE = "kiln-private-place-7f3a9c"  # in the absolute path of everything the build reads, and nowhere else


def texts(blob: bytes) -> list[str]:
    """A blob as text, and what it carries inside: a gzipped layer's bytes, a DSSE envelope's payload."""
    raw = gzip.decompress(blob) if blob[:2] == b"\x1f\x8b" else blob
    out = [raw.decode("utf-8", "replace")]
    try:
        doc = json.loads(raw)
    except ValueError:
        return out
    if isinstance(doc, dict) and isinstance(doc.get("payload"), str):
        out.append(base64.b64decode(doc["payload"]).decode("utf-8", "replace"))
    return out


def test_a_local_build_publishes_no_absolute_path(tmp_path, monkeypatch):
    from workers.services import build_services

    where = tmp_path / PLACE / "models"
    checkpoint = where / "tiny"
    shutil.copytree(TINY, checkpoint)
    (where / "heldout.txt").write_text((TINY.parent.parent / "README.md").read_text()[:20000])
    home = tmp_path / "home"
    monkeypatch.setenv("KILN_HOME", str(home))
    monkeypatch.setenv("KILN_CHECKPOINT_ROOTS", str(where))
    services = build_services(upgrade_embedded=True)
    settings, store, sessions = services.settings, services.store, services.sessions
    spec = parse_spec({"checkpoint": f"file://{checkpoint}", "precision": "fp8", "target": "cpu",
                       "backend": "checkpoint", "calibration": {"samples": 8, "seq_len": 64},
                       "evaluation": {"max_tokens": 1024, "dataset": str(where / "heldout.txt")},
                       "override_reason": "a test build: a short evaluation"}, settings.roots)
    assert PLACE in spec.checkpoint  # the build itself reads the worker's path

    from builder.pipeline import Builder

    out = Builder(settings, store, sessions).build(spec).to_dict()
    digest = out["artifact"]["digest"]

    # every blob of the store: the manifest and its annotations, the engine layer, provenance.json, report.json,
    # the signature bundle and the DSSE-signed provenance
    blobs = [p for p in (home / "store").rglob("*") if p.is_file()]
    assert len(blobs) >= 6
    found = [str(p) for p in blobs if any(PLACE in t for t in texts(p.read_bytes()))]
    assert not found, f"the worker's path is in {found}"

    # what the records say instead: the folder's name, the content digest beside it
    from artifacts.oci import read_manifest

    annotations = read_manifest(store, digest)["annotations"]
    assert annotations["dev.kiln.checkpoint.ref"] == annotations["org.opencontainers.image.source"] == "file:tiny"
    with sessions() as s:
        from kiln.tables import Artifact

        row = s.get(Artifact, digest)
        record = json.dumps({**row.summary(), "provenance": row.provenance, "validation": row.validation})
        assert row.provenance["checkpoint"]["ref"] == row.provenance["spec"]["checkpoint"] == "file:tiny"
        assert row.provenance["spec"]["evaluation"]["dataset"] == "file:heldout.txt"
        assert row.provenance["checkpoint"]["digest"].startswith("sha256:")
        assert row.checkpoint_ref == "file:tiny"
    assert PLACE not in record

    # as the API serves it: the engine's JSON, its report and the registry's referrers
    from api.app import create_app

    client = TestClient(create_app(settings, enqueue=lambda *a: None))
    for path in (f"/v1/artifacts/{digest}", f"/v1/artifacts/{digest}/report.html", f"/v2/tiny/manifests/{digest}",
                 f"/v2/tiny/referrers/{digest}"):
        r = client.get(path)
        assert r.status_code == 200 and PLACE not in r.text, (path, r.status_code)

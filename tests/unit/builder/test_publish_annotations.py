"""Every published engine manifest carries the standard OCI annotations and Kiln's ``dev.kiln.engine.*`` ones,
so a registry UI or a policy engine reads an engine's identity without Kiln; the image config's labels carry
Kiln's too (what ``docker inspect`` / ``skopeo inspect`` show)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from artifacts.factory import open_store
from artifacts.oci import read_manifest
from builder.publish import publish
from kiln import db
from kiln.spec import parse_spec

STANDARD = ("created", "source", "revision", "version", "title")
KILN = ("target", "precision", "profile", "backend", "runtime")


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@pytest.fixture
def registry(tmp_path: Path):
    url = f"sqlite:///{tmp_path / 'kiln.db'}"
    db.upgrade(url)
    return open_store(f"file://{tmp_path / 'store'}"), db.session_factory(url)


@pytest.mark.parametrize("backend,target,ref,revision,toolchain,runtime", [
    ("checkpoint", "sm90", f"hf://acme/tiny@{'a' * 40}", "a" * 40, {"torch": "2.13"},
     "tensorrt-llm-pytorch,vllm,sglang"),
    ("trtllm-engine", "sm90", f"hf://acme/tiny@{'b' * 40}", "b" * 40,
     {"torch": "2.9", "tensorrt_llm": "1.2.1", "tensorrt": "10.13.3"}, "tensorrt_llm=1.2.1,tensorrt=10.13.3"),
    ("aot-inductor", "cpu", "/ckpt/tiny", None, {"torch": "2.13.0+cpu"}, "torch=2.13.0+cpu"),
])
def test_published_manifest_carries_standard_and_kiln_annotations(registry, tmp_path, backend, target, ref,
                                                                    revision, toolchain, runtime):
    store, sessions = registry
    spec = parse_spec({"checkpoint": ref if ref.startswith("hf://") else f"hf://acme/tiny@{'c' * 40}",
                       "model_name": "acme/tiny", "precision": "fp8", "profile": "balanced", "backend": backend,
                       "target": target}, [])
    engine = tmp_path / "engine"
    engine.mkdir()
    (engine / "config.json").write_text("{}")
    digest = sha(b"checkpoint content")
    provenance = {"created": "2026-12-01T00:00:00Z", "toolchain": toolchain,
                  "checkpoint": {"ref": ref, "digest": digest, "revision": revision}}
    row = publish(store, sessions, engine, spec=spec, build_key=sha(backend.encode()), provenance=provenance,
                  validation={"passed": True})
    manifest = read_manifest(store, row.digest)
    a = manifest["annotations"]
    for key in STANDARD:
        assert a[f"org.opencontainers.image.{key}"], key
    for key in KILN:
        assert a[f"dev.kiln.engine.{key}"], key
    assert a["org.opencontainers.image.created"] == "2026-12-01T00:00:00Z"
    assert a["org.opencontainers.image.title"] == "acme/tiny"
    assert a["org.opencontainers.image.version"] == row.tag
    assert a["org.opencontainers.image.source"] == ("https://huggingface.co/acme/tiny" if ref.startswith("hf://")
                                                    else "file:///ckpt/tiny")
    assert a["org.opencontainers.image.revision"] == (revision or digest)  # no commit: the content digest
    assert (a["dev.kiln.engine.target"], a["dev.kiln.engine.precision"], a["dev.kiln.engine.profile"],
            a["dev.kiln.engine.backend"], a["dev.kiln.engine.runtime"]) == (target, "fp8", "balanced", backend, runtime)
    labels = json.loads(store.get_bytes(manifest["config"]["digest"]))["config"]["Labels"]
    assert all(labels[f"dev.kiln.engine.{k}"] == a[f"dev.kiln.engine.{k}"] for k in KILN)

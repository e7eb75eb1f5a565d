"""Every published engine manifest carries the standard OCI annotations and Kiln's ``dev.kiln.engine.*`` ones,
so a registry UI or a policy engine reads an engine's identity without Kiln; the image config's labels carry
Kiln's too (what ``docker inspect`` / ``skopeo inspect`` show)."""

from __future__ import annotations

import base64
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
KILN = ("target", "precision", "profile", "backend", "runtime", "recipe")


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
    ("aot-inductor", "cpu", "/ckpt/tiny", None, {"torch": "2.13.0+cpu", "cpu": "x86_64-AVX512+avx512_bf16+bf16"},
     "torch=2.13.0+cpu,cpu=x86_64-AVX512+avx512_bf16+bf16"),  # what resolve --runtime matches the CPU with
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
                                                    else "file:tiny")  # a local folder's name, not its path
    assert a["dev.kiln.checkpoint.ref"] == (ref if ref.startswith("hf://") else "file:tiny")
    assert "/ckpt" not in json.dumps(a)
    assert a["org.opencontainers.image.revision"] == (revision or digest)  # no commit: the content digest
    assert (a["dev.kiln.engine.target"], a["dev.kiln.engine.precision"], a["dev.kiln.engine.profile"],
            a["dev.kiln.engine.backend"], a["dev.kiln.engine.runtime"]) == (target, "fp8", "balanced", backend, runtime)
    assert a["dev.kiln.engine.recipe"] == "fp8"  # auto's first rung, the recipe this engine was built with
    labels = json.loads(store.get_bytes(manifest["config"]["digest"]))["config"]["Labels"]
    assert all(labels[f"dev.kiln.engine.{k}"] == a[f"dev.kiln.engine.{k}"] for k in KILN)


@pytest.mark.parametrize("backend,target,tag", [
    ("aot-inductor", "cpu", "fp8-cpu-latency"), ("checkpoint", "cpu", "fp8-cpu-latency-checkpoint"),
    ("trtllm-engine", "sm90", "fp8-sm90-latency-trtllm-engine"), ("checkpoint", "sm90", "fp8-sm90-latency-checkpoint"),
    ("aot-inductor", "sm90", "fp8-sm90-latency"),
])
def test_a_tag_names_precision_target_and_profile_and_the_backend_unless_it_is_the_targets_default(backend, target, tag):
    from builder.publish import tag_for

    spec = parse_spec({"checkpoint": f"hf://acme/tiny@{'a' * 40}", "precision": "fp8", "backend": backend,
                       "target": target}, [])
    assert tag_for(spec) == tag


def test_source_urls_runtimes_and_json_annotations_are_exact():
    from builder.publish import _source_url, annotations_for, runtime_for

    assert _source_url("hf://acme/tiny@refs@odd") == "https://huggingface.co/acme/tiny"
    assert _source_url("s3://bucket/prefix") == "s3://bucket/prefix"
    assert _source_url("/ckpt/tiny") == _source_url("file:///ckpt/tiny") == "file:tiny"  # never the path
    spec = parse_spec({"checkpoint": f"hf://acme/tiny@{'a' * 40}", "precision": "fp8", "backend": "trtllm-engine",
                       "target": "sm90"}, [])
    assert runtime_for(spec, {}) == "tensorrt_llm=absent,tensorrt=absent"
    cpu = parse_spec({"checkpoint": f"hf://acme/tiny@{'a' * 40}", "precision": "fp8"}, [])
    assert runtime_for(cpu, {}) == "torch=absent"
    toolchain = {"torch": "2.13", "modelopt": "0.47"}
    prov = {"created": "2026-01-01T00:00:00Z", "toolchain": toolchain,
            "checkpoint": {"ref": cpu.checkpoint, "digest": "sha256:" + "c" * 64, "revision": "a" * 40}}
    notes = annotations_for(cpu, "sha256:" + "d" * 64, prov, True)
    assert notes["dev.kiln.profile"] == json.dumps(cpu.batch_profile.model_dump(), sort_keys=True)
    assert notes["dev.kiln.profile"].index("max_num_tokens") < notes["dev.kiln.profile"].index("max_seq_len")  # sorted
    assert notes["dev.kiln.toolchain"] == '{"modelopt": "0.47", "torch": "2.13"}'
    assert notes["org.opencontainers.image.title"] == "acme/tiny"
    assert (notes["dev.kiln.validation.passed"], annotations_for(cpu, "sha256:" + "d" * 64, prov, False)[
        "dev.kiln.validation.passed"]) == ("true", "false")


def test_a_rejected_engine_records_the_gates_it_failed():
    from builder.publish import rejection_reason

    gates = [{"name": "perplexity", "value": 31.25678, "threshold": 20.0, "passed": False},
             {"name": "top1_agreement", "value": 0.97, "threshold": 0.9, "passed": True},
             {"name": "throughput_drop", "value": 0.35, "threshold": 0.2, "passed": False}]
    assert rejection_reason({"passed": False, "gates": gates}) == (
        "failed perplexity: 31.26 against the threshold 20; throughput_drop: 0.35 against the threshold 0.2")
    assert rejection_reason({"passed": False, "gates": [{"name": "n", "value": 3, "threshold": 2, "passed": False}]}) \
        == "failed n: 3 against the threshold 2"
    assert rejection_reason({"gates": [{"name": "n", "value": None, "threshold": "x", "passed": False}]}) \
        == "failed n: None against the threshold x"
    assert rejection_reason({"passed": False}) == rejection_reason({"passed": False, "gates": gates[1:2]}) \
        == "validation did not pass"


def published(registry, tmp_path, *, build_key: str, model: str = "acme/tiny", revision: str = "a" * 40,
              validation: dict | None = None, request_key: str | None = None):
    store, sessions = registry
    spec = parse_spec({"checkpoint": f"hf://acme/tiny@{revision}", "model_name": model, "precision": "fp8",
                       "profile": "balanced", "target": "cpu"}, [])
    engine = tmp_path / f"engine-{build_key[-6:]}-{model.replace('/', '_')}"
    engine.mkdir()
    (engine / "config.json").write_text(json.dumps({"key": build_key}))
    (engine / "rank0.bin").write_bytes(b"\x00" * 4096)
    provenance = {"created": "2026-12-01T00:00:00Z", "toolchain": {"torch": "2.13"},
                  "checkpoint": {"ref": spec.checkpoint, "digest": sha(b"ckpt"), "revision": revision}}
    validation = validation if validation is not None else {"passed": True, "gates": []}
    row = publish(store, sessions, engine, spec=spec, build_key=build_key, provenance=provenance,
                  validation=validation, request_key=request_key)
    return row, spec, provenance, validation


def test_publish_indexes_the_engine_its_tag_and_every_referrer_exactly(registry, tmp_path):
    from artifacts.signing import BUNDLE_TYPE, IN_TOTO_PAYLOAD_TYPE
    from builder.publish import PROVENANCE_TYPE
    from kiln.tables import Artifact, Referrer, Tag, TagEvent
    from validation.report import REPORT_TYPE

    store, sessions = registry
    key = sha(b"build")
    row, spec, provenance, validation = published(registry, tmp_path, build_key=key, request_key=sha(b"request"))
    manifest = read_manifest(store, row.digest)
    assert (manifest["annotations"]["dev.kiln.build-key"], manifest["annotations"]["dev.kiln.validation.passed"]) == (
        key, "true")
    size = store.stat(row.digest).size + sum(layer["size"] for layer in manifest["layers"])
    with sessions() as s:
        a = s.get(Artifact, row.digest)
        assert (a.build_key, a.request_key, a.repository, a.tag, a.precision, a.target, a.profile, a.backend) == (
            key, sha(b"request"), "acme/tiny", "fp8-cpu-balanced", "fp8", "cpu", "balanced", "aot-inductor")
        assert (a.checkpoint_ref, a.checkpoint_digest, a.checkpoint_revision) == (spec.checkpoint, sha(b"ckpt"), "a" * 40)
        assert (a.size, a.provenance, a.validation, a.status, a.status_reason) == (
            size, provenance, validation, "fresh", None)
        assert s.get(Tag, ("acme/tiny", "fp8-cpu-balanced")).digest == row.digest
        assert [(e.old_digest, e.new_digest, e.reason) for e in s.query(TagEvent)] == [
            (None, row.digest, f"published {key}")]
        refs = {r.artifact_type: r for r in s.query(Referrer)}
    assert set(refs) == {PROVENANCE_TYPE, REPORT_TYPE, BUNDLE_TYPE, IN_TOTO_PAYLOAD_TYPE}
    for r in refs.values():
        assert (r.subject, r.repository, r.size) == (row.digest, "acme/tiny", store.stat(r.digest).size)
        m = read_manifest(store, r.digest)
        assert m["subject"] == {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": row.digest,
                                "size": store.stat(row.digest).size}
        assert (m["artifactType"], m.get("annotations")) == (r.artifact_type, r.annotations)
    for t in (PROVENANCE_TYPE, REPORT_TYPE):
        assert refs[t].annotations == {"dev.kiln.build-key": key}
        assert read_manifest(store, refs[t].digest)["layers"][0]["mediaType"] == t
    payload = store.get_bytes(read_manifest(store, refs[PROVENANCE_TYPE].digest)["layers"][0]["digest"])
    assert payload == json.dumps({"provenance": provenance, "validation": validation}, sort_keys=True, indent=1).encode()
    report = json.loads(store.get_bytes(read_manifest(store, refs[REPORT_TYPE].digest)["layers"][0]["digest"]))
    assert (report["digest"], report["engine"]["repository"], report["engine"]["tag"], report["verdict"]) == (
        row.digest, "acme/tiny", "fp8-cpu-balanced", "pass")
    assert (report["engine"]["created"], report["spec"]["checkpoint_content"]) == (
        "2026-12-01T00:00:00Z", provenance["checkpoint"])
    envelope = json.loads(store.get_bytes(read_manifest(store, refs[IN_TOTO_PAYLOAD_TYPE].digest)["layers"][0]["digest"]))
    statement = json.loads(base64.b64decode(envelope["payload"]))
    assert statement["subject"][0]["name"] == "acme/tiny@manifest"


def test_publish_uploads_the_layer_a_build_surveyed_beforehand_without_reading_it_again(registry, tmp_path):
    from artifacts.oci import survey_engine_layer

    store, sessions = registry
    spec = parse_spec({"checkpoint": f"hf://acme/tiny@{'a' * 40}", "precision": "fp8", "target": "cpu"}, [])
    engine = tmp_path / "engine"
    engine.mkdir()
    (engine / "config.json").write_text("{}")
    survey = survey_engine_layer(store, engine)

    def read_again(open_source):
        raise AssertionError("publish surveyed the layer again")

    store.survey = read_again
    provenance = {"created": "2026-12-01T00:00:00Z", "toolchain": {},
                  "checkpoint": {"ref": spec.checkpoint, "digest": sha(b"c"), "revision": "a" * 40}}
    row = publish(store, sessions, engine, spec=spec, build_key=sha(b"k"), provenance=provenance,
                  validation={"passed": True}, layer_survey=survey)
    assert read_manifest(store, row.digest)["layers"][0]["digest"] == survey["engine.tar"].digest


def test_a_rejected_or_stale_engine_is_indexed_untagged_with_its_reason(registry, tmp_path):
    from kiln.tables import Artifact, Tag, TrackedModel, utcnow

    store, sessions = registry
    gates = [{"name": "perplexity", "value": 30.0, "threshold": 20.0, "passed": False}]
    rejected, *_ = published(registry, tmp_path, build_key=sha(b"r"), validation={"passed": False, "gates": gates})
    with sessions() as s:
        s.add(TrackedModel(name="acme/tiny", checkpoint="hf://acme/tiny@main", hf_repo="acme/tiny", branch="main",
                           head_sha="b" * 40, matrix=[], gates={}, created_at=utcnow(), updated_at=utcnow()))
        s.commit()
    stale, *_ = published(registry, tmp_path, build_key=sha(b"s"))
    fresh, *_ = published(registry, tmp_path, build_key=sha(b"f"), revision="b" * 40)
    with sessions() as s:
        assert (s.get(Artifact, rejected.digest).status, s.get(Artifact, rejected.digest).status_reason) == (
            "rejected", "failed perplexity: 30 against the threshold 20")
        assert (s.get(Artifact, stale.digest).status, s.get(Artifact, stale.digest).status_reason) == ("stale", None)
        assert [(t.name, t.digest) for t in s.query(Tag)] == [("fp8-cpu-balanced", fresh.digest)]


def test_a_key_published_first_answers_in_its_repository_and_is_named_in_another(registry, tmp_path):
    from kiln.tables import Artifact, EngineName, Referrer

    store, sessions = registry
    first, *_ = published(registry, tmp_path, build_key=sha(b"k"))
    with sessions() as s:
        referrers = s.query(Referrer).count()
    (tmp_path / "again").mkdir()
    again, *_ = published(registry, tmp_path / "again", build_key=sha(b"k"))
    assert (again.digest, again.repository, again.status) == (first.digest, "acme/tiny", "fresh")
    other, *_ = published(registry, tmp_path, build_key=sha(b"k"), model="acme/other")
    assert (other.digest, other.repository) == (first.digest, "acme/tiny")
    with sessions() as s:
        assert s.query(Artifact).count() == 1 and s.query(Referrer).count() == referrers
        assert [(n.repository, n.digest) for n in s.query(EngineName)] == [("acme/other", first.digest)]

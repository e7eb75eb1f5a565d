"""The admission decision (api/admission.py), one test per verdict, with AdmissionReview payloads shaped as
the Kubernetes API server sends them; then the webhook end to end (api/routes/admission.py) over published,
signed engines in a real database."""

from __future__ import annotations

import copy
import json

import pytest
from fastapi.testclient import TestClient

from kiln.targets import sm_of_product
from api.admission import EngineFacts, asked_sms, parse_reference, registry_host, registry_hosts, review

HOST = "kiln.internal:8000"
D_FRESH, D_STALE, D_REVOKED, D_REJECTED, D_UNSIGNED, D_OTHER_KEY, D_SM100 = (
    "sha256:" + c * 64 for c in "1234567")
D_UNKNOWN = "sha256:" + "9" * 64
KEY, UNTRUSTED = "sha256:" + "a" * 64, "sha256:" + "b" * 64
UID = "705ab4f5-6393-11e8-b7cc-42010a800002"

FACTS = {
    D_FRESH: EngineFacts(D_FRESH, "fresh", None, "sm90", "r1", "r1", frozenset({KEY})),
    D_STALE: EngineFacts(D_STALE, "stale", "head moved to r2", "sm90", "r1", "r2", frozenset({KEY})),
    D_REVOKED: EngineFacts(D_REVOKED, "revoked", "CVE-2026-1 in the tokenizer", "sm90", "r1", "r1", frozenset({KEY})),
    D_REJECTED: EngineFacts(D_REJECTED, "rejected", "perplexity gate", "sm90", "r1", "r1", frozenset({KEY})),
    D_UNSIGNED: EngineFacts(D_UNSIGNED, "fresh", None, "sm90", "r1", "r1", frozenset()),
    D_OTHER_KEY: EngineFacts(D_OTHER_KEY, "fresh", None, "sm90", "r1", "r1", frozenset({UNTRUSTED})),
    D_SM100: EngineFacts(D_SM100, "fresh", None, "sm100", "r1", "r1", frozenset({KEY})),
}
TAGS = {("acme/tiny", "fp8-sm90-latency"): D_FRESH}


def lookup(ref):
    digest = ref.digest or TAGS.get((ref.repository, ref.tag))
    return FACTS.get(digest)


def decide(body, *, allow_tags=False):
    return review(body, hosts={HOST}, allow_tags=allow_tags, trusted={KEY}, lookup=lookup)["response"]


def pod_create(*, image=f"{HOST}/acme/tiny@{D_FRESH}", volume=None, annotations=None, node_selector=None,
               init_image=None):
    """An AdmissionReview for a Pod CREATE, as kube-apiserver sends it (v1, with userInfo, dryRun, options)."""
    spec = {"containers": [{"name": "server", "image": "nvcr.io/nvidia/tritonserver:25.01-trtllm-python-py3",
                            "resources": {"limits": {"nvidia.com/gpu": "1"}}}],
            "nodeSelector": node_selector or {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
            "volumes": [], "restartPolicy": "Always", "dnsPolicy": "ClusterFirst"}
    if image:
        spec["containers"].append({"name": "engine", "image": image, "imagePullPolicy": "IfNotPresent"})
    if init_image:
        spec["initContainers"] = [{"name": "pull", "image": init_image}]
    if volume:
        spec["volumes"].append({"name": "engine", "image": {"reference": volume, "pullPolicy": "IfNotPresent"}})
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "tiny-0", "namespace": "serving", "annotations": annotations or {},
                        "creationTimestamp": None},
           "spec": spec, "status": {}}
    return {"kind": "AdmissionReview", "apiVersion": "admission.k8s.io/v1",
            "request": {"uid": UID, "kind": {"group": "", "version": "v1", "kind": "Pod"},
                        "resource": {"group": "", "version": "v1", "resource": "pods"},
                        "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
                        "requestResource": {"group": "", "version": "v1", "resource": "pods"},
                        "name": "tiny-0", "namespace": "serving", "operation": "CREATE",
                        "userInfo": {"username": "system:serviceaccount:kube-system:replicaset-controller",
                                     "uid": "c0ffee", "groups": ["system:serviceaccounts", "system:authenticated"]},
                        "object": pod, "oldObject": None, "dryRun": False,
                        "options": {"kind": "CreateOptions", "apiVersion": "meta.k8s.io/v1"}}}


def deployment_update(pod_review: dict) -> dict:
    """The same pod, as the template of a Deployment being updated."""
    pod = pod_review["request"]["object"]
    dep = {"apiVersion": "apps/v1", "kind": "Deployment",
           "metadata": {"name": "tiny", "namespace": "serving", "generation": 3},
           "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "tiny"}},
                    "template": {"metadata": {"labels": {"app": "tiny"}, **{
                        k: v for k, v in pod["metadata"].items() if k == "annotations"}}, "spec": pod["spec"]}}}
    old = copy.deepcopy(dep)
    old["spec"]["template"]["spec"]["containers"] = old["spec"]["template"]["spec"]["containers"][:1]
    body = copy.deepcopy(pod_review)
    body["request"].update({"kind": {"group": "apps", "version": "v1", "kind": "Deployment"},
                            "resource": {"group": "apps", "version": "v1", "resource": "deployments"},
                            "requestKind": {"group": "apps", "version": "v1", "kind": "Deployment"},
                            "requestResource": {"group": "apps", "version": "v1", "resource": "deployments"},
                            "operation": "UPDATE", "object": dep, "oldObject": old,
                            "options": {"kind": "UpdateOptions", "apiVersion": "meta.k8s.io/v1"}})
    return body


def test_a_fresh_signed_engine_by_digest_is_allowed_and_the_uid_echoed():
    out = review(pod_create(), hosts={HOST}, allow_tags=False, trusted={KEY}, lookup=lookup)
    assert out["apiVersion"] == "admission.k8s.io/v1" and out["kind"] == "AdmissionReview"
    assert out["response"] == {"uid": UID, "allowed": True}


def test_by_tag_is_denied_unless_configured():
    body = pod_create(image=f"{HOST}/acme/tiny:fp8-sm90-latency")
    r = decide(body)
    assert r["uid"] == UID and r["allowed"] is False and r["status"]["code"] == 403
    assert "by tag" in r["status"]["message"] and "containers[1] (engine)" in r["status"]["message"]
    assert decide(body, allow_tags=True)["allowed"] is True  # the tag resolves to a fresh, signed engine
    assert decide(pod_create(image=f"{HOST}/acme/tiny:nope"), allow_tags=True)["allowed"] is False


@pytest.mark.parametrize("digest,words", [(D_UNKNOWN, "no engine with this digest"),
                                          (D_REVOKED, "revoked: CVE-2026-1"),
                                          (D_REJECTED, "rejected")])
def test_unknown_revoked_and_rejected_are_denied_with_the_reason(digest, words):
    r = decide(pod_create(image=f"{HOST}/acme/tiny@{digest}"))
    assert r["allowed"] is False and words in r["status"]["message"]


def test_stale_is_denied_unless_annotated_and_the_reason_comes_back_as_a_warning():
    r = decide(pod_create(image=f"{HOST}/acme/tiny@{D_STALE}"))
    assert r["allowed"] is False and "stale" in r["status"]["message"] and "kiln.dev/allow-stale" in r["status"]["message"]
    r = decide(pod_create(image=f"{HOST}/acme/tiny@{D_STALE}",
                          annotations={"kiln.dev/allow-stale": "rollback during incident 4711"}))
    assert r["allowed"] is True
    assert len(r["warnings"]) == 1 and "rollback during incident 4711" in r["warnings"][0]


def test_gpu_architecture_mismatch_is_denied():
    r = decide(pod_create(image=f"{HOST}/acme/tiny@{D_SM100}"))  # an sm100 engine on an H100 node
    assert r["allowed"] is False and "built for sm100" in r["status"]["message"] and "sm90" in r["status"]["message"]
    assert decide(pod_create(image=f"{HOST}/acme/tiny@{D_SM100}", node_selector={"kiln.dev/sm": "sm100"}))["allowed"]
    assert decide(pod_create(image=f"{HOST}/acme/tiny@{D_SM100}",
                             node_selector={"nvidia.com/gpu.product": "NVIDIA-B200"}))["allowed"]
    assert not decide(pod_create(node_selector={"kiln.dev/sm": "sm100"}))["allowed"]  # sm90 engine, sm100 pod


def test_unsigned_and_untrusted_are_denied():
    r = decide(pod_create(image=f"{HOST}/acme/tiny@{D_UNSIGNED}"))
    assert r["allowed"] is False and "unsigned" in r["status"]["message"]
    r = decide(pod_create(image=f"{HOST}/acme/tiny@{D_OTHER_KEY}"))
    assert r["allowed"] is False and "not a trusted key" in r["status"]["message"] and UNTRUSTED in r["status"]["message"]


def test_other_registries_are_untouched():
    body = pod_create(image=f"docker.io/library/busybox@{D_UNKNOWN}", init_image="busybox:latest",
                      volume="ghcr.io/acme/tiny:latest")
    assert decide(body) == {"uid": UID, "allowed": True}


def test_image_volume_init_and_ephemeral_containers_are_checked():
    r = decide(pod_create(image=None, volume=f"{HOST}/acme/tiny@{D_REVOKED}"))
    assert r["allowed"] is False and "volumes[0] (engine)" in r["status"]["message"]
    assert decide(pod_create(image=None, volume=f"{HOST}/acme/tiny@{D_FRESH}"))["allowed"] is True
    r = decide(pod_create(init_image=f"{HOST}/acme/tiny@{D_UNSIGNED}"))
    assert r["allowed"] is False and "initContainers[0] (pull)" in r["status"]["message"]
    body = pod_create()
    body["request"].update({"subResource": "ephemeralcontainers", "operation": "UPDATE"})
    body["request"]["object"]["spec"]["ephemeralContainers"] = [{"name": "debug", "image": f"{HOST}/acme/tiny:x"}]
    r = decide(body)
    assert r["allowed"] is False and "ephemeralContainers[0] (debug)" in r["status"]["message"]


def test_deployment_update_checks_its_pod_template_and_workloads_of_every_kind():
    r = decide(deployment_update(pod_create(image=f"{HOST}/acme/tiny@{D_STALE}")))
    assert r["uid"] == UID and r["allowed"] is False and "stale" in r["status"]["message"]
    ok = decide(deployment_update(pod_create(image=f"{HOST}/acme/tiny@{D_STALE}",
                                             annotations={"kiln.dev/allow-stale": "pinned"})))
    assert ok["allowed"] is True and "pinned" in ok["warnings"][0]
    spec = pod_create(image=f"{HOST}/acme/tiny@{D_REVOKED}")["request"]["object"]["spec"]
    template = {"metadata": {}, "spec": spec}
    for kind, obj in (("StatefulSet", {"spec": {"template": template}}), ("DaemonSet", {"spec": {"template": template}}),
                      ("Job", {"spec": {"template": template}}),
                      ("CronJob", {"spec": {"schedule": "0 * * * *", "jobTemplate": {"spec": {"template": template}}}})):
        body = pod_create()
        body["request"].update({"kind": {"group": "apps", "version": "v1", "kind": kind}, "object": obj})
        assert decide(body)["allowed"] is False, kind
    body = pod_create(image=f"{HOST}/acme/tiny@{D_REVOKED}")
    body["request"].update({"operation": "DELETE", "object": None})
    assert decide(body)["allowed"] is True  # a deletion runs nothing


def test_not_an_admission_review_is_a_value_error():
    for bad in ({}, {"kind": "AdmissionReview"}, {"kind": "AdmissionReview", "request": {"kind": {"kind": "Pod"}}}):
        with pytest.raises(ValueError):
            review(bad, hosts={HOST}, allow_tags=False, trusted={KEY}, lookup=lookup)


def test_odd_shapes_never_crash():
    body = pod_create()
    for path, value in ((("kind",), "Pod"), (("object", "spec", "containers"), "x"), (("object", "spec", "volumes"), [1]),
                        (("object", "spec", "nodeSelector"), ["a"]), (("object", "metadata", "annotations"), [1]),
                        (("object", "spec", "affinity"), {"nodeAffinity": {
                            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [None, 3]}}}),
                        (("object",), "pod"), (("operation",), ["CREATE"])):
        b = copy.deepcopy(body)
        target = b["request"]
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        assert decide(b)["uid"] == UID


def test_reference_parsing_and_gpu_products():
    assert parse_reference(f"{HOST}/acme/tiny@{D_FRESH}") == (HOST, "acme/tiny", None, D_FRESH)
    assert parse_reference("KILN.internal:8000/acme/tiny:fp8@" + D_FRESH) == (HOST, "acme/tiny", "fp8", D_FRESH)
    assert parse_reference("busybox:1.36") == (None, "busybox", "1.36", None)
    assert parse_reference("localhost/acme/tiny") == ("localhost", "acme/tiny", None, None)
    assert sm_of_product("NVIDIA-H100-80GB-HBM3") == "sm90" and sm_of_product("NVIDIA-GeForce-RTX-4090") == "sm89"
    assert sm_of_product("NVIDIA-A100-SXM4-40GB") == "sm80" and sm_of_product("Tesla-T4") == "sm75"
    assert sm_of_product("NVIDIA-RTX-6000-Ada-Generation") == "sm89" and sm_of_product("Mystery-GPU") is None
    affinity = {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "nvidia.com/gpu.product", "operator": "In", "values": ["NVIDIA-H200"]}]}]}}}}
    assert asked_sms(affinity) == ({"sm90"}, [])
    r = decide(pod_create(node_selector={"nvidia.com/gpu.product": "Mystery-GPU"}))
    assert r["allowed"] is True and "Mystery-GPU" in r["warnings"][0]


# -- the webhook, end to end --------------------------------------------------------------------------------------
def index_app():
    """The real app on the isolated home's settings: SQLite with the migrations, the local store, the signer."""
    from api.app import create_app
    from kiln import db
    from kiln.settings import Settings

    settings = Settings(registry_hosts=HOST)
    db.upgrade(settings.db_url)
    return create_app(settings, enqueue=lambda *a, **k: None)


def publish_engine(app, tmp_path, seed: str, *, model: str = "acme/tiny", target: str = "sm90",
                   profile: str = "latency", revision: str | None = "a" * 40, validation: dict | None = None,
                   backend: str = "checkpoint", toolchain: dict | None = None):
    """An engine published by the real ``builder.publish.publish`` (signed, its referrers indexed); ``seed``
    makes its files and build key distinct."""
    from builder.publish import publish
    from kiln.digests import sha256_bytes
    from kiln.spec import parse_spec

    spec = parse_spec({"checkpoint": f"hf://{model}@{'a' * 40}", "model_name": model, "precision": "fp8",
                       "profile": profile, "backend": backend, "target": target}, [])
    root = tmp_path / seed
    root.mkdir()
    (root / "config.json").write_text(json.dumps({"seed": seed}))
    prov = {"created": "2026-01-01T00:00:00Z", "toolchain": toolchain or {},
            "checkpoint": {"ref": spec.checkpoint, "digest": sha256_bytes(b"c"), "revision": revision}}
    return publish(app.state.store, app.state.sessions, root, spec=spec, build_key=sha256_bytes(seed.encode()),
                   provenance=prov, validation=validation or {"passed": True})


def test_webhook_over_published_engines(tmp_path, monkeypatch):
    from api.app import create_app
    from kiln.tables import Artifact, Referrer, TrackedModel
    from kiln.settings import Settings

    app = index_app()
    client = TestClient(app, base_url=f"http://{HOST}")
    good, stale = publish_engine(app, tmp_path, "good"), publish_engine(app, tmp_path, "stale")
    with app.state.sessions() as s:
        s.add(TrackedModel(name="acme/tiny", checkpoint="hf://acme/tiny@main", head_sha="a" * 40))
        s.get(Artifact, stale.digest).checkpoint_revision = "b" * 40  # built from a head the branch has left
        s.commit()

    def post(body):
        r = client.post("/v1/admission/validate", json=body)
        assert r.status_code == 200, r.text
        return r.json()["response"]

    assert post(pod_create(image=f"{HOST}/acme/tiny@{good.digest}")) == {"uid": UID, "allowed": True}
    r = post(deployment_update(pod_create(image=f"{HOST}/acme/tiny@{stale.digest}")))
    assert r["allowed"] is False and f"built from {'b' * 40}" in r["status"]["message"]
    r = post(pod_create(image=None, volume=f"{HOST}/acme/tiny:{good.tag}"))
    assert r["allowed"] is False and "by tag" in r["status"]["message"]
    # another host's own images pass; a Kiln engine's digest there is judged as the engine (the same bytes)
    assert post(pod_create(image=f"other.registry:5000/acme/tiny@{D_UNKNOWN}"))["allowed"] is True
    r = post(pod_create(image=f"other.registry:5000/acme/tiny@{stale.digest}"))
    assert r["allowed"] is False and f"built from {'b' * 40}" in r["status"]["message"]
    # signature facts come from the index: without the referrers the engine is unsigned
    with app.state.sessions() as s:
        for ref in s.query(Referrer).filter(Referrer.subject == good.digest,
                                            Referrer.annotations.isnot(None)).all():
            if ref.artifact_type in ("application/vnd.dev.sigstore.bundle.v0.3+json", "application/vnd.in-toto+json"):
                s.delete(ref)
        s.commit()
    r = post(pod_create(image=f"{HOST}/acme/tiny@{good.digest}"))
    assert r["allowed"] is False and "unsigned" in r["status"]["message"]
    bad = client.post("/v1/admission/validate", json={"kind": "Pod"})
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "request"
    # KILN_REGISTRY_HOSTS names the hosts pods pull from
    monkeypatch.setenv("KILN_REGISTRY_HOSTS", "registry.example:443, other.registry:5000")
    app2 = create_app(Settings(), enqueue=lambda *a, **k: None)
    r = TestClient(app2, base_url=f"http://{HOST}").post(
        "/v1/admission/validate", json=pod_create(image=f"other.registry:5000/acme/tiny@{stale.digest}")).json()
    assert r["response"]["allowed"] is False


def test_the_hosts_of_this_registry_in_any_spelling_are_judged():
    """Case, a trailing dot and HTTPS's default port do not make this registry another one: such a reference (an
    alias of a configured host) is judged as the host itself. Before, each was allowed unchecked."""
    hosts = registry_hosts("Kiln.Example.com:443, registry:5000")
    assert hosts == {"kiln.example.com", "registry:5000"}
    for alias in ("kiln.example.com", "kiln.example.com:443", "kiln.example.com.", "KILN.EXAMPLE.COM.:443",
                  "registry:5000", "Registry.:5000"):
        for image in (f"{alias}/acme/tiny@{D_REVOKED}", f"{alias}/acme/tiny:latest"):
            r = review(pod_create(image=image), hosts=hosts, allow_tags=False, trusted={KEY}, lookup=lookup)
            assert r["response"]["allowed"] is False, image
        r = review(pod_create(image=f"{alias}/acme/tiny@{D_FRESH}"), hosts=hosts, allow_tags=False,
                   trusted={KEY}, lookup=lookup)
        assert r["response"]["allowed"] is True
    # another port, another name: another registry
    for other in ("kiln.example.com:5000", "kiln.example.org", "registry:5001", "registry"):
        r = review(pod_create(image=f"{other}/acme/tiny@{D_REVOKED}"), hosts=hosts, allow_tags=False,
                   trusted={KEY}, lookup=lookup)
        assert r["response"]["allowed"] is True, other
    assert registry_host("[::1]:443") == "[::1]" and registry_host("[::1]:5000") == "[::1]:5000"


def test_a_port_with_leading_zeros_is_the_same_port():
    """The port is a number: ``:0443`` is HTTPS's default port and ``:05000`` is ``:5000``. Compared as strings,
    a tag reference to this registry written so (also with a trailing dot, in upper case) was admitted unchecked
    as another registry's."""
    hosts = registry_hosts("kiln.example.com, registry:5000")
    for alias in ("kiln.example.com:0443", "kiln.example.com.:0443", "KILN.EXAMPLE.COM.:00443", "registry:05000",
                  "Registry.:005000"):
        assert registry_host(alias) in hosts, alias
        for image in (f"{alias}/acme/tiny:latest", f"{alias}/acme/tiny@{D_REVOKED}"):
            r = review(pod_create(image=image), hosts=hosts, allow_tags=False, trusted={KEY}, lookup=lookup)
            assert r["response"]["allowed"] is False, image
    assert registry_hosts("kiln.example.com:0443") == {"kiln.example.com"}
    assert registry_host("[::1]:0443") == "[::1]" and registry_host("[::1]:05000") == "[::1]:5000"
    r = review(pod_create(image=f"kiln.example.com:4430/acme/tiny@{D_REVOKED}"), hosts=hosts, allow_tags=False,
               trusted={KEY}, lookup=lookup)
    assert r["response"]["allowed"] is True  # another port: another registry


def test_without_registry_hosts_the_webhook_denies_rather_than_trusting_the_host_header(tmp_path):
    """The webhook took the request's own Host as the registry's name: a caller chose which references are
    judged. Unconfigured, every image is denied, saying why; a deletion is still allowed."""
    from api.app import create_app
    from kiln import db
    from kiln.settings import Settings

    settings = Settings()
    assert settings.registry_hosts is None
    db.upgrade(settings.db_url)
    client = TestClient(create_app(settings, enqueue=lambda *a, **k: None), base_url="http://evil.example")
    r = client.post("/v1/admission/validate", json=pod_create(image=f"evil.example/acme/tiny@{D_FRESH}")).json()
    assert r["response"]["allowed"] is False and "KILN_REGISTRY_HOSTS is not set" in r["response"]["status"]["message"]
    r = client.post("/v1/admission/validate", json=pod_create(image="busybox:1.36")).json()
    assert r["response"]["allowed"] is False
    body = pod_create()
    body["request"]["operation"] = "DELETE"
    assert client.post("/v1/admission/validate", json=body).json()["response"]["allowed"] is True


def test_keys_artifacts_and_resolve_say_who_signed(tmp_path):
    from api.app import create_app
    from artifacts.signing import configured_signer
    from builder.publish import publish
    from kiln import db
    from kiln.digests import sha256_bytes
    from kiln.settings import Settings
    from kiln.spec import parse_spec

    settings = Settings(registry_hosts=HOST)
    db.upgrade(settings.db_url)
    app = create_app(settings, enqueue=lambda *a, **k: None)
    client = TestClient(app)
    spec = parse_spec({"checkpoint": f"hf://acme/tiny@{'a' * 40}", "model_name": "acme/tiny", "precision": "fp8",
                       "profile": "latency", "backend": "checkpoint"}, [])
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "config.json").write_text("{}")
    art = publish(app.state.store, app.state.sessions, tmp_path / "e", spec=spec, build_key=sha256_bytes(b"k"),
                  provenance={"created": "2026-01-01T00:00:00Z", "toolchain": {},
                              "checkpoint": {"ref": spec.checkpoint, "digest": sha256_bytes(b"c"), "revision": None}},
                  validation={"passed": True})
    fp = configured_signer().fingerprint
    keys = client.get("/v1/keys").json()["keys"]
    assert keys == [{"fingerprint": fp, "public_key": configured_signer().public_pem.decode(), "signing": True}]
    sig = client.get(f"/v1/artifacts/{art.digest}").json()["signature"]
    assert sig == {"signed": True, "trusted": True, "key": fp, "keys": [fp]}
    r = client.get("/v1/resolve", params={"model": "acme/tiny", "precision": "fp8", "profile": "latency",
                                          "target": "cpu", "backend": "checkpoint"})
    assert r.status_code == 200 and r.json()["signature"] == sig


def test_an_api_given_public_keys_only_lists_them_and_makes_no_key():
    """API pods get the signing key's public half (KILN_TRUSTED_KEYS), not the private key. Such an API made a key
    of its own under KILN_HOME and listed it first, as the signing key (`kiln keys public --server` printed it):
    it lists the configured keys only, none as its own, and makes none."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    from api.app import create_app
    from artifacts.signing import fingerprint
    from kiln import db
    from kiln.settings import Settings

    public = ec.generate_private_key(ec.SECP256R1()).public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    settings = Settings(registry_hosts=HOST, trusted_keys=public.decode())
    db.upgrade(settings.db_url)
    client = TestClient(create_app(settings, enqueue=lambda *a, **k: None))
    keys = client.get("/v1/keys").json()["keys"]
    assert [(k["fingerprint"], k["signing"]) for k in keys] == [(fingerprint(public), False)]
    pem = client.get("/v1/keys", headers={"Accept": "application/x-pem-file"}).content
    assert pem == keys[0]["public_key"].encode()
    assert not (settings.home_dir / "keys").exists()


def test_every_verdict_from_the_index_facts(tmp_path, monkeypatch):
    """engine_facts reads each verdict's fact from the real index: a revoke through the route (its reason comes
    back), a rejected engine (its reason), an unknown digest, the target against the pod's GPU, a head the
    engine was not built from, and with tags allowed a tag resolved in its own repository only."""
    from kiln.tables import Artifact, TrackedModel
    from kiln.settings import Settings

    monkeypatch.setenv("KILN_ADMISSION_ALLOW_TAGS", "true")
    assert Settings().admission_allow_tags is True
    app = index_app()
    client = TestClient(app, base_url=f"http://{HOST}")

    def engine(seed: str, *, passed: bool = True, **kw) -> Artifact:
        return publish_engine(app, tmp_path, seed, **kw, validation={"passed": passed, "gates": [
            {"name": "perplexity", "value": 412.345, "threshold": 20.0, "passed": passed},
            {"name": "top1_agreement", "value": 0.99, "threshold": 0.9, "passed": True}]})

    revoked, rejected, blackwell = engine("revoked"), engine("rejected", passed=False), engine("b200", target="sm100")
    good = engine("good")  # last of its variant: the tag names it
    other = engine("other-model", model="acme/other", profile="throughput")  # a tag acme/tiny does not have
    assert client.post(f"/v1/artifacts/{revoked.digest}/revoke", json={"reason": "CVE-2026-7"}).status_code == 200
    with app.state.sessions() as s:
        reason_rejected = s.get(Artifact, rejected.digest).status_reason
        assert s.get(Artifact, rejected.digest).status == "rejected"

    def post(image, **kw):
        r = client.post("/v1/admission/validate", json=pod_create(image=image, **kw))
        assert r.status_code == 200, r.text
        return r.json()["response"]

    ok = post(f"{HOST}/acme/tiny@{good.digest}")
    assert ok == {"uid": UID, "allowed": True}
    msg = post(f"{HOST}/acme/tiny@{revoked.digest}")["status"]["message"]
    assert "the engine is revoked: CVE-2026-7" in msg
    msg = post(f"{HOST}/acme/tiny@{rejected.digest}")["status"]["message"]
    assert reason_rejected == "failed perplexity: 412.3 against the threshold 20"
    assert f"failed validation (rejected): {reason_rejected}" in msg
    msg = post(f"{HOST}/acme/tiny@{D_UNKNOWN}")["status"]["message"]
    assert "no engine with this digest" in msg
    msg = post(f"{HOST}/acme/tiny@{blackwell.digest}")["status"]["message"]  # the pod selects an H100
    assert "built for sm100 but the pod selects sm90" in msg
    # by tag (allowed here): resolved in the reference's repository, then judged as the digest would be
    r = post(f"{HOST}/acme/tiny:{good.tag}")
    assert r["allowed"] is True, (good.tag, r)
    assert "no engine" in post(f"{HOST}/acme/tiny:{other.tag}")["status"]["message"]  # acme/other's tag
    assert post(f"{HOST}/acme/other:{other.tag}")["allowed"] is True
    assert "no engine" in post(f"{HOST}/acme/tiny:no-such-tag")["status"]["message"]
    # the tracked head moves: the engine built from the old head is stale (the fact is the head, read live)
    with app.state.sessions() as s:
        s.add(TrackedModel(name="acme/tiny", checkpoint="hf://acme/tiny@main", head_sha="c" * 40))
        s.commit()
    msg = post(f"{HOST}/acme/tiny@{good.digest}")["status"]["message"]
    assert f"built from {'a' * 40}, the tracked head is {'c' * 40}" in msg
    r = post(f"{HOST}/acme/tiny@{good.digest}", annotations={"kiln.dev/allow-stale": "rollback drill"})
    assert r["allowed"] is True and "admitted by kiln.dev/allow-stale: rollback drill" in r["warnings"][0]


def test_the_exact_words_of_each_denial():
    """What an operator reads in `kubectl` output: every list joined and sorted, a stale engine of an untracked
    model, unnamed containers and volumes, registry hosts told apart from repository paths."""
    two_keys = "sha256:" + "c" * 64
    facts = {**FACTS,
             D_OTHER_KEY: EngineFacts(D_OTHER_KEY, "fresh", None, "sm90", "r1", "r1", frozenset({two_keys, UNTRUSTED})),
             D_STALE: EngineFacts(D_STALE, "stale", None, "sm90", "r1", None, frozenset({KEY})),  # untracked now
             D_REVOKED: EngineFacts(D_REVOKED, "revoked", None, "sm90", "r1", "r1", frozenset({KEY}))}  # no reason

    def decide_with(body):
        return review(body, hosts={HOST, "registry.example", "registry:5000"}, allow_tags=False, trusted={KEY},
                      lookup=lambda ref: facts.get(ref.digest))["response"]

    msg = decide_with(pod_create(image=f"{HOST}/acme/tiny@{D_OTHER_KEY}"))["status"]["message"]
    assert f"the engine is signed by {UNTRUSTED}, {two_keys}, not a trusted key" in msg
    msg = decide_with(pod_create(image=f"{HOST}/acme/tiny@{D_STALE}"))["status"]["message"]
    assert msg.endswith(f"containers[1] (engine): {HOST}/acme/tiny@{D_STALE}: the engine is stale (stale); "
                        "set the annotation kiln.dev/allow-stale: <reason> to run it anyway")
    msg = decide_with(pod_create(image=f"{HOST}/acme/tiny@{D_REVOKED}"))["status"]["message"]
    assert msg.endswith(f"{D_REVOKED}: the engine is revoked")
    affinity = pod_create(image=f"{HOST}/acme/tiny@{D_SM100}")  # nodeSelector: an H100; affinity: an A100
    affinity["request"]["object"]["spec"]["affinity"] = {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{"matchExpressions": [
            {"key": "nvidia.com/gpu.product", "operator": "In", "values": ["NVIDIA-A100-SXM4-80GB"]}]}]}}}
    msg = decide_with(affinity)["status"]["message"]
    assert "built for sm100 but the pod selects sm80, sm90 (engines load" in msg
    body = pod_create(image=None, volume=f"{HOST}/acme/tiny@{D_REVOKED}")
    del body["request"]["object"]["spec"]["volumes"][0]["name"]
    body["request"]["object"]["spec"]["containers"].append({"image": f"{HOST}/acme/tiny@{D_UNSIGNED}"})
    msg = decide_with(body)["status"]["message"]
    assert "volumes[0] (?)" in msg and "containers[1] (?)" in msg
    # a first component with a dot, or a colon (a port), or localhost, is a host; otherwise a path
    assert parse_reference("registry.example/acme/tiny:fp8")[:3] == ("registry.example", "acme/tiny", "fp8")
    assert parse_reference("registry:5000/acme/tiny")[:3] == ("registry:5000", "acme/tiny", None)
    assert parse_reference("acme/tiny:fp8")[:3] == (None, "acme/tiny", "fp8")
    assert decide_with(pod_create(image=f"registry:5000/acme/tiny@{D_UNKNOWN}"))["allowed"] is False
    assert decide_with(pod_create(image=f"registry.example/acme/tiny@{D_UNKNOWN}"))["allowed"] is False
    odd = pod_create(image=f"{HOST}/acme/tiny@{D_UNKNOWN}")
    odd["request"]["kind"]["kind"] = ["Pod"]  # not a kind: nothing to judge, no crash
    assert decide_with(odd) == {"uid": UID, "allowed": True}


def test_signature_summary_is_per_engine_and_names_the_trusted_key_first(tmp_path):
    from builder.attest import SIGNED_TYPES
    from kiln.tables import Referrer
    from api.admission import signature_summary

    app = index_app()
    signed, stripped = (publish_engine(app, tmp_path, seed, model=f"acme/{seed}", target="cpu", revision=None)
                        for seed in ("signed", "stripped"))
    with app.state.sessions() as s:
        s.query(Referrer).filter(Referrer.subject == stripped.digest, Referrer.artifact_type.in_(SIGNED_TYPES)) \
            .delete(synchronize_session=False)
        s.commit()
        fp = signature_summary(s, signed.digest, set())["keys"][0]
        other = "sha256:" + "e" * 64
        assert signature_summary(s, signed.digest, {other}) == {"signed": True, "trusted": False, "key": fp,
                                                                 "keys": [fp]}
        assert signature_summary(s, signed.digest, {other, fp}) == {"signed": True, "trusted": True, "key": fp,
                                                                     "keys": [fp]}
        assert signature_summary(s, stripped.digest, {other, fp}) == {"signed": False, "trusted": False,
                                                                       "key": None, "keys": []}


def test_the_review_envelope_operations_and_every_reference_judged():
    """The AdmissionReview's own rules: the denial's status object, every reference judged (a by-tag or malformed
    one does not stop the others), operations that hold no new pod pass, the request's apiVersion echoed,
    annotations of the workload itself count, long warnings cut, refusals of a body that is not a review."""
    body = pod_create(image=f"{HOST}/acme/tiny:fp8", init_image=f"{HOST}/acme/tiny@sha256:abc",
                      volume=f"{HOST}/acme/tiny@{D_REVOKED}")
    r = decide(body)
    assert r["status"] == {"code": 403, "reason": "Forbidden", "message": (
        f"kiln denied this pod: initContainers[0] (pull): {HOST}/acme/tiny@sha256:abc has a malformed digest; "
        f"containers[1] (engine): {HOST}/acme/tiny:fp8 names an engine by tag; use {HOST}/acme/tiny@sha256:… "
        "(a tag can move under a running deployment); "
        f"volumes[0] (engine): {HOST}/acme/tiny@{D_REVOKED}: the engine is revoked: CVE-2026-1 in the tokenizer")}
    for operation, judged in (("DELETE", False), ("CONNECT", True), ("UPDATE", True), (None, True)):
        b = copy.deepcopy(body)
        if operation is None:
            del b["request"]["operation"]  # absent: judged as a CREATE
        else:
            b["request"]["operation"] = operation
        assert decide(b)["allowed"] is (not judged), operation
    for version, echoed in (("admission.k8s.io/v1beta1", "admission.k8s.io/v1beta1"),
                            ("admission.k8s.io/v1", "admission.k8s.io/v1"), ("v2", "admission.k8s.io/v1")):
        b = copy.deepcopy(body)
        b["apiVersion"] = version
        assert review(b, hosts={HOST}, allow_tags=False, trusted={KEY}, lookup=lookup)["apiVersion"] == echoed
    # the Deployment's own annotation admits its template's stale engine; a product label's note comes with it
    dep = deployment_update(pod_create(image=f"{HOST}/acme/tiny@{D_STALE}",
                                       node_selector={"nvidia.com/gpu.product": "Mystery-" + "X" * 2000}))
    dep["request"]["object"]["metadata"]["annotations"] = {"kiln.dev/allow-stale": "pinned for the audit"}
    r = decide(dep)
    assert r["allowed"] is True and len(r["warnings"]) == 2
    assert r["warnings"][0].startswith("nvidia.com/gpu.product=Mystery-XX") and len(r["warnings"][0]) == 1000
    assert r["warnings"][1].endswith("admitted by kiln.dev/allow-stale: pinned for the audit")
    for bad, words in (({"kind": "Pod"}, "not an AdmissionReview with a request"),
                       ({"kind": "AdmissionReview", "request": {"uid": ""}}, "request.uid is missing"),
                       ({"kind": "AdmissionReview", "request": {"uid": 7}}, "request.uid is missing")):
        with pytest.raises(ValueError) as err:
            decide(bad)
        assert str(err.value) == words


def test_staleness_is_judged_by_the_head_of_the_repository_the_pod_names(tmp_path):
    """As resolve does: an engine B published, named through repository A, is stale for A once it is not A's head,
    whatever B's head says. Before, admission read the publisher's (B's) tracked head only."""
    from kiln.tables import TrackedModel

    app = index_app()
    client = TestClient(app, base_url=f"http://{HOST}")
    engine = publish_engine(app, tmp_path, "shared", model="acme/tiny", revision="a" * 40)
    with app.state.sessions() as s:
        s.add(TrackedModel(name="acme/tiny", checkpoint="hf://acme/tiny@main", head_sha="a" * 40))
        s.add(TrackedModel(name="other/tiny", checkpoint="hf://acme/tiny@release", head_sha="b" * 40))
        s.commit()

    def post(repository):
        body = pod_create(image=f"{HOST}/{repository}@{engine.digest}")
        return client.post("/v1/admission/validate", json=body).json()["response"]

    assert post("acme/tiny")["allowed"] is True
    r = post("other/tiny")
    assert r["allowed"] is False and f"the tracked head is {'b' * 40}" in r["status"]["message"]
    assert post("untracked/tiny")["allowed"] is True  # no tracked head to be behind


AMX = "x86_64-AVX512+amx_tile+avx512_bf16+avx512_vnni+bf16"
NEEDS_AMX = {"kubernetes.io/arch": "amd64", "feature.node.kubernetes.io/cpu-cpuid.AVX512F": "true",
             "feature.node.kubernetes.io/cpu-cpuid.AMXTILE": "true",
             "feature.node.kubernetes.io/cpu-cpuid.AVX512BF16": "true",
             "feature.node.kubernetes.io/cpu-cpuid.AVX512VNNI": "true"}


@pytest.mark.parametrize("cpu,labels", [
    (AMX, NEEDS_AMX),
    ("x86_64-AVX2", {"kubernetes.io/arch": "amd64"}),  # the x86-64 baseline: any amd64 node
    ("aarch64-SVE256+bf16", {"kubernetes.io/arch": "arm64"}),
])
def test_a_cpu_engines_node_requirements_are_nfd_labels_for_what_its_code_uses(cpu, labels):
    from kiln.toolchain import node_requirements

    assert node_requirements(cpu) == labels


def test_a_cpu_engine_is_admitted_only_where_the_pod_requires_nodes_that_can_load_it():
    d = "sha256:" + "c" * 64
    FACTS[d] = EngineFacts(d, "fresh", None, "cpu", "r1", "r1", frozenset({KEY}), AMX)
    try:
        image = f"{HOST}/acme/tiny@{d}"
        r = decide(pod_create(image=image, node_selector={"kubernetes.io/arch": "amd64"}))
        assert r["allowed"] is False
        msg = r["status"]["message"]
        assert f"compiled for {AMX}" in msg and 'feature.node.kubernetes.io/cpu-cpuid.AMXTILE: "true"' in msg
        assert "kubernetes.io/arch" not in msg.split("nodeSelector:")[1].split("(")[0]  # what it has is not asked
        assert decide(pod_create(image=image, node_selector=NEEDS_AMX))["allowed"]
        affinity = {"nodeSelectorTerms": [{"matchExpressions": [
            {"key": k, "operator": "In", "values": [v]} if k.startswith("kubernetes.io") else
            {"key": k, "operator": "Exists"} for k, v in NEEDS_AMX.items()]}]}
        body = pod_create(image=image, node_selector={"x": "y"})
        body["request"]["object"]["spec"]["affinity"] = {"nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": affinity}}
        assert decide(body)["allowed"]
        # a second, alternative term without the labels admits other nodes: denied
        affinity["nodeSelectorTerms"].append({"matchExpressions": [
            {"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64"]}]})
        assert not decide(body)["allowed"]
    finally:
        del FACTS[d]


def test_the_index_gives_admission_the_cpu_of_a_native_cpu_engine_only(tmp_path):
    from api.admission import ImageRef, engine_facts

    app = index_app()
    native = publish_engine(app, tmp_path, "native", target="cpu", backend="aot-inductor", toolchain={"cpu": AMX})
    portable = publish_engine(app, tmp_path, "portable", target="cpu", toolchain={"cpu": AMX})  # checkpoint: no code
    with app.state.sessions() as s:
        def facts(a):
            return engine_facts(s, ImageRef("c", f"{HOST}/acme/tiny@{a.digest}", HOST, "acme/tiny", None, a.digest))
        assert facts(native).cpu == AMX and facts(portable).cpu is None

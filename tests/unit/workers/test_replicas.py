"""Copies of Kiln engines in other registries (workers/replicas.py, workers/admission.copy_verdict): a reference to
another registry is judged as the engine its digest is when Kiln pushed it there (a recorded replica) or the place
is trusted (KILN_TRUSTED_REGISTRIES); other registries' own images pass; a tag there never does. First the rules
over scripted facts, then the facts from a real index, the webhook and resolve's --registry end to end."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from artifacts.push import Destination, PushResult, registry_host
from kiln.errors import ArtifactUnknown, NameInvalid
from tests.unit.api.test_admission import UID, index_app, pod_create, publish_engine
from api.admission import EngineFacts, review
from workers.replicas import Place, ReplicaFacts, parse_place, trusted_registries

HOST = "kiln.internal:8000"  # Kiln's own registry
MIRROR = "registry.example.com"  # the team's registry
D_FRESH, D_REVOKED, D_MOVED, D_UNKNOWN = ("sha256:" + c * 64 for c in "1239")
KEY = "sha256:" + "a" * 64
STATUS = {D_FRESH: ("fresh", None), D_REVOKED: ("revoked", "CVE-2026-9 in the tokenizer"), D_MOVED: ("fresh", None)}
PUBLISHER = {D_FRESH: "acme/tiny", D_REVOKED: "acme/tiny", D_MOVED: "acme/tiny"}
HEADS = {"acme/tiny": "r1", "acme/moved": "r2"}  # Kiln's tracked heads; every engine here is built from r1
# Kiln pushed: (host, repository, digest) → the Kiln repository the copy stands for
RECORDS = {(MIRROR, "team/engines", D_FRESH): "acme/tiny", (MIRROR, "team/engines", D_REVOKED): "acme/tiny",
           (MIRROR, "team/moved", D_MOVED): "acme/moved"}


def lookup(ref):
    """engine_facts as the index answers: by digest, the head of the repository the reference is judged as."""
    if ref.digest not in STATUS:
        return None
    status, reason = STATUS[ref.digest]
    return EngineFacts(ref.digest, status, reason, "sm90", "r1", HEADS.get(ref.repository), frozenset({KEY}))


def replicas(ref):
    """replica_facts as the index answers (workers/replicas.FACTS)."""
    host = registry_host(ref.host)
    model = RECORDS.get((host, ref.repository, ref.digest))
    return ReplicaFacts(any((h, r) == (host, ref.repository) for h, r, _ in RECORDS), model is not None,
                        model or PUBLISHER.get(ref.digest))


def decide(image, *, places=(), allow_tags=False, **kw):
    return review(pod_create(image=image, **kw), hosts={HOST}, allow_tags=allow_tags, trusted={KEY}, lookup=lookup,
                  replicas=replicas, trusted_registries=tuple(places))["response"]


def test_a_recorded_copy_of_a_fresh_signed_engine_is_admitted_in_any_spelling_of_its_host():
    for host in (MIRROR, "Registry.Example.com:443", "registry.example.com."):
        assert decide(f"{host}/team/engines@{D_FRESH}") == {"uid": UID, "allowed": True}, host


def test_a_copy_is_judged_as_its_engine():
    r = decide(f"{MIRROR}/team/engines@{D_REVOKED}")  # pushed before it was revoked: the index says revoked now
    assert r["allowed"] is False
    assert r["status"]["message"].endswith(f"containers[1] (engine): {MIRROR}/team/engines@{D_REVOKED}: "
                                           "the engine is revoked: CVE-2026-9 in the tokenizer")
    r = decide(f"{MIRROR}/team/engines@{D_FRESH}", node_selector={"kiln.dev/sm": "sm100"})
    assert r["allowed"] is False and "built for sm90" in r["status"]["message"]
    r = review(pod_create(image=f"{MIRROR}/team/engines@{D_FRESH}"), hosts={HOST}, allow_tags=False,
               trusted={"sha256:" + "f" * 64}, lookup=lookup, replicas=replicas)["response"]
    assert r["allowed"] is False and "not a trusted key" in r["status"]["message"]


def test_a_copy_is_stale_by_the_head_of_the_kiln_repository_it_stands_for():
    """team/moved holds a copy of an acme/moved engine built from r1; acme/moved's head is r2. The registry's own
    repository name (team/moved) is tracked by nobody: judged by it, the copy would pass."""
    r = decide(f"{MIRROR}/team/moved@{D_MOVED}")
    assert r["allowed"] is False and "built from r1, the tracked head is r2" in r["status"]["message"]
    r = decide(f"{MIRROR}/team/moved@{D_MOVED}", annotations={"kiln.dev/allow-stale": "rollback drill"})
    assert r["allowed"] is True and r["warnings"][0].endswith("admitted by kiln.dev/allow-stale: rollback drill")


def test_a_kiln_engine_where_kiln_did_not_push_it_is_denied_unless_the_place_is_trusted():
    image = f"{MIRROR}/team/other@{D_FRESH}"
    r = decide(image)
    assert r["allowed"] is False
    assert r["status"]["message"].endswith(
        f"containers[1] (engine): {image} is a Kiln engine (acme/tiny) that Kiln did not push to {MIRROR}/team/other; "
        f"run kiln push {D_FRESH} {MIRROR}/team/other, or add the registry to KILN_TRUSTED_REGISTRIES")
    assert decide(f"elsewhere.example:5000/x@{D_FRESH}")["allowed"] is False  # any registry: the digest is Kiln's
    for hub, where in ((f"team/x@{D_REVOKED}", "revoked"), (f"x@{D_FRESH}", "did not push to docker.io/library/x")):
        r = decide(hub)  # no host: Docker Hub, where the same bytes are judged the same
        assert r["allowed"] is False and where in r["status"]["message"], hub
    assert decide(image, places=[Place(MIRROR, "team")])["allowed"] is True
    assert decide(image, places=[Place(MIRROR)])["allowed"] is True
    assert decide(image, places=[Place(MIRROR, "team/other")])["allowed"] is True
    for place in (Place(MIRROR, "tea"), Place(MIRROR, "team/other/sub"), Place("registry.example.org"),
                  Place(MIRROR + ":5000")):
        assert decide(image, places=[place])["allowed"] is False, place
    r = decide(f"{MIRROR}/team/other@{D_REVOKED}", places=[Place(MIRROR)])  # trusted: still judged
    assert r["allowed"] is False and "revoked" in r["status"]["message"]


def test_an_unknown_digest_is_denied_where_kiln_engines_live_and_untouched_elsewhere():
    for image, places, where in ((f"{MIRROR}/team/engines@{D_UNKNOWN}", (), "a place Kiln pushes engines to"),
                                 (f"{MIRROR}/mirror/x@{D_UNKNOWN}", [Place(MIRROR, "mirror")],
                                  f"trusted for Kiln engines ({MIRROR}/mirror)")):
        r = decide(image, places=places)
        assert r["allowed"] is False, image
        assert r["status"]["message"].endswith(f"{image}: no Kiln engine has this digest ({image.split('@')[0]} is "
                                               f"{where}; only digests Kiln published are admitted)")
    assert decide(f"{MIRROR}/team/app@{D_UNKNOWN}", places=[Place(MIRROR, "mirror")])["allowed"] is True
    assert decide(f"{MIRROR}/team/engines@sha256:abc")["status"]["message"].endswith("has a malformed digest")
    assert decide(f"docker.io/library/busybox@{D_UNKNOWN}")["allowed"] is True


def test_a_tag_where_kiln_engines_live_is_denied_even_with_tags_allowed():
    for image, places in ((f"{MIRROR}/team/engines:fp8-sm90", ()),
                          (f"{MIRROR}/team/app:v1", [Place(MIRROR, "team")])):
        r = decide(image, places=places, allow_tags=True)
        assert r["allowed"] is False, image
        where = image.rsplit(":", 1)[0]
        assert r["status"]["message"].endswith(
            f"{image} names a Kiln engine in another registry by tag, which Kiln cannot check (that registry's tag "
            f"can move); use {where}@sha256:… (kiln resolve … --registry {where} prints it)")
    for image in (f"{MIRROR}/team/app:v1", "nvcr.io/nvidia/tritonserver:25.01-trtllm-python-py3", "busybox:1.36"):
        assert decide(image)["allowed"] is True, image  # no Kiln engine lives there
    assert decide(f"{MIRROR}/team/engines:fp8@{D_FRESH}")["allowed"] is True  # the runtime pulls the digest


def test_trusted_registries_are_parsed_with_an_error_naming_the_setting():
    assert trusted_registries(" Registry.Example.com:443/team/engines/ , localhost:5000,, ") == (
        Place(MIRROR, "team/engines"), Place("localhost:5000"))
    assert trusted_registries(None) == () and trusted_registries("") == ()
    assert str(parse_place("[::1]:5000/x", field="registry")) == "[::1]:5000/x"
    for bad in ("https://registry.example.com", "registry", "registry.example.com/Team", "r.example/x@sha256:1",
                "r.example/x:tag", "/team"):
        with pytest.raises(NameInvalid) as err:
            trusted_registries(f"localhost:5000,{bad}")
        assert err.value.field == "KILN_TRUSTED_REGISTRIES" and "host[:port][/path]" in err.value.fix, bad


# -- the index, the webhook and resolve ----------------------------------------------------------------------------
def record(app, engine, dest: str, model: str | None = None) -> None:
    """What push_engine records after a push that succeeded (builder/replicate.record_replica)."""
    from builder.replicate import record_replica

    host, _, rest = dest.partition("/")
    repository, _, tag = rest.partition(":")
    with app.state.sessions() as s:
        record_replica(s, PushResult(Destination(host, repository, tag or None), engine.digest, [], True),
                       model or engine.repository)
        s.commit()


def test_the_index_records_replicas_and_answers_their_facts(tmp_path):
    from kiln.tables import Replica
    from workers.replicas import replica_facts

    app = index_app()
    engine = publish_engine(app, tmp_path, "copied")
    record(app, engine, "Registry.Example.com:443/team/engines:fp8")
    record(app, engine, "registry.example.com/team/engines", model="acme/other")  # pushed again: one row, updated
    with app.state.sessions() as s:
        [row] = s.query(Replica).all()
        assert (row.host, row.repository, row.tag, row.model) == (MIRROR, "team/engines", "fp8", "acme/other")
        assert replica_facts(s, "REGISTRY.example.com", "team/engines", engine.digest) == ReplicaFacts(
            True, True, "acme/other")
        assert replica_facts(s, MIRROR, "team/engines", D_UNKNOWN) == ReplicaFacts(True, False, None)
        assert replica_facts(s, MIRROR, "team/engines", None) == ReplicaFacts(True, False, None)
        assert replica_facts(s, MIRROR, "team/other", engine.digest) == ReplicaFacts(False, False, "acme/tiny")
        assert replica_facts(s, MIRROR + ":5000", "team/engines", engine.digest).place is False


def test_the_webhook_admits_recorded_and_trusted_copies(tmp_path, monkeypatch):
    from api.app import create_app
    from kiln.tables import TrackedModel
    from kiln.settings import Settings

    app = index_app()
    engine = publish_engine(app, tmp_path, "webhook")
    record(app, engine, f"{MIRROR}/team/engines:fp8")

    def post(image, client=TestClient(app, base_url=f"http://{HOST}"), **kw):
        r = client.post("/v1/admission/validate", json=pod_create(image=image, **kw))
        assert r.status_code == 200, r.text
        return r.json()["response"]

    assert post(f"{MIRROR}/team/engines@{engine.digest}") == {"uid": UID, "allowed": True}
    assert "no Kiln engine has this digest" in post(f"{MIRROR}/team/engines@{D_UNKNOWN}")["status"]["message"]
    assert "by tag" in post(f"{MIRROR}/team/engines:fp8")["status"]["message"]
    assert "did not push" in post(f"mirror.example/x@{engine.digest}")["status"]["message"]
    with app.state.sessions() as s:  # acme/tiny's head moves: the copy is stale as the engine is
        s.add(TrackedModel(name="acme/tiny", checkpoint="hf://acme/tiny@main", head_sha="c" * 40))
        s.commit()
    msg = post(f"{MIRROR}/team/engines@{engine.digest}")["status"]["message"]
    assert f"built from {'a' * 40}, the tracked head is {'c' * 40}" in msg
    # KILN_TRUSTED_REGISTRIES: copies made by other means
    monkeypatch.setenv("KILN_REGISTRY_HOSTS", HOST)
    monkeypatch.setenv("KILN_TRUSTED_REGISTRIES", "mirror.example")
    trusting = TestClient(create_app(Settings(), enqueue=lambda *a, **k: None), base_url=f"http://{HOST}")
    r = post(f"mirror.example/x@{engine.digest}", client=trusting, annotations={"kiln.dev/allow-stale": "drill"})
    assert r["allowed"] is True and "drill" in r["warnings"][0]
    assert "no Kiln engine" in post(f"mirror.example/x@{D_UNKNOWN}", client=trusting)["status"]["message"]
    monkeypatch.setenv("KILN_TRUSTED_REGISTRIES", "https://mirror.example")
    bad = TestClient(create_app(Settings(), enqueue=lambda *a, **k: None), base_url=f"http://{HOST}").post(
        "/v1/admission/validate", json=pod_create())
    assert bad.status_code == 400 and bad.json()["error"]["field"] == "KILN_TRUSTED_REGISTRIES", bad.text


def test_resolve_prints_the_copy_in_the_deployers_registry(tmp_path):
    from workers.replicas import replica_reference

    app = index_app()
    client = TestClient(app)
    engine = publish_engine(app, tmp_path, "resolved", target="cpu", revision=None)
    query = {"model": "acme/tiny", "precision": "fp8", "profile": "latency", "target": "cpu",
             "backend": "checkpoint"}
    assert "replica" not in client.get("/v1/resolve", params=query).json()  # asked for none: the answer as before
    r = client.get("/v1/resolve", params={**query, "registry": MIRROR})
    assert r.status_code == 404 and r.json()["error"]["field"] == "registry"
    assert r.json()["error"]["fix"].startswith(f"run kiln push acme/tiny@{engine.digest} {MIRROR}/acme/tiny ")
    # in this order: the latest pushed is the answer only where no repository is the path or <path>/<model>
    for dest in (f"{MIRROR}/mirror/acme/tiny:fp8",  # KILN_REPLICATE_TO=registry.example.com/mirror
                 f"{MIRROR}/team/engines", f"{MIRROR}/team/engines/tiny", f"{MIRROR}/mirror/copy",
                 "other.example/team/engines"):
        record(app, engine, dest)
    for registry, reference in ((MIRROR, f"{MIRROR}/mirror/copy"),
                                (f"{MIRROR}/mirror", f"{MIRROR}/mirror/acme/tiny"),
                                (f"{MIRROR}:443/team/engines/", f"{MIRROR}/team/engines"),
                                (f"{MIRROR}/team/engines/tiny", f"{MIRROR}/team/engines/tiny"),
                                (f"{MIRROR}/mirror/acme/tiny", f"{MIRROR}/mirror/acme/tiny"),
                                ("other.example", "other.example/team/engines")):
        r = client.get("/v1/resolve", params={**query, "registry": registry})
        assert r.status_code == 200 and r.json()["replica"] == f"{reference}@{engine.digest}", (registry, r.text)
    for registry in (f"{MIRROR}/team/engine", f"{MIRROR}:5000", "third.example"):
        assert client.get("/v1/resolve", params={**query, "registry": registry}).status_code == 404, registry
    bad = client.get("/v1/resolve", params={**query, "registry": "https://registry.example.com"})
    assert bad.status_code == 400 and bad.json()["error"]["field"] == "registry"
    with app.state.sessions() as s, pytest.raises(ArtifactUnknown):
        replica_reference(s, D_UNKNOWN, "acme/tiny", MIRROR)

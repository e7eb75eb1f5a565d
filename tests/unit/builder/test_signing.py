"""Signed engines: publish signs the engine files (OpenSSF model_signing) and the provenance (DSSE, in-toto SLSA
v1) with the configured key; `kiln pull` writes model.sig beside the files, which the real `model_signing` CLI
verifies offline; tampering of every kind fails it; the DSSE envelope verifies with securesystemslib (not only
Kiln's verifier); `kiln verify` and `kiln pull --verify-key` say why an engine is not verified."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from fastapi.testclient import TestClient

from api.app import create_app
from api.cli import main
from api.pull import pull_remote
from api.routes import oci
from artifacts.oci import read_manifest
from artifacts.signing import (BUNDLE_TYPE, IN_TOTO_PAYLOAD_TYPE, SIGNATURE_FILE, configured_signer, fingerprint,
                               pae)
from builder.attest import SIGNATURE_KEY_ANNOTATION
from builder.publish import publish
from artifacts.verify import keys_from, pull_local
from kiln import db
from kiln.digests import sha256_bytes
from kiln.tables import Artifact, Referrer
from kiln.settings import Settings
from kiln.spec import parse_spec

REPO = "acme/tiny"


def make_engine(root: Path, seed: str) -> Path:
    files = {"config.json": json.dumps({"engine": seed}).encode(), "rank0.safetensors": seed.encode() * 3000,
             "tokenizer/tokenizer.json": b"{}"}
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


class Kiln:
    """A Kiln on the test's KILN_HOME (what the CLI opens too), with engines published by publish()."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.settings = Settings()
        db.upgrade(self.settings.db_url)
        oci.MANIFESTS.clear()
        self.app = create_app(self.settings, enqueue=lambda *a, **k: None)
        self.store, self.sessions = self.app.state.store, self.app.state.sessions
        self.client = TestClient(self.app)

    def publish(self, seed: str, **kw) -> Artifact:
        spec = parse_spec({"checkpoint": f"hf://acme/tiny@{'a' * 40}", "model_name": REPO, "precision": "fp8",
                           "profile": "latency", "backend": "checkpoint"}, [])
        provenance = {"created": "2026-01-01T00:00:00Z", "toolchain": {"torch": "2.13"}, "kiln": "0.1.0",
                      "build_key": sha256_bytes(seed.encode()), "spec": spec.model_dump(),
                      "data": {"calibration": sha256_bytes(b"calib"), "evaluation": sha256_bytes(b"eval")},
                      "stages": [{"name": "quantize", "seconds": 2.0}],
                      "checkpoint": {"ref": spec.checkpoint, "digest": sha256_bytes(b"ckpt"), "revision": "a" * 40}}
        validation = {"passed": True, "metrics": {"perplexity": 41.0},
                      "gates": [{"name": "max_ppl_increase_pct", "value": 0.4, "threshold": 5.0, "passed": True}]}
        return publish(self.store, self.sessions, make_engine(self.tmp / seed, seed), spec=spec,
                       build_key=sha256_bytes(seed.encode()), provenance=provenance, validation=validation, **kw)

    def pull(self, digest: str, dest: Path, keys=None):
        return pull_local(self.store, self.sessions, digest, dest, keys=keys)

    def signatures(self, digest: str) -> list[Referrer]:
        with self.sessions() as s:
            return s.query(Referrer).filter(Referrer.subject == digest,
                                            Referrer.artifact_type.in_([BUNDLE_TYPE, IN_TOTO_PAYLOAD_TYPE])).all()

    def envelope(self, digest: str) -> dict:
        ref = next(r for r in self.signatures(digest) if r.artifact_type == IN_TOTO_PAYLOAD_TYPE)
        return json.loads(self.store.get_bytes(read_manifest(self.store, ref.digest)["layers"][0]["digest"]))


@pytest.fixture
def kiln(tmp_path):
    return Kiln(tmp_path)


def model_signing_verify(directory: Path, public_key: Path) -> subprocess.CompletedProcess:
    """The real OpenSSF CLI, as a deployer runs it: no Kiln code, no network."""
    return subprocess.run([sys.executable, "-m", "model_signing", "verify", "key", "--signature",
                           str(directory / SIGNATURE_FILE), "--public_key", str(public_key), str(directory)],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "NO_PROXY": "*"})


def other_key(tmp_path: Path) -> Path:
    pem = ec.generate_private_key(ec.SECP256R1()).public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    (tmp_path / "other.pub").write_bytes(pem)
    return tmp_path / "other.pub"


def test_embedded_defaults_generate_a_private_key_under_kiln_home(kiln):
    signer = configured_signer()
    path = Path(os.environ["KILN_HOME"]) / "keys" / "signing-key.pem"
    assert path.is_file() and (path.stat().st_mode & 0o777) == 0o600
    assert configured_signer(Settings()).fingerprint == signer.fingerprint  # one key, reused


def test_a_pulled_engine_verifies_with_the_model_signing_cli_and_each_tamper_fails(kiln, tmp_path):
    a, b = kiln.publish("engine-a"), kiln.publish("engine-b")
    pub = tmp_path / "kiln.pub"
    r = CliRunner().invoke(main, ["keys", "public"])
    assert r.exit_code == 0, r.output
    pub.write_text(r.output)
    assert fingerprint(pub.read_bytes()) == configured_signer().fingerprint

    dirs = {}
    for name, art in (("a", a), ("b", b), ("byte", a), ("added", a), ("swapped", a)):
        dirs[name] = tmp_path / f"pulled-{name}"
        r = CliRunner().invoke(main, ["pull", f"{REPO}@{art.digest}", str(dirs[name])])
        assert r.exit_code == 0, r.output
        assert (dirs[name] / SIGNATURE_FILE).is_file()
    ok = model_signing_verify(dirs["a"], pub)
    assert ok.returncode == 0, ok.stderr
    assert "Verification succeeded" in ok.stdout

    f = dirs["byte"] / "rank0.safetensors"  # one byte in one file
    data = bytearray(f.read_bytes())
    data[100] ^= 1
    f.write_bytes(bytes(data))
    (dirs["added"] / "tokenizer" / "extra.json").write_text("{}")  # a file added
    (dirs["swapped"] / SIGNATURE_FILE).write_bytes((dirs["b"] / SIGNATURE_FILE).read_bytes())  # another engine's
    for name in ("byte", "added", "swapped"):
        bad = model_signing_verify(dirs[name], pub)
        assert bad.returncode == 1, (name, bad.stdout, bad.stderr)
    wrong = model_signing_verify(dirs["a"], other_key(tmp_path))  # the wrong key
    assert wrong.returncode == 1 and "Key mismatch" in wrong.stderr


def test_the_provenance_envelope_verifies_with_securesystemslib_and_plain_cryptography(kiln):
    from securesystemslib.dsse import Envelope
    from securesystemslib.signer import SSlibKey

    art = kiln.publish("engine-a")
    signer = configured_signer()
    raw = kiln.envelope(art.digest)
    public = serialization.load_pem_public_key(signer.public_pem)
    key = SSlibKey.from_crypto(public, keyid=raw["signatures"][0]["keyid"], scheme="ecdsa-sha2-nistp256")
    env = Envelope.from_dict(json.loads(json.dumps(raw)))
    assert list(env.verify([key], 1)) == [signer.fingerprint]
    # and a second, independent check: the DSSE PAE written out here, the signature checked by cryptography
    payload = base64.b64decode(raw["payload"])
    pae_bytes = b"DSSEv1 %d %s %d %s" % (len(IN_TOTO_PAYLOAD_TYPE), IN_TOTO_PAYLOAD_TYPE.encode(), len(payload),
                                          payload)
    assert pae_bytes == pae(IN_TOTO_PAYLOAD_TYPE, payload)
    public.verify(base64.b64decode(raw["signatures"][0]["sig"]), pae_bytes, ec.ECDSA(hashes.SHA256()))
    statement = json.loads(payload)
    assert statement["_type"] == "https://in-toto.io/Statement/v1"
    assert statement["predicateType"] == "https://slsa.dev/provenance/v1"
    manifest = read_manifest(kiln.store, art.digest)
    assert [s["digest"]["sha256"] for s in statement["subject"]] == [
        d.split(":")[1] for d in [art.digest, manifest["layers"][0]["digest"]]]
    bd, rd = statement["predicate"]["buildDefinition"], statement["predicate"]["runDetails"]
    ckpt = next(d for d in bd["resolvedDependencies"] if d["name"] == "checkpoint")
    assert ckpt["uri"] == f"hf://acme/tiny@{'a' * 40}" and ckpt["digest"]["gitCommit"] == "a" * 40
    assert {d["name"] for d in bd["resolvedDependencies"]} >= {"dataset:calibration", "dataset:evaluation",
                                                              "toolchain:torch"}
    assert bd["externalParameters"]["spec"]["precision"] == "fp8"
    assert rd["builder"]["version"]["kiln"] == "0.1.0" and rd["metadata"]["startedOn"] == "2025-12-31T23:59:58Z"
    assert rd["byproducts"][0]["annotations"]["gates"][0]["passed"] is True
    tampered = dict(raw, payload=base64.b64encode(payload.replace(b"fp8", b"fp4")).decode())
    with pytest.raises(Exception):
        Envelope.from_dict(tampered).verify([key], 1)


def test_referrers_name_the_key(kiln):
    art = kiln.publish("engine-a")
    refs = kiln.signatures(art.digest)
    assert sorted(r.artifact_type for r in refs) == sorted([BUNDLE_TYPE, IN_TOTO_PAYLOAD_TYPE])
    assert {r.annotations[SIGNATURE_KEY_ANNOTATION] for r in refs} == {configured_signer().fingerprint}
    listed = kiln.client.get(f"/v2/{REPO}/referrers/{art.digest}", params={"artifactType": BUNDLE_TYPE}).json()[
        "manifests"]
    assert len(listed) == 1 and listed[0]["annotations"][SIGNATURE_KEY_ANNOTATION] == configured_signer().fingerprint


def _verify(*args: str) -> tuple[int, str]:
    r = CliRunner().invoke(main, ["verify", *args])
    return r.exit_code, r.output


def test_kiln_verify_verdicts(kiln, tmp_path):
    a, b = kiln.publish("engine-a"), kiln.publish("engine-b")
    code, out = _verify(f"{REPO}@{a.digest}")
    assert code == 0 and f"key {configured_signer().fingerprint}" in out
    code, out = _verify(a.digest, "--key", str(other_key(tmp_path)))  # wrong key
    assert code == 1 and "not trusted (wrong key)" in out
    code, out = _verify("sha256:nothex")
    assert code == 2
    code, out = _verify(a.digest, "--key", str(tmp_path / "missing.pub"))
    assert code == 2 and "key" in out

    # subject mismatch: a's provenance referrer made to carry b's (validly signed) envelope
    env_b = json.dumps(kiln.envelope(b.digest)).encode()
    ref_a = next(r for r in kiln.signatures(a.digest) if r.artifact_type == IN_TOTO_PAYLOAD_TYPE)
    from artifacts.oci import MEDIA_TYPE_IMAGE_MANIFEST, descriptor, push_referrer
    from artifacts.signing import DSSE_TYPE

    forged = push_referrer(kiln.store, descriptor(MEDIA_TYPE_IMAGE_MANIFEST, a.digest, kiln.store.stat(a.digest).size),
                           artifact_type=IN_TOTO_PAYLOAD_TYPE, payload=env_b, payload_media_type=DSSE_TYPE,
                           annotations={})
    with kiln.sessions() as s:
        s.delete(s.get(Referrer, ref_a.digest))
        s.add(Referrer(digest=forged, subject=a.digest, repository=REPO, artifact_type=IN_TOTO_PAYLOAD_TYPE,
                       size=kiln.store.stat(forged).size, annotations={}))
        s.commit()
    code, out = _verify(a.digest)
    assert code == 1 and "subject mismatch" in out

    # unsigned: an engine whose signature referrers are gone (published before signing existed)
    with kiln.sessions() as s:
        for r in s.query(Referrer).filter(Referrer.subject == b.digest,
                                          Referrer.artifact_type.in_([BUNDLE_TYPE, IN_TOTO_PAYLOAD_TYPE])):
            s.delete(r)
        s.commit()
    code, out = _verify(b.digest)
    assert code == 1 and "unsigned" in out
    # ...which one admin command signs
    r = CliRunner().invoke(main, ["keys", "resign", "--all"])
    assert r.exit_code == 0 and "1 engine(s) signed" in r.output, r.output
    assert _verify(b.digest)[0] == 0


def test_kiln_verify_refuses_a_revoked_engine_in_the_local_store(kiln):
    """With --server a revoked engine is refused (403 from /v2); the local store said "verified", exit 0."""
    from kiln.states import move_artifact

    a = kiln.publish("engine-a")
    with kiln.sessions() as s:
        move_artifact(s, s.get(Artifact, a.digest), "revoked", reason="bad weights")
        s.commit()
    code, out = _verify(a.digest)
    assert code == 2 and "verified" not in out.replace("not verified", "")
    assert f"engine {a.digest} is revoked (bad weights)" in out


def test_tampered_layer_in_the_store_is_not_verified(kiln):
    a = kiln.publish("engine-a")
    from artifacts import paths

    layer = read_manifest(kiln.store, a.digest)["layers"][0]["digest"]
    blob = kiln.store.root / paths.blob_path(layer)
    blob.chmod(0o644)
    data = bytearray(blob.read_bytes())
    data[2000] ^= 1
    blob.write_bytes(bytes(data))
    code, out = _verify(a.digest)
    assert code == 1 and "tampered" in out


def test_pull_verify_key_refuses_and_writes_nothing(kiln, tmp_path):
    a = kiln.publish("engine-a")
    pub = tmp_path / "kiln.pub"
    pub.write_bytes(configured_signer().public_pem)
    wrong = other_key(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    r = CliRunner().invoke(main, ["pull", a.digest, str(out / "e"), "--verify-key", str(wrong)])
    assert r.exit_code == 1 and "wrong key" in r.output
    assert list(out.iterdir()) == []
    r = CliRunner().invoke(main, ["pull", a.digest, str(out / "e"), "--verify-key", str(pub)])
    assert r.exit_code == 0 and "verified, signed by" in r.output, r.output
    assert model_signing_verify(out / "e", pub).returncode == 0

    # and over the /v2 API, trusting nothing the server says about keys
    keys = keys_from(str(pub))
    got = pull_remote("http://testserver", f"{REPO}@{a.digest}", tmp_path / "remote", client=kiln.client,
                      verify_keys=keys)
    assert got.verified_key == configured_signer().fingerprint and (tmp_path / "remote" / SIGNATURE_FILE).is_file()
    assert (tmp_path / "remote" / SIGNATURE_FILE).read_bytes() == (out / "e" / SIGNATURE_FILE).read_bytes()
    with pytest.raises(Exception, match="wrong key"):
        pull_remote("http://testserver", f"{REPO}@{a.digest}", out / "r2", client=kiln.client,
                    verify_keys=keys_from(str(wrong)))
    assert list(out.iterdir()) == [out / "e"]
    unverified = pull_remote("http://testserver", f"{REPO}@{a.digest}", tmp_path / "plain", client=kiln.client)
    assert unverified.signed and unverified.verified_key is None
    assert model_signing_verify(tmp_path / "plain", pub).returncode == 0


def test_a_stage_cache_engine_publishes_and_verifies_without_its_stage_record(kiln, tmp_path):
    """The engine directory a build publishes is its stage-cache entry, with ``.complete`` beside the files: the
    layer leaves the record out, so the signature must too, and the pulled engine verifies without it."""
    engine = tmp_path / "engine-c"
    engine.mkdir()
    (engine / ".complete").write_text(json.dumps({"seconds": 1.5, "dir": str(engine)}))
    art = kiln.publish("engine-c")
    pub = tmp_path / "kiln.pub"
    pub.write_bytes(configured_signer().public_pem)
    out = tmp_path / "pulled"
    r = CliRunner().invoke(main, ["pull", art.digest, str(out), "--verify-key", str(pub)])
    assert r.exit_code == 0 and "verified, signed by" in r.output, r.output
    assert not (out / ".complete").exists() and (out / "config.json").is_file()
    assert ".complete" not in (out / SIGNATURE_FILE).read_text()
    assert model_signing_verify(out, pub).returncode == 0


def test_rotation_old_engines_verify_with_trusted_keys(kiln, tmp_path, monkeypatch):
    a = kiln.publish("engine-a")
    old_pub = configured_signer().public_pem
    new = ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    (tmp_path / "new.pem").write_bytes(new)
    (tmp_path / "old.pub").write_bytes(old_pub)
    monkeypatch.setenv("KILN_SIGNING_KEY", str(tmp_path / "new.pem"))
    assert _verify(a.digest)[0] == 1  # the old key is no longer trusted...
    monkeypatch.setenv("KILN_TRUSTED_KEYS", str(tmp_path / "old.pub"))
    assert _verify(a.digest)[0] == 0  # ...until it is listed
    b = kiln.publish("engine-b")
    assert {r.annotations[SIGNATURE_KEY_ANNOTATION] for r in kiln.signatures(b.digest)} == {
        fingerprint(serialization.load_pem_private_key(new, None).public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))}
    monkeypatch.setenv("KILN_SIGNING_KEY", "not a key")
    r = CliRunner().invoke(main, ["keys", "public"])
    assert r.exit_code == 2 and "KILN_SIGNING_KEY" in r.output

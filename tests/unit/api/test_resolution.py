"""Resolution never returns a stale, revoked, rejected or incompatible engine — over random sequences of
builds published by the real ``builder.publish.publish`` (one of them racing a head move), head moves through
``workers.freshness``, revokes through the real ``POST /v1/artifacts/{digest}/revoke`` route, and resolves
(hypothesis), on a real SQLite database with the real migrations and a real local blob store."""

from __future__ import annotations

import itertools
import json

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from sqlalchemy import event

from api.app import create_app
from artifacts.oci import read_manifest
from builder.publish import publish as real_publish
from kiln import db
from kiln.backends import BACKENDS
from kiln.precisions import PRECISIONS
from kiln.errors import SpecError
from kiln.tables import Artifact, Tag, TrackedModel, utcnow
from kiln.settings import Settings
from kiln.spec import parse_spec
from workers.freshness import mark_stale
from api.resolution import Servable, incompatibility, parse_runtime, resolve_engine

MODEL = "acme/tiny"
SLOTS = [("fp8", "latency", "cpu", "aot-inductor"), ("nvfp4", "latency", "sm100", "trtllm-engine")]
RUNTIMES = ["tensorrt_llm=1.2.1", "tensorrt_llm=1.2.0", None]
counter = itertools.count()


def rev(n: int) -> str:
    return f"{n:040x}"


class Index:
    """A real app (its index, store and routes) in a temporary home."""

    def __init__(self, tmp_path):
        self.tmp = tmp_path / f"r{next(counter)}"
        self.settings = Settings(home=self.tmp / "home")
        db.upgrade(self.settings.db_url)
        self.app = create_app(self.settings, enqueue=lambda *a: None)
        self.sessions, self.store = self.app.state.sessions, self.app.state.store
        self.client = TestClient(self.app)

    def publish(self, *, revision: str, slot, trtllm: str, passed: bool = True, toolchain: dict | None = None) -> Artifact:
        n = next(counter)
        precision, profile, target, backend = slot
        spec = parse_spec({"checkpoint": f"hf://acme/tiny@{revision}", "model_name": MODEL, "precision": precision,
                           "profile": profile, "target": target, "backend": backend}, [])
        root = self.tmp / f"engine{n}"
        root.mkdir(parents=True)
        (root / "config.json").write_text(json.dumps({"n": n}))
        provenance = {"created": "2026-01-01T00:00:00Z", "toolchain": toolchain or {"tensorrt_llm": trtllm},
                      "checkpoint": {"ref": spec.checkpoint, "digest": f"sha256:{n:064x}", "revision": revision}}
        return real_publish(self.store, self.sessions, root, spec=spec, build_key=f"sha256:{n + 10**6:064x}",
                            provenance=provenance, validation={"passed": passed})

    def move_head(self, head: str) -> None:
        with self.sessions() as s:
            m = s.get(TrackedModel, MODEL)
            m.head_sha = head
            mark_stale(s, m)
            s.commit()

    def publish_racing_head_move(self, *, revision: str, new_head: str, slot, trtllm: str) -> Artifact:
        """Publish while another connection moves the head: it commits after publish has read the head (as
        fresh) and just before publish writes its row — the interleaving two processes can produce."""
        engine = db.get_engine(self.settings.db_url)
        fired = []

        def move_now(conn, cursor, statement, *_):
            if not fired and statement.lstrip().upper().startswith("INSERT INTO ARTIFACTS"):
                fired.append(True)
                self.move_head(new_head)

        event.listen(engine, "before_cursor_execute", move_now)
        try:
            return self.publish(revision=revision, slot=slot, trtllm=trtllm)
        finally:
            event.remove(engine, "before_cursor_execute", move_now)
            assert fired, "the head move did not run inside publish"

    def revoke(self, digest: str, reason: str = "withdrawn"):
        return self.client.post(f"/v1/artifacts/{digest}/revoke", json={"reason": reason})


class Registry(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.index = Index(self._tmp)
        self.sessions = self.index.sessions
        self.heads = [rev(0)]

    _tmp = None

    @initialize()
    def track(self):
        with self.sessions() as s:
            s.add(TrackedModel(name=MODEL, checkpoint="hf://acme/tiny@main", hf_repo="acme/tiny", branch="main",
                               head_sha=rev(0), matrix=[], gates={}, created_at=utcnow(), updated_at=utcnow()))
            s.commit()

    @rule(slot=st.sampled_from(SLOTS), old=st.booleans(), trtllm=st.sampled_from(["1.2.1", "1.2.0"]),
          passed=st.booleans())
    def publish(self, slot, old, trtllm, passed):
        revision = self.heads[0] if (old and len(self.heads) > 1) else self.heads[-1]
        self.index.publish(revision=revision, slot=slot, trtllm=trtllm, passed=passed)

    @rule(slot=st.sampled_from(SLOTS), trtllm=st.sampled_from(["1.2.1", "1.2.0"]))
    def publish_while_the_head_moves(self, slot, trtllm):
        self.heads.append(rev(len(self.heads)))
        self.index.publish_racing_head_move(revision=self.heads[-2], new_head=self.heads[-1], slot=slot,
                                            trtllm=trtllm)

    @rule()
    def move_head(self):
        self.heads.append(rev(len(self.heads)))
        self.index.move_head(self.heads[-1])

    @rule(data=st.data())
    def revoke(self, data):
        with self.sessions() as s:
            rows = [(a.digest, a.status) for a in s.query(Artifact).all()]
        if not rows:
            return
        digest, status = data.draw(st.sampled_from(rows))
        r = self.index.revoke(digest)
        assert r.status_code == (409 if status == "revoked" else 200), r.text

    @rule(slot=st.sampled_from(SLOTS), runtime=st.sampled_from(RUNTIMES))
    def resolve(self, slot, runtime):
        precision, profile, target, backend = slot
        with self.sessions() as s:
            r = resolve_engine(s, model=MODEL, precision=precision, profile=profile, target=target, backend=backend,
                               runtime=runtime)
            head = s.get(TrackedModel, MODEL).head_sha
            if r.artifact is not None:
                a = r.artifact
                assert a.status == "fresh" and a.checkpoint_revision == head
                assert (a.precision, a.profile, a.target, a.backend) == slot
                if runtime:
                    assert a.provenance["toolchain"]["tensorrt_llm"] == runtime.split("=")[1]
            else:
                servable = [a for a in s.query(Artifact).filter_by(precision=precision, target=target, backend=backend)
                            if a.status == "fresh" and a.checkpoint_revision == head
                            and (not runtime or a.provenance["toolchain"]["tensorrt_llm"] == runtime.split("=")[1])]
                assert not servable, "a servable engine existed but resolve said none"
                assert r.status in (404, 409) and r.reason

    @invariant()
    def tags_name_only_fresh_engines_of_the_head(self):
        with self.sessions() as s:
            head = s.get(TrackedModel, MODEL).head_sha if s.get(TrackedModel, MODEL) else None
            for t in s.query(Tag).all():
                a = s.get(Artifact, t.digest)
                assert a.status == "fresh" and (head is None or a.checkpoint_revision == head)

    @invariant()
    def no_fresh_engine_of_an_old_head(self):
        with self.sessions() as s:
            head = s.get(TrackedModel, MODEL).head_sha if s.get(TrackedModel, MODEL) else None
            if head is not None:
                assert not s.query(Artifact).filter(Artifact.status == "fresh",
                                                    Artifact.checkpoint_revision != head).all()


@pytest.fixture
def machine(tmp_path):
    Registry._tmp = tmp_path
    return Registry


def test_resolve_never_serves_stale_revoked_or_incompatible(machine):
    from hypothesis.stateful import run_state_machine_as_test

    run_state_machine_as_test(machine, settings=settings(max_examples=25, stateful_step_count=20, deadline=None,
                                                         suppress_health_check=list(HealthCheck)))


def test_runtime_parsing():
    assert parse_runtime("tensorrt_llm=1.2.1, tensorrt=10.13.3") == {"tensorrt_llm": "1.2.1", "tensorrt": "10.13.3"}
    with pytest.raises(SpecError) as e:
        parse_runtime("trtllm")
    assert e.value.field == "runtime"


def track(index: Index, head: str) -> None:
    with index.sessions() as s:
        s.add(TrackedModel(name=MODEL, checkpoint="hf://acme/tiny@main", hf_repo="acme/tiny", branch="main",
                           head_sha=head, matrix=[], gates={}, created_at=utcnow(), updated_at=utcnow()))
        s.commit()


def test_resolve_reasons(tmp_path):
    index = Index(tmp_path)
    sessions, slot = index.sessions, SLOTS[0]
    with sessions() as s:
        r = resolve_engine(s, model=MODEL, precision="fp8", profile="latency", target="cpu", backend="aot-inductor")
        assert (r.status, r.code) == (404, "not_built")
    track(index, rev(1))
    index.publish(revision=rev(1), slot=slot, trtllm="1.2.1")
    with sessions() as s:
        ok = resolve_engine(s, model=MODEL, precision="fp8", profile="latency", target="cpu", backend="aot-inductor")
        assert ok.status == 200
        bad = resolve_engine(s, model=MODEL, precision="fp8", profile="latency", target="cpu", backend="aot-inductor",
                             runtime="tensorrt_llm=9.9")
        assert (bad.status, bad.code) == (409, "incompatible_runtime") and "9.9" in bad.reason
    index.move_head(rev(2))
    with sessions() as s:
        stale = resolve_engine(s, model=MODEL, precision="fp8", profile="latency", target="cpu", backend="aot-inductor")
        assert (stale.status, stale.code) == (409, "stale_only") and rev(2) in stale.reason
        assert s.query(Tag).count() == 0
        with pytest.raises(SpecError) as e:
            resolve_engine(s, model=MODEL, precision="int8", profile="latency", target="cpu", backend="aot-inductor")
        assert e.value.field == "precision"


def test_an_engine_published_while_the_head_moves_is_stale_and_untagged(tmp_path):
    index = Index(tmp_path)
    track(index, rev(1))
    a = index.publish_racing_head_move(revision=rev(1), new_head=rev(2), slot=SLOTS[0], trtllm="1.2.1")
    with index.sessions() as s:
        assert (s.get(Artifact, a.digest).status, s.get(Artifact, a.digest).status_reason) == (
            "stale", f"the tracked branch moved while {a.build_key} published")
        assert s.query(Tag).count() == 0
        r = resolve_engine(s, model=MODEL, precision="fp8", profile="latency", target="cpu", backend="aot-inductor")
        assert r.artifact is None and r.code == "stale_only"


ASKED = ("fp8", "latency", "cpu", "aot-inductor")
#: one field off the asked variant each: precision, profile, target, backend
NEIGHBOURS = [("nvfp4", "latency", "cpu", "aot-inductor"), ("fp8", "throughput", "cpu", "aot-inductor"),
              ("fp8", "latency", "sm90", "aot-inductor"), ("fp8", "latency", "cpu", "checkpoint")]


def resolve_slot(s, slot, **kw):
    precision, profile, target, backend = slot
    return resolve_engine(s, model=MODEL, precision=precision, profile=profile, target=target, backend=backend, **kw)


def test_resolve_answers_its_own_variant_only_the_newest_engine(tmp_path):
    index = Index(tmp_path)
    neighbours = [index.publish(revision=rev(1), slot=slot, trtllm="1.2.1") for slot in NEIGHBOURS]
    with index.sessions() as s:
        r = resolve_slot(s, ASKED)
        assert (r.status, r.code) == (404, "not_built"), "an engine one field off the asked variant was served"
        for slot, engine in zip(NEIGHBOURS, neighbours):
            assert resolve_slot(s, slot).artifact.digest == engine.digest
    older = index.publish(revision=rev(1), slot=ASKED, trtllm="1.2.1")
    newer = index.publish(revision=rev(1), slot=ASKED, trtllm="1.2.1")
    with index.sessions() as s:
        s.get(Artifact, older.digest).created_at = utcnow()  # stamped in publish order, apart even where the
        s.get(Artifact, newer.digest).created_at = utcnow()  # clock is coarse
        s.commit()
        r = resolve_slot(s, ASKED)
        assert r.status == 200 and r.artifact.digest == newer.digest
        # another model's engines are not this model's
        other = resolve_engine(s, model="acme/other", precision="fp8", profile="latency", target="cpu",
                               backend="aot-inductor")
        assert (other.status, other.code) == (404, "not_built") and "is not tracked" in other.reason


def add_build(s, slot, status: str, *, model: str = MODEL) -> str:
    import uuid

    from kiln.tables import Build

    precision, profile, target, backend = slot
    bid = uuid.uuid4().hex
    s.add(Build(id=bid, request_key="sha256:" + uuid.uuid4().hex * 2, queue="q", status=status,
                spec={"model_name": model, "precision": precision, "target": target, "backend": backend,
                      "profile": {"name": profile}, "checkpoint": f"hf://acme/tiny@{rev(3)}"}))
    s.commit()
    return bid


@pytest.mark.parametrize("status", ["queued", "running"])
def test_resolve_names_the_build_in_progress_for_its_variant(tmp_path, status):
    index = Index(tmp_path)
    with index.sessions() as s:
        for slot in NEIGHBOURS:  # builds one field off, a finished build and another model's: none counts
            add_build(s, slot, status)
        add_build(s, ASKED, "succeeded")
        add_build(s, ASKED, status, model="acme/other")
        r = resolve_slot(s, ASKED)
        assert (r.status, r.code) == (404, "not_built")
        bid = add_build(s, ASKED, status)
        r = resolve_slot(s, ASKED)
        assert (r.status, r.code) == (404, "building") and f"build {bid} is {status}" in r.reason
        assert rev(3) in r.reason


WHAT = "acme/tiny fp8 latency cpu aot-inductor"


def publish_in_order(index: Index, *engines) -> list[Artifact]:
    """Publish ``(revision, trtllm, passed)`` engines of the asked variant, each stamped newer than the last."""
    out = [index.publish(revision=r, slot=ASKED, trtllm=t, passed=p) for r, t, p in engines]
    with index.sessions() as s:
        for a in out:
            s.get(Artifact, a.digest).created_at = utcnow()
            s.commit()
    return out


def test_an_untracked_model_with_no_engine_is_named_as_untracked_word_for_word(tmp_path):
    index = Index(tmp_path)
    with index.sessions() as s:
        r = resolve_slot(s, ASKED)
    assert (r.artifact, r.status, r.code) == (None, 404, "not_built")
    assert r.reason == f"no engine for {WHAT} has been built; model 'acme/tiny' is not tracked"
    track(index, rev(1))
    with index.sessions() as s:
        assert resolve_slot(s, ASKED).reason == f"no engine for {WHAT} has been built"


def test_the_incompatible_runtime_reason_lists_the_three_newest_fresh_engines_and_what_each_was_built_with(tmp_path):
    index = Index(tmp_path)
    track(index, rev(1))
    a, b, c, d = publish_in_order(index, (rev(1), "1.2.0", True), (rev(1), "1.2.1", True), (rev(1), "1.2.2", True),
                                  (rev(1), "1.2.3", True))
    with index.sessions() as s:
        r = resolve_slot(s, ASKED, runtime="tensorrt_llm=9.9, tensorrt=10.13")
        assert (r.artifact, r.status, r.code) == (None, 409, "incompatible_runtime")
        assert r.reason == (f"fresh engines for {WHAT} exist but none loads on tensorrt_llm=9.9, tensorrt=10.13: "
                            f"{d.digest[:19]}… built with tensorrt_llm 1.2.3 (asked 9.9), tensorrt absent (asked 10.13); "
                            f"{c.digest[:19]}… built with tensorrt_llm 1.2.2 (asked 9.9), tensorrt absent (asked 10.13); "
                            f"{b.digest[:19]}… built with tensorrt_llm 1.2.1 (asked 9.9), tensorrt absent (asked 10.13)")
        # an older engine that loads on the asked runtime is the answer, with everything a deployer needs
        ok = resolve_slot(s, ASKED, runtime="tensorrt_llm=1.2.0")
        assert (ok.status, ok.code, ok.reason) == (200, "ok", "fresh")
        assert ok.artifact == Servable(a.digest, MODEL, a.tag, "fresh", "fp8", "latency", "cpu", "aot-inductor", rev(1),
                                       s.get(Artifact, a.digest).provenance)
        assert resolve_slot(s, ASKED).artifact.digest == d.digest  # no runtime asked: the newest


def test_the_stale_only_reason_names_the_head_what_its_engines_are_and_the_build_in_progress(tmp_path):
    index = Index(tmp_path)
    track(index, rev(1))
    publish_in_order(index, (rev(1), "1.2.1", True))
    index.move_head(rev(2))
    with index.sessions() as s:
        r = resolve_slot(s, ASKED)
        assert (r.artifact, r.status, r.code) == (None, 409, "stale_only")
        assert r.reason == f"only stale engines for {WHAT} (the head is {rev(2)}); no build is running"
    rejected, revoked = publish_in_order(index, (rev(2), "1.2.1", False), (rev(2), "1.2.1", True))
    assert index.revoke(revoked.digest).status_code == 200
    with index.sessions() as s:
        assert resolve_slot(s, ASKED).reason == (f"only stale engines for {WHAT} (the head is {rev(2)}); "
                                                 "the head's engines are rejected, revoked; no build is running")
        bid = add_build(s, ASKED, "queued")
        assert resolve_slot(s, ASKED).reason == (f"only stale engines for {WHAT} (the head is {rev(2)}); "
                                                 "the head's engines are rejected, revoked; "
                                                 f"build {bid} is queued for hf://acme/tiny@{rev(3)}")


def test_stale_engines_of_an_untracked_model_are_named_without_a_head(tmp_path):
    index = Index(tmp_path)
    a, rejected = publish_in_order(index, (rev(1), "1.2.1", True), (rev(1), "1.2.1", False))
    with index.sessions() as s:
        s.get(Artifact, a.digest).status = "stale"  # set up: a model no longer tracked keeps its stale engines
        s.get(Artifact, rejected.digest).checkpoint_revision = None  # and one of no known revision: no head's
        s.commit()
        r = resolve_slot(s, ASKED)
    assert (r.status, r.code, r.reason) == (409, "stale_only", f"only stale engines for {WHAT}; no build is running")


def test_a_head_that_moves_back_names_its_old_engines_stale_and_the_others_by_state(tmp_path):
    index = Index(tmp_path)
    track(index, rev(1))
    publish_in_order(index, (rev(1), "1.2.1", True))
    index.move_head(rev(2))
    index.move_head(rev(1))  # a revert: the engine of rev(1) stays stale (a stale engine is never fresh again)
    with index.sessions() as s:
        assert resolve_slot(s, ASKED).reason == f"only stale engines for {WHAT} (the head is {rev(1)}); no build is running"
    publish_in_order(index, (rev(1), "1.2.1", False))
    with index.sessions() as s:
        assert resolve_slot(s, ASKED).reason == (f"only stale engines for {WHAT} (the head is {rev(1)}); "
                                                 "the head's engines are rejected; no build is running")


@pytest.mark.parametrize("field,value,message,fix", [
    ("precision", "int8", "'int8' is not a precision", f"use one of {', '.join(PRECISIONS)}"),
    ("backend", "tensorrt", "'tensorrt' is not a backend", f"use one of {', '.join(BACKENDS)}"),
])
def test_resolve_refuses_an_unknown_precision_or_backend_naming_the_field_and_the_choices(tmp_path, field, value,
                                                                                        message, fix):
    index = Index(tmp_path)
    asked = dict(zip(("precision", "profile", "target", "backend"), ASKED), **{field: value})
    with index.sessions() as s, pytest.raises(SpecError) as e:
        resolve_engine(s, model=MODEL, **asked)
    assert (e.value.message, e.value.field, e.value.fix) == (message, field, fix)


def test_resolve_refuses_an_unknown_target_with_the_targets_own_words(tmp_path):
    from kiln.targets import normalize_target

    index = Index(tmp_path)
    _, err = normalize_target("tpu-v9")
    with index.sessions() as s, pytest.raises(SpecError) as e:
        resolve_engine(s, model=MODEL, precision="fp8", profile="latency", target="tpu-v9", backend="aot-inductor")
    assert (e.value.message, e.value.field, e.value.fix) == (err["message"], "target", err["fix"])
    assert err["message"] and err["fix"]


def test_engines_that_exist_but_cannot_be_served_are_named_by_their_states(tmp_path):
    index = Index(tmp_path)
    track(index, rev(1))
    publish_in_order(index, (rev(1), "1.2.1", False))
    with index.sessions() as s:
        r = resolve_slot(s, ASKED)
        assert (r.artifact, r.status, r.code) == (None, 404, "none_servable")
        assert r.reason == f"engines for {WHAT} exist but are rejected"
    (revoked,) = publish_in_order(index, (rev(1), "1.2.1", True))
    assert index.revoke(revoked.digest).status_code == 200
    with index.sessions() as s:
        assert resolve_slot(s, ASKED).reason == f"engines for {WHAT} exist but are rejected, revoked"
        bid = add_build(s, ASKED, "running")
        r = resolve_slot(s, ASKED)
    assert (r.status, r.code) == (404, "building")
    assert r.reason == f"no fresh engine for {WHAT} yet; build {bid} is running for hf://acme/tiny@{rev(3)}"


def test_runtime_parsing_word_for_word():
    assert parse_runtime(None) == {} and parse_runtime("") == {}
    assert parse_runtime(" tensorrt_llm = 1.2.1 ,tensorrt=10.13.3") == {"tensorrt_llm": "1.2.1", "tensorrt": "10.13.3"}
    assert parse_runtime("a=b=c") == {"a": "b=c"}
    for bad in ("trtllm", "=1.2", "trtllm="):
        with pytest.raises(SpecError) as e:
            parse_runtime(f"tensorrt=10,{bad}")
        assert (e.value.message, e.value.field, e.value.fix) == (
            f"{bad!r} is not name=version", "runtime", "write e.g. tensorrt_llm=1.2.1,tensorrt=10.13.3")


def test_incompatibility_names_each_component_built_otherwise_or_absent():
    built = {"toolchain": {"tensorrt_llm": "1.2.1", "tensorrt": "10.13.3"}}
    assert incompatibility(built, {}) is None
    assert incompatibility(built, {"tensorrt_llm": "1.2.1", "tensorrt": "10.13.3"}) is None
    assert incompatibility(built, {"tensorrt": "10.13.3", "tensorrt_llm": "1.2.0", "cuda": "13"}) == \
        "built with tensorrt_llm 1.2.1 (asked 1.2.0), cuda absent (asked 13)"
    assert incompatibility(None, {"tensorrt_llm": "1.2.1"}) == "built with tensorrt_llm absent (asked 1.2.1)"
    assert incompatibility({}, {"tensorrt_llm": "1.2.1"}) == "built with tensorrt_llm absent (asked 1.2.1)"


AVX2 = "x86_64-AVX2"
SKYLAKE = "x86_64-AVX512"  # AVX512 without VNNI, AVX512-BF16 or AMX
ZEN4 = "x86_64-AVX512+avx512_bf16+avx512_vnni+bf16"
SAPPHIRE_RAPIDS = "x86_64-AVX512+amx_tile+avx512_bf16+avx512_vnni+bf16"


def test_a_cpu_engine_resolves_only_for_a_cpu_that_runs_its_code(tmp_path):
    """An AVX512 / AMX ``.so`` never goes to an AVX2 runtime (it would not load: illegal instructions); an AVX2
    one goes to an AVX512 runtime; features the engine was compiled with must all be on the asked CPU."""
    index = Index(tmp_path)
    track(index, rev(1))
    avx2, amx = (index.publish(revision=rev(1), slot=ASKED, trtllm="", toolchain={"torch": "2.13.0+cpu", "cpu": cpu})
                 for cpu in (AVX2, SAPPHIRE_RAPIDS))
    with index.sessions() as s:
        s.get(Artifact, avx2.digest).created_at = utcnow()
        s.commit()
        s.get(Artifact, amx.digest).created_at = utcnow()
        s.commit()
        served = {cpu: resolve_slot(s, ASKED, runtime=f"torch=2.13.0+cpu,cpu={cpu}").artifact.digest
                  for cpu in (AVX2, SKYLAKE, ZEN4, SAPPHIRE_RAPIDS)}
        assert served == {AVX2: avx2.digest, SKYLAKE: avx2.digest, ZEN4: avx2.digest, SAPPHIRE_RAPIDS: amx.digest}
        assert resolve_slot(s, ASKED, runtime="cpu=aarch64-DEFAULT").code == "incompatible_runtime"
        s.delete(s.get(Artifact, avx2.digest))
        s.commit()
        r = resolve_slot(s, ASKED, runtime=f"cpu={AVX2}")
        assert (r.artifact, r.status, r.code) == (None, 409, "incompatible_runtime")
        assert r.reason == (f"fresh engines for {WHAT} exist but none loads on cpu={AVX2}: {amx.digest[:19]}… built "
                            f"with cpu {SAPPHIRE_RAPIDS} (asked {AVX2}: built for AVX512 code, which AVX2 cannot run)")
        r = resolve_slot(s, ASKED, runtime=f"cpu={SKYLAKE}")
        assert r.code == "incompatible_runtime" and r.reason.endswith(
            "built with amx_tile, avx512_bf16, avx512_vnni, bf16, which the asked CPU lacks)")
        # the published runtime annotation is a runtime= string that resolves to the engine itself
        runtime = read_manifest(index.store, amx.digest)["annotations"]["dev.kiln.engine.runtime"]
        assert runtime == f"torch=2.13.0+cpu,cpu={SAPPHIRE_RAPIDS}"
        assert resolve_slot(s, ASKED, runtime=runtime).artifact.digest == amx.digest


def test_cpu_incompatibility_orders_levels_and_requires_features():
    from kiln.toolchain import cpu_incompatibility

    assert cpu_incompatibility(AVX2, AVX2) is None and cpu_incompatibility(AVX2, SAPPHIRE_RAPIDS) is None
    assert cpu_incompatibility(SAPPHIRE_RAPIDS, SAPPHIRE_RAPIDS) is None
    assert cpu_incompatibility(ZEN4, SAPPHIRE_RAPIDS) is None  # SPR has everything Zen 4's code uses
    assert cpu_incompatibility(SKYLAKE, AVX2) == "built for AVX512 code, which AVX2 cannot run"
    assert cpu_incompatibility("x86_64-DEFAULT", AVX2) is None
    assert cpu_incompatibility(SAPPHIRE_RAPIDS, ZEN4) == "built with amx_tile, which the asked CPU lacks"
    assert cpu_incompatibility(AVX2, "aarch64-DEFAULT") == "built for x86_64, asked aarch64"
    assert cpu_incompatibility("x86_64-ODD", "x86_64-AVX512") == "built for ODD, asked AVX512"
    assert cpu_incompatibility(None, AVX2) == "built with cpu absent"
    assert incompatibility({"toolchain": {"torch": "2.13"}}, {"cpu": AVX2}) == f"built with cpu absent (asked {AVX2})"
    assert incompatibility({"toolchain": {"cpu": AVX2}}, {"cpu": ZEN4}) is None

"""Resolution never returns a stale, revoked, rejected or incompatible engine — over random sequences of
builds, ref moves, revokes and resolves (hypothesis), on a real SQLite database with the real migrations."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from builder.publish import is_stale_now
from kiln import db
from kiln.errors import SpecError
from kiln.models import Artifact, Tag, TrackedModel, utcnow
from kiln.states import point_tag, remove_tag
from workers.freshness import mark_stale
from workers.resolution import parse_runtime, resolve_engine

MODEL = "acme/tiny"
SLOTS = [("fp8", "latency", "cpu", "aot-inductor"), ("nvfp4", "latency", "sm100", "trtllm-engine")]
RUNTIMES = ["tensorrt_llm=1.2.1", "tensorrt_llm=1.2.0", None]
counter = itertools.count()


def sessions_for(tmp_path):
    url = f"sqlite:///{tmp_path / f'r{next(counter)}.db'}"
    db.upgrade(url)
    return db.session_factory(url)


def add_artifact(s, *, revision: str, slot, trtllm: str, passed: bool = True) -> Artifact:
    """Insert an engine row the way publish does (fresh unless rejected or already stale; tag moves)."""
    n = next(counter)
    precision, profile, target, backend = slot
    a = Artifact(digest=f"sha256:{n:064x}", build_key=f"sha256:{n + 10**6:064x}", repository=MODEL,
                 tag=f"{precision}-{target}-{profile}", status="fresh" if passed else "rejected",
                 precision=precision, target=target, profile=profile, backend=backend, checkpoint_ref="hf://acme/tiny",
                 checkpoint_digest=f"sha256:{n:064x}", checkpoint_revision=revision, size=1,
                 provenance={"toolchain": {"tensorrt_llm": trtllm}}, validation={"passed": passed}, created_at=utcnow())
    if passed and is_stale_now(s, MODEL, revision):
        a.status = "stale"
    s.add(a)
    if a.status == "fresh":
        point_tag(s, MODEL, a.tag, a, reason="test publish")
    s.commit()
    return a


class Registry(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.sessions = sessions_for(self._tmp)
        self.heads = ["rev0"]

    _tmp = None

    @initialize()
    def track(self):
        with self.sessions() as s:
            s.add(TrackedModel(name=MODEL, checkpoint="hf://acme/tiny@main", hf_repo="acme/tiny", branch="main",
                               head_sha="rev0", matrix=[], gates={}, created_at=utcnow(), updated_at=utcnow()))
            s.commit()

    @rule(slot=st.sampled_from(SLOTS), old=st.booleans(), trtllm=st.sampled_from(["1.2.1", "1.2.0"]),
          passed=st.booleans())
    def publish(self, slot, old, trtllm, passed):
        revision = self.heads[0] if (old and len(self.heads) > 1) else self.heads[-1]
        with self.sessions() as s:
            add_artifact(s, revision=revision, slot=slot, trtllm=trtllm, passed=passed)

    @rule()
    def move_head(self):
        self.heads.append(f"rev{len(self.heads)}")
        with self.sessions() as s:
            m = s.get(TrackedModel, MODEL)
            m.head_sha = self.heads[-1]
            mark_stale(s, m)
            s.commit()

    @rule(data=st.data())
    def revoke(self, data):
        with self.sessions() as s:
            rows = s.query(Artifact).all()
            if not rows:
                return
            a = data.draw(st.sampled_from(rows))
            a.status = "revoked"
            for t in s.query(Tag).filter(Tag.digest == a.digest).all():
                remove_tag(s, MODEL, t.name, reason="revoked")
            s.commit()

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


def test_resolve_reasons(tmp_path):
    sessions = sessions_for(tmp_path)
    slot = SLOTS[0]
    with sessions() as s:
        r = resolve_engine(s, model=MODEL, precision="fp8", profile="latency", target="cpu", backend="aot-inductor")
        assert (r.status, r.code) == (404, "not_built")
        s.add(TrackedModel(name=MODEL, checkpoint="hf://acme/tiny@main", hf_repo="acme/tiny", branch="main",
                           head_sha="a", matrix=[], gates={}, created_at=utcnow(), updated_at=utcnow()))
        s.commit()
        add_artifact(s, revision="a", slot=slot, trtllm="1.2.1")
        ok = resolve_engine(s, model=MODEL, precision="fp8", profile="latency", target="cpu", backend="aot-inductor")
        assert ok.status == 200
        bad = resolve_engine(s, model=MODEL, precision="fp8", profile="latency", target="cpu", backend="aot-inductor",
                             runtime="tensorrt_llm=9.9")
        assert (bad.status, bad.code) == (409, "incompatible_runtime") and "9.9" in bad.reason
        m = s.get(TrackedModel, MODEL)
        m.head_sha = "b"
        mark_stale(s, m)
        s.commit()
        stale = resolve_engine(s, model=MODEL, precision="fp8", profile="latency", target="cpu", backend="aot-inductor")
        assert (stale.status, stale.code) == (409, "stale_only") and "b" in stale.reason
        assert s.query(Tag).count() == 0
        with pytest.raises(SpecError) as e:
            resolve_engine(s, model=MODEL, precision="int8", profile="latency", target="cpu", backend="aot-inductor")
        assert e.value.field == "precision"

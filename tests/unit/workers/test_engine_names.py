"""One engine, several repositories: a request for repository A whose BuildKey repository B's engine already
has gets B's bytes under A's name — A's tag, A's resolve answer, A's /v2 manifests, blobs and referrers — and
a revoke or A's own head move takes it out of A as it would an engine A published. And a build of a tracked
model is judged at least as strictly as the model's matrix unless it gives an override_reason.

Real SQLite index with the real migrations, the real publish, submit, resolve, freshness and routes; the broker
is the fake of test_build_states (a message for an uncommitted row fails the test)."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from api.app import create_app
from kiln.errors import SpecError
from kiln.tables import Artifact, Build, EngineName, Tag, TrackedModel
from kiln.states import move_artifact
from tests.unit.workers.test_build_states import CPU, Broker, env, prepared, publish_for, spec_of  # noqa: F401
from workers.freshness import mark_stale
from api.resolution import resolve_engine
from workers.submit import submit

A = "other/tiny"
B = CPU["model_name"]  # acme/tiny
REV, NEXT = "1" * 40, "2" * 40


def _published_under_b(settings, sessions, tmp_path, *, revision=None):
    spec_b = spec_of(settings, CPU)
    return publish_for(settings, sessions, spec_b, prepared(settings, sessions, spec_b).build_key, tmp_path,
                       revision=revision)


def _tag(sessions, repository, name):
    with sessions() as s:
        t = s.get(Tag, (repository, name))
        return t.digest if t else None


def _track(sessions, name, head):
    with sessions() as s:
        s.add(TrackedModel(name=name, checkpoint="hf://acme/tiny@main", hf_repo="acme/tiny", branch="main",
                           head_sha=head, matrix=[], gates={}))
        s.commit()


def _resolve(sessions, model):
    with sessions() as s:
        return resolve_engine(s, model=model, precision="fp8", profile="latency", target="cpu", backend="aot-inductor")


def test_a_request_for_another_repository_gets_the_same_engine_under_its_own_tag(env, tmp_path):
    settings, sessions, broker = env
    engine = _published_under_b(settings, sessions, tmp_path)
    answer = submit(settings, sessions, spec_of(settings, {**CPU, "model_name": A}), broker)
    assert answer.outcome == "existing-artifact" and answer.artifact.digest == engine.digest
    assert broker.sent == []  # no build: the engine exists
    assert _tag(sessions, A, engine.tag) == engine.digest and _tag(sessions, B, engine.tag) == engine.digest
    r = _resolve(sessions, A)
    assert (r.status, r.artifact.digest, r.artifact.repository) == (200, engine.digest, A)
    # the same request again changes nothing
    assert submit(settings, sessions, spec_of(settings, {**CPU, "model_name": A}), broker).artifact.digest == engine.digest
    with sessions() as s:
        assert s.scalar(select(func.count()).select_from(EngineName)) == 1
    # named in A, published in B: a third repository that asked for nothing has no engine
    r = _resolve(sessions, "third/tiny")
    assert (r.status, r.code) == (404, "not_built")


def test_a_named_engine_is_pulled_through_the_other_repository_by_tag_and_digest(env, tmp_path):
    settings, sessions, broker = env
    engine = _published_under_b(settings, sessions, tmp_path)
    client = TestClient(create_app(settings, enqueue=broker))
    assert client.get(f"/v2/{A}/manifests/{engine.tag}").status_code == 404  # not named in A yet
    submit(settings, sessions, spec_of(settings, {**CPU, "model_name": A}), broker)
    by_tag = client.get(f"/v2/{A}/manifests/{engine.tag}")
    assert by_tag.status_code == 200 and by_tag.headers["Docker-Content-Digest"] == engine.digest
    by_digest = client.get(f"/v2/{A}/manifests/{engine.digest}")
    assert by_digest.status_code == 200 and by_digest.content == by_tag.content
    manifest = json.loads(by_tag.content)
    for desc in [manifest["config"], *manifest["layers"]]:
        assert client.get(f"/v2/{A}/blobs/{desc['digest']}").status_code == 200
    assert client.get(f"/v2/{A}/tags/list").json()["tags"] == [engine.tag]
    assert {A, B} <= set(client.get("/v2/_catalog").json()["repositories"])
    referrers = client.get(f"/v2/{A}/referrers/{engine.digest}").json()["manifests"]
    assert referrers and referrers == client.get(f"/v2/{B}/referrers/{engine.digest}").json()["manifests"]
    for ref in referrers:
        assert client.get(f"/v2/{A}/manifests/{ref['digest']}").status_code == 200
    listed = client.get("/v1/artifacts", params={"model": A}).json()["artifacts"]
    assert [a["digest"] for a in listed] == [engine.digest]


def test_revoking_a_named_engine_untags_it_in_every_repository(env, tmp_path):
    settings, sessions, broker = env
    engine = _published_under_b(settings, sessions, tmp_path)
    submit(settings, sessions, spec_of(settings, {**CPU, "model_name": A}), broker)
    client = TestClient(create_app(settings, enqueue=broker))
    assert client.post(f"/v1/artifacts/{engine.digest}/revoke", json={"reason": "leaks"}).status_code == 200
    assert _tag(sessions, A, engine.tag) is None and _tag(sessions, B, engine.tag) is None
    assert _resolve(sessions, A).status == 404
    denied = client.get(f"/v2/{A}/manifests/{engine.digest}")
    assert denied.status_code == 403 and denied.json()["errors"][0]["code"] == "DENIED"


def test_a_head_move_of_the_naming_repository_untags_the_engine_there_only(env, tmp_path):
    settings, sessions, broker = env
    _track(sessions, A, REV)
    engine = _published_under_b(settings, sessions, tmp_path, revision=REV)
    submit(settings, sessions, spec_of(settings, {**CPU, "model_name": A}), broker)
    assert _tag(sessions, A, engine.tag) == engine.digest
    with sessions() as s:
        model = s.get(TrackedModel, A)
        model.head_sha = NEXT
        assert mark_stale(s, model) == 0  # no engine of A's own went stale
        s.commit()
        assert s.get(Artifact, engine.digest).status == "fresh"  # still fresh for B, which published it
    assert _tag(sessions, A, engine.tag) is None and _tag(sessions, B, engine.tag) == engine.digest
    assert (_resolve(sessions, A).code, _resolve(sessions, B).status) == ("stale_only", 200)


def test_an_engine_of_another_head_is_named_but_not_tagged(env, tmp_path):
    settings, sessions, broker = env
    _track(sessions, A, NEXT)  # A follows a head the engine was not built from
    engine = _published_under_b(settings, sessions, tmp_path, revision=REV)
    submit(settings, sessions, spec_of(settings, {**CPU, "model_name": A}), broker)
    assert _tag(sessions, A, engine.tag) is None
    with sessions() as s:
        assert s.get(EngineName, (A, engine.digest)) is not None


def test_a_stale_engine_asked_for_under_another_repository_is_named_there_but_never_tagged(env, tmp_path):
    settings, sessions, broker = env
    engine = _published_under_b(settings, sessions, tmp_path, revision=REV)
    with sessions() as s:
        move_artifact(s, s.get(Artifact, engine.digest), "stale", reason="its head moved")
        s.commit()
    answer = submit(settings, sessions, spec_of(settings, {**CPU, "model_name": A}), broker)
    assert answer.outcome == "existing-artifact" and answer.artifact.status == "stale"
    assert _tag(sessions, A, engine.tag) is None and _tag(sessions, B, engine.tag) is None
    with sessions() as s:
        assert s.get(EngineName, (A, engine.digest)) is not None
    assert _resolve(sessions, A).status != 200


def test_an_identical_build_for_another_repository_published_second_is_named_in_it(env, tmp_path):
    """Two builds with one BuildKey for two repositories, running at once: the second to publish meets the
    first's row (the unique build_key) and its repository gets a tag naming the first's engine."""
    settings, sessions, _ = env
    spec_b, spec_a = spec_of(settings, CPU), spec_of(settings, {**CPU, "model_name": A})
    key = prepared(settings, sessions, spec_b).build_key
    first = publish_for(settings, sessions, spec_b, key, tmp_path / "b")
    second = publish_for(settings, sessions, spec_a, key, tmp_path / "a")
    assert second.digest == first.digest and second.repository == B
    assert _tag(sessions, A, first.tag) == first.digest
    with sessions() as s:
        assert s.scalar(select(func.count()).select_from(Artifact)) == 1


def test_builds_for_two_repositories_are_two_builds_each_joined_by_its_own_repeats(env):
    settings, sessions, broker = env
    for_b = submit(settings, sessions, spec_of(settings, CPU), broker)
    for_a = submit(settings, sessions, spec_of(settings, {**CPU, "model_name": A}), broker)
    assert (for_b.outcome, for_a.outcome) == ("created", "created") and for_a.build.id != for_b.build.id
    again = submit(settings, sessions, spec_of(settings, {**CPU, "model_name": A}), broker)
    assert (again.outcome, again.build.id) == ("existing-build", for_a.build.id)


# -- the tracked matrix is the baseline -------------------------------------------------------------------------
MATRIX_ENTRY = {"precision": "fp8", "target": "cpu", "backend": "aot-inductor", "profile": "latency",
                "calibration": CPU["calibration"], "gates": {"max_mean_kl": 0.02},
                "evaluation": {"max_tokens": 32768}}


def _track_matrix(sessions):
    with sessions() as s:
        s.add(TrackedModel(name=B, checkpoint="hf://acme/tiny@main", hf_repo="acme/tiny", branch="main",
                           head_sha=None, matrix=[MATRIX_ENTRY], gates={}))
        s.commit()


def _builds(sessions):
    with sessions() as s:
        return s.scalar(select(func.count()).select_from(Build))


@pytest.mark.parametrize("looser, field", [
    ({}, "gates.max_mean_kl"),  # the default KL gate (0.05) is looser than the matrix's 0.02
    ({"gates": {"max_mean_kl": 0.02}, "evaluation": {"max_tokens": 16384}}, "evaluation.max_tokens"),
])
def test_a_build_looser_than_its_tracked_matrix_is_refused_without_a_reason(env, looser, field):
    settings, sessions, broker = env
    _track_matrix(sessions)
    with pytest.raises(SpecError) as e:
        submit(settings, sessions, spec_of(settings, {**CPU, **looser}), broker)
    assert e.value.field == field and "override_reason" in e.value.fix and "acme/tiny's tracked matrix" in e.value.message
    assert _builds(sessions) == 0 and broker.sent == []


def test_a_build_as_strict_as_its_tracked_matrix_or_with_a_reason_is_built(env):
    settings, sessions, broker = env
    _track_matrix(sessions)
    strict = {**CPU, "gates": {"max_mean_kl": 0.01}, "evaluation": {"max_tokens": 32768}}
    assert submit(settings, sessions, spec_of(settings, strict), broker).outcome == "created"
    reasoned = {**CPU, "override_reason": "a quick look at a candidate"}
    assert submit(settings, sessions, spec_of(settings, reasoned), broker).outcome == "created"
    other_variant = {**CPU, "profile": "throughput"}  # no matrix entry: the defaults (parse_spec) rule it
    assert submit(settings, sessions, spec_of(settings, other_variant), broker).outcome == "created"


def test_the_route_answers_a_looser_build_with_a_422_naming_the_field_and_writes_nothing(env):
    settings, sessions, broker = env
    _track_matrix(sessions)
    client = TestClient(create_app(settings, enqueue=broker))
    r = client.post("/v1/builds", json={**CPU})
    assert r.status_code == 422 and r.json()["error"]["field"] == "gates.max_mean_kl"
    assert _builds(sessions) == 0


def test_a_queued_build_for_another_repository_finds_the_engine_published_meanwhile_and_names_it(env, tmp_path):
    from workers import runner

    settings, sessions, broker = env
    queued = submit(settings, sessions, spec_of(settings, {**CPU, "model_name": A}), broker)
    assert queued.outcome == "created"
    engine = _published_under_b(settings, sessions, tmp_path)  # B's identical build finished first
    assert runner.run_build(queued.build.id, settings, "w1") == "succeeded"
    with sessions() as s:
        assert s.get(Build, queued.build.id).digest == engine.digest
    assert _tag(sessions, A, engine.tag) == engine.digest


def test_a_repeated_request_never_moves_the_tag_back_from_the_repositorys_own_newer_engine(env, tmp_path):
    settings, sessions, broker = env
    engine = _published_under_b(settings, sessions, tmp_path)
    spec_a = spec_of(settings, {**CPU, "model_name": A})
    submit(settings, sessions, spec_a, broker)
    assert _tag(sessions, A, engine.tag) == engine.digest
    own = publish_for(settings, sessions, spec_a, "sha256:" + "9" * 64, tmp_path / "own")  # A's own, newer
    assert _tag(sessions, A, engine.tag) == own.digest
    again = submit(settings, sessions, spec_a, broker)
    assert again.artifact.digest == engine.digest and _tag(sessions, A, engine.tag) == own.digest


def test_an_engine_without_a_revision_is_stale_for_a_repository_that_tracks_a_head(env, tmp_path):
    settings, sessions, broker = env
    engine = _published_under_b(settings, sessions, tmp_path)  # a local checkpoint: no revision
    submit(settings, sessions, spec_of(settings, {**CPU, "model_name": A}), broker)
    assert _tag(sessions, A, engine.tag) == engine.digest  # A tracks nothing yet
    _track(sessions, A, REV)
    with sessions() as s:
        mark_stale(s, s.get(TrackedModel, A))
        s.commit()
    assert _tag(sessions, A, engine.tag) is None and _tag(sessions, B, engine.tag) == engine.digest


def test_a_build_as_strict_as_any_matrix_entry_of_its_variant_passes(env):
    settings, sessions, broker = env
    entry = {k: v for k, v in MATRIX_ENTRY.items() if k not in ("gates", "evaluation")}
    with sessions() as s:
        s.add(TrackedModel(name=B, checkpoint="hf://acme/tiny@main", hf_repo="acme/tiny", branch="main",
                           head_sha=None, matrix=[{**entry, "gates": {"max_mean_kl": 0.02}},
                                                  {**entry, "gates": {"max_mean_kl": 0.04}}], gates={}))
        s.commit()
    spec = spec_of(settings, {**CPU, "gates": {"max_mean_kl": 0.04}})  # the second entry's own build
    assert submit(settings, sessions, spec, broker).outcome == "created"
    with pytest.raises(SpecError) as e:  # looser than both
        submit(settings, sessions, spec_of(settings, {**CPU, "gates": {"max_mean_kl": 0.045}}), broker)
    assert e.value.field == "gates.max_mean_kl"


def test_a_head_move_untags_only_this_repositorys_names_of_other_heads_engines(env, tmp_path):
    """A's tags after ``mark_stale(A)``: its own engine of the head and another repository's engine of the head
    keep theirs; B's tags are B's, even where B's engine of an old revision shares the tag name with A's."""
    from builder.publish import name_in_repository

    settings, sessions, broker = env
    _track(sessions, A, NEXT)
    old_b = _published_under_b(settings, sessions, tmp_path, revision=REV)  # B's tag T
    own = publish_for(settings, sessions, spec_of(settings, {**CPU, "model_name": A}), "sha256:" + "e" * 64,
                      tmp_path, revision=NEXT)  # A's own engine of its head, under the same tag name T
    balanced = spec_of(settings, {**CPU, "profile": "balanced"})
    head_b = publish_for(settings, sessions, balanced, "sha256:" + "f" * 64, tmp_path, revision=NEXT)
    name_in_repository(sessions, head_b.digest, A)  # B's engine of A's head, named and tagged in A
    assert old_b.tag == own.tag != head_b.tag
    with sessions() as s:
        assert mark_stale(s, s.get(TrackedModel, A)) == 0
        s.commit()
    assert (_tag(sessions, A, own.tag), _tag(sessions, A, head_b.tag)) == (own.digest, head_b.digest)
    assert (_tag(sessions, B, old_b.tag), _tag(sessions, B, head_b.tag)) == (old_b.digest, head_b.digest)


def _publish_validated(settings, sessions, spec, key, tmp_path, *, ppl_increase_pct, tokens_per_s, data=None):
    """An engine of ``spec``'s repository with measured metrics (what previous_engine compares with)."""
    from artifacts.factory import open_store
    from builder.publish import publish
    from tests.unit.workers.test_build_states import engine_dir

    cond = {"device": "cpu", "threads": 4, "cpus": 4, "cpu_model": "test", "gpu": None}
    metrics = {"ppl_increase_pct": ppl_increase_pct,
               "throughput": [{"batch_size": 1, "seq_len": 64, "tokens_per_s": tokens_per_s,
                               "tokens_per_s_best": tokens_per_s}]}
    prov = {"created": "2026-01-01T00:00:00Z", "toolchain": {}, "spec": spec.model_dump(), "data": data or {},
            "checkpoint": {"ref": spec.checkpoint, "digest": "sha256:" + "c" * 64, "revision": None}}
    seed = key[-12:] + spec.model_name.replace("/", "-")
    return publish(open_store(settings.store), sessions, engine_dir(tmp_path / seed, seed), spec=spec, build_key=key,
                   provenance=prov, validation={"passed": True, "metrics": metrics, "conditions": cond})


def test_naming_another_repositorys_engine_is_judged_against_this_repositorys_previous_engine(env, tmp_path):
    """B's engine for the requested BuildKey was named in A (and took A's tag) with no judgement against A's
    previous engine: a build in A with those metrics would have failed A's regression gate."""
    from kiln.errors import ValidationFailed

    settings, sessions, broker = env
    spec_a, spec_b = spec_of(settings, {**CPU, "model_name": A}), spec_of(settings, CPU)
    p = prepared(settings, sessions, spec_b)
    ours = _publish_validated(settings, sessions, spec_a, "sha256:" + "e" * 64, tmp_path, ppl_increase_pct=0.5,
                              tokens_per_s=1000.0, data=p.data)
    _publish_validated(settings, sessions, spec_b, p.build_key, tmp_path, ppl_increase_pct=4.0, tokens_per_s=1000.0,
                       data=p.data)
    with pytest.raises(ValidationFailed, match="max_accuracy_regression_pct") as refused:
        submit(settings, sessions, spec_a, broker)
    assert ours.digest in str(refused.value)
    assert _tag(sessions, A, ours.tag) == ours.digest  # A's tag stays on its own engine
    with sessions() as s:
        assert s.scalar(select(func.count()).select_from(EngineName)) == 0
    # the worker's path (a build whose key another repository's engine has by then) judges the same way
    from builder.pipeline import Builder

    with pytest.raises(ValidationFailed, match="regresses against"):
        Builder(settings, None, sessions).build(spec_a)
    assert _tag(sessions, A, ours.tag) == ours.digest


def test_naming_an_engine_that_does_not_regress_here_still_works(env, tmp_path):
    settings, sessions, broker = env
    spec_a, spec_b = spec_of(settings, {**CPU, "model_name": A}), spec_of(settings, CPU)
    p = prepared(settings, sessions, spec_b)
    _publish_validated(settings, sessions, spec_a, "sha256:" + "e" * 64, tmp_path, ppl_increase_pct=0.5,
                       tokens_per_s=1000.0, data=p.data)
    theirs = _publish_validated(settings, sessions, spec_b, p.build_key, tmp_path, ppl_increase_pct=0.8,
                                tokens_per_s=950.0, data=p.data)
    answer = submit(settings, sessions, spec_a, broker)
    assert answer.outcome == "existing-artifact" and answer.artifact.digest == theirs.digest
    assert _tag(sessions, A, theirs.tag) == theirs.digest


def test_a_revoked_engine_never_answers_a_build_it_is_built_anew(env, tmp_path, monkeypatch):
    """The API's lookup skips revoked engines and enqueues the build; the worker's lookup (Builder._existing)
    answered it with the revoked engine (`kiln build --server` printed [revoked], exit 0). The worker now builds
    anew, under a new BuildKey (the revoked engine keeps its own)."""
    import builder.pipeline as pipeline

    settings, sessions, broker = env
    engine = _published_under_b(settings, sessions, tmp_path)
    with sessions() as s:
        move_artifact(s, s.get(Artifact, engine.digest), "revoked", reason="bad weights")
        s.commit()
    spec = spec_of(settings, CPU)
    answer = submit(settings, sessions, spec, broker)
    assert answer.outcome != "existing-artifact" and len(broker.sent) == 1  # the API: built anew

    b = pipeline.Builder(settings, None, sessions)
    assert b.describe(prepared(settings, sessions, spec))["cached"]["artifact"] is None
    keys = []

    def materialize(resolved, **_):  # past the lookup: the build runs its stages (stopped here)
        raise RuntimeError("built anew")

    real = pipeline.Builder.prepare

    def prepare(self, *a, **kw):
        done = real(self, *a, **kw)
        keys.append(done[0].build_key)
        return done

    monkeypatch.setattr(pipeline.Builder, "prepare", prepare)
    monkeypatch.setattr(pipeline, "materialize_checkpoint", materialize)
    with pytest.raises(RuntimeError, match="built anew"):
        b.build(spec)
    assert keys[0] == engine.build_key and keys[-1] != engine.build_key

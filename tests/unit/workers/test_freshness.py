"""Freshness (workers/freshness.py) on the fast path: registering a tracked model checks every matrix entry before
anything is written, tracks the branch's head and builds the matrix for it; a refresh after the branch moved
makes the old head's engines stale, untags them and builds the new head; the webhook's secret and payload rules.

Real SQLite index with the real migrations, publish and submit; the Hub is a real local Hub cache the test makes
(tests/hubcache.py; the Hub's network is the one thing that cannot exist here); the broker is the fake of
test_build_states (a message for an uncommitted row fails the test)."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from kiln.errors import ArtifactUnknown, SpecError
from kiln.tables import Artifact, Build, Tag, TrackedModel
from tests import hubcache
from tests.unit.workers.test_build_states import CPU, Broker, env, prepared, publish_for, spec_of  # noqa: F401
from workers.freshness import (mark_stale, models_for_webhook, refresh_model, register_model,
                               webhook_secret_ok)

NAME, REPO = "acme/tiny", "acme/tiny"
C1, C2 = hubcache.commit_sha(1), hubcache.commit_sha(2)
ENTRY = {"precision": "fp8", "profile": "latency", "target": "cpu", "backend": "checkpoint",
         "calibration": {"samples": 8, "seq_len": 64}}


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """acme/tiny at two commits, ``main`` at the first; the library reads the cache offline."""
    import huggingface_hub.constants as hf_constants

    hub = tmp_path / "hub"
    for n, commit in ((1, C1), (2, C2)):
        hubcache.add_snapshot(hub, REPO, commit, config_note=f"revision {n}")
    hubcache.set_ref(hub, REPO, "main", C1)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(hub))  # read once at import by huggingface_hub
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    return hub


def body(*entries, **extra):
    return {"checkpoint": f"hf://{REPO}@main", "matrix": list(entries) or [ENTRY], **extra}


def builds(sessions):
    with sessions() as s:
        return s.scalars(select(Build).order_by(Build.created_at)).all()


def nothing_written(sessions, broker):
    with sessions() as s:
        assert s.scalars(select(TrackedModel)).all() == [] and s.scalars(select(Build)).all() == []
    assert broker.sent == []


# -- registration ---------------------------------------------------------------------------------------
BODY_FIX = 'send {"checkpoint": ..., "matrix": [...]}'
MATRIX = ("matrix must list 1 to 64 entries", "give [{precision, profile, target, backend}, ...]")
NAME_FIX = "use lowercase letters, digits, '.', '_', '-' and '/' separators, e.g. acme/tiny"


@pytest.mark.parametrize("name, payload, field, words", [
    ("Acme/Tiny", body(), "model", ("'Acme/Tiny' is not a valid model name", NAME_FIX)),
    ("a" * 256, body(), "model", (f"'{'a' * 256}' is not a valid model name", NAME_FIX)),
    ("acme/tiny", ["not", "an", "object"], "body", ("the body must be a JSON object", BODY_FIX)),
    ("acme/tiny", body(checkpoint="/models/tiny"), "checkpoint", None),
    ("acme/tiny", {"checkpoint": f"hf://{REPO}@main", "matrix": []}, "matrix", MATRIX),
    ("acme/tiny", {"checkpoint": f"hf://{REPO}@main", "matrix": [ENTRY] * 65}, "matrix", MATRIX),
    ("acme/tiny", {"checkpoint": f"hf://{REPO}@main", "matrix": ENTRY}, "matrix", MATRIX),
    ("acme/tiny", body(ENTRY, {**ENTRY, "checkpoint": "/elsewhere"}), "matrix.1", "unknown fields ['checkpoint']"),
    ("acme/tiny", body(ENTRY, "fp8"), "matrix.1", "unknown fields ['(not an object)']"),
    ("acme/tiny", body(ENTRY, {**ENTRY, "precision": "int3"}), "matrix.1.precision", None),
    ("acme/tiny", body(ENTRY, gates={"speed": 3}), "matrix.0.gates.speed", None),
    ("acme/tiny", body(ENTRY, {**ENTRY, "gates": {"speed": 3}}), "matrix.1.gates.speed", None),  # an entry's own
])
def test_registration_checks_every_entry_before_anything_is_written(env, hub, name, payload, field, words):
    settings, sessions, broker = env
    with pytest.raises(SpecError) as err:
        register_model(settings, sessions, name, payload, broker)
    assert err.value.field == field and err.value.fix and err.value.message
    if isinstance(words, tuple):
        assert (err.value.message, err.value.fix) == words
    elif isinstance(words, str):
        assert err.value.message == words and err.value.fix.startswith("use only [")
    nothing_written(sessions, broker)


def test_registration_takes_64_entries_and_a_255_character_name(env, hub):
    settings, sessions, broker = env
    profiles = [{"name": f"p{i}", "max_batch_size": 1, "max_input_len": 64 + i, "max_seq_len": 256,
                 "max_num_tokens": 256} for i in range(64)]
    name = "acme/" + "t" * 250
    out = register_model(settings, sessions, name, body(*({**ENTRY, "profile": p} for p in profiles)), broker)
    assert out.model.name == name and len(out.model.matrix) == 64


def test_a_refused_task_file_in_an_entry_stores_nothing_and_replaces_nothing(env, hub, tmp_path):
    """A matrix entry's task file is checked (as data) before the registration is written: answering 422 after
    storing the matrix left a tracked model whose every refresh failed on the refused file."""
    from tests.hostile_tasks import function_in_folder, layout, metric_script

    settings, sessions, broker = env
    register_model(settings, sessions, NAME, body(ENTRY), broker)
    sent = len(broker.sent)
    for attack in (function_in_folder, metric_script):
        task = attack(layout(tmp_path / attack.__name__))
        hostile = {**ENTRY, "profile": "balanced", "evaluation": {"tasks": [str(task)]}}
        with pytest.raises(SpecError) as err:
            register_model(settings, sessions, NAME, body(ENTRY, hostile), broker)
        assert err.value.field == "matrix.1.evaluation.tasks" and "task file t.yaml" in err.value.message
        with sessions() as s:
            assert s.get(TrackedModel, NAME).matrix == [ENTRY]
        assert len(broker.sent) == sent and len(builds(sessions)) == 1
    assert not (tmp_path / "function_in_folder" / "marker").exists()


def test_registration_tracks_the_head_and_builds_the_matrix_for_that_commit(env, hub):
    settings, sessions, broker = env
    second = {**ENTRY, "profile": "balanced", "gates": {"max_mean_kl": 0.04}}
    out = register_model(settings, sessions, NAME, body(ENTRY, second, gates={"min_top1_agreement": 0.9}), broker)
    assert (out.moved, out.old_head) == (False, None)
    assert out.model.head_sha == C1 and (out.model.hf_repo, out.model.branch) == (REPO, "main")
    assert [b.outcome for b in out.builds] == ["created", "created"]
    made = builds(sessions)
    assert len(made) == 2 and len(broker.sent) == 2
    # the commit, never the branch, is the build's input; the model's gates apply under each entry's own
    assert {b.spec["checkpoint"] for b in made} == {f"hf://{REPO}@{C1}"}
    assert {b.spec["model_name"] for b in made} == {NAME}
    gates = sorted((b.spec["gates"] for b in made), key=len)
    assert gates == [{"min_top1_agreement": 0.9}, {"min_top1_agreement": 0.9, "max_mean_kl": 0.04}]
    with sessions() as s:
        stored = s.get(TrackedModel, NAME)
        assert stored.matrix == [ENTRY, second] and stored.gates == {"min_top1_agreement": 0.9}
        assert stored.checkpoint == f"hf://{REPO}@main"


def test_registering_again_at_the_same_head_joins_the_builds_it_started(env, hub):
    settings, sessions, broker = env
    register_model(settings, sessions, NAME, body(), broker)
    again = register_model(settings, sessions, NAME, body(), broker)
    assert (again.moved, again.old_head) == (False, C1)
    assert [b.outcome for b in again.builds] == ["existing-build"] and len(builds(sessions)) == 1
    assert len(broker.sent) == 1


def _engine_of(settings, sessions, tmp_path, revision: str) -> Artifact:
    spec = spec_of(settings, {**CPU, "model_name": NAME, "checkpoint": f"hf://{REPO}@{revision}"})
    return publish_for(settings, sessions, spec, prepared(settings, sessions, spec).build_key, tmp_path,
                       revision=revision)


def _status(sessions, digest):
    with sessions() as s:
        return s.get(Artifact, digest).status


def _tags(sessions, repository=NAME):
    with sessions() as s:
        return {t.name: t.digest for t in s.scalars(select(Tag).where(Tag.repository == repository))}


def test_a_refresh_after_the_branch_moved_stales_and_untags_the_old_head_and_builds_the_new(env, hub, tmp_path):
    settings, sessions, broker = env
    register_model(settings, sessions, NAME, body(), broker)
    old = _engine_of(settings, sessions, tmp_path, C1)
    assert _status(sessions, old.digest) == "fresh" and old.digest in _tags(sessions).values()
    hubcache.set_ref(hub, REPO, "main", C2)
    out = refresh_model(settings, sessions, NAME, broker)
    assert (out.moved, out.old_head, out.model.head_sha) == (True, C1, C2)
    assert _status(sessions, old.digest) == "stale" and old.digest not in _tags(sessions).values()
    assert [b.outcome for b in out.builds] == ["created"]
    assert builds(sessions)[-1].spec["checkpoint"] == f"hf://{REPO}@{C2}"
    with sessions() as s:
        assert s.get(TrackedModel, NAME).head_sha == C2


def test_a_refresh_at_the_same_head_stales_nothing_and_resubmits_the_matrix(env, hub, tmp_path):
    settings, sessions, broker = env
    register_model(settings, sessions, NAME, body(), broker)
    engine = _engine_of(settings, sessions, tmp_path, C1)
    out = refresh_model(settings, sessions, NAME, broker)
    assert (out.moved, out.old_head) == (False, C1)
    assert _status(sessions, engine.digest) == "fresh" and engine.digest in _tags(sessions).values()
    assert [b.outcome for b in out.builds] == ["existing-build"]  # a lost build would be started again


def test_a_registration_that_moves_the_head_stales_the_old_engines(env, hub, tmp_path):
    settings, sessions, broker = env
    register_model(settings, sessions, NAME, body(), broker)
    old = _engine_of(settings, sessions, tmp_path, C1)
    hubcache.set_ref(hub, REPO, "main", C2)
    out = register_model(settings, sessions, NAME, body(), broker)
    assert (out.moved, out.old_head, out.model.head_sha) == (True, C1, C2)
    assert _status(sessions, old.digest) == "stale" and _tags(sessions) == {}


def test_refreshing_an_untracked_model_names_the_model(env, hub):
    settings, sessions, broker = env
    with pytest.raises(ArtifactUnknown) as err:
        refresh_model(settings, sessions, "acme/never", broker)
    assert err.value.field == "model" and "acme/never" in err.value.message and "PUT /v1/models" in err.value.fix
    assert broker.sent == []


def test_a_model_unregistered_while_its_branch_is_read_is_unknown_and_nothing_is_built(env, hub, monkeypatch):
    # refresh reads the model, asks the Hub for the branch's head (seconds, outside any transaction), then reads
    # the model again to move it: a row deleted in between is the same answer as a model never tracked
    import workers.freshness as freshness

    settings, sessions, broker = env
    register_model(settings, sessions, NAME, body(), broker)
    sent = len(broker.sent)
    read_head = freshness.head_of

    def head_then_gone(*args):
        head = read_head(*args)
        with sessions() as s:
            s.delete(s.get(TrackedModel, NAME))
            s.commit()
        return head

    monkeypatch.setattr(freshness, "head_of", head_then_gone)
    with pytest.raises(ArtifactUnknown) as err:
        refresh_model(settings, sessions, NAME, broker)
    assert err.value.field == "model" and NAME in err.value.message
    assert len(broker.sent) == sent


def test_mark_stale_spares_the_head_and_stales_engines_without_a_revision(env, hub, tmp_path):
    settings, sessions, _ = env
    head = _engine_of(settings, sessions, tmp_path / "a", C2)
    unknown = _engine_of(settings, sessions, tmp_path / "b", C1)
    with sessions() as s:
        s.get(Artifact, unknown.digest).checkpoint_revision = None  # an engine whose revision was never recorded
        s.commit()
    model = TrackedModel(name=NAME, checkpoint=f"hf://{REPO}@main", hf_repo=REPO, branch="main", head_sha=C2,
                         matrix=[], gates={})
    with sessions() as s:
        assert mark_stale(s, model) == 1
        s.commit()
    assert _status(sessions, head.digest) == "fresh" and _status(sessions, unknown.digest) == "stale"
    with sessions() as s:
        assert s.get(Artifact, unknown.digest).status_reason == f"{REPO}@main moved to {C2}"


# -- the webhook ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("expected, given, ok", [("s3cret", "s3cret", True), ("s3cret", "s3cre", False),
                                                 ("s3cret", "S3CRET", False), ("s3cret", None, False),
                                                 (None, "s3cret", False), ("", "", False), (None, None, False)])
def test_the_webhook_secret_must_be_configured_and_match(expected, given, ok):
    assert webhook_secret_ok(expected, given) is ok


def _track(sessions, name, repo=REPO, branch="main"):
    with sessions() as s:
        s.add(TrackedModel(name=name, checkpoint=f"hf://{repo}@{branch}", hf_repo=repo, branch=branch, head_sha=C1,
                           matrix=[], gates={}))
        s.commit()


def payload(scope="repo.content", repo=REPO, refs=("refs/heads/main",)):
    p = {"event": {"action": "update", "scope": scope}, "repo": {"type": "model", "name": repo, "headSha": C2}}
    if refs is not None:
        p["updatedRefs"] = [{"ref": r, "oldSha": C1, "newSha": C2} for r in refs]
    return p


def test_the_webhook_concerns_the_models_tracking_an_updated_branch_of_the_repo(env):
    _, sessions, _ = env
    _track(sessions, "acme/main")
    _track(sessions, "acme/dev", branch="dev")
    _track(sessions, "other/main", repo="other/model")
    assert models_for_webhook(sessions, payload()) == ["acme/main"]
    assert models_for_webhook(sessions, payload(refs=("refs/heads/dev",))) == ["acme/dev"]
    assert sorted(models_for_webhook(sessions, payload(refs=("refs/heads/main", "refs/heads/dev")))) == [
        "acme/dev", "acme/main"]
    assert models_for_webhook(sessions, payload(refs=("refs/heads/feature",))) == []
    # no list of refs (or an empty one): every model of the repo is re-resolved (the head is never trusted)
    assert sorted(models_for_webhook(sessions, payload(refs=None))) == ["acme/dev", "acme/main"]
    assert sorted(models_for_webhook(sessions, payload(refs=()))) == ["acme/dev", "acme/main"]
    assert models_for_webhook(sessions, payload(repo="nobody/else")) == []
    assert models_for_webhook(sessions, payload(scope="repo.config")) == []  # a settings change moves no head
    # a ref without a name is ignored, the others still count
    p = payload()
    p["updatedRefs"].append({"oldSha": C1})
    assert models_for_webhook(sessions, p) == ["acme/main"]


@pytest.mark.parametrize("bad, field", [(["a list"], "body"), ({"repo": {"name": REPO}}, "event"),
                                        ({"event": {"scope": "repo.content"}}, "event"),
                                        ({"event": {"scope": "repo.content"}, "repo": {"name": 7}}, "event"),
                                        ({"event": "repo.content", "repo": {"name": REPO}}, "event")])
def test_a_payload_that_is_not_the_hubs_is_refused_naming_the_field(env, bad, field):
    _, sessions, _ = env
    with pytest.raises(SpecError) as err:
        models_for_webhook(sessions, bad)
    assert err.value.field == field
    assert (err.value.message, err.value.fix) == ({
        "body": ("the payload must be a JSON object", "send the Hub's webhook payload"),
        "event": ("not a Hugging Face webhook payload",
                  "expected {event: {scope, action}, repo: {name, headSha}, updatedRefs: [...]}")}[field])


@pytest.mark.parametrize("ref", ["s3://bucket/acme", "/models/acme", None])
def test_a_tracked_checkpoint_must_be_a_hub_branch(ref):
    from workers.freshness import parse_tracked_checkpoint

    with pytest.raises(SpecError) as err:
        parse_tracked_checkpoint(ref)
    assert (err.value.field, err.value.message, err.value.fix) == (
        "checkpoint", "a tracked model follows a Hugging Face branch", "give hf://org/name@branch")
    assert parse_tracked_checkpoint(f"hf://{REPO}@dev") == (REPO, "dev")


def test_re_registering_with_looser_gates_needs_a_reason_recorded_with_the_models_history(env, hub):
    """A PUT with looser matrix gates than the stored matrix was accepted without a reason: the matrix a build of
    the model is judged against could be loosened on a write token's say alone."""
    from kiln.tables import ModelEvent

    settings, sessions, broker = env
    strict = {**ENTRY, "gates": {"max_ppl_increase_pct": 1.0}}
    register_model(settings, sessions, NAME, body(strict), broker)
    for looser in (body({**ENTRY, "gates": {"max_ppl_increase_pct": 2.0}}),  # an entry's own gate
                   body(ENTRY, gates={"max_ppl_increase_pct": 2.5}),  # the model-wide gates
                   body(ENTRY)):  # back to the precision's defaults (3.0)
        with pytest.raises(SpecError) as err:
            register_model(settings, sessions, NAME, looser, broker)
        assert err.value.field == "matrix.0.gates.max_ppl_increase_pct"
        assert "loosens" in err.value.message and "override_reason" in err.value.fix
    with sessions() as s:
        assert s.get(TrackedModel, NAME).matrix == [strict]
    # as strict, stricter, or another variant: no reason needed
    register_model(settings, sessions, NAME, body({**ENTRY, "gates": {"max_ppl_increase_pct": 0.5}}), broker)
    # with a reason: accepted, and the reason is in the model's history
    register_model(settings, sessions, NAME, body(ENTRY, override_reason="the 0.5 gate flakes on CPU runners"), broker)
    with sessions() as s:
        events = s.scalars(select(ModelEvent).where(ModelEvent.model == NAME).order_by(ModelEvent.id)).all()
        assert [e.override_reason for e in events] == [None, None, "the 0.5 gate flakes on CPU runners"]
        assert events[-1].matrix == [ENTRY] and s.get(TrackedModel, NAME).matrix == [ENTRY]
    with pytest.raises(SpecError) as err:
        register_model(settings, sessions, NAME, body(ENTRY, override_reason=["no"]), broker)
    assert err.value.field == "override_reason"


@pytest.mark.parametrize("payload, field", [
    (body(ENTRY, gates=[1]), "gates"), (body(ENTRY, gates="strict"), "gates"),
    (body({**ENTRY, "gates": "x"}), "matrix.0.gates"), (body(ENTRY, {**ENTRY, "gates": [2]}), "matrix.1.gates"),
])
def test_gates_that_are_not_an_object_are_refused_naming_the_field(env, hub, payload, field):
    """They were a TypeError (500) when merged with the entry's gates."""
    settings, sessions, broker = env
    with pytest.raises(SpecError) as err:
        register_model(settings, sessions, NAME, payload, broker)
    assert err.value.field == field and "object" in err.value.message
    nothing_written(sessions, broker)

"""Freshness end to end on the embedded service (``kiln serve``) with a local Hub cache the test builds and moves:
register a model, build its matrix, move the branch (webhook and poll), and check that resolve never hands out
a stale engine — not while the replacement builds, not after replays or out-of-order deliveries."""

from __future__ import annotations

import time

import pytest

from tests import hubcache
from scripts.devstack import Stack
from scripts.devstack import served as embedded

pytestmark = pytest.mark.slow
SECRET = "s3cret-for-tests"
REPO_ID = "acme/tiny"
MATRIX = [{"precision": "fp8", "profile": "latency", "target": "cpu", "backend": "checkpoint",
           "calibration": {"samples": 8, "seq_len": 64}, "evaluation": {"max_tokens": 1024},
           "override_reason": "a test build: a short evaluation"}]
RESOLVE = "/v1/resolve?model=acme/tiny&precision=fp8&profile=latency&target=cpu&backend=checkpoint"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    hub = tmp_path_factory.mktemp("hub")
    for n in (1, 2, 3):
        hubcache.add_snapshot(hub, REPO_ID, hubcache.commit_sha(n), config_note=f"revision {n}")
    hubcache.set_ref(hub, REPO_ID, "main", hubcache.commit_sha(1))
    return hub


@pytest.fixture(scope="module")
def served(tmp_path_factory, hub):
    with embedded(tmp_path_factory.mktemp("fresh") / "kiln", {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hub),
                                                          "KILN_WEBHOOK_SECRET": SECRET}) as s:
        yield s


def webhook(s: Stack, old: str | None, new: str, secret: str = SECRET):
    import httpx

    payload = {"event": {"action": "update", "scope": "repo.content"},
               "repo": {"type": "model", "name": REPO_ID, "headSha": new},
               "updatedRefs": [{"ref": "refs/heads/main", "oldSha": old, "newSha": new}]}
    return httpx.post(f"{s.url}/v1/webhooks/huggingface", json=payload, headers={"X-Webhook-Secret": secret}, timeout=60)


def wait_resolved(s: Stack, revision: str, timeout: float = 300) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        r = s.get(RESOLVE)
        if r.status_code == 200:
            body = r.json()
            assert body["provenance"]["checkpoint"]["revision"] == revision, body  # never another head
            return body
        assert r.status_code in (404, 409) and r.json()["error"]["message"]
        time.sleep(0.5)
    raise AssertionError(f"never resolved to {revision}: {s.get(RESOLVE).text}\n{s.log('serve')[-3000:]}")


def test_register_build_move_and_never_serve_stale(served, hub):
    c1, c2, c3 = (hubcache.commit_sha(n) for n in (1, 2, 3))
    r = served.put("/v1/models/acme/tiny", {"checkpoint": f"hf://{REPO_ID}@main", "matrix": MATRIX})
    assert r.status_code == 200, r.text
    assert r.json()["model"]["head_sha"] == c1 and len(r.json()["builds"]) == 1
    first = wait_resolved(served, c1)
    assert first["tag"] == "fp8-cpu-latency-checkpoint"

    # wrong secret: refused, nothing changes
    hubcache.set_ref(hub, REPO_ID, "main", c2)
    assert webhook(served, c1, c2, secret="nope").status_code == 401
    assert served.get(RESOLVE).json()["digest"] == first["digest"]

    # the branch moved: the old engine is stale at once, before the new one exists
    moved = webhook(served, c1, c2)
    assert moved.status_code == 200 and moved.json()["handled"][0]["moved"] is True
    now = served.get(RESOLVE)
    assert now.status_code in (404, 409) or now.json()["provenance"]["checkpoint"]["revision"] == c2
    old = served.get(f"/v1/artifacts/{first['digest']}").json()
    assert old["status"] == "stale" and c2 in old["status_reason"]
    second = wait_resolved(served, c2)
    assert second["digest"] != first["digest"]

    # replayed and out-of-order deliveries change nothing: the head is re-resolved, not read from the payload
    replay = webhook(served, c1, c2)
    assert replay.json()["handled"][0]["moved"] is False
    late = webhook(served, None, c1)
    assert late.json()["handled"][0]["head_sha"] == c2
    assert served.get(RESOLVE).json()["digest"] == second["digest"]

    # a pinned rollback by digest still works, and says it is stale
    assert served.get(f"/v1/artifacts/{first['digest']}").json()["status"] == "stale"

    # poll: the branch moves again; refresh does what the webhook does
    hubcache.set_ref(hub, REPO_ID, "main", c3)
    polled = served.post("/v1/models/acme/tiny/refresh", None)
    assert polled.status_code == 200 and polled.json()["moved"] is True
    third = wait_resolved(served, c3)

    # revoke: never resolved again
    rv = served.post(f"/v1/artifacts/{third['digest']}/revoke", {"reason": "bad outputs in canary"})
    assert rv.status_code == 200 and rv.json()["status"] == "revoked"
    gone = served.get(RESOLVE)
    assert gone.status_code == 409 and "revoked" in gone.json()["error"]["message"]
    assert served.post(f"/v1/artifacts/{third['digest']}/revoke", {}).json()["error"]["field"] == "reason"


def test_model_registration_errors(served):
    bad = served.put("/v1/models/acme/tiny", {"checkpoint": "s3://x/y", "matrix": MATRIX})
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "checkpoint"
    bad = served.put("/v1/models/acme/tiny", {"checkpoint": "hf://acme/tiny@main", "matrix": [{"precision": "int8"}]})
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "matrix.0.precision"
    bad = served.put("/v1/models/Bad Name", {"checkpoint": "hf://acme/tiny@main", "matrix": MATRIX})
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "model"
    bad = served.put("/v1/models/acme/other", {"checkpoint": "hf://acme/missing@main", "matrix": MATRIX})
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "checkpoint"
    assert served.post("/v1/models/acme/none/refresh", None).status_code == 404
    r = served.get("/v1/resolve?model=acme/tiny&precision=fp8&profile=latency&target=a100&backend=checkpoint")
    assert r.status_code == 422 and r.json()["error"]["field"] == "target"


def test_a_ref_that_moves_while_its_build_runs(served, hub):
    repo = "acme/moving"
    c1, c2 = hubcache.commit_sha(11), hubcache.commit_sha(12)
    hubcache.add_snapshot(hub, repo, c1, config_note="moving 1")
    hubcache.add_snapshot(hub, repo, c2, config_note="moving 2")
    hubcache.set_ref(hub, repo, "main", c1)
    r = served.put("/v1/models/acme/moving", {"checkpoint": f"hf://{repo}@main", "matrix": MATRIX})
    build = r.json()["builds"][0]
    served.wait_build(build["id"], states=("running", "succeeded"))
    hubcache.set_ref(hub, repo, "main", c2)
    assert served.post("/v1/models/acme/moving/refresh", None).json()["moved"] is True
    done = served.wait_build(build["id"])
    assert done["status"] == "succeeded"
    # the engine built from the old head is published stale (never tagged, never resolved)
    assert served.get(f"/v1/artifacts/{done['digest']}").json()["status"] == "stale"
    url = RESOLVE.replace("acme/tiny", "acme/moving")
    deadline = time.time() + 300
    while time.time() < deadline:
        r = served.get(url)
        if r.status_code == 200:
            assert r.json()["provenance"]["checkpoint"]["revision"] == c2
            break
        time.sleep(0.5)
    else:
        raise AssertionError(served.get(url).text)

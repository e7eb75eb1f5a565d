"""API behaviour that every deployment shape must show: run against the distributed stack (PostgreSQL, Redis,
Celery worker processes) and against the embedded ``kiln serve`` (SQLite, SQLite broker)."""

from __future__ import annotations

import json

import httpx

from scripts.devstack import Stack, tiny_spec


def submit_follow_and_query(stack: Stack, spec: dict) -> dict:
    r = stack.post("/v1/builds", spec)
    assert r.status_code == 202, r.text
    build = r.json()
    assert build["status"] == "queued" and build["id"] and build["request_key"].startswith("sha256:")

    events = []
    with httpx.stream("GET", f"{stack.url}/v1/builds/{build['id']}/events", timeout=httpx.Timeout(10, read=300)) as s:
        assert s.headers["content-type"].startswith("text/event-stream")
        kind = None
        for line in s.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                events.append((kind, json.loads(line[6:])))
                if kind == "end":
                    break
    finished = [d["name"] for k, d in events if k == "stage" and d["state"] == "finished"]
    assert finished == ["resolve", "quantize", "compile", "validate", "publish"], events
    assert events[-1] == ("end", {"status": "succeeded"})
    steps = {(d["stage"], d["step"]) for k, d in events if k == "progress"}  # what a stage was doing, as it ran
    assert {("quantize", "calibration batch"), ("validate", "evaluation window")} <= steps, events

    done = stack.get(f"/v1/builds/{build['id']}").json()
    assert done["status"] == "succeeded" and done["digest"].startswith("sha256:")
    assert [s["name"] for s in done["stages"]] == finished and all("seconds" in s for s in done["stages"])
    art = stack.get(f"/v1/artifacts/{done['digest']}").json()
    assert art["status"] == "fresh" and art["build_key"] == done["build_key"]
    assert art["provenance"]["checkpoint"]["digest"].startswith("sha256:")
    assert art["validation"]["passed"] is True
    listed = stack.get("/v1/artifacts?backend=checkpoint").json()["artifacts"]
    assert done["digest"] in [a["digest"] for a in listed]

    again = stack.post("/v1/builds", spec)
    assert again.status_code == 200, again.text
    assert again.json()["digest"] == done["digest"] and again.json()["cache_hit"] is True
    return done


def bad_requests_are_4xx_with_json(stack: Stack) -> None:
    r = stack.post("/v1/builds", tiny_spec(precision="int8"))
    assert r.status_code == 422 and r.json()["error"]["field"] == "precision"
    r = stack.post("/v1/builds", {"matrix": [tiny_spec(), tiny_spec(target="a100")]})
    assert r.status_code == 422 and r.json()["error"]["field"] == "matrix.1.target"
    r = stack.post("/v1/builds", tiny_spec(profile={"max_batch_size": 4, "max_input_len": 64, "max_seq_len": 32,
                                                    "max_num_tokens": 64}))
    assert r.status_code == 422 and r.json()["error"]["field"] == "profile.max_seq_len"
    r = stack.post("/v1/builds", [1, 2])
    assert r.status_code == 422 and r.json()["error"]["field"] == "body"
    r = stack.get("/v1/builds/doesnotexist")
    assert r.status_code == 404 and r.json()["error"]["field"] == "id"
    r = stack.get("/v1/artifacts/sha256:nothex")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_digest"
    r = stack.get("/v1/artifacts/sha256:" + "0" * 64)
    assert r.status_code == 404 and r.json()["error"]["field"] == "digest"
    r = stack.get("/v1/builds?limit=0")
    assert r.status_code == 422 and r.json()["error"]["field"] == "limit"
    assert stack.get("/openapi.json").json()["components"]["schemas"]["BuildSpec"]["required"]


def health(stack: Stack) -> None:
    assert stack.get("/healthz").json() == {"status": "ok"}
    ready = stack.get("/readyz")
    assert ready.status_code == 200 and ready.json()["checks"] == {"database": "ok", "broker": "ok"}

"""``POST /v1/builds`` with evaluation task files (docs/security.md "Task files"): the API checks a task file's
shape and places and nothing more — it imports, renders and evaluates nothing of it — and a refusal is Kiln's own
message, never what the file or the environment held."""

from __future__ import annotations

import os
import shutil

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from kiln import db
from kiln.settings import Settings
from tests.conftest import REPO, TINY
from tests.hostile_tasks import ATTACKS, SECRET, function_in_folder, layout, task_yaml

CHEAP = {"checkpoint": str(TINY), "precision": "fp8", "backend": "checkpoint",
         "calibration": {"samples": 8, "seq_len": 64}, "evaluation": {"max_tokens": 1024},
         "override_reason": "a test build: a short evaluation"}


def client(tmp_path, case, **settings) -> TestClient:
    roots = os.pathsep.join([str(REPO), str(case.roots)])
    s = Settings(home=tmp_path / "home", auth="off", checkpoint_roots=roots, **settings)
    db.upgrade(s.db_url)
    return TestClient(create_app(s, enqueue=lambda *a: None))


def build(c: TestClient, *paths, **evaluation):
    return c.post("/v1/builds", json={**CHEAP, "evaluation": {**CHEAP["evaluation"], **evaluation,
                                                             "tasks": [str(p) for p in paths]}})


@pytest.fixture
def case(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_BOOTSTRAP_TOKEN", SECRET)  # what a task once read from the API's environment
    return layout(tmp_path)


@pytest.mark.parametrize("attack", ATTACKS, ids=lambda a: a.__name__)
def test_a_hostile_task_runs_nothing_in_the_api_and_its_answer_holds_no_secret(attack, case, tmp_path):
    r = build(client(tmp_path, case), attack(case))
    assert not case.marker.exists()
    assert SECRET not in r.text
    if attack.__name__.startswith("jinja"):  # not rendered here: the worker's sandbox refuses it
        assert r.status_code == 202, r.text
    else:
        assert r.status_code == 422 and r.json()["error"]["field"] == "evaluation.tasks", r.text


def test_a_trusted_folders_task_is_accepted_and_still_not_imported_by_the_api(case, tmp_path):
    path = function_in_folder(case)
    r = build(client(tmp_path, case), path)
    assert r.status_code == 422 and "!function" in r.json()["error"]["message"]
    r = build(client(tmp_path, case, trusted_task_dirs=str(path.parent)), path)
    assert r.status_code == 202, r.text
    assert not case.marker.exists()


def test_sixteen_copies_of_a_task_cost_one_check(case, tmp_path):
    from validation import taskfile

    path = task_yaml(case)
    (path.parent / "items.jsonl").write_text("".join(
        f'{{"id": "{n}", "context": "The list is", "choices": ["empty", "full"], "answer": {n % 2}}}\n'
        for n in range(2000)))
    copies = [path.parent / f"copy{n}.yaml" for n in range(16)]
    for p in copies:
        shutil.copy(path, p)
    before = taskfile.CHECKS.misses
    r = build(client(tmp_path, case), *copies)
    assert r.status_code == 202, r.text
    assert taskfile.CHECKS.misses - before == 1

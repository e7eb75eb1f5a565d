"""A task file is data unless an operator trusts its folder (validation/taskfile.py, validation/tasks.py,
docs/security.md): neither the check nor the worker's load runs a task's code, renders its templates outside a
sandbox, follows it outside its folder or the checkpoint roots, or answers with what it read."""

from __future__ import annotations

import os
import shutil

import pytest

from kiln.errors import SpecError
from tests.conftest import REPO, TINY
from tests.hostile_tasks import ATTACKS, SECRET, function_quoted, layout, marking_module, task_yaml
from validation import tasks
from validation.runners import TransformersRunner


@pytest.fixture(scope="module")
def runner():
    return TransformersRunner(TINY)


@pytest.fixture
def case(tmp_path, monkeypatch):
    case = layout(tmp_path)
    monkeypatch.setenv("KILN_CHECKPOINT_ROOTS", os.pathsep.join([str(REPO), str(case.roots)]))
    monkeypatch.setenv("KILN_BOOTSTRAP_TOKEN", SECRET)
    monkeypatch.delenv("KILN_TRUSTED_TASK_DIRS", raising=False)
    return case


@pytest.mark.parametrize("attack", ATTACKS, ids=lambda a: a.__name__)
def test_the_check_runs_no_task_code_and_shows_nothing_it_read(attack, case):
    """Every hostile form but a template is refused by the check itself; it renders nothing, so a template's
    escape is the worker's sandbox's to refuse."""
    path = attack(case)
    if attack.__name__.startswith("jinja"):
        assert tasks.check_task_file(path)["items"] == 2
    else:
        with pytest.raises(SpecError) as err:
            tasks.check_task_file(path)
        assert SECRET not in str(err.value) and err.value.field == "evaluation.tasks"
    assert not case.marker.exists()


@pytest.mark.parametrize("attack", ATTACKS, ids=lambda a: a.__name__)
def test_the_worker_refuses_a_hostile_task_before_its_code_runs(attack, case, runner):
    path = attack(case)
    with pytest.raises(SpecError) as err:
        tasks.evaluate_task(runner, TINY, path, max_batch=8, max_len=64, limit=2)
    assert err.value.field == "evaluation.tasks" and SECRET not in str(err.value)
    assert not case.marker.exists()


def test_a_trusted_folder_may_run_code(case, monkeypatch, runner):
    path = function_quoted(case)
    with pytest.raises(SpecError, match="!function"):
        tasks.check_task_file(path)
    monkeypatch.setenv("KILN_TRUSTED_TASK_DIRS", str(path.parent))
    assert tasks.check_task_file(path)["items"] == 2
    assert not case.marker.exists()  # the check imports nothing, even for a trusted task
    out = tasks.evaluate_task(runner, TINY, path, max_batch=8, max_len=64)
    assert out["n"] == 2 and case.marker.exists()


def test_a_trusted_task_renders_templates_unsandboxed(case, monkeypatch, runner):
    path = task_yaml(case, text="\"{{ cycler.__init__.__globals__.__name__ }} {{context}}\"")
    with pytest.raises(SpecError, match="SecurityError"):
        tasks.evaluate_task(runner, TINY, path, max_batch=8, max_len=64)
    monkeypatch.setenv("KILN_TRUSTED_TASK_DIRS", str(case.roots))
    assert tasks.evaluate_task(runner, TINY, path, max_batch=8, max_len=64)["n"] == 2


def test_the_digest_covers_a_quoted_function_module_and_included_files(case, monkeypatch):
    monkeypatch.setenv("KILN_TRUSTED_TASK_DIRS", str(case.roots))
    path = function_quoted(case)
    before = tasks.check_task_file(path)["digest"]
    module = path.parent / "helpers.py"
    module.write_text(module.read_text() + "# changed\n")
    assert tasks.check_task_file(path)["digest"] != before
    (path.parent / "base.yaml").write_text("description: one\n")
    path.write_text(path.read_text() + "include: base.yaml\n")
    with_include = tasks.check_task_file(path)["digest"]
    (path.parent / "base.yaml").write_text("description: two\n")
    assert tasks.check_task_file(path)["digest"] != with_include


def test_include_and_function_files_stay_in_the_tasks_folder(case, monkeypatch):
    """A relative ``include:`` or ``!function`` that climbs out of the folder is refused like an absolute one, a
    symlink out of the roots like the place it points to, even in a trusted folder."""
    (case.roots / "base.yaml").write_text("description: above\n")
    path = task_yaml(case, extra="include: ../base.yaml\n")
    with pytest.raises(SpecError, match="include"):
        tasks.check_task_file(path)
    monkeypatch.setenv("KILN_TRUSTED_TASK_DIRS", str(path.parent))
    marking_module(case.roots, "above", case.marker)
    with pytest.raises(SpecError, match="!function"):
        tasks.check_task_file(task_yaml(case, text="!function .." + ".".join(case.roots.parts[1:]) + ".above.text"))
    shutil.copy(case.task.parent / "items.jsonl", case.outside / "items.jsonl")
    (case.task.parent / "linked.jsonl").symlink_to(case.outside / "items.jsonl")
    with pytest.raises(SpecError, match="outside the checkpoint roots"):
        tasks.check_task_file(task_yaml(case, data="linked.jsonl"))
    assert not case.marker.exists()


def test_the_check_is_cached_by_content(case):
    """Copies of one task (any names) cost one reading of its items; a changed item is read again."""
    from validation import taskfile

    task_yaml(case)
    copies = []
    for n in range(16):
        copies.append(case.task.parent / f"copy{n}.yaml")
        shutil.copy(case.task, copies[-1])
    before = taskfile.CHECKS.misses
    assert len({tasks.check_task_file(p)["digest"] for p in copies}) == 1
    assert taskfile.CHECKS.misses - before <= 1
    data = case.task.parent / "items.jsonl"
    data.write_text(data.read_text().replace('"answer": 1', '"answer": 0'))
    tasks.check_task_file(copies[0])
    assert taskfile.CHECKS.misses - before <= 2 and taskfile.CHECKS.misses > before

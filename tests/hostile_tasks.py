"""Hostile evaluation task files, one per way a task YAML once ran code or read files in whatever loaded it
(docs/security.md "Task files"): each writes a marker file if its code runs, or puts a secret where an error
message would show it. Shared by the API's check (tests/unit/api/test_task_files.py) and the worker's load
(tests/unit/validation/test_task_safety.py)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

SECRET = "kiln-secret-3f9c1d"  # in the environment (KILN_BOOTSTRAP_TOKEN) and in a file outside the roots
ROWS = [{"id": "a", "context": "The list is", "choices": ["empty", "full"], "answer": 1},
        {"id": "b", "context": "The box is", "choices": ["open", "shut"], "answer": 0}]
BASE = """task: t
dataset_path: json
dataset_kwargs:
  data_files:
    test: DATA
test_split: test
output_type: multiple_choice
doc_to_text: TEXT
doc_to_choice: CHOICES
doc_to_target: TARGET
"""


@dataclass
class Case:
    roots: Path  # the only checkpoint root besides the repository
    task: Path  # the task file to name
    marker: Path  # created if the task's code runs
    outside: Path  # a folder outside the roots


def layout(tmp_path: Path) -> Case:
    """``roots/task/`` with two good items, ``outside/`` beside ``roots``."""
    folder = tmp_path / "roots" / "task"
    folder.mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    (folder / "items.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return Case(tmp_path / "roots", folder / "t.yaml", tmp_path / "marker", tmp_path / "outside")


def task_yaml(case: Case, *, text: str = '"{{context}}"', choices: str = '"{{choices}}"', target: str = '"{{answer}}"',
              data: str = "items.jsonl", extra: str = "") -> Path:
    fields = {"DATA": data, "TEXT": text, "CHOICES": choices, "TARGET": target}
    case.task.write_text("".join(fields.get(word, word) for word in re.split(r"(DATA|TEXT|CHOICES|TARGET)", BASE))
                         + extra)
    return case.task


def marking_module(folder: Path, name: str, marker: Path) -> Path:
    """A module that writes ``marker`` when imported, with a harmless ``text(doc)``."""
    path = folder / f"{name}.py"
    path.write_text(f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n\n\n"
                    "def text(doc):\n    return doc['context']\n")
    return path


def function_in_folder(case: Case) -> Path:
    marking_module(case.task.parent, "helpers", case.marker)
    return task_yaml(case, text="!function helpers.text")


def function_quoted(case: Case) -> Path:
    marking_module(case.task.parent, "helpers", case.marker)
    return task_yaml(case, text='!function "helpers.text"')


def function_outside(case: Case) -> Path:
    """lm-eval reads ``..tmp.x.f`` as the file ``//tmp/x.py``: any module file on the machine."""
    marking_module(case.outside, "far", case.marker)
    assert "." not in str(case.outside)
    return task_yaml(case, text="!function .." + ".".join(case.outside.parts[1:]) + ".far.text")


def jinja_escape(case: Case) -> Path:
    return task_yaml(case, text=f"\"{{{{ cycler.__init__.__globals__.os.system('touch {case.marker}') }}}}\"")


def jinja_environment(case: Case) -> Path:
    """A template that reads the server's environment into the item's target, which an error message showed."""
    return task_yaml(case, target="\"{{ cycler.__init__.__globals__.os.environ['KILN_BOOTSTRAP_TOKEN'] }}\"")


def include_outside(case: Case) -> Path:
    """An absolute ``include:`` outside the task's folder, whose YAML imports a module beside it."""
    marking_module(case.outside, "base_helpers", case.marker)
    (case.outside / "base.yaml").write_text("doc_to_text: !function base_helpers.text\n")
    return task_yaml(case, extra=f"include: {case.outside / 'base.yaml'}\n")


def data_outside(case: Case) -> Path:
    """``data_files`` naming a registry credentials file outside the roots, its content put in the target."""
    secret = case.outside / "config.json"
    secret.write_text(json.dumps({"auths": {"registry.example": {"auth": SECRET}}}) + "\n")
    return task_yaml(case, text='"x"', choices="\"{{['a', 'b']}}\"", data=str(secret), target='"{{auths}}"')


def metric_script(case: Case) -> Path:
    """A metric named by a local script's path (lm-eval hands unknown metric names to ``evaluate.load``)."""
    script = marking_module(case.outside, "evil_metric", case.marker)
    return task_yaml(case, extra=f"metric_list:\n  - metric: acc\n  - metric: {script}\n")


ATTACKS = [function_in_folder, function_quoted, function_outside, jinja_escape, jinja_environment, include_outside,
           data_outside, metric_script]

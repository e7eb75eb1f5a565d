"""The reference's stored results (validation/reference.py) and their key (kiln/keys.py): computed once, read back
exactly, shared by every build of a checkpoint with that evaluation and by nothing else."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kiln.datasets import load_text
from kiln.keys import reference_key
from kiln.spec import parse_spec
from validation.gates import effective_gates
from validation.reference import Reference, compute_reference, layout
from validation.runners import CheckpointRunner, TransformersRunner
from validation.tasks import check_task_file
from validation.validate import validate

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "examples" / "tiny-llama"
TASK = REPO / "examples" / "tasks" / "heldout-cloze.jsonl"
TOOLCHAIN = {"torch": "2.13.0", "transformers": "5.14.1", "lm_eval": "0.4.13", "modelopt": "0.47"}


def spec(**kw):
    return parse_spec({"checkpoint": str(TINY), "precision": "fp8", "backend": "checkpoint",
                       "evaluation": {"max_tokens": 2048, **kw.pop("evaluation", {})},
                       "override_reason": "a unit test: a short evaluation", **kw}, [REPO])


@pytest.fixture(scope="module")
def text() -> str:
    return load_text("kiln:heldout", field="evaluation.dataset", roots=[])[0]


@pytest.fixture(scope="module")
def task() -> dict[str, Path]:
    return {check_task_file(TASK)["digest"]: TASK}


@pytest.fixture(scope="module")
def stored(text, task, tmp_path_factory) -> tuple[Reference, Path]:
    s = spec(evaluation={"tasks": [str(TASK)]})
    ref = compute_reference(TransformersRunner(TINY), TINY, text, s, task)
    folder = tmp_path_factory.mktemp("reference")
    ref.save(folder)
    return ref, folder


def test_what_is_saved_is_read_back_exactly(stored):
    ref, folder = stored
    again = Reference.load(folder, TINY)
    assert np.array_equal(np.asarray(again.windows.hidden), ref.windows.hidden) and again.tasks == ref.tasks
    [outcome] = again.tasks.values()
    assert outcome["n"] == 200 and len(outcome["items"]) == 200


def test_a_build_with_the_stored_reference_judges_exactly_as_with_the_runner(stored, text, task, fp8_export):
    ref, folder = stored
    s = spec(evaluation={"tasks": [str(TASK)]})
    gates = effective_gates("fp8", {})
    with_store = validate(CheckpointRunner(fp8_export / "hf"), Reference.load(folder, TINY), TINY, text, s, gates,
                          2048, tasks=task)
    with_runner = validate(CheckpointRunner(fp8_export / "hf"), TransformersRunner(TINY), TINY, text, s, gates, 2048,
                           tasks=task)
    for key in ("perplexity", "reference_perplexity", "ppl_increase_pct", "top1_agreement", "mean_kl", "intervals"):
        assert with_store["metrics"][key] == with_runner["metrics"][key], key
    [a], [b] = with_store["metrics"]["tasks"], with_runner["metrics"]["tasks"]
    assert a["outcomes"] == b["outcomes"] and a["interval"] == b["interval"]
    assert [g["decision"] for g in with_store["gates"]] == [g["decision"] for g in with_runner["gates"]]


def test_the_layout_follows_what_the_engine_accepts():
    assert layout(spec())["seq_len"] == 128
    assert layout(spec(profile={"max_batch_size": 1, "max_input_len": 32, "max_seq_len": 64, "max_num_tokens": 64}))[
        "seq_len"] == 64  # windows are capped by max_seq_len
    assert "task_max_len" not in layout(spec())
    assert layout(spec())["computed_in"] == "float32" and layout(spec(), torch.bfloat16)["computed_in"] == "bfloat16"
    assert layout(spec(evaluation={"tasks": [str(TASK)]}))["task_max_len"] == 256  # max_input_len of latency


def test_the_key_names_the_checkpoint_and_the_evaluation_and_nothing_else():
    data = {"calibration": "sha256:c", "evaluation": "sha256:e"}
    base = reference_key("sha256:ck", spec(), TOOLCHAIN, data, layout(spec()))
    other_precision = spec(precision="nvfp4", recipe="nvfp4")
    other_backend = spec(backend="aot-inductor")
    for s in (other_precision, other_backend, spec(profile="balanced")):  # same windows: the same reference
        assert reference_key("sha256:ck", s, TOOLCHAIN, {**data, "calibration": "sha256:other"}, layout(s)) == base
    assert reference_key("sha256:other", spec(), TOOLCHAIN, data, layout(spec())) != base
    assert reference_key("sha256:ck", spec(), TOOLCHAIN, {**data, "evaluation": "sha256:x"}, layout(spec())) != base
    assert reference_key("sha256:ck", spec(), TOOLCHAIN, {**data, "tasks": ["sha256:t"]}, layout(spec())) != base
    assert reference_key("sha256:ck", spec(), {**TOOLCHAIN, "transformers": "5.15"}, data, layout(spec())) != base
    longer = spec(evaluation={"max_tokens": 4096})
    assert reference_key("sha256:ck", longer, TOOLCHAIN, data, layout(longer)) != base

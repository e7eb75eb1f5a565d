"""Task evaluation on a real trained model (SmolLM2-135M-Instruct): lm-eval's own ``hf`` model and RunnerLM over Kiln's
TransformersRunner answer the shipped held-out cloze task (examples/tasks/heldout-cloze.jsonl) item by item alike,
well above the 25 % a guess gets."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.realmodels import smollm2
from validation import tasks
from validation.runners import TransformersRunner

pytestmark = [pytest.mark.slow, pytest.mark.realmodel]

TASK = Path(__file__).resolve().parents[2] / "examples" / "tasks" / "heldout-cloze.jsonl"
LIMIT = 120  # of the task's 200 items: both passes within about a minute on two cores


def test_runner_lm_and_lm_evals_hf_model_agree_on_smollm2(tmp_path):
    import lm_eval
    from lm_eval.tasks import TaskManager

    ckpt = smollm2()
    t0 = time.perf_counter()
    ours = tasks.evaluate_task(TransformersRunner(ckpt), ckpt, TASK, max_batch=8, max_len=128, limit=LIMIT)
    t1 = time.perf_counter()
    cfg = tasks.task_config(TASK, cache_dir=tmp_path)
    out = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={ckpt},dtype=float32", device="cpu",
                                  batch_size=8, tasks=[cfg], task_manager=TaskManager(include_defaults=False),
                                  limit=LIMIT, log_samples=True, bootstrap_iters=0)
    t2 = time.perf_counter()
    theirs = sorted(out["samples"][cfg["task"]], key=lambda s: s["doc_id"])
    print(f"heldout-cloze on SmolLM2-135M, {LIMIT} items: RunnerLM acc {ours['accuracy']:.3f} in {t1 - t0:.0f}s, "
          f"lm-eval hf acc {out['results'][cfg['task']]['acc,none']:.3f} in {t2 - t1:.0f}s")
    assert ours["n"] == len(theirs) == LIMIT
    for item, s in zip(ours["items"], theirs):
        assert item["id"] == s["doc"]["id"] and item["correct"] == (s["acc"] == 1.0), item["id"]
        assert item["loglikelihoods"] == pytest.approx([r[0] for r in s["filtered_resps"]], abs=1e-3), item["id"]
    assert ours["accuracy"] == pytest.approx(out["results"][cfg["task"]]["acc,none"])
    assert ours["accuracy"] > 0.6  # a trained model reads the held-out prose: far above chance (0.25)

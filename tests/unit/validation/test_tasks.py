"""Task evaluation through lm-evaluation-harness (validation/tasks.py) on the shipped tiny Llama: task files are
checked before any model runs, both task forms give the same items, and RunnerLM over a Kiln runner agrees with
lm-eval's own ``hf`` model item by item, within an engine's batch and length limits."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from kiln.errors import SpecError
from validation import tasks
from validation.runners import TransformersRunner

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "examples" / "tiny-llama"
JSONL = REPO / "examples" / "tasks" / "heldout-cloze.jsonl"
YAML = REPO / "examples" / "tasks" / "heldout-cloze.yaml"
N = 30  # items of the shipped task the model tests run


class Recording:
    """A runner that records the shapes it is asked for (and can damage its model's logits)."""

    def __init__(self, inner, max_batch: int | None = None, max_len: int | None = None):
        self.inner, self.shapes, self.max_batch, self.max_len = inner, [], max_batch, max_len

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        b, s = input_ids.shape
        self.shapes.append((b, s))
        assert input_ids.dtype == torch.int64 and s >= 2
        assert self.max_batch is None or b <= self.max_batch
        assert self.max_len is None or s <= self.max_len
        return self.inner.logits(input_ids)


@pytest.fixture(scope="module")
def runner():
    return TransformersRunner(TINY)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TINY))


@pytest.fixture(scope="module")
def hflm():
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=str(TINY), dtype="float32", device="cpu", batch_size=8)


@pytest.fixture(scope="module")
def runner_result(runner):
    return tasks.evaluate_task(runner, TINY, JSONL, max_batch=8, max_len=128, limit=N)


def _requests(kind: str, args: list[tuple]):
    from lm_eval.api.instance import Instance

    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


# -- task files ------------------------------------------------------------------------------------
GOOD = {"id": "a", "context": "The list is", "choices": ["empty", "full"], "answer": 1}
YAML_TEXT = """task: t
dataset_path: json
dataset_kwargs:
  data_files:
    test: items.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "{{context}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
"""


def _jsonl(tmp_path: Path, *rows, name: str = "t.jsonl") -> Path:
    p = tmp_path / name
    p.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return p


def _yaml(tmp_path: Path, text: str = YAML_TEXT, rows=({**GOOD, "answer": 0}, {**GOOD, "id": "b"})) -> Path:
    _jsonl(tmp_path, *rows, name="items.jsonl")
    (tmp_path / "t.yaml").write_text(text)
    return tmp_path / "t.yaml"


@pytest.mark.parametrize("rows, says", [
    (["{not json"], "line 1 is not JSON"),
    ([GOOD, "[1, 2]"], "line 2 is not a JSON object"),
    ([{k: v for k, v in GOOD.items() if k != "answer"}], "line 1: missing answer"),
    ([{**GOOD, "anwser": 0}], "line 1: 1 unknown field(s)"),
    ([{**GOOD, "answer": 2}], "line 1: answer is not an index of its 2 choices"),
    ([{**GOOD, "answer": True}], "answer is not an index"),
    ([{**GOOD, "choices": ["only"], "answer": 0}], "line 1: 1 choices"),
    ([{**GOOD, "choices": ["same", "same"]}], "2 choices (1 distinct)"),
    ([{**GOOD, "choices": ["ok", ""]}], "non-empty strings"),
    ([{**GOOD, "context": 3}], "context and id must be strings"),
    ([GOOD, GOOD], "item ids repeat"),
    ([GOOD, ""], "line 2 is not JSON"),
])
def test_bad_jsonl_lines_are_spec_errors_naming_the_line(tmp_path, rows, says):
    with pytest.raises(SpecError) as err:
        tasks.check_task_file(_jsonl(tmp_path, *rows))
    assert err.value.field == "evaluation.tasks" and says in err.value.message and err.value.fix


def test_missing_empty_and_unsupported_files_are_spec_errors(tmp_path):
    (tmp_path / "t.csv").write_text("a,b\n")
    (tmp_path / "empty.jsonl").write_text("")
    for path, says in [(tmp_path / "nope.jsonl", "not found"), (tmp_path / "t.csv", "unsupported file type '.csv'"),
                       (tmp_path / "empty.jsonl", "no items")]:
        with pytest.raises(SpecError, match=says) as err:
            tasks.check_task_file(path)
        assert err.value.field == "evaluation.tasks"


@pytest.mark.parametrize("change, says", [
    (("output_type: multiple_choice", "output_type: generate_until"), "output_type 'generate_until' is not supported"),
    (("dataset_path: json", "dataset_path: allenai/ai2_arc"), "dataset_path is not json"),
    (("test: items.jsonl", "test: gone.jsonl"), "data file 1 not found"),
    (("test_split: test", "test_split: validation"), "test_split (or validation_split) names no split of data_files"),
    (('doc_to_target: "{{answer}}"\n', ""), "missing doc_to_target"),
    (("task: t\n", "group: g\n"), "not a single task"),
    (("test_split: test\n", "test_split: test\nmetric_list:\n  - metric: f1\n"), "has neither acc nor acc_norm"),
    (("task: t\n", "task: [t\n"), "not valid YAML (line 2)"),
])
def test_bad_yaml_tasks_are_spec_errors(tmp_path, change, says):
    path = _yaml(tmp_path, YAML_TEXT.replace(*change))
    with pytest.raises(SpecError) as err:
        tasks.check_task_file(path)
    assert err.value.field == "evaluation.tasks" and says in err.value.message, err.value.message


@pytest.mark.parametrize("change, says", [
    (('doc_to_target: "{{answer}}"', 'doc_to_target: "{{answer * 5}}"'), "item 1: target 5 is not one of its 2"),
    (('doc_to_choice: "{{choices}}"', 'doc_to_choice: "{{choices[0]}}"'), "lm-eval cannot load the task"),
])
def test_templates_that_do_not_render_are_spec_errors_when_the_task_is_opened(tmp_path, change, says):
    """Templates are rendered only where a task runs (a worker, in Jinja's sandbox), not by the check."""
    path = _yaml(tmp_path, YAML_TEXT.replace(*change))
    assert tasks.check_task_file(path)["items"] == 2
    with pytest.raises(SpecError) as err, tasks.opened_task(path):
        pass
    assert err.value.field == "evaluation.tasks" and says in err.value.message, err.value.message


def test_check_gives_name_items_metric_and_a_content_digest_that_ignores_paths(tmp_path):
    info = tasks.check_task_file(JSONL)
    assert info == {"name": "heldout-cloze", "kind": "jsonl", "items": 200, "metric": "acc",
                    "digest": "sha256:" + hashlib.sha256(JSONL.read_bytes()).hexdigest()}
    yaml_info = tasks.check_task_file(YAML)
    assert {k: yaml_info[k] for k in ("name", "kind", "items", "metric")} == \
        {"name": "heldout_cloze", "kind": "yaml", "items": 200, "metric": "acc"}
    # the same files elsewhere: the same digest; a changed data file: another
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    shutil.copy(YAML, moved)
    shutil.copy(JSONL, moved)
    assert tasks.check_task_file(moved / YAML.name)["digest"] == yaml_info["digest"]
    data = moved / JSONL.name
    data.write_text(data.read_text().replace('"answer": 0', '"answer": 1', 1))
    assert tasks.check_task_file(moved / YAML.name)["digest"] != yaml_info["digest"]


def test_acc_norm_is_used_when_the_task_lists_it_first(tmp_path):
    text = YAML_TEXT + "metric_list:\n  - metric: acc_norm\n  - metric: acc\n"
    assert tasks.check_task_file(_yaml(tmp_path, text))["metric"] == "acc_norm"


# -- running ---------------------------------------------------------------------------------------
def test_jsonl_and_yaml_forms_give_the_same_items(runner, runner_result):
    other = tasks.evaluate_task(runner, TINY, YAML, max_batch=8, max_len=128, limit=N)
    assert runner_result["n"] == other["n"] == N and runner_result["metric"] == other["metric"] == "acc"
    assert runner_result["items"] == other["items"]
    first = json.loads(JSONL.read_text().splitlines()[0])
    assert runner_result["items"][0]["id"] == first["id"]
    assert runner_result["accuracy"] == sum(i["correct"] for i in runner_result["items"]) / N


def test_runner_lm_agrees_with_lm_evals_hf_model_item_by_item(runner_result, tmp_path):
    """The key check: lm-eval's own entry point and ``hf`` model on the same task config, against RunnerLM over
    Kiln's TransformersRunner. Same tokenization and scoring → the same log-likelihoods, the same verdicts."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    cfg = tasks.task_config(JSONL, cache_dir=tmp_path)
    out = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={TINY},dtype=float32", device="cpu",
                                  batch_size=8, tasks=[cfg], task_manager=TaskManager(include_defaults=False),
                                  limit=N, log_samples=True, bootstrap_iters=0)
    samples = sorted(out["samples"][cfg["task"]], key=lambda s: s["doc_id"])
    assert [str(s["doc"]["id"]) for s in samples] == [i["id"] for i in runner_result["items"]]
    for s, item in zip(samples, runner_result["items"]):
        assert item["correct"] == (s["acc"] == 1.0), item["id"]
        assert item["loglikelihoods"] == pytest.approx([r[0] for r in s["filtered_resps"]], abs=1e-4), item["id"]
    assert runner_result["accuracy"] == pytest.approx(out["results"][cfg["task"]]["acc,none"])
    assert 0.4 < runner_result["accuracy"] < 1.0  # the tiny model does better than chance (0.25), not perfectly


def test_batching_and_padding_do_not_change_loglikelihoods(runner, tokenizer):
    texts = json.loads(JSONL.read_text().splitlines()[3])["context"], "The list", "A short one"
    args = [(t, " " + w) for t in texts for w in ("value", "list", "statement of the object")]
    results = {}
    for b in (1, 3, 8):
        rec = Recording(runner, max_batch=b)
        results[b] = tasks.RunnerLM(rec, tokenizer, max_batch=b, max_len=128).loglikelihood(_requests("loglikelihood", args))
        assert max(s[0] for s in rec.shapes) == min(b, 6)  # 9 requests, 6 distinct inputs (one-token choices share)
    for b in (3, 8):
        assert [r[0] for r in results[b]] == pytest.approx([r[0] for r in results[1]], abs=1e-5)
        assert [r[1] for r in results[b]] == [r[1] for r in results[1]]


def test_right_padding_leaves_earlier_positions_alone(runner):
    """Why right-padding with any token is safe: a causal model's logits at a position ignore later tokens."""
    x = torch.randint(0, 2048, (2, 12), generator=torch.Generator().manual_seed(0))
    padded = torch.cat([x, torch.randint(0, 2048, (2, 7), generator=torch.Generator().manual_seed(1))], dim=1)
    assert torch.allclose(runner.logits(padded)[:, :12], runner.logits(x), atol=1e-5)


def test_one_token_inputs_are_padded_to_two(runner, tokenizer):
    rec = Recording(runner)
    lm = tasks.RunnerLM(rec, tokenizer, max_batch=4, max_len=32)
    ll = lm.loglikelihood(_requests("loglikelihood", [("", "A")]))
    assert rec.shapes == [(1, 2)] and ll[0][0] < 0


def test_max_len_truncates_from_the_left_like_lm_evals_hf_model(runner, tokenizer):
    from lm_eval.models.huggingface import HFLM

    context = json.loads(JSONL.read_text().splitlines()[5])["context"]
    args = [(context, " value"), (context, " the object of the statement"), ("Short", " one")]
    rec = Recording(runner, max_len=16)
    ours = tasks.RunnerLM(rec, tokenizer, max_batch=4, max_len=16).loglikelihood(_requests("loglikelihood", args))
    theirs = HFLM(pretrained=str(TINY), dtype="float32", device="cpu", batch_size=4, max_length=16).loglikelihood(
        _requests("loglikelihood", args))
    assert [r[0] for r in ours] == pytest.approx([r[0] for r in theirs], abs=1e-4)
    assert max(s[1] for s in rec.shapes) == 16
    # and it is a truncation: with room for the whole context the long request scores differently
    full = tasks.RunnerLM(runner, tokenizer, max_batch=4, max_len=128).loglikelihood(_requests("loglikelihood", args))
    assert abs(full[0][0] - ours[0][0]) > 1e-3


def test_rolling_loglikelihood_matches_lm_evals_hf_model(runner, tokenizer, hflm):
    from lm_eval.models.huggingface import HFLM

    text = " ".join(json.loads(line)["context"] for line in JSONL.read_text().splitlines()[:3])
    rec = Recording(runner, max_len=32)
    ours = tasks.RunnerLM(rec, tokenizer, max_batch=4, max_len=32).loglikelihood_rolling(
        _requests("loglikelihood_rolling", [(text,), ("Short text.",)]))
    theirs = HFLM(pretrained=str(TINY), dtype="float32", device="cpu", batch_size=4, max_length=32) \
        .loglikelihood_rolling(_requests("loglikelihood_rolling", [(text,), ("Short text.",)]))
    assert ours == pytest.approx(theirs, abs=1e-3)
    assert len(tokenizer.encode(text)) > 3 * 32  # several windows


def test_generate_until_is_greedy_and_honours_stop_sequences(runner, tokenizer, hflm):
    prompts = [json.loads(line)["context"] for line in JSONL.read_text().splitlines()[:3]]
    args = [(p, {"until": ["\n\n"], "max_gen_toks": 12, "do_sample": False}) for p in prompts]
    ours = tasks.RunnerLM(runner, tokenizer, max_batch=2, max_len=128).generate_until(_requests("generate_until", args))
    assert ours == hflm.generate_until(_requests("generate_until", args))
    assert all(o for o in ours)
    # a stop sequence cuts the text where it first appears
    n = max(range(len(ours)), key=lambda i: len(ours[i].split()))
    stop = ours[n].split()[1]
    cut = tasks.RunnerLM(runner, tokenizer, max_batch=2, max_len=128).generate_until(
        _requests("generate_until", [(prompts[n], {"until": [stop], "max_gen_toks": 12})]))
    assert cut == [ours[n].split(stop)[0]] and len(cut[0]) < len(ours[n])


def test_a_damaged_runner_scores_lower(runner_result):
    """Scrambled weights (one attention projection of every layer permuted) → worse answers."""
    damaged = TransformersRunner(TINY)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in damaged._model.model.layers:
            w = layer.self_attn.o_proj.weight
            w.copy_(w.flatten()[torch.randperm(w.numel(), generator=gen)].view_as(w))
    bad = tasks.evaluate_task(damaged, TINY, JSONL, max_batch=8, max_len=128, limit=N)
    assert bad["accuracy"] < runner_result["accuracy"]

    def gold(result):
        return sum(i["loglikelihoods"][json.loads(line)["answer"]]
                   for i, line in zip(result["items"], JSONL.read_text().splitlines()))

    assert gold(bad) < gold(runner_result) - 10


def test_run_tasks_checks_every_file_before_running_any(runner, tmp_path):
    rec = Recording(runner)
    with pytest.raises(SpecError, match="line 1 is not JSON"):
        tasks.run_tasks(rec, TINY, [JSONL, _jsonl(tmp_path, "{")], max_batch=8, max_len=64, limit=2)
    assert rec.shapes == []
    out = tasks.run_tasks(rec, TINY, [JSONL, YAML], max_batch=8, max_len=64, limit=2)
    assert [r["task"] for r in out] == ["heldout-cloze", "heldout_cloze"] and all(r["n"] == 2 for r in out)
    assert max(b for b, _ in rec.shapes) <= 8 and max(s for _, s in rec.shapes) <= 64


def test_nothing_is_written_outside_temporary_folders(runner, tmp_path, monkeypatch):
    import datasets

    cache = Path(datasets.config.HF_DATASETS_CACHE)
    before = sorted(cache.rglob("*")) if cache.exists() else []
    monkeypatch.chdir(tmp_path)
    tasks.evaluate_task(runner, TINY, YAML, max_batch=8, max_len=64, limit=3)
    assert (sorted(cache.rglob("*")) if cache.exists() else []) == before
    assert list(tmp_path.iterdir()) == []


def test_the_shipped_cloze_task_is_what_its_generator_writes():
    from scripts.make_cloze_task import SOURCE, make_items, render

    items = make_items(SOURCE.read_text(encoding="utf-8"))
    assert render(items) == JSONL.read_text(encoding="utf-8")  # deterministic: regenerate with the script
    assert len(items) == 200 and len({i["id"] for i in items}) == 200
    for item in items:
        answer = item["choices"][item["answer"]]
        assert 30 <= len(item["context"].split()) <= 60 and len(item["choices"]) == 4
        assert all(c.lower() != answer.lower() for n, c in enumerate(item["choices"]) if n != item["answer"])
    assert len({i["answer"] for i in items}) == 4  # the right answer is not always in one place


def test_chosen_items_are_exactly_those_items_of_a_full_run(runner, runner_result):
    part = tasks.evaluate_task(runner, TINY, JSONL, max_batch=8, max_len=128, items=[17, 3, 9])
    full = {i["id"]: i for i in runner_result["items"]}
    assert [i["id"] for i in part["items"]] == [runner_result["items"][k]["id"] for k in (3, 9, 17)]
    for item in part["items"]:
        assert item["correct"] == full[item["id"]]["correct"]
        assert item["loglikelihoods"] == pytest.approx(full[item["id"]]["loglikelihoods"], abs=1e-4)


@pytest.mark.parametrize("threshold,sequential,evaluated,decision", [
    (30.0, True, 16, "pass"),  # an engine identical to its reference, a loose gate: decided at the first look
    (1.0, True, 64, "undecided"),  # a gate finer than 64 items resolve: every item, and it says so
    (30.0, False, 64, None),  # --eval-all
])
def test_task_items_are_evaluated_sequentially_until_the_task_gate_is_decided(runner, tmp_path, threshold, sequential,
                                                                                evaluated, decision):
    from types import SimpleNamespace

    from kiln.spec import parse_spec
    from validation.validate import task_accuracy

    path = tmp_path / "cloze64.jsonl"
    path.write_text("".join(JSONL.read_text().splitlines(keepends=True)[:64]))
    reference = SimpleNamespace(tasks={"d": tasks.evaluate_task(runner, TINY, path, max_batch=8, max_len=128)})
    spec = parse_spec({"checkpoint": str(TINY), "precision": "fp8", "evaluation": {"sequential": sequential}},
                      [REPO])
    rec = Recording(runner)
    [out] = task_accuracy(rec, reference, TINY, spec, {"d": path}, threshold=threshold if sequential else None)
    assert out["evaluated"] == evaluated and out["total"] == 64 and out["items"] == evaluated
    assert out["sequential"]["decision"] == decision and out["sequential"]["skipped"] == 64 - evaluated
    assert out["drop_pts"] == 0.0 and len(out["outcomes"]) == evaluated
    if sequential:
        assert out["interval"]["confidence"] == pytest.approx(0.95 if len(out["sequential"]["looks"]) == 1 else
                                                               out["sequential"]["confidence"])
        assert out["sequential"]["confidence"] > 0.95

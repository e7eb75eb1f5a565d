"""Gates: max_ gates pass at or below the threshold, min_ gates at or above; a non-finite figure never passes
where it would mean a broken engine."""

from __future__ import annotations

import math

import pytest

from kiln.precisions import PRECISIONS
from validation.gates import DEFAULT_GATES, TASK_GATE, effective_gates, evaluate

GATE_NAMES = ("max_ppl_increase_pct", "min_top1_agreement", "max_mean_kl", TASK_GATE, "min_throughput_tps")


def metrics(ppl=1.0, top1=0.95, kl=0.01, tps=(100.0, 250.0)):
    return {"ppl_increase_pct": ppl, "top1_agreement": top1, "mean_kl": kl,
            "throughput": [{"batch_size": i + 1, "seq_len": 8, "tokens_per_s": t} for i, t in enumerate(tps)]}


def by_name(verdicts):
    return {v["name"]: v for v in verdicts}


def test_default_gates_cover_every_gate_and_fp8_is_tighter():
    for precision in PRECISIONS:
        assert set(DEFAULT_GATES[precision]) == set(GATE_NAMES)
    fp8, nvfp4 = DEFAULT_GATES["fp8"], DEFAULT_GATES["nvfp4"]
    assert fp8["max_ppl_increase_pct"] < nvfp4["max_ppl_increase_pct"]
    assert fp8["max_mean_kl"] < nvfp4["max_mean_kl"]
    assert fp8["min_top1_agreement"] > nvfp4["min_top1_agreement"]
    assert fp8[TASK_GATE] < nvfp4[TASK_GATE]


def test_effective_gates_overrides_one_and_keeps_the_rest():
    gates = effective_gates("fp8", {"max_mean_kl": 1})
    assert gates == {**DEFAULT_GATES["fp8"], "max_mean_kl": 1.0}
    assert isinstance(gates["max_mean_kl"], float)
    assert effective_gates("nvfp4", {}) == DEFAULT_GATES["nvfp4"]
    assert effective_gates("nvfp4", {}) is not DEFAULT_GATES["nvfp4"]


def test_effective_gates_does_not_modify_the_defaults():
    before = {k: dict(v) for k, v in DEFAULT_GATES.items()}
    effective_gates("fp8", {"max_ppl_increase_pct": 50.0})["min_top1_agreement"] = 0.0
    assert DEFAULT_GATES == before


def test_one_verdict_per_gate_with_value_and_threshold():
    gates = DEFAULT_GATES["fp8"]
    verdicts = evaluate(metrics(), gates)
    assert [v["name"] for v in verdicts] == [g for g in gates if g != TASK_GATE]  # no tasks: no task verdict
    v = by_name(verdicts)
    assert v["max_ppl_increase_pct"] == {"name": "max_ppl_increase_pct", "threshold": 5.0, "value": 1.0, "passed": True,
                                         "decision": "pass"}
    assert v["min_throughput_tps"]["value"] == 250.0  # the peak across the envelope
    assert all(x["passed"] is True for x in verdicts)


@pytest.mark.parametrize("name, metric, at, worse, better", [
    ("max_ppl_increase_pct", "ppl", 3.0, 3.0001, -1.0),
    ("max_mean_kl", "kl", 0.05, 0.0501, 0.0),
    ("min_top1_agreement", "top1", 0.85, 0.8499, 1.0),
])
def test_max_and_min_semantics_with_inclusive_thresholds(name, metric, at, worse, better):
    gates = {name: at}
    assert evaluate(metrics(**{metric: at}), gates)[0]["passed"] is True
    assert evaluate(metrics(**{metric: better}), gates)[0]["passed"] is True
    assert evaluate(metrics(**{metric: worse}), gates)[0]["passed"] is False


def test_throughput_gate_uses_the_peak_and_fails_without_measurements():
    assert evaluate(metrics(tps=(0.5, 2.0)), {"min_throughput_tps": 1.0})[0]["passed"] is True
    assert evaluate(metrics(tps=(0.5, 0.9)), {"min_throughput_tps": 1.0})[0]["passed"] is False
    assert evaluate(metrics(tps=()), {"min_throughput_tps": 1.0})[0] == {
        "name": "min_throughput_tps", "threshold": 1.0, "value": 0.0, "passed": False, "decision": "fail"}


@pytest.mark.parametrize("metric", ["ppl", "kl", "top1"])
def test_nan_fails(metric):
    gate = {"ppl": "max_ppl_increase_pct", "kl": "max_mean_kl", "top1": "min_top1_agreement"}[metric]
    verdict = evaluate(metrics(**{metric: math.nan}), {gate: DEFAULT_GATES["nvfp4"][gate]})[0]
    assert verdict["passed"] is False


def test_nan_throughput_fails():
    assert evaluate(metrics(tps=(math.nan,)), {"min_throughput_tps": 1.0})[0]["passed"] is False


@pytest.mark.parametrize("metric", ["ppl", "kl"])
def test_infinite_loss_figures_fail(metric):
    gate = {"ppl": "max_ppl_increase_pct", "kl": "max_mean_kl"}[metric]
    assert evaluate(metrics(**{metric: math.inf}), {gate: 1e30})[0]["passed"] is False


def test_negative_infinite_agreement_fails():
    assert evaluate(metrics(top1=-math.inf), {"min_top1_agreement": 0.0})[0]["passed"] is False


def test_only_the_given_gates_are_judged():
    assert [v["name"] for v in evaluate(metrics(), {"max_mean_kl": 0.1})] == ["max_mean_kl"]
    assert evaluate(metrics(), {}) == []


def interval(low, high):
    return {"low": low, "high": high, "confidence": 0.95}


@pytest.mark.parametrize("low, high, decision", [(1.0, 2.9, "pass"), (2.0, 3.5, "undecided"), (3.2, 4.0, "fail")])
def test_an_accuracy_gate_with_an_interval_is_decided_on_it(low, high, decision):
    m = {**metrics(ppl=(low + high) / 2), "intervals": {"ppl_increase_pct": interval(low, high)}}
    [v] = evaluate(m, {"max_ppl_increase_pct": 3.0})
    assert v["decision"] == decision and v["passed"] is (decision == "pass")
    assert v["interval"] == [low, high] and v["confidence"] == 0.95


def test_the_task_gate_gives_one_verdict_per_task():
    tasks = [{"task": "a", "drop_pts": 0.5, "interval": interval(-1.0, 2.0)},
             {"task": "b", "drop_pts": 6.0, "interval": interval(4.0, 8.0)},
             {"task": "c", "drop_pts": 1.0, "interval": interval(-5.0, 7.0)}]
    verdicts = evaluate({**metrics(), "tasks": tasks}, {TASK_GATE: 3.0})
    assert [(v["task"], v["decision"], v["passed"]) for v in verdicts] == [
        ("a", "pass", True), ("b", "fail", False), ("c", "undecided", False)]

"""The memory budget and the regression gate: judged against the previous validated engine of the same target,
overridable only with a recorded reason, and never fooled by a noisy measurement or a different machine."""

from __future__ import annotations

import math
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from kiln import db
from kiln.errors import SpecError
from kiln.keys import build_key, request_key
from kiln.tables import Artifact
from kiln.spec import GATE_NAMES, REGRESSION_GATE_NAMES, parse_spec
from validation.gates import (DEFAULT_GATES, GPU_MEMORY_BUDGETS, MEMORY_GATE, REGRESSION_DEFAULTS, REGRESSION_GATES,
                              evaluate, judged_gates, memory_budget, physical_memory_bytes, regression)
from validation.validate import previous_engine

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "examples" / "tiny-llama"
COND = {"device": "cpu", "threads": 2, "cpus": 2, "cpu_model": "AMD EPYC", "torch": "2.13"}


def points(*tps, best=None):
    out = []
    for i, t in enumerate(tps):
        p = {"batch_size": 2 ** i, "seq_len": 256, "tokens_per_s": t}
        if best is not None:
            p["tokens_per_s_best"] = best[i]
        out.append(p)
    return out


def metrics(tps=(100.0, 200.0), ppl=1.0, best=None, memory=1e6):
    return {"ppl_increase_pct": ppl, "top1_agreement": 0.95, "mean_kl": 0.01, "perplexity": 40.0,
            "throughput": points(*tps, best=best), "peak_memory_bytes": memory}


def previous(tps=(100.0, 200.0), ppl=1.0, best=None, cond=None, same_evaluation=True):
    return {"digest": "sha256:" + "a" * 64, "build_key": "sha256:" + "b" * 64, "status": "fresh",
            "created_at": "2026-01-01T00:00:00+00:00", "metrics": metrics(tps, ppl, best),
            "conditions": dict(cond or COND), "same_evaluation": same_evaluation}


def by_name(verdicts):
    return {v["name"]: v for v in verdicts}


# -- names and defaults ----------------------------------------------------------------------------
def test_every_gate_is_a_spec_gate_name_and_the_regression_names_agree():
    names = set(DEFAULT_GATES["fp8"]) | {MEMORY_GATE} | set(REGRESSION_GATES)
    assert names == set(GATE_NAMES)
    assert tuple(REGRESSION_GATES) == REGRESSION_GATE_NAMES
    assert REGRESSION_DEFAULTS == {"max_throughput_drop_pct": 20.0, "max_accuracy_regression_pct": 1.0}


# -- memory budget ---------------------------------------------------------------------------------
def test_memory_budget_table_and_cpu_share_of_ram():
    assert memory_budget("sm89")[0] == 48e9 and memory_budget("sm90")[0] == 80e9
    assert memory_budget("sm100")[0] == 180e9 and memory_budget("sm120")[0] == 32e9
    assert set(GPU_MEMORY_BUDGETS) == {"sm89", "sm90", "sm100", "sm120"}
    size, source = memory_budget("cpu")
    assert size == pytest.approx(0.75 * physical_memory_bytes()) and "75%" in source
    assert physical_memory_bytes() > 2**28


def test_judged_gates_add_the_budget_and_regression_defaults_without_touching_the_key_gates():
    gates = dict(DEFAULT_GATES["fp8"])
    judged, sources = judged_gates(gates, "sm90")
    assert gates == DEFAULT_GATES["fp8"]  # the gates that entered the BuildKey are unchanged
    assert judged[MEMORY_GATE] == 80e9 and sources[MEMORY_GATE].startswith("default for sm90")
    assert judged["max_throughput_drop_pct"] == 20.0 and sources["max_throughput_drop_pct"] == "default"
    overridden, sources = judged_gates({**gates, MEMORY_GATE: 24e9, "max_throughput_drop_pct": 50.0}, "sm89")
    assert overridden[MEMORY_GATE] == 24e9 and sources[MEMORY_GATE] == "set by the build"
    assert overridden["max_throughput_drop_pct"] == 50.0 and sources["max_throughput_drop_pct"] == "set by the build"


@pytest.mark.parametrize("peak, passed", [(1e9, True), (2e9, True), (2e9 + 1, False), (math.inf, False), (math.nan, False)])
def test_memory_gate_the_envelope_must_fit(peak, passed):
    [v] = evaluate(metrics(memory=peak), {MEMORY_GATE: 2e9})
    assert v["name"] == MEMORY_GATE and v["threshold"] == 2e9 and v["passed"] is passed


def test_memory_gate_without_a_measurement_fails():
    m = metrics()
    del m["peak_memory_bytes"]
    assert evaluate(m, {MEMORY_GATE: 1e12})[0] == {"name": MEMORY_GATE, "threshold": 1e12, "value": math.inf,
                                                   "passed": False, "decision": "fail"}


def test_evaluate_leaves_the_regression_gates_to_regression():
    judged, _ = judged_gates(DEFAULT_GATES["fp8"], "cpu")
    names = [v["name"] for v in evaluate(metrics(), judged)]
    assert names == [*(g for g in DEFAULT_GATES["fp8"] if g != "max_task_accuracy_drop_pts"), MEMORY_GATE]


# -- regression: throughput ------------------------------------------------------------------------
def test_no_previous_engine_judges_nothing_and_says_why():
    record, verdicts = regression(metrics(), COND, None, {})
    assert verdicts == [] and record["previous"] is None
    assert set(record["not_judged"]) == set(REGRESSION_GATES)
    assert "no previous" in record["not_judged"]["max_throughput_drop_pct"]


@pytest.mark.parametrize("now, drop, passed", [(200.0, 0.0, True), (170.0, 15.0, True), (160.0, 20.0, True),
                                               (150.0, 25.0, False), (300.0, -50.0, True)])
def test_peak_throughput_drop_against_the_previous_engine(now, drop, passed):
    record, verdicts = regression(metrics(tps=(100.0, now)), COND, previous(), {})
    v = by_name(verdicts)["max_throughput_drop_pct"]
    assert v["value"] == pytest.approx(drop) and v["threshold"] == 20.0 and v["passed"] is passed
    assert v["against"] == "sha256:" + "a" * 64
    assert record["previous"]["digest"] == v["against"] and record["previous"]["peak_tokens_per_s"] == 200.0
    assert record["throughput_drop_pct"] == pytest.approx(drop)


def test_the_threshold_is_overridable():
    _, verdicts = regression(metrics(tps=(100.0, 150.0)), COND, previous(), {"max_throughput_drop_pct": 30.0})
    assert by_name(verdicts)["max_throughput_drop_pct"]["passed"] is True


def test_best_of_reps_is_compared_when_both_have_it():
    cur = metrics(tps=(50.0, 100.0), best=(90.0, 195.0))  # a noisy median, a steady best
    _, verdicts = regression(cur, COND, previous(best=(100.0, 200.0)), {})
    v = by_name(verdicts)["max_throughput_drop_pct"]
    assert v["value"] == pytest.approx(2.5) and v["passed"]


def test_an_apparent_drop_is_measured_again_before_it_fails():
    asked = []

    def steady(b, s):
        asked.append((b, s))
        return 199.0

    record, verdicts = regression(metrics(tps=(50.0, 100.0)), COND, previous(), {}, remeasure=steady)
    assert asked == [(2, 256)]  # the previous engine's peak point
    assert by_name(verdicts)["max_throughput_drop_pct"]["passed"] is True
    assert record["throughput"]["rechecked"] is True and record["throughput"]["recheck_tokens_per_s"] == 199.0

    record, verdicts = regression(metrics(tps=(50.0, 100.0)), COND, previous(), {}, remeasure=lambda b, s: 101.0)
    assert by_name(verdicts)["max_throughput_drop_pct"]["passed"] is False  # really slower
    assert record["throughput_drop_pct"] == pytest.approx(49.5)


def test_no_recheck_when_the_drop_is_inside_the_threshold():
    def boom(b, s):
        raise AssertionError("no re-measurement needed")

    record, verdicts = regression(metrics(tps=(100.0, 190.0)), COND, previous(), {}, remeasure=boom)
    v = by_name(verdicts)["max_throughput_drop_pct"]  # judged, from the first measurement, and passed
    assert v["value"] == pytest.approx(5.0) and v["passed"] is True
    assert record["throughput_drop_pct"] == pytest.approx(5.0) and not record["throughput"].get("rechecked")


@pytest.mark.parametrize("key, other", [("threads", 16), ("cpus", 64), ("device", "cuda:0"), ("cpu_model", "Xeon")])
def test_throughput_is_not_compared_across_different_conditions(key, other):
    record, verdicts = regression(metrics(tps=(10.0, 20.0)), COND, previous(cond={**COND, key: other}), {})
    assert "max_throughput_drop_pct" not in by_name(verdicts)
    assert key in record["not_judged"]["max_throughput_drop_pct"]
    assert by_name(verdicts)["max_accuracy_regression_pct"]["passed"] is True  # accuracy still compared


@pytest.mark.parametrize("now_load, then_load, judged", [(2.9, 0.1, True), (3.1, 0.1, False), (0.5, 7.0, False),
                                                         (None, None, True)])
def test_throughput_measured_on_a_busy_cpu_is_not_judged(now_load, then_load, judged):
    now = {**COND, "load_avg_1m": now_load}
    record, verdicts = regression(metrics(tps=(10.0, 20.0)), now, previous(cond={**COND, "load_avg_1m": then_load}), {})
    assert ("max_throughput_drop_pct" in by_name(verdicts)) is judged
    if not judged:
        assert "busy" in record["not_judged"]["max_throughput_drop_pct"]
        assert "max_accuracy_regression_pct" in by_name(verdicts)


@pytest.mark.parametrize("now_wait, then_wait, judged", [(9.9, 0.0, True), (10.0, 0.0, False), (0.0, 45.0, False),
                                                         (None, 2.0, True)])
def test_throughput_whose_threads_waited_for_a_cpu_is_not_judged(now_wait, then_wait, judged):
    """The run-queue wait measured while the timings ran (validation.measure.cpu_wait) says the machine was busy
    even when the one-minute load average has not caught up yet."""
    now = {**COND, "load_avg_1m": 0.5, "cpu_wait_pct": now_wait}
    record, verdicts = regression(metrics(tps=(10.0, 20.0)), now,
                                  previous(cond={**COND, "load_avg_1m": 0.5, "cpu_wait_pct": then_wait}), {})
    assert ("max_throughput_drop_pct" in by_name(verdicts)) is judged
    if not judged:
        reason = record["not_judged"]["max_throughput_drop_pct"]
        assert "busy" in reason and "waited for a CPU" in reason
        assert ("now" in reason) is (now_wait == 10.0) and ("then" in reason) is (then_wait == 45.0)
        assert "max_accuracy_regression_pct" in by_name(verdicts)


def test_a_busy_host_does_not_matter_to_a_gpu_measurement():
    gpu = {**COND, "device": "cuda", "gpu": "NVIDIA H200", "load_avg_1m": 40.0, "cpu_wait_pct": 80.0}
    _, verdicts = regression(metrics(tps=(10.0, 20.0)), gpu, previous(cond=gpu), {})
    assert by_name(verdicts)["max_throughput_drop_pct"]["passed"] is False  # judged: a 90 % drop


def test_only_points_both_engines_measured_are_compared():
    prev = previous()
    prev["metrics"]["throughput"] = [{"batch_size": 1, "seq_len": 256, "tokens_per_s": 100.0},
                                     {"batch_size": 64, "seq_len": 256, "tokens_per_s": 9999.0}]
    _, verdicts = regression(metrics(tps=(100.0, 200.0)), COND, prev, {})
    assert by_name(verdicts)["max_throughput_drop_pct"]["value"] == pytest.approx(0.0)
    prev["metrics"]["throughput"] = [{"batch_size": 64, "seq_len": 256, "tokens_per_s": 9999.0}]
    record, verdicts = regression(metrics(), COND, prev, {})
    assert "max_throughput_drop_pct" in record["not_judged"]


# -- regression: accuracy --------------------------------------------------------------------------
@pytest.mark.parametrize("now, worse, passed", [(1.0, 0.0, True), (1.9, 0.9, True), (2.0, 1.0, True),
                                                (2.5, 1.5, False), (-3.0, -4.0, True), (math.inf, math.inf, False),
                                                (math.nan, math.inf, False)])
def test_accuracy_regression_in_percentage_points(now, worse, passed):
    record, verdicts = regression(metrics(ppl=now), COND, previous(ppl=1.0), {})
    v = by_name(verdicts)["max_accuracy_regression_pct"]
    assert v["passed"] is passed and v["against"] == "sha256:" + "a" * 64
    assert v["value"] == pytest.approx(worse) if math.isfinite(worse) else v["value"] == math.inf
    assert record["previous"]["ppl_increase_pct"] == 1.0


def test_accuracy_is_not_compared_across_evaluation_texts():
    record, verdicts = regression(metrics(ppl=9.0), COND, previous(same_evaluation=False), {})
    assert "max_accuracy_regression_pct" not in by_name(verdicts)
    assert "evaluated on other text" in record["not_judged"]["max_accuracy_regression_pct"]


def test_the_override_reason_is_recorded():
    record, _ = regression(metrics(), COND, previous(), {}, override_reason="new CPU fleet")
    assert record["override_reason"] == "new CPU fleet"


# -- spec rules: an override needs a reason --------------------------------------------------------
def spec(**overrides):
    return parse_spec({"checkpoint": str(TINY), "precision": "fp8", **overrides}, [REPO])


@pytest.mark.parametrize("gate", ["max_throughput_drop_pct", "max_accuracy_regression_pct"])
def test_changing_the_regression_gate_needs_a_reason(gate):
    with pytest.raises(SpecError) as info:
        spec(gates={gate: 100.0})
    assert info.value.field == "override_reason" and gate in str(info.value) and info.value.fix
    with pytest.raises(SpecError):
        spec(gates={gate: 100.0}, override_reason="   ")
    ok = spec(gates={gate: 100.0}, override_reason="toolchain upgrade: new baseline")
    assert ok.gates == {gate: 100.0} and ok.override_reason == "toolchain upgrade: new baseline"
    assert ok.model_dump()["override_reason"] == "toolchain upgrade: new baseline"  # recorded in provenance


def test_other_gates_need_no_reason_and_the_reason_enters_no_key():
    a = spec(gates={"max_mean_kl": 0.04, MEMORY_GATE: 24e9})
    b = spec(gates={"max_mean_kl": 0.04, MEMORY_GATE: 24e9}, override_reason="noted")
    assert a.override_reason is None and a.key_fields() == b.key_fields()
    toolchain, data = {"torch": "2.13"}, {"evaluation": "sha256:" + "0" * 64}
    assert build_key("sha256:" + "1" * 64, a, toolchain, a.gates, data) == build_key("sha256:" + "1" * 64, b,
                                                                                       toolchain, b.gates, data)
    assert request_key("sha256:" + "1" * 64, a, a.gates, data) == request_key("sha256:" + "1" * 64, b, b.gates, data)


@pytest.mark.parametrize("value", [0, -1.0, math.inf])
def test_memory_budget_must_be_positive_bytes(value):
    with pytest.raises(SpecError) as info:
        spec(gates={MEMORY_GATE: value})
    assert info.value.field == f"gates.{MEMORY_GATE}"


def test_an_overlong_reason_is_refused():
    with pytest.raises(SpecError) as info:
        spec(override_reason="x" * 2001)
    assert info.value.field == "override_reason"


# -- the previous engine in the index --------------------------------------------------------------
@pytest.fixture
def sessions(tmp_path):
    url = f"sqlite:///{tmp_path / 'kiln.db'}"
    db.upgrade(url)
    return db.session_factory(url)


T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def add(sessions, n, *, status="fresh", minutes=0, profile=None, backend="checkpoint", evaluation=None,
        eval_data="sha256:" + "e" * 64, metrics_=True, key=None, **spec_over):
    s = spec(backend=backend, **({"profile": profile} if profile else {}), **spec_over)
    prov = {"spec": s.model_dump(), "data": {"evaluation": eval_data}}
    if evaluation is not None:
        prov["spec"]["evaluation"] = evaluation
    digest = f"sha256:{n:064x}"
    with sessions() as session:
        session.add(Artifact(
            digest=digest, build_key=key or f"sha256:{n + 1000:064x}", repository=s.model_name, tag="t", status=status,
            precision=s.precision, target=s.target, profile=s.batch_profile.name, backend=s.backend,
            checkpoint_ref=s.checkpoint, checkpoint_digest="sha256:" + "c" * 64, size=1, provenance=prov,
            validation={"passed": True, "metrics": metrics() if metrics_ else {}, "conditions": COND},
            created_at=T0 + timedelta(minutes=minutes)))
        session.commit()
    return digest


def test_previous_engine_is_the_newest_validated_one_of_the_same_target(sessions):
    me = spec(backend="checkpoint")
    ours = f"sha256:{9999:064x}"
    assert previous_engine(sessions, me, ours) is None
    old = add(sessions, 1, minutes=1)
    newer = add(sessions, 2, minutes=2, status="stale")  # validated, from an older checkpoint head
    add(sessions, 3, minutes=3, status="rejected")
    add(sessions, 4, minutes=4, status="revoked")
    add(sessions, 5, minutes=5, backend="aot-inductor")
    add(sessions, 6, minutes=6, profile="balanced")
    add(sessions, 7, minutes=7, profile={"name": "latency", "max_batch_size": 2, "max_input_len": 256,
                                         "max_seq_len": 512, "max_num_tokens": 512})  # same name, other limits
    add(sessions, 8, minutes=8, precision="nvfp4")
    add(sessions, 9, minutes=9, model_name="other/model")
    add(sessions, 10, minutes=10, metrics_=False)
    add(sessions, 11, minutes=11, key=ours)  # the same BuildKey is not "previous"
    got = previous_engine(sessions, me, ours, {"evaluation": "sha256:" + "e" * 64})
    assert got["digest"] == newer and got["status"] == "stale" and got["same_evaluation"] is True
    assert got["metrics"]["throughput"] and got["conditions"] == COND
    assert got["created_at"].startswith("2026-01-01T00:02")
    with sessions() as session:
        session.get(Artifact, newer).status = "revoked"
        session.commit()
    assert previous_engine(sessions, me, ours)["digest"] == old


def test_previous_engine_says_when_it_was_evaluated_differently(sessions):
    me = spec(backend="checkpoint")
    add(sessions, 1, eval_data="sha256:" + "f" * 64)
    assert previous_engine(sessions, me, "sha256:" + "0" * 64, {"evaluation": "sha256:" + "e" * 64})[
        "same_evaluation"] is False
    add(sessions, 2, minutes=1, evaluation={"dataset": "kiln:heldout", "seq_len": 64, "max_tokens": 16384})
    assert previous_engine(sessions, me, "sha256:" + "0" * 64, {"evaluation": "sha256:" + "e" * 64})[
        "same_evaluation"] is False
    add(sessions, 3, minutes=2)
    assert previous_engine(sessions, me, "sha256:" + "0" * 64, {"evaluation": "sha256:" + "e" * 64})[
        "same_evaluation"] is True

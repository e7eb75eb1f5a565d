"""validation/fit.py: coverage of a traffic sample by batch profiles, on samples generated deterministically
(seeded shuffles of hand-built requests) whose coverage can be computed by hand."""

from __future__ import annotations

import json
import random

import pytest

from kiln.errors import SpecError
from kiln.spec import PROFILES
from validation import fit as f


def jsonl(requests: list[dict], seed: int) -> list[str]:
    """The requests as JSON lines in a seeded random order (order must not matter)."""
    rows = list(requests)
    random.Random(seed).shuffle(rows)
    return [json.dumps(r) for r in rows]


def lengths_sample(seed: int = 7) -> list[dict]:
    """100 requests 10 s apart, 1 s each: 90 fit every named profile, 6 have a 300-token prompt (over
    max_input_len 256, total 310 within 512), 4 have prompt 100 + output 500 (over max_seq_len 512)."""
    rng = random.Random(seed)
    reqs = [{"prompt_tokens": rng.randint(1, 256), "output_tokens": rng.randint(0, 256)} for _ in range(90)]
    reqs += [{"prompt_tokens": 300, "output_tokens": 10}] * 6 + [{"prompt_tokens": 100, "output_tokens": 500}] * 4
    return [{**r, "arrival_s": 10.0 * i, "duration_s": 1.0} for i, r in enumerate(reqs)]


def bursts_sample() -> list[dict]:
    """4 bursts of 10 simultaneous 1-second requests at t = 0, 10, 20, 30: window 31 s, of which 4 s at
    concurrency 10 and 27 s at 0."""
    return [{"prompt_tokens": 64, "output_tokens": 64, "arrival_s": 10.0 * b, "duration_s": 1.0}
            for b in range(4) for _ in range(10)]


def test_length_coverage_counts_each_limit():
    reqs = f.parse_jsonl(jsonl(lengths_sample(), seed=1))
    t = f.Traffic.of(reqs)
    r = f.fit(t, PROFILES["latency"])
    assert r["length_coverage"] == 90 / 100
    assert r["outside"] == {"prompt_too_long": 6, "seq_too_long": 4, "requests": 10}
    assert r["batch_coverage"] == 1.0  # never two requests at once
    assert r["coverage"] == 0.9 and r["covers"] is False
    assert t.window_s == 991.0 and t.level_time == {0: 891.0, 1: 100.0}


def test_order_of_lines_does_not_matter():
    a = f.analyze(f.parse_jsonl(jsonl(bursts_sample(), seed=1)))
    b = f.analyze(f.parse_jsonl(jsonl(bursts_sample(), seed=2)))
    assert a == b


def test_batch_coverage_is_share_of_time():
    t = f.Traffic.of(f.parse_jsonl(jsonl(bursts_sample(), seed=3)))
    assert t.window_s == 31.0
    assert t.level_time == {10: 4.0, 0: 27.0}
    assert t.time_share_at_most(1) == 27 / 31
    assert t.time_share_at_most(9) == 27 / 31
    assert t.time_share_at_most(10) == 1.0
    by_name = {p["name"]: p for p in f.analyze(t.requests)["profiles"]}
    assert by_name["latency"]["batch_coverage"] == 27 / 31
    assert by_name["balanced"]["batch_coverage"] == 27 / 31
    assert by_name["throughput"]["batch_coverage"] == 1.0
    assert by_name["throughput"]["coverage"] == 1.0


def test_duration_model_prefill_plus_decode():
    model = f.ServiceModel(prefill_tps=100, decode_tps=10)
    reqs = [f.Request(100, 10, 0.0), f.Request(100, 10, 1.0)]  # each 100/100 + 10/10 = 2 s
    assert model.duration(reqs[0]) == 2.0
    t = f.Traffic.of(reqs, model)
    assert t.level_time == {1: 2.0, 2: 1.0} and t.window_s == 3.0
    assert t.time_share_at_most(1) == 2 / 3
    assert t.summary()["concurrency"] == {"mean": 4 / 3, "p50": 1, "p95": 2, "peak": 2}


def test_back_to_back_requests_do_not_overlap():
    t = f.Traffic.of([f.Request(0, 0, 0.0, 1.0), f.Request(0, 0, 1.0, 1.0)])
    assert t.level_time == {1: 2.0} and t.time_share_at_most(1) == 1.0


def test_idle_gaps_count_as_covered_time():
    t = f.Traffic.of([f.Request(0, 0, 0.0, 1.0), f.Request(0, 0, 0.0, 1.0), f.Request(0, 0, 9.0, 1.0)])
    assert t.level_time == {2: 1.0, 0: 8.0, 1: 1.0}
    assert t.time_share_at_most(1) == 9 / 10


def test_zero_length_requests_and_zero_window():
    t = f.Traffic.of([f.Request(0, 0, 5.0, 0.0)])
    assert t.window_s == 0.0 and t.time_share_at_most(1) == 1.0
    t = f.Traffic.of([f.Request(0, 0, 0.0, 0.0), f.Request(0, 0, 4.0, 0.0)])
    assert t.level_time == {0: 4.0} and t.time_share_at_most(1) == 1.0


def test_best_profile_is_the_cheapest_that_covers():
    reqs = f.parse_jsonl(jsonl(bursts_sample(), seed=4))
    assert f.analyze(reqs, threshold=0.95)["best_profile"] == "throughput"  # only batch 32 ≥ 10 covers 95 %
    assert f.analyze(reqs, threshold=0.85)["best_profile"] == "latency"  # 27/31 = 87.1 %: batch 1 is enough
    single = [f.Request(10, 10, float(i) * 10, 1.0) for i in range(20)]
    assert f.analyze(single)["best_profile"] == "latency"


def test_best_profile_when_none_covers_is_the_highest_coverage():
    long = [f.Request(1000, 10, float(i), 0.5) for i in range(9)] + [f.Request(10, 10, 100.0, 0.5)]
    report = f.analyze(long)
    assert all(p["coverage"] == 0.1 for p in report["profiles"])  # every profile: 1 of 10 fits
    assert report["best_profile"] == "latency"  # the cheapest on a tie


def test_engines_drift_below_threshold():
    reqs = f.parse_jsonl(jsonl(bursts_sample(), seed=5))
    engines = [{"digest": "sha256:" + "a" * 64, "tag": "fp8-cpu-latency",
                "profile": PROFILES["latency"].model_dump()},
               {"digest": "sha256:" + "b" * 64, "tag": "fp8-cpu-throughput",
                "profile": PROFILES["throughput"].model_dump()},
               {"digest": "sha256:" + "c" * 64, "tag": "odd", "profile": {"name": "custom"}}]
    report = f.analyze(reqs, engines=engines)
    rows = {e["digest"][7]: e for e in report["engines"]}
    assert rows["a"]["drifted"] is True and rows["a"]["coverage"] == 27 / 31 and rows["a"]["profile"] == "latency"
    assert rows["b"]["drifted"] is False and rows["b"]["coverage"] == 1.0
    assert rows["c"]["drifted"] is None and "max_batch_size" in rows["c"]["error"]
    assert report["drifted"] == ["sha256:" + "a" * 64]
    assert f.analyze(reqs, engines=engines[:1], threshold=0.85)["drifted"] == []


def test_suggested_envelope_reaches_the_threshold():
    reqs = f.parse_jsonl(jsonl(lengths_sample(), seed=6))
    t = f.Traffic.of(reqs)
    s = f.suggest(t, 0.95)
    totals = sorted(r.prompt_tokens + r.output_tokens for r in reqs)
    assert s["max_seq_len"] == totals[94]  # nearest rank: the 95th of 100
    assert s["max_batch_size"] == 1 and s["max_num_tokens"] == s["max_input_len"]
    assert f.fit(t, s)["length_coverage"] >= 0.95
    bursts = f.Traffic.of(f.parse_jsonl(jsonl(bursts_sample(), seed=6)))
    assert f.suggest(bursts, 0.95)["max_batch_size"] == 10
    assert f.suggest(bursts, 0.85)["max_batch_size"] == 1


def test_nearest_rank():
    assert f.nearest_rank([1, 2, 3, 4], 0.5) == 2
    assert f.nearest_rank([1, 2, 3, 4], 0.95) == 4
    assert f.nearest_rank([7], 0.01) == 7
    assert f.nearest_rank(list(range(1, 101)), 0.95) == 95


@pytest.mark.parametrize("line, field, words", [
    ('{"prompt_tokens": 1, "output_tokens": 2}', "traffic.arrival_s", "line 2 has no arrival_s"),
    ('{"prompt_tokens": -1, "output_tokens": 2, "arrival_s": 0}', "traffic.prompt_tokens", "line 2"),
    ('{"prompt_tokens": 1.5, "output_tokens": 2, "arrival_s": 0}', "traffic.prompt_tokens", "not a non-negative integer"),
    ('{"prompt_tokens": true, "output_tokens": 2, "arrival_s": 0}', "traffic.prompt_tokens", "line 2"),
    ('{"prompt_tokens": 1, "output_tokens": 2, "arrival_s": "soon"}', "traffic.arrival_s", "line 2"),
    ('{"prompt_tokens": 1, "output_tokens": 2, "arrival_s": 0, "duration_s": -1}', "traffic.duration_s", "line 2"),
    ("[1, 2]", "traffic", "line 2 is not a JSON object"),
    ("{nope", "traffic", "line 2 is not JSON"),
])
def test_bad_lines_are_named(line, field, words):
    good = '{"prompt_tokens": 1, "output_tokens": 2, "arrival_s": 0}'
    with pytest.raises(SpecError) as err:
        f.parse_jsonl([good, line])
    assert err.value.field == field and words in err.value.message


def test_empty_sample_and_blank_lines():
    with pytest.raises(SpecError, match="no requests"):
        f.parse_jsonl(["", "  "])
    assert len(f.parse_jsonl(["", '{"prompt_tokens": 1, "output_tokens": 2, "arrival_s": 0}', ""])) == 1
    with pytest.raises(SpecError) as err:
        f.parse_records([{"prompt_tokens": 1, "output_tokens": 2, "arrival_s": 0}, {"prompt_tokens": 1}])
    assert "request 1" in err.value.message


def test_threshold_and_service_model_checks():
    assert f.parse_threshold("95%") == 0.95 and f.parse_threshold("0.9") == 0.9
    for bad in ("0", "1.5", "abc", "150%"):
        with pytest.raises(SpecError) as err:
            f.parse_threshold(bad)
        assert err.value.field == "threshold"
    with pytest.raises(SpecError) as err:
        f.ServiceModel(prefill_tps=0)
    assert err.value.field == "prefill_tps"


def test_report_is_json_serialisable():
    report = f.analyze(f.parse_jsonl(jsonl(lengths_sample(), seed=8)))
    assert json.loads(json.dumps(report)) == report
    assert {p["name"] for p in report["profiles"]} == set(PROFILES)
    assert report["traffic"]["requests"] == 100 and report["traffic"]["prompt_tokens"]["max"] == 300

"""Decisions with confidence (validation/stats.py): three-way gate decisions, paired intervals that cover the truth
as often as they claim, detectable effects, sequential looks."""

from __future__ import annotations

import math

import numpy as np
from statistics import NormalDist

import pytest

from validation import stats
from validation.stats import FAIL, PASS, UNDECIDED, Interval, decide


class TestDecide:
    @pytest.mark.parametrize("low,high,expected", [(1.0, 2.5, PASS), (3.1, 4.0, FAIL), (2.0, 3.5, UNDECIDED),
                                                   (1.0, 3.0, PASS), (3.0, 4.0, UNDECIDED)])
    def test_a_max_gate_passes_only_when_the_whole_interval_is_at_or_below_it(self, low, high, expected):
        assert decide("max_ppl_increase_pct", Interval((low + high) / 2, low, high, 0.95), (low + high) / 2, 3.0) == expected

    @pytest.mark.parametrize("low,high,expected", [(0.9, 0.95, PASS), (0.7, 0.84, FAIL), (0.8, 0.9, UNDECIDED)])
    def test_a_min_gate_is_the_mirror_image(self, low, high, expected):
        assert decide("min_top1_agreement", Interval((low + high) / 2, low, high, 0.95), (low + high) / 2, 0.85) == expected

    def test_without_an_interval_the_value_decides_and_nan_never_passes(self):
        assert decide("min_throughput_tps", None, 5.0, 1.0) == PASS
        assert decide("min_throughput_tps", None, 0.5, 1.0) == FAIL
        assert decide("max_mean_kl", None, math.nan, 1.0) == FAIL
        assert decide("max_mean_kl", Interval(math.inf, 1.0, math.inf, 0.95), math.inf, 0.05) == FAIL


def _windows(rng, n: int, shift: float, spread: float = 0.3, seq: int = 128) -> dict[str, np.ndarray]:
    """Per-window sums whose true per-token NLL difference is ``shift`` (so the true increase is e^shift − 1)."""
    base = rng.normal(3.2, 0.6, n) * seq  # windows differ a lot from one another ...
    diff = rng.normal(shift, spread / math.sqrt(seq), n) * seq  # ... their engine − reference difference less
    return {"nll_reference": base, "nll_engine": base + diff, "kl": np.abs(rng.normal(0.04, 0.01, n)) * seq,
            "agree": rng.binomial(seq, 0.9, n).astype(float), "tokens": np.full(n, float(seq))}


class TestWindowIntervals:
    def test_the_point_values_are_the_ratio_statistics_over_all_windows(self):
        w = _windows(np.random.default_rng(1), 40, 0.02)
        iv = stats.window_intervals(w, 0.95, samples=500)
        tokens = w["tokens"].sum()
        assert iv["ppl_increase_pct"].value == pytest.approx(
            (math.exp((w["nll_engine"].sum() - w["nll_reference"].sum()) / tokens) - 1) * 100)
        assert iv["mean_kl"].value == pytest.approx(w["kl"].sum() / tokens)
        assert iv["top1_agreement"].value == pytest.approx(w["agree"].sum() / tokens)
        for i in iv.values():
            assert i.low <= i.value <= i.high

    def test_each_end_is_a_95_percent_one_sided_bound(self):
        # a wrong decision crosses one end only: the upper bound must lie above the truth (and the lower below it)
        # in about 95 % of evaluations each — not 97.5 %, which would hold the gate to half its stated error
        rng = np.random.default_rng(7)
        truth = (math.exp(0.02) - 1) * 100
        above = below = 0
        for i in range(300):
            iv = stats.window_intervals(_windows(rng, 48, 0.02), 0.95, samples=600, seed=i)["ppl_increase_pct"]
            above += iv.high >= truth
            below += iv.low <= truth
        # (seeded: 0.953 and 0.950 here; two-sided 95 % intervals gave 0.973 and 0.967)
        assert 0.93 <= above / 300 <= 0.965 and 0.93 <= below / 300 <= 0.965

    def test_more_windows_narrow_the_interval(self):
        rng = np.random.default_rng(3)
        few = stats.window_intervals(_windows(rng, 16, 0.02), 0.95, samples=800)["ppl_increase_pct"]
        many = stats.window_intervals(_windows(rng, 256, 0.02), 0.95, samples=800)["ppl_increase_pct"]
        assert (many.high - many.low) < 0.5 * (few.high - few.low)


class TestDetectableEffect:
    def test_the_paired_mde_follows_the_spread_of_the_differences_and_pairing_needs_fewer_windows(self):
        w = _windows(np.random.default_rng(5), 64, 0.0)
        mde = stats.window_mde(w)
        d = (w["nll_engine"] - w["nll_reference"]) / w["tokens"]
        k = stats.z(0.95) + stats.z(0.8)  # one-sided, as TensorRT-LLM's compute_theta
        assert mde["ppl_increase_pct"]["paired"] == pytest.approx((math.exp(k * d.std(ddof=1) / 8) - 1) * 100)
        # windows differ far more from each other than engine from reference on the same window
        assert mde["ppl_increase_pct"]["unpaired_windows_needed"] > 20 * 64


class TestPairedAccuracy:
    def test_the_drop_counts_only_the_items_on_which_the_two_disagree(self):
        ref = [True] * 60 + [False] * 40
        eng = [True] * 55 + [False] * 5 + [True] * 1 + [False] * 39  # 5 lost, 1 gained
        out = stats.paired_accuracy(eng, ref, 0.95)
        assert out["drop_pts"] == pytest.approx(4.0)
        assert out["reference_only_correct"] == 5 and out["engine_only_correct"] == 1
        assert out["engine_accuracy"] == pytest.approx(0.56) and out["reference_accuracy"] == pytest.approx(0.60)
        assert out["interval"].low < 4.0 < out["interval"].high

    def test_ten_agreeing_items_decide_nothing_but_a_thousand_do(self):
        few = stats.paired_accuracy([True] * 10, [True] * 10, 0.95)["interval"]
        many = stats.paired_accuracy([True] * 1000, [True] * 1000, 0.95)["interval"]
        assert decide("max_task_accuracy_drop_pts", few, 0.0, 3.0) == UNDECIDED
        assert decide("max_task_accuracy_drop_pts", many, 0.0, 3.0) == PASS

    def test_a_clear_loss_fails_the_gate(self):
        ref = [True] * 400
        eng = [True] * 340 + [False] * 60  # 15 points lost
        iv = stats.paired_accuracy(eng, ref, 0.95)["interval"]
        assert decide("max_task_accuracy_drop_pts", iv, 15.0, 3.0) == FAIL

    def test_pairing_needs_fewer_items_than_an_unpaired_test(self):
        ref = [True] * 70 + [False] * 30
        eng = ref[:]
        eng[0] = False
        out = stats.paired_accuracy(eng, ref, 0.95)
        assert out["unpaired_items_needed"] > 5 * out["items"]

    def test_each_end_of_the_task_interval_is_a_95_percent_one_sided_bound(self):
        """400 paired items, a true drop of 3.3 points (the engine loses 6 % of the reference's right answers and
        gains 3 % of its wrong ones): each end misses the truth about 5 % of the time, not 2.5 %."""
        rng = np.random.default_rng(11)
        above = below = 0
        for _ in range(600):
            ref = rng.random(400) < 0.7
            flip = rng.random(400)
            eng = ref.copy()
            eng[(flip < 0.06) & ref] = False
            eng[(flip > 0.97) & ~ref] = True
            iv = stats.paired_accuracy(eng.tolist(), ref.tolist(), 0.95)["interval"]
            above += iv.high >= 3.3
            below += iv.low <= 3.3
        # (seeded: 0.928 and 0.960 here; the two-sided intervals gave 0.963 and 0.985)
        assert 0.925 <= (above + below) / 1200 <= 0.962

    def test_outcomes_must_pair(self):
        with pytest.raises(ValueError):
            stats.paired_accuracy([True], [True, False], 0.95)


class TestLooks:
    def test_looks_start_at_the_floor_and_end_with_everything(self):
        assert stats.looks(128, floor=32, step=16) == [32, 48, 64, 80, 96, 112, 128]
        assert stats.looks(10, floor=32, step=16) == [10]

    def test_one_look_is_the_plain_confidence(self):
        assert stats.look_confidence([128]) == pytest.approx(0.95)

    def test_equally_spaced_looks_get_pococks_published_one_sided_boundary(self):
        # Pocock's two-sided alpha 0.10 constants (Jennison & Turnbull 2000, table 2.1: 1.875, 2.122, 2.289 for 2, 5
        # and 10 looks), which the one-sided alpha 0.05 ones nearly equal: the two-sided boundary also counts the
        # rare paths that cross on both sides, so it sits a little higher the more looks there are
        for k, c in ((2, 1.875), (5, 2.122), (10, 2.289)):
            confidence = stats.look_confidence(list(range(1, k + 1)))
            assert c - 0.025 < NormalDist().inv_cdf(confidence) < c + 0.01

    def test_the_boundary_keeps_alpha_over_all_looks_and_costs_less_than_bonferroni(self):
        planned = [16, 35, 54, 73, 92, 111, 128]  # plan_looks(128, 16)
        confidence = stats.look_confidence(planned)
        assert 1 - 0.05 / len(planned) > confidence > 0.95
        # an independent simulation (another seed) of an engine exactly at the threshold: how often does any look
        # decide it wrongly (its bound crosses the threshold on the side away from the truth)?
        rng = np.random.default_rng(12345)
        t = np.asarray(planned) / planned[-1]
        paths = np.cumsum(rng.standard_normal((100_000, len(t))) * np.sqrt(np.diff(t, prepend=0.0)), axis=1)
        c = NormalDist().inv_cdf(confidence)
        # 0.0498 here (100,000 paths: ±0.0007); the two-sided |Z| boundary gave 0.0464 — it over-paid
        assert (paths / np.sqrt(t) > c).any(axis=1).mean() == pytest.approx(0.05, abs=0.002)
        assert stats.look_confidence(planned) == confidence  # seeded: every build of a plan gets the same number

    def test_a_fail_or_all_passes_settle_the_verdict(self):
        assert stats.settled([PASS, PASS]) and stats.settled([UNDECIDED, FAIL])
        assert not stats.settled([PASS, UNDECIDED])

    def test_the_order_is_random_but_fixed(self):
        assert stats.fixed_order(50) == stats.fixed_order(50) and sorted(stats.fixed_order(50)) == list(range(50))
        assert stats.fixed_order(50) != list(range(50))

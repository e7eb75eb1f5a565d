"""measure: evaluation windows, the batch × sequence points of the envelope, throughput records."""

from __future__ import annotations

import pytest
import torch

from kiln.spec import PROFILES, BatchProfile
from validation.measure import batch_points, conditions, seq_points, throughput, windows


def prof(batch=8, inp=256, seq=512, tokens=4096):
    return BatchProfile(max_batch_size=batch, max_input_len=inp, max_seq_len=seq, max_num_tokens=tokens)


@pytest.mark.parametrize("n, seq_len, count", [(9, 4, 2), (8, 4, 1), (5, 4, 1), (101, 10, 10), (100, 10, 9)])
def test_windows_count(n, seq_len, count):
    w = windows(torch.arange(n), seq_len)
    assert w.shape == (count, seq_len + 1)


def test_windows_are_consecutive_and_share_only_the_boundary_token():
    w = windows(torch.arange(13), 4)
    assert w.tolist() == [[0, 1, 2, 3, 4], [4, 5, 6, 7, 8], [8, 9, 10, 11, 12]]
    inputs, targets = w[:, :-1], w[:, 1:]
    assert inputs.flatten().tolist() == list(range(12))  # every input token once
    assert targets.flatten().tolist() == list(range(1, 13))  # every target token once


def test_windows_too_short_for_one_window():
    with pytest.raises(RuntimeError):
        windows(torch.arange(4), 4)


@pytest.mark.parametrize("max_batch, points", [(1, [1]), (2, [1, 2]), (3, [1, 2, 3]), (4, [1, 2, 4]), (8, [1, 2, 4, 8]),
                                               (32, [1, 2, 16, 32]), (4096, [1, 2, 2048, 4096])])
def test_batch_points(max_batch, points):
    assert batch_points(max_batch) == points


@pytest.mark.parametrize("max_batch", range(1, 70))
def test_batch_points_properties(max_batch):
    pts = batch_points(max_batch)
    assert pts == sorted(set(pts)) and pts[0] == 1 and pts[-1] == max_batch
    assert len(pts) >= min(3, max_batch)


@pytest.mark.parametrize("inp, points", [(256, [64, 128, 256]), (1, [1]), (2, [1, 2]), (3, [1, 3]), (7, [1, 3, 7])])
def test_seq_points(inp, points):
    assert seq_points(prof(inp=inp, seq=max(inp, 2))) == points


def test_seq_points_of_the_named_profiles_stay_inside_the_input_length():
    for p in PROFILES.values():
        pts = seq_points(p)
        assert pts[-1] == p.max_input_len and all(1 <= s <= p.max_input_len for s in pts)


class CountingEngine:
    """A real (trivial) engine: an embedding lookup, so throughput has something to time."""

    device = "cpu"
    kv_cache = False

    def __init__(self, vocab=16):
        self.table = torch.randn(vocab, vocab)
        self.shapes: list[tuple[int, int]] = []

    def logits(self, input_ids):
        self.shapes.append(tuple(input_ids.shape))
        return self.table[input_ids]


def test_throughput_measures_every_point_of_the_envelope():
    engine = CountingEngine()
    p = prof(batch=4, inp=8, seq=16, tokens=64)
    out = throughput(engine, p, vocab=16, warmup=1, reps=3)
    points = [(r["batch_size"], r["seq_len"]) for r in out]
    assert points == [(1, 8), (2, 8), (4, 8), (1, 2), (1, 4)]
    assert engine.shapes == [pt for pt in points for _ in range(4)]  # 1 warmup + 3 timed each
    for r in out:
        assert r["tokens_per_s"] == pytest.approx(r["batch_size"] * r["seq_len"] / r["seconds_median"])
        assert r["seconds_spread"] >= 0 and r["reps"] == 3 and r["warmup"] == 1


def test_throughput_inputs_are_valid_token_ids_and_seeded():
    seen = []

    class Recorder(CountingEngine):
        def logits(self, input_ids):
            seen.append(input_ids.clone())
            return super().logits(input_ids)

    throughput(Recorder(vocab=5), prof(batch=2, inp=4, seq=4, tokens=8), vocab=5, reps=1, warmup=0)
    first = [t.clone() for t in seen]
    seen.clear()
    throughput(Recorder(vocab=5), prof(batch=2, inp=4, seq=4, tokens=8), vocab=5, reps=1, warmup=0)
    assert all(torch.equal(a, b) for a, b in zip(first, seen))
    assert all(int(t.max()) < 5 and int(t.min()) >= 0 and t.dtype == torch.long for t in seen)


def test_conditions_describe_the_engine():
    c = conditions(CountingEngine())
    assert c["device"] == "cpu" and c["kv_cache"] is False
    assert c["threads"] == torch.get_num_threads() and c["torch"] == torch.__version__

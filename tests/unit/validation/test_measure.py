"""measure: evaluation windows, the batch × sequence points of the envelope, throughput records."""

from __future__ import annotations

import os
import time

import pytest
import torch

from kiln.spec import PROFILES, BatchProfile
from validation.measure import conditions, throughput, windows
from validation.points import batch_points, seq_points


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


@pytest.mark.parametrize("inp, seq, points", [(256, 256, [64, 128, 256]), (256, 512, [64, 128, 256, 512]),
                                               (1, 2, [1, 2]), (2, 2, [1, 2]), (3, 3, [1, 3]), (7, 9, [1, 3, 7, 9])])
def test_seq_points(inp, seq, points):
    assert seq_points(prof(inp=inp, seq=seq)) == points


def test_seq_points_of_the_named_profiles_reach_the_longest_sequence():
    for p in PROFILES.values():
        pts = seq_points(p)
        assert p.max_input_len in pts and pts[-1] == p.max_seq_len and all(1 <= s <= p.max_seq_len for s in pts)


class CountingEngine:
    """A real (trivial) engine: an embedding lookup, so throughput has something to time."""

    device = "cpu"
    kv_cache = False

    def __init__(self, vocab=16):
        self.table = torch.randn(vocab, vocab)
        self.shapes: list[tuple[int, int]] = []

    def prefill(self, input_ids):
        self.shapes.append(tuple(input_ids.shape))
        return self.table[input_ids]

    def logits(self, input_ids):
        return self.prefill(input_ids)


def test_throughput_measures_every_point_of_the_envelope():
    engine = CountingEngine()
    p = prof(batch=4, inp=8, seq=16, tokens=64)
    out = throughput(engine, p, vocab=16, warmup=1, reps=3)
    points = [(r["batch_size"], r["seq_len"]) for r in out]
    assert points == [(1, 8), (2, 8), (4, 8), (1, 2), (1, 4), (1, 16)]
    assert engine.shapes == [pt for pt in points for _ in range(4)]  # 1 warmup + 3 timed each
    for r in out:
        assert r["tokens_per_s"] == pytest.approx(r["batch_size"] * r["seq_len"] / r["seconds_median"])
        assert r["seconds_spread"] >= 0 and r["reps"] == 3 and r["warmup"] == 1


def test_throughput_inputs_are_valid_token_ids_and_seeded():
    seen = []

    class Recorder(CountingEngine):
        def prefill(self, input_ids):
            seen.append(input_ids.clone())
            return super().prefill(input_ids)

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


def _matmuls(seconds: float) -> None:
    x, w = torch.randn(128, 256), torch.randn(256, 256)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        x @ w


def test_cpu_wait_sees_processes_competing_for_the_cores():
    """More busy processes than cores beside a measurement: its threads must wait for a CPU, and cpu_wait says
    so (over the regression gate's threshold); the figure is a share of the runnable time."""
    import subprocess
    import sys

    from validation.gates import CPU_WAIT_BUSY_PCT
    from validation.measure import cpu_wait

    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range((os.cpu_count() or 1) + 1)]
    try:
        time.sleep(0.3)
        with cpu_wait() as busy:
            _matmuls(1.5)
    finally:
        for b in burners:
            b.kill()
            b.wait()
    assert CPU_WAIT_BUSY_PCT <= busy["cpu_wait_pct"] <= 100.0, busy


# -- generation latency and peak memory, on the shipped tiny Llama -----------------------------------
from pathlib import Path  # noqa: E402

from validation.measure import decode_latency, decode_shape, greedy_decode, peak_memory  # noqa: E402

TINY = Path(__file__).resolve().parents[3] / "examples" / "tiny-llama"


@pytest.mark.parametrize("inp, seq, shape", [(256, 512, (256, 16)), (512, 512, (496, 16)), (8, 10, (1, 9)),
                                             (1, 2, (1, 1)), (100, 116, (100, 16))])
def test_decode_shape_keeps_prompt_plus_new_tokens_inside_max_seq_len(inp, seq, shape):
    assert decode_shape(prof(batch=1, inp=inp, seq=seq, tokens=seq)) == shape
    prompt, new = shape
    assert prompt + new <= seq and prompt <= inp


def test_greedy_decode_generates_what_transformers_generate_does():
    from validation.runners import TransformersRunner

    runner = TransformersRunner(TINY)
    prompt = torch.randint(0, 2048, (2, 12), generator=torch.Generator().manual_seed(3))
    steps, generated = greedy_decode(runner, prompt, 6)
    expected = runner._model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6,
                                      do_sample=False, min_new_tokens=6, pad_token_id=0)[:, 12:]
    assert torch.equal(generated, expected) and len(steps) == 6 and all(s > 0 for s in steps)


def test_decode_latency_of_the_tiny_model_at_batch_1_and_the_maximum_batch():
    from validation.runners import CheckpointRunner

    engine = CheckpointRunner(TINY)
    out = decode_latency(engine, prof(batch=3, inp=32, seq=40, tokens=96), vocab=2048, new_tokens=8, reps=2)
    assert [p["batch_size"] for p in out["points"]] == [1, 3]
    for p in out["points"]:
        assert p["prompt_len"] == 32 and p["new_tokens"] == 8 and p["reps"] == 2
        assert p["ttft_ms"] > 0 and p["tpot_ms"] > 0 and p["tpot_spread_ms"] >= 0
        assert p["decode_tokens_per_s"] == pytest.approx(p["batch_size"] / (p["tpot_ms"] / 1e3))
    assert out["ttft_ms"] == out["points"][0]["ttft_ms"] and out["tpot_ms"] == out["points"][0]["tpot_ms"]
    c = out["conditions"]
    assert c["kv_cache"] is True and "KV cache" in c["method"] and c["new_tokens"] == 8 and "tpot" not in c


def test_the_kv_cache_decode_generates_what_the_full_forward_decode_does_and_each_step_is_one_token():
    from validation.runners import CheckpointRunner

    engine = CheckpointRunner(TINY)
    prompt = torch.randint(0, 2048, (2, 40), generator=torch.Generator().manual_seed(5))
    _, full = greedy_decode(engine, prompt, 8)
    steps, cached = engine.decode(prompt, 8)
    assert torch.equal(cached, full) and len(steps) == 8
    seen = []
    handle = engine.built.model.model.embed_tokens.register_forward_hook(lambda m, a, o: seen.append(a[0].shape[1]))
    try:
        engine.decode(prompt, 4)
    finally:
        handle.remove()
    assert seen == [40, 1, 1, 1]  # the prefill, then one new token per step: a KV cache, not a re-run


def test_an_engine_without_a_kv_cache_reports_ttft_and_no_tpot():
    from validation.runners import CheckpointRunner

    class NoCache:  # the aot-inductor runner's shape: a forward and logits, no decode
        device, kv_cache = "cpu", False

        def __init__(self):
            self._inner = CheckpointRunner(TINY)

        def prefill(self, ids):
            return self._inner.prefill(ids)

        def logits(self, ids):
            return self._inner.logits(ids)

    out = decode_latency(NoCache(), prof(batch=2, inp=32, seq=40, tokens=80), vocab=2048, new_tokens=8, reps=2)
    assert all(p["ttft_ms"] > 0 and p["tpot_ms"] is None and p["decode_tokens_per_s"] is None for p in out["points"])
    assert out["tpot_ms"] is None and out["conditions"]["kv_cache"] is False
    assert out["conditions"]["tpot"].startswith("not measured")


def test_peak_memory_in_a_fresh_process_counts_weights_and_grows_with_the_corner(fp8_export):
    from validation.runners import CheckpointRunner

    engine = CheckpointRunner(fp8_export / "hf")
    source = ("checkpoint", fp8_export / "hf")
    small = peak_memory(engine, prof(batch=1, inp=64, seq=64, tokens=64), 2048, source=source)
    big = peak_memory(engine, prof(batch=8, inp=256, seq=512, tokens=4096), 2048, source=source)
    assert small["conditions"]["corner"] == {"batch_size": 1, "seq_len": 64}
    assert small["conditions"]["engine_loaded_bytes"] > 4e6  # 1.4 M parameters dequantized to fp32
    assert small["peak_memory_bytes"] > 4e6
    # the corner's logits alone are 8 × 512 × 2048 float32 = 32 MiB more than at 1 × 64
    assert big["peak_memory_bytes"] - small["peak_memory_bytes"] > 8 * 512 * 2048 * 4 * 0.9
    assert big["conditions"]["process_peak_bytes"] > big["peak_memory_bytes"]  # the runtime is reported, not gated


def test_a_probe_the_kernel_kills_is_an_envelope_that_does_not_fit(monkeypatch, tmp_path):
    import signal
    import subprocess

    from kiln.errors import StageFailed

    def killed(*a, **kw):
        return subprocess.CompletedProcess(a[0], -signal.SIGKILL, "", "")

    monkeypatch.setattr(subprocess, "run", killed)
    out = peak_memory(CountingEngine(), prof(), 16, source=("checkpoint", tmp_path))
    assert out["peak_memory_bytes"] == float("inf") and "SIGKILL" in out["conditions"]["method"]

    monkeypatch.setattr(subprocess, "run", lambda *a, **kw: subprocess.CompletedProcess(a[0], 1, "", "Boom: no\n"))
    with pytest.raises(StageFailed, match="Boom: no"):
        peak_memory(CountingEngine(), prof(), 16, source=("checkpoint", tmp_path))


class AllocatingEngine(CountingEngine):
    """Its forward holds ``extra`` bytes (written, so resident) and frees them before returning."""

    def __init__(self, extra: int):
        super().__init__()
        self.extra = extra

    def prefill(self, input_ids):
        held = torch.ones(self.extra // 4, dtype=torch.float32)
        out = super().prefill(input_ids) + float(held[-1]) * 0
        del held
        return out


def test_peak_memory_in_process_without_a_source():
    extra = 256 * 2**20
    engine = AllocatingEngine(extra)
    out = peak_memory(engine, prof(batch=2, inp=4, seq=8, tokens=16), 16)
    c = out["conditions"]
    assert "in-process" in c["method"] and c["corner"] == {"batch_size": 2, "seq_len": 8}
    assert engine.shapes == [(2, 8)]  # one forward, at the corner
    assert out["peak_memory_bytes"] == c["process_peak_bytes"]
    if c["hwm_reset"]:  # the peak is the forward's: what the process held before plus what the forward held
        assert out["peak_memory_bytes"] >= c["rss_before_bytes"] + 0.9 * extra
        assert out["peak_memory_bytes"] < c["rss_before_bytes"] + 2 * extra
    else:
        assert out["peak_memory_bytes"] >= 0.9 * extra

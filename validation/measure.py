"""Measurements of a loaded artifact: accuracy against the unquantized reference and speed across the batch
profile's envelope. Each figure carries the conditions that produced it (device, threads, warm-up,
repetitions, spread).

- :func:`accuracy` (validation/accuracy.py): perplexity increase, top-1 agreement and KL against the
  reference, with paired intervals, evaluated sequentially.
- :func:`throughput`: forward (prefill) tokens/s at ≥ 3 batch sizes up to ``max_batch_size`` (at
  ``max_input_len``) and at sequence lengths up to ``max_seq_len`` (at batch 1).
- :func:`decode_latency`: TTFT (time to the first token: the prefill of a ``max_input_len`` prompt) and TPOT
  (mean time per later token) at batch 1 and at the maximum batch. TPOT only where the runner decodes with a KV
  cache (``decode``: the checkpoint runner through transformers' cache); an engine without one (aot-inductor)
  reports TPOT as not measured.
- :func:`peak_memory`: memory of one forward at the envelope's corner (``max_batch_size × max_seq_len``).
  On CPU, in a fresh child process: the peak resident set (Linux ``VmHWM``, reset through
  ``/proc/self/clear_refs`` between phases) while the engine loads and runs the corner, minus the resident set
  of the runtime alone (interpreter, torch and the runner code imported, before the engine loads). On CUDA,
  ``torch.cuda.max_memory_allocated`` around the corner forward (weights + activations held by torch).
"""

from __future__ import annotations

import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
from kiln.errors import StageFailed
from kiln.progress import report
from kiln.spec import BatchProfile
from validation.points import envelope_points
from validation.accuracy import accuracy, windows  # noqa: F401  (re-exported: callers import them from here)

DECODE_NEW_TOKENS = 16
NO_KV_CACHE_NOTE = ("not measured: this engine has no KV cache, so every generated token would re-run the whole "
                    "sequence so far — a figure no runtime with a KV cache would show")


# -- throughput ------------------------------------------------------------------------------------
def _timed(engine, x: torch.Tensor, warmup: int, reps: int) -> list[float]:
    for _ in range(warmup):
        engine.prefill(x)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        engine.prefill(x)
        times.append(time.perf_counter() - t)
    return times


def throughput_point(engine, batch: int, seq: int, vocab: int, *, warmup: int = 1, reps: int = 3,
                     seed: int = 0) -> dict:
    """Forward tokens/s of one (batch, sequence) point: median of ``reps`` timed runs after ``warmup``."""
    x = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))
    times = _timed(engine, x, warmup, reps)
    med, best = statistics.median(times), min(times)
    return {"batch_size": batch, "seq_len": seq, "tokens_per_s": batch * seq / med,
            "tokens_per_s_best": batch * seq / best, "seconds_median": med, "seconds_best": best,
            "seconds_spread": max(times) - min(times), "reps": reps, "warmup": warmup}


def throughput(engine, profile: BatchProfile, vocab: int, *, warmup: int = 1, reps: int = 3, seed: int = 0) -> list[dict]:
    """Forward (prefill) tokens/s at every point of :func:`envelope_points`. ``tokens_per_s`` is from the
    median run, ``tokens_per_s_best`` from the fastest (interference from other processes only ever slows a
    run down, so the fastest is the most reproducible figure; the regression gate compares it)."""
    gen = torch.Generator().manual_seed(seed)
    out, points = [], envelope_points(profile)
    for k, (b, s) in enumerate(points, 1):
        report("throughput point", k, len(points))
        point_seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
        out.append(throughput_point(engine, b, s, vocab, warmup=warmup, reps=reps, seed=point_seed))
    return out


# -- generation latency ----------------------------------------------------------------------------
def decode_shape(profile: BatchProfile, new_tokens: int = DECODE_NEW_TOKENS) -> tuple[int, int]:
    """(prompt length, new tokens): the prompt is ``max_input_len`` unless prompt + new tokens would pass
    ``max_seq_len``; then the prompt is shortened (never below 1 token)."""
    new = max(1, min(new_tokens, profile.max_seq_len - 1))
    return max(1, min(profile.max_input_len, profile.max_seq_len - new)), new


def greedy_decode(engine, prompt: torch.Tensor, new_tokens: int) -> tuple[list[float], torch.Tensor]:
    """Generate ``new_tokens`` greedily, one full forward per token (no KV cache). Returns the seconds of each
    step (step 0 is the prefill, ending with the first token) and the generated ids [batch, new_tokens]."""
    seq, steps, generated = prompt, [], []
    for _ in range(new_tokens):
        t = time.perf_counter()
        logits = engine.prefill(seq)
        nxt = logits[:, -1].argmax(-1, keepdim=True).cpu()
        steps.append(time.perf_counter() - t)
        generated.append(nxt)
        seq = torch.cat([seq, nxt.to(seq.dtype)], 1)
    return steps, torch.cat(generated, 1)


def decode_latency(engine, profile: BatchProfile, vocab: int, *, new_tokens: int = DECODE_NEW_TOKENS,
                   warmup: int = 1, reps: int = 2, seed: int = 0) -> dict:
    """TTFT and TPOT at batch 1 and at the maximum batch (medians over ``reps``, after ``warmup``), as a runtime
    serves them: a runner with a KV cache (``engine.decode``) generates ``new_tokens`` greedily, each step after the
    prefill processing one new token; a runner without one is timed for its prefill (TTFT) only, and its TPOT is
    "not measured" — a cache-less per-token figure is no runtime's. ``ttft_ms`` / ``tpot_ms`` are the batch-1
    figures (what one user waits); ``points`` has each batch size's."""
    prompt_len, new = decode_shape(profile, new_tokens)
    cached = callable(getattr(engine, "decode", None))
    gen = torch.Generator().manual_seed(seed)
    points, batches = [], sorted({1, profile.max_batch_size})
    for k, b in enumerate(batches, 1):
        report("decode latency batch size", k, len(batches))
        prompt = torch.randint(0, vocab, (b, prompt_len), generator=gen)
        for _ in range(warmup):
            engine.decode(prompt, 2) if cached else engine.prefill(prompt)
        ttfts, tpots = [], []
        for _ in range(reps):
            steps, _ = engine.decode(prompt, new) if cached else greedy_decode(engine, prompt, 1)
            ttfts.append(steps[0])
            if len(steps) > 1:
                tpots.append(statistics.fmean(steps[1:]))
        tpot = statistics.median(tpots) if tpots else None
        points.append({
            "batch_size": b, "prompt_len": prompt_len, "new_tokens": new if cached else 1,
            "ttft_ms": statistics.median(ttfts) * 1e3, "ttft_spread_ms": (max(ttfts) - min(ttfts)) * 1e3,
            "tpot_ms": tpot * 1e3 if tpot is not None else None,
            "tpot_spread_ms": (max(tpots) - min(tpots)) * 1e3 if tpots else None,
            "decode_tokens_per_s": b / tpot if tpot else None, "reps": reps, "warmup": warmup,
        })
    first = points[0]
    method = ("greedy decoding with the runner's KV cache: the prefill, then one new token per step" if cached
              else "the prefill alone (one forward of the prompt): TTFT")
    return {"ttft_ms": first["ttft_ms"], "tpot_ms": first["tpot_ms"], "points": points,
            "conditions": {"method": method, "kv_cache": cached, "prompt_len": prompt_len,
                           "new_tokens": new if cached else 1, "warmup": warmup, "reps": reps,
                           "statistic": "median over reps", **({} if cached else {"tpot": NO_KV_CACHE_NOTE})}}


# -- peak memory -----------------------------------------------------------------------------------
def _proc_status() -> dict[str, int]:
    """VmRSS / VmHWM of this process in bytes (Linux)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, value = line.split(":", 1)
                out[key] = int(value.split()[0]) * 1024
    return out


def _reset_peak_rss() -> bool:
    """Reset this process's VmHWM to its current RSS (Linux ≥ 4.0); False where that is not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _corner_input(profile: BatchProfile, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (profile.max_batch_size, profile.max_seq_len),
                         generator=torch.Generator().manual_seed(seed))


def _corner_conditions(profile: BatchProfile) -> dict:
    return {"batch_size": profile.max_batch_size, "seq_len": profile.max_seq_len}


def peak_memory(engine, profile: BatchProfile, vocab: int, *, source: tuple[str, Path] | None = None,
                seed: int = 0, timeout_s: float = 1800) -> dict:
    """Peak memory of one forward at the envelope's corner; ``source`` = (backend, engine_dir) lets the CPU
    measurement load the engine afresh in a child process (the honest figure: weights + activations, nothing
    left over from earlier work). Without it the CPU figure is this whole process's peak RSS during the corner
    forward: an upper bound (the method says so)."""
    corner = _corner_conditions(profile)
    report("peak memory at the profile's corner")
    if str(engine.device).startswith("cuda"):
        return _cuda_peak(engine, profile, vocab, seed, corner)
    if source is not None:
        return _child_peak(source, profile, vocab, seed, corner, timeout_s)
    hwm_reset = _reset_peak_rss()
    before = _proc_status()
    with torch.no_grad():
        engine.prefill(_corner_input(profile, vocab, seed))
    after = _proc_status()
    return {"peak_memory_bytes": after["VmHWM"],
            "conditions": {"method": "in-process: this whole process's peak RSS (VmHWM) during one forward at the "
                                     "corner: an upper bound (it includes the runtime and whatever else the process "
                                     "holds)", "device": "cpu", "corner": corner, "hwm_reset": hwm_reset,
                           "rss_before_bytes": before["VmRSS"], "process_peak_bytes": after["VmHWM"]}}


def _cuda_peak(engine, profile, vocab, seed, corner) -> dict:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with torch.no_grad():
        engine.prefill(_corner_input(profile, vocab, seed))
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return {"peak_memory_bytes": int(torch.cuda.max_memory_allocated()),
            "conditions": {"method": "torch.cuda.max_memory_allocated around one forward at the corner "
                                     "(weights and activations allocated through torch)",
                           "device": str(engine.device), "corner": corner, "allocated_before_bytes": int(before),
                           "device_used_bytes": int(total - free), "device_total_bytes": int(total)}}


def _child_peak(source, profile, vocab, seed, corner, timeout_s) -> dict:
    backend, engine_dir = source
    job = {"backend": backend, "engine_dir": str(engine_dir), "batch": profile.max_batch_size,
           "seq": profile.max_seq_len, "vocab": vocab, "seed": seed, "threads": torch.get_num_threads()}
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "TRANSFORMERS_VERBOSITY": "error"}
    try:
        proc = subprocess.run([sys.executable, "-m", "validation.measure", "--memory-probe", json.dumps(job)],
                              capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        raise StageFailed(f"the peak-memory probe at the corner {corner} ran longer than {timeout_s:.0f}s") from None
    if proc.returncode < 0 and -proc.returncode == signal.SIGKILL:  # the kernel's OOM killer, most likely
        return {"peak_memory_bytes": math.inf,
                "conditions": {"method": "child process killed by SIGKILL while loading or running the corner "
                                         "(out of memory?): the envelope does not fit", "device": "cpu",
                               "corner": corner}}
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise StageFailed(f"the peak-memory probe failed (exit {proc.returncode}): {tail}")
    probe = json.loads(proc.stdout.strip().splitlines()[-1])
    peak = max(probe["load_peak_bytes"], probe["forward_peak_bytes"])
    return {"peak_memory_bytes": max(0, peak - probe["runtime_bytes"]),
            "conditions": {"method": "fresh child process: peak RSS (VmHWM) while loading the engine and running "
                                     "one forward at the corner, minus the RSS of the runtime alone",
                           "device": "cpu", "corner": corner, "threads": probe["threads"],
                           "runtime_bytes": probe["runtime_bytes"], "engine_loaded_bytes": probe["loaded_bytes"] - probe["runtime_bytes"],
                           "load_peak_bytes": probe["load_peak_bytes"], "forward_peak_bytes": probe["forward_peak_bytes"],
                           "process_peak_bytes": peak, "hwm_reset": probe["hwm_reset"]}}


def _memory_probe(job: dict) -> dict:
    """Runs in the child: import the runtime, reset the peak, load the engine, reset, run the corner."""
    import importlib

    torch.set_num_threads(int(job["threads"]))
    for module in ("torch._inductor", "kiln.hfmodel", "kiln.quantformat"):  # the runtime's code, not the engine:
        importlib.import_module(module)                                     # loaded before the baseline
    from validation.runners import open_engine

    x = torch.randint(0, int(job["vocab"]), (int(job["batch"]), int(job["seq"])),
                      generator=torch.Generator().manual_seed(int(job["seed"])))
    runtime = _proc_status()["VmRSS"]
    reset = _reset_peak_rss()
    engine = open_engine(job["backend"], Path(job["engine_dir"]))
    loaded = _proc_status()
    reset = _reset_peak_rss() and reset
    with torch.no_grad():
        engine.prefill(x)
    done = _proc_status()
    return {"runtime_bytes": runtime, "loaded_bytes": loaded["VmRSS"], "load_peak_bytes": loaded["VmHWM"],
            "forward_peak_bytes": done["VmHWM"], "hwm_reset": reset, "threads": torch.get_num_threads()}


# -- conditions ------------------------------------------------------------------------------------
def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _schedstat() -> dict[str, tuple[int, int]]:
    """Per thread of this process: (ns it ran on a CPU, ns it waited runnable for one) — Linux
    ``/proc/self/task/<tid>/schedstat``; empty where the kernel does not provide it."""
    out: dict[str, tuple[int, int]] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ran, waited = f.read().split()[:2]
            out[tid] = (int(ran), int(waited))
        except (OSError, ValueError):
            continue  # a thread that ended meanwhile
    return out


@contextmanager
def cpu_wait() -> Iterator[dict]:
    """Measure how much of its runnable time this process spent waiting for a CPU while the block ran: yields a
    dict that gets ``cpu_wait_pct`` (0–100) when the block ends. On free cores it stays near 0; every process
    competing for them raises it (one busy process beside a two-thread measurement on two cores: ~30–50 %).
    It is the direct evidence that a CPU timing was taken under contention, where the load average is a
    one-minute trailing mean. Threads alive at both ends are counted. Nothing is added where the kernel has no
    ``schedstat``."""
    out: dict = {}
    start = _schedstat()
    try:
        yield out
    finally:
        end = _schedstat()
        ran = waited = 0
        for tid in start.keys() & end.keys():
            ran += end[tid][0] - start[tid][0]
            waited += end[tid][1] - start[tid][1]
        if ran + waited > 0:
            out["cpu_wait_pct"] = round(100.0 * waited / (ran + waited), 1)


def conditions(engine) -> dict:
    out = {"device": engine.device, "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
           "torch": torch.__version__, "kv_cache": engine.kv_cache, "cpu_model": _cpu_model()}
    try:
        out["load_avg_1m"] = round(os.getloadavg()[0], 2)
    except OSError:
        pass
    if str(engine.device).startswith("cuda") and torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(torch.device(engine.device))
    return out


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--memory-probe":
    print(json.dumps(_memory_probe(json.loads(sys.argv[2]))))

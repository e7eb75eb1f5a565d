"""Gates: thresholds that decide whether an engine may be served.

- Accuracy and speed floors, per precision (FP8 tighter than NVFP4), chosen so faithful builds of two real
  families (SmolLM2-135M, Gemma 3 270M) on two texts pass and a damaged one fails loudly (measured: FP8 +1.2 – 3.5 %
  perplexity, KL 0.02 – 0.07; a scrambled NVFP4 dequant ≈ ×2000; a corrupted FP8 weight scale ≈ ×10;
  docs/validation.md "Gates").
- The memory budget ``max_peak_memory_bytes``: the envelope's corner must fit. Its default depends on the
  target (:func:`memory_budget`) and, for ``cpu``, on the validating machine's RAM, so it is resolved when the
  engine is validated and enters no key unless a build overrides it.
- The regression gate: against the previous validated engine of the same target, peak throughput may drop at
  most ``max_throughput_drop_pct`` (percent) and the perplexity increase may worsen by at most
  ``max_accuracy_regression_pct`` (percentage points). Changing either needs the spec's ``override_reason``.

``max_`` gates pass at or below their threshold, ``min_`` gates at or above; a NaN never passes.
"""

from __future__ import annotations

import math
import os
from typing import Callable

from kiln import units
from kiln.precisions import PRECISIONS
from kiln.targets import TARGETS
from validation.accuracy import GATE_METRIC  # the accuracy gates decided on a window interval
from validation.stats import PASS, Interval, decide

#: each precision's defaults, as its descriptor (kiln/precisions.py) states them
DEFAULT_GATES: dict[str, dict[str, float]] = {name: dict(p.gates) for name, p in PRECISIONS.items()}
REGRESSION_DEFAULTS: dict[str, float] = {"max_throughput_drop_pct": 20.0, "max_accuracy_regression_pct": 1.0}
REGRESSION_GATES = tuple(REGRESSION_DEFAULTS)
MEMORY_GATE = "max_peak_memory_bytes"
CPU_MEMORY_FRACTION = 0.75
# Per GPU target: its descriptor's card memory (kiln/targets.py)
GPU_MEMORY_BUDGETS: dict[str, tuple[float, str]] = {t.name: t.memory_budget for t in TARGETS.values()}


def effective_gates(precision: str, overrides: dict[str, float]) -> dict[str, float]:
    """The gates that enter the BuildKey: the precision's defaults plus the build's overrides (which may name
    the memory and regression gates; their defaults are resolved at validation, see :func:`judged_gates`)."""
    return {**DEFAULT_GATES[precision], **{k: float(v) for k, v in overrides.items()}}


def physical_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def memory_budget(target: str) -> tuple[float, str]:
    """(bytes, where the figure comes from) for ``target``: a GPU target's card memory, or for ``cpu`` 75 % of
    this machine's physical RAM (the rest is the OS's and the serving process's own)."""
    if target in GPU_MEMORY_BUDGETS:
        size, card = GPU_MEMORY_BUDGETS[target]
        return size, f"default for {target}: {card}"
    ram = physical_memory_bytes()
    return CPU_MEMORY_FRACTION * ram, (f"default for cpu: {CPU_MEMORY_FRACTION:.0%} of this machine's "
                                       f"{units.bytes_iec(ram)} RAM")


def judged_gates(gates: dict[str, float], target: str) -> tuple[dict[str, float], dict[str, str]]:
    """The thresholds validation judges by: ``gates`` plus the memory budget and the regression thresholds
    where the build did not set them. Returns (gates, where each non-default figure came from)."""
    out, sources = dict(gates), {}
    if MEMORY_GATE not in out:
        out[MEMORY_GATE], sources[MEMORY_GATE] = memory_budget(target)
    else:
        sources[MEMORY_GATE] = "set by the build"
    for name, default in REGRESSION_DEFAULTS.items():
        sources[name] = "set by the build" if name in out else "default"
        out.setdefault(name, default)
    return out, sources


def peak_throughput(points: list[dict], key: str = "tokens_per_s") -> float:
    return max((p.get(key, p["tokens_per_s"]) for p in points), default=0.0)


def _passes(name: str, value: float, threshold: float) -> bool:
    return bool(value <= threshold if name.startswith("max_") else value >= threshold)  # NaN: False either way


TASK_GATE = "max_task_accuracy_drop_pts"


def _verdict(name: str, threshold: float, value: float, interval: dict | None) -> dict:
    iv = Interval(value, interval["low"], interval["high"], interval["confidence"]) if interval else None
    decision = decide(name, iv, value, threshold)
    out = {"name": name, "threshold": threshold, "value": value, "passed": decision == PASS, "decision": decision}
    if iv is not None:
        out.update(interval=[iv.low, iv.high], confidence=iv.confidence)
    return out


def evaluate(metrics: dict, gates: dict[str, float]) -> list[dict]:
    """One verdict per gate of ``gates`` except the regression gates (see :func:`regression`):
    {name, threshold, value, passed, decision[, interval, confidence]}. An accuracy gate with a paired interval in
    ``metrics["intervals"]`` is decided on it (pass / fail / undecided; undecided does not pass); the others on
    their value. The task gate gives one verdict per task of ``metrics["tasks"]`` (none without tasks), and each
    window gate one more per longer window length of ``metrics["long_windows"]`` (with its ``seq_len``). A missing
    memory figure counts as infinite (it never passes)."""
    values = {
        "max_ppl_increase_pct": metrics.get("ppl_increase_pct"),
        "min_top1_agreement": metrics.get("top1_agreement"),
        "max_mean_kl": metrics.get("mean_kl"),
        "min_throughput_tps": peak_throughput(metrics.get("throughput", [])),
        MEMORY_GATE: metrics.get("peak_memory_bytes", math.inf),
    }
    intervals = metrics.get("intervals") or {}
    verdicts = []
    for name, threshold in gates.items():
        if name in REGRESSION_GATES:
            continue
        if name == TASK_GATE:
            for task in metrics.get("tasks") or []:
                v = _verdict(name, threshold, task["drop_pts"], task["interval"])
                verdicts.append({**v, "task": task["task"]})
            continue
        value = values[name]
        value = math.inf if value is None else value
        verdicts.append(_verdict(name, threshold, value, intervals.get(GATE_METRIC.get(name, ""))))
    for longer in metrics.get("long_windows") or []:  # the same accuracy gates at each longer window length
        if not longer.get("evaluated"):
            continue
        for name, threshold in gates.items():
            if (metric := GATE_METRIC.get(name)) is not None:
                value = longer.get(metric)
                verdicts.append({**_verdict(name, threshold, math.inf if value is None else value,
                                            (longer.get("intervals") or {}).get(metric)),
                                 "seq_len": longer["seq_len"]})
    return verdicts


def _common_peak(current: list[dict], previous: list[dict]) -> tuple[tuple[int, int] | None, float, tuple[int, int] | None, float]:
    """Peak best-of-reps tokens/s of each side over the (batch, seq) points both measured, with its point."""
    prev = {(p["batch_size"], p["seq_len"]): p.get("tokens_per_s_best", p["tokens_per_s"]) for p in previous}
    cur = {(p["batch_size"], p["seq_len"]): p.get("tokens_per_s_best", p["tokens_per_s"]) for p in current}
    common = set(prev) & set(cur)
    if not common:
        return None, 0.0, None, 0.0
    cp = max(common, key=lambda k: cur[k])
    pp = max(common, key=lambda k: prev[k])
    return cp, cur[cp], pp, prev[pp]


COMPARABLE_CONDITIONS = ("device", "threads", "cpus", "cpu_model", "gpu")


#: a CPU timing whose threads waited for a CPU this share of their runnable time or more was taken under
#: contention (validation.measure.cpu_wait: ~0–5 % on free cores, 30 % and more beside one busy process)
CPU_WAIT_BUSY_PCT = 10.0


def _busy(conditions: dict) -> str | None:
    """Why a CPU measurement counts as taken while other work competed for the cores, or None: its threads
    waited for a CPU for :data:`CPU_WAIT_BUSY_PCT` of their runnable time or more while it ran, or the 1-minute
    load average exceeded the CPU count by more than one (the measurement's own threads account for up to the
    CPU count)."""
    if str(conditions.get("device", "cpu")) != "cpu":
        return None
    load, cpus, wait = conditions.get("load_avg_1m"), conditions.get("cpus"), conditions.get("cpu_wait_pct")
    if isinstance(wait, (int, float)) and wait >= CPU_WAIT_BUSY_PCT:
        return f"its threads waited for a CPU {units.percent(wait, signed=False)} of their runnable time"
    if isinstance(load, (int, float)) and isinstance(cpus, int) and load > cpus + 1:
        return f"1-minute load {load} on {cpus} CPUs"
    return None


def regression(metrics: dict, conditions: dict, previous: dict | None, gates: dict[str, float], *,
               remeasure: Callable[[int, int], float] | None = None, override_reason: str | None = None,
               ) -> tuple[dict, list[dict]]:
    """Compare with ``previous`` (see :func:`validation.validate.previous_engine`): returns the regression record
    for the report and the verdicts of the regression gates that could be judged.

    Throughput is compared as the peak best-of-reps tokens/s over the points both engines measured, and only
    under the same conditions (device, threads, CPU count and model, GPU) on CPUs that were not busy with other
    work, then and now (:func:`_busy`: the timings' threads waited for a CPU under 10 % of the time, 1-minute
    load ≤ CPUs + 1); an apparent drop beyond the threshold
    is measured again at the previous engine's peak point with ``remeasure(batch, seq)`` (best tokens/s of more
    repetitions) before it fails. Accuracy is compared as the change in ``ppl_increase_pct``, in percentage
    points, and only when both engines were evaluated on the same text with the same settings."""
    thresholds = {k: gates.get(k, REGRESSION_DEFAULTS[k]) for k in REGRESSION_GATES}
    record: dict = {"previous": None, "thresholds": thresholds, "throughput_drop_pct": None,
                    "accuracy_regression_pct": None, "not_judged": {}, "override_reason": override_reason}
    if previous is None:
        reason = "no previous validated engine of this target to compare with"
        record["not_judged"] = {k: reason for k in REGRESSION_GATES}
        return record, []
    pm = previous.get("metrics") or {}
    record["previous"] = {
        "digest": previous.get("digest"), "build_key": previous.get("build_key"),
        "created_at": previous.get("created_at"), "status": previous.get("status"),
        "peak_tokens_per_s": peak_throughput(pm.get("throughput", []), "tokens_per_s_best"),
        **{k: pm.get(k) for k in ("perplexity", "reference_perplexity", "ppl_increase_pct", "top1_agreement",
                                  "mean_kl", "ttft_ms", "tpot_ms", "peak_memory_bytes")},
        "conditions": {k: (previous.get("conditions") or {}).get(k) for k in COMPARABLE_CONDITIONS},
    }
    verdicts = []
    # -- throughput ----------------------------------------------------------------------------
    prev_cond = previous.get("conditions") or {}
    differing = [k for k in COMPARABLE_CONDITIONS if prev_cond.get(k) != conditions.get(k)]
    cur_point, cur_peak, prev_point, prev_peak = _common_peak(metrics.get("throughput", []), pm.get("throughput", []))
    name = "max_throughput_drop_pct"
    if differing:
        record["not_judged"][name] = ("measured under different conditions (" + ", ".join(
            f"{k} {prev_cond.get(k)!r} then, {conditions.get(k)!r} now" for k in differing) + ")")
    elif busy := [f"{who} ({why})" for who, c in (("now", conditions), ("then", prev_cond)) if (why := _busy(c))]:
        record["not_judged"][name] = ("the machine was busy while throughput was measured " + " and ".join(busy)
                                      + ": a CPU timing under contention is no baseline and no evidence")
    elif cur_point is None or prev_point is None or prev_peak <= 0:
        record["not_judged"][name] = "the two engines share no measured (batch, sequence) point"
    else:
        drop = (prev_peak - cur_peak) / prev_peak * 100.0
        record["throughput"] = {"previous_peak_tokens_per_s": prev_peak, "previous_peak_point": list(prev_point),
                                "peak_tokens_per_s": cur_peak, "peak_point": list(cur_point), "rechecked": False}
        if not _passes(name, drop, thresholds[name]) and remeasure is not None:
            again = remeasure(*prev_point)
            record["throughput"].update(rechecked=True, recheck_point=list(prev_point), recheck_tokens_per_s=again)
            if again > cur_peak:
                cur_peak = again
                record["throughput"]["peak_tokens_per_s"] = again
                drop = (prev_peak - cur_peak) / prev_peak * 100.0
        record["throughput_drop_pct"] = drop
        verdicts.append({"name": name, "threshold": thresholds[name], "value": drop,
                         "passed": _passes(name, drop, thresholds[name]), "against": previous.get("digest")})
    # -- accuracy ------------------------------------------------------------------------------
    name = "max_accuracy_regression_pct"
    if not previous.get("same_evaluation", True):
        record["not_judged"][name] = "the previous engine was evaluated on other text or settings"
    elif pm.get("ppl_increase_pct") is None:
        record["not_judged"][name] = "the previous engine has no perplexity figure"
    else:
        cur, prev = metrics.get("ppl_increase_pct"), pm["ppl_increase_pct"]
        worse = cur - prev if cur is not None and math.isfinite(cur) else math.inf  # a broken engine never passes
        record["accuracy_regression_pct"] = worse
        verdicts.append({"name": name, "threshold": thresholds[name], "value": worse,
                         "passed": _passes(name, worse, thresholds[name]), "against": previous.get("digest")})
    return record, verdicts

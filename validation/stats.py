"""Decisions with confidence: paired intervals for every accuracy metric, three-way gate decisions, the smallest
change an evaluation could have detected, and the looks of a sequential evaluation.

Every accuracy figure compares the engine with the unquantized reference **on the same units** (the same
evaluation windows, the same task items), so the comparison is paired: what varies between units (one passage is
harder than another) cancels, and far fewer units decide a question than two independent samples would need.

- Windows (perplexity increase, mean KL, top-1 agreement): a paired **bootstrap over windows** (each resample
  draws whole windows with replacement and recomputes the ratio statistic from their sums), percentile interval.
- Task items (accuracy drop in points): per item the pair (engine correct, reference correct); the interval is
  the Agresti–Min adjusted Wald interval for a difference of paired proportions (McNemar's setting). It stays
  honest where the bootstrap is not: ten items that all agree give ±16 points, not [0, 0].
- A gate is a **one-sided test** at level ``alpha``, as TensorRT-LLM's accuracy CI tests its tasks (one-tailed:
  only a loss is a regression). An interval's ``confidence`` is that of **each end as a one-sided bound**: the high
  end of a ``max_`` gate's metric is an upper bound at that confidence, the low end a lower bound. The gate is
  **decided**: ``pass`` when the good-side bound is on the good side of the threshold, ``fail`` when the bad-side
  bound is on the bad side, ``undecided`` when the interval straddles it (the evaluation is too small to tell; an
  undecided gate does not pass). Whatever the true value, only one of the two wrong decisions is possible (a bad
  engine can only be wrongly passed, a good one only wrongly failed), so each end errs with at most ``alpha`` and
  so does the decision. (Two-sided intervals at ``1 - alpha`` — 97.5 % bounds — would hold every gate to half the
  stated error and need about a quarter more windows to decide a close engine.)
- Sequential evaluation looks at the data a fixed number of times (:func:`looks`); each look's bounds are at one
  confidence, Pocock's one-sided boundary for the plan (:func:`look_confidence`), so the chance that any look
  decides wrongly stays ≤ ``alpha``.
- The **minimum detectable effect** (MDE): the smallest true change that this many units would detect with power
  ``1 - beta`` in that one-sided test, ``(z(1-alpha) + z(1-beta)) * sd / sqrt(n)`` — TensorRT-LLM's accuracy CI
  sizes its tests the same way for its unpaired case (``compute_theta``). Beside it, how many units an unpaired
  comparison would need to detect the same change.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

ALPHA = 0.05  # the chance that a decision is wrong (over all looks)
BETA = 0.2  # 1 - power, for the minimum detectable effect
BOOTSTRAP_SAMPLES = 4000
SEED = 0
PASS, FAIL, UNDECIDED = "pass", "fail", "undecided"


def z(p: float) -> float:
    return NormalDist().inv_cdf(p)


@dataclass(frozen=True)
class Interval:
    """A point value and its bounds: ``low`` is a lower and ``high`` an upper bound, each one-sided at
    ``confidence`` (so together they cover the value with ``2 * confidence - 1``)."""

    value: float
    low: float
    high: float
    confidence: float

    def as_dict(self) -> dict:
        return {"value": self.value, "low": self.low, "high": self.high, "confidence": self.confidence}


def decide(name: str, interval: Interval | None, value: float, threshold: float) -> str:
    """``max_`` gates pass at or below the threshold, ``min_`` gates at or above; without an interval the point
    value decides (speed and memory gates). A NaN never passes."""
    upper = name.startswith("max_")
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return FAIL
    if interval is None or not all(math.isfinite(x) for x in (interval.low, interval.high)):
        ok = value <= threshold if upper else value >= threshold
        return PASS if ok else FAIL
    good, bad = (interval.high, interval.low) if upper else (interval.low, interval.high)
    if (good <= threshold) if upper else (good >= threshold):
        return PASS
    if (bad > threshold) if upper else (bad < threshold):
        return FAIL
    return UNDECIDED


# -- windows: a paired bootstrap of ratio statistics -------------------------------------------------
def _ratio_statistics(sums: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The window metrics from (resampled) per-window sums; arrays broadcast over resamples."""
    tokens = sums["tokens"]
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        return {
            "ppl_increase_pct": (np.exp((sums["nll_engine"] - sums["nll_reference"]) / tokens) - 1.0) * 100.0,
            "mean_kl": sums["kl"] / tokens,
            "top1_agreement": sums["agree"] / tokens,
        }


def window_intervals(per_window: dict[str, np.ndarray], confidence: float, *, samples: int = BOOTSTRAP_SAMPLES,
                     seed: int = SEED) -> dict[str, Interval]:
    """Point value and percentile bootstrap bounds of each window metric (each one-sided at ``confidence``).
    ``per_window``: arrays over windows of
    ``nll_engine``, ``nll_reference``, ``kl`` and ``agree`` (sums over the window's tokens) and ``tokens``."""
    n = len(per_window["tokens"])
    totals = {k: np.asarray(v, dtype=np.float64).sum() for k, v in per_window.items()}
    point = _ratio_statistics(totals)
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, n, size=(samples, n))
    resampled = {k: np.asarray(v, dtype=np.float64)[picks].sum(axis=1) for k, v in per_window.items()}
    boot = _ratio_statistics(resampled)
    tail = 1.0 - confidence
    out = {}
    for name, values in boot.items():
        finite = values[np.isfinite(values)]
        if len(finite) < len(values):  # an overflowing perplexity: the interval is unbounded above
            low = float(np.quantile(finite, tail)) if len(finite) else math.inf
            out[name] = Interval(float(point[name]), low, math.inf, confidence)
        else:
            out[name] = Interval(float(point[name]), float(np.quantile(values, tail)),
                                 float(np.quantile(values, 1.0 - tail)), confidence)
    return out


def window_mde(per_window: dict[str, np.ndarray], *, alpha: float = ALPHA, beta: float = BETA) -> dict[str, dict]:
    """Per window metric: the smallest change these windows detect (paired, in the metric's unit) and how many
    windows two independent samples would need to detect it (their per-window spread is the windows' own, not
    their difference's). Perplexity's is the increase in percent."""
    n = len(per_window["tokens"])
    k = z(1 - alpha) + z(1 - beta)
    tokens = np.asarray(per_window["tokens"], dtype=np.float64)
    nll_e = np.asarray(per_window["nll_engine"], dtype=np.float64) / tokens
    nll_r = np.asarray(per_window["nll_reference"], dtype=np.float64) / tokens
    per_token = {"ppl_increase_pct": (nll_e - nll_r, nll_r),
                 "mean_kl": (np.asarray(per_window["kl"]) / tokens, None),
                 "top1_agreement": (np.asarray(per_window["agree"]) / tokens, None)}
    out = {}
    for name, (diff, alone) in per_token.items():
        if n < 2:
            out[name] = {"paired": math.inf, "windows": n, "unpaired_windows_needed": None}
            continue
        sd = float(np.std(diff, ddof=1))
        delta = k * sd / math.sqrt(n)
        mde = (math.exp(delta) - 1.0) * 100.0 if name == "ppl_increase_pct" else delta
        unpaired = None
        if alone is not None and delta > 0:
            sd_alone = float(np.std(alone, ddof=1))  # two independent samples of windows, each with this spread
            unpaired = math.ceil(2 * (k * sd_alone / delta) ** 2)
        out[name] = {"paired": mde, "windows": n, "unpaired_windows_needed": unpaired}
    return out


# -- task items: paired proportions -------------------------------------------------------------------
def paired_accuracy(engine: list[bool], reference: list[bool], confidence: float, *, alpha: float = ALPHA,
                    beta: float = BETA) -> dict:
    """The accuracy drop (reference − engine, in points) on paired items, with its bounds (Agresti–Min, each one-sided
    at ``confidence``) and
    the minimum detectable drop; beside it the items an unpaired comparison (TensorRT-LLM's ``compute_theta``
    setting: two independent samples, σ² = p(1−p)) would need for the same detectable drop."""
    n = len(engine)
    if n != len(reference):
        raise ValueError("engine and reference outcomes must pair item by item")
    e = np.asarray(engine, dtype=bool)
    r = np.asarray(reference, dtype=bool)
    only_r = int(np.sum(r & ~e))  # the reference right, the engine wrong: the engine's losses
    only_e = int(np.sum(e & ~r))
    drop = (only_r - only_e) / n * 100.0 if n else math.nan
    pb, pc = (only_r + 0.5) / (n + 2), (only_e + 0.5) / (n + 2)
    se = math.sqrt(max(pb + pc - (pb - pc) ** 2, 0.0) / (n + 2))
    half = z(confidence) * se * 100.0
    centre = (pb - pc) * 100.0
    k = z(1 - alpha) + z(1 - beta)
    sd = math.sqrt(max(pb + pc - (pb - pc) ** 2, 0.0))
    mde = k * sd / math.sqrt(n) * 100.0 if n else math.inf
    acc_r = float(r.mean()) if n else math.nan
    var = acc_r * (1 - acc_r) if n else 0.0
    unpaired = math.ceil(2 * var * (k * 100.0 / mde) ** 2) if n and mde > 0 and var > 0 else None
    return {"drop_pts": drop, "interval": Interval(drop, centre - half, centre + half, confidence),
            "engine_accuracy": float(e.mean()) if n else math.nan, "reference_accuracy": acc_r, "items": n,
            "engine_only_correct": only_e, "reference_only_correct": only_r,
            "mde_pts": mde, "unpaired_items_needed": unpaired}


# -- sequential looks ----------------------------------------------------------------------------------
def looks(total: int, *, floor: int, step: int) -> list[int]:
    """The unit counts at which a sequential evaluation looks: the floor, then every ``step`` units, then all."""
    floor = max(1, min(floor, total))
    points = list(range(floor, total, max(1, step))) + [total]
    return sorted(set(points))


#: paths simulated to find a look plan's Pocock boundary (its confidence is then within ~0.001 of the exact one)
POCOCK_PATHS = 200_000


def look_confidence(looks, alpha: float = ALPHA) -> float:
    """Each look's one-sided confidence so that all looks together err with probability ≤ ``alpha``: Pocock's
    one-sided boundary — one constant for every look — for the planned looks ``looks`` (units evaluated at each,
    the last being all). One look: ``1 - alpha``.

    An estimate after n of N units behaves as a Brownian motion observed at n/N; the looks are correlated (each
    sees the units of the one before), so the Bonferroni price (``1 − alpha / looks``) overpays. The constant is the
    1 − alpha quantile of the largest Z over the looks (a wrong decision crosses one bound, on the side away from the
    truth), simulated (seeded, so every build of a plan gets the same number) on any spacing the plan has. Seven
    looks (128 windows): 98.6 % each (Z ≤ 2.20) rather than Bonferroni's 99.3 %."""
    looks = tuple(int(n) for n in looks)
    if len(looks) <= 1:
        return 1.0 - alpha
    return _pocock(looks, alpha)


@functools.lru_cache(maxsize=64)
def _pocock(looks: tuple[int, ...], alpha: float) -> float:
    t = np.asarray(looks, dtype=np.float64) / looks[-1]
    rng = np.random.default_rng(SEED)
    steps = rng.standard_normal((POCOCK_PATHS, len(t))) * np.sqrt(np.diff(t, prepend=0.0))
    largest = (np.cumsum(steps, axis=1) / np.sqrt(t)).max(axis=1)
    return NormalDist().cdf(float(np.quantile(largest, 1.0 - alpha)))


def settled(decisions: list[str]) -> bool:
    """Whether more evaluation can change the build's verdict: any gate decided ``fail`` fails it; all
    ``pass`` pass it."""
    return FAIL in decisions or all(d == PASS for d in decisions)


def fixed_order(n: int, seed: int = SEED) -> list[int]:
    """A random but fixed order of ``n`` units (the same for every build, so engines are compared alike)."""
    return np.random.default_rng(seed).permutation(n).tolist()

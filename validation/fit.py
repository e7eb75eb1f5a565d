"""Does an engine's build envelope still fit the traffic it serves? Pure logic over a traffic sample (no database,
no I/O): which share of requests fits the envelope's lengths, which share of time the concurrency stays within
its batch size, which named profile fits best, and which engines have drifted below a coverage threshold.

Traffic: one JSON object per request, ``{"prompt_tokens": int, "output_tokens": int, "arrival_s": float}``
(optionally ``"duration_s": float``, a measured time in the server, which then replaces the model below).

Lengths: a request fits when ``prompt_tokens ≤ max_input_len`` and ``prompt_tokens + output_tokens ≤
max_seq_len`` (a TensorRT-LLM engine rejects a longer prompt, and its KV cache holds at most ``max_seq_len``
tokens per sequence). ``length_coverage`` is the share of requests that fit.

Concurrency model: a request occupies one batch slot from ``arrival_s`` for
``duration_s = prompt_tokens / prefill_tps + output_tokens / decode_tps`` seconds (prefill at ``prefill_tps``
prompt tokens/s, then decode at ``decode_tps`` generated tokens/s per sequence, i.e. 1 / TPOT), as under
in-flight batching with no queueing: concurrency at time t is the number of requests with
``arrival_s ≤ t < arrival_s + duration_s``. ``batch_coverage`` is the share of the sample's window — from the
first arrival to the last departure, idle gaps included — during which concurrency ≤ ``max_batch_size``; above
it requests would wait for a slot. ``coverage = min(length_coverage, batch_coverage)``."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from kiln.errors import SpecError
from kiln.spec import LIMITS, PROFILES, BatchProfile

DEFAULT_THRESHOLD = 0.95
DEFAULT_PREFILL_TPS = 8000.0  # prompt tokens per second while a request's prefill runs
DEFAULT_DECODE_TPS = 40.0     # generated tokens per second per sequence (TPOT 25 ms)
MAX_REQUESTS = 1_000_000
ENVELOPE_FIELDS = ("max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens")


@dataclass(frozen=True)
class Request:
    prompt_tokens: int
    output_tokens: int
    arrival_s: float
    duration_s: float | None = None


@dataclass(frozen=True)
class ServiceModel:
    """How long a request holds a batch slot (see the module docstring)."""

    prefill_tps: float = DEFAULT_PREFILL_TPS
    decode_tps: float = DEFAULT_DECODE_TPS

    def __post_init__(self):
        for name in ("prefill_tps", "decode_tps"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not (v > 0 and math.isfinite(v)):
                raise SpecError(f"{v!r} is not a positive number", field=name, fix="give tokens per second, e.g. 40")

    def duration(self, r: Request) -> float:
        if r.duration_s is not None:
            return r.duration_s
        return r.prompt_tokens / self.prefill_tps + r.output_tokens / self.decode_tps

    def describe(self) -> dict:
        return {"prefill_tps": self.prefill_tps, "decode_tps": self.decode_tps,
                "duration": "duration_s if given, else prompt_tokens / prefill_tps + output_tokens / decode_tps"}


# -- reading a sample --------------------------------------------------------------------------------------------
def _int(value: Any, where: str, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value != int(value) or value < 0:
        raise SpecError(f"{where}: {name} is {value!r}, not a non-negative integer", field=f"traffic.{name}",
                        fix='write {"prompt_tokens": 120, "output_tokens": 80, "arrival_s": 0.5}')
    return int(value)


def _float(value: Any, where: str, name: str, *, minimum: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (
            minimum is not None and value < minimum):
        raise SpecError(f"{where}: {name} is {value!r}, not a finite{' non-negative' if minimum == 0 else ''} number",
                        field=f"traffic.{name}", fix="give seconds as a number, e.g. 12.5")
    return float(value)


def parse_record(obj: Any, where: str) -> Request:
    if not isinstance(obj, Mapping):
        raise SpecError(f"{where} is not a JSON object", field="traffic",
                        fix='one object per line: {"prompt_tokens": 120, "output_tokens": 80, "arrival_s": 0.5}')
    missing = [k for k in ("prompt_tokens", "output_tokens", "arrival_s") if k not in obj]
    if missing:
        raise SpecError(f"{where} has no {missing[0]}", field=f"traffic.{missing[0]}",
                        fix="every request needs prompt_tokens, output_tokens and arrival_s")
    duration = obj.get("duration_s")
    return Request(_int(obj["prompt_tokens"], where, "prompt_tokens"), _int(obj["output_tokens"], where, "output_tokens"),
                   _float(obj["arrival_s"], where, "arrival_s"),
                   None if duration is None else _float(duration, where, "duration_s", minimum=0))


def parse_records(records: Iterable[Any]) -> list[Request]:
    """Objects (e.g. a JSON array's items), named by index in errors."""
    out = [parse_record(obj, f"request {i}") for i, obj in enumerate(records)]
    return _checked(out)


def parse_jsonl(lines: Iterable[str]) -> list[Request]:
    """JSON lines (blank lines skipped), named by line number in errors."""
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            raise SpecError(f"line {n} is not JSON", field="traffic",
                            fix="write one JSON object per line (JSON lines)") from None
        out.append(parse_record(obj, f"line {n}"))
        if len(out) > MAX_REQUESTS:
            break
    return _checked(out)


def _checked(requests: list[Request]) -> list[Request]:
    if not requests:
        raise SpecError("the traffic sample has no requests", field="traffic", fix="give at least one request")
    if len(requests) > MAX_REQUESTS:
        raise SpecError(f"more than {MAX_REQUESTS:,} requests", field="traffic", fix="sample the traffic")
    return requests


# -- the sample's shape ------------------------------------------------------------------------------------------
@dataclass
class Traffic:
    """A sample with its concurrency profile: ``level_time[c]`` = seconds during which exactly c requests are
    in flight, over ``window_s`` (first arrival to last departure)."""

    requests: list[Request]
    model: ServiceModel
    level_time: dict[int, float] = field(default_factory=dict)
    window_s: float = 0.0
    arrival_concurrency: list[int] = field(default_factory=list)  # in flight at each arrival, itself included

    @classmethod
    def of(cls, requests: list[Request], model: ServiceModel | None = None) -> "Traffic":
        t = cls(list(requests), model or ServiceModel())
        t._sweep()
        return t

    def _sweep(self) -> None:
        events: list[tuple[float, int, int]] = []  # (time, delta, index); ends (-1) sort before starts at a tie
        for i, r in enumerate(self.requests):
            d = self.model.duration(r)
            if d > 0:
                events += [(r.arrival_s, 1, i), (r.arrival_s + d, -1, i)]
        events.sort(key=lambda e: (e[0], e[1]))
        level, prev = 0, None
        at_arrival: dict[int, int] = {}
        for t, delta, i in events:
            if prev is not None and t > prev:
                self.level_time[level] = self.level_time.get(level, 0.0) + (t - prev)
            level += delta
            prev = t
            if delta == 1:
                at_arrival[i] = level
        start = min(r.arrival_s for r in self.requests)
        end = max(r.arrival_s + self.model.duration(r) for r in self.requests)
        self.window_s = end - start
        # zero-length requests before the first or after the last event widen the window at concurrency 0
        idle = (events[0][0] - start) + (end - prev) if events and prev is not None else end - start
        if idle > 0:
            self.level_time[0] = self.level_time.get(0, 0.0) + idle
        self.arrival_concurrency = [at_arrival.get(i, 0) for i in range(len(self.requests))]

    def time_share_at_most(self, batch: int) -> float:
        """Share of the window during which concurrency ≤ ``batch`` (1.0 for a window of zero length)."""
        total = sum(self.level_time.values())
        if total <= 0:
            return 1.0
        return sum(s for c, s in self.level_time.items() if c <= batch) / total

    def batch_quantile(self, share: float) -> int:
        """The smallest batch size B with ``time_share_at_most(B) ≥ share``."""
        total = sum(self.level_time.values())
        if total <= 0:
            return max(1, max(self.arrival_concurrency, default=1))
        acc = 0.0
        for c in sorted(self.level_time):
            acc += self.level_time[c]
            if acc / total >= share - 1e-12:
                return max(1, c)
        return max(1, max(self.level_time))

    def summary(self) -> dict:
        prompts = sorted(r.prompt_tokens for r in self.requests)
        totals = sorted(r.prompt_tokens + r.output_tokens for r in self.requests)
        outputs = sorted(r.output_tokens for r in self.requests)
        total = sum(self.level_time.values())
        mean = sum(c * s for c, s in self.level_time.items()) / total if total > 0 else 0.0
        return {
            "requests": len(self.requests), "window_s": self.window_s,
            "prompt_tokens": _dist(prompts), "output_tokens": _dist(outputs), "total_tokens": _dist(totals),
            "concurrency": {"mean": mean, "p50": self.batch_quantile(0.5), "p95": self.batch_quantile(0.95),
                            "peak": max((c for c, s in self.level_time.items() if s > 0), default=0)},
        }


def nearest_rank(sorted_values: list[int], share: float) -> int:
    """The smallest value v in the sample with at least ``share`` of the values ≤ v."""
    k = max(1, math.ceil(share * len(sorted_values) - 1e-9))
    return sorted_values[min(k, len(sorted_values)) - 1]


def _dist(values: list[int]) -> dict:
    return {"p50": nearest_rank(values, 0.5), "p95": nearest_rank(values, 0.95), "max": values[-1]}


# -- fitting envelopes -------------------------------------------------------------------------------------------
def envelope_limits(profile: BatchProfile | Mapping[str, Any]) -> dict[str, int]:
    d = profile.model_dump() if isinstance(profile, BatchProfile) else dict(profile)
    missing = [k for k in ENVELOPE_FIELDS if not isinstance(d.get(k), int)]
    if missing:
        raise SpecError(f"the envelope has no {missing[0]}", field=f"profile.{missing[0]}",
                        fix="give max_batch_size, max_input_len, max_seq_len and max_num_tokens")
    return {k: int(d[k]) for k in ENVELOPE_FIELDS}


def fit(traffic: Traffic, profile: BatchProfile | Mapping[str, Any], threshold: float = DEFAULT_THRESHOLD) -> dict:
    """How one envelope covers the sample."""
    lim = envelope_limits(profile)
    prompt_long = sum(1 for r in traffic.requests if r.prompt_tokens > lim["max_input_len"])
    seq_long = sum(1 for r in traffic.requests if r.prompt_tokens + r.output_tokens > lim["max_seq_len"])
    fits = sum(1 for r in traffic.requests if r.prompt_tokens <= lim["max_input_len"]
               and r.prompt_tokens + r.output_tokens <= lim["max_seq_len"])
    length = fits / len(traffic.requests)
    batch = traffic.time_share_at_most(lim["max_batch_size"])
    coverage = min(length, batch)
    return {"limits": lim, "length_coverage": length, "batch_coverage": batch, "coverage": coverage,
            "covers": coverage >= threshold - 1e-12,
            "outside": {"prompt_too_long": prompt_long, "seq_too_long": seq_long, "requests": len(traffic.requests) - fits}}


def cost(limits: Mapping[str, int]) -> tuple[int, int]:
    """What an envelope reserves: KV-cache slots (batch × sequence), then tokens per step."""
    return limits["max_batch_size"] * limits["max_seq_len"], limits["max_num_tokens"]


def best_profile(fits: Mapping[str, dict]) -> str:
    """The cheapest profile that reaches the threshold; if none does, the one with the highest coverage
    (the cheaper one on a tie)."""
    covering = [n for n, f in fits.items() if f["covers"]]
    if covering:
        return min(covering, key=lambda n: (cost(fits[n]["limits"]), n))
    return min(fits, key=lambda n: (-fits[n]["coverage"], cost(fits[n]["limits"]), n))


def suggest(traffic: Traffic, threshold: float = DEFAULT_THRESHOLD) -> dict[str, int]:
    """The smallest explicit envelope that reaches ``threshold`` on this sample: ``max_seq_len`` the
    threshold-quantile of prompt + output, ``max_input_len`` the longest prompt among the requests within it (so
    length coverage ≥ threshold), ``max_batch_size`` the threshold-quantile of concurrency over time,
    ``max_num_tokens = max_batch_size × max_input_len``; clamped to Kiln's limits."""
    totals = sorted(r.prompt_tokens + r.output_tokens for r in traffic.requests)
    seq = nearest_rank(totals, threshold)
    inp = max((r.prompt_tokens for r in traffic.requests if r.prompt_tokens + r.output_tokens <= seq), default=1)
    batch = traffic.batch_quantile(threshold)

    def clamp(name: str, v: int) -> int:
        lo, hi = LIMITS[name]
        return min(max(v, lo), hi)

    inp = clamp("max_input_len", inp)
    seq = clamp("max_seq_len", max(seq, inp, 2))
    batch = clamp("max_batch_size", batch)
    return {"max_batch_size": batch, "max_input_len": inp, "max_seq_len": seq,
            "max_num_tokens": clamp("max_num_tokens", batch * inp)}


def analyze(requests: list[Request], *, engines: Iterable[Mapping[str, Any]] = (),
            profiles: Mapping[str, BatchProfile] | None = None, threshold: float = DEFAULT_THRESHOLD,
            model: ServiceModel | None = None) -> dict:
    """The whole report: the sample, every named profile, the best one, a suggested envelope, and each engine
    (``{"digest", "repository", "tag", "profile": {name, max_*...}}``) with ``drifted`` = coverage < threshold."""
    check_threshold(threshold)
    traffic = Traffic.of(requests, model)
    profiles = PROFILES if profiles is None else profiles
    fits = {name: {"name": name, **fit(traffic, p, threshold)} for name, p in profiles.items()}
    best = best_profile(fits) if fits else None
    engine_rows = []
    for e in engines:
        prof = e.get("profile") or {}
        base = {**{k: v for k, v in e.items() if k != "profile"}, "profile": prof.get("name", "custom")}
        try:
            f = fit(traffic, prof, threshold)
        except SpecError as exc:  # an engine whose provenance lacks its limits: reported, not judged
            engine_rows.append({**base, "error": exc.message, "coverage": None, "drifted": None})
            continue
        engine_rows.append({**base, **f, "drifted": not f["covers"]})
    return {
        "threshold": threshold, "service_model": traffic.model.describe(), "traffic": traffic.summary(),
        "profiles": list(fits.values()), "best_profile": best, "suggested": suggest(traffic, threshold),
        "engines": engine_rows, "drifted": [e.get("digest") for e in engine_rows if e["drifted"]],
    }


def check_threshold(threshold: Any) -> float:
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 < threshold <= 1:
        raise SpecError(f"{threshold!r} is not a share in (0, 1]", field="threshold", fix="write 0.95 (or 95%)")
    return float(threshold)


def parse_threshold(text: str) -> float:
    """``0.95`` or ``95%``."""
    s = str(text).strip()
    try:
        value = float(s[:-1]) / 100 if s.endswith("%") else float(s)
    except ValueError:
        raise SpecError(f"{text!r} is not a share", field="threshold", fix="write 0.95 or 95%") from None
    return check_threshold(value)

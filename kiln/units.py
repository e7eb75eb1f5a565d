"""The one formatter for every number a person reads: the CLI, the HTML and JUnit reports and the dashboard (whose
twin, ``api/static/units.js``, gives the same strings for the same inputs; tests/unit/kiln/test_units.py runs both).

Style, the same everywhere:

- bytes in IEC units with 3 significant digits: ``512 B``, ``1.00 KiB``, ``42.4 MiB``, ``17.7 GiB``;
- durations: ``850 ms``, ``12.3 s``, ``4 min 05 s``, ``1 h 02 min``;
- percentages without a space, changes signed: ``+3.50%``, ``-1.20%``; shares of one (agreement, accuracy,
  confidence) as ``94.2%``; percentage points as ``+1.20 pts``;
- counts with thousands separators: ``30,307``; rates as ``30,307 tokens/s`` (3 significant digits under 100);
- other numbers with 4 significant digits, trailing zeros dropped: ``0.0077``, ``41.26``;
- no value ``—``; infinities ``∞`` and ``−∞``; ``NaN`` (without a unit); booleans yes/no; any other value
  (a string) as it is, so a formatter never raises on what a server sent.

Rounding is half away from zero on the float's exact value, which is what JavaScript's ``toFixed`` and
``toExponential`` do, so the two implementations agree digit for digit. JSON outputs keep raw values (machines).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from decimal import ROUND_HALF_UP, Context, Decimal, localcontext
from typing import Any

NONE = "—"
BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")

#: every gate (validation/gates.py): what a person calls it, and the kind of number it judges
GATES: dict[str, tuple[str, str]] = {
    "max_peak_memory_bytes": ("peak memory", "bytes"),
    "max_ppl_increase_pct": ("perplexity increase", "percent"),
    "min_top1_agreement": ("top-1 agreement", "fraction"),
    "max_mean_kl": ("mean KL", "number"),
    "min_throughput_tps": ("throughput", "tokens/s"),
    "max_throughput_drop_pct": ("throughput drop", "percent"),
    "max_accuracy_regression_pct": ("perplexity increase change", "points"),
    "max_task_accuracy_drop_pts": ("task accuracy drop", "points"),
}


# -- rounding (the same digits as JavaScript) --------------------------------------------------------------
def _special(x) -> str | None:
    """The text of what is not a finite number: None, a boolean, a string (shown as it is), an infinity, NaN."""
    if x is None:
        return NONE
    if isinstance(x, bool):
        return "yes" if x else "no"
    if not isinstance(x, (int, float)):
        return str(x)
    if isinstance(x, float) and not math.isfinite(x):
        return "NaN" if math.isnan(x) else ("∞" if x > 0 else "−∞")
    return None


def _fixed(x: float, decimals: int) -> str:
    """``x`` with ``decimals`` decimals, half away from zero, no sign on a zero (JS: ``x.toFixed(decimals)``)."""
    with localcontext() as ctx:
        ctx.prec = 400
        text = format(Decimal(x).quantize(Decimal(1).scaleb(-decimals), rounding=ROUND_HALF_UP), "f")
    return text[1:] if text.startswith("-") and not text.strip("-0.") else text


def _exponent(x: float, digits: int) -> int:
    """The decimal exponent of ``x`` once rounded to ``digits`` significant digits (JS: ``toExponential``)."""
    if x == 0:
        return 0
    return Context(prec=digits, rounding=ROUND_HALF_UP).plus(Decimal(abs(x))).adjusted()


def significant(x: float, digits: int = 3) -> str:
    """``digits`` significant digits, trailing zeros kept (``1.00``, ``42.4``, ``512``, ``0.0120``)."""
    return _fixed(x, min(100, max(0, digits - 1 - _exponent(x, digits))))


def _trim(text: str) -> str:
    return text.rstrip("0").rstrip(".") if "." in text else text


def _group(text: str) -> str:
    sign, text = ("-", text[1:]) if text.startswith("-") else ("", text)
    whole, dot, frac = text.partition(".")
    groups: list[str] = []
    while len(whole) > 3:
        groups.insert(0, whole[-3:])
        whole = whole[:-3]
    return sign + ",".join([whole, *groups]) + dot + frac


# -- the formatters ------------------------------------------------------------------------------------------
def count(n) -> str:
    """A whole number with thousands separators: ``30,307`` (a float is rounded)."""
    return _special(n) or _group(_fixed(n, 0))


def number(x, digits: int = 4) -> str:
    """A plain number: 4 significant digits, trailing zeros dropped (``0.0077``, ``41.26``); a whole number or one
    from 1,000 up as a count (``2,048``)."""
    if (s := _special(x)) is not None:
        return s
    if abs(x) >= 1000 or float(x).is_integer():
        return count(x)
    return _trim(significant(x, digits))


def bytes_iec(n) -> str:
    """``512 B``, ``1.00 KiB``, ``42.4 MiB``, ``17.7 GiB``: IEC units, 3 significant digits."""
    if (s := _special(n)) is not None:
        return s
    sign, v, i = ("-" if n < 0 else ""), abs(float(n)), 0
    while i < len(BYTE_UNITS) - 1 and float(_fixed(v, 0) if i == 0 else significant(v)) >= 1024:
        v, i = v / 1024, i + 1
    return sign + (_fixed(v, 0) if i == 0 else significant(v)) + " " + BYTE_UNITS[i]


def duration(s) -> str:
    """``850 ms``, ``12.3 s``, ``4 min 05 s``, ``1 h 02 min``."""
    if (t := _special(s)) is not None:
        return t
    if s == 0:
        return "0 s"
    sign, s = ("-" if s < 0 else ""), abs(float(s))
    if float(significant(s * 1000)) < 1000:
        return sign + significant(s * 1000) + " ms"
    if float(significant(s)) < 60:
        return sign + significant(s) + " s"
    whole = int(_fixed(s, 0))
    if whole < 3600:
        return f"{sign}{whole // 60} min {whole % 60:02d} s"
    minutes = int(_fixed(s / 60, 0))
    return f"{sign}{minutes // 60} h {minutes % 60:02d} min"


def percent(x, signed: bool = True, digits: int = 2) -> str:
    """A value already in percent: ``+3.50%`` (signed, for a change) or ``3.50%``."""
    if (s := _special(x)) is not None:
        return s
    text = _fixed(x, digits)
    return ("+" + text if signed and not text.startswith("-") else text) + "%"


def fraction(x, digits: int = 1) -> str:
    """A share of one (agreement, accuracy, confidence) as a percentage: ``0.942`` → ``94.2%``."""
    return _special(x) or _fixed(x * 100, digits) + "%"


def points(x, digits: int = 2) -> str:
    """Percentage points, signed: ``+1.20 pts``."""
    if (s := _special(x)) is not None:
        return s
    text = _fixed(x, digits)
    return ("" if text.startswith("-") else "+") + text + " pts"


def rate(x, unit: str = "tokens/s") -> str:
    """``30,307 tokens/s``; under 100, 3 significant digits (``1.00 tokens/s``)."""
    if (s := _special(x)) is not None:
        return s
    return (count(x) if abs(x) >= 100 else significant(x)) + " " + unit


KINDS: dict[str, Callable[[Any], str]] = {"bytes": bytes_iec, "percent": percent, "fraction": fraction, "number": number, "points": points,
         "tokens/s": rate, "seconds": duration, "count": count}


def display(v) -> str:
    """Any value a person reads in a table: numbers as :func:`number`, None ``—``, booleans yes/no, the rest as text."""
    return number(v)


# -- gates ---------------------------------------------------------------------------------------------------
def gate_label(name: str) -> str:
    return GATES.get(name, (name, "number"))[0]


def gate_subject(g: dict) -> str:
    """What a verdict was measured on beside its gate: `` [arc]`` for a task, `` [512-token windows]`` for the
    window gates at a longer length; ``""`` for the evaluation's own windows."""
    if g.get("task"):
        return f" [{g['task']}]"
    if g.get("seq_len"):
        return f" [{g['seq_len']}-token windows]"
    return ""


def gate_value(name: str, value) -> str:
    """A gate's value or threshold in the gate's unit (an unknown gate: a plain number; not a number: as text)."""
    return KINDS[GATES.get(name, (name, "number"))[1]](value)


def gate_op(name: str) -> str:
    return "≤" if name.startswith("max_") else "≥"


def gate_decision(g: dict) -> str:
    decision = g.get("decision") or ("pass" if g.get("passed") else "fail")
    return {"pass": "pass", "fail": "FAIL", "undecided": "UNDECIDED"}.get(decision, str(decision))


def rung_verdict(rung: dict) -> str:
    """A ladder rung's verdict: ``pass``, or ``FAIL perplexity increase; undecided mean KL``. A sequential evaluation
    stops once one gate fails, so a failed rung's other gates may be undecided; they are named apart, since an
    undecided gate is not a measured failure."""
    if rung.get("passed"):
        return "pass"
    by: dict[str, list[str]] = {"FAIL": [], "UNDECIDED": []}
    for g in rung.get("gates") or []:
        if (word := gate_decision(g)) in by:
            by[word].append(gate_label(str(g.get("name"))))
    parts = ([f"FAIL {', '.join(by['FAIL'])}"] if by["FAIL"] else []) + (
        [f"undecided {', '.join(by['UNDECIDED'])}"] if by["UNDECIDED"] else [])
    return "; ".join(parts) or "FAIL"


def gate_interval(g: dict) -> str:
    """``[+2.10%, +3.70%] (99.0%)``: the interval the gate was decided on, at its confidence; ``""`` without one."""
    iv = g.get("interval")
    if not iv:
        return ""
    conf = g.get("confidence")
    return (f"[{gate_value(g['name'], iv[0])}, {gate_value(g['name'], iv[1])}]"
            + (f" ({fraction(conf)})" if isinstance(conf, (int, float)) and not isinstance(conf, bool) else ""))


def gate_line(g: dict) -> str:
    """``peak memory 42.4 MiB ≤ 17.7 GiB  pass``; with an interval ``mean KL 0.0077 [0.0069, 0.0085] (99.3%) ≤
    0.05  pass``; a task gate names its task: ``task accuracy drop [arc] +1.20 pts ≤ +3.00 pts  pass``."""
    name = g["name"]
    label = gate_label(name) + gate_subject(g)
    interval = gate_interval(g)
    word = gate_decision(g) + (" (evaluate more to decide)" if g.get("decision") == "undecided" else "")
    return (f"{label} {gate_value(name, g.get('value'))}{' ' + interval if interval else ''} {gate_op(name)} "
            f"{gate_value(name, g.get('threshold'))}  {word}")

// The one number formatter, JavaScript twin of kiln/units.py: the same functions give the same strings for the
// same inputs (tests/unit/kiln/test_units.py runs both). Loaded before dashboard.js as a plain script (global
// KilnUnits); under node, require() returns the same object.
"use strict";

const KilnUnits = (() => {
  const NONE = "—";
  const BYTE_UNITS = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
  const GATES = {
    max_peak_memory_bytes: ["peak memory", "bytes"],
    max_ppl_increase_pct: ["perplexity increase", "percent"],
    min_top1_agreement: ["top-1 agreement", "fraction"],
    max_mean_kl: ["mean KL", "number"],
    min_throughput_tps: ["throughput", "tokens/s"],
    max_throughput_drop_pct: ["throughput drop", "percent"],
    max_accuracy_regression_pct: ["perplexity increase change", "points"],
    max_task_accuracy_drop_pts: ["task accuracy drop", "points"],
  };

  // -- rounding: toFixed and toExponential round half away from zero on the exact value, as kiln/units.py does
  function special(x) {
    if (x === null || x === undefined) return NONE;
    if (typeof x === "boolean") return x ? "yes" : "no";
    if (typeof x !== "number") return String(x);
    if (!isFinite(x)) return isNaN(x) ? "NaN" : (x > 0 ? "∞" : "−∞");
    return null;
  }

  function fixed(x, decimals) {
    const text = Number(x).toFixed(decimals);
    return text.startsWith("-") && !/[1-9]/.test(text) ? text.slice(1) : text;
  }

  function exponent(x, digits) {
    if (x === 0) return 0;
    return parseInt(Math.abs(x).toExponential(digits - 1).split("e")[1], 10);
  }

  function significant(x, digits) {
    if (digits === undefined) digits = 3;
    return fixed(x, Math.min(100, Math.max(0, digits - 1 - exponent(x, digits))));
  }

  function trim(text) { return text.includes(".") ? text.replace(/0+$/, "").replace(/\.$/, "") : text; }

  function group(text) {
    let sign = "";
    if (text.startsWith("-")) { sign = "-"; text = text.slice(1); }
    const dot = text.indexOf(".");
    let whole = dot < 0 ? text : text.slice(0, dot);
    const rest = dot < 0 ? "" : text.slice(dot);
    const groups = [];
    while (whole.length > 3) { groups.unshift(whole.slice(-3)); whole = whole.slice(0, -3); }
    return sign + [whole].concat(groups).join(",") + rest;
  }

  // -- the formatters
  function count(n) { return special(n) || group(fixed(n, 0)); }

  function number(x, digits) {
    const s = special(x);
    if (s !== null) return s;
    if (Math.abs(x) >= 1000 || Number.isInteger(x)) return count(x);
    return trim(significant(x, digits === undefined ? 4 : digits));
  }

  function bytesIec(n) {
    const s = special(n);
    if (s !== null) return s;
    const sign = n < 0 ? "-" : "";
    let v = Math.abs(n), i = 0;
    const show = () => (i === 0 ? fixed(v, 0) : significant(v));
    while (i < BYTE_UNITS.length - 1 && parseFloat(show()) >= 1024) { v /= 1024; i++; }
    return sign + show() + " " + BYTE_UNITS[i];
  }

  function duration(s) {
    const t = special(s);
    if (t !== null) return t;
    if (s === 0) return "0 s";
    const sign = s < 0 ? "-" : "";
    s = Math.abs(s);
    if (parseFloat(significant(s * 1000)) < 1000) return sign + significant(s * 1000) + " ms";
    if (parseFloat(significant(s)) < 60) return sign + significant(s) + " s";
    const whole = parseInt(fixed(s, 0), 10);
    const pad = (k) => String(k).padStart(2, "0");
    if (whole < 3600) return sign + Math.floor(whole / 60) + " min " + pad(whole % 60) + " s";
    const minutes = parseInt(fixed(s / 60, 0), 10);
    return sign + Math.floor(minutes / 60) + " h " + pad(minutes % 60) + " min";
  }

  function percent(x, signed, digits) {
    const s = special(x);
    if (s !== null) return s;
    const text = fixed(x, digits === undefined ? 2 : digits);
    return (signed !== false && !text.startsWith("-") ? "+" + text : text) + "%";
  }

  function fraction(x, digits) {
    return special(x) || fixed(x * 100, digits === undefined ? 1 : digits) + "%";
  }

  function points(x, digits) {
    const s = special(x);
    if (s !== null) return s;
    const text = fixed(x, digits === undefined ? 2 : digits);
    return (text.startsWith("-") ? "" : "+") + text + " pts";
  }

  function rate(x, unit) {
    const s = special(x);
    if (s !== null) return s;
    return (Math.abs(x) >= 100 ? count(x) : significant(x)) + " " + (unit === undefined ? "tokens/s" : unit);
  }

  const KINDS = { bytes: bytesIec, percent: (x) => percent(x), fraction: (x) => fraction(x), number: (x) => number(x),
    points: (x) => points(x), "tokens/s": (x) => rate(x), seconds: duration, count };

  function display(v) { return number(v); }

  // -- gates
  function gateKind(name) { return GATES[name] || [name, "number"]; }
  function gateLabel(name) { return gateKind(name)[0]; }

  function gateValue(name, value) {
    return KINDS[gateKind(name)[1]](value);
  }

  function gateOp(name) { return name.startsWith("max_") ? "≤" : "≥"; }

  function gateDecision(g) {
    const d = g.decision || (g.passed ? "pass" : "fail");
    return { pass: "pass", fail: "FAIL", undecided: "UNDECIDED" }[d] || String(d);
  }

  function gateInterval(g) {
    if (!g.interval || !g.interval.length) return "";
    const conf = typeof g.confidence === "number" ? " (" + fraction(g.confidence) + ")" : "";
    return "[" + gateValue(g.name, g.interval[0]) + ", " + gateValue(g.name, g.interval[1]) + "]" + conf;
  }

  function gateLine(g) {
    const label = gateLabel(g.name) + (g.task ? " [" + g.task + "]" : g.seq_len ? " [" + g.seq_len + "-token windows]" : "");
    const interval = gateInterval(g);
    const word = gateDecision(g) + (g.decision === "undecided" ? " (evaluate more to decide)" : "");
    return label + " " + gateValue(g.name, g.value) + (interval ? " " + interval : "") + " " + gateOp(g.name) + " " +
      gateValue(g.name, g.threshold) + "  " + word;
  }

  return { GATES, significant, count, number, bytesIec, duration, percent, fraction, points, rate, display,
    gateLabel, gateValue, gateOp, gateDecision, gateInterval, gateLine };
})();

if (typeof module !== "undefined" && module.exports) module.exports = KilnUnits;

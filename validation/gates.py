"""Gates: thresholds that decide whether an engine may be served. Defaults per precision (FP8 tighter than
NVFP4), chosen so correct builds of the shipped tiny Llama pass with margin and a damaged one fails loudly
(measured: FP8 W8A8 ≈ +0.5 % perplexity, NVFP4 W4A4 ≈ +6 %; a scrambled NVFP4 dequant ≈ ×2000)."""

from __future__ import annotations

DEFAULT_GATES: dict[str, dict[str, float]] = {
    "fp8": {"max_ppl_increase_pct": 3.0, "min_top1_agreement": 0.85, "max_mean_kl": 0.05, "min_throughput_tps": 1.0},
    "nvfp4": {"max_ppl_increase_pct": 15.0, "min_top1_agreement": 0.70, "max_mean_kl": 0.25, "min_throughput_tps": 1.0},
}


def effective_gates(precision: str, overrides: dict[str, float]) -> dict[str, float]:
    return {**DEFAULT_GATES[precision], **{k: float(v) for k, v in overrides.items()}}


def evaluate(metrics: dict, gates: dict[str, float]) -> list[dict]:
    """One verdict per gate: {name, threshold, value, passed}."""
    peak = max((p["tokens_per_s"] for p in metrics.get("throughput", [])), default=0.0)
    values = {
        "max_ppl_increase_pct": metrics["ppl_increase_pct"],
        "min_top1_agreement": metrics["top1_agreement"],
        "max_mean_kl": metrics["mean_kl"],
        "min_throughput_tps": peak,
    }
    verdicts = []
    for name, threshold in gates.items():
        value = values[name]
        ok = value <= threshold if name.startswith("max_") else value >= threshold
        verdicts.append({"name": name, "threshold": threshold, "value": value, "passed": bool(ok)})
    return verdicts

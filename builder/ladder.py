"""``--recipe auto``: a precision's ladder (kiln/precisions.py, data) run as a build stage of its own.

Rungs are tried in order, the fastest to serve first. Each rung is quantized (its quantize stage is cached under
its own key, so a rung any earlier build ran is not calibrated again) and **screened**: its exported checkpoint,
as transformers computes it from the exported tensors (the ``checkpoint`` artifact's numerics; the compiled
engine is built from the same model), is evaluated on the build's evaluation text against the unquantized
reference, and judged by the accuracy gates alone. The first rung that passes is compiled, validated in full and
published; only one engine is ever compiled. When no rung passes, the rung with the smallest perplexity increase
is compiled and validated, and the engine is rejected with the whole table in its report.

The reference runner is opened once for the ladder and handed to validation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kiln.recipes import RECIPES, ladder
from kiln.spec import BuildSpec
from validation.gates import evaluate

#: the gates a screen judges (speed and memory are the compiled engine's, judged by validation)
ACCURACY_GATES = ("max_ppl_increase_pct", "min_top1_agreement", "max_mean_kl")


@dataclass
class Rung:
    recipe: str
    quantize_key: str
    quantized: Path
    metrics: dict
    gates: list[dict]
    seconds: dict

    @property
    def passed(self) -> bool:
        return all(g["passed"] for g in self.gates)

    def record(self) -> dict:
        keep = ("perplexity", "reference_perplexity", "ppl_increase_pct", "top1_agreement", "mean_kl", "tokens")
        return {"recipe": self.recipe, "quant_algo": RECIPES[self.recipe].quant_algo, "passed": self.passed,
                "metrics": {k: self.metrics.get(k) for k in keep}, "gates": self.gates, "seconds": self.seconds,
                "quantize_key": self.quantize_key}


def rungs_for(spec: BuildSpec) -> list[str]:
    """The ladder's rungs this spec's backend can build, in order."""
    return [r for r in ladder(spec.precision) if spec.backend in RECIPES[r].backends]


def accuracy_gates(gates: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in gates.items() if k in ACCURACY_GATES}


def screen(quantized: Path, reference, ids, seq: int, batch: int) -> dict:
    """The rung's accuracy metrics, from its exported checkpoint computed eagerly."""
    from validation.measure import accuracy
    from validation.runners import CheckpointRunner

    engine = CheckpointRunner(quantized / "hf")
    try:
        return accuracy(engine, reference, ids, seq, batch)
    finally:
        del engine


def climb(spec: BuildSpec, gates: dict[str, float], reference, ids, seq: int, batch: int,
          quantize: Callable[[BuildSpec], tuple[str, Path, float]],
          on_rung: Callable[[dict], None] = lambda r: None) -> tuple[Rung, list[Rung]]:
    """Run the ladder: ``quantize(rung_spec)`` → (its quantize key, its output dir, seconds). Returns the rung to
    compile (the first that passed, else the most accurate) and every rung tried."""
    tried: list[Rung] = []
    judged = accuracy_gates(gates)
    for name in rungs_for(spec):
        qkey, qdir, q_seconds = quantize(spec.with_recipe(name))
        t = time.perf_counter()
        metrics = screen(qdir, reference, ids, seq, batch)
        rung = Rung(name, qkey, qdir, metrics, evaluate(metrics, judged),
                    {"quantize": round(q_seconds, 3), "screen": round(time.perf_counter() - t, 3)})
        tried.append(rung)
        on_rung(rung.record())
        if rung.passed:
            return rung, tried
    best = min(tried, key=lambda r: r.metrics.get("ppl_increase_pct", float("inf")))
    return best, tried


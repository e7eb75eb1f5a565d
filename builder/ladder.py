"""``--recipe auto``: a precision's ladder (kiln/precisions.py, data), climbed inside the validate stage.

The first rung (the fastest to serve) is built as any build is: quantized, compiled, validated. When its engine
fails an accuracy gate, the next rungs are tried in order: each is quantized (under its own quantize key, so a
rung any earlier build ran is not calibrated again) and **screened** — its exported checkpoint, as transformers
computes it from the exported tensors (the numerics the compiled engine is built from), evaluated on the build's
evaluation text against the same reference runner, judged by the accuracy gates alone. The first rung that
passes is compiled and validated in full, and published; when none passes, the rung with the smallest
perplexity increase is, and its engine is rejected with the whole table in its report. A build whose first rung
passes costs what a plain build costs.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kiln.recipes import RECIPES
from kiln.spec import BuildSpec
from validation.accuracy import GATE_METRIC
from validation.gates import TASK_GATE, evaluate

#: the gates whose failure climbs the ladder (speed and memory are the compiled engine's, judged by validation). A
#: screen judges the window gates; the task gate (evaluation tasks) is judged on the chosen rung's engine.
ACCURACY_GATES = (*GATE_METRIC, TASK_GATE)
KEPT_METRICS = ("perplexity", "reference_perplexity", "ppl_increase_pct", "top1_agreement", "mean_kl", "tokens",
                "intervals", "long_windows")


@dataclass
class Rung:
    recipe: str
    quantize_key: str
    quantized: Path | None
    metrics: dict
    gates: list[dict]
    seconds: dict
    judged_on: str  # "engine": the compiled engine's validation; "screen": the exported checkpoint, eagerly
    #: how its speed was measured: a failed rung's is "not measured: …" (validation times no rejected engine)
    speed: str = "not measured: a screen judges accuracy only"

    @property
    def passed(self) -> bool:
        return all(g["passed"] for g in self.gates)

    @staticmethod
    def ppl(rung: "Rung") -> float:
        value = rung.metrics.get("ppl_increase_pct")
        return value if isinstance(value, (int, float)) and math.isfinite(value) else math.inf

    @classmethod
    def validated(cls, recipe: str, quantize_key: str, report: dict, seconds: float) -> "Rung":
        """The first rung, from its engine's validation report."""
        gates = [g for g in report.get("gates", []) if g["name"] in ACCURACY_GATES]
        speed = ((report.get("conditions") or {}).get("throughput") or {}).get("method", "measured")
        return cls(recipe, quantize_key, None, report.get("metrics") or {}, gates,
                   {"validate": round(seconds, 3)}, "engine", speed)

    def record(self) -> dict:
        return {"recipe": self.recipe, "quant_algo": RECIPES[self.recipe].quant_algo, "passed": self.passed,
                "judged_on": self.judged_on, "metrics": {k: self.metrics.get(k) for k in KEPT_METRICS},
                "gates": self.gates, "seconds": self.seconds, "quantize_key": self.quantize_key, "speed": self.speed}


def accuracy_gates(gates: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in gates.items() if k in ACCURACY_GATES}


def accuracy_passed(report: dict) -> bool:
    return all(g["passed"] for g in report.get("gates", []) if g["name"] in ACCURACY_GATES)


def screen_dtype(spec: BuildSpec, quantized: Path):
    """What the rung's engine would compute in, as its backend says (an aot-inductor engine of a bf16 checkpoint on
    a CPU with native bf16 computes in bf16; the others in float32, the checkpoint runner's)."""
    from builder.backends import get_backend

    return get_backend(spec.backend).compute_dtype(spec, quantized)


def screen(quantized: Path, reference, text, batches: list[int], dtype=None, gates: dict | None = None) -> dict:
    """A rung's accuracy metrics, from its exported checkpoint computed eagerly (in ``dtype``: float32 unless
    given), against ``reference`` (the reference's stored windows at each length, or its runner) on ``text``
    (validation.validate.EvalText); with ``gates``, evaluated sequentially until they are decided, as validation
    is, at every window length."""
    import torch

    from validation.accuracy import accuracy_at_lengths
    from validation.runners import CheckpointRunner

    return accuracy_at_lengths(CheckpointRunner(quantized / "hf", dtype or torch.float32), reference, text.ids,
                               text.lengths, batches, gates, convention=text.convention)


def climb(spec: BuildSpec, rungs: list[str], gates: dict[str, float], reference, text, batches: list[int],
          quantize: Callable[[BuildSpec], tuple[str, Path, float]],
          on_rung: Callable[[dict], None] = lambda r: None) -> tuple[Rung | None, list[Rung]]:
    """Screen ``rungs`` in order: ``quantize(rung_spec)`` → (its quantize key, its output dir, seconds). Returns
    the first that passed (None when none did) and every rung tried."""
    tried: list[Rung] = []
    judged = accuracy_gates(gates)
    for name in rungs:
        qkey, qdir, q_seconds = quantize(spec.with_recipe(name))
        t = time.perf_counter()
        metrics = screen(qdir, reference, text, batches, screen_dtype(spec, qdir), judged)
        rung = Rung(name, qkey, qdir, metrics, evaluate(metrics, judged),
                    {"quantize": round(q_seconds, 3), "screen": round(time.perf_counter() - t, 3)}, "screen")
        tried.append(rung)
        on_rung(rung.record())
        if rung.passed:
            return rung, tried
    return None, tried

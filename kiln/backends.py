"""Backends: one descriptor per way a quantized checkpoint becomes what a deployer loads, owning its rules (checked
in the spec, before any work), the families it supports, the export of the quantize stage it consumes, the
toolchain versions that bind its output, the recipes it builds, and where its compile step and its runner live.

The compile step and the runner are named as ``module:Class`` and imported when used (as vLLM's model registry
does), so the core can say what a backend is without importing torch.export or TensorRT-LLM.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from kiln.families import FAMILIES, Family
from kiln.precisions import PRECISIONS, Precision
from kiln.targets import FLOOR_SM


@dataclass(frozen=True)
class Backend:
    name: str
    title: str
    export: str  # "hf": ModelOpt's unified HF checkpoint; "trtllm": its TensorRT-LLM checkpoint (from the calibration)
    compiler: str  # module:Class of the compile step (builder/backends)
    runner: str  # module:Class of the runner validation loads the artifact with
    gpu_only: bool  # needs a GPU target (no cpu)
    tensor_parallel: bool  # tp_size > 1 allowed
    kv_cache_quant: bool  # has a KV cache to quantize
    toolchain: tuple[str, ...]  # versions beyond torch / ModelOpt / transformers that bind its output
    status: str  # what has run where (README "What has run where")
    #: toolchain entries that name what loads its output (the ``engine.runtime`` annotation, ``kiln resolve
    #: --runtime``); empty: the serving runtimes its serving configurations name (builder/serving.py)
    runtime: tuple[str, ...]
    #: a cpu build's output is machine code for the build CPU's ISA (it loads only where those features are)
    cpu_native: bool = False
    #: what a worker needs beyond CUDA torch to build it for a GPU target (workers/capabilities.py detects each)
    worker_needs: tuple[str, ...] = ()
    #: workers advertise a queue per TensorRT-LLM / TensorRT version their toolchain binds the output to
    versioned_queues: bool = False
    #: the recipes (kiln/recipes.py) it builds; None: every recipe, which is what a backend consuming the unified HF
    #: export can promise (it reads every format back through kiln/quantformat.py)
    recipes: tuple[str, ...] | None = None

    def builds(self, recipe: str) -> bool:
        """Whether this backend can build and validate ``recipe``."""
        return self.recipes is None or recipe in self.recipes

    def family_gap(self, family: Family) -> str | None:
        """Why this backend cannot build ``family``; None when it can."""
        if self.export == "trtllm" and family.trtllm_decoder is None:
            return family.trtllm_gap or f"TensorRT-LLM 1.2.x's engine path has no {family.title}"
        return None

    def min_sm(self, precision: Precision) -> int:
        """The oldest GPU architecture this backend builds ``precision`` for."""
        return precision.min_sm_for(self.export)

    def precision_gap(self, precision: Precision, sm: int | None) -> str | None:
        """Why this backend cannot build ``precision`` for a GPU of ``sm`` (None: cpu); None when it can."""
        need = self.min_sm(precision)
        if sm is not None and sm < need:
            return f"{precision.name} {'TensorRT-LLM engines need' if self.export == 'trtllm' else 'needs'} sm{need}+"
        return None

    def load(self, attr: str):
        module, _, cls = getattr(self, attr).partition(":")
        return getattr(importlib.import_module(module), cls)


BACKENDS: dict[str, Backend] = {b.name: b for b in (
    Backend("aot-inductor", "torch.export + AOTInductor package (portable engine)", "hf",
            "builder.backends.aot_inductor:AOTInductorBackend", "validation.runners:AOTInductorRunner",
            gpu_only=False, tensor_parallel=False, kv_cache_quant=False, toolchain=("cuda",),
            status="runs here (CPU); CUDA compile measured on an H200 once", runtime=("torch",), cpu_native=True),
    Backend("checkpoint", "ModelOpt unified HF checkpoint (TensorRT-LLM PyTorch backend, vLLM, SGLang)", "hf",
            "builder.backends.checkpoint:CheckpointBackend", "validation.runners:CheckpointRunner",
            gpu_only=False, tensor_parallel=False, kv_cache_quant=True, toolchain=("kiln_serving",),
            status="runs here (validated on CPU from its own tensors)", runtime=()),
    Backend("trtllm-engine", "TensorRT-LLM 1.2.x engine (trtllm-build; legacy)", "trtllm",
            "builder.backends.trtllm:TRTLLMBackend", "validation.runners:TRTLLMRunner",
            gpu_only=True, tensor_parallel=True, kv_cache_quant=True, toolchain=("tensorrt_llm", "tensorrt", "cuda"),
            status="legacy: TensorRT-LLM 1.2.x engines only (TensorRT-LLM removed trtllm-build in July 2026; from 1.3 "
                   "its PyTorch backend serves the checkpoint backend's artifact: --backend checkpoint --runtime "
                   "tensorrt-llm); written against 1.2.x, never run (no TensorRT-LLM or GPU here)",
            runtime=("tensorrt_llm", "tensorrt"), worker_needs=("tensorrt_llm",), versioned_queues=True,
            # trtllm-build takes ModelOpt's TensorRT-LLM checkpoint of a whole-model FP8 or NVFP4 recipe only
            recipes=("fp8", "nvfp4")),
)}


#: The backend a build uses when none is named, for every target: the one that builds and runs on every target here
#: (trtllm-engine has never run, so it is chosen by name). ``kiln build``, the spec, engine tags and ``kiln resolve``
#: all read it through ``default_backend`` — one answer, so a build and a resolve of the same target agree.
DEFAULT_BACKEND = "aot-inductor"


def default_backend(target: str) -> str:
    """The backend a build for ``target`` uses when none is named."""
    del target  # the same for every target today; the signature keeps the rule's home if that changes
    return DEFAULT_BACKEND


def get_backend_info(name: str) -> Backend:
    return BACKENDS[name]


def support_matrix() -> list[dict]:
    """Family × precision × backend, each with ``supported`` and the reason for a gap — generated from the
    descriptors (``kiln models``, ``GET /v1/models/support``, docs/models.md)."""
    rows = []
    for family in FAMILIES.values():
        for precision in PRECISIONS.values():
            for backend in BACKENDS.values():
                gap = backend.family_gap(family)
                rows.append({"family": family.name, "title": family.title, "model_types": list(family.model_types),
                             "precision": precision.name, "backend": backend.name, "supported": gap is None,
                             "status": backend.status if gap is None else "unsupported",
                             "reason": gap or (f"{precision.name} engines need sm{backend.min_sm(precision)}+"
                                               if backend.min_sm(precision) > FLOOR_SM else "")})
    return rows


def backends_for(family: Family) -> list[str]:
    return [b.name for b in BACKENDS.values() if b.family_gap(family) is None]

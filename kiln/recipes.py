"""Recipes: one descriptor per ModelOpt quantization recipe Kiln builds, owning which ModelOpt config it runs,
what its export is called (``quant_algo``, see kiln/precisions.py for how each format is read back), where
calibration must run, and which serving runtimes load its checkpoint under which name (which backends here build
it is each backend's rule, kiln/backends.py). A precision's ladder (``--recipe auto``) is data in its descriptor;
the ladder's runner is builder/ladder.py.

The runtime names were read from the runtimes' loaders (docs/validation.md "Recipes" has the table and its
sources); what a runtime did with a recipe when it ran is kiln/runtimes.py's. A runtime that does not load a
recipe's export gets no serving configuration for it (builder/serving.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kiln.backends import BACKENDS
from kiln.precisions import FORMATS, PRECISIONS, QuantFormat

AUTO = "auto"


@dataclass(frozen=True)
class Recipe:
    name: str  # the spec's ``recipe``
    precision: str
    title: str
    modelopt_config: str  # attribute of modelopt.torch.quantization
    quant_algo: str  # what its unified HF export names it (a key of kiln.precisions.FORMATS)
    #: what ModelOpt's calibration needs: "any" device, or "cuda" (its NVFP4 dynamic block quantization, used by
    #: AWQ's search, asks for a CUDA tensor)
    calibrate_on: str
    #: runtime → the name it loads this checkpoint under (None: it does not): TensorRT-LLM's ``QuantAlgo`` (its
    #: PyTorch backend reads ``hf_quant_config.json`` itself), vLLM's and SGLang's ``quantization`` option
    runtimes: dict[str, str | None] = field(default_factory=dict)
    #: one line on what it costs to serve against what it keeps
    why: str = ""

    @property
    def format(self) -> QuantFormat:
        return FORMATS[self.quant_algo]

    @property
    def backends(self) -> tuple[str, ...]:
        """The backends here that can build and validate it: each backend's row says which recipes it builds."""
        return tuple(b.name for b in BACKENDS.values() if b.builds(self.name))


RECIPES: dict[str, Recipe] = {r.name: r for r in (
    Recipe("fp8", "fp8", "FP8 per-tensor weights and static per-tensor activations", "FP8_DEFAULT_CFG", "FP8",
           "any",
           {"tensorrt-llm": "QuantAlgo.FP8", "vllm": "modelopt", "sglang": "modelopt_fp8"},
           "the fastest FP8 to serve: one scale per weight and per activation tensor, fixed at calibration"),
    Recipe("fp8-pcpt", "fp8", "FP8 per-channel weights and dynamic per-token activations",
           "FP8_PER_CHANNEL_PER_TOKEN_CFG", "FP8_PER_CHANNEL_PER_TOKEN", "any",
           {"tensorrt-llm": "QuantAlgo.FP8_PER_CHANNEL_PER_TOKEN", "vllm": "modelopt", "sglang": None},
           "a scale per output channel and per token (computed at run time): closer to bf16, a little slower"),
    Recipe("nvfp4", "nvfp4", "NVFP4 weights and activations, FP8 scales per 16 values", "NVFP4_DEFAULT_CFG",
           "NVFP4", "any",
           {"tensorrt-llm": "QuantAlgo.NVFP4", "vllm": "modelopt_fp4", "sglang": "modelopt_fp4"},
           "4-bit weights and activations on every decoder linear: the smallest and fastest on Blackwell"),
    Recipe("nvfp4-mlp-only", "nvfp4", "NVFP4 on the MLP linears only (attention kept in the model's dtype)",
           "NVFP4_MLP_ONLY_CFG", "NVFP4", "any",
           {"tensorrt-llm": "QuantAlgo.NVFP4", "vllm": "modelopt_fp4", "sglang": "modelopt_fp4"},
           "most of the weights (the MLP's) in 4 bits; attention's projections unquantized"),
    Recipe("nvfp4-w4a16", "nvfp4", "NVFP4 weights only, activations in the model's dtype", "W4A16_NVFP4_CFG",
           "W4A16_NVFP4", "any",
           {"tensorrt-llm": None, "vllm": "modelopt_fp4", "sglang": None},
           "4-bit weights for memory, 16-bit activations for accuracy; no 4-bit tensor-core math"),
)}


def recipes_for(precision: str) -> list[Recipe]:
    return [r for r in RECIPES.values() if r.precision == precision]


def ladder(precision: str) -> tuple[str, ...]:
    return PRECISIONS[precision].ladder


def resolved_recipe(precision: str, recipe: str | None) -> str:
    """The recipe a spec asks for: its own, or its precision's default (which may be ``auto``)."""
    return recipe or PRECISIONS[precision].default_recipe


def recipe_table() -> list[dict]:
    """Every recipe with its runtimes and backends (``kiln models``, ``GET /v1/support``, docs); what each
    runtime did with it per kind of target is kiln/runtimes.py's ``support_table``."""
    out = []
    for r in RECIPES.values():
        out.append({"recipe": r.name, "precision": r.precision, "title": r.title, "modelopt_config": r.modelopt_config,
                    "quant_algo": r.quant_algo, "activations": r.format.activations, "calibrate_on": r.calibrate_on,
                    "backends": list(r.backends), "runtimes": dict(r.runtimes),
                    "in_ladder": r.name in PRECISIONS[r.precision].ladder, "why": r.why})
    return out

"""``checkpoint``: the quantized unified Hugging Face checkpoint itself, for runtimes that load it directly
(TensorRT-LLM's PyTorch backend, vLLM, SGLang). No compile step; validated by loading the exported checkpoint
with transformers' implementation of its family (validation/runners.py ``CheckpointRunner``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from builder.backends.base import CompileStep, Kernels
from builder.serving import write_serving_configs
from kiln.spec import BuildSpec

ENGINE_FORMAT = "kiln-hf-checkpoint/1"


class CheckpointBackend(CompileStep):
    name = "checkpoint"

    def plan(self, spec: BuildSpec, quantized_dir: Path, out_dir: Path) -> dict:
        return {"commands": [], "steps": [f"copy {quantized_dir / 'hf'} to {out_dir} (no compile)"]}

    def compile(self, spec: BuildSpec, quantized_dir: Path, out_dir: Path, *, checkpoint_dir: Path,
                kernels: Kernels | None = None) -> dict:
        shutil.copytree(quantized_dir / "hf", out_dir)
        engine = {"format": ENGINE_FORMAT, "precision": spec.precision, "kv_cache": spec.kv_cache,
                  "profile": spec.batch_profile.model_dump(), "target": spec.target}
        (out_dir / "engine.json").write_text(json.dumps(engine, indent=2, sort_keys=True))
        write_serving_configs(spec, out_dir)  # serving/: trtllm-serve, vLLM and SGLang configs (builder/serving.py)
        return {"backend": self.name, "seconds": {}}

"""Loading artifacts the way a deployer loads them, behind one small interface (token ids in, logits out).

- ``aot-inductor``: the compiled ``model.pt2`` through ``torch._inductor.aoti_load_package``.
- ``checkpoint``: the exported unified HF checkpoint, dequantized from its own tensors (ModelOpt's NVFP4
  forward needs CUDA, the exported tensors do not).
- reference: the unquantized checkpoint through transformers, in float32.
- ``trtllm-engine``: the TensorRT-LLM runtime (``tensorrt_llm.runtime.ModelRunner``); GPU workers only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

import torch

from kiln.errors import StageFailed, ToolchainMissing


class Runner(Protocol):
    device: str
    kv_cache: bool

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[batch, seq] int64 → [batch, seq, vocab] float32."""


class AOTInductorRunner:
    kv_cache = False

    def __init__(self, engine_dir: Path):
        meta = json.loads((engine_dir / "engine.json").read_text())
        self.device = meta.get("device", "cpu")
        try:
            self._fn = torch._inductor.aoti_load_package(str(engine_dir / "model.pt2"))
        except Exception as exc:
            raise StageFailed(f"the AOTInductor package does not load: {type(exc).__name__}: {exc}") from exc

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        # The compiled kernels assume contiguous inputs: a strided view (e.g. windows[:, :-1]) reads garbage.
        with torch.no_grad():
            out = self._fn(input_ids.to(self.device).contiguous())
        return (out[0] if isinstance(out, (list, tuple)) else out).float().cpu()


class DequantizedCheckpointRunner:
    kv_cache = False

    def __init__(self, checkpoint_dir: Path, *, reference: bool = False):
        from kiln.llama import KilnLlama
        from kiln.quantformat import load_quantized_checkpoint, load_reference_checkpoint

        self.device = "cpu"
        load = load_reference_checkpoint if reference else load_quantized_checkpoint
        self._model = KilnLlama(load(checkpoint_dir)).eval()

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self._model(input_ids)


class TransformersRunner:
    """The unquantized reference, exactly as transformers computes it."""

    kv_cache = True

    def __init__(self, checkpoint_dir: Path):
        from transformers import AutoModelForCausalLM

        self.device = "cpu"
        self._model = AutoModelForCausalLM.from_pretrained(checkpoint_dir, dtype=torch.float32).eval()

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self._model(input_ids).logits.float()


class TRTLLMRunner:
    """TensorRT-LLM runtime, for GPU workers. Written against the 1.2.x ``ModelRunner`` API; never run here."""

    kv_cache = True

    def __init__(self, engine_dir: Path):
        try:
            from tensorrt_llm.runtime import ModelRunner  # type: ignore[import-not-found]
        except ImportError:
            raise ToolchainMissing("TensorRT-LLM is not installed; trtllm-engine artifacts validate on GPU workers",
                                   fix="run validation on a GPU worker built from the TensorRT-LLM release container") from None
        self.device = "cuda"
        self._runner = ModelRunner.from_dir(engine_dir=str(engine_dir))

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        out = self._runner.generate(
            [row for row in input_ids.int()], max_new_tokens=1, output_generation_logits=True,
            output_context_logits=True, return_dict=True, end_id=-1, pad_id=0,
        )
        return out["context_logits"].float().cpu()


def open_engine(backend: str, engine_dir: Path) -> Runner:
    if backend == "aot-inductor":
        return AOTInductorRunner(engine_dir)
    if backend == "checkpoint":
        return DequantizedCheckpointRunner(engine_dir)
    if backend == "trtllm-engine":
        return TRTLLMRunner(engine_dir)
    raise StageFailed(f"no runner for backend {backend!r}")


def open_reference(checkpoint_dir: Path) -> Runner:
    return TransformersRunner(checkpoint_dir)

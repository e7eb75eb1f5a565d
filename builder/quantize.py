"""Stage 2, quantize: ModelOpt post-training quantization (FP8 or NVFP4, optionally FP8 KV cache), calibrated
on real text, exported as both the TensorRT-LLM checkpoint (``trtllm/``: config.json + rank*.safetensors) and
the unified Hugging Face checkpoint (``hf/``: hf_quant_config.json + safetensors + tokenizer).

ModelOpt's exporters modify the model in place, so each format is exported from its own copy.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import logging
import time
import warnings
from pathlib import Path

import torch

from kiln.errors import SpecError, StageFailed
from kiln.spec import BuildSpec

log = logging.getLogger(__name__)

# model_type → ModelOpt decoder_type for the TensorRT-LLM exporter
DECODER_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen", "qwen3": "qwen", "gemma": "gemma",
                 "gemma2": "gemma2", "phi3": "phi3", "mixtral": "llama"}


def preload() -> None:
    """Import what :func:`quantize` needs (ModelOpt alone takes seconds): a long-lived worker process calls
    this when it starts, so that no build pays for it. Where ModelOpt is not installed, nothing happens here;
    the stage reports it when it runs."""
    try:
        import modelopt.torch.export  # noqa: F401
        import modelopt.torch.quantization  # noqa: F401
        from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401
    except ImportError as exc:
        log.info("not preloading the quantizer: %s", exc)


def quant_config(precision: str, kv_cache: str) -> dict:
    import modelopt.torch.quantization as mtq

    cfg = copy.deepcopy(mtq.FP8_DEFAULT_CFG if precision == "fp8" else mtq.NVFP4_DEFAULT_CFG)
    if kv_cache == "fp8":
        kv_rules = copy.deepcopy(mtq.FP8_KV_CFG["quant_cfg"])
        if isinstance(cfg["quant_cfg"], list):  # ModelOpt ≥ 0.4x: an ordered list of rules
            cfg["quant_cfg"] = cfg["quant_cfg"] + list(kv_rules)
        else:  # older releases: a dict of patterns
            cfg["quant_cfg"].update(kv_rules)
    return cfg


def calibration_batches(tokenizer, text: str, samples: int, seq_len: int) -> torch.Tensor:
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"][0]
    need = samples * seq_len
    if len(ids) < need:
        raise SpecError(f"the calibration text has {len(ids)} tokens, {samples}×{seq_len} = {need} needed",
                        field="calibration.samples", fix="lower calibration.samples or seq_len, or give a longer text")
    return ids[:need].view(samples, seq_len)


def _device(spec: BuildSpec) -> str:
    return "cuda" if spec.target != "cpu" and torch.cuda.is_available() else "cpu"


def quantize(checkpoint_dir: Path, spec: BuildSpec, calib_text: str, out_dir: Path) -> dict:
    """Calibrate and export into ``out_dir`` (which must not exist yet). Returns the stage's record."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint, export_tensorrt_llm_checkpoint
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = _device(spec)
    config = json.loads((checkpoint_dir / "config.json").read_text())
    decoder = DECODER_TYPES.get(config.get("model_type", ""))
    if decoder is None:
        raise SpecError(f"model_type {config.get('model_type')!r} has no TensorRT-LLM export in Kiln",
                        field="checkpoint", fix=f"use a model of type {', '.join(DECODER_TYPES)}")
    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint_dir)
    model = AutoModelForCausalLM.from_pretrained(checkpoint_dir, dtype="auto").to(device).eval()
    batches = calibration_batches(tokenizer, calib_text, spec.calibration.samples, spec.calibration.seq_len).to(device)

    def forward_loop(m):
        with torch.no_grad():
            for i in range(0, len(batches), 8):
                m(batches[i : i + 8])

    t1 = time.perf_counter()
    library_log = io.StringIO()  # ModelOpt prints progress to stdout; keep it in the stage record instead
    with warnings.catch_warnings(), contextlib.redirect_stdout(library_log):
        warnings.simplefilter("ignore")
        try:
            model = mtq.quantize(model, quant_config(spec.precision, spec.kv_cache), forward_loop)
        except Exception as exc:  # ModelOpt raises many types; the message is what a user needs
            raise StageFailed(f"ModelOpt calibration failed: {type(exc).__name__}: {exc}") from exc
        t2 = time.perf_counter()
        out_dir.mkdir(parents=True)
        try:
            export_tensorrt_llm_checkpoint(copy.deepcopy(model), decoder, dtype=model.dtype,
                                           export_dir=out_dir / "trtllm", inference_tensor_parallel=spec.tp_size)
            export_hf_checkpoint(copy.deepcopy(model), export_dir=out_dir / "hf")
        except Exception as exc:
            raise StageFailed(f"ModelOpt export failed: {type(exc).__name__}: {exc}") from exc
    tokenizer.save_pretrained(out_dir / "hf")
    t3 = time.perf_counter()
    quantized = sum(1 for n, m in model.named_modules() if n.endswith("weight_quantizer") and m.is_enabled)
    record = {
        "precision": spec.precision, "kv_cache": spec.kv_cache, "device": device, "decoder_type": decoder,
        "calibration": {**spec.calibration.model_dump(), "tokens": int(batches.numel())},
        "quantized_linears": quantized,
        "seconds": {"load": round(t1 - t0, 3), "calibrate": round(t2 - t1, 3), "export": round(t3 - t2, 3)},
        "log": library_log.getvalue().splitlines()[-50:],
        "hf_quant_config": json.loads((out_dir / "hf" / "hf_quant_config.json").read_text()),
    }
    (out_dir / "quantize.json").write_text(json.dumps(record, indent=2))
    return record

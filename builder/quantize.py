"""Stage 2, quantize: ModelOpt post-training quantization (the precision's ModelOpt config, optionally FP8 KV
cache), calibrated on real text, exported as the unified Hugging Face checkpoint (``hf/``: safetensors, config.json
with its ``quantization_config``, hf_quant_config.json, tokenizer, generation config) — the export every backend
that runs here consumes — plus the calibration itself (``calibration/``: ModelOpt's state and the quantizers'
amax buffers, no weights), from which :func:`export_trtllm_checkpoint` makes the TensorRT-LLM checkpoint when a
``trtllm-engine`` build asks for one. The stage key has no backend, so switching backend never re-calibrates.

The model is loaded in the checkpoint's own dtype (bf16 for bf16 checkpoints) and not copied: the unified export
modifies it in place, and it is the last thing done with it.
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
from kiln.families import family_of
from kiln.kvcache import KV_CACHES
from kiln.progress import report
from kiln.recipes import AUTO, RECIPES
from kiln.spec import BuildSpec
from validation.text import calibration_rows, convention_of, stream

log = logging.getLogger(__name__)
#: files of the source checkpoint the unified export carries over when ModelOpt does not write them
CARRIED = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
           "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja")


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


def _add_rules(cfg: dict, rules: list[dict]) -> None:
    """Append ``rules`` ([{quantizer_name, enable | cfg}], later rules win) to a ModelOpt config."""
    if isinstance(cfg["quant_cfg"], list):  # ModelOpt ≥ 0.4x: an ordered list of rules
        cfg["quant_cfg"] = cfg["quant_cfg"] + rules
    else:  # older releases: a dict of patterns
        for rule in rules:
            rule = dict(rule)
            cfg["quant_cfg"][rule.pop("quantizer_name")] = rule.get("cfg", {"enable": rule.get("enable")})


def quant_config(recipe: str, kv_cache: str, unquantized_layers: tuple[int, ...] = (), num_layers: int = 0) -> dict:
    """The recipe's ModelOpt config, with the KV cache's rules (kiln/kvcache.py) and the layers kept unquantized
    added."""
    import modelopt.torch.quantization as mtq

    cfg = copy.deepcopy(getattr(mtq, RECIPES[recipe].modelopt_config))
    if (kv_config := KV_CACHES[kv_cache].modelopt_config) is not None:
        kv = copy.deepcopy(getattr(mtq, kv_config)["quant_cfg"])
        _add_rules(cfg, list(kv) if isinstance(kv, list) else [{"quantizer_name": k, "cfg": v} for k, v in kv.items()])
    if unquantized_layers:
        # "*layers.1.*" matches layer 1's quantizers and not layer 11's: the index ends at a dot
        _add_rules(cfg, [{"quantizer_name": f"*layers.{i % num_layers}.*", "enable": False}
                         for i in sorted({i % num_layers for i in unquantized_layers})])
    return cfg


def calibration_batches(tokenizer, text: str, samples: int, seq_len: int) -> torch.Tensor:
    """``samples`` rows of ``seq_len`` tokens, each as the checkpoint's tokenizer starts a text (its BOS first where
    it adds one: validation/text.py), so calibration sees the activations the served model sees."""
    try:
        return calibration_rows(stream(tokenizer, text), samples, seq_len, convention_of(tokenizer))
    except ValueError as exc:
        raise SpecError(f"the calibration text has {exc}", field="calibration.samples",
                        fix="lower calibration.samples or seq_len, or give a longer text") from None


def _device(spec: BuildSpec) -> str:
    return "cuda" if spec.target != "cpu" and torch.cuda.is_available() else "cpu"


def load_source_model(checkpoint_dir: Path, device: str):
    from transformers import AutoModelForCausalLM

    # typed as the torch module it is: transformers wraps Module.to (functools.wraps), whose stub then wants the model
    # as the first argument
    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(checkpoint_dir, dtype="auto")
    return model.to(device).eval()


def save_calibration(model, out: Path) -> None:
    """ModelOpt's state and the quantizers' buffers (amax): what restores the calibrated model on the source
    weights, without a second copy of the weights."""
    import modelopt.torch.opt as mto

    out.mkdir(parents=True)
    quantizers = {k: v.detach().cpu() for k, v in model.state_dict().items() if "_quantizer." in k}
    torch.save({"modelopt_state": mto.modelopt_state(model), "quantizers": quantizers}, out / "calibration.pt")


def restore_calibration(checkpoint_dir: Path, calibration_dir: Path, device: str):
    """The source model with the saved calibration applied (no forward pass: nothing is re-calibrated)."""
    import modelopt.torch.opt as mto

    saved = torch.load(calibration_dir / "calibration.pt", map_location=device, weights_only=False)
    model = mto.restore_from_modelopt_state(load_source_model(checkpoint_dir, device), saved["modelopt_state"])
    missing = set(saved["quantizers"]) - set(model.state_dict())
    if missing:
        raise StageFailed(f"the saved calibration does not fit this checkpoint ({len(missing)} quantizer buffers unknown)")
    model.load_state_dict(saved["quantizers"], strict=False)
    return model


def quantize(checkpoint_dir: Path, spec: BuildSpec, calib_text: str, out_dir: Path) -> dict:
    """Calibrate and export into ``out_dir`` (which must not exist yet). Returns the stage's record."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoTokenizer

    recipe = spec.recipe_name
    if recipe == AUTO:
        raise StageFailed("quantize takes one recipe; --recipe auto is run by builder/ladder.py, a rung at a time")
    device = _device(spec)
    config = json.loads((checkpoint_dir / "config.json").read_text())
    family = family_of(config)
    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint_dir)
    model = load_source_model(checkpoint_dir, device)
    batches = calibration_batches(tokenizer, calib_text, spec.calibration.samples, spec.calibration.seq_len).to(device)

    def forward_loop(m):
        steps = (len(batches) + 7) // 8
        with torch.no_grad():
            for i in range(0, len(batches), 8):
                report("calibration batch", i // 8 + 1, steps)
                m(batches[i : i + 8])

    t1 = time.perf_counter()
    library_log = io.StringIO()  # ModelOpt prints progress to stdout; keep it in the stage record instead
    with warnings.catch_warnings(), contextlib.redirect_stdout(library_log):
        warnings.simplefilter("ignore")
        try:
            cfg = quant_config(recipe, spec.kv_cache, spec.unquantized_layers, int(config.get("num_hidden_layers") or 1))
            model = mtq.quantize(model, cfg, forward_loop)
        except Exception as exc:  # ModelOpt raises many types; the message is what a user needs
            raise StageFailed(f"ModelOpt calibration failed: {type(exc).__name__}: {exc}") from exc
        t2 = time.perf_counter()
        out_dir.mkdir(parents=True)
        quantized = sum(1 for n, m in model.named_modules() if n.endswith("weight_quantizer") and m.is_enabled)
        save_calibration(model, out_dir / "calibration")
        try:
            export_hf_checkpoint(model, export_dir=out_dir / "hf")  # in place: the model is not used after this
        except Exception as exc:
            raise StageFailed(f"ModelOpt export failed: {type(exc).__name__}: {exc}") from exc
    del model
    tokenizer.save_pretrained(out_dir / "hf")
    for name in CARRIED:
        if (checkpoint_dir / name).is_file() and not (out_dir / "hf" / name).exists():
            (out_dir / "hf" / name).write_bytes((checkpoint_dir / name).read_bytes())
    t3 = time.perf_counter()
    hf_quant = out_dir / "hf" / "hf_quant_config.json"
    record = {
        "precision": spec.precision, "recipe": recipe, "modelopt_config": RECIPES[recipe].modelopt_config,
        "unquantized_layers": list(spec.unquantized_layers), "kv_cache": spec.kv_cache, "device": device,
        "family": family.name,
        "calibration": {**spec.calibration.model_dump(), "tokens": int(batches.numel()),
                        "text": convention_of(tokenizer).as_dict(tokenizer)},
        "quantized_linears": quantized, "exports": ["hf"],
        "seconds": {"load": round(t1 - t0, 3), "calibrate": round(t2 - t1, 3), "export": round(t3 - t2, 3)},
        "log": library_log.getvalue().splitlines()[-50:],
        "hf_quant_config": json.loads(hf_quant.read_text()) if hf_quant.is_file() else
        json.loads((out_dir / "hf" / "config.json").read_text()).get("quantization_config"),
    }
    (out_dir / "quantize.json").write_text(json.dumps(record, indent=2))
    return record


def export_trtllm_checkpoint(checkpoint_dir: Path, quantized_dir: Path, spec: BuildSpec, out_dir: Path) -> dict:
    """ModelOpt's TensorRT-LLM checkpoint (``config.json`` + ``rank{N}.safetensors``) from the saved calibration,
    for ``trtllm-engine`` builds only. ``export_tensorrt_llm_checkpoint`` is deprecated upstream and goes away in
    ModelOpt 0.49: the TensorRT-LLM 1.2.x release container's ModelOpt still has it."""
    try:
        from modelopt.torch.export import export_tensorrt_llm_checkpoint as export
    except ImportError as exc:
        raise StageFailed("this ModelOpt has no export_tensorrt_llm_checkpoint (removed in 0.49); trtllm-engine "
                          "builds run in the TensorRT-LLM 1.2.x release container, whose ModelOpt has it") from exc
    family = family_of(json.loads((checkpoint_dir / "config.json").read_text()))
    device = _device(spec)
    t0 = time.perf_counter()
    library_log = io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stdout(library_log):
        warnings.simplefilter("ignore")
        model = restore_calibration(checkpoint_dir, quantized_dir / "calibration", device)
        try:
            export(model, family.trtllm_decoder, dtype=model.dtype, export_dir=out_dir,
                   inference_tensor_parallel=spec.tp_size)
        except Exception as exc:
            raise StageFailed(f"ModelOpt's TensorRT-LLM export failed for {family.title}: "
                              f"{type(exc).__name__}: {exc}") from exc
    return {"decoder_type": family.trtllm_decoder, "seconds": round(time.perf_counter() - t0, 3),
            "log": library_log.getvalue().splitlines()[-20:]}

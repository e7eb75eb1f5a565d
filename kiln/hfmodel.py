"""The model an engine computes: transformers' own implementation of the checkpoint's family, built from the
exported checkpoint's config, holding the weights dequantized from the exported tensors, with activation
quantization emulated from the exported ``input_scale`` values. No family has a hand-written model.

- Weights go through ``from_pretrained(None, config=…, state_dict=…)``, so transformers applies its own checkpoint
  conversions (e.g. the per-expert ``experts.N.w1`` tensors of a Mixtral checkpoint fused into
  ``experts.gate_up_proj``); a tensor it does not take, or a parameter left without one, is an error.
- Activation quantization: a forward pre-hook on each quantized ``nn.Linear`` fake-quantizes its input with the
  precision's quantizer and that linear's exported scale. Fused MoE experts (one module computing every expert)
  take their input quantized with the largest of the experts' gate/up input scales (what serving runtimes do: one
  activation scale per fused GEMM); the experts' down projections run on unquantized intermediates — recorded in
  :attr:`EngineModel.emulation`. Linears that share an input and its scale (q, k, v; gate, up) share one
  quantize-dequantize (:class:`_SharedInput`). A static scale is a float32 buffer of its module
  (:data:`INPUT_SCALE`), so an exported engine holds it as a constant beside the weights, never as a number in its
  code: another checkpoint of the architecture runs on the same compiled code with its own scales.
- :class:`LogitsOnly` is the export surface: ``input_ids [batch, seq] → logits [batch, seq, vocab]``, without a KV
  cache, which is what ``torch.export`` takes with dynamic batch and sequence ranges. The logits come out in the
  dtype the model computes in, as transformers returns them and as serving runtimes do (TensorRT-LLM's engines
  return float16 logits): a bf16 engine that widened them to float32 would write twice the bytes of its largest
  tensor for nothing, since a bf16 head's products are already rounded to bf16.
- Rotary embeddings in an exported engine (:func:`tabulate_rotary`): cos/sin looked up by position from tables
  computed once at export, not recomputed in every layer's kernel.
- Attention in an exported engine (:data:`CAUSAL_SDPA`): transformers' SDPA path passes an explicit causal mask
  whenever it is traced (it cannot prove the absence of padding then), and SDPA with a mask computes the whole
  square where ``is_causal`` skips the upper triangle (on a 2-core AVX512-BF16 CPU, 9 heads of 64 in bf16: 1.05 ×
  the causal kernel's time at 512 tokens, 1.6 × at 2,048; a 25 M-parameter engine 1–3 % faster end to end). An engine's input is
  unpadded whole sequences without a cache, so its mask is exactly causal: a plain causal layer runs SDPA with
  ``is_causal``; a layer with anything more (a sliding window, soft-capping, sinks, a position bias) runs
  transformers' own SDPA path with the mask, as before.
"""

from __future__ import annotations

from typing import Any

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from kiln.errors import StageFailed
from kiln.families import Family, family_of
from kiln.quantformat import ExportedCheckpoint, load_exported

#: the attention implementation an exported engine runs (registered with transformers on first use)
CAUSAL_SDPA = "kiln_causal_sdpa"
#: the buffer holding a quantized module's static activation scale (float32, 0-d)
INPUT_SCALE = "kiln_input_scale"


def _causal_sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                 **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``is_causal`` SDPA for a plain causal layer on whole sequences
    (the engine's only input), transformers' SDPA with the mask for any other layer."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    extra = (kwargs.get("sliding_window"), kwargs.get("softcap"), kwargs.get("position_bias"),
             getattr(module, "sliding_window", None), getattr(module, "sinks", None))
    if (any(x is not None for x in extra) or dropout or not getattr(module, "is_causal", True)
            or query.shape[2] != key.shape[2]):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    out = nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _register_causal_sdpa() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(CAUSAL_SDPA, _causal_sdpa)
    AttentionMaskInterface.register(CAUSAL_SDPA, sdpa_mask)  # the mask, for the layers that still take it


#: rotary types whose frequencies change with the sequence (transformers' ``dynamic_rope_update``): never tabulated
SEQUENCE_DEPENDENT_ROPE = ("dynamic", "longrope")


def _static_rope(module: nn.Module) -> bool:
    kinds = getattr(module, "rope_type", "default")
    return not any(d in str(k) for k in (kinds.values() if isinstance(kinds, dict) else [kinds])
                   for d in SEQUENCE_DEPENDENT_ROPE)


def tabulate_rotary(model: nn.Module, length: int) -> str:
    """Give each rotary embedding of ``model`` its cos/sin for positions ``0 … length-1``, computed once here
    exactly as transformers computes them (rounded to the model's dtype, as it does), and make its forward a lookup
    by position. Returns what was done, for the engine's record.

    An engine's input is a whole sequence of at most ``length`` tokens, so its positions are ``0 … seq-1``. Traced as
    transformers writes it, the compiler fuses the cheap cos/sin producer into each consumer: every layer's rotary
    kernel recomputes a sin and a cos per value for each query and key head (SmolLM2-135M: 30 layers × 12 heads,
    where eager computes them once), in a kernel that runs on one thread at batch 1. A table costs
    ``2 × length × head_dim`` values per rotary kind. Rotary types whose frequencies depend on the sequence length
    (dynamic NTK, LongRoPE) keep transformers' computation, as does a rotary embedding called with keyword
    arguments (none is, as of transformers 5.14). One called with extra arguments (Gemma 3: the layer type) gets a
    table for each value it is called with, found by running the model once on two tokens."""
    static = [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding") and _static_rope(m)]
    if not static:
        return "computed in every forward (no rotary embedding with sequence-independent frequencies)"
    calls: dict[nn.Module, dict] = {m: {} for m in static}
    plain = {m: m.forward for m in static}

    def recording(m: nn.Module):
        def forward(x: torch.Tensor, position_ids: torch.Tensor, *rest: Any, **kw: Any):
            calls[m][rest if not kw else None] = (x.dtype, x.device)
            return plain[m](x, position_ids, *rest, **kw)
        return forward

    for m in static:
        m.forward = recording(m)
    try:
        device = next(model.parameters()).device
        with torch.no_grad():
            model(input_ids=torch.zeros((1, 2), dtype=torch.long, device=device), use_cache=False)
    finally:
        for m in static:
            m.forward = plain[m]
    tabulated = 0
    for m in static:
        if not calls[m] or None in calls[m]:
            continue
        tables = {}
        for i, (rest, (dtype, dev)) in enumerate(calls[m].items()):
            with torch.no_grad():
                cos, sin = plain[m](torch.zeros(1, dtype=dtype, device=dev),
                                    torch.arange(length, device=dev)[None], *rest)
            m.register_buffer(f"kiln_cos_{i}", cos[0].contiguous(), persistent=False)
            m.register_buffer(f"kiln_sin_{i}", sin[0].contiguous(), persistent=False)
            tables[rest] = i

        def lookup(x: torch.Tensor, position_ids: torch.Tensor, *rest: Any, m=m, tables=tables):
            i = tables[rest]
            return getattr(m, f"kiln_cos_{i}")[position_ids], getattr(m, f"kiln_sin_{i}")[position_ids]

        m.forward = lookup
        tabulated += len(tables)
    if not tabulated:
        return "computed in every forward (no rotary embedding was called with positional arguments only)"
    count = f"{tabulated} table{'s' if tabulated > 1 else ''}"
    return f"cos/sin tabulated for positions < {length} ({count}), looked up by position"


EXPERT_INPUT = re.compile(r"^(?P<layer>.+)\.(?:block_sparse_moe|mlp)\.experts\.\d+\.(?P<proj>w1|w3|gate_proj|up_proj|w2|down_proj)$")


@dataclass
class EngineModel:
    model: nn.Module
    family: Family
    checkpoint: ExportedCheckpoint
    emulation: dict = field(default_factory=dict)


class LogitsOnly(nn.Module):
    """The causal LM as an engine: token ids in, logits out in the dtype the model computes in, no cache."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits


def _config(ckpt: ExportedCheckpoint):
    from transformers import AutoConfig

    d = dict(ckpt.config)
    model_type = d.pop("model_type")
    for key in ("_name_or_path", "transformers_version", "torch_dtype", "dtype"):
        d.pop(key, None)
    return AutoConfig.for_model(model_type, **d)


def _quantize_inputs(model: nn.Module, ckpt: ExportedCheckpoint) -> dict:
    """Register the activation fake-quantizers; returns what was emulated. A static format quantizes each linear's
    input with its exported ``input_scale``; a dynamic one every quantized linear's input per token; a weight-only
    one nothing."""
    fmt = ckpt.format
    if fmt is None:
        return {"activations": "none (unquantized checkpoint)"}
    if fmt.activations == "none":
        return {"activations": f"none ({fmt.quant_algo} is weight-only)"}
    scales: dict[str, float | None] = (dict(ckpt.input_scales) if fmt.activations == "static"
                                       else dict.fromkeys(ckpt.quantized))
    modules = dict(model.named_modules())
    shared = _SharedInput()
    model.register_forward_pre_hook(shared.clear)
    model.register_forward_hook(shared.clear)
    hooked, experts, missing = 0, dict[str, float | None](), list[str]()
    for name, scale in scales.items():
        target = modules.get(name)
        if isinstance(target, nn.Linear):
            _hook(target, fmt.fake_quant, scale, shared)
            hooked += 1
            continue
        m = EXPERT_INPUT.match(name)
        if m is None:
            missing.append(name)
            continue
        fused = next((f"{m['layer']}.{p}.experts" for p in ("mlp", "block_sparse_moe")
                      if f"{m['layer']}.{p}.experts" in modules), None)
        if fused is None:
            missing.append(name)
        elif m["proj"] in ("w1", "w3", "gate_proj", "up_proj"):
            experts[fused] = None if scale is None else max(experts.get(fused) or 0.0, scale)
    if missing:
        raise StageFailed(f"{len(missing)} quantized inputs name no module of the model (e.g. {missing[0]})")
    for fused, scale in experts.items():
        _hook(modules[fused], fmt.fake_quant, scale, shared)
    how = "from their exported input_scale" if fmt.activations == "static" else "per token (dynamic scales)"
    out = {"activations": f"{fmt.precision} emulated on {hooked} linears {how}"}
    if experts:
        out["experts"] = (f"{len(experts)} fused expert blocks take their input quantized "
                          + ("with the largest expert gate/up input_scale" if fmt.activations == "static"
                             else "per token") + "; expert down projections are not activation-quantized")
    return out


class _SharedInput:
    """The last input fake-quantized and its result. Linears that read the same tensor at the same scale (q, k and
    v; gate and up — ModelOpt exports one input_scale for each such group, and a per-token scale depends only on
    the tensor) get it quantized once: eagerly, and in the graph torch.export traces, where one
    quantize-dequantize then feeds the group's matmuls. Held for one forward only (the model's hooks clear it)."""

    def __init__(self) -> None:
        self.last: tuple | None = None

    def __call__(self, fake_quant, x: torch.Tensor, scale: float | None,
                 tensor: torch.Tensor | None = None) -> torch.Tensor:
        """``scale`` decides what is shared; ``tensor`` (the scale as a buffer, when given) is what is computed with."""
        last = self.last
        if last is not None and last[0] is x and last[1] == scale:
            return last[2]
        y = fake_quant(x) if scale is None else fake_quant(x, scale if tensor is None else tensor)
        self.last = (x, scale, y)
        return y

    def clear(self, *_) -> None:
        self.last = None


def _hook(module: nn.Module, fake_quant, scale: float | None, shared: _SharedInput) -> None:
    """``scale`` None: a dynamic quantizer (``fake_quant(x)``); else a static one, skipped for a zero scale, that
    computes with the module's :data:`INPUT_SCALE` buffer (a constant of an exported graph, not a literal in it)."""
    if scale is not None and not scale > 0:
        return
    if scale is not None:
        module.register_buffer(INPUT_SCALE, torch.tensor(scale, dtype=torch.float32), persistent=False)

    def pre(_, args):
        return (shared(fake_quant, args[0], scale, None if scale is None else getattr(module, INPUT_SCALE)), *args[1:])

    module.register_forward_pre_hook(pre)


def load_engine_model(directory: Path, *, dtype: torch.dtype = torch.float32, for_export: bool = False,
                      device: str = "cpu") -> EngineModel:
    """The exported checkpoint in ``directory`` as transformers computes it (see the module docstring).

    ``for_export``: the model is going into an AOTInductor package, which must load without Python. transformers'
    default MoE kernel on CPU is a Python custom op (``transformers::grouped_mm_fallback``) that a package cannot
    call, so experts use ``batched_mm`` there (plain gathers and batched matmuls; on CUDA, ``grouped_mm`` is
    ``torch._grouped_mm``, a native op)."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING
    from transformers.utils import logging as hf_logging

    ckpt = load_exported(directory)
    family = family_of(ckpt.config)
    config = _config(ckpt)
    state = {k: v.to(dtype) for k, v in ckpt.state.items()}
    extra = {}
    if for_export and family.moe:
        extra["experts_implementation"] = "batched_mm" if device == "cpu" else "grouped_mm"
    if for_export:
        _register_causal_sdpa()
        extra["attn_implementation"] = CAUSAL_SDPA
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()  # the loading report is checked below, not printed
    hf_logging.disable_progress_bar()
    try:
        model_class: Any = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]  # a class, typed loosely by transformers
        model, info = model_class.from_pretrained(None, config=config, state_dict=state, dtype=dtype,
                                                  output_loading_info=True, **extra)
    except Exception as exc:
        raise StageFailed(f"transformers could not build {family.title} from the exported checkpoint: "
                          f"{type(exc).__name__}: {exc}") from exc
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    missing = [k for k in info.get("missing_keys", []) if k not in tied]
    unexpected = list(info.get("unexpected_keys", []))
    mismatched = list(info.get("mismatched_keys", []))
    if missing or unexpected or mismatched:
        raise StageFailed(f"the exported tensors do not fill transformers' {family.title}: "
                          f"missing {missing[:3]}, unused {unexpected[:3]}, mismatched {mismatched[:3]}")
    model.eval()
    emulation = _quantize_inputs(model, ckpt)
    if "experts_implementation" in extra:
        emulation["experts_kernel"] = extra["experts_implementation"]
    if for_export:
        emulation["attention"] = CAUSAL_SDPA
    return EngineModel(model, family, ckpt, emulation)

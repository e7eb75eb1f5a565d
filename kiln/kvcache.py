"""KV caches: one descriptor per value of the spec's ``kv_cache``, owning every rule about it — the names a spec
may give and the error for another, which backends can build it, the ModelOpt rules that quantize it, what an
export names it (``kv_cache_quant_algo``) and the scale tensors it writes, each serving runtime's name for it, and
what a TensorRT-LLM engine built with it has (``trtllm-build`` flags, ``plugin_config`` entries). Every precision
takes every KV cache (the cache's quantizers are apart from the weights' and activations'). Nothing outside this
module compares KV-cache names.

Sources: ModelOpt 0.47's ``FP8_KV_CFG`` (rules for the attention's ``k_bmm_quantizer``/``v_bmm_quantizer``) and its
exports (``k_proj.output_scale``/``v_proj.output_scale`` in the TensorRT-LLM checkpoint, ``k_scale``/``v_scale`` in
the unified HF one); TensorRT-LLM 1.2.x ``kv_cache_config.dtype`` and ``trtllm-build`` (builder/backends/trtllm.py);
vLLM 0.19 and SGLang 0.5 ``kv-cache-dtype`` (builder/serving.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kiln.backends import BACKENDS, Backend


@dataclass(frozen=True)
class KVCache:
    name: str  # the spec's value
    title: str
    #: quantized: only a backend whose engine keeps a KV cache can build it (``Backend.kv_cache_quant``)
    quantized: bool
    #: attribute of ``modelopt.torch.quantization`` whose ``quant_cfg`` rules are added to the recipe's (None: none)
    modelopt_config: str | None
    #: what an export's quantization block names it (``kv_cache_quant_algo``; None: not quantized)
    quant_algo: str | None
    #: serving runtime (kiln/runtimes.RUNTIMES) → its name for this cache ("auto": the checkpoint's own dtype)
    runtimes: dict[str, str]
    #: tensors the quantize stage exports beside the attention projections (read by runtimes with a KV cache)
    scale_suffixes: tuple[str, ...] = ()
    #: ``trtllm-build`` flags that say how a TensorRT-LLM engine reads this cache
    trtllm_build_flags: tuple[tuple[str, str], ...] = ()
    #: ``build_config.plugin_config`` entries an engine built with those flags has, and why (for the mismatch error)
    trtllm_plugins: dict[str, bool] = field(default_factory=dict)
    trtllm_plugins_why: str = ""


KV_CACHES: dict[str, KVCache] = {k.name: k for k in (
    KVCache("none", "the model's dtype (not quantized)", quantized=False, modelopt_config=None, quant_algo=None,
            runtimes={"tensorrt-llm": "auto", "vllm": "auto", "sglang": "auto"}),
    KVCache("fp8", "FP8 (e4m3) keys and values, one scale per tensor", quantized=True, modelopt_config="FP8_KV_CFG",
            quant_algo="FP8", runtimes={"tensorrt-llm": "fp8", "vllm": "fp8", "sglang": "fp8_e4m3"},
            scale_suffixes=("k_scale", "v_scale", "k_proj.output_scale", "v_proj.output_scale"),
            trtllm_build_flags=(("--use_paged_context_fmha", "enable"), ("--use_fp8_context_fmha", "enable")),
            trtllm_plugins={"context_fmha": True, "use_paged_context_fmha": True, "use_fp8_context_fmha": True},
            trtllm_plugins_why="an FP8 KV cache is read by FP8 (paged) context FMHA"),
)}
#: a spec without ``kv_cache``
DEFAULT_KV_CACHE = "none"
#: every KV-cache scale an export may hold: consumed (not emulated) by Kiln's full-sequence engines
KV_SCALE_SUFFIXES = tuple(dict.fromkeys(s for k in KV_CACHES.values() for s in k.scale_suffixes))


def kv_cache_error(value: object) -> dict | None:
    """The spec error (field ``kv_cache``, with its fix) for a value no descriptor has; None for a known one."""
    if value in KV_CACHES:
        return None
    return {"field": "kv_cache", "message": f"{value!r} is not supported", "fix": f"use one of: {', '.join(KV_CACHES)}"}


def backend_gap(kv_cache: KVCache, backend: Backend) -> dict | None:
    """The spec error when ``backend`` cannot build ``kv_cache`` (a quantized cache needs an engine that keeps one)."""
    if not kv_cache.quantized or backend.kv_cache_quant:
        return None
    able = [b.name for b in BACKENDS.values() if b.kv_cache_quant]
    return {"field": "kv_cache", "message": f"{backend.name} engines have no KV cache to quantize",
            "fix": f"use --kv-cache {DEFAULT_KV_CACHE}, or --backend {' / '.join(able)}"}

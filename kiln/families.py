"""Model families: one descriptor per open-weight family Kiln builds, owning how a checkpoint is recognised (its
config.json's ``model_type`` and ``architectures``), what distinguishes it, which TensorRT-LLM paths know it and
what ModelOpt calls it. Every family is computed by transformers' own implementation (never a hand-written copy),
so a family here is a table row, not a model.

:func:`family_of` is checked before any work (the API's submit and the CLI's planning read only config.json):
an unknown, multimodal or non-causal checkpoint, or a family × backend pair that is not supported, is a
:class:`~kiln.errors.SpecError` naming ``checkpoint``, the family and the backends that do take it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.errors import SpecError


@dataclass(frozen=True)
class Family:
    name: str
    title: str
    model_types: tuple[str, ...]  # config.json "model_type"
    architectures: tuple[str, ...]  # config.json "architectures" (the causal-LM class)
    features: tuple[str, ...]  # what distinguishes it, as the tests' tiny models keep it
    #: ModelOpt's ``decoder_type`` for ``export_tensorrt_llm_checkpoint`` and TensorRT-LLM 1.2.x's engine path
    #: (``tensorrt_llm/models/__init__.py`` MODEL_MAP); None where that path does not know the family
    trtllm_decoder: str | None
    trtllm_gap: str = ""  # why there is no engine path, when there is none
    moe: bool = False


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("llama", "Llama 2 / Llama 3.x", ("llama",), ("LlamaForCausalLM",),
           ("llama3 rope scaling", "tied or untied embeddings", "GQA"), "llama"),
    Family("mistral", "Mistral", ("mistral",), ("MistralForCausalLM",), ("sliding-window attention", "GQA"), "llama"),
    Family("qwen2", "Qwen2 / Qwen2.5", ("qwen2",), ("Qwen2ForCausalLM",), ("q/k/v biases", "GQA"), "qwen"),
    Family("qwen3", "Qwen3", ("qwen3",), ("Qwen3ForCausalLM",), ("q/k norm", "head_dim ≠ hidden/heads"), "qwen"),
    Family("gemma2", "Gemma 2", ("gemma2",), ("Gemma2ForCausalLM",),
           ("logit soft-capping", "sliding-window layers", "scaled embeddings", "(1 + w) RMSNorm"), "gemma2"),
    Family("gemma3", "Gemma 3 (text)", ("gemma3_text",), ("Gemma3ForCausalLM",),
           ("q/k norm", "sliding-window layers", "scaled embeddings", "(1 + w) RMSNorm"), "gemma3"),
    Family("phi3", "Phi-3 / Phi-4", ("phi3",), ("Phi3ForCausalLM",), ("fused qkv_proj", "fused gate_up_proj"), "phi3"),
    Family("mixtral", "Mixtral", ("mixtral",), ("MixtralForCausalLM",), ("mixture of experts", "GQA"), "llama",
           moe=True),
    Family("qwen3_moe", "Qwen3-MoE", ("qwen3_moe",), ("Qwen3MoeForCausalLM",), ("mixture of experts", "q/k norm"),
           None, trtllm_gap="TensorRT-LLM 1.2.x serves Qwen3-MoE on its PyTorch backend only (no engine path)",
           moe=True),
)}
BY_MODEL_TYPE: dict[str, Family] = {t: f for f in FAMILIES.values() for t in f.model_types}
#: model types users meet that are not text decoders Kiln can build, with the reason
NOT_CAUSAL = {"bert": "an encoder-only model", "roberta": "an encoder-only model", "deberta-v2": "an encoder-only model",
              "t5": "an encoder-decoder model", "bart": "an encoder-decoder model", "whisper": "a speech model",
              "gemma3": "a multimodal (image + text) checkpoint; use its text-only variant (model_type gemma3_text)",
              "llama4": "Llama 4 (multimodal MoE), served by TensorRT-LLM's PyTorch backend only"}


def family_of(config: dict) -> Family:
    """The family of the checkpoint whose config.json is ``config``; SpecError naming ``checkpoint`` otherwise."""
    model_type = str(config.get("model_type") or "")
    archs = [str(a) for a in (config.get("architectures") or [])]
    shown = f"{archs[0]} (model_type {model_type!r})" if archs else f"model_type {model_type!r}"
    supported = ", ".join(f.title for f in FAMILIES.values())
    if config.get("is_encoder_decoder") or model_type in NOT_CAUSAL:
        why = NOT_CAUSAL.get(model_type, "an encoder-decoder model")
        raise SpecError(f"{shown} is {why}, not a causal language model Kiln builds", field="checkpoint",
                        fix=f"give a causal LM checkpoint of a supported family ({supported})")
    if archs and not any(a.endswith("ForCausalLM") for a in archs):
        raise SpecError(f"{shown} is not a causal language model (architectures {archs})", field="checkpoint",
                        fix=f"give the ForCausalLM checkpoint of a supported family ({supported})")
    family = BY_MODEL_TYPE.get(model_type)
    if family is None:
        raise SpecError(f"{shown} is not a family Kiln builds", field="checkpoint",
                        fix=f"supported families: {supported} (see `kiln models`)")
    return family

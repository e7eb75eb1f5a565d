"""Reading ModelOpt's unified Hugging Face checkpoint (``hf_quant_config.json`` + safetensors) back into
dequantized float32 weights and the per-layer activation scales, so an engine or a validator can reproduce the
exported numerics without ModelOpt (whose NVFP4 forward needs CUDA).

Formats, as ModelOpt 0.47 writes them:
- FP8: ``weight`` float8_e4m3fn, ``weight_scale`` fp32 (per tensor), ``input_scale`` fp32. value = w × scale.
- NVFP4: ``weight`` uint8 with two e2m1 values per byte, the LOW nibble holding the first element;
  ``weight_scale`` float8_e4m3fn, one per 16 inputs; ``weight_scale_2`` fp32 global (amax / (6 × 448));
  ``input_scale`` fp32 global for activations. value = e2m1 × weight_scale × weight_scale_2.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kiln.errors import StageFailed

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
NVFP4_GROUP = 16
FP8_MAX = 448.0


def e2m1_table() -> torch.Tensor:
    """Lookup for a 4-bit code: bit 3 is the sign, bits 0–2 index E2M1_VALUES."""
    mags = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    return torch.cat([mags, -mags])


def unpack_nvfp4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n/2] → float32 e2m1 values [..., n]; the low nibble is the first element."""
    table = e2m1_table()
    low = table[(packed & 0x0F).long()]
    high = table[(packed >> 4).long()]
    return torch.stack([low, high], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def dequantize_nvfp4(packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    values = unpack_nvfp4(packed)
    out_f, in_f = values.shape
    blocks = values.reshape(out_f, in_f // NVFP4_GROUP, NVFP4_GROUP)
    scaled = blocks * block_scale.float().unsqueeze(-1) * global_scale.float()
    return scaled.reshape(out_f, in_f)


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return weight.float() * scale.float()


@dataclass
class QuantizedCheckpoint:
    """A unified HF checkpoint, dequantized: what an engine built from it must compute."""

    config: dict
    quant_algo: str | None  # "FP8", "NVFP4" or None for an unquantized checkpoint
    kv_cache_quant_algo: str | None
    weights: dict[str, torch.Tensor]  # float32, Hugging Face parameter names
    input_scales: dict[str, float] = field(default_factory=dict)  # linear module name → activation scale


def _load_state(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise StageFailed(f"no .safetensors files in {directory}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def load_quantized_checkpoint(directory: Path) -> QuantizedCheckpoint:
    """Dequantize every quantized linear weight of the checkpoint in ``directory``."""
    directory = Path(directory)
    config = json.loads((directory / "config.json").read_text())
    qpath = directory / "hf_quant_config.json"
    quant = json.loads(qpath.read_text())["quantization"] if qpath.exists() else {}
    algo, kv_algo = quant.get("quant_algo"), quant.get("kv_cache_quant_algo")
    if algo not in (None, "FP8", "NVFP4"):
        raise StageFailed(f"quant_algo {algo!r} is not one Kiln reads (FP8, NVFP4)")
    raw = _load_state(directory)
    weights: dict[str, torch.Tensor] = {}
    scales: dict[str, float] = {}
    for name, tensor in raw.items():
        if not name.endswith(".weight"):
            continue
        module = name[: -len(".weight")]
        if algo == "NVFP4" and tensor.dtype == torch.uint8:
            weights[name] = dequantize_nvfp4(tensor, raw[f"{module}.weight_scale"], raw[f"{module}.weight_scale_2"])
        elif algo == "FP8" and tensor.dtype == torch.float8_e4m3fn:
            weights[name] = dequantize_fp8(tensor, raw[f"{module}.weight_scale"])
        else:
            weights[name] = tensor.float()
        if f"{module}.input_scale" in raw:
            scales[module] = float(raw[f"{module}.input_scale"].float().item())
    return QuantizedCheckpoint(config, algo, kv_algo, weights, scales)


def load_reference_checkpoint(directory: Path) -> QuantizedCheckpoint:
    """The unquantized checkpoint in the same shape (float32 weights, no scales)."""
    directory = Path(directory)
    config = json.loads((directory / "config.json").read_text())
    return QuantizedCheckpoint(config, None, None, {k: v.float() for k, v in _load_state(directory).items()})

"""Reading ModelOpt's unified Hugging Face checkpoint back: every tensor, the quantized linear weights
dequantized by their precision (kiln/precisions.py), the activation ``input_scale`` of each quantized linear, and
the KV-cache scales — so an engine or a validator reproduces the exported numerics without ModelOpt (whose NVFP4
forward needs CUDA).

The quantization block is read from ``config.json`` (``quantization_config``, where newer ModelOpt releases write
it) or ``hf_quant_config.json`` (``quantization``, which ModelOpt plans to retire); either is enough. Sharded
checkpoints are read through ``model.safetensors.index.json`` when there is one: a shard it names must exist.
Every tensor is accounted for: a weight, bias or norm goes into the state dict; a scale is consumed by the weight it
scales; a tensor that is neither is an error rather than dropped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kiln.errors import StageFailed
from kiln.kvcache import KV_SCALE_SUFFIXES
from kiln.precisions import FORMATS, PRECISIONS, Precision, QuantFormat


@dataclass
class ExportedCheckpoint:
    """A checkpoint as an engine built from it must compute it."""

    config: dict  # config.json without its quantization block
    format: QuantFormat | None  # None: an unquantized checkpoint
    kv_cache_quant_algo: str | None
    state: dict[str, torch.Tensor]  # checkpoint names → float32 (quantized weights dequantized)
    input_scales: dict[str, float] = field(default_factory=dict)  # linear module name → activation scale
    kv_scales: dict[str, float] = field(default_factory=dict)
    quantized: list[str] = field(default_factory=list)  # modules whose weight was stored quantized

    @property
    def quant_algo(self) -> str | None:
        return self.format.quant_algo if self.format else None

    @property
    def precision(self) -> Precision | None:
        return PRECISIONS[self.format.precision] if self.format else None


def quantization_block(directory: Path, config: dict) -> dict:
    """``{quant_algo, kv_cache_quant_algo, …}`` from config.json or hf_quant_config.json ({} when unquantized)."""
    block = dict(config.get("quantization_config") or {})
    legacy = directory / "hf_quant_config.json"
    if legacy.is_file():
        old = json.loads(legacy.read_text()).get("quantization") or {}
        block = {**old, **{k: v for k, v in block.items() if v is not None}}
    return block


def safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
        missing = [n for n in names if not (directory / n).is_file()]
        if missing:
            raise StageFailed(f"{directory} lacks the shards its index names: {', '.join(missing[:3])}")
        return [directory / n for n in names]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise StageFailed(f"no .safetensors files in {directory}")
    return files


def load_raw(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in safetensors_files(Path(directory)):
        state.update(load_file(str(f)))
    return state


def load_exported(directory: Path) -> ExportedCheckpoint:
    """Read the checkpoint in ``directory`` (exported by ModelOpt, or an unquantized HF checkpoint)."""
    directory = Path(directory)
    config = json.loads((directory / "config.json").read_text())
    block = quantization_block(directory, config)
    algo = block.get("quant_algo")
    if algo is not None and algo not in FORMATS:
        raise StageFailed(f"quant_algo {algo!r} is not one Kiln reads ({', '.join(FORMATS)})")
    fmt = FORMATS.get(algo) if algo else None
    raw = load_raw(directory)
    scale_suffixes = fmt.scale_suffixes if fmt else ()
    state: dict[str, torch.Tensor] = {}
    ckpt = ExportedCheckpoint({k: v for k, v in config.items() if k != "quantization_config"}, fmt,
                              block.get("kv_cache_quant_algo"), state)
    consumed: set[str] = set()
    for name, tensor in raw.items():
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and fmt is not None:
            value = fmt.dequantize(raw, module)
            if value is not None:
                state[name] = value
                ckpt.quantized.append(module)
                consumed |= {f"{module}.{s}" for s in scale_suffixes if s != "input_scale"}
                continue
        if leaf == "input_scale":
            ckpt.input_scales[module] = float(tensor.float().item())
            consumed.add(name)
        elif any(name.endswith("." + s) for s in KV_SCALE_SUFFIXES):
            ckpt.kv_scales[name] = float(tensor.float().reshape(-1)[0].item())
            consumed.add(name)
        elif leaf not in ("weight_scale", "weight_scale_2"):
            state[name] = tensor.float()
    orphans = sorted(n for n in raw if n not in state and n not in consumed)
    if orphans:
        raise StageFailed(f"{len(orphans)} exported tensors belong to no quantized weight (e.g. {orphans[0]}); "
                          "the checkpoint is damaged or in a format Kiln does not read")
    return ckpt

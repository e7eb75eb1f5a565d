"""Precisions and their exported formats.

A **precision** (the spec's ``precision``: fp8, nvfp4) owns what is common to its recipes: the GPU architectures
its engines need, its default accuracy gates, its default recipe and its ladder (``--recipe auto``: the recipes
tried in order, fastest to serve first; kiln/recipes.py holds the recipes themselves). A **format** is what an
exported checkpoint's ``quant_algo`` names: how its weights are dequantized and how its activation quantization
is emulated. Nothing outside this module compares precision or format names.

Formats, as ModelOpt 0.47 exports them (checked on CPU, docs/validation.md "Recipes"):
- ``FP8``: ``weight`` float8_e4m3fn, ``weight_scale`` fp32 (one per tensor), ``input_scale`` fp32 (static, per
  tensor). value = w × scale.
- ``FP8_PER_CHANNEL_PER_TOKEN``: ``weight`` float8_e4m3fn, ``weight_scale`` fp32 [out_features] (one per output
  channel); no ``input_scale``: activations are quantized per token at run time (scale = the token's amax / 448).
- ``NVFP4``: ``weight`` uint8 with two e2m1 values per byte, the LOW nibble holding the first element;
  ``weight_scale`` float8_e4m3fn, one per 16 inputs; ``weight_scale_2`` fp32 global (amax / (6 × 448));
  ``input_scale`` fp32 global for activations. value = e2m1 × weight_scale × weight_scale_2.
- ``W4A16_NVFP4``: NVFP4 weights as above, no ``input_scale``: activations stay in the model's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # torch is imported where a tensor is computed: the kiln-client install has none (client/)
    import torch

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
NVFP4_GROUP = 16
FP8_MAX = 448.0


# -- FP8 ---------------------------------------------------------------------------------------------
def dequantize_fp8(raw: dict[str, torch.Tensor], module: str) -> torch.Tensor | None:
    """Per tensor (a scalar scale) or per output channel (``[out_features]``): each row times its scale."""
    import torch

    w = raw[f"{module}.weight"]
    if w.dtype != torch.float8_e4m3fn:
        return None
    return w.float() * raw[f"{module}.weight_scale"].float().reshape(-1, 1)


def fake_quant_fp8(x: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """Quantize-dequantize with a per-tensor scale, computed in float32 whatever ``x``'s dtype (a bf16 engine's
    activations round as the exported scale says, not as bf16's 8-bit mantissa would), returned in ``x``'s dtype.

    ``scale``: a number, or a float32 tensor (an engine's constant, kiln/hfmodel.py ``INPUT_SCALE``); either way its
    reciprocal is taken in float64 and rounded to float32, so both give the same bits."""
    import torch

    inverse = 1.0 / scale if not isinstance(scale, torch.Tensor) else (1.0 / scale.double()).float()
    return _fp8_qdq(x.float(), inverse, scale).to(x.dtype)


def _fp8_qdq(y: torch.Tensor, inverse, scale) -> torch.Tensor:
    """float32 ``y`` through e4m3 and back: times ``inverse`` (the scale's reciprocal, 448 / amax), rounded, times
    ``scale`` (numbers, or tensors broadcasting over ``y``). Multiplying by the reciprocal is how ModelOpt's fake
    quantizer computes it (``x × 448 / amax``, then ``× amax / 448``), and cheaper than dividing by the scale."""
    return round_e4m3((y * inverse).clamp(-FP8_MAX, FP8_MAX)) * scale


#: Veltkamp's splitter for float32 (24 significant bits) keeping 4: e4m3's implicit bit and 3 mantissa bits
_E4M3_SPLIT = float(2**20 + 1)
#: below 2**-5 e4m3's step is 2**-9 whatever the exponent (the lowest normal binade and the subnormals): adding
#: and subtracting 1.5 × 2**14, whose float32 step is 2**-9, rounds to that step, ties to even
_E4M3_FIXED_STEP = 1.5 * 2.0**14


def round_e4m3(y: torch.Tensor) -> torch.Tensor:
    """float32 ``y`` with |y| ≤ 448 to the nearest float8_e4m3fn value (ties to even), in float32: exactly
    ``y.to(torch.float8_e4m3fn).to(torch.float32)`` (zeros may lose their sign).

    On CPU it is computed with float32 arithmetic — Veltkamp's splitting to 4 significant bits above 2**-5, a fixed
    step below — because the two casts are the costly part of activation emulation there: Inductor's per-token
    quantize-dequantize kernel takes 1.8 × as long with them (docs/log/performance.md). Checked against the cast on
    every float32 in [-448, 448], eager and compiled by Inductor with its default flags (no FP contraction: a fused
    multiply-add would skip the rounding the splitting relies on; builder/backends/aot_inductor.py pins them).
    Elsewhere (CUDA: one conversion instruction, and Triton contracts multiply-adds) it is the cast."""
    import torch

    if y.device.type != "cpu":
        return y.to(torch.float8_e4m3fn).to(torch.float32)
    split = y * _E4M3_SPLIT
    high = split + (y - split)
    low = (y + _E4M3_FIXED_STEP) - _E4M3_FIXED_STEP
    return torch.where(y.abs() < 2.0**-5, low, high)


#: a token whose amax is at most this is quantized as if its amax were 1 (ModelOpt's rule): an all-zero token stays
#: zero instead of dividing by zero
TINY_TOKEN_AMAX = 2.0**-24


def fake_quant_fp8_per_token(x: torch.Tensor) -> torch.Tensor:
    """Dynamic per-token FP8: each token (the last axis) scaled by its own amax / 448, computed in float32 as
    :func:`fake_quant_fp8`, returned in ``x``'s dtype — ModelOpt's own per-token fake quantization on CPU, bit for
    bit.

    The amax is taken in ``x``'s own dtype and then widened: the largest magnitude of bf16 values is a bf16 value,
    so it is the same number as in float32. In a compiled engine it matters: the amax and the quantize-dequantize
    then both read ``x`` itself, and Inductor keeps it in bf16 between them (a row in a local buffer after an
    RMSNorm, the MLP's product rounded to bf16 in place) instead of writing a float32 copy of every activation to
    memory and reading it twice. As in eager bf16, the quantizer sees the bf16 tensor (docs/log/performance.md, "The
    per-token quantizer reads the bf16 activation")."""
    import torch

    amax = x.abs().amax(dim=-1, keepdim=True).float()
    inverse = FP8_MAX / torch.where(amax <= TINY_TOKEN_AMAX, torch.ones_like(amax), amax)
    return _fp8_qdq(x.float(), inverse, 1.0 / inverse).to(x.dtype)


# -- NVFP4 -------------------------------------------------------------------------------------------
def e2m1_table() -> torch.Tensor:
    """Lookup for a 4-bit code: bit 3 is the sign, bits 0–2 index E2M1_VALUES."""
    import torch

    mags = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    return torch.cat([mags, -mags])


def unpack_nvfp4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n/2] → float32 e2m1 values [..., n]; the low nibble is the first element."""
    import torch

    table = e2m1_table()
    low = table[(packed & 0x0F).long()]
    high = table[(packed >> 4).long()]
    return torch.stack([low, high], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def dequantize_nvfp4_tensor(packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    values = unpack_nvfp4(packed)
    out_f, in_f = values.shape
    blocks = values.reshape(out_f, in_f // NVFP4_GROUP, NVFP4_GROUP)
    scaled = blocks * block_scale.float().unsqueeze(-1) * global_scale.float()
    return scaled.reshape(out_f, in_f)


def dequantize_nvfp4(raw: dict[str, torch.Tensor], module: str) -> torch.Tensor | None:
    import torch

    w = raw[f"{module}.weight"]
    if w.dtype != torch.uint8:
        return None
    return dequantize_nvfp4_tensor(w, raw[f"{module}.weight_scale"], raw[f"{module}.weight_scale_2"])


def _round_e2m1(v: torch.Tensor) -> torch.Tensor:
    """Round |v| ≤ 6 to the e2m1 grid {0, .5, 1, 1.5, 2, 3, 4, 6} (steps .5 below 2, 1 below 4, 2 above)."""
    import torch

    a = v.abs().clamp(max=6.0)
    q = torch.where(a < 2.0, torch.round(a * 2.0) / 2.0, torch.where(a < 4.0, torch.round(a), torch.round(a / 2.0) * 2.0))
    return q * torch.sign(v)


def fake_quant_nvfp4(x: torch.Tensor, global_scale: float | torch.Tensor) -> torch.Tensor:
    """Quantize-dequantize with per-16 block scales (FP8) under a global scale (a number or a float32 tensor), in
    float32 (as :func:`fake_quant_fp8`), returned in ``x``'s dtype."""
    import torch

    if x.dtype != torch.float32:
        return fake_quant_nvfp4(x.float(), global_scale).to(x.dtype)
    shape = x.shape
    blocks = x.reshape(-1, NVFP4_GROUP)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    block_scale = round_e4m3((amax / 6.0 / global_scale).clamp(max=FP8_MAX)) * global_scale
    safe = torch.where(block_scale > 0, block_scale, torch.ones_like(block_scale))
    return (_round_e2m1(blocks / safe) * block_scale).reshape(shape)


# -- the registry ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Precision:
    name: str  # the spec's value
    title: str
    #: lowest SM whose tensor cores run it at all (FP8: Ada); an export format's kernels may need more
    min_sm: int
    gates: dict[str, float]  # default accuracy and speed gates (docs/validation.md says why each is what it is)
    #: what ``--recipe auto`` tries, in order (kiln/recipes.py): the fastest to serve first, the most accurate last
    ladder: tuple[str, ...]
    default_recipe: str = "auto"  # a spec without ``recipe``
    #: a dimension every quantized activation's last axis must divide by (NVFP4: its 16-element blocks)
    block: int = 1
    #: ``trtllm-build --gemm_plugin`` for its engines (builder/backends/trtllm.py says why): ``auto`` resolves to the
    #: model's dtype for the unquantized GEMMs; a named plugin is held in the engine's ``plugin_config``
    trtllm_gemm_plugin: str = "auto"
    #: export format (kiln/backends.py ``Backend.export``) → the lowest SM its runtime's kernels for this precision
    #: run on, where that is above ``min_sm`` (TensorRT-LLM 1.2's NVFP4 GEMMs: Blackwell only)
    export_min_sm: dict[str, int] = field(default_factory=dict)

    def min_sm_for(self, export: str) -> int:
        """The oldest GPU architecture an artifact of this precision in ``export`` format runs on."""
        return self.export_min_sm.get(export, self.min_sm)


@dataclass(frozen=True)
class QuantFormat:
    """What an exported checkpoint's ``quant_algo`` means to a reader."""

    quant_algo: str
    precision: str
    #: module name, raw exported tensors → the dequantized float32 weight, or None when the tensor is not in
    #: this format (ModelOpt leaves embeddings, lm_head, MoE routers and excluded layers unquantized)
    dequantize: Callable[[dict[str, torch.Tensor], str], torch.Tensor | None]
    #: "static": one exported ``input_scale`` per linear; "dynamic": per token at run time; "none": weight-only
    activations: str
    #: static: (x, input_scale) → x quantize-dequantized; dynamic: (x) → the same; none: unused
    fake_quant: Callable[..., torch.Tensor] | None
    #: the tensors next to a quantized weight that this format consumes
    scale_suffixes: tuple[str, ...] = field(default=())


PRECISIONS: dict[str, Precision] = {p.name: p for p in (
    Precision("fp8", "FP8 (e4m3) weights and activations", min_sm=89,
              gates={"max_ppl_increase_pct": 5.0, "min_top1_agreement": 0.80, "max_mean_kl": 0.10,
                     "max_task_accuracy_drop_pts": 3.0, "min_throughput_tps": 1.0},
              ladder=("fp8", "fp8-pcpt")),
    Precision("nvfp4", "NVFP4 (e2m1) weights, FP8 scales per 16 values", min_sm=89,
              gates={"max_ppl_increase_pct": 15.0, "min_top1_agreement": 0.70, "max_mean_kl": 0.25,
                     "max_task_accuracy_drop_pts": 8.0, "min_throughput_tps": 1.0},
              ladder=("nvfp4", "nvfp4-mlp-only", "nvfp4-w4a16"), block=NVFP4_GROUP, trtllm_gemm_plugin="nvfp4",
              export_min_sm={"trtllm": 100}),
)}

FORMATS: dict[str, QuantFormat] = {f.quant_algo: f for f in (
    QuantFormat("FP8", "fp8", dequantize_fp8, "static", fake_quant_fp8, ("weight_scale", "input_scale")),
    QuantFormat("FP8_PER_CHANNEL_PER_TOKEN", "fp8", dequantize_fp8, "dynamic", fake_quant_fp8_per_token,
                ("weight_scale",)),
    QuantFormat("NVFP4", "nvfp4", dequantize_nvfp4, "static", fake_quant_nvfp4,
                ("weight_scale", "weight_scale_2", "input_scale")),
    QuantFormat("W4A16_NVFP4", "nvfp4", dequantize_nvfp4, "none", None, ("weight_scale", "weight_scale_2")),
)}

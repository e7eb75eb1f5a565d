"""A Llama decoder written for ``torch.export``: fixed rotary tables sliced by sequence length, SDPA causal
attention, no KV cache, no data-dependent control flow. It computes what the exported checkpoint computes:
weights come dequantized from the exported tensors, and activation quantization is emulated from the exported
``input_scale`` values (FP8 per-tensor; NVFP4 per 16-element block with FP8 block scales), so the compiled
engine's validation predicts a TensorRT-LLM engine of the same checkpoint.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from kiln.errors import StageFailed
from kiln.quantformat import FP8_MAX, NVFP4_GROUP, QuantizedCheckpoint


def fake_quant_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(x.dtype) * scale


def _round_e2m1(v: torch.Tensor) -> torch.Tensor:
    """Round |v| ≤ 6 to the e2m1 grid {0, .5, 1, 1.5, 2, 3, 4, 6} (steps .5 below 2, 1 below 4, 2 above)."""
    a = v.abs().clamp(max=6.0)
    q = torch.where(a < 2.0, torch.round(a * 2.0) / 2.0, torch.where(a < 4.0, torch.round(a), torch.round(a / 2.0) * 2.0))
    return q * torch.sign(v)


def fake_quant_nvfp4(x: torch.Tensor, global_scale: float) -> torch.Tensor:
    shape = x.shape
    blocks = x.reshape(-1, NVFP4_GROUP)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    block_scale = (amax / 6.0 / global_scale).clamp(max=FP8_MAX).to(torch.float8_e4m3fn).float() * global_scale
    safe = torch.where(block_scale > 0, block_scale, torch.ones_like(block_scale))
    return (_round_e2m1(blocks / safe) * block_scale).reshape(shape)


class QLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, act: str, input_scale: float | None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.act = act if input_scale else "none"
        self.input_scale = float(input_scale or 1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act == "fp8":
            x = fake_quant_fp8(x, self.input_scale)
        elif self.act == "nvfp4":
            x = fake_quant_nvfp4(x, self.input_scale)
        return F.linear(x, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rope_theta(config: dict) -> float:
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise StageFailed(f"rope type {kind!r} is not supported by the aot-inductor Llama (default rope only)")
    return float(params.get("rope_theta", config.get("rope_theta", 10000.0)))


class Layer(nn.Module):
    def __init__(self, ckpt: QuantizedCheckpoint, i: int, act: str):
        super().__init__()
        c, w = ckpt.config, ckpt.weights
        p = f"model.layers.{i}."
        lin = lambda n: QLinear(w[p + n + ".weight"], act, ckpt.input_scales.get(p + n))  # noqa: E731
        self.q, self.k, self.v, self.o = lin("self_attn.q_proj"), lin("self_attn.k_proj"), lin("self_attn.v_proj"), lin("self_attn.o_proj")
        self.gate, self.up, self.down = lin("mlp.gate_proj"), lin("mlp.up_proj"), lin("mlp.down_proj")
        eps = float(c.get("rms_norm_eps", 1e-6))
        self.ln1 = RMSNorm(w[p + "input_layernorm.weight"], eps)
        self.ln2 = RMSNorm(w[p + "post_attention_layernorm.weight"], eps)
        self.heads = int(c["num_attention_heads"])
        self.kv_heads = int(c.get("num_key_value_heads") or self.heads)
        self.head_dim = int(c.get("head_dim") or c["hidden_size"] // self.heads)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.ln1(x)
        q = self.q(h).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(h).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(h).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if self.kv_heads != self.heads:
            rep = self.heads // self.kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))
        h = self.ln2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class KilnLlama(nn.Module):
    """input_ids [batch, seq] (int64) → logits [batch, seq, vocab] (float32)."""

    def __init__(self, ckpt: QuantizedCheckpoint):
        super().__init__()
        c, w = ckpt.config, ckpt.weights
        arch = (c.get("architectures") or ["?"])[0]
        if c.get("model_type") != "llama":
            raise StageFailed(f"architecture {arch} is not supported by the aot-inductor backend (Llama only)")
        if c.get("attention_bias") or c.get("mlp_bias") or any(k.endswith(".bias") for k in w):
            raise StageFailed("Llama variants with linear biases are not supported by the aot-inductor backend",
                              fix="use --backend checkpoint or trtllm-engine")
        act = {"FP8": "fp8", "NVFP4": "nvfp4"}.get(ckpt.quant_algo or "", "none")
        self.embed = nn.Parameter(w["model.embed_tokens.weight"], requires_grad=False)
        self.layers = nn.ModuleList(Layer(ckpt, i, act) for i in range(int(c["num_hidden_layers"])))
        self.norm = RMSNorm(w["model.norm.weight"], float(c.get("rms_norm_eps", 1e-6)))
        head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
        self.lm_head = nn.Parameter(head, requires_grad=False)
        head_dim = self.layers[0].head_dim
        positions = int(c.get("max_position_embeddings", 2048))
        inv = 1.0 / (_rope_theta(c) ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        freqs = torch.outer(torch.arange(positions, dtype=torch.float32), inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
        self.max_positions = positions

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        s = input_ids.shape[1]
        x = F.embedding(input_ids, self.embed)
        cos, sin = self.cos[:s], self.sin[:s]
        for layer in self.layers:
            x = layer(x, cos, sin)
        return F.linear(self.norm(x), self.lm_head)

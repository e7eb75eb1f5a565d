"""Tiny checkpoints of every family Kiln supports, made by transformers from configs that keep each family's
distinguishing fields (llama3 rope scaling, q/k/v biases, q/k norm, head_dim ≠ hidden/heads, soft-capping,
sliding windows, fused projections, experts, tied embeddings, GQA), briefly trained on the calibration text so
their predictions are not uniform, and saved as real repositories ship them: sharded bf16 safetensors with
``model.safetensors.index.json``, ``generation_config.json`` and a ``tokenizer.json`` (the shipped tiny Llama's
byte-level BPE, vocabulary 2048).

Made once per test session and shared read-only (``family_checkpoint``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.conftest import TINY

VOCAB = 2048
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, bos_token_id=0, eos_token_id=1, pad_token_id=None)

#: family name (kiln/families.py) → config fields; each keeps what distinguishes the family
FAMILY_CONFIGS: dict[str, dict] = {
    "llama": dict(model_type="llama", tie_word_embeddings=True,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 64, "rope_theta": 500000.0}),
    "mistral": dict(model_type="mistral", sliding_window=32, tie_word_embeddings=False),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=False),  # q/k/v biases are Qwen2's own
    "qwen3": dict(model_type="qwen3", head_dim=32, tie_word_embeddings=True),  # head_dim 32 ≠ 64 / 4
    "gemma2": dict(model_type="gemma2", head_dim=16, sliding_window=32, final_logit_softcapping=30.0,
                   attn_logit_softcapping=50.0, query_pre_attn_scalar=16, pad_token_id=0),
    "gemma3": dict(model_type="gemma3_text", head_dim=16, sliding_window=32, query_pre_attn_scalar=16,
                   pad_token_id=0, layer_types=["sliding_attention", "full_attention"]),
    "phi3": dict(model_type="phi3", pad_token_id=0, tie_word_embeddings=False),  # fused qkv_proj, gate_up_proj
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False),
    "qwen3_moe": dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                      head_dim=16, decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False),
}
TRAIN_STEPS = 20


def make_config(family: str):
    from transformers import AutoConfig

    fields = {**COMMON, **FAMILY_CONFIGS[family]}
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def make_checkpoint(family: str, dest: Path, *, train_steps: int = TRAIN_STEPS, seed: int = 0) -> Path:
    """Write a tiny ``family`` checkpoint to ``dest`` (sharded bf16, with tokenizer) and return ``dest``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from kiln.datasets import load_text

    config = make_config(family)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    config.architectures = [type(model).__name__]
    tokenizer = AutoTokenizer.from_pretrained(TINY)
    text, _ = load_text("kiln:calibration", field="calibration.dataset", roots=[])
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"][0]
    # trained on the second half of the calibration text (calibration reads its start), windows of 64
    windows = ids[len(ids) // 2:][: (len(ids) // 2 // 65) * 65].view(-1, 65)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(train_steps):
        batch = windows[torch.randint(0, len(windows), (4,), generator=gen)]
        loss = model(input_ids=batch[:, :-1], labels=batch[:, 1:].contiguous(), use_cache=False).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    dest.mkdir(parents=True)
    model.to(torch.bfloat16).save_pretrained(dest, max_shard_size="150KB")
    GenerationConfig(bos_token_id=0, eos_token_id=1, do_sample=False).save_pretrained(dest)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(TINY / name, dest / name)
    assert (dest / "model.safetensors.index.json").is_file(), "the checkpoint must be sharded"
    return dest


def family_checkpoint(tmp_path_factory, family: str) -> Path:
    """The session's shared tiny checkpoint of ``family`` (made on first use)."""
    root = tmp_path_factory.getbasetemp() / "kiln-families"
    dest = root / family
    if not (dest / "config.json").is_file():
        staging = root / f".{family}.partial"
        shutil.rmtree(staging, ignore_errors=True)
        make_checkpoint(family, staging)
        staging.rename(dest)
    return dest


def shards(directory: Path) -> list[str]:
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    return sorted(set(index["weight_map"].values()))

"""KilnLlama (the export-friendly Llama) against transformers, and the activation fake-quantizers."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.errors import StageFailed
from kiln.llama import KilnLlama, _round_e2m1, fake_quant_fp8, fake_quant_nvfp4
from kiln.quantformat import E2M1_VALUES, FP8_MAX, NVFP4_GROUP, QuantizedCheckpoint, load_reference_checkpoint

TINY = Path(__file__).resolve().parents[3] / "examples" / "tiny-llama"
GRID = torch.tensor(E2M1_VALUES)


# -- on the shipped tiny Llama ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference():
    return load_reference_checkpoint(TINY)


@pytest.fixture(scope="module")
def hf_model():
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def kiln_model(reference):
    return KilnLlama(reference).eval()


@pytest.mark.parametrize("batch, seq", [(1, 1), (1, 37), (3, 64), (2, 200)])
def test_matches_transformers_logits(kiln_model, hf_model, batch, seq):
    ids = torch.randint(0, 2048, (batch, seq), generator=torch.Generator().manual_seed(batch * 1000 + seq))
    with torch.no_grad():
        ours = kiln_model(ids)
        theirs = hf_model(ids).logits.float()
    assert ours.shape == (batch, seq, 2048) and ours.dtype == torch.float32
    assert (ours - theirs).abs().max().item() < 1e-4


def test_rows_of_a_batch_are_independent(kiln_model):
    ids = torch.randint(0, 2048, (3, 20), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        batched = kiln_model(ids)
        single = kiln_model(ids[1:2])
    assert torch.allclose(batched[1:2], single, atol=1e-5)


def test_attention_is_causal(kiln_model):
    ids = torch.randint(0, 2048, (1, 30), generator=torch.Generator().manual_seed(3))
    changed = ids.clone()
    changed[0, 20:] = (changed[0, 20:] + 1) % 2048
    with torch.no_grad():
        a, b = kiln_model(ids), kiln_model(changed)
    assert torch.allclose(a[:, :20], b[:, :20], atol=1e-6)
    assert not torch.allclose(a[:, 20:], b[:, 20:])


def test_non_llama_config_raises_stage_failed(reference):
    config = {**reference.config, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}
    with pytest.raises(StageFailed, match="GPT2LMHeadModel"):
        KilnLlama(QuantizedCheckpoint(config, None, None, reference.weights))


def test_non_default_rope_raises_stage_failed(reference):
    config = {**reference.config, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0}}
    with pytest.raises(StageFailed, match="llama3"):
        KilnLlama(QuantizedCheckpoint(config, None, None, reference.weights))


def test_quantized_checkpoint_turns_on_activation_quant(reference):
    layer0 = "model.layers.0.self_attn.q_proj"
    ckpt = QuantizedCheckpoint(reference.config, "FP8", None, reference.weights, {layer0: 0.05})
    model = KilnLlama(ckpt)
    assert model.layers[0].q.act == "fp8" and model.layers[0].q.input_scale == 0.05
    assert model.layers[0].k.act == "none"  # no exported scale: nothing to emulate


# -- other Llama shapes, made with transformers ----------------------------------------------------
def _random_llama(**config):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    base = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 64}
    cfg = LlamaConfig(**{**base, **config})
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return model, QuantizedCheckpoint(cfg.to_dict(), None, None, state)


@pytest.mark.parametrize("config", [{"num_key_value_heads": 2}, {"num_key_value_heads": 1}, {"tie_word_embeddings": True},
                                    {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}],
                         ids=["gqa2", "mqa", "tied", "theta"])
def test_matches_transformers_on_other_llama_shapes(config):
    model, ckpt = _random_llama(**config)
    ids = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (KilnLlama(ckpt)(ids) - model(ids).logits).abs().max().item() < 1e-4


@pytest.mark.parametrize("config", [{"attention_bias": True}, {"mlp_bias": True}])
def test_llama_with_biases_matches_or_is_refused(config):
    model, ckpt = _random_llama(**config)
    ids = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(1))
    try:
        ours = KilnLlama(ckpt)(ids)
    except StageFailed:
        return
    with torch.no_grad():
        assert (ours - model(ids).logits).abs().max().item() < 1e-4


# -- fake quantization -----------------------------------------------------------------------------
def _fp8_representable(t: torch.Tensor) -> bool:
    """On the FP8 e4m3 grid, up to the float32 rounding of the multiply/divide by a scale."""
    return torch.allclose(t.to(torch.float8_e4m3fn).float(), t, rtol=1e-6, atol=0)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), scale=st.floats(1e-3, 10.0), spread=st.floats(0.01, 1000.0))
def test_fake_quant_fp8_properties(seed, scale, spread):
    x = torch.randn(257, generator=torch.Generator().manual_seed(seed)) * spread
    q = fake_quant_fp8(x, scale)
    codes = q / scale
    assert _fp8_representable(codes)  # on the FP8 grid (in units of the scale)
    assert codes.abs().max() <= FP8_MAX * (1 + 1e-6)
    assert torch.equal(fake_quant_fp8(q, scale), q)  # idempotent
    inside = (x / scale).abs() <= FP8_MAX
    err = (q - x).abs()[inside]
    bound = torch.maximum(x.abs()[inside] / 16, torch.full_like(err, scale * 2.0**-10)) * 1.0001
    assert (err <= bound).all()  # round to nearest: half a step (3 mantissa bits) or half a subnormal step
    assert torch.allclose(q[~inside].abs(), torch.full_like(q[~inside], FP8_MAX * scale))  # saturates, keeps sign
    assert torch.equal(torch.sign(q[q != 0]), torch.sign(x[q != 0]))


def test_fake_quant_fp8_keeps_dtype_and_shape():
    x = torch.randn(2, 3, 4, dtype=torch.bfloat16)
    q = fake_quant_fp8(x, 0.01)
    assert q.dtype == torch.bfloat16 and q.shape == x.shape


def test_round_e2m1_maps_onto_the_grid():
    v = torch.linspace(-7, 7, 2801)
    r = _round_e2m1(v)
    assert torch.isin(r.abs(), GRID).all()
    # nearest grid value (ties may go either way)
    dist = (v.abs().clamp(max=6)[:, None] - GRID[None, :]).abs()
    assert torch.allclose((r.abs() - v.abs().clamp(max=6)).abs(), dist.min(1).values, atol=1e-6)
    assert torch.equal(_round_e2m1(GRID), GRID) and torch.equal(_round_e2m1(-GRID), -GRID)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), spread=st.floats(1e-2, 1e3), rows=st.integers(1, 6))
def test_fake_quant_nvfp4_properties(seed, spread, rows):
    x = torch.randn(rows, 4 * NVFP4_GROUP, generator=torch.Generator().manual_seed(seed)) * spread
    global_scale = x.abs().max().item() / (6 * FP8_MAX)  # how ModelOpt calibrates input_scale
    q = fake_quant_nvfp4(x, global_scale)
    assert q.shape == x.shape
    xb, qb = x.reshape(-1, NVFP4_GROUP), q.reshape(-1, NVFP4_GROUP)
    amax = xb.abs().amax(-1, keepdim=True)
    block_scale = (amax / 6 / global_scale).to(torch.float8_e4m3fn).float() * global_scale
    codes = qb / block_scale
    assert torch.isin(codes.abs().round(decimals=4), GRID).all()  # each block on its e2m1 grid
    assert _fp8_representable(block_scale / global_scale)  # block scales are FP8 in units of the global scale
    assert torch.allclose(fake_quant_nvfp4(q, global_scale), q, rtol=1e-6, atol=0)  # idempotent
    # error at most one grid step (2 at the top of the range) of the block scale, and the block scale is
    # amax / 6 up to FP8 rounding
    assert ((qb - xb).abs() <= block_scale * 1.0001).all()
    assert ((qb - xb).abs() <= amax / 6 * 1.07).all()


def test_fake_quant_nvfp4_zero_block_stays_zero():
    x = torch.zeros(2, NVFP4_GROUP)
    x[1, 3] = 1.0
    q = fake_quant_nvfp4(x, 1.0 / (6 * FP8_MAX))
    assert torch.equal(q[0], torch.zeros(NVFP4_GROUP)) and not torch.isnan(q).any()
    assert q[1, 3].item() == pytest.approx(1.0, rel=0.07)


def test_fake_quant_nvfp4_blocks_are_independent():
    x = torch.randn(1, 2 * NVFP4_GROUP, generator=torch.Generator().manual_seed(0))
    big = x.clone()
    big[0, NVFP4_GROUP:] *= 100  # a large second block must not coarsen the first
    gs = big.abs().max().item() / (6 * FP8_MAX)
    assert torch.equal(fake_quant_nvfp4(x, gs)[0, :NVFP4_GROUP], fake_quant_nvfp4(big, gs)[0, :NVFP4_GROUP])


def test_weights_are_not_modified_by_the_model(reference):
    before = copy.deepcopy(reference.weights["model.layers.0.mlp.up_proj.weight"])
    KilnLlama(reference)(torch.zeros(1, 4, dtype=torch.long))
    assert torch.equal(before, reference.weights["model.layers.0.mlp.up_proj.weight"])

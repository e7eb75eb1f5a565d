"""Reading ModelOpt's exported tensors back: NVFP4 nibble order and sign, block and global scales, FP8 scales,
and the checkpoint loader. Every tensor here is made by hand, so the expected values are known exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kiln.errors import StageFailed
from kiln.precisions import E2M1_VALUES, NVFP4_GROUP, e2m1_table, unpack_nvfp4
from kiln.precisions import dequantize_nvfp4_tensor as dequantize_nvfp4
from kiln.quantformat import load_exported


def dequantize_fp8(w, scale):
    from kiln.precisions import dequantize_fp8 as by_module

    return by_module({"m.weight": w, "m.weight_scale": scale}, "m")


def u8(*values: int) -> torch.Tensor:
    return torch.tensor([values], dtype=torch.uint8)


def test_e2m1_table_has_sign_in_bit_3():
    table = e2m1_table()
    assert table[:8].tolist() == list(E2M1_VALUES)
    assert table[8:].tolist() == [-v for v in E2M1_VALUES]


def test_low_nibble_is_the_first_element():
    assert unpack_nvfp4(u8(0x21)).tolist() == [[0.5, 1.0]]
    assert unpack_nvfp4(u8(0x12)).tolist() == [[1.0, 0.5]]
    assert unpack_nvfp4(u8(0x70)).tolist() == [[0.0, 6.0]]


def test_every_code_in_the_low_and_high_nibble():
    codes = list(range(16))
    expected = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    low = unpack_nvfp4(torch.tensor([codes], dtype=torch.uint8))
    high = unpack_nvfp4(torch.tensor([[c << 4 for c in codes]], dtype=torch.uint8))
    assert low[0, 0::2].tolist() == expected and low[0, 1::2].tolist() == [0.0] * 16
    assert high[0, 1::2].tolist() == expected and high[0, 0::2].tolist() == [0.0] * 16


def test_sign_bit():
    assert unpack_nvfp4(u8(0x9F)).tolist() == [[-6.0, -0.5]]
    assert unpack_nvfp4(u8(0xA3)).tolist() == [[1.5, -1.0]]
    assert torch.signbit(unpack_nvfp4(u8(0x08)))[0, 0]  # 0b1000 is negative zero


def test_unpack_keeps_leading_dimensions():
    packed = torch.arange(24, dtype=torch.uint8).reshape(2, 3, 4)
    out = unpack_nvfp4(packed)
    assert out.shape == (2, 3, 8) and out.dtype == torch.float32
    assert out[1, 2, 6].item() == e2m1_table()[packed[1, 2, 3].item() & 0xF].item()


def test_dequantize_nvfp4_applies_block_and_global_scales():
    # 2 rows × 32 inputs = 2 blocks per row; row r, block b is filled with code 0x2 (1.0) in the low nibble and
    # 0xA (-1.0) in the high one, so values alternate +1, -1.
    packed = torch.full((2, 16), 0xA2, dtype=torch.uint8)
    block = torch.tensor([[1.0, 2.0], [0.5, 448.0]]).to(torch.float8_e4m3fn)
    out = dequantize_nvfp4(packed, block, torch.tensor(0.25))
    assert out.shape == (2, 32)
    expected_scale = torch.tensor([[0.25] * 16 + [0.5] * 16, [0.125] * 16 + [112.0] * 16])
    sign = torch.tensor([1.0, -1.0]).repeat(16)
    assert torch.equal(out, expected_scale * sign)


def test_dequantize_nvfp4_block_boundaries_follow_the_group_size():
    packed = torch.full((1, NVFP4_GROUP), 0x77, dtype=torch.uint8)  # 32 values of 6.0
    block = torch.tensor([[1.0, 0.5]]).to(torch.float8_e4m3fn)
    out = dequantize_nvfp4(packed, block, torch.tensor(2.0))[0]
    assert out[:NVFP4_GROUP].tolist() == [12.0] * NVFP4_GROUP
    assert out[NVFP4_GROUP:].tolist() == [6.0] * NVFP4_GROUP


def test_dequantize_fp8():
    w = torch.tensor([[1.0, -2.0, 448.0, 0.0]]).to(torch.float8_e4m3fn)
    assert dequantize_fp8(w, torch.tensor(0.5)).tolist() == [[0.5, -1.0, 224.0, 0.0]]


# -- the checkpoint loader -------------------------------------------------------------------------
def _write_checkpoint(directory: Path, algo: str | None, state: dict, *, in_config: bool = False) -> Path:
    directory.mkdir(parents=True)
    config = {"model_type": "llama"}
    if algo is not None and in_config:  # where newer ModelOpt writes the block
        config["quantization_config"] = {"quant_method": "modelopt", "quant_algo": algo}
    elif algo is not None:
        (directory / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": algo}}))
    (directory / "config.json").write_text(json.dumps(config))
    save_file(state, str(directory / "model.safetensors"))
    return directory


@pytest.mark.parametrize("in_config", [False, True])
def test_load_nvfp4_checkpoint_dequantizes_packed_weights(tmp_path, in_config):
    state = {
        "layer.weight": torch.full((1, 8), 0x21, dtype=torch.uint8),
        "layer.weight_scale": torch.tensor([[2.0]]).to(torch.float8_e4m3fn),
        "layer.weight_scale_2": torch.tensor(0.5),
        "layer.input_scale": torch.tensor(0.125),
        "layer.bias": torch.ones(1, dtype=torch.bfloat16),
        "norm.weight": torch.ones(4, dtype=torch.bfloat16),
    }
    ckpt = load_exported(_write_checkpoint(tmp_path / "c", "NVFP4", state, in_config=in_config))
    assert ckpt.quant_algo == "NVFP4" and ckpt.kv_cache_quant_algo is None
    assert "quantization_config" not in ckpt.config
    assert ckpt.state["layer.weight"].tolist() == [[0.5, 1.0] * 8]
    assert ckpt.state["norm.weight"].dtype == torch.float32
    assert ckpt.input_scales == {"layer": 0.125} and ckpt.quantized == ["layer"]
    assert set(ckpt.state) == {"layer.weight", "layer.bias", "norm.weight"}  # biases and norms are kept


def test_load_fp8_checkpoint(tmp_path):
    state = {"l.weight": torch.tensor([[2.0, -4.0]]).to(torch.float8_e4m3fn), "l.weight_scale": torch.tensor(0.25),
             "l.input_scale": torch.tensor(0.5)}
    ckpt = load_exported(_write_checkpoint(tmp_path / "c", "FP8", state))
    assert ckpt.state["l.weight"].tolist() == [[0.5, -1.0]]
    assert ckpt.input_scales == {"l": 0.5}


def test_a_scale_without_its_quantized_weight_is_refused_not_dropped(tmp_path):
    state = {"l.weight": torch.ones(2, 2), "l.weight_scale": torch.tensor(0.25)}  # weight not in FP8
    with pytest.raises(StageFailed, match="belong to no quantized weight"):
        load_exported(_write_checkpoint(tmp_path / "c", "FP8", state))


def test_sharded_checkpoint_is_read_through_its_index(tmp_path):
    d = tmp_path / "c"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    save_file({"a.weight": torch.ones(2, dtype=torch.bfloat16)}, str(d / "model-00001-of-00002.safetensors"))
    save_file({"b.weight": torch.zeros(2, dtype=torch.bfloat16)}, str(d / "model-00002-of-00002.safetensors"))
    index = {"weight_map": {"a.weight": "model-00001-of-00002.safetensors", "b.weight": "model-00002-of-00002.safetensors"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    assert set(load_exported(d).state) == {"a.weight", "b.weight"}
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(StageFailed, match="lacks the shards"):
        load_exported(d)


def test_unquantized_checkpoint_loads_as_float32(tmp_path):
    directory = _write_checkpoint(tmp_path / "c", None, {"w.weight": torch.ones(2, 2, dtype=torch.float16)})
    ckpt = load_exported(directory)
    assert ckpt.quant_algo is None and ckpt.state["w.weight"].dtype == torch.float32


def test_unknown_quant_algo_is_refused(tmp_path):
    directory = _write_checkpoint(tmp_path / "c", "W4A16_AWQ", {"w.weight": torch.ones(2, 2)})
    with pytest.raises(StageFailed, match="W4A16_AWQ"):
        load_exported(directory)


def test_directory_without_safetensors_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(StageFailed, match="safetensors"):
        load_exported(tmp_path)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("which", ["fp8", "nvfp4"])
def test_activation_fake_quant_rounds_in_float32_whatever_the_engines_dtype(dtype, which):
    """A bf16/fp16 engine's activations are quantized as the exported scale says: the same codes as the float32
    computation of the same values (bf16's 8-bit mantissa would move values across rounding boundaries)."""
    from kiln.precisions import fake_quant_fp8, fake_quant_nvfp4

    fq, scale = (fake_quant_fp8, 0.0173) if which == "fp8" else (fake_quant_nvfp4, 0.0011)
    x = (torch.randn(64, 256, generator=torch.Generator().manual_seed(3)) * 3).to(dtype)
    out = fq(x, scale)
    assert out.dtype == dtype
    assert torch.equal(out, fq(x.float(), scale).to(dtype))
    # and it is a quantizer: far fewer distinct values than the input has
    assert out.float().unique().numel() < x.float().unique().numel() / 4


# -- per-channel weights, per-token activations, weight-only ------------------------------------------
def test_dequantize_fp8_per_channel_scales_each_output_row():
    w = torch.tensor([[1.0, -2.0], [4.0, 0.5]]).to(torch.float8_e4m3fn)
    assert dequantize_fp8(w, torch.tensor([0.5, 2.0])).tolist() == [[0.5, -1.0], [8.0, 1.0]]


def test_fake_quant_fp8_per_token_scales_each_token_by_its_own_amax():
    from kiln.precisions import FP8_MAX, fake_quant_fp8_per_token

    x = torch.tensor([[[1.0, -3.0, 0.3], [100.0, 7.0, -50.0], [0.0, 0.0, 0.0]]])
    out = fake_quant_fp8_per_token(x)
    for t in range(2):  # each row quantized with its own scale (x × 448 / amax, rounded, × amax / 448), not a shared one
        inverse = FP8_MAX / x[0, t].abs().max()
        expected = (x[0, t] * inverse).to(torch.float8_e4m3fn).float() * (1 / inverse)
        assert torch.equal(out[0, t], expected)
    # each amax takes the top code, 448, and comes back as 448 × (1 / (448 / amax)): amax within float32 rounding
    assert out[0, 0, 1].item() == pytest.approx(-3.0, rel=2**-23) and out[0, 1, 0].item() == pytest.approx(100.0, rel=2**-23)
    assert torch.equal(out[0, 2], torch.zeros(3))  # an all-zero token stays zero (no division by zero)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fake_quant_fp8_per_token_is_modelopts_own_quantizer_bit_for_bit(dtype):
    """The engine's per-token activation emulation is ModelOpt's dynamic per-token FP8 quantizer (the input
    quantizer FP8_PER_CHANNEL_PER_TOKEN_CFG configures) on every value: tokens over six decades of amax, an
    all-zero token and a token under ModelOpt's tiny-amax threshold (quantized as if its amax were 1)."""
    from modelopt.torch.quantization.config import QuantizerAttributeConfig
    from modelopt.torch.quantization.nn import TensorQuantizer

    from kiln.precisions import fake_quant_fp8_per_token

    theirs = TensorQuantizer(QuantizerAttributeConfig(num_bits=(4, 3), axis=None, type="dynamic", block_sizes={-1: None}))
    x = torch.randn(3, 50, 256, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 3, 50).reshape(1, 50, 1)
    x[0, 0], x[0, 1] = 0.0, 1e-9
    x = x.to(dtype)
    with torch.no_grad():
        assert torch.equal(fake_quant_fp8_per_token(x), theirs(x))


def test_the_per_token_quantizer_reads_a_bf16_activation_as_bf16():
    """The amax and the quantize-dequantize both read the bf16 activation itself, each widening it to float32 where
    it reads it; no float32 copy of the activation feeds both. In an engine, that is what lets Inductor keep the
    activation in bf16 between the two instead of writing a float32 copy to memory (docs/performance.md)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from kiln.precisions import fake_quant_fp8_per_token

    graph = make_fx(fake_quant_fp8_per_token, tracing_mode="fake")(torch.ones(2, 8, 64, dtype=torch.bfloat16)).graph
    x = next(n for n in graph.nodes if n.op == "placeholder")
    amax = next(n for n in graph.nodes if n.target == torch.ops.aten.amax.default)
    assert amax.meta["val"].dtype == torch.bfloat16, "the amax is taken on a float32 copy of the activation"
    widened = [n for n in x.users if n.meta["val"].dtype == torch.float32]
    assert all(len(n.users) == 1 for n in widened), "one float32 copy of the activation feeds several consumers"


@pytest.mark.parametrize("algo, activations", [("FP8_PER_CHANNEL_PER_TOKEN", "dynamic"), ("W4A16_NVFP4", "none")])
def test_formats_without_input_scales_load(tmp_path, algo, activations):
    if algo.startswith("FP8"):
        state = {"m.weight": torch.ones(2, 16).to(torch.float8_e4m3fn), "m.weight_scale": torch.tensor([1.0, 3.0])}
    else:
        state = {"m.weight": torch.full((2, 8), 0x22, dtype=torch.uint8),  # every value 1.0
                 "m.weight_scale": torch.ones(2, 1).to(torch.float8_e4m3fn), "m.weight_scale_2": torch.tensor(0.5)}
    ckpt = load_exported(_write_checkpoint(tmp_path / "c", algo, state))
    assert ckpt.format.activations == activations and ckpt.input_scales == {} and ckpt.quantized == ["m"]
    expected = [[1.0] * 16, [3.0] * 16] if algo.startswith("FP8") else [[0.5] * 16] * 2
    assert ckpt.state["m.weight"].tolist() == expected


# -- e4m3 rounding by arithmetic (CPU) -----------------------------------------------------------------
def _floats(lo: float, hi: float) -> torch.Tensor:
    """Every float32 in [lo, hi), both signs."""
    a = torch.tensor(lo, dtype=torch.float32).view(torch.int32).item()
    b = torch.tensor(hi, dtype=torch.float32).view(torch.int32).item()
    pos = torch.arange(a, b, dtype=torch.int32).view(torch.float32)
    return torch.cat([pos, -pos])


def _e4m3_probe() -> torch.Tensor:
    """Where e4m3 rounding can go wrong: every float32 from 2**-7 to 2**-4 (the subnormals' fixed step, the lowest
    normal binades and the switch between the two at 2**-5) and from 256 to 448 (the top binade, saturation's
    edge), every bf16 value within ±448 (what a bf16 engine's activations are), every e4m3 value and the midpoints
    between neighbours (ties), and 4 M random float32 bit patterns within ±448."""
    import math

    grid = torch.arange(0, 256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[grid.isfinite()].unique()
    bf16 = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    top = torch.tensor(448.0).view(torch.int32).item()
    rand = torch.randint(0, top + 1, (1 << 22,), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    rand = rand.view(torch.float32) * torch.where(torch.rand(1 << 22) < 0.5, -1.0, 1.0)
    parts = [_floats(2.0**-7, 2.0**-4), _floats(256.0, math.nextafter(448.0, math.inf)),
             bf16[bf16.abs() <= 448], grid, (grid[1:] + grid[:-1]) / 2, rand, torch.tensor([0.0, -0.0, 2.0**-149])]
    return torch.cat(parts)


def test_round_e4m3_is_the_float8_cast_where_rounding_can_go_wrong():
    """The arithmetic rounding gives the cast's value for every probed float32 (67 M of them; checked on every
    float32 within ±448, 2.3 G values, when it was written: docs/log/performance.md)."""
    from kiln.precisions import round_e4m3

    z = _e4m3_probe()
    cast = z.to(torch.float8_e4m3fn).to(torch.float32)
    got = round_e4m3(z)
    wrong = got != cast
    assert not wrong.any(), f"{int(wrong.sum())} values differ, e.g. {z[wrong][:3].tolist()}"


def test_round_e4m3_compiled_by_inductor_is_the_float8_cast():
    """Compiled to C++ by Inductor with the flags the aot-inductor backend pins (no contraction of the splitting's
    multiply and add into a fused multiply-add), it still gives the cast's values."""
    from builder.backends.aot_inductor import EXACT_CPP_MATH
    from kiln.precisions import round_e4m3

    z = _e4m3_probe()
    with torch._inductor.config.patch(EXACT_CPP_MATH):
        got = torch.compile(round_e4m3, dynamic=True)(z)
    assert torch.equal(got, z.to(torch.float8_e4m3fn).to(torch.float32))

"""quantize: ModelOpt PTQ of the tiny Llama, exported as the unified HF checkpoint with its calibration saved (the
TensorRT-LLM checkpoint is made from that calibration by the trtllm-engine backend; test_trtllm.py)."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from builder.quantize import calibration_batches, quant_config, quantize
from kiln.errors import SpecError
from kiln.precisions import dequantize_nvfp4_tensor as dequantize_nvfp4
from kiln.precisions import unpack_nvfp4
from kiln.spec import parse_spec

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "examples" / "tiny-llama"
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TINY)


@pytest.fixture(scope="module")
def reference_state():
    return load_file(str(TINY / "model.safetensors"))


# -- quant_config ----------------------------------------------------------------------------------
@pytest.mark.parametrize("precision, attr", [("fp8", "FP8_DEFAULT_CFG"), ("nvfp4", "NVFP4_DEFAULT_CFG")])
def test_quant_config_is_modelopts_default(precision, attr):
    import modelopt.torch.quantization as mtq

    cfg = quant_config(precision, "none")
    assert cfg == getattr(mtq, attr)
    assert cfg is not getattr(mtq, attr) and cfg["quant_cfg"] is not getattr(mtq, attr)["quant_cfg"]


@pytest.mark.parametrize("precision, attr", [("fp8", "FP8_DEFAULT_CFG"), ("nvfp4", "NVFP4_DEFAULT_CFG")])
def test_fp8_kv_cache_appends_the_kv_rules_to_the_list(precision, attr):
    import modelopt.torch.quantization as mtq

    base = getattr(mtq, attr)
    before = copy.deepcopy(base)
    cfg = quant_config(precision, "fp8")
    kv_rules = mtq.FP8_KV_CFG["quant_cfg"]
    assert isinstance(cfg["quant_cfg"], list)
    assert cfg["quant_cfg"] == list(base["quant_cfg"]) + list(kv_rules)  # appended last, so they win
    assert any("bmm_quantizer" in str(rule) for rule in cfg["quant_cfg"][-len(kv_rules):])
    assert base == before  # ModelOpt's constant is not modified
    assert quant_config(precision, "none")["quant_cfg"] == list(base["quant_cfg"])


# -- calibration batches ---------------------------------------------------------------------------
def test_calibration_batches_shape(tokenizer):
    from kiln.datasets import load_text

    text, _ = load_text("kiln:calibration", field="calibration.dataset", roots=[])
    batches = calibration_batches(tokenizer, text, 8, 64)
    assert batches.shape == (8, 64) and batches.dtype == torch.long
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert batches.flatten().tolist() == ids[: 8 * 64]  # consecutive real text, no padding


def test_calibration_text_too_short_names_samples(tokenizer):
    with pytest.raises(SpecError) as info:
        calibration_batches(tokenizer, "too short a text", 8, 64)
    assert info.value.field == "calibration.samples"
    assert info.value.fix and "512" in info.value.message


def test_unsupported_model_type_is_refused_before_calibration(tmp_path):
    ckpt = tmp_path / "bert"
    shutil.copytree(TINY, ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "model_type": "bert"}))
    spec = parse_spec({"checkpoint": str(ckpt), "precision": "fp8", "recipe": "fp8"}, [tmp_path])
    with pytest.raises(SpecError) as info:
        quantize(ckpt, spec, "text", tmp_path / "out")
    assert info.value.field == "checkpoint" and "bert" in info.value.message
    assert not (tmp_path / "out").exists()


# -- real exports (shared session fixtures, see conftest.py) ---------------------------------------
@pytest.mark.parametrize("precision, algo", [("fp8", "FP8"), ("nvfp4", "NVFP4")])
def test_export_layout_and_quant_algo(request, precision, algo):
    out: Path = request.getfixturevalue(f"{precision}_export")
    assert not (out / "trtllm").exists()  # only trtllm-engine builds export it, from the saved calibration
    assert (out / "calibration" / "calibration.pt").is_file()
    calib = torch.load(out / "calibration" / "calibration.pt", weights_only=False)
    assert calib["quantizers"] and all("_quantizer." in k for k in calib["quantizers"])  # no weights
    hq = json.loads((out / "hf" / "hf_quant_config.json").read_text())
    assert hq["quantization"]["quant_algo"] == algo
    assert {"lm_head", "model.embed_tokens"} <= set(hq["quantization"]["exclude_modules"])
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        assert (out / "hf" / name).is_file(), name
    assert json.loads((out / "hf" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def test_fp8_weights_are_float8_with_fp32_scales(fp8_export, reference_state):
    state = load_file(str(fp8_export / "hf" / "model.safetensors"))
    for layer in range(4):
        for lin in LINEARS:
            p = f"model.layers.{layer}.{lin}"
            assert state[f"{p}.weight"].dtype == torch.float8_e4m3fn
            assert state[f"{p}.weight_scale"].dtype == torch.float32 and state[f"{p}.weight_scale"].numel() == 1
            assert state[f"{p}.input_scale"].dtype == torch.float32 and state[f"{p}.input_scale"].item() > 0
            ref = reference_state[f"{p}.weight"]
            deq = state[f"{p}.weight"].float() * state[f"{p}.weight_scale"]
            assert deq.shape == ref.shape
            assert (deq - ref).abs().max() <= ref.abs().max() / 16 + 1e-6  # FP8 e4m3: ≤ half a step of 3 bits
    assert state["lm_head.weight"].dtype == torch.float32  # left unquantized
    assert torch.equal(state["model.embed_tokens.weight"], reference_state["model.embed_tokens.weight"])


def test_nvfp4_weights_are_packed_uint8_with_float8_block_scales(nvfp4_export, reference_state):
    state = load_file(str(nvfp4_export / "hf" / "model.safetensors"))
    for layer in range(4):
        for lin in LINEARS:
            p = f"model.layers.{layer}.{lin}"
            ref = reference_state[f"{p}.weight"]
            out_f, in_f = ref.shape
            w, s, s2 = state[f"{p}.weight"], state[f"{p}.weight_scale"], state[f"{p}.weight_scale_2"]
            assert w.dtype == torch.uint8 and w.shape == (out_f, in_f // 2)  # two e2m1 values per byte
            assert s.dtype == torch.float8_e4m3fn and s.shape == (out_f, in_f // 16)  # group 16
            assert s2.dtype == torch.float32 and s2.numel() == 1
        # weight_scale_2 = amax / (6 × 448), the amax shared by the linears TensorRT-LLM fuses (qkv, gate+up)
        for group in (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj"),
                      ("self_attn.o_proj",), ("mlp.down_proj",)):
            names = [f"model.layers.{layer}.{lin}" for lin in group]
            amax = max(reference_state[f"{n}.weight"].abs().max().item() for n in names)
            for n in names:
                assert state[f"{n}.weight_scale_2"].item() == pytest.approx(amax / (6 * 448), rel=1e-5)
    hq = json.loads((nvfp4_export / "hf" / "hf_quant_config.json").read_text())
    assert hq["quantization"]["group_size"] == 16


def test_nvfp4_export_dequantizes_low_nibble_first(nvfp4_export, reference_state):
    """The format facts hold on a real export: read low-nibble-first the weights come back close to the
    reference; read in the other order they do not."""
    state = load_file(str(nvfp4_export / "hf" / "model.safetensors"))
    p = "model.layers.1.mlp.up_proj"
    ref = reference_state[f"{p}.weight"]
    w, s, s2 = state[f"{p}.weight"], state[f"{p}.weight_scale"], state[f"{p}.weight_scale_2"]
    right = dequantize_nvfp4(w, s, s2)
    swapped = dequantize_nvfp4(((w & 0x0F) << 4) | (w >> 4), s, s2)
    rel = lambda x: ((x - ref).norm() / ref.norm()).item()  # noqa: E731
    assert rel(right) < 0.15
    assert rel(swapped) > 0.8
    assert unpack_nvfp4(w).shape == ref.shape


def test_quantize_record(fp8_export, nvfp4_export):
    for out, precision, algo in ((fp8_export, "fp8", "FP8"), (nvfp4_export, "nvfp4", "NVFP4")):
        record = json.loads((out / "quantize.json").read_text())
        assert record["precision"] == precision and record["kv_cache"] == "none"
        assert record["device"] == "cpu" and record["family"] == "llama"
        assert record["exports"] == ["hf"]
        text = record["calibration"].pop("text")  # the tiny model's tokenizer adds no BOS: nothing before a text
        assert text["prefix"] == [] and text["rule"].startswith("tokenizer-special-tokens")
        assert record["calibration"] == {"dataset": "kiln:calibration", "samples": 8, "seq_len": 64, "tokens": 512}
        assert record["quantized_linears"] == 4 * len(LINEARS)
        assert set(record["seconds"]) == {"load", "calibrate", "export"}
        assert all(v >= 0 for v in record["seconds"].values())
        assert record["hf_quant_config"] == json.loads((out / "hf" / "hf_quant_config.json").read_text())
        assert record["hf_quant_config"]["quantization"]["quant_algo"] == algo


def test_quantize_refuses_an_existing_output_dir(fp8_export, tmp_path):
    spec = parse_spec({"checkpoint": str(TINY), "precision": "fp8", "recipe": "fp8",
                       "calibration": {"samples": 1, "seq_len": 8}}, [REPO])
    existing = tmp_path / "out"
    existing.mkdir()
    (existing / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError):
        quantize(TINY, spec, "word " * 200, existing)
    assert [p.name for p in existing.iterdir()] == ["keep.txt"]


# -- recipes beyond the defaults: their exports, read back as ModelOpt computes them ------------------------
def _quantize_recipe(tmp_path, recipe: str, **spec) -> Path:
    from kiln.datasets import load_text
    from kiln.recipes import RECIPES

    s = parse_spec({"checkpoint": str(TINY), "precision": RECIPES[recipe].precision, "recipe": recipe,
                    "calibration": {"samples": 4, "seq_len": 64}, **spec}, [REPO])
    text, _ = load_text(s.calibration.dataset, field="calibration.dataset", roots=[REPO])
    quantize(TINY, s, text, tmp_path / recipe)
    return tmp_path / recipe


def test_fp8_pcpt_engine_computes_what_modelopts_own_quantized_model_computes(tmp_path, tokenizer):
    """Per-channel weight scales and per-token activation scales, read back from the export alone, give ModelOpt's
    own fake-quantized forward (a per-tensor reading of either would not)."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoModelForCausalLM

    from kiln.hfmodel import load_engine_model

    ids = tokenizer("The quick brown fox jumps over the lazy dog. " * 12, return_tensors="pt")["input_ids"][:, :64]
    model = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval()
    model = mtq.quantize(model, quant_config("fp8-pcpt", "none"), lambda m: m(ids))
    with torch.no_grad():
        theirs = model(ids).logits
    export_hf_checkpoint(model, export_dir=tmp_path / "hf")
    built = load_engine_model(tmp_path / "hf")
    assert "per token" in built.emulation["activations"]
    with torch.no_grad():
        ours = built.model(input_ids=ids, use_cache=False).logits
    unquantized = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval()
    with torch.no_grad():
        plain = unquantized(ids).logits
    gap = (ours - theirs).abs().max().item()
    assert gap < 0.1 * (plain - theirs).abs().max().item()  # far closer to ModelOpt than bf16 is
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_unquantized_layers_keep_their_weights_and_the_rest_is_quantized(tmp_path, reference_state):
    out = _quantize_recipe(tmp_path, "fp8", unquantized_layers=[0, -1])
    state = load_file(str(out / "hf" / "model.safetensors"))
    record = json.loads((out / "quantize.json").read_text())
    assert record["recipe"] == "fp8" and record["unquantized_layers"] == [0, -1]
    for layer, kept in ((0, True), (1, False), (2, False), (3, True)):
        for lin in LINEARS:
            w = state[f"model.layers.{layer}.{lin}.weight"]
            if kept:
                assert w.dtype == torch.float32 and f"model.layers.{layer}.{lin}.input_scale" not in state
                assert torch.equal(w, reference_state[f"model.layers.{layer}.{lin}.weight"])
            else:
                assert w.dtype == torch.float8_e4m3fn, (layer, lin)
    from kiln.hfmodel import load_engine_model

    built = load_engine_model(out / "hf")
    assert len(built.checkpoint.quantized) == 2 * len(LINEARS)


def test_w4a16_nvfp4_is_weight_only(tmp_path):
    from kiln.hfmodel import load_engine_model

    out = _quantize_recipe(tmp_path, "nvfp4-w4a16")
    built = load_engine_model(out / "hf")
    assert built.checkpoint.quant_algo == "W4A16_NVFP4" and built.checkpoint.input_scales == {}
    assert "weight-only" in built.emulation["activations"]
    assert all(not m._forward_pre_hooks for m in built.model.modules())  # no activation quantizer anywhere
    assert len(built.checkpoint.quantized) == 4 * len(LINEARS)

"""Accuracy against the unquantized reference, and the verdict on real exports: an NVFP4 checkpoint as ModelOpt
wrote it passes the default NVFP4 gates; the same checkpoint with every packed byte's nibbles swapped (the
classic wrong-order bug) fails them loudly."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln.datasets import load_text
from kiln.errors import SpecError, StageFailed
from kiln.spec import parse_spec
from validation.gates import effective_gates
from validation.measure import accuracy
from validation.runners import CheckpointRunner, TransformersRunner, open_engine, open_reference
from validation.validate import eval_tokens, validate

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "examples" / "tiny-llama"
EVAL_TOKENS = 2048  # 16 windows of 128: enough to separate good from damaged, ~1 s per engine here


def nvfp4_spec(**overrides):
    data = {"checkpoint": str(TINY), "precision": "nvfp4", "backend": "checkpoint",
            "evaluation": {"max_tokens": EVAL_TOKENS}, "override_reason": "a unit test: a shorter evaluation"}
    data.update(overrides)
    return parse_spec(data, [REPO])


@pytest.fixture(scope="module")
def heldout() -> str:
    return load_text("kiln:heldout", field="evaluation.dataset", roots=[REPO])[0]


@pytest.fixture(scope="module")
def reference():
    return open_reference(TINY)


@pytest.fixture(scope="module")
def tokens(heldout):
    text = eval_tokens(TINY, heldout, nvfp4_spec())
    return text.ids, text.seq


@pytest.fixture(scope="module")
def damaged_nvfp4(nvfp4_export, tmp_path_factory) -> Path:
    """A copy of the NVFP4 export with the two nibbles of every packed weight byte swapped."""
    out = tmp_path_factory.mktemp("damaged") / "hf"
    shutil.copytree(nvfp4_export / "hf", out)
    for path in out.glob("*.safetensors"):
        state = load_file(str(path))
        packed = [k for k, v in state.items() if v.dtype == torch.uint8]
        assert len(packed) == 28
        for k in packed:
            v = state[k]
            state[k] = ((v & 0x0F) << 4) | (v >> 4)
        save_file(state, str(path), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def damaged_fp8(fp8_export, tmp_path_factory) -> Path:
    """A copy of the FP8 export with one corrupted scale: the first layer's down_proj weight_scale × 16 (four
    exponent steps, as a bit flip in a float32 exponent would give)."""
    out = tmp_path_factory.mktemp("damaged-fp8") / "hf"
    shutil.copytree(fp8_export / "hf", out)
    for path in out.glob("*.safetensors"):
        state = load_file(str(path))
        scales = [k for k in state if k.endswith("weight_scale")]
        assert len(scales) == 28
        key = "model.layers.0.mlp.down_proj.weight_scale"
        state[key] = state[key] * 16
        save_file(state, str(path), metadata={"format": "pt"})
    return out


# -- eval tokens -----------------------------------------------------------------------------------
def test_eval_tokens_are_capped_and_windowed(tokens):
    ids, seq = tokens
    assert seq == 128 and len(ids) == EVAL_TOKENS + 1 and ids.dtype == torch.long


def test_eval_sequence_is_capped_by_the_profile(heldout):
    prof = {"max_batch_size": 2, "max_input_len": 32, "max_seq_len": 64, "max_num_tokens": 128}
    text = eval_tokens(TINY, heldout, nvfp4_spec(profile=prof))
    assert text.seq == 64 and text.lengths == [64]


def test_windows_reach_the_profiles_longest_sequence(heldout):
    """The evaluation's windows and windows of the profile's max_seq_len: the positions the engine serves."""
    text = eval_tokens(TINY, heldout, nvfp4_spec())
    assert text.lengths == [128, 512]
    prof = {"max_batch_size": 2, "max_input_len": 32, "max_seq_len": 8192, "max_num_tokens": 128}
    with pytest.raises(SpecError) as info:  # 16,384 tokens hold one window of 8,192: two are needed
        eval_tokens(TINY, heldout, nvfp4_spec(profile=prof, evaluation={"max_tokens": 12000}))
    assert info.value.field == "evaluation.dataset" and "8192" in info.value.message


def test_too_short_evaluation_text_names_the_dataset_field():
    with pytest.raises(SpecError) as info:
        eval_tokens(TINY, "only a few words", nvfp4_spec())
    assert info.value.field == "evaluation.dataset" and info.value.fix


# -- accuracy --------------------------------------------------------------------------------------
def test_reference_against_itself(reference, tokens):
    ids, seq = tokens
    m = accuracy(reference, reference, ids, seq, 8)
    assert m["perplexity"] == m["reference_perplexity"]
    assert m["ppl_increase_pct"] == 0.0 and m["top1_agreement"] == 1.0
    assert abs(m["mean_kl"]) < 1e-9  # the stored reference log-probabilities are float32
    assert m["tokens"] == EVAL_TOKENS and m["seq_len"] == 128
    assert 5 < m["reference_perplexity"] < 100  # a trained model: far below a uniform 2048


def test_the_checkpoint_runner_on_an_unquantized_checkpoint_is_transformers(reference, tokens):
    ids, seq = tokens
    ours = CheckpointRunner(TINY)
    m = accuracy(ours, reference, ids[:513], seq, 4)
    assert abs(m["ppl_increase_pct"]) < 1e-3
    assert m["top1_agreement"] > 0.999 and m["mean_kl"] < 1e-8


def test_accuracy_is_independent_of_the_batch_size(reference, tokens):
    ids, seq = tokens
    a = accuracy(reference, reference, ids[:513], seq, 1)
    b = accuracy(reference, reference, ids[:513], seq, 3)
    assert a["reference_perplexity"] == pytest.approx(b["reference_perplexity"], rel=1e-9)


class NaNEngine:
    device, kv_cache = "cpu", False

    def logits(self, input_ids):
        return torch.full((*input_ids.shape, 2048), math.nan)


def test_nan_logits_give_failing_figures(reference, tokens):
    ids, seq = tokens
    m = accuracy(NaNEngine(), reference, ids[:257], seq, 2)
    assert m["ppl_increase_pct"] == math.inf and m["mean_kl"] == math.inf


# -- verdicts on real NVFP4 exports ----------------------------------------------------------------
def test_undamaged_nvfp4_export_passes_the_default_gates(nvfp4_export, reference, heldout):
    spec = nvfp4_spec()
    engine = open_engine("checkpoint", nvfp4_export / "hf")
    report = validate(engine, reference, TINY, heldout, spec, effective_gates("nvfp4", {}), 2048)
    m = report["metrics"]
    assert report["passed"], report["gates"]
    assert 0 < m["ppl_increase_pct"] < 15 and m["top1_agreement"] > 0.7 and m["mean_kl"] < 0.25
    assert [g["name"] for g in report["gates"]] == [*(g for g in effective_gates("nvfp4", {})
                                                      if g != "max_task_accuracy_drop_pts"), "max_peak_memory_bytes",
                                                    "max_ppl_increase_pct", "min_top1_agreement", "max_mean_kl"]
    longer = [g for g in report["gates"] if "seq_len" in g]  # the window gates again, on windows of max_seq_len
    assert {g["seq_len"] for g in longer} == {512} and all(g["passed"] for g in longer)
    assert [(x["seq_len"], x["positions"]) for x in m["long_windows"]] == [(512, [0, 511])]
    assert [x["positions"] for x in report["conditions"]["accuracy"]["lengths"]] == [[0, 127], [0, 511]]
    assert report["conditions"]["eval_batch"] == 1 and report["conditions"]["device"] == "cpu"
    assert {(p["batch_size"], p["seq_len"]) for p in m["throughput"]} == {(1, 256), (1, 64), (1, 128), (1, 512)}


def test_nibble_swapped_nvfp4_export_fails_loudly(damaged_nvfp4, reference, heldout):
    spec = nvfp4_spec()
    engine = CheckpointRunner(damaged_nvfp4)
    report = validate(engine, reference, TINY, heldout, spec, effective_gates("nvfp4", {}), 2048)
    m = report["metrics"]
    verdicts = {g["name"]: g["passed"] for g in report["gates"]}
    assert report["passed"] is False
    assert m["ppl_increase_pct"] > 100.0  # measured: ~×2000
    assert verdicts == {"max_ppl_increase_pct": False, "min_top1_agreement": False, "max_mean_kl": False}
    # an engine that failed its accuracy gates is not timed: no speed, no memory, no longer windows
    assert m["throughput"] == [] and m["peak_memory_bytes"] is None and m["ttft_ms"] is None
    assert report["not_judged"]["min_throughput_tps"].startswith("not measured: the engine failed its accuracy gates")
    assert [x["evaluated"] for x in m["long_windows"]] == [False]


def test_fp8_export_passes_the_tighter_fp8_gates(fp8_export, reference, heldout):
    calls = []

    class Recorded(CheckpointRunner):
        def prefill(self, input_ids):  # logits (accuracy) and the timed forwards both run it
            calls.append("forward")
            return super().prefill(input_ids)

    spec = nvfp4_spec(precision="fp8")
    report = validate(Recorded(fp8_export / "hf"), reference, TINY, heldout, spec, effective_gates("fp8", {}), 2048,
                      before_timing=lambda: calls.append("before_timing"))
    assert report["passed"], report["gates"]
    assert report["metrics"]["ppl_increase_pct"] < 3.0
    # the hook runs once, between the accuracy pass and the first timed forward
    first = calls.index("before_timing")
    assert calls.count("before_timing") == 1 and 0 < first < len(calls) - 1


SMALL = {"max_batch_size": 1, "max_input_len": 64, "max_seq_len": 96, "max_num_tokens": 96}  # quick speed checks


def test_fp8_export_with_one_corrupted_scale_fails_loudly(damaged_fp8, reference, heldout):
    spec = nvfp4_spec(precision="fp8", profile=SMALL)
    report = validate(CheckpointRunner(damaged_fp8), reference, TINY, heldout, spec,
                      effective_gates("fp8", {}), 2048)
    m = report["metrics"]
    verdicts = {g["name"]: g["passed"] for g in report["gates"]}
    assert report["passed"] is False
    assert m["ppl_increase_pct"] > 100.0  # measured: +430 %
    assert verdicts == {"max_ppl_increase_pct": False, "min_top1_agreement": False, "max_mean_kl": False}


def test_an_impossible_threshold_fails_only_its_gate(fp8_export, reference, heldout):
    spec = nvfp4_spec(precision="fp8", profile=SMALL, gates={"max_peak_memory_bytes": 1})
    report = validate(CheckpointRunner(fp8_export / "hf"), reference, TINY, heldout, spec,
                      effective_gates("fp8", spec.gates), 2048)
    failed = [g["name"] for g in report["gates"] if not g["passed"]]
    assert report["passed"] is False and failed == ["max_peak_memory_bytes"]
    assert report["conditions"]["gate_sources"]["max_peak_memory_bytes"] == "set by the build"


def test_transformers_runner_is_the_reference():
    assert isinstance(open_reference(TINY), TransformersRunner)


def test_open_engine_refuses_unknown_backends(tmp_path):
    with pytest.raises(StageFailed, match="onnx"):
        open_engine("onnx", tmp_path)


def test_trtllm_engine_validates_only_where_tensorrt_llm_is(tmp_path):
    import importlib.util

    if importlib.util.find_spec("tensorrt_llm") is not None:
        pytest.skip("TensorRT-LLM is installed here")
    from kiln.errors import ToolchainMissing

    with pytest.raises(ToolchainMissing, match="TensorRT-LLM is not installed"):
        open_engine("trtllm-engine", tmp_path)


def test_aot_inductor_package_that_does_not_load_is_stage_failed(tmp_path):
    (tmp_path / "engine.json").write_text('{"device": "cpu"}')
    (tmp_path / "model.pt2").write_bytes(b"not a package")
    with pytest.raises(StageFailed, match="does not load"):
        open_engine("aot-inductor", tmp_path)

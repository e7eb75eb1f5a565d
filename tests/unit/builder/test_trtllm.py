"""The trtllm-engine backend and the TensorRT-LLM runner, up to the process boundary.

Neither a GPU nor TensorRT-LLM exists here, so nothing in this file runs TensorRT-LLM. What is tested:
- the environment checks (GPUs of the target SM, tensor-parallel size) on hand-made NVML GPU lists;
- the engine checks (plugin config, rank files, version) on hand-made engine directories;
- compile's orchestration with a STAND-IN ``trtllm-build`` (a shell script written by the test that produces a
  hand-made engine directory): the refusal of a mismatching engine, the build log, the tokenizer copy, the record;
- the runner's pure parts: prefix requests and how their logits are assembled (the runtime's answers simulated
  by the reference model), trtllm-bench's dataset, command line and report parsing (report HAND-MADE in the layout
  of TensorRT-LLM 1.2's ``ReportUtility.get_statistics_dict``; the values are invented).
"""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest
import torch

from builder.backends import trtllm
from builder.backends.trtllm import (TRTLLMBackend, build_argv, check_engine_config, check_engine_files,
                                     check_engine_version, check_gpus, expected_plugins, gpu_env)
from kiln.errors import SpecError, StageFailed, ToolchainMissing
from kiln.spec import PROFILES, BatchProfile, parse_spec
from validation.runners import TRTLLMRunner

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "examples" / "tiny-llama"
GB = 1024**3


def spec(**overrides):
    data = {"checkpoint": str(TINY), "precision": "fp8", "backend": "trtllm-engine", "target": "sm90"}
    data.update(overrides)
    return parse_spec(data, [REPO])


def gpu(index, sm="sm90", name="NVIDIA H100 80GB HBM3", memory=80 * GB):
    """HAND-MADE: one entry as kiln.toolchain.detect_gpus returns it."""
    return {"index": index, "name": name, "sm": sm, "memory_bytes": memory, "uuid": f"GPU-{index:08d}-test"}


# -- the environment ---------------------------------------------------------------------------------
def test_enough_gpus_of_the_target_sm():
    gpus = [gpu(0), gpu(1)]
    assert check_gpus(spec(tp_size=2), gpus) == gpus
    assert check_gpus(spec(), gpus) == gpus


def test_tensor_parallel_size_beyond_the_visible_gpus_is_bad_input():
    with pytest.raises(SpecError) as info:
        check_gpus(spec(tp_size=4), [gpu(0), gpu(1), gpu(2, sm="sm89", name="NVIDIA L40S")])
    err = info.value
    assert err.field == "tp_size" and err.code == "invalid_spec"
    assert "4" in err.message and "2 visible" in err.message
    assert "kiln.trtllm-engine.sm90.tp4" in err.fix


@pytest.mark.parametrize("gpus", [[], [gpu(0, sm="sm89", name="NVIDIA L40S")]], ids=["none", "other-sm"])
def test_no_gpu_of_the_target_sm_is_the_wrong_machine(gpus):
    with pytest.raises(ToolchainMissing) as info:
        check_gpus(spec(), gpus)
    assert "sm90 GPU" in info.value.message and "kiln.trtllm-engine.sm90" in info.value.fix
    if gpus:
        assert "L40S (sm89)" in info.value.message


def test_check_environment_refuses_tp_before_any_work(monkeypatch):
    monkeypatch.setattr(trtllm, "check_toolchain", lambda: None)  # as if TensorRT-LLM were installed
    monkeypatch.setattr(trtllm, "detect_gpus", lambda: [gpu(0)])  # HAND-MADE: one H100
    backend = TRTLLMBackend()
    backend.check_environment(spec())
    with pytest.raises(SpecError) as info:
        backend.check_environment(spec(tp_size=2))
    assert info.value.field == "tp_size"


def test_check_environment_without_tensorrt_llm_names_it_first(monkeypatch):
    if trtllm.shutil.which("trtllm-build"):
        pytest.skip("TensorRT-LLM is installed here")
    monkeypatch.setattr(trtllm, "detect_gpus", lambda: [])
    with pytest.raises(ToolchainMissing, match="TensorRT-LLM is not installed"):
        TRTLLMBackend().check_environment(spec(tp_size=8))


def test_the_build_child_sees_exactly_the_chosen_gpus():
    env = gpu_env([gpu(2), gpu(3)], base={"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-00000002-test,GPU-00000003-test"
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID" and env["PATH"] == "/bin"
    assert gpu_env([{**gpu(5), "uuid": None}], base={})["CUDA_VISIBLE_DEVICES"] == "5"


# -- plan -----------------------------------------------------------------------------------------------
def test_plan_shows_the_command_and_the_profile_values():
    s = spec(kv_cache="fp8", profile="balanced", tp_size=2)
    plan = TRTLLMBackend().plan(s, Path("/cache/q"), Path("/cache/c"))
    assert json.loads(json.dumps(plan)) == plan  # what `kiln build --dry-run --json` prints
    [argv] = plan["commands"]
    assert argv == build_argv(s, Path("/cache/c.trtllm-checkpoint"), Path("/cache/c"))
    assert plan["profile"] == {"name": "balanced", "max_batch_size": 8, "max_input_len": 256, "max_seq_len": 512,
                               "max_num_tokens": 2048}
    assert plan["tp_size"] == 2 and plan["target"] == "sm90" and plan["kv_cache"] == "fp8"
    assert plan["quantization"] == {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}
    assert plan["plugins"] == {"--gemm_plugin": "auto", "--use_paged_context_fmha": "enable",
                               "--use_fp8_context_fmha": "enable"}
    text = "\n".join(plan["steps"])
    assert "2 visible sm90" in text and "max_num_tokens 2048" in text and "rank0..rank1.engine" in text


def test_nvfp4_plan_uses_the_nvfp4_gemm_plugin():
    s = spec(precision="nvfp4", target="sm100")
    assert TRTLLMBackend().plan(s, Path("/q"), Path("/c"))["plugins"] == {"--gemm_plugin": "nvfp4"}
    assert expected_plugins(s) == {"paged_kv_cache": True, "gemm_plugin": "nvfp4"}


# -- engine checks ----------------------------------------------------------------------------------
def engine_config(s, **plugin_overrides):
    """HAND-MADE config.json of an engine that matches ``s`` (TensorRT-LLM 1.2 EngineConfig layout)."""
    p = s.batch_profile
    plugins = {"dtype": "bfloat16", "gemm_plugin": "nvfp4" if s.precision == "nvfp4" else "auto",
               "gpt_attention_plugin": "auto", "paged_kv_cache": True, "tokens_per_block": 32, "context_fmha": True,
               "use_paged_context_fmha": True, "use_fp8_context_fmha": s.kv_cache == "fp8"}
    plugins.update(plugin_overrides)
    return {
        "version": "1.2.1",
        "pretrained_config": {"architecture": "LlamaForCausalLM", "dtype": "bfloat16", "vocab_size": 2048,
                              "mapping": {"world_size": s.tp_size, "tp_size": s.tp_size, "pp_size": 1},
                              "quantization": {"quant_algo": s.precision.upper(),
                                               "kv_cache_quant_algo": "FP8" if s.kv_cache == "fp8" else None}},
        "build_config": {**p.limits(), "kv_cache_type": "PAGED", "gather_context_logits": False,
                         "plugin_config": plugins},
    }


@pytest.mark.parametrize("kw", [{}, {"kv_cache": "fp8"}, {"precision": "nvfp4", "target": "sm100"},
                                {"precision": "nvfp4", "target": "sm100", "kv_cache": "fp8", "tp_size": 2}])
def test_matching_engines_pass(kw):
    s = spec(**kw)
    assert check_engine_config(engine_config(s), s) == []


def test_fp8_kv_cache_engine_without_fp8_context_fmha_is_refused():
    s = spec(kv_cache="fp8")
    problems = check_engine_config(engine_config(s, use_fp8_context_fmha=False), s)
    assert problems == ["plugin_config.use_fp8_context_fmha is False, expected True "
                        "(an FP8 KV cache is read by FP8 (paged) context FMHA)"]
    assert len(check_engine_config(engine_config(s, use_paged_context_fmha=False, context_fmha=False), s)) == 2


def test_nvfp4_engine_without_the_nvfp4_gemm_plugin_is_refused():
    s = spec(precision="nvfp4", target="sm100")
    [problem] = check_engine_config(engine_config(s, gemm_plugin=None), s)
    assert problem.startswith("plugin_config.gemm_plugin is None, expected 'nvfp4'")


def test_an_engine_built_with_context_logits_is_not_what_kiln_ships():
    s = spec()
    cfg = engine_config(s)
    cfg["build_config"]["gather_context_logits"] = True
    [problem] = check_engine_config(cfg, s)
    assert "gather_context_logits" in problem


def test_rank_files_follow_tensor_parallelism(tmp_path):
    s = spec(tp_size=2)
    (tmp_path / "rank0.engine").write_bytes(b"plan")
    assert check_engine_files(tmp_path, s) == ["rank1.engine is missing"]
    (tmp_path / "rank1.engine").write_bytes(b"plan")
    assert check_engine_files(tmp_path, s) == []
    assert check_engine_files(tmp_path, spec()) == ["rank1.engine is unexpected for tp_size 1"]


def test_engine_version_must_be_the_installed_one():
    assert check_engine_version({"version": "1.2.1"}, "1.2.1") == []
    assert check_engine_version({"version": "1.2.1"}, "1.2.1+cu12") == []
    assert check_engine_version({}, "1.2.1") == [] and check_engine_version({"version": "1.2.1"}, None) == []
    [problem] = check_engine_version({"version": "1.2.0"}, "1.2.1")
    assert "1.2.0" in problem and "1.2.1" in problem


# -- compile against a STAND-IN trtllm-build ------------------------------------------------------------
STAND_IN = """#!{python}
# STAND-IN for trtllm-build written by tests/unit/builder/test_trtllm.py: NOT TensorRT-LLM. It parses the flags
# Kiln passes and writes a hand-made engine directory (config.json from {config}, one rank file per TP rank).
import json, sys
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
mode = {mode!r}
if mode == "fail":
    print("[TRT-LLM] [E] Engine building failed, please check error log.", file=sys.stderr)
    sys.exit(1)
cfg = json.load(open({config!r}))
out = args["--output_dir"]
import os
os.makedirs(out, exist_ok=True)
json.dump(cfg, open(os.path.join(out, "config.json"), "w"))
for r in range(cfg["pretrained_config"]["mapping"]["tp_size"]):
    open(os.path.join(out, f"rank{{r}}.engine"), "wb").write(b"not a real plan")
print("[TRT-LLM] [I] Total time of building all engines: 00:00:01")
print("argv", json.dumps(sys.argv[1:]))
"""


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    """Put a STAND-IN trtllm-build on PATH; declare TensorRT-LLM present and one HAND-MADE H100 visible."""
    bindir = tmp_path / "bin"
    bindir.mkdir()

    def install(config: dict, mode: str = "ok"):
        (tmp_path / "engine-config.json").write_text(json.dumps(config))
        exe = bindir / "trtllm-build"
        exe.write_text(STAND_IN.format(python=sys.executable,
                                       config=str(tmp_path / "engine-config.json"), mode=mode))
        exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
        return exe

    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(trtllm, "check_toolchain", lambda: None)
    monkeypatch.setattr(trtllm, "detect_gpus", lambda: [gpu(0), gpu(1)])
    monkeypatch.setattr(trtllm, "tensorrt_llm_version", lambda: "1.2.1")
    # the binding probe would import torch in a child (seconds); its output is HAND-MADE here
    monkeypatch.setattr(trtllm, "probe_bindings", lambda env: {
        "tensorrt_llm": "1.2.1", "tensorrt": "10.13.3", "cuda": "12.9", "sm": "sm90", "gpu": "NVIDIA H100 80GB HBM3",
        "torch": "2.9.0", "visible": env["CUDA_VISIBLE_DEVICES"]})
    return install


@pytest.fixture
def quantized(fp8_export):
    """A real quantize-stage output of the tiny Llama (its saved calibration is what compile exports the
    TensorRT-LLM checkpoint from, with the real ModelOpt exporter; only trtllm-build is a stand-in)."""
    return fp8_export


def test_compile_publishes_a_matching_engine_with_its_record(stand_in, quantized, tmp_path):
    s = spec(kv_cache="fp8", tp_size=2, model_name="acme/tiny")
    stand_in(engine_config(s))
    out = tmp_path / "engine"
    record = TRTLLMBackend().compile(s, quantized, out, checkpoint_dir=TINY)
    assert sorted(p.name for p in out.iterdir()) == ["build.log", "config.json", "engine.json", "rank0.engine",
                                                     "rank1.engine", "tokenizer"]
    assert sorted(p.name for p in (out / "tokenizer").iterdir()) == sorted(
        n for n in trtllm.TOKENIZER_FILES if (quantized / "hf" / n).is_file())
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= {p.name for p in (out / "tokenizer").iterdir()}
    assert "Total time of building all engines" in (out / "build.log").read_text()
    assert record["argv"][0] == "trtllm-build" and record["argv"][record["argv"].index("--workers") + 1] == "2"
    assert {k: record["bindings"][k] for k in ("tensorrt_llm", "tensorrt", "cuda", "sm", "gpu")} == {
        "tensorrt_llm": "1.2.1", "tensorrt": "10.13.3", "cuda": "12.9", "sm": "sm90", "gpu": "NVIDIA H100 80GB HBM3"}
    assert record["engine_version"] == "1.2.1" and record["seconds"]["trtllm_build"] >= 0
    assert record["plugin_config"]["use_fp8_context_fmha"] is True
    assert [g["sm"] for g in record["gpus"]] == ["sm90", "sm90"]
    engine = json.loads((out / "engine.json").read_text())
    assert engine["format"] == "kiln-trtllm-engine/1" and engine["model_name"] == "acme/tiny"
    assert engine["tokenizer"] == "tokenizer" and engine["tp_size"] == 2
    assert json.loads(json.dumps(record)) == record  # goes into provenance as JSON
    assert not (tmp_path / "engine.trtllm-build").exists()
    # the TensorRT-LLM checkpoint was exported from the saved calibration by ModelOpt, handed to trtllm-build,
    # and removed afterwards
    assert record["trtllm_checkpoint"]["decoder_type"] == "llama" and record["seconds"]["export_trtllm_checkpoint"] > 0
    argv_dir = Path(record["argv"][record["argv"].index("--checkpoint_dir") + 1])
    assert argv_dir == tmp_path / "engine.trtllm-checkpoint" and not argv_dir.exists()


def test_compile_refuses_an_engine_that_does_not_match_the_spec(stand_in, quantized, tmp_path):
    s = spec()
    stand_in(engine_config(spec(precision="nvfp4", target="sm100")))  # trtllm-build made something else
    out = tmp_path / "engine"
    with pytest.raises(StageFailed, match="does not match the spec") as info:
        TRTLLMBackend().compile(s, quantized, out, checkpoint_dir=TINY)
    assert "quant_algo is 'NVFP4'" in info.value.message
    assert not out.exists() and not (tmp_path / "engine.trtllm-build").exists()


def test_compile_refuses_an_engine_from_another_tensorrt_llm(stand_in, quantized, tmp_path):
    s = spec()
    cfg = engine_config(s)
    cfg["version"] = "1.2.0"
    stand_in(cfg)
    with pytest.raises(StageFailed, match="installed TensorRT-LLM"):
        TRTLLMBackend().compile(s, quantized, tmp_path / "engine", checkpoint_dir=TINY)


def test_compile_reports_trtllm_build_failure_with_its_last_lines(stand_in, quantized, tmp_path):
    stand_in({}, mode="fail")
    with pytest.raises(StageFailed, match="exited 1: .*Engine building failed"):
        TRTLLMBackend().compile(spec(), quantized, tmp_path / "engine", checkpoint_dir=TINY)
    assert not (tmp_path / "engine").exists() and not (tmp_path / "engine.trtllm-build").exists()


def test_compile_checks_gpus_before_running_anything(stand_in, quantized, tmp_path, monkeypatch):
    stand_in(engine_config(spec()))
    monkeypatch.setattr(trtllm, "detect_gpus", lambda: [gpu(0, sm="sm100", name="NVIDIA B200")])
    with pytest.raises(ToolchainMissing, match="must be built on a sm90 GPU"):
        TRTLLMBackend().compile(spec(), quantized, tmp_path / "engine", checkpoint_dir=TINY)
    assert not (tmp_path / "engine.trtllm-build").exists()


# -- the runner's accuracy path: prefix requests ----------------------------------------------------------
def test_prefix_prompts_are_every_prefix_row_major():
    x = torch.tensor([[5, 6, 7], [8, 9, 10]])
    assert TRTLLMRunner.prefix_prompts(x) == [[5], [5, 6], [5, 6, 7], [8], [8, 9], [8, 9, 10]]


def test_prefix_logits_assemble_into_the_full_forward():
    """On a real causal LM (the shipped tiny Llama, through transformers), the logits of the first generated
    token of prefix x[:t+1] — which is what the runtime returns as generation logits, SIMULATED here by the
    model's last-position logits — assembled by TRTLLMRunner equal the full forward's logits at every position."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval()
    x = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(x).logits
        answers = []
        for prompt in TRTLLMRunner.prefix_prompts(x):
            last = model(torch.tensor([prompt])).logits[0, -1]
            padded = torch.cat([last, torch.full((6,), -1e4)])  # a TP engine pads the vocabulary
            answers.append(padded[None].half())  # [generated tokens=1, vocab_padded], in the engine's dtype
    got = TRTLLMRunner.assemble_prefix_logits(answers, 2, 9, model.config.vocab_size)
    assert got.shape == full.shape and got.dtype == torch.float32
    assert torch.allclose(got, full, atol=2e-2)  # fp16 rounding of the simulated answers
    assert (got.argmax(-1) == full.argmax(-1)).float().mean() > 0.95


def test_prefix_logits_refuse_a_short_answer():
    with pytest.raises(StageFailed, match="answered 3 of 4"):
        TRTLLMRunner.assemble_prefix_logits([torch.zeros(1, 8)] * 3, 2, 2, 8)


def test_context_logits_assemble_per_row():
    per = [torch.arange(4 * 10, dtype=torch.float16).reshape(4, 10) + r for r in range(3)]
    got = TRTLLMRunner.assemble_context_logits(per, 3, 4, 8)
    assert got.shape == (3, 4, 8) and got[2, 1, 0] == 12
    with pytest.raises(StageFailed, match="fewer context logits"):
        TRTLLMRunner.assemble_context_logits(per, 3, 5, 8)


def test_runner_needs_tensorrt_llm(tmp_path):
    import importlib.util

    if importlib.util.find_spec("tensorrt_llm") is not None:
        pytest.skip("TensorRT-LLM is installed here")
    with pytest.raises(ToolchainMissing, match="TensorRT-LLM is not installed"):
        TRTLLMRunner(tmp_path)


# -- the runner's speed path: trtllm-bench --------------------------------------------------------------
@pytest.mark.parametrize("profile, shape", [
    (PROFILES["latency"], (256, 64)), (PROFILES["throughput"], (256, 64)),
    (BatchProfile(max_batch_size=4, max_input_len=100, max_seq_len=120, max_num_tokens=400), (100, 20)),
    (BatchProfile(max_batch_size=4, max_input_len=300, max_seq_len=300, max_num_tokens=1200), (299, 1)),
    (BatchProfile(max_batch_size=2, max_input_len=512, max_seq_len=1024, max_num_tokens=128), (128, 64)),
    (BatchProfile(max_batch_size=1, max_input_len=1, max_seq_len=2, max_num_tokens=1), (1, 1)),
])
def test_bench_requests_fit_the_engine(profile, shape):
    inp, out = TRTLLMRunner.bench_shape(profile)
    assert (inp, out) == shape
    assert inp + out <= profile.max_seq_len and inp <= profile.max_num_tokens and inp <= profile.max_input_len


def test_bench_dataset_is_trtllm_bench_json_lines(tmp_path):
    records = TRTLLMRunner.bench_dataset(num_requests=5, input_len=7, output_len=3, vocab=50, seed=1)
    path = TRTLLMRunner.write_bench_dataset(tmp_path / "d.jsonl", records)
    lines = path.read_text().splitlines()
    assert len(lines) == 5 and path.read_text().endswith("\n")
    parsed = [json.loads(line) for line in lines]  # one object per line, no indentation
    assert [set(r) for r in parsed] == [{"task_id", "input_ids", "output_tokens"}] * 5
    assert [r["task_id"] for r in parsed] == list(range(5))
    assert all(len(r["input_ids"]) == 7 and r["output_tokens"] == 3 for r in parsed)
    assert all(isinstance(t, int) and 0 <= t < 50 for r in parsed for t in r["input_ids"])
    assert parsed == TRTLLMRunner.bench_dataset(num_requests=5, input_len=7, output_len=3, vocab=50, seed=1)
    assert parsed != TRTLLMRunner.bench_dataset(num_requests=5, input_len=7, output_len=3, vocab=50, seed=2)


def test_bench_command_line():
    argv = TRTLLMRunner.bench_argv(Path("/e"), Path("/e/tokenizer"), Path("/w/d.jsonl"), Path("/w/r.json"),
                                   concurrency=8, num_requests=32, warmup=8, model="acme/tiny", workspace=Path("/w"))
    assert argv == ["trtllm-bench", "--model", "acme/tiny", "--model_path", "/e/tokenizer", "--workspace", "/w",
                    "throughput", "--backend", "tensorrt", "--engine_dir", "/e", "--dataset", "/w/d.jsonl",
                    "--concurrency", "8", "--num_requests", "32", "--warmup", "8", "--eos_id", "-1", "--streaming",
                    "--report_json", "/w/r.json"]


def bench_report(*, streaming=True, total=51234.5):
    """HAND-MADE trtllm-bench --report_json: the keys of TensorRT-LLM 1.2's ReportUtility.get_statistics_dict,
    invented values."""
    report = {
        "engine": {"model": "acme/tiny", "model_path": "/e/tokenizer", "engine_dir": "/e", "version": "1.2.1",
                   "backend": "TRT", "dtype": "bfloat16", "kv_cache_dtype": None, "quantization": "FP8",
                   "max_input_length": 256, "max_sequence_length": 512},
        "machine": {"name": "NVIDIA H100 80GB HBM3", "memory.total": 79.1, "clocks.mem": 2.6},
        "world_info": {"tp_size": 1, "pp_size": 1, "ep_size": 1, "world_size": 1, "max_batch_size": 8,
                       "max_num_tokens": 2048, "scheduling_policy": "GUARANTEED_NO_EVICT",
                       "kv_cache_percentage": 0.9, "issue_rate": 1.0e9},
        "request_info": {"num_requests": 32, "avg_num_concurrent_requests": 7.6, "avg_input_length": 256.0,
                         "avg_output_length": 64.0},
        "performance": {"total_latency_ms": 199.9, "avg_request_latency_ms": 48.2, "request_throughput_req_s": 160.1,
                        "system_output_throughput_tok_s": 10246.9, "system_total_throughput_tok_s": total,
                        "output_throughput_per_user_tok_s": 1327.0, "output_throughput_per_gpu_tok_s": 10246.9,
                        "request_latency_percentiles_ms": {"p50": 47.0, "p99": 60.1}},
        "dataset": {"num_requests": 32},
    }
    if streaming:
        report["streaming_metrics"] = {
            "token_output_speed_tok_s": 1500.2, "avg_ttft_ms": 6.25, "avg_tpot_ms": 0.66,
            "tpot_percentiles": {"minimum": 0.5, "maximum": 0.9, "average": 0.66, "p50": 0.65, "p90": 0.8,
                                 "p95": 0.85, "p99": 0.88},
            "ttft_percentiles": {"minimum": 4.0, "maximum": 9.0, "average": 6.25, "p50": 6.0, "p90": 8.0,
                                 "p95": 8.5, "p99": 8.9},
            "gen_tps_percentiles": {"average": 1500.2}}
    return report


def test_bench_report_becomes_a_throughput_point():
    point = TRTLLMRunner.parse_bench_report(bench_report(), batch=8, input_len=256, output_len=64)
    assert point == {
        "batch_size": 8, "seq_len": 256, "output_len": 64, "tokens_per_s": 51234.5, "output_tokens_per_s": 10246.9,
        "requests_per_s": 160.1, "seconds_total": pytest.approx(0.1999), "request_latency_ms": 48.2,
        "ttft_ms": 6.25, "tpot_ms": 0.66, "ttft_p99_ms": 8.9, "tpot_p99_ms": 0.88, "num_requests": 32,
        "avg_concurrency": 7.6, "tensorrt_llm": "1.2.1", "gpu": "NVIDIA H100 80GB HBM3", "source": "trtllm-bench"}


def test_bench_report_without_streaming_has_no_latency_and_without_performance_is_refused():
    point = TRTLLMRunner.parse_bench_report(bench_report(streaming=False), batch=1, input_len=8, output_len=8)
    assert point["ttft_ms"] is None and point["tpot_ms"] is None and point["tokens_per_s"] == 51234.5
    with pytest.raises(StageFailed, match="system_total_throughput_tok_s"):
        TRTLLMRunner.parse_bench_report({"engine": {}}, batch=1, input_len=8, output_len=8)


@pytest.fixture
def engine_dir(tmp_path):
    """HAND-MADE engine dir as the backend leaves it (config.json, engine.json, tokenizer/)."""
    e = tmp_path / "engine"
    (e / "tokenizer").mkdir(parents=True)
    (e / "tokenizer" / "config.json").write_text((TINY / "config.json").read_text())
    (e / "config.json").write_text(json.dumps(engine_config(spec(profile="balanced"))))
    (e / "engine.json").write_text(json.dumps({"model_name": "acme/tiny"}))
    return e


class BenchStandIn:
    """STAND-IN for the process runner (subprocess.run): records each trtllm-bench command, checks its dataset
    and writes a hand-made report where --report_json says. No trtllm-bench runs."""

    def __init__(self, returncode=0):
        self.calls, self.returncode = [], returncode

    def __call__(self, argv, **kw):
        import subprocess

        self.calls.append(argv)
        args = {a: b for a, b in zip(argv, argv[1:]) if a.startswith("--") and not b.startswith("--")}
        records = [json.loads(line) for line in Path(args["--dataset"]).read_text().splitlines()]
        assert len(records) == int(args["--num_requests"])
        if self.returncode == 0:
            Path(args["--report_json"]).write_text(json.dumps(bench_report(total=1000.0 * int(args["--concurrency"]))))
        return subprocess.CompletedProcess(argv, self.returncode, "", "[TRT-LLM] [E] out of memory\n")


def test_throughput_with_trtllm_bench_runs_one_bench_per_batch_size(engine_dir, tmp_path):
    run = BenchStandIn()
    points = TRTLLMRunner.throughput_with_trtllm_bench(engine_dir, PROFILES["balanced"], workdir=tmp_path / "w",
                                                       run=run)
    assert [p["batch_size"] for p in points] == [1, 2, 4, 8]  # validation.points.batch_points(8)
    assert [p["tokens_per_s"] for p in points] == [1000.0, 2000.0, 4000.0, 8000.0]
    assert all(p["seq_len"] == 256 and p["output_len"] == 64 and p["ttft_ms"] == 6.25 for p in points)
    first = run.calls[0]
    assert first[:5] == ["trtllm-bench", "--model", "acme/tiny", "--model_path", str(engine_dir / "tokenizer")]
    assert first[first.index("--engine_dir") + 1] == str(engine_dir) and "--streaming" in first
    assert [c[c.index("--num_requests") + 1] for c in run.calls] == ["8", "8", "16", "32"]
    dataset = [json.loads(line) for line in (tmp_path / "w" / "dataset-b8.jsonl").read_text().splitlines()]
    assert all(len(r["input_ids"]) == 256 and max(r["input_ids"]) < 2048 for r in dataset)


def test_throughput_with_trtllm_bench_failure_and_missing_pieces(engine_dir, tmp_path):
    with pytest.raises(StageFailed, match="batch 1 exited 2: .*out of memory"):
        TRTLLMRunner.throughput_with_trtllm_bench(engine_dir, PROFILES["latency"], run=BenchStandIn(returncode=2))
    (engine_dir / "tokenizer" / "config.json").unlink()
    with pytest.raises(StageFailed, match="tokenizer/config.json"):
        TRTLLMRunner.throughput_with_trtllm_bench(engine_dir, PROFILES["latency"], run=BenchStandIn())
    if trtllm.shutil.which("trtllm-bench") is None:
        with pytest.raises(ToolchainMissing, match="trtllm-bench is not installed"):
            TRTLLMRunner.throughput_with_trtllm_bench(engine_dir, PROFILES["latency"])


# -- the engine check against a RECONSTRUCTED TensorRT-LLM 1.2.x config.json ----------------------------------
# data/trtllm-1.2-llama3-fp8-engine-config.json is what `trtllm-build` 1.2.x writes (Engine.save ->
# EngineConfig.to_dict) for a Llama-3.1-8B FP8 / FP8-KV engine built with build_argv's flags and the `latency`
# profile, reconstructed field by field from TensorRT-LLM's source; data/…SOURCE.md names the commits and what
# every section comes from. It is NOT the output of a real build (none has run here), but nothing in it is written
# to suit check_engine_config.
REAL_CONFIG = Path(__file__).resolve().parent / "data" / "trtllm-1.2-llama3-fp8-engine-config.json"


def real_config() -> dict:
    return json.loads(REAL_CONFIG.read_text())


def real_spec():
    """The spec that engine was built for: FP8 weights, FP8 KV cache, sm90, the latency profile, tp 1."""
    return spec(kv_cache="fp8", profile="latency", tp_size=1)


def test_reconstructed_engine_config_is_what_build_argv_asks_for():
    cfg, s = real_config(), real_spec()
    argv = build_argv(s, Path("/ckpt"), Path("/out"))
    flags = dict(zip(argv[1::2], argv[2::2]))
    build, pretrained = cfg["build_config"], cfg["pretrained_config"]
    for name in ("max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens"):
        assert build[name] == int(flags[f"--{name}"]) == PROFILES["latency"].limits()[name]
    assert build["plugin_config"]["gemm_plugin"] == flags["--gemm_plugin"] == "auto"  # kept as given, not resolved
    assert build["plugin_config"]["use_paged_context_fmha"] is build["plugin_config"]["use_fp8_context_fmha"] is True
    assert pretrained["mapping"]["tp_size"] == int(flags["--workers"]) == 1
    assert set(cfg) == {"version", "pretrained_config", "build_config"}
    assert "dry_run" not in build and "visualize_network" not in build  # EngineConfig.to_dict drops them


def test_reconstructed_trtllm_engine_config_matches_its_spec():
    assert check_engine_config(real_config(), real_spec()) == []
    assert check_engine_version(real_config(), "1.2.1") == []


def _set(cfg: dict, dotted: str, value) -> dict:
    node = cfg
    *path, last = dotted.split(".")
    for key in path:
        node = node[key]
    node[last] = value
    return cfg


@pytest.mark.parametrize(("dotted", "value", "named"), [
    ("pretrained_config.quantization.quant_algo", "NVFP4", "quant_algo"),
    ("pretrained_config.quantization.quant_algo", None, "quant_algo"),
    ("pretrained_config.quantization.kv_cache_quant_algo", None, "kv_cache_quant_algo"),
    ("pretrained_config.quantization.kv_cache_quant_algo", "INT8", "kv_cache_quant_algo"),
    ("build_config.max_batch_size", 8, "build_config.max_batch_size"),
    ("build_config.max_num_tokens", 256, "build_config.max_num_tokens"),
    ("build_config.kv_cache_type", "CONTINUOUS", "kv_cache_type"),
    ("build_config.plugin_config.paged_kv_cache", False, "paged_kv_cache"),
    ("pretrained_config.mapping.tp_size", 2, "mapping.tp_size"),
    ("build_config.gather_context_logits", True, "gather_context_logits"),
    ("build_config.plugin_config.use_fp8_context_fmha", False, "use_fp8_context_fmha"),
], ids=lambda v: str(v))
def test_one_wrong_field_of_the_reconstructed_config_is_one_problem_naming_it(dotted, value, named):
    [problem] = check_engine_config(_set(real_config(), dotted, value), real_spec())
    assert named in problem


def test_a_continuous_kv_cache_engine_as_trtllm_writes_it_is_one_problem():
    # BuildConfig.update_kv_cache_type keeps kv_cache_type and plugin_config.paged_kv_cache in step: a
    # --kv_cache_type continuous build writes both. Kiln reports it once.
    cfg = _set(_set(real_config(), "build_config.kv_cache_type", "CONTINUOUS"),
               "build_config.plugin_config.paged_kv_cache", False)
    [problem] = check_engine_config(cfg, real_spec())
    assert "not paged" in problem and "'CONTINUOUS'" in problem and "paged_kv_cache False" in problem


@pytest.mark.parametrize("spelling", ["PAGED", "paged", "KVCacheType.PAGED"])
def test_kv_cache_type_is_read_in_every_spelling_trtllm_has_used(spelling):
    # "PAGED": BuildConfig.to_dict writes the enum's name. "paged": the value of 1.2's Python KVCacheType(str, Enum)
    # (llmapi/kv_cache_type.py), what a JSON-mode pydantic dump of the migrated BuildConfig would write.
    # "KVCacheType.PAGED": str() of the pybind enum, ConfigEncoder's input.
    cfg = _set(real_config(), "build_config.kv_cache_type", spelling)
    assert check_engine_config(cfg, real_spec()) == []


def test_the_reconstructed_fp8_engine_refuses_specs_it_was_not_built_for():
    cfg = real_config()
    assert {p.split(" is ")[0] for p in check_engine_config(cfg, spec(profile="balanced"))} == {
        "kv_cache_quant_algo", "build_config.max_batch_size", "build_config.max_num_tokens"}
    [problem] = check_engine_config(cfg, spec(kv_cache="fp8", tp_size=2))
    assert problem == "mapping.tp_size is 1, spec asks 2"

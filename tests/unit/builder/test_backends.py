"""Backends: the trtllm-build argv and engine-config checks (TensorRT-LLM cannot run here), the aot-inductor
plan and early refusals, and the checkpoint backend's copy."""

from __future__ import annotations

import copy
import json
import re
import shutil
from pathlib import Path

import pytest

from builder.backends import BACKENDS, get_backend
from builder.backends.aot_inductor import AOTInductorBackend
from builder.backends.checkpoint import CheckpointBackend
from builder.backends.trtllm import TRTLLMBackend, build_argv, check_engine_config
from kiln.errors import SpecError, StageFailed, ToolchainMissing
from kiln.precisions import PRECISIONS
from kiln.recipes import recipes_for
from kiln.spec import PROFILES, parse_spec

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "examples" / "tiny-llama"
CKPT_DIR = Path("/q/trtllm")
OUT_DIR = Path("/engines/e1")


def spec(**overrides):
    data = {"checkpoint": str(TINY), "precision": "fp8", "backend": "trtllm-engine", "target": "sm100"}
    data.update(overrides)
    return parse_spec(data, [REPO])


def test_backends_by_name():
    assert {"trtllm-engine", "aot-inductor", "checkpoint"} <= set(BACKENDS)
    assert isinstance(get_backend("trtllm-engine"), TRTLLMBackend) and get_backend("trtllm-engine").info.export == "trtllm"
    assert isinstance(get_backend("aot-inductor"), AOTInductorBackend) and get_backend("aot-inductor").info.export == "hf"
    assert isinstance(get_backend("checkpoint"), CheckpointBackend) and get_backend("checkpoint").info.export == "hf"


# -- trtllm-build argv -----------------------------------------------------------------------------
EXPECTED_LIMITS = {  # batch, input, seq, tokens of the named profiles
    "latency": ("1", "256", "512", "512"),
    "balanced": ("8", "256", "512", "2048"),
    "throughput": ("32", "256", "512", "8192"),
}


@pytest.mark.parametrize("precision, gemm", [("fp8", "auto"), ("nvfp4", "nvfp4")])
@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_build_argv_for_every_named_profile(profile, precision, gemm):
    b, i, s, t = EXPECTED_LIMITS[profile]
    # FP8: the GEMM plugin in the model dtype (FP8 linears run on TensorRT's FP8 kernels); NVFP4: the NVFP4 GEMM
    # plugin, which TensorRT-LLM 1.x's builder selects for NVFP4 checkpoints anyway unless explicitly disabled.
    assert build_argv(spec(profile=profile, precision=precision), CKPT_DIR, OUT_DIR) == [
        "trtllm-build",
        "--checkpoint_dir", "/q/trtllm",
        "--output_dir", "/engines/e1",
        "--max_batch_size", b,
        "--max_input_len", i,
        "--max_seq_len", s,
        "--max_num_tokens", t,
        "--kv_cache_type", "paged",
        "--gemm_plugin", gemm,
        "--workers", "1",
    ]


@pytest.mark.parametrize("precision", [p for p in PRECISIONS if any(
    BACKENDS["trtllm-engine"].builds(r.name) for r in recipes_for(p))])  # the precisions trtllm-build takes
def test_fp8_kv_cache_enables_paged_fp8_context_fmha(precision):
    argv = build_argv(spec(precision=precision, kv_cache="fp8", profile="balanced"), CKPT_DIR, OUT_DIR)
    plain = build_argv(spec(precision=precision, profile="balanced"), CKPT_DIR, OUT_DIR)
    assert argv == plain[:-2] + ["--use_paged_context_fmha", "enable", "--use_fp8_context_fmha", "enable"] + plain[-2:]


def test_build_argv_never_gathers_context_logits():
    for kw in ({}, {"kv_cache": "fp8"}, {"precision": "nvfp4", "tp_size": 2}):
        assert not any("logits" in a for a in build_argv(spec(**kw), CKPT_DIR, OUT_DIR))


def test_build_argv_workers_follow_tensor_parallel_size():
    argv = build_argv(spec(target="sm90", tp_size=4), CKPT_DIR, OUT_DIR)
    assert argv[argv.index("--workers") + 1] == "4"


def test_build_argv_for_a_custom_profile():
    prof = {"max_batch_size": 3, "max_input_len": 100, "max_seq_len": 150, "max_num_tokens": 300}
    argv = build_argv(spec(profile=prof), CKPT_DIR, OUT_DIR)
    assert [argv[argv.index(f"--{k}") + 1] for k in prof] == ["3", "100", "150", "300"]


def test_every_argv_element_is_a_string():
    assert all(isinstance(a, str) for a in build_argv(spec(kv_cache="fp8", tp_size=2, target="sm90"), CKPT_DIR, OUT_DIR))


def test_trtllm_plan_is_the_argv_on_the_trtllm_export_made_from_the_calibration():
    s = spec(profile="throughput")
    plan = TRTLLMBackend().plan(s, Path("/cache/q1"), OUT_DIR)
    assert plan["commands"] == [build_argv(s, Path("/engines/e1.trtllm-checkpoint"), OUT_DIR)]
    assert any("/cache/q1/calibration" in step for step in plan["steps"])
    assert all(isinstance(a, str) for cmd in plan["commands"] for a in cmd)
    assert plan["profile"] == PROFILES["throughput"].model_dump() and plan["tp_size"] == 1
    assert plan["plugins"] == {"--gemm_plugin": "auto"} and plan["steps"]


# -- engine config checks --------------------------------------------------------------------------
def engine_config(*, quant_algo="FP8", kv_algo=None, tp_size=1, batch=1, inp=256, seq=512, tokens=512, paged=True):
    """HAND-MADE: an engine config.json laid out as TensorRT-LLM 1.2's EngineConfig.to_dict() writes it
    (version, pretrained_config{..., mapping, quantization}, build_config{max_*, kv_cache_type, plugin_config}).
    The plugin values are what 1.x's builder leaves for Kiln's argv (read in tensorrt_llm/builder.py): the NVFP4
    GEMM plugin for NVFP4; paged context FMHA on (the default); FP8 context FMHA on exactly with an FP8 KV cache."""
    return {
        "version": "1.2.1",
        "pretrained_config": {
            "architecture": "LlamaForCausalLM", "dtype": "float16", "vocab_size": 2048, "hidden_size": 128,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
            "mapping": {"world_size": tp_size, "tp_size": tp_size, "pp_size": 1, "cp_size": 1, "gpus_per_node": 8},
            "quantization": {"quant_algo": quant_algo, "kv_cache_quant_algo": kv_algo, "group_size": 16,
                             "exclude_modules": ["lm_head"]},
        },
        "build_config": {
            "max_input_len": inp, "max_seq_len": seq, "opt_batch_size": 8, "max_batch_size": batch,
            "max_beam_width": 1, "max_num_tokens": tokens, "opt_num_tokens": None,
            "kv_cache_type": "PAGED" if paged else "CONTINUOUS", "strongly_typed": True,
            "plugin_config": {"dtype": "float16", "gemm_plugin": "nvfp4" if quant_algo == "NVFP4" else "auto",
                              "gpt_attention_plugin": "auto", "paged_kv_cache": paged, "tokens_per_block": 32,
                              "use_paged_context_fmha": True, "use_fp8_context_fmha": kv_algo == "FP8",
                              "remove_input_padding": True, "context_fmha": True},
        },
    }


@pytest.mark.parametrize("precision, algo", [("fp8", "FP8"), ("nvfp4", "NVFP4")])
def test_matching_engine_config_has_no_problems(precision, algo):
    assert check_engine_config(engine_config(quant_algo=algo), spec(precision=precision)) == []


def test_matching_engine_with_fp8_kv_and_tp():
    cfg = engine_config(kv_algo="FP8", tp_size=2, batch=32, tokens=8192)
    assert check_engine_config(cfg, spec(kv_cache="fp8", tp_size=2, target="sm90", profile="throughput")) == []


def test_mismatched_quant_algo_is_reported():
    problems = check_engine_config(engine_config(quant_algo="FP8"), spec(precision="nvfp4"))
    assert "quant_algo" in problems[0] and "NVFP4" in problems[0]
    assert len(problems) == 2 and "gemm_plugin" in problems[1]  # an FP8 engine has no NVFP4 GEMM plugin either
    assert check_engine_config(engine_config(quant_algo=None), spec())[0].startswith("quant_algo is None")


def test_mismatched_kv_cache_quant_algo_is_reported():
    assert "kv_cache_quant_algo" in check_engine_config(engine_config(kv_algo="FP8"), spec())[0]
    assert "kv_cache_quant_algo" in check_engine_config(engine_config(), spec(kv_cache="fp8"))[0]


@pytest.mark.parametrize("field, kw", [("max_batch_size", {"batch": 2}), ("max_input_len", {"inp": 128}),
                                       ("max_seq_len", {"seq": 1024}), ("max_num_tokens", {"tokens": 64})])
def test_mismatched_limits_are_reported(field, kw):
    problems = check_engine_config(engine_config(**kw), spec())
    assert len(problems) == 1 and f"build_config.{field}" in problems[0]


def test_mismatched_tp_size_is_reported():
    problems = check_engine_config(engine_config(tp_size=2), spec())
    assert problems == ["mapping.tp_size is 2, spec asks 1"]


def test_non_paged_kv_cache_is_reported():
    problems = check_engine_config(engine_config(paged=False), spec())
    assert len(problems) == 1 and "paged_kv_cache" in problems[0]
    cfg = engine_config()
    cfg["build_config"]["kv_cache_type"] = "CONTINUOUS"  # paged_kv_cache left unset
    del cfg["build_config"]["plugin_config"]["paged_kv_cache"]
    assert len(check_engine_config(cfg, spec())) == 1


def test_every_mismatch_is_reported_at_once():
    cfg = engine_config(quant_algo="NVFP4", kv_algo="FP8", tp_size=4, batch=64, paged=False)
    assert len(check_engine_config(cfg, spec())) == 5


def test_empty_config_is_all_problems_not_a_crash():
    problems = check_engine_config({}, spec())
    assert any("quant_algo" in p for p in problems) and any("max_batch_size" in p for p in problems)


def test_check_does_not_modify_the_config():
    cfg = engine_config()
    before = copy.deepcopy(cfg)
    check_engine_config(cfg, spec(precision="nvfp4"))
    assert cfg == before


def test_trtllm_spec_cannot_ask_for_more_tokens_than_batch_times_sequence():
    prof = {"max_batch_size": 1, "max_input_len": 64, "max_seq_len": 128, "max_num_tokens": 4096}
    with pytest.raises(SpecError) as err:  # refused before any work, not capped by trtllm-build later
        spec(profile=prof)
    assert err.value.field == "profile.max_num_tokens" and err.value.fix


# -- trtllm compile here ---------------------------------------------------------------------------
def test_trtllm_compile_without_tensorrt_llm_raises_toolchain_missing(tmp_path):
    if shutil.which("trtllm-build"):
        pytest.skip("TensorRT-LLM is installed here")
    backend = TRTLLMBackend()
    with pytest.raises(ToolchainMissing) as info:
        backend.compile(spec(), tmp_path / "q", tmp_path / "engine", checkpoint_dir=TINY)
    assert "TensorRT-LLM is not installed" in info.value.message
    assert "release" in info.value.fix and info.value.code == "toolchain_missing"
    with pytest.raises(ToolchainMissing):
        backend.check_environment(spec())
    assert not (tmp_path / "engine").exists() and not (tmp_path / "engine.trtllm-build").exists()


# -- aot-inductor ----------------------------------------------------------------------------------
@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_aot_inductor_plan_mentions_the_dynamic_ranges(profile):
    s = spec(backend="aot-inductor", target="cpu", profile=profile)
    plan = AOTInductorBackend().plan(s, Path("/cache/q1"), Path("/cache/c1"))
    p = PROFILES[profile]
    text = "\n".join(plan["steps"])
    assert plan["commands"] == []
    assert f"batch: 1..{p.max_batch_size}" in text and f"seq: 1..{p.max_seq_len}" in text
    assert "/cache/q1/hf" in text and "/cache/c1/model.pt2" in text and "device cpu" in text


def test_aot_inductor_gpu_target_without_cuda_is_toolchain_missing(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    s = spec(backend="aot-inductor", target="sm90")
    with pytest.raises(ToolchainMissing) as info:
        AOTInductorBackend().compile(s, tmp_path / "q", tmp_path / "c", checkpoint_dir=TINY)
    assert "sm90" in info.value.message and info.value.fix
    AOTInductorBackend().check_environment(spec(backend="aot-inductor", target="cpu"))  # cpu is fine


def test_aot_inductor_refuses_a_profile_longer_than_the_model(nvfp4_export, tmp_path):
    prof = {"max_batch_size": 2, "max_input_len": 256, "max_seq_len": 1024, "max_num_tokens": 2048}  # model: 512
    s = spec(backend="aot-inductor", target="cpu", precision="nvfp4", profile=prof)
    with pytest.raises(StageFailed, match="1024"):
        AOTInductorBackend().compile(s, nvfp4_export, tmp_path / "c", checkpoint_dir=TINY)
    assert not (tmp_path / "c").exists()


def test_aot_inductor_compile_leaves_none_of_the_traced_models_weights_alive(nvfp4_export, tmp_path, monkeypatch):
    """torch keeps the last non-strict export's graph — a ``GraphModule`` holding the traced model's float32
    weights as its parameters — in a module-level map until the next export: the compile stage lets go of it, or
    validation would carry one more copy of the engine's weights. The export and AOTInductor's lowering are real
    (the lowering's trace is what torch keeps), of the NVFP4 export cut to its first layer (a quarter of the
    lowering's time); the C++ compile after them is made to fail, so the test takes no compiler time and checks
    the failure path's release too."""
    import gc

    import torch
    from safetensors.torch import load_file, save_file
    from torch._inductor.codecache import AotCodeCompiler

    def parameters():
        gc.collect()
        return [o for o in gc.get_objects() if isinstance(o, torch.nn.Parameter)]

    def fail(*args, **kwargs):
        raise RuntimeError("stopped before the C++ compile")

    one = tmp_path / "q" / "hf"
    shutil.copytree(nvfp4_export / "hf", one)
    config = json.loads((one / "config.json").read_text())
    config["num_hidden_layers"] = 1
    (one / "config.json").write_text(json.dumps(config))
    for f in one.glob("*.safetensors"):
        save_file({k: v for k, v in load_file(f).items() if not re.match(r"model\.layers\.[1-9]", k)}, f)
    monkeypatch.setattr(AotCodeCompiler, "compile", fail)
    before = parameters()  # held, so no new parameter can take one of their ids
    s = spec(backend="aot-inductor", target="cpu", precision="nvfp4")
    try:
        AOTInductorBackend().compile(s, tmp_path / "q", tmp_path / "c", checkpoint_dir=TINY)
    except StageFailed as exc:
        assert "stopped before the C++ compile" in exc.message
    else:
        raise AssertionError("the compile did not fail")
    known = {id(p) for p in before}
    assert [tuple(p.shape) for p in parameters() if id(p) not in known] == []


# -- checkpoint ------------------------------------------------------------------------------------
def test_checkpoint_backend_copies_the_hf_export_and_writes_engine_json(nvfp4_export, tmp_path):
    s = spec(backend="checkpoint", target="sm90", precision="nvfp4", kv_cache="fp8", profile="balanced")
    out = tmp_path / "engine"
    backend = CheckpointBackend()
    assert str(nvfp4_export / "hf") in backend.plan(s, nvfp4_export, out)["steps"][0]
    record = backend.compile(s, nvfp4_export, out, checkpoint_dir=TINY)
    assert record["backend"] == "checkpoint"
    src = sorted(p.name for p in (nvfp4_export / "hf").iterdir())
    assert sorted(p.name for p in out.iterdir()) == sorted(src + ["engine.json", "serving"])
    assert sorted(p.name for p in (out / "serving").iterdir()) == [
        "serving.json", "sglang.yaml", "trtllm-serve.yaml", "vllm.yaml"]  # builder/serving.py, tests/unit/builder/test_serving.py
    for name in src:
        assert (out / name).read_bytes() == (nvfp4_export / "hf" / name).read_bytes()
    engine = json.loads((out / "engine.json").read_text())
    assert engine == {"format": "kiln-hf-checkpoint/1", "precision": "nvfp4", "kv_cache": "fp8",
                      "profile": PROFILES["balanced"].model_dump(), "target": "sm90"}
    assert not (nvfp4_export / "hf" / "engine.json").exists()  # the shared export is untouched


@pytest.mark.parametrize("target,config,expected", [
    ("sm90", {"dtype": "bfloat16"}, "bfloat16"),  # a GPU engine computes in the checkpoint's own dtype
    ("sm100", {"torch_dtype": "float16"}, "float16"),
    ("sm90", {"dtype": "float32"}, "float32"),
    ("sm90", {}, "float32"),
])
def test_the_aot_inductor_engine_computes_in_the_checkpoints_dtype_on_gpu_targets(target, config, expected):
    import torch

    from builder.backends.aot_inductor import compute_dtype

    assert compute_dtype(target, config) == getattr(torch, expected)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_the_ladder_screens_a_rung_in_the_dtype_its_backends_engine_computes_in(backend, tmp_path):
    """The aot-inductor engine computes a bf16 checkpoint in bf16 on a GPU target; the others compute in float32
    (the checkpoint runner's), whatever the checkpoint."""
    import torch

    from builder.ladder import screen_dtype

    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"dtype": "bfloat16"}))
    want = torch.bfloat16 if backend == "aot-inductor" else torch.float32
    assert screen_dtype(spec(backend=backend, target="sm90"), tmp_path) == want


@pytest.mark.parametrize("cpu,config,expected", [
    ("x86_64-AVX2", {"dtype": "bfloat16"}, "float32"),  # no native bf16: float32 is the faster
    ("x86_64-AVX512", {"dtype": "bfloat16"}, "float32"),  # AVX512 without AVX512-BF16 / AMX: bf16 is emulated
    ("x86_64-AVX512+avx512_bf16+avx512_vnni+bf16", {"dtype": "bfloat16"}, "bfloat16"),
    ("x86_64-AVX512+amx_tile+avx512_bf16+avx512_vnni+bf16", {"torch_dtype": "bfloat16"}, "bfloat16"),
    ("x86_64-AVX512+amx_tile+avx512_bf16+avx512_vnni+bf16", {"dtype": "float32"}, "float32"),  # never below it
    ("x86_64-AVX512+amx_tile+avx512_bf16+avx512_vnni+bf16", {"dtype": "float16"}, "float32"),
    ("aarch64-DEFAULT+bf16", {"dtype": "bfloat16"}, "bfloat16"),
])
def test_a_cpu_engine_computes_bf16_only_for_a_bf16_checkpoint_on_native_bf16_units(cpu, config, expected):
    import torch

    from builder.backends.aot_inductor import compute_choice

    dtype, why = compute_choice("cpu", config, cpu)
    assert dtype == getattr(torch, expected)
    assert (cpu in why) if config.get("dtype", config.get("torch_dtype")) == "bfloat16" else ("checkpoint is" in why)


def _fake_cpu(monkeypatch, *, capability: str, probes: dict[str, bool], flags: set[str], machine: str = "x86_64"):
    """This host's capability readers answering as another CPU would; the toolchain read again."""
    import platform

    import torch

    from kiln import toolchain

    monkeypatch.setattr(platform, "machine", lambda: machine)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    for name in ("_is_vnni_supported", "_is_amx_tile_supported", "_is_avx512_bf16_supported"):
        monkeypatch.setattr(torch.cpu, name, lambda v=probes.get(name, False): v)
    monkeypatch.setattr(toolchain, "_proc_cpu_flags", lambda: set(flags))
    toolchain._toolchain_for.cache_clear()


@pytest.mark.parametrize("capability,probes,flags,cpu,expected", [
    ("AVX2", {}, {"avx2", "fma"}, "x86_64-AVX2", "float32"),  # AMD EPYC (Zen 2/3)
    # ATEN_CPU_CAPABILITY=avx2 on an AMX Xeon: AVX2 code, no bf16 units used
    ("AVX2", {"_is_vnni_supported": True, "_is_amx_tile_supported": True, "_is_avx512_bf16_supported": True},
     {"avx2", "avx512f", "amx_bf16", "amx_tile", "avx512_bf16"}, "x86_64-AVX2", "float32"),
    ("AVX512", {}, {"avx2", "avx512f"}, "x86_64-AVX512", "float32"),  # Skylake-SP
    ("AVX512", {"_is_vnni_supported": True}, {"avx512f", "avx512_vnni"}, "x86_64-AVX512+avx512_vnni", "float32"),
    ("AVX512", {"_is_vnni_supported": True, "_is_avx512_bf16_supported": True}, {"avx512f", "avx512_bf16"},
     "x86_64-AVX512+avx512_bf16+avx512_vnni+bf16", "bfloat16"),  # Zen 4 / Cooper Lake
    ("AVX512", {"_is_vnni_supported": True, "_is_amx_tile_supported": True, "_is_avx512_bf16_supported": True},
     {"avx512f", "amx_bf16", "amx_tile", "avx512_bf16"}, "x86_64-AVX512+amx_tile+avx512_bf16+avx512_vnni+bf16",
     "bfloat16"),  # Sapphire Rapids and later
])
def test_the_cpu_engines_dtype_and_toolchain_follow_the_capability_readers(monkeypatch, capability, probes, flags,
                                                                           cpu, expected):
    """Read, never assumed: the same build computes in float32 where the readers say "no native bf16" and in bf16
    where they say there is, and the toolchain (the build key, what resolve matches) says which it was."""
    import torch

    from builder.backends.aot_inductor import compute_dtype
    from kiln import toolchain

    _fake_cpu(monkeypatch, capability=capability, probes=probes, flags=flags)
    try:
        assert toolchain.host_cpu() == cpu
        assert toolchain.toolchain_for("aot-inductor", "cpu")["cpu"] == cpu
        assert compute_dtype("cpu", {"dtype": "bfloat16"}) == getattr(torch, expected)
        assert compute_dtype("cpu", {"dtype": "float32"}) == torch.float32
    finally:
        toolchain._toolchain_for.cache_clear()


def test_the_bf16_engine_and_the_float32_engine_have_different_keys(monkeypatch):
    from kiln import toolchain

    keys = []
    for bf16 in (False, True):
        _fake_cpu(monkeypatch, capability="AVX512", probes={"_is_avx512_bf16_supported": bf16}, flags={"avx512f"})
        keys.append(toolchain.toolchain_for("aot-inductor", "cpu"))
    toolchain._toolchain_for.cache_clear()
    assert keys[0]["cpu"] == "x86_64-AVX512" and keys[1]["cpu"] == "x86_64-AVX512+avx512_bf16+bf16"


def test_arm_bf16_is_read_from_onednn(monkeypatch):
    import torch

    from kiln import toolchain

    for native in (False, True):
        _fake_cpu(monkeypatch, capability="DEFAULT", probes={}, flags={"asimd"}, machine="aarch64")
        monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda v=native: v)
        assert toolchain.host_cpu() == ("aarch64-DEFAULT+bf16" if native else "aarch64-DEFAULT")
    toolchain._toolchain_for.cache_clear()


@pytest.mark.parametrize("target", ["cpu", "sm89", "sm90", "h100", "sm100", "sm120"])
def test_build_tag_and_resolve_take_one_default_backend_for_every_target(target):
    """The issue: ``kiln build --target sm90`` built aot-inductor while ``kiln resolve --target sm90`` asked for
    trtllm-engine. The spec's default, the CLI's default, the tag's unsuffixed backend and resolve's default are one."""
    import click

    from api.cli import build
    from builder.publish import tag_for
    from kiln.backends import default_backend
    from kiln.spec import parse_spec
    from kiln.targets import normalize_target

    canonical, _ = normalize_target(target)
    spec = parse_spec({"checkpoint": f"hf://acme/tiny@{'a' * 40}", "precision": "fp8", "target": target}, [])
    cli_default = next(p.default for p in build.params if isinstance(p, click.Option) and p.name == "backend")
    assert spec.backend == cli_default == default_backend(canonical)
    assert tag_for(spec) == f"fp8-{spec.target}-latency"

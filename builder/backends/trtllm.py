"""``trtllm-engine``: a TensorRT-LLM engine directory (``config.json`` + ``rank{N}.engine``) built by
``trtllm-build`` (TensorRT-LLM 1.2.x, the last line with the TensorRT-engine path) from ModelOpt's TensorRT-LLM
checkpoint. It only runs on a GPU worker with TensorRT-LLM installed (NVIDIA's release container); here the
argv mapping and the engine-config checks are tested, the build itself has never run in this repository.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import time
from pathlib import Path

from builder.backends.base import Backend
from kiln.errors import StageFailed, ToolchainMissing
from kiln.spec import BuildSpec

QUANT_ALGO = {"fp8": "FP8", "nvfp4": "NVFP4"}
INSTALL_HINT = ("GPU workers get it from NVIDIA's TensorRT-LLM 1.2.x release container "
                "(nvcr.io/nvidia/tensorrt-llm/release:1.2.1); see docs/gpu.md")


def build_argv(spec: BuildSpec, checkpoint_dir: Path, out_dir: Path) -> list[str]:
    """The exact ``trtllm-build`` command for ``spec``'s profile (1.2.x flags)."""
    p = spec.batch_profile
    argv = [
        "trtllm-build",
        "--checkpoint_dir", str(checkpoint_dir),
        "--output_dir", str(out_dir),
        "--max_batch_size", str(p.max_batch_size),
        "--max_input_len", str(p.max_input_len),
        "--max_seq_len", str(p.max_seq_len),
        "--max_num_tokens", str(p.max_num_tokens),
        "--kv_cache_type", "paged",
        "--gemm_plugin", "auto",
        "--workers", str(spec.tp_size),
    ]
    if spec.kv_cache == "fp8":
        # FP8 KV cache needs paged context FMHA to read the quantized cache in the context phase.
        argv += ["--use_paged_context_fmha", "enable"]
    return argv


def check_engine_config(config: dict, spec: BuildSpec) -> list[str]:
    """Mismatches between a built engine's config.json and the spec; empty when it matches."""
    problems = []
    pretrained, build = config.get("pretrained_config", {}), config.get("build_config", {})
    quant = pretrained.get("quantization", {}) or {}
    if quant.get("quant_algo") != QUANT_ALGO[spec.precision]:
        problems.append(f"quant_algo is {quant.get('quant_algo')!r}, spec asks {QUANT_ALGO[spec.precision]!r}")
    want_kv = "FP8" if spec.kv_cache == "fp8" else None
    if quant.get("kv_cache_quant_algo") != want_kv:
        problems.append(f"kv_cache_quant_algo is {quant.get('kv_cache_quant_algo')!r}, spec asks {want_kv!r}")
    for name, value in spec.batch_profile.limits().items():
        if build.get(name) != value:
            problems.append(f"build_config.{name} is {build.get(name)!r}, spec asks {value}")
    tp = (pretrained.get("mapping") or {}).get("tp_size", 1)
    if tp != spec.tp_size:
        problems.append(f"mapping.tp_size is {tp}, spec asks {spec.tp_size}")
    plugins = build.get("plugin_config", {}) or {}
    if plugins.get("paged_kv_cache") is False:
        problems.append("plugin_config.paged_kv_cache is off, Kiln builds paged KV cache engines")
    return problems


def check_toolchain() -> None:
    if importlib.util.find_spec("tensorrt_llm") is None or shutil.which("trtllm-build") is None:
        raise ToolchainMissing("TensorRT-LLM is not installed on this machine; trtllm-engine builds need it",
                               fix=INSTALL_HINT)


class TRTLLMBackend(Backend):
    name = "trtllm-engine"
    consumes = "trtllm"

    def plan(self, spec: BuildSpec, quantized_dir: Path, out_dir: Path) -> dict:
        return {"commands": [build_argv(spec, quantized_dir / "trtllm", out_dir)],
                "steps": ["verify the engine's config.json against the spec before publishing"]}

    def check_environment(self, spec: BuildSpec) -> None:
        check_toolchain()

    def compile(self, spec: BuildSpec, quantized_dir: Path, out_dir: Path) -> dict:
        check_toolchain()
        staging = out_dir.with_name(out_dir.name + ".trtllm-build")
        argv = build_argv(spec, quantized_dir / "trtllm", staging)
        t0 = time.perf_counter()
        proc = subprocess.run(argv, capture_output=True, text=True)
        seconds = time.perf_counter() - t0
        log_text = proc.stdout + proc.stderr
        if proc.returncode != 0:
            shutil.rmtree(staging, ignore_errors=True)
            raise StageFailed(f"trtllm-build exited {proc.returncode}: {log_text.strip().splitlines()[-1:] or ''}")
        config = json.loads((staging / "config.json").read_text())
        problems = check_engine_config(config, spec)
        if problems:
            shutil.rmtree(staging, ignore_errors=True)
            raise StageFailed("the built engine does not match the spec: " + "; ".join(problems))
        (staging / "build.log").write_text(log_text)
        staging.rename(out_dir)
        return {"backend": self.name, "argv": argv, "seconds": {"trtllm_build": round(seconds, 3)},
                "engine_version": config.get("version")}

"""``trtllm-engine``: a TensorRT-LLM engine directory (``config.json`` + ``rank{N}.engine``) built by
``trtllm-build`` (TensorRT-LLM 1.2.x, the last line with the TensorRT-engine path) from ModelOpt's TensorRT-LLM
checkpoint (config.json + rank{N}.safetensors, TP mapping from ``spec.tp_size``), which compile exports from the
quantize stage's saved calibration (builder/quantize.py ``export_trtllm_checkpoint``): the calibration is shared
with every other backend, and only this backend pays for the deprecated exporter.

It runs only on a GPU worker with TensorRT-LLM installed (NVIDIA's release container) and a GPU of the target
SM: ``trtllm-build`` compiles for the GPU it runs on, and the engine loads only there and only with the TensorRT
that built it. Here (no GPU, no TensorRT-LLM) the argv mapping, the environment checks and the engine-config checks
are tested; **a real build has never run in this repository**.

What the flags are, from TensorRT-LLM's own source (``tensorrt_llm/commands/build.py``, ``plugin/plugin.py`` and
``builder.py`` of the 1.x line; see docs/gpu.md):

- limits: ``--max_batch_size --max_input_len --max_seq_len --max_num_tokens``; ``--kv_cache_type paged``;
  ``--workers`` = tp_size (ranks are built in parallel on ``min(GPUs, workers)`` devices).
- ``--gemm_plugin``: ``auto`` for FP8 — it resolves to the model dtype and serves the unquantized GEMMs
  (``lm_head``); the FP8 linears go through TensorRT's own FP8 kernels from the Q/DQ pairs (the cuBLASLt FP8 GEMM
  plugin, ``--gemm_plugin fp8``, is a latency tuning choice that also needs matching calibration; Kiln does not
  make it). ``nvfp4`` for NVFP4 — the builder switches to the NVFP4 GEMM plugin for NVFP4 checkpoints anyway
  unless the plugin is explicitly disabled; passing it says so in the argv and the engine config.
- FP8 KV cache: ``--use_paged_context_fmha enable --use_fp8_context_fmha enable`` (both are 1.x defaults; the
  builder turns FP8 context FMHA on exactly when the KV cache is FP8 and paged context FMHA is on, and off
  otherwise). Stated so that the plan shows how the quantized cache is read and the engine check can hold it.
- no ``--gather_context_logits``: it changes the engine (logits for every context token, a
  ``max_num_tokens × vocab`` output buffer). Kiln ships the engine a deployer would build and validates it through
  the runtime's generation logits instead (validation/runners.py, ``TRTLLMRunner``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from builder.backends.base import CompileStep, Kernels
from kiln.errors import SpecError, StageFailed, ToolchainMissing
from kiln.kvcache import KV_CACHES
from kiln.precisions import PRECISIONS
from kiln.recipes import RECIPES
from kiln.spec import BuildSpec
from kiln.toolchain import detect_gpus, gpus_of, tensorrt_llm_version

ENGINE_FORMAT = "kiln-trtllm-engine/1"
INSTALL_HINT = ("GPU workers get it from NVIDIA's TensorRT-LLM 1.2.x release container "
                "(nvcr.io/nvidia/tensorrt-llm/release:1.2.1); see docs/gpu.md")
#: files of the unified HF export copied next to the engine (``tokenizer/``): what trtllm-serve's ``--tokenizer``
#: and trtllm-bench's ``--model_path`` read. The weights are not copied.
TOKENIZER_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                   "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja")
#: a child process that reports the versions the engine binds to (run with the build's GPU selection)
PROBE = r"""
import json, sys
out = {}
try:
    import torch
    out["torch"] = torch.__version__
    out["cuda"] = torch.version.cuda
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(0)
        out["sm"] = f"sm{major}{minor}"
        out["gpu"] = torch.cuda.get_device_name(0)
        out["gpu_count"] = torch.cuda.device_count()
except Exception as exc:
    out["torch_error"] = f"{type(exc).__name__}: {exc}"
for name in ("tensorrt", "tensorrt_llm"):
    try:
        mod = __import__(name)
        out[name] = getattr(mod, "__version__", None)
    except Exception as exc:
        out[name + "_error"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""


def plugin_flags(spec: BuildSpec) -> list[tuple[str, str]]:
    """The plugin flags for ``spec``'s precision and KV cache, as their descriptors say (see the module docstring
    for why)."""
    return [("--gemm_plugin", PRECISIONS[spec.precision].trtllm_gemm_plugin),
            *KV_CACHES[spec.kv_cache].trtllm_build_flags]


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
    ]
    for flag, value in plugin_flags(spec):
        argv += [flag, value]
    return argv + ["--workers", str(spec.tp_size)]


def expected_plugins(spec: BuildSpec) -> dict:
    """``build_config.plugin_config`` entries a correct engine for ``spec`` has."""
    want: dict = {"paged_kv_cache": True}
    if (gemm := PRECISIONS[spec.precision].trtllm_gemm_plugin) != "auto":  # auto is the model dtype's, not checked
        want["gemm_plugin"] = gemm
    return want | KV_CACHES[spec.kv_cache].trtllm_plugins


def check_engine_config(config: dict, spec: BuildSpec) -> list[str]:
    """Mismatches between a built engine's config.json and the spec; empty when it matches."""
    problems = []
    pretrained, build = config.get("pretrained_config", {}) or {}, config.get("build_config", {}) or {}
    quant = pretrained.get("quantization", {}) or {}
    want_algo = RECIPES[spec.rungs[0]].quant_algo
    if quant.get("quant_algo") != want_algo:
        problems.append(f"quant_algo is {quant.get('quant_algo')!r}, spec asks {want_algo!r}")
    want_kv = KV_CACHES[spec.kv_cache].quant_algo
    if quant.get("kv_cache_quant_algo") != want_kv:
        problems.append(f"kv_cache_quant_algo is {quant.get('kv_cache_quant_algo')!r}, spec asks {want_kv!r}")
    for name, value in spec.batch_profile.limits().items():
        if build.get(name) != value:
            problems.append(f"build_config.{name} is {build.get(name)!r}, spec asks {value}")
    tp = (pretrained.get("mapping") or {}).get("tp_size", 1)
    if tp != spec.tp_size:
        problems.append(f"mapping.tp_size is {tp}, spec asks {spec.tp_size}")
    plugins = build.get("plugin_config", {}) or {}
    kv_type = str(build.get("kv_cache_type") or "PAGED").upper().rsplit(".", 1)[-1]
    if plugins.get("paged_kv_cache") is False or kv_type != "PAGED":
        problems.append(f"the KV cache is not paged (kv_cache_type {build.get('kv_cache_type')!r}, "
                        f"plugin_config.paged_kv_cache {plugins.get('paged_kv_cache')!r}); Kiln builds paged KV cache engines")
    gemm = PRECISIONS[spec.precision].trtllm_gemm_plugin
    for name, value in expected_plugins(spec).items():
        if name == "paged_kv_cache":
            continue  # reported above, with kv_cache_type
        if plugins.get(name) != value:
            why = {"gemm_plugin": f"an {spec.precision} engine uses the {gemm.upper()} GEMM plugin"}.get(
                name, KV_CACHES[spec.kv_cache].trtllm_plugins_why)
            problems.append(f"plugin_config.{name} is {plugins.get(name)!r}, expected {value!r} ({why})")
    if build.get("gather_context_logits"):
        problems.append("build_config.gather_context_logits is on; Kiln ships engines without it "
                        "(validation reads generation logits)")
    return problems


def check_engine_files(engine_dir: Path, spec: BuildSpec) -> list[str]:
    """One ``rank{N}.engine`` per tensor-parallel rank, none missing, none extra."""
    want = {f"rank{r}.engine" for r in range(spec.tp_size)}
    have = {p.name for p in engine_dir.glob("rank*.engine")}
    problems = [f"{name} is missing" for name in sorted(want - have)]
    problems += [f"{name} is unexpected for tp_size {spec.tp_size}" for name in sorted(have - want)]
    return problems


def _base_version(v: str | None) -> str | None:
    return None if v is None else str(v).split("+", 1)[0].strip()


def check_engine_version(config: dict, installed: str | None) -> list[str]:
    """The engine was written by the TensorRT-LLM whose version is in the build key."""
    built = _base_version(config.get("version"))
    if built and installed and built != _base_version(installed):
        return [f"config.json version is {built}, the installed TensorRT-LLM (in the build key) is {installed}"]
    return []


def check_toolchain() -> None:
    import importlib.util

    if importlib.util.find_spec("tensorrt_llm") is None or shutil.which("trtllm-build") is None:
        raise ToolchainMissing("TensorRT-LLM is not installed on this machine; trtllm-engine builds need it",
                               fix=INSTALL_HINT)


def check_gpus(spec: BuildSpec, gpus: list[dict]) -> list[dict]:
    """The visible GPUs of ``spec.target``, at least ``spec.tp_size`` of them; raises otherwise.

    No GPU of the target SM at all is the wrong machine (ToolchainMissing: the build waits for, or is sent to, a
    worker that has one). Fewer than ``tp_size`` is a tensor-parallel size this target cannot hold here
    (SpecError on ``tp_size``): the engine would build (ranks can be built one after another on one GPU), but it
    could not be loaded and validated as it ships, on ``tp_size`` GPUs. The service routes ``tp_size > 1`` builds
    to ``….tp<N>`` queues that only workers with at least N such GPUs consume (workers/capabilities.py)."""
    matching = gpus_of(gpus, spec.target)
    if not matching:
        seen = ", ".join(sorted({f"{g['name']} ({g['sm']})" for g in gpus})) or "none"
        raise ToolchainMissing(f"a trtllm-engine for {spec.target} must be built on a {spec.target} GPU; "
                               f"this machine's visible GPUs: {seen}",
                               fix=f"run it on a GPU worker serving queue kiln.trtllm-engine.{spec.target}")
    if spec.tp_size > len(matching):
        raise SpecError(f"tensor-parallel size {spec.tp_size} needs {spec.tp_size} {spec.target} GPUs; this worker "
                        f"has {len(matching)} visible", field="tp_size",
                        fix=f"use --tp {len(matching)} or less here, or build on a worker advertising "
                            f"≥ {spec.tp_size} {spec.target} GPUs (queue kiln.trtllm-engine.{spec.target}.tp{spec.tp_size})")
    return matching


def gpu_env(gpus: list[dict], base: dict | None = None) -> dict:
    """The environment for a child that must see exactly ``gpus`` (by UUID where NVML gave one)."""
    env = dict(os.environ if base is None else base)
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # indices in NVML's order
    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g.get("uuid") or g["index"]) for g in gpus)
    return env


def probe_bindings(env: dict | None = None) -> dict:
    """TensorRT, TensorRT-LLM, CUDA, torch, GPU name and SM as a child process sees them (never imported here)."""
    try:
        proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    lines = proc.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1]) if proc.returncode == 0 and lines else {
            "error": f"probe exited {proc.returncode}: {(proc.stderr.strip().splitlines() or [''])[-1]}"}
    except json.JSONDecodeError:
        return {"error": f"probe printed no JSON: {lines[-1][:200]}"}


def copy_tokenizer(hf_dir: Path, out_dir: Path) -> list[str]:
    copied = []
    if hf_dir.is_dir():
        (out_dir / "tokenizer").mkdir()
        for name in TOKENIZER_FILES:
            if (hf_dir / name).is_file():
                shutil.copy2(hf_dir / name, out_dir / "tokenizer" / name)
                copied.append(name)
    return copied


def _tail(text: str, n: int = 3) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return " | ".join(lines[-n:])


def trtllm_checkpoint_dir(out_dir: Path) -> Path:
    return out_dir.with_name(out_dir.name + ".trtllm-checkpoint")


class TRTLLMBackend(CompileStep):
    name = "trtllm-engine"

    def plan(self, spec: BuildSpec, quantized_dir: Path, out_dir: Path) -> dict:
        p = spec.batch_profile
        return {
            "commands": [build_argv(spec, trtllm_checkpoint_dir(out_dir), out_dir)],
            "profile": p.model_dump(), "precision": spec.precision, "kv_cache": spec.kv_cache,
            "tp_size": spec.tp_size, "target": spec.target,
            "quantization": {"quant_algo": RECIPES[spec.rungs[0]].quant_algo,
                             "kv_cache_quant_algo": KV_CACHES[spec.kv_cache].quant_algo},
            "plugins": dict(plugin_flags(spec)),
            "steps": [
                f"check: TensorRT-LLM installed, ≥ {spec.tp_size} visible {spec.target} GPU(s) (NVML)",
                f"export ModelOpt's TensorRT-LLM checkpoint (tp {spec.tp_size}) from the saved calibration in "
                f"{quantized_dir / 'calibration'} to {trtllm_checkpoint_dir(out_dir)}",
                f"run the command (into a staging folder renamed to the output when verified) with "
                f"CUDA_VISIBLE_DEVICES set to the {spec.target} GPUs "
                f"(max_batch_size {p.max_batch_size}, max_input_len {p.max_input_len}, max_seq_len {p.max_seq_len}, "
                f"max_num_tokens {p.max_num_tokens}, tp {spec.tp_size})",
                "verify config.json against the spec (quant_algo, kv_cache_quant_algo, limits, mapping.tp_size, "
                f"plugin_config {expected_plugins(spec)}) and rank0..rank{spec.tp_size - 1}.engine; refuse a mismatch",
                f"copy the tokenizer from {quantized_dir / 'hf'} to {out_dir / 'tokenizer'}; record TensorRT, "
                "TensorRT-LLM, CUDA and GPU SM in the compile record",
            ],
        }

    def check_environment(self, spec: BuildSpec) -> None:
        check_toolchain()
        check_gpus(spec, detect_gpus())

    def compile(self, spec: BuildSpec, quantized_dir: Path, out_dir: Path, *, checkpoint_dir: Path,
                kernels: Kernels | None = None) -> dict:
        check_toolchain()
        gpus = check_gpus(spec, detect_gpus())
        env = gpu_env(gpus[: max(spec.tp_size, 1)])
        from builder.quantize import export_trtllm_checkpoint

        trtllm_dir = trtllm_checkpoint_dir(out_dir)
        shutil.rmtree(trtllm_dir, ignore_errors=True)
        exported = export_trtllm_checkpoint(checkpoint_dir, quantized_dir, spec, trtllm_dir)
        staging = out_dir.with_name(out_dir.name + ".trtllm-build")
        shutil.rmtree(staging, ignore_errors=True)
        argv = build_argv(spec, trtllm_dir, staging)
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, env=env)
        except OSError as exc:
            raise ToolchainMissing(f"trtllm-build could not be started: {exc}", fix=INSTALL_HINT) from exc
        finally:
            shutil.rmtree(trtllm_dir, ignore_errors=True)
        seconds = time.perf_counter() - t0
        log_text = proc.stdout + proc.stderr
        try:
            if proc.returncode != 0:
                raise StageFailed(f"trtllm-build exited {proc.returncode}: {_tail(log_text)}")
            t1 = time.perf_counter()
            try:
                config = json.loads((staging / "config.json").read_text())
            except (OSError, json.JSONDecodeError) as exc:
                raise StageFailed(f"trtllm-build wrote no readable config.json: {exc}") from exc
            installed = tensorrt_llm_version()
            problems = (check_engine_config(config, spec) + check_engine_files(staging, spec)
                        + check_engine_version(config, installed))
            bindings = probe_bindings(env)
            if bindings.get("sm") and bindings["sm"] != spec.target:
                problems.append(f"the build ran on a {bindings['sm']} GPU ({bindings.get('gpu')}), spec asks {spec.target}")
            if problems:
                raise StageFailed("the built engine does not match the spec: " + "; ".join(problems))
            tokenizer = copy_tokenizer(quantized_dir / "hf", staging)
            (staging / "build.log").write_text(log_text)
            engine = {"format": ENGINE_FORMAT, "model_name": spec.model_name, "precision": spec.precision,
                      "kv_cache": spec.kv_cache,
                      "target": spec.target, "tp_size": spec.tp_size, "profile": spec.batch_profile.model_dump(),
                      "argv": argv, "tensorrt_llm": config.get("version"), "tokenizer": "tokenizer" if tokenizer else None,
                      "bindings": bindings}
            (staging / "engine.json").write_text(json.dumps(engine, indent=2, sort_keys=True))
            t2 = time.perf_counter()
            staging.rename(out_dir)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        build = config.get("build_config", {}) or {}
        return {
            "backend": self.name, "argv": argv, "engine_version": config.get("version"),
            "trtllm_checkpoint": {k: exported[k] for k in ("decoder_type", "log")},
            "seconds": {"export_trtllm_checkpoint": exported["seconds"], "trtllm_build": round(seconds, 3),
                        "verify": round(t2 - t1, 3)},
            "bindings": {"tensorrt_llm": bindings.get("tensorrt_llm") or installed, "tensorrt": bindings.get("tensorrt"),
                         "cuda": bindings.get("cuda"), "sm": bindings.get("sm") or spec.target,
                         "gpu": bindings.get("gpu"), "torch": bindings.get("torch"),
                         **({"probe_error": bindings["error"]} if "error" in bindings else {})},
            "gpus": [{"name": g["name"], "sm": g["sm"], "memory_bytes": g["memory_bytes"]} for g in gpus[: spec.tp_size]],
            "plugin_config": {k: (build.get("plugin_config") or {}).get(k) for k in
                              ("gemm_plugin", "gpt_attention_plugin", "paged_kv_cache", "use_paged_context_fmha",
                               "use_fp8_context_fmha", "context_fmha", "tokens_per_block")},
            "engine_files": sorted(p.name for p in out_dir.iterdir()),
            "build_log_tail": log_text.strip().splitlines()[-20:],
        }

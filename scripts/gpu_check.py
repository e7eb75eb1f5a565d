#!/usr/bin/env python3
"""Kiln's GPU check: run the pipeline's GPU paths for the shipped model (examples/tiny-llama) on this machine and
print ONE JSON summary on stdout (everything else goes to stderr).

On a CUDA machine, with a spec targeting the local GPU's SM:
1. ModelOpt FP8 and NVFP4 quantize on CUDA (builder.quantize.quantize);
2. AOTInductor CUDA compile of each (the aot-inductor backend);
3. validation on the GPU (validation.validate with the AOTInductor runner): perplexity, top-1 agreement, mean KL,
   throughput, against the fp32 reference;
4. where TensorRT-LLM is installed: a bf16 copy of the model quantized, ``trtllm-build`` through the trtllm-engine
   backend (FP8 on sm89+, NVFP4 on sm100+), accuracy through TRTLLMRunner (prefix generation logits), throughput
   and TTFT/TPOT through trtllm-bench, and a consistency check of the runner's logits against a second engine
   built with ``--gather_context_logits``. Skipped, with the reason, where TensorRT-LLM is not installed.

On a machine without CUDA it checks what it can (imports, NVML, the worker's capabilities), prints the JSON with
``"cuda": false`` and exits 0. Exit status otherwise: 0 when no step failed, 1 when one did.

    python scripts/gpu_check.py [--out FILE] [--workdir DIR] [--keep] [--skip-trtllm]

Record the output in docs/gpu.md ("What has run on a GPU").
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

TINY = REPO / "examples" / "tiny-llama"
PROFILE = {"max_batch_size": 8, "max_input_len": 128, "max_seq_len": 256, "max_num_tokens": 1024}
CALIBRATION = {"samples": 32, "seq_len": 128}
IMPORTS = ("kiln", "kiln.toolchain", "builder.quantize", "builder.backends.aot_inductor", "builder.backends.trtllm",
           "validation.validate", "validation.runners", "workers.capabilities", "torch", "transformers",
           "modelopt.torch.quantization", "modelopt.torch.export")


def log(msg: str) -> None:
    print(f"[gpu_check] {msg}", file=sys.stderr, flush=True)


def now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class Check:
    """Collects steps; each step is recorded as ok / failed (with the error) / skipped (with the reason)."""

    def __init__(self):
        self.steps: dict[str, dict] = {}
        self.skipped: dict[str, str] = {}

    def skip(self, name: str, reason: str) -> None:
        self.steps[name] = {"status": "skipped", "reason": reason}
        self.skipped[name] = reason
        log(f"{name}: skipped ({reason})")

    def run(self, name: str, fn, *args, **kwargs):
        log(f"{name}: running")
        t = time.perf_counter()
        try:
            value, detail = fn(*args, **kwargs)
        except Exception as exc:  # a check reports every failure and goes on
            self.steps[name] = {"status": "failed", "seconds": round(time.perf_counter() - t, 3),
                                "error": f"{type(exc).__name__}: {exc}"[:2000],
                                "traceback": traceback.format_exc().strip().splitlines()[-8:]}
            log(f"{name}: FAILED {type(exc).__name__}: {exc}")
            return None
        self.steps[name] = {"status": "ok", "seconds": round(time.perf_counter() - t, 3), **(detail or {})}
        log(f"{name}: ok in {self.steps[name]['seconds']}s")
        return value

    @property
    def failed(self) -> list[str]:
        return [n for n, s in self.steps.items() if s["status"] == "failed"]


# -- environment ---------------------------------------------------------------------------------------
def versions() -> dict:
    from kiln import toolchain

    out = {"python": platform.python_version(), "kiln": _kiln_version(),
           "modelopt": toolchain._version("nvidia-modelopt"), "transformers": toolchain._version("transformers"),
           "tensorrt_llm": toolchain.tensorrt_llm_version(), "tensorrt": toolchain.tensorrt_version(),
           "nvidia_ml_py": toolchain._version("nvidia-ml-py")}
    try:
        import torch

        out |= {"torch": torch.__version__, "torch_cuda": torch.version.cuda}
    except Exception as exc:
        out["torch_error"] = f"{type(exc).__name__}: {exc}"
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            v = pynvml.nvmlSystemGetDriverVersion()
            out["driver"] = v.decode() if isinstance(v, bytes) else str(v)
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        out["driver"] = None
    return out


def _kiln_version() -> str | None:
    try:
        import kiln

        return kiln.__version__
    except Exception:
        return None


def check_imports() -> dict:
    out = {}
    for name in IMPORTS:
        try:
            importlib.import_module(name)
            out[name] = "ok"
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {exc}"[:300]
    out["tensorrt_llm"] = "installed (not imported)" if importlib.util.find_spec("tensorrt_llm") else "not installed"
    out["trtllm-build"] = shutil.which("trtllm-build") or "not on PATH"
    out["trtllm-bench"] = shutil.which("trtllm-bench") or "not on PATH"
    return out


def kiln_target(major: int, minor: int) -> str | None:
    """The Kiln target for a compute capability: exact (sm89, sm90, sm100, sm120), else the family's base
    architecture for Blackwell variants (sm103 → sm100, sm121 → sm120); None for GPUs Kiln does not build for."""
    from kiln.targets import GPU_ARCHS

    exact = f"sm{major}{minor}"
    if exact in GPU_ARCHS:
        return exact
    return {10: "sm100", 12: "sm120"}.get(major)


def capabilities() -> dict:
    from workers.capabilities import detect

    caps = detect()
    return {k: caps[k] for k in ("backends", "targets", "gpu_counts", "tp_sizes", "cuda", "trtllm", "queues")}


# -- pipeline steps ------------------------------------------------------------------------------------
def make_spec(checkpoint: Path, precision: str, backend: str, target: str, roots: list[Path]):
    from kiln.spec import parse_spec

    return parse_spec({"checkpoint": str(checkpoint), "precision": precision, "backend": backend, "target": target,
                       "profile": PROFILE, "calibration": CALIBRATION}, roots)


def texts(roots: list[Path]) -> tuple[str, str]:
    from kiln.datasets import load_text

    calib, _ = load_text("kiln:calibration", field="calibration.dataset", roots=roots)
    heldout, _ = load_text("kiln:heldout", field="evaluation.dataset", roots=roots)
    return calib, heldout


def quantize_step(checkpoint: Path, spec, calib_text: str, out: Path):
    from builder.quantize import quantize

    record = quantize(checkpoint, spec, calib_text, out)
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    return out, {"device": record["device"], "quantized_linears": record["quantized_linears"],
                 "stage_seconds": record["seconds"], "export_bytes": size}


def aot_compile_step(spec, qdir: Path, out: Path):
    from builder.backends.aot_inductor import AOTInductorBackend

    record = AOTInductorBackend().compile(spec, qdir, out)
    return out, {"device": record["device"], "stage_seconds": record["seconds"],
                 "package_bytes": (out / "model.pt2").stat().st_size}


def summarize_validation(report: dict) -> dict:
    m = report.get("metrics", {})
    points = m.get("throughput") or []
    keep = ("perplexity", "reference_perplexity", "ppl_increase_pct", "top1_agreement", "mean_kl", "tokens")
    out = {k: m.get(k) for k in keep}
    out["peak_tokens_per_s"] = max((p.get("tokens_per_s", 0.0) for p in points), default=None)
    out["throughput"] = [{k: p.get(k) for k in ("batch_size", "seq_len", "tokens_per_s", "ttft_ms", "tpot_ms")}
                         for p in points]
    for extra in ("decode_latency", "peak_memory"):
        if isinstance(m.get(extra), dict):
            out[extra] = {k: v for k, v in m[extra].items() if k in ("ttft_ms", "tpot_ms", "peak_memory_bytes")}
    out["passed"] = report.get("passed")
    out["gates"] = [{k: g.get(k) for k in ("name", "value", "threshold", "passed")} for g in report.get("gates", [])]
    out["conditions"] = report.get("conditions")
    return out


def aot_validate_step(spec, engine_dir: Path, reference_dir: Path, eval_text: str):
    from validation.gates import effective_gates
    from validation.runners import open_engine, open_reference
    from validation.validate import validate

    vocab = json.loads((reference_dir / "config.json").read_text())["vocab_size"]
    report = validate(open_engine("aot-inductor", engine_dir), open_reference(reference_dir), reference_dir,
                      eval_text, spec, effective_gates(spec.precision, {}), int(vocab))
    return report, summarize_validation(report)


def bf16_copy(src: Path, dst: Path):
    """The shipped model in bfloat16 (TensorRT-LLM engines run in 16-bit; the fp32 model would make an fp32
    engine, a configuration Kiln does not ship)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    model.save_pretrained(dst)
    AutoTokenizer.from_pretrained(src).save_pretrained(dst)
    return dst, {"dtype": "bfloat16"}


def trtllm_compile_step(spec, qdir: Path, out: Path):
    from builder.backends.trtllm import TRTLLMBackend

    record = TRTLLMBackend().compile(spec, qdir, out)
    return out, {k: record.get(k) for k in ("argv", "seconds", "bindings", "engine_version", "plugin_config",
                                            "engine_files")}


def trtllm_validate_step(spec, engine_dir: Path, reference_dir: Path, eval_text: str):
    """What validation.validate does for an engine, with trtllm-bench for speed: accuracy through the runner's
    logits, throughput / TTFT / TPOT from trtllm-bench, then the gates."""
    from validation.gates import effective_gates, evaluate
    from validation.measure import accuracy
    from validation.runners import TRTLLMRunner, open_reference
    from validation.validate import eval_tokens

    runner = TRTLLMRunner(engine_dir)
    try:
        text = eval_tokens(reference_dir, eval_text, spec)
        batch = min(spec.batch_profile.max_batch_size, 16)
        t = time.perf_counter()
        metrics = accuracy(runner, open_reference(reference_dir), text.ids, text.seq, batch, convention=text.convention)
        accuracy_s = time.perf_counter() - t
        metrics["throughput"] = runner.throughput(spec.batch_profile)
        metrics["decode_latency"] = runner.decode_latency(spec.batch_profile)
    finally:
        runner.close()
    verdicts = evaluate(metrics, effective_gates(spec.precision, {}))
    report = {"passed": all(v["passed"] for v in verdicts), "metrics": metrics, "gates": verdicts,
              "conditions": {"device": "cuda", "logits": runner.mode, "accuracy_seconds": round(accuracy_s, 3),
                             "eval_batch": batch}}
    return report, summarize_validation(report)


def trtllm_consistency_step(spec, qdir: Path, engine_dir: Path, work: Path):
    """The runner's prefix-mode logits (generation logits of one token per prefix, on the shipped engine) against
    the context logits of a second engine built with --gather_context_logits: they should agree up to kernel
    differences. This is the check that the accuracy method reads the right logits."""
    import subprocess

    import torch

    from builder.backends.trtllm import build_argv, check_gpus, gpu_env
    from kiln.toolchain import detect_gpus
    from validation.runners import TRTLLMRunner

    ctx_dir = work / f"engine-{spec.precision}-context-logits"
    env = gpu_env(check_gpus(spec, detect_gpus())[:1])
    argv = build_argv(spec, qdir / "trtllm", ctx_dir) + ["--gather_context_logits"]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"trtllm-build --gather_context_logits exited {proc.returncode}: "
                           f"{(proc.stdout + proc.stderr).strip().splitlines()[-3:]}")
    x = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(0))
    shipped = TRTLLMRunner(engine_dir)
    try:
        a = shipped.logits(x)
    finally:
        shipped.close()
    ctx = TRTLLMRunner(ctx_dir)
    try:
        b = ctx.logits(x)
    finally:
        ctx.close()
    return None, {"modes": [shipped.mode, ctx.mode], "max_abs_diff": float((a - b).abs().max()),
                  "mean_abs_diff": float((a - b).abs().mean()),
                  "top1_agreement": float((a.argmax(-1) == b.argmax(-1)).float().mean())}


# -- main ----------------------------------------------------------------------------------------------
def gather(args) -> dict:
    check = Check()
    summary: dict = {"check": "kiln-gpu-check/1", "started": now(), "host": platform.node(),
                     "repo": str(REPO), "model": str(TINY.relative_to(REPO))}
    summary["versions"] = versions()
    summary["imports"] = check_imports()
    try:
        from kiln.toolchain import detect_gpus

        summary["gpus"] = [{k: g[k] for k in ("index", "name", "sm", "memory_bytes")} for g in detect_gpus()]
    except Exception as exc:
        summary["gpus"] = {"error": f"{type(exc).__name__}: {exc}"}
    try:
        summary["capabilities"] = capabilities()
    except Exception as exc:
        summary["capabilities"] = {"error": f"{type(exc).__name__}: {exc}"}
    try:
        import torch

        cuda = bool(torch.cuda.is_available())
    except Exception:
        cuda = False
    summary["cuda"] = cuda
    from kiln.precisions import PRECISIONS

    gpu_steps = [f"{step}.{p}" for step in ("quantize", "aot-inductor.compile", "aot-inductor.validate")
                 for p in PRECISIONS] + ["trtllm"]
    if not cuda:
        summary["gpu"] = None
        for name in gpu_steps:
            check.skip(name, "no CUDA device (torch.cuda.is_available() is false)")
        return finish(summary, check)

    import torch

    from kiln.targets import FLOOR_SM

    major, minor = torch.cuda.get_device_capability(0)
    props = torch.cuda.get_device_properties(0)
    target = kiln_target(major, minor)
    summary["gpu"] = {"name": torch.cuda.get_device_name(0), "sm": f"sm{major}{minor}", "target": target,
                      "memory_bytes": int(props.total_memory), "count": torch.cuda.device_count()}
    if target is None:
        for name in gpu_steps:
            check.skip(name, f"sm{major}{minor} is not a Kiln target (the oldest is sm{FLOOR_SM})")
        return finish(summary, check)

    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="kiln-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    summary["workdir"] = str(work)
    roots = [REPO, work]
    try:
        calib_text, eval_text = texts(roots)
        for precision in PRECISIONS:
            spec = check.run(f"spec.{precision}", lambda p=precision: (make_spec(TINY, p, "aot-inductor", target, roots), {}))
            if spec is None:
                continue
            qdir = check.run(f"quantize.{precision}", quantize_step, TINY, spec, calib_text, work / f"q-{precision}")
            if qdir is None:
                check.skip(f"aot-inductor.compile.{precision}", "quantize failed")
                continue
            edir = check.run(f"aot-inductor.compile.{precision}", aot_compile_step, spec, qdir, work / f"aot-{precision}")
            if edir is None:
                check.skip(f"aot-inductor.validate.{precision}", "compile failed")
                continue
            check.run(f"aot-inductor.validate.{precision}", aot_validate_step, spec, edir, TINY, eval_text)
            torch.cuda.empty_cache()
        trtllm_path(args, check, target, work, roots, calib_text, eval_text)
    finally:
        if not args.keep and not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    return finish(summary, check)


def trtllm_path(args, check: Check, target: str, work: Path, roots: list[Path], calib_text: str, eval_text: str):
    from kiln.targets import GPU_ARCHS

    if args.skip_trtllm:
        check.skip("trtllm", "--skip-trtllm")
        return
    if importlib.util.find_spec("tensorrt_llm") is None or shutil.which("trtllm-build") is None:
        check.skip("trtllm", "TensorRT-LLM is not installed here (GPU workers use NVIDIA's TensorRT-LLM 1.2.x "
                             "release container; see docs/gpu.md)")
        return
    bf16 = check.run("trtllm.bf16-model", bf16_copy, TINY, work / "tiny-llama-bf16")
    if bf16 is None:
        return
    from kiln.backends import get_backend_info
    from kiln.precisions import PRECISIONS

    engine_path = get_backend_info("trtllm-engine")
    for precision, min_sm in ((p.name, engine_path.min_sm(p)) for p in PRECISIONS.values()):
        name = f"trtllm.{precision}"
        if GPU_ARCHS[target] < min_sm:
            check.skip(name, f"an {precision.upper()} TensorRT-LLM engine needs sm{min_sm}+, this GPU is {target}")
            continue
        spec = check.run(f"{name}.spec", lambda p=precision: (make_spec(bf16, p, "trtllm-engine", target, roots), {}))
        if spec is None:
            continue
        qdir = check.run(f"{name}.quantize", quantize_step, bf16, spec, calib_text, work / f"q-trtllm-{precision}")
        if qdir is None:
            continue
        edir = check.run(f"{name}.compile", trtllm_compile_step, spec, qdir, work / f"engine-{precision}")
        if edir is None:
            continue
        check.run(f"{name}.validate", trtllm_validate_step, spec, edir, bf16, eval_text)
        check.run(f"{name}.logits-consistency", trtllm_consistency_step, spec, qdir, edir, work)


def finish(summary: dict, check: Check) -> dict:
    summary["steps"] = check.steps
    summary["skipped"] = check.skipped
    summary["failed"] = check.failed
    summary["ok"] = not check.failed
    summary["finished"] = now()
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="also write the JSON summary (indented) to this file")
    parser.add_argument("--workdir", help="work here (kept) instead of a temporary folder")
    parser.add_argument("--keep", action="store_true", help="keep the temporary work folder")
    parser.add_argument("--skip-trtllm", action="store_true", help="skip the TensorRT-LLM engine path")
    args = parser.parse_args(argv)
    # Libraries print to stdout (ModelOpt progress, TensorRT-LLM banners); stdout is for the one JSON line.
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            summary = gather(args)
    except BaseException as exc:  # even a crash of the check itself ends in one JSON object
        summary = {"check": "kiln-gpu-check/1", "ok": False, "error": f"{type(exc).__name__}: {exc}",
                   "traceback": traceback.format_exc().strip().splitlines()[-8:]}
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
    text = json.dumps(summary, sort_keys=True, default=str)
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=2, sort_keys=True, default=str) + "\n")
    print(text, flush=True)
    if summary.get("cuda") is False:
        return 0
    return 0 if summary.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())

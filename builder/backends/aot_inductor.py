"""``aot-inductor``: a portable engine. transformers' own model of the checkpoint's family is built from the
exported checkpoint (weights dequantized, activation quantization emulated from the exported scales: kiln/hfmodel.py),
exported with ``torch.export`` with the batch profile's limits as dynamic-shape ranges (no KV cache), and compiled
ahead of time by AOTInductor.

An engine is a kernel and its weights. The kernel, ``model.pt2``, is the compiled code with no constant inside it
(:data:`KERNEL_CONFIG`); ``weights.safetensors`` holds the constants it runs with (weights, activation scales,
rotary tables) by their fully qualified names, in the dtype and shape the kernel expects; a runner loads the
kernel, then the weights (``load_constants``: validation/runners.py). The kernel is kept under its kernel key
(kiln/keys.py), so a fine-tune of a built architecture exports, finds the kernel and writes only its weights.

ModelOpt's quantized module itself cannot be exported (fake tensors, data-dependent guards), hence the rebuild.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import subprocess
import tempfile
import time
from functools import lru_cache
from pathlib import Path

import torch

from builder.backends.base import CompileStep, Kernels
from kiln.digests import sha256_file
from kiln.errors import StageFailed
from kiln.hfmodel import LogitsOnly, load_engine_model, tabulate_rotary
from kiln.progress import report
from kiln.quantformat import quantization_block
from kiln.spec import BuildSpec

ENGINE_FORMAT = "kiln-aot-inductor/2"
KERNEL_FORMAT = "kiln-aot-kernel/1"
#: the compiled code (an AOTInductor package without weights), the constants it runs with, and what it expects
KERNEL, WEIGHTS, KERNEL_MANIFEST = "model.pt2", "weights.safetensors", "kernel.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")


#: what a CUDA engine computes in, by the checkpoint's own dtype (config ``dtype`` / ``torch_dtype``)
CUDA_COMPUTE = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def checkpoint_dtype(config: dict) -> str:
    return str(config.get("dtype") or config.get("torch_dtype") or "float32")


def compute_choice(target: str, config: dict, cpu: str | None = None) -> tuple[torch.dtype, str]:
    """The dtype the engine computes in, and why (weights dequantized into it; activation quantization emulated
    in float32 and cast back; logits returned in it too).

    A GPU target computes in the checkpoint's own dtype, as serving runtimes do. The ``cpu`` target computes a
    bf16 checkpoint in bf16 where the build CPU has native bf16 matrix units (``cpu``: the toolchain's entry,
    this host's by default, whose ``bf16`` feature says so: kiln/toolchain.py ``cpu_features``) and everything
    else in float32: without native units (AVX2, or AVX512 without AVX512-BF16 / AMX) bf16 is the slower choice —
    eager bf16 ran 0.65 × float32 on an AVX2-only AMD EPYC — while with them bf16 is the faster one (an AMX Xeon:
    docs/performance.md). The toolchain's ``cpu`` entry is in the build key and matched by resolve, so a bf16
    AVX512 engine is built again, not reused, on a CPU without them, and is never resolved for one."""
    ckpt = checkpoint_dtype(config)
    if target != "cpu":
        return CUDA_COMPUTE.get(ckpt, torch.float32), f"a GPU target computes in the checkpoint's own dtype ({ckpt})"
    from kiln.toolchain import cpu_bf16_native, toolchain_for

    cpu = cpu or toolchain_for("aot-inductor", "cpu")["cpu"]
    if ckpt != "bfloat16":
        return torch.float32, f"the checkpoint is {ckpt}: a cpu engine computes in float32 unless it is bfloat16"
    if cpu_bf16_native(cpu):
        return torch.bfloat16, f"a bfloat16 checkpoint and the build CPU ({cpu}) has native bf16 units"
    return torch.float32, (f"a bfloat16 checkpoint, but the build CPU ({cpu}) has no native bf16 units "
                           "(AVX512-BF16 / AMX / Arm BF16), where float32 is faster")


def compute_dtype(target: str, config: dict, cpu: str | None = None) -> torch.dtype:
    """The dtype of :func:`compute_choice`."""
    return compute_choice(target, config, cpu)[0]


def release_export_graph() -> None:
    """Let go of the graph the last non-strict ``torch.export`` traced. torch keeps its nodes in a module-level map
    (``proxy_tensor._FAKE_TENSOR_ID_TO_PROXY_MAP_FOR_EXPORT``, for its fake-tensor leak check) until the next
    export; a node holds its graph and the graph its ``GraphModule``, which holds the traced model's real
    parameters — one float32 copy of the engine's weights (98 MiB at 30 M parameters, 4.6 GiB at 1 B) kept alive
    through validation. Clearing the map is what the next export does first."""
    from torch.fx.experimental import proxy_tensor

    leaked = getattr(proxy_tensor, "_FAKE_TENSOR_ID_TO_PROXY_MAP_FOR_EXPORT", None)
    if isinstance(leaked, dict):
        leaked.clear()


def _dims(spec: BuildSpec):
    from torch.export import Dim

    p = spec.batch_profile
    batch = Dim("batch", min=1, max=p.max_batch_size) if p.max_batch_size > 1 else Dim.STATIC
    seq = Dim("seq", min=1, max=p.max_seq_len)
    return batch, seq


#: Inductor's C++ flags the engine's numerics rely on, pinned whatever the environment says: no floating-point
#: contraction (a fused multiply-add would skip the rounding kiln/precisions.py ``round_e4m3`` emulates e4m3 with)
#: and no unsafe math (which may reassociate it away). Both are Inductor's defaults.
EXACT_CPP_MATH = {"cpp.enable_floating_point_contract_flag": "off", "cpp.enable_unsafe_math_opt_flag": False}


#: Inductor's settings for a kernel that takes its weights when it is loaded: no constant inside the ``.so``, none
#: written into the code as a number (Inductor inlines a 0-d or tiny constant as a literal unless told to keep tensor
#: constants), and nothing computed from constants alone folded at compile time (Inductor replaces such a result
#: with a literal when its value is uniform — the reciprocal of an activation scale, ``1 + w`` of an all-zero norm
#: weight — which bakes the compiled checkpoint's value into the code). New weights never need new code.
KERNEL_CONFIG = {"aot_inductor.package_constants_in_so": False, "always_keep_tensor_constants": True,
                 "joint_graph_constant_folding": False}


def graph_digest(exported) -> str:
    """sha256 of the traced graph as text (its signature, ops, arguments and literals): what a kernel compiles,
    apart from the values of its constants. Two checkpoints with the same digest (and key) run on one kernel."""
    text = f"{exported.graph_signature}\n{exported.graph}"
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


@lru_cache(maxsize=1)
def cxx_compiler() -> str:
    """The C++ compiler Inductor builds kernels with, and its version (``g++: g++ (Debian 12.2.0-14) 12.2.0``)."""
    from torch._inductor.cpp_builder import get_cpp_compiler

    cxx = get_cpp_compiler()
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    return f"{cxx}: {out.splitlines()[0] if out else 'unknown'}"


def exported_constants(exported) -> dict[str, torch.Tensor]:
    """Every tensor an exported program holds (parameters, buffers, lifted constants) by fully qualified name."""
    named = {**exported.state_dict, **exported.constants}
    return {k: v for k, v in named.items() if isinstance(v, torch.Tensor)}


def compile_kernel(exported, out: Path, device: str, code: dict) -> dict:
    """Compile ``exported`` into the kernel folder ``out`` (absent on entry): ``model.pt2`` without weights, and
    ``kernel.json`` naming each constant it expects (from the loaded package) with its dtype and shape."""
    out.mkdir(parents=True)
    t = time.perf_counter()
    report("AOTInductor compile (C++ code generation and g++)")
    with torch.no_grad(), torch._inductor.config.patch({**EXACT_CPP_MATH, **KERNEL_CONFIG}):
        torch._inductor.aoti_compile_and_package(exported, package_path=str(out / KERNEL))
    fqns = torch._inductor.aoti_load_package(str(out / KERNEL)).get_constant_fqns()
    named = exported_constants(exported)
    manifest = {"format": KERNEL_FORMAT, "device": device, "code": code, "torch": torch.__version__,
                "constants": {f: {"dtype": str(named[f].dtype).removeprefix("torch."), "shape": list(named[f].shape)}
                              for f in sorted(fqns)}}
    (out / KERNEL_MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
    return {"seconds": round(time.perf_counter() - t, 3)}


def kernel_weights(exported, manifest: dict) -> dict[str, torch.Tensor]:
    """The constants a kernel expects (its ``kernel.json``), taken from ``exported``, contiguous on the CPU, one
    copy per name (safetensors stores no shared storage: a tied head gets its own). A name the export lacks, or a
    dtype or shape that differs, means the kernel key missed something that shapes the code: refused."""
    named, wanted = exported_constants(exported), manifest["constants"]
    wrong = [f"{f} (missing)" if f not in named else f"{f} ({named[f].dtype}, {list(named[f].shape)})"
             for f, m in wanted.items()
             if f not in named or str(named[f].dtype).removeprefix("torch.") != m["dtype"] or list(named[f].shape) != m["shape"]]
    if wrong:
        raise StageFailed(f"the kernel does not take this checkpoint's weights: {len(wrong)} constants differ from "
                          f"what it expects (e.g. {wrong[0]}); its key missed an input that shapes the code")
    out: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    for f in sorted(wanted):
        t = named[f].detach().to("cpu").contiguous()
        if t.untyped_storage().data_ptr() in storages:
            t = t.clone()
        storages.add(t.untyped_storage().data_ptr())
        out[f] = t
    return out


class AOTInductorBackend(CompileStep):
    name = "aot-inductor"

    def compute_dtype(self, spec: BuildSpec, quantized_dir: Path) -> torch.dtype:
        """A bf16 checkpoint on a CPU with native bf16 computes in bf16 (:func:`compute_choice`)."""
        return compute_dtype(spec.target, json.loads((quantized_dir / "hf" / "config.json").read_text()))

    def plan(self, spec: BuildSpec, quantized_dir: Path, out_dir: Path) -> dict:
        p = spec.batch_profile
        return {"commands": [], "steps": [
            f"build transformers' model of the family from {quantized_dir / 'hf'} (dequantized {spec.precision} "
            "weights, activation quant emulated)",
            f"torch.export.export(model, dynamic_shapes={{batch: 1..{p.max_batch_size}, seq: 1..{p.max_seq_len}}})",
            "the kernel under its kernel key (kiln/keys.py), else torch._inductor.aoti_compile_and_package(exported) "
            f"with no constant in the .so  # device {'cuda' if spec.target != 'cpu' else 'cpu'}",
            f"{out_dir / KERNEL} (the kernel) and {out_dir / WEIGHTS} (the export's constants the kernel expects)",
        ]}

    def check_environment(self, spec: BuildSpec) -> None:
        if spec.target != "cpu" and not torch.cuda.is_available():
            from kiln.errors import ToolchainMissing

            raise ToolchainMissing(f"an aot-inductor engine for {spec.target} must be compiled on a CUDA GPU of that "
                                   "architecture; this machine has none", fix="run it on a GPU worker or use --target cpu")

    def compile(self, spec: BuildSpec, quantized_dir: Path, out_dir: Path, *, checkpoint_dir: Path,
                kernels: Kernels | None = None) -> dict:
        """Export, find the kernel under its key or compile it (``kernels``; without them a kernel is compiled for
        this engine alone), and write the engine: the kernel, its weights from this export, engine.json."""
        self.check_environment(spec)
        device = "cpu" if spec.target == "cpu" else "cuda"
        t0 = time.perf_counter()
        config = json.loads((quantized_dir / "hf" / "config.json").read_text())
        dtype, why = compute_choice(spec.target, config)
        built = load_engine_model(quantized_dir / "hf", dtype=dtype, for_export=True, device=device)
        ckpt = built.checkpoint
        positions = int(ckpt.config.get("max_position_embeddings", 0))
        if spec.batch_profile.max_seq_len > positions:
            raise StageFailed(f"profile max_seq_len {spec.batch_profile.max_seq_len} exceeds the model's {positions} positions")
        built.emulation["rotary"] = tabulate_rotary(built.model, spec.batch_profile.max_seq_len)
        model = LogitsOnly(built.model).eval().to(device)
        batch, seq = _dims(spec)
        example = torch.zeros((2 if spec.batch_profile.max_batch_size > 1 else 1, 8), dtype=torch.long, device=device)
        t1 = time.perf_counter()
        with contextlib.ExitStack() as stack:
            stack.callback(release_export_graph)
            try:
                report("torch.export")
                with torch.no_grad():
                    exported = torch.export.export(model, (example,), dynamic_shapes={"input_ids": {0: batch, 1: seq}},
                                                   strict=False)
                t2 = time.perf_counter()
                code = {"graph": graph_digest(exported), "compiler": cxx_compiler(),
                        "inductor": {**EXACT_CPP_MATH, **KERNEL_CONFIG}, "compute_dtype": str(dtype).removeprefix("torch.")}
                if kernels is None:
                    kernels = Kernels.fresh(spec, Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kiln-kernel-"))))
                key = kernels.key(config, quantization_block(quantized_dir / "hf", config), code)
                kernel_dir, made = kernels.get(key, lambda out: compile_kernel(exported, out, device, code))
            except Exception as exc:
                raise StageFailed(f"AOTInductor compile failed: {type(exc).__name__}: {exc}") from exc
            t3 = time.perf_counter()
            report("the kernel's weights")
            weights = kernel_weights(exported, json.loads((kernel_dir / KERNEL_MANIFEST).read_text()))
            out_dir.mkdir(parents=True)
            shutil.copy2(kernel_dir / KERNEL, out_dir / KERNEL)
            from safetensors.torch import save_file

            save_file(weights, str(out_dir / WEIGHTS))
            del weights
        t4 = time.perf_counter()
        for name in TOKENIZER_FILES + ("config.json", "hf_quant_config.json", "generation_config.json"):
            if (quantized_dir / "hf" / name).exists():
                shutil.copy2(quantized_dir / "hf" / name, out_dir / name)
        kernel = {"key": key, "digest": sha256_file(out_dir / KERNEL)[0]}
        p = spec.batch_profile
        engine = {
            "format": ENGINE_FORMAT, "device": device, "target": spec.target, "precision": spec.precision,
            "family": built.family.name, "model_class": type(built.model).__name__,
            "quant_algo": ckpt.quant_algo, "activation_quant_emulated": ckpt.quant_algo is not None,
            "emulation": built.emulation, "compute_dtype": str(dtype).removeprefix("torch."),
            "compute_dtype_reason": why, "checkpoint_dtype": checkpoint_dtype(config),
            "kv_cache": "none (full-sequence forward, no KV cache)",
            "input": {"name": "input_ids", "dtype": "int64", "shape": [f"1..{p.max_batch_size}", f"1..{p.max_seq_len}"]},
            "output": {"name": "logits", "dtype": str(dtype).removeprefix("torch."), "shape": ["batch", "seq", int(ckpt.config["vocab_size"])]},
            "profile": p.model_dump(), "torch": torch.__version__,
            "kernel": {"file": KERNEL, **kernel}, "weights": {"file": WEIGHTS, "digest": sha256_file(out_dir / WEIGHTS)[0]},
        }
        if device == "cpu":  # what the .so was compiled for and needs: the toolchain's entry, matched by resolve
            from kiln.toolchain import toolchain_for

            engine["cpu"] = toolchain_for(self.name, "cpu")["cpu"]
        (out_dir / "engine.json").write_text(json.dumps(engine, indent=2, sort_keys=True))
        return {"backend": self.name, "device": device, "kernel": {**kernel, "reused": made is None},
                "seconds": {"rebuild": round(t1 - t0, 3), "export": round(t2 - t1, 3), "compile": round(t3 - t2, 3),
                            "weights": round(t4 - t3, 3)}}

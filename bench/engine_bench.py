"""Is the compiled engine worth compiling? Prefill tokens/s of Kiln's ``aot-inductor`` FP8 engine against eager
transformers running the same checkpoint in its own dtype (bf16) and in float32, at every (batch, sequence)
point of the envelope, in one process, alternating who runs first; and what the FP8 emulation costs (the
engine's model run eagerly with and without its activation fake-quantizers).

    python bench/engine_bench.py [--layers 8 --hidden 512 --rounds 5] [--checkpoint DIR]

The checkpoint is made here: a Llama-3-shaped model (bf16, sharded safetensors, random weights, the shipped
tiny model's tokenizer), about 25 M parameters by default (``--layers`` / ``--hidden`` size it), or
``--checkpoint DIR`` (any local checkpoint; eager runs in its config's dtype and in float32). The engine is what
``kiln build --backend aot-inductor --precision fp8 --recipe fp8-pcpt`` makes of it (a ``kiln build`` in a process
of its own, on the embedded defaults; ``--recipe`` picks another FP8 recipe: fp8-pcpt is the rung SmolLM2-135M's
default build publishes). The CPU is named first (model name, capability, what the engine's toolchain says —
``+bf16`` where bf16 units are native — and oneDNN's bf16 support): the engine computes in bf16 there and in
float32 elsewhere (builder/backends/aot_inductor.py ``compute_choice``).

The float32 path of a CPU without native bf16 can be forced on one that has it: run with
``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2`` (ATen, AOTInductor, oneDNN and
MKL then all generate or pick AVX2 code; the toolchain reads ``x86_64-AVX2`` and the engine computes in float32).

Targets: the engine's prefill tokens/s ≥ eager transformers in the checkpoint's own dtype at every measured point
(issue 17), on a CPU with bf16 units ≥ eager bf16 and on an AVX2 CPU ≥ eager float32 (issue 26). Ratios are
medians over rounds of per-round ratios; each figure is the fastest of ``--reps`` timed runs after a warm-up
(interference from other processes only ever slows a run down).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
warnings.filterwarnings("ignore")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

POINTS = [(1, 32), (1, 128), (1, 512), (4, 128), (4, 512)]
PROFILE = {"max_batch_size": 4, "max_input_len": 512, "max_seq_len": 512, "max_num_tokens": 2048}


def make_checkpoint(out: Path, layers: int, hidden: int) -> int:
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tiny = ROOT / "examples" / "tiny-llama"
    cfg = LlamaConfig(vocab_size=json.loads((tiny / "config.json").read_text())["vocab_size"], hidden_size=hidden,
                      intermediate_size=hidden * 3, num_hidden_layers=layers, num_attention_heads=hidden // 64,
                      num_key_value_heads=max(1, hidden // 256), head_dim=64, max_position_embeddings=1024,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out, max_shard_size="20MB")
    for f in tiny.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy2(f, out / f.name)
    return sum(p.numel() for p in model.parameters())


def count_params(ckpt: Path) -> int:
    import math

    from safetensors import safe_open

    total = 0
    for f in ckpt.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            total += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())
    return total


def build(ckpt: Path, home: Path, recipe: str) -> tuple[Path, Path]:
    env = {**os.environ, "KILN_HOME": str(home), "KILN_CHECKPOINT_ROOTS": str(ckpt.parent)}
    p = PROFILE
    argv = ["build", str(ckpt), "--precision", "fp8", "--recipe", recipe, "--backend", "aot-inductor", "--max-batch-size",
            str(p["max_batch_size"]), "--max-input-len", str(p["max_input_len"]), "--max-seq-len", str(p["max_seq_len"]),
            "--max-num-tokens", str(p["max_num_tokens"]), "--calib-samples", "8", "--calib-seq-len", "64",
            "--eval-max-tokens", "1024", "--override-reason", "a benchmark build: a short evaluation", "--json"]
    t = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "api.cli", *argv], env=env,
                          cwd=ROOT, capture_output=True, text=True)
    if done.returncode not in (0, 1):  # 1: random weights may fail the accuracy gates; the engine is still built
        raise SystemExit(f"kiln build failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    print(f"kiln build: {time.perf_counter() - t:.0f} s")
    return built_in(home)


def built_in(home: Path) -> tuple[Path, Path]:
    """The engine and the quantized checkpoint a build left in ``home``'s stage cache: one recipe, one of each —
    never a guess among several."""
    engines = [d for d in (home / "cache" / "compile").iterdir() if (d / "model.pt2").is_file()]
    quantized = [d / "hf" for d in (home / "cache" / "quantize").iterdir() if (d / "hf").is_dir()]
    if len(engines) != 1 or len(quantized) != 1:
        raise SystemExit(f"expected one engine and one quantized checkpoint under {home / 'cache'}, found "
                         f"{len(engines)} and {len(quantized)}")
    return engines[0], quantized[0]


def cpu_line() -> str:
    """This CPU, named: model, ATen capability, the toolchain's cpu entry (what the engine needs and whether bf16
    is native), oneDNN's bf16 support (true on AVX512 CPUs that only emulate bf16), env overrides in force."""
    import platform

    import torch

    from kiln.toolchain import host_cpu

    model = platform.processor() or platform.machine()
    try:
        model = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.lower().startswith("model name"))
    except (OSError, StopIteration):
        pass
    env = ", ".join(f"{k}={os.environ[k]}" for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA",
                                                     "MKL_ENABLE_INSTRUCTIONS") if k in os.environ)
    return (f"cpu: {model}; {os.cpu_count()} logical cores, torch {torch.get_num_threads()} threads; capability "
            f"{torch.backends.cpu.get_cpu_capability()}; toolchain cpu {host_cpu()}; "
            f"mkldnn bf16 supported {torch.ops.mkldnn._is_mkldnn_bf16_supported()}" + (f"; env {env}" if env else ""))


def fastest(fn, x, reps: int) -> float:
    import torch

    with torch.no_grad():
        fn(x)
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn(x)
            times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default="fp8-pcpt", help="the FP8 recipe to build (default fp8-pcpt: the rung "
                    "SmolLM2-135M publishes; fp8's static per-tensor emulation has no per-token amax to compute)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--work", type=Path, help="reuse the checkpoint and engine an earlier run left in this folder")
    ap.add_argument("--out", type=Path, help="make the checkpoint and engine in this folder (default: a temporary one)")
    ap.add_argument("--checkpoint", type=Path, help="bench this local checkpoint instead of making one (copied)")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from kiln.hfmodel import LogitsOnly, load_engine_model
    from validation.runners import AOTInductorRunner

    work = args.work or args.out or Path(tempfile.mkdtemp(prefix="kiln-engine-bench-"))
    print(f"work: {work}")
    ckpt = work / "ckpt"
    if args.work:
        params = count_params(ckpt)
        engine_dir, quantized = built_in(work / "home")
    else:
        if args.checkpoint:
            import shutil

            shutil.copytree(args.checkpoint, ckpt)
            params = count_params(ckpt)
        else:
            params = make_checkpoint(ckpt, args.layers, args.hidden)
        engine_dir, quantized = build(ckpt, work / "home", args.recipe)
    config = json.loads((ckpt / "config.json").read_text())
    own = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    print(cpu_line())
    print(f"checkpoint: {args.checkpoint or 'Llama-3 shape (made here)'}, {params / 1e6:.1f} M parameters, {own}, "
          f"{len(list(ckpt.glob('*.safetensors')))} shards; torch {torch.__version__}, {torch.get_num_threads()} threads")
    meta = json.loads((engine_dir / "engine.json").read_text())
    print(f"engine: {meta['format']}, computes in {meta.get('compute_dtype', 'float32')} "
          f"({meta.get('compute_dtype_reason', 'recorded before the reason was')}), {meta['precision']}")

    engine = AOTInductorRunner(engine_dir)
    eager = {dt: AutoModelForCausalLM.from_pretrained(ckpt, dtype=getattr(torch, dt)).eval()
             for dt in dict.fromkeys((own, "float32"))}
    computes = getattr(torch, meta.get("compute_dtype", "float32"))  # eager emulation in the engine's own dtype
    emulated = LogitsOnly(load_engine_model(quantized, dtype=computes).model).eval()
    plain_model = load_engine_model(quantized, dtype=computes).model
    for module in plain_model.modules():
        module._forward_pre_hooks.clear()  # the same dequantized weights, activations not fake-quantized
    plain = LogitsOnly(plain_model).eval()
    runs = {
        "engine": engine.prefill,  # the engine's own output (logits in its compute dtype), as a deployer gets it
        "eager_own": lambda x: eager[own](input_ids=x, use_cache=False).logits,
        "eager_fp32": lambda x: eager["float32"](input_ids=x, use_cache=False).logits,
        "eager_fp8_emulated": emulated,
        "eager_dequantized_only": plain,
    }
    rows = {p: {k: [] for k in runs} for p in POINTS}
    vocab = int(json.loads((ckpt / "config.json").read_text())["vocab_size"])
    for r in range(args.rounds):
        order = list(runs) if r % 2 == 0 else list(reversed(runs))
        for b, s in POINTS:
            x = torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(r))
            for name in order:
                rows[(b, s)][name].append(b * s / fastest(runs[name], x, args.reps))
    print(f"\nprefill tokens/s (fastest of {args.reps} after a warm-up; medians over {args.rounds} rounds) and ratios")
    short = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}.get(own, own)
    print(f"{'batch x seq':>12} {'engine':>9} {'eager ' + short:>11} {'eager fp32':>11} {'engine/' + short:>12} "
          f"{'engine/fp32':>12} {'emulation cost':>15}")
    out = []
    for (b, s), r in rows.items():
        med = {k: statistics.median(v) for k, v in r.items()}
        vs_own = statistics.median(e / x for e, x in zip(r["engine"], r["eager_own"]))
        vs_fp32 = statistics.median(e / x for e, x in zip(r["engine"], r["eager_fp32"]))
        emul = statistics.median(p / q for p, q in zip(r["eager_dequantized_only"], r["eager_fp8_emulated"]))
        print(f"{b:>5} x {s:<5} {med['engine']:9.0f} {med['eager_own']:11.0f} {med['eager_fp32']:11.0f} "
              f"{vs_own:11.2f}x {vs_fp32:11.2f}x {emul:14.2f}x")
        out.append({"batch": b, "seq": s, **{k: round(v, 1) for k, v in med.items()},
                    "engine_over_eager_own_dtype": round(vs_own, 3), "engine_over_eager_fp32": round(vs_fp32, 3),
                    "emulation_slowdown": round(emul, 3)})
    print("(emulation cost: eager time with the FP8 activation fake-quantizers over eager time without them, "
          "same dequantized weights)")
    print(json.dumps({"params": params, "checkpoint_dtype": own, "compute_dtype": meta.get("compute_dtype"),
                      "cpu": cpu_line(), "points": out}))


if __name__ == "__main__":
    main()

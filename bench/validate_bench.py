"""The validate stage against the validation it replaced, in one run, on the same engines: seconds and verdicts.

    python bench/validate_bench.py --checkpoint DIR [--baseline-rev REV] [--out DIR]

Two engines of one checkpoint are built once (quantize + compile with Kiln's own stages, aot-inductor on the cpu
target, ``latency`` profile): FP8 (``fp8`` recipe) and a second precision (``nvfp4``). Then, each in a fresh
Python process so that none inherits another's memory or warm caches:

- ``baseline``: the validation of ``--baseline-rev`` (default 30cfb1e, the last commit before decisions with
  confidence), from a ``git worktree`` of that commit: the reference runner recomputed, every window evaluated,
  TPOT by re-running the whole sequence per token;
- ``cold``: this tree's validation of the FP8 engine with no stored reference: the reference's hidden states
  computed (as a first build of a checkpoint does) and saved, then sequential evaluation;
- ``warm``: this tree's validation of the second precision's engine with the reference loaded from what ``cold``
  saved (every later build of the checkpoint, on any worker).

Each process times the whole of what the validate stage does for its engine (opening the engine and the reference,
accuracy, throughput sweep, latency, the peak-memory child) and prints its verdict and accuracy figures. The
table names the CPU, and gives each ratio: ``cold / baseline(fp8)`` and ``warm / baseline(second precision)``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BASELINE_REV = "30cfb1e"

# One validation, in a child process; argv: mode engine_dir checkpoint_dir reference_dir precision
CHILD = r'''
import json, sys, time
t0 = time.perf_counter()
from pathlib import Path
mode, engine_dir, ckpt, ref_dir, precision = sys.argv[1:6]
from kiln.datasets import load_text
from kiln.spec import parse_spec
from validation.gates import effective_gates
from validation.runners import open_engine, open_reference
from validation.validate import validate
ckpt, engine_dir, ref_dir = Path(ckpt), Path(engine_dir), Path(ref_dir)
spec = parse_spec({"checkpoint": str(ckpt), "precision": precision, "recipe": precision}, [ckpt.parent])
text, _ = load_text("kiln:heldout", field="evaluation.dataset", roots=[])
vocab = int(json.loads((ckpt / "config.json").read_text())["vocab_size"])
imported = time.perf_counter() - t0
t = time.perf_counter()
engine = open_engine("aot-inductor", engine_dir)
if mode == "baseline":
    reference = open_reference(ckpt)
elif mode == "cold":
    from validation.reference import compute_reference
    from validation.runners import reference_dtype  # as the pipeline does: bf16 on a CPU with native bf16 units
    dtype = reference_dtype(json.loads((ckpt / "config.json").read_text()))
    reference = compute_reference(open_reference(ckpt, dtype), ckpt, text, spec)
    reference.save(ref_dir)
else:
    from validation.reference import Reference
    reference = Reference.load(ref_dir, ckpt)
report = validate(engine, reference, ckpt, text, spec, effective_gates(precision, {}), vocab,
                  engine_source=("aot-inductor", engine_dir))
seconds = time.perf_counter() - t
m = report["metrics"]
print(json.dumps({"mode": mode, "precision": precision, "seconds": seconds, "imports": imported,
                  "passed": report["passed"], "failed": [g["name"] for g in report["gates"] if not g["passed"]],
                  "ppl_increase_pct": m["ppl_increase_pct"], "mean_kl": m["mean_kl"],
                  "top1_agreement": m["top1_agreement"], "tokens": m["tokens"], "tpot_ms": m.get("tpot_ms"),
                  "ttft_ms": m.get("ttft_ms"), "intervals": m.get("intervals"),
                  "windows": (m.get("sequential") or {}).get("windows"), "mde": m.get("mde")}))
'''


def build_engine(ckpt: Path, precision: str, out: Path) -> Path:
    """quantize + compile with Kiln's stages (cached in ``out``)."""
    from builder import quantize as quantize_stage
    from builder.backends import get_backend
    from kiln.datasets import load_text
    from kiln.spec import parse_spec

    engine = out / f"{precision}-engine"
    if (engine / "model.pt2").is_file():
        return engine
    spec = parse_spec({"checkpoint": str(ckpt), "precision": precision, "recipe": precision}, [ckpt.parent])
    text, _ = load_text(spec.calibration.dataset, field="calibration.dataset", roots=[])
    quantized = out / f"{precision}-quantized"
    if not (quantized / "quantize.json").is_file():
        quantize_stage.quantize(ckpt, spec, text, quantized)
    get_backend("aot-inductor").compile(spec, quantized, engine, checkpoint_dir=ckpt)
    return engine


def child(tree: Path, mode: str, engine: Path, ckpt: Path, ref_dir: Path, precision: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONWARNINGS": "ignore", "TRANSFORMERS_VERBOSITY": "error"}
    proc = subprocess.run([sys.executable, "-c", CHILD, mode, str(engine), str(ckpt), str(ref_dir), precision],
                          cwd=tree, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} {precision} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True, type=Path)
    ap.add_argument("--baseline-rev", default=BASELINE_REV)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--second", default="nvfp4", help="the second precision (default nvfp4)")
    args = ap.parse_args()
    from kiln.toolchain import host_cpu
    from validation.measure import _cpu_model

    out = args.out or Path(tempfile.mkdtemp(prefix="kiln-validate-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    ckpt = args.checkpoint.resolve()
    engines = {p: build_engine(ckpt, p, out) for p in ("fp8", args.second)}
    worktree = out / "baseline-tree"
    if not worktree.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(worktree), args.baseline_rev], cwd=ROOT, check=True,
                       capture_output=True)
    ref_dir = out / "reference"
    rows = [child(worktree, "baseline", engines["fp8"], ckpt, ref_dir, "fp8"),
            child(ROOT, "cold", engines["fp8"], ckpt, ref_dir, "fp8"),
            child(worktree, "baseline", engines[args.second], ckpt, ref_dir, args.second),
            child(ROOT, "warm", engines[args.second], ckpt, ref_dir, args.second)]
    print(f"CPU: {_cpu_model()} ({os.cpu_count()} CPUs; {host_cpu()}); load {os.getloadavg()[0]:.2f}; "
          f"checkpoint {ckpt.name}; baseline {args.baseline_rev}")
    print(f"{'run':<9} {'precision':<9} {'seconds':>8} {'verdict':<8} {'ppl +%':>8} {'KL':>8} {'top-1':>7} "
          f"{'tokens':>7} {'TPOT ms':>8}  failed gates")
    for r in rows:
        tpot = f"{r['tpot_ms']:.1f}" if isinstance(r.get("tpot_ms"), (int, float)) else "—"
        print(f"{r['mode']:<9} {r['precision']:<9} {r['seconds']:>8.1f} {'pass' if r['passed'] else 'FAIL':<8} "
              f"{r['ppl_increase_pct']:>8.2f} {r['mean_kl']:>8.4f} {r['top1_agreement']:>7.3f} {r['tokens']:>7} "
              f"{tpot:>8}  {', '.join(r['failed']) or '—'}")
    for r in rows:
        if r.get("mde"):
            d = r["mde"]["ppl_increase_pct"]
            print(f"{r['mode']:<9} smallest detectable perplexity increase {d['paired']:.2f} % over {d['windows']} "
                  f"windows, paired; an unpaired comparison would need {d['unpaired_windows_needed']} windows")
    print(f"cold / baseline (fp8): {rows[1]['seconds'] / rows[0]['seconds']:.3f}   "
          f"warm / baseline ({args.second}): {rows[3]['seconds'] / rows[2]['seconds']:.3f}   "
          f"same verdicts: {rows[0]['passed'] == rows[1]['passed'] and rows[2]['passed'] == rows[3]['passed']}")
    (out / "validate_bench.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()

"""Quantize's peak memory: Kiln's stage function against the raw ModelOpt calls, each in a fresh process with the
same imports done before anything is measured, on the scale benchmark's checkpoints. Prints, per size, the peak
resident growth of both, their ratio, and the issue's line (1.5 × the model in its own dtype + the calibration
activations).

    python bench/quantize_memory.py [--sizes 30m,150m] [--rounds 2] [--models-dir DIR]

Kiln = ``builder.quantize.quantize`` (what the quantize stage runs) on a parsed spec: FP8, calibration 8 × 64
tokens of the built-in calibration text. Raw = ``bench/raw_build.quantize``: ``AutoModelForCausalLM`` in the
checkpoint's dtype, ``mtq.quantize`` with the same config and forward loop, the saved calibration,
``export_hf_checkpoint``. Growth = the process's VmHWM during the call minus its RSS just before it (VmHWM is
reset there: ``/proc/self/clear_refs``). Raw's process also resets VmHWM between its steps, which gives where
the peak is: after loading (safetensors maps the shards; pages count once touched), calibrating, exporting.
The activations in the line are raw's calibration peak minus the model's bytes: what calibration holds beyond
the weights (one batch's logits, ModelOpt's fake-quant temporaries). Rounds alternate who goes first.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE)]


def child(mode: str, ckpt: Path, out: Path) -> dict:
    """(fresh process) One quantize, measured."""
    import modelopt.torch.export  # noqa: F401
    import modelopt.torch.opt  # noqa: F401
    import modelopt.torch.quantization  # noqa: F401
    import torch  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    import raw_build
    from builder import quantize as stage
    from kiln.spec import parse_spec
    from validation.measure import _proc_status

    text = raw_build.read_text("calibration.txt")
    spec = parse_spec({"checkpoint": str(ckpt), "precision": "fp8", "recipe": "fp8",
                       "calibration": {"samples": 8, "seq_len": 64}}, [ckpt.parent])
    mem = raw_build.Memory() if mode == "raw" else None  # resets VmHWM
    before = _proc_status()["VmRSS"]
    if mode == "kiln":
        raw_build.Memory._reset()
        stage.quantize(ckpt, spec, text, out)
        return {"growth": _proc_status()["VmHWM"] - before}
    raw_build.quantize(ckpt, out, precision="fp8", samples=8, seq_len=64, mem=mem)
    steps = {k: v["peak_bytes"] - before for k, v in mem.steps.items() if k.startswith("quantize.")}
    return {"growth": max(steps.values()), "steps": steps}


def run_child(mode: str, ckpt: Path, work: Path) -> dict:
    out = Path(tempfile.mkdtemp(dir=work)) / "out"
    proc = subprocess.run([sys.executable, __file__, "--child", mode, str(ckpt), str(out)], cwd=ROOT,
                          capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{mode} quantize failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    import scale_bench

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="30m,150m")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--models-dir", type=Path, help="keep the generated checkpoints here and reuse them")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        mode, ckpt, out = args.child
        print(json.dumps(child(mode, Path(ckpt), Path(out))))
        return
    mib = 1 << 20
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for size in args.sizes.split(","):
            ckpt, _ = scale_bench.checkpoint_for(size, args.models_dir or work / "models")
            model = sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))
            print(f"{size}: model {model / mib:.0f} MiB ({ckpt})")
            for r in range(args.rounds):
                order = ("kiln", "raw") if r % 2 == 0 else ("raw", "kiln")
                got = {mode: run_child(mode, ckpt, work) for mode in order}
                steps = got["raw"]["steps"]
                activations = steps["quantize.calibrate"] - model
                line = 1.5 * model + activations
                print(f"  round {r + 1}: kiln {got['kiln']['growth'] / mib:.0f} MiB, raw {got['raw']['growth'] / mib:.0f}"
                      f" MiB, kiln/raw {got['kiln']['growth'] / got['raw']['growth']:.3f}; raw's steps "
                      + ", ".join(f"{k.split('.')[1]} {v / mib:.0f}" for k, v in steps.items())
                      + f"; line 1.5 × {model / mib:.0f} + {activations / mib:.0f} = {line / mib:.0f} MiB:"
                      f" kiln {got['kiln']['growth'] / line:.2f} × the line")


if __name__ == "__main__":
    main()

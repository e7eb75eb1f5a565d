"""The measured-defaults table (docs/validation.md "Measured on real models"): model × recipe × calibration size →
perplexity increase, top-1 agreement, mean KL and seconds, through Kiln's own quantize stage and the ladder's
accuracy screen (the exported checkpoint computed eagerly from its tensors, against the unquantized reference in
float32, on the default evaluation: kiln:heldout, 128-token windows, 16,384 tokens).

    python bench/recipe_table.py --model smollm2-135m --recipes fp8,fp8-pcpt --calibration 32x128,128x512

``--model`` is a real model from scripts/real_models.py (made on first use) or a checkpoint directory. The CPU it
ran on is printed first; one JSON line per row follows (``--out FILE`` also writes them).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from builder.ladder import screen  # noqa: E402
from builder.quantize import quantize  # noqa: E402
from kiln.datasets import load_text  # noqa: E402
from kiln.spec import parse_spec  # noqa: E402
from kiln.toolchain import cpu_capability  # noqa: E402
from validation.runners import open_reference  # noqa: E402
from validation.validate import eval_tokens  # noqa: E402


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def checkpoint(model: str) -> Path:
    if Path(model).is_dir():
        return Path(model).resolve()
    from scripts.real_models import ensure

    return ensure(model)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--recipes", default="fp8,fp8-pcpt,nvfp4,nvfp4-mlp-only,nvfp4-w4a16")
    ap.add_argument("--calibration", default="32x128", help="samples x seq_len, comma-separated")
    ap.add_argument("--unquantized-layers", default="", help="e.g. 0,-1")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.manual_seed(0)
    ckpt = checkpoint(args.model)
    print(f"# cpu: {cpu_name()} ({platform.machine()}, torch capability {cpu_capability()}, "
          f"{torch.get_num_threads()} threads); model {ckpt.name}", flush=True)
    calib_text, _ = load_text("kiln:calibration", field="calibration.dataset", roots=[])
    eval_text, _ = load_text("kiln:heldout", field="evaluation.dataset", roots=[])
    reference = open_reference(ckpt)
    layers = [int(x) for x in args.unquantized_layers.split(",") if x.strip()]
    rows = []
    for recipe in args.recipes.split(","):
        from kiln.recipes import RECIPES

        for cal in args.calibration.split(","):
            samples, seq_len = (int(x) for x in cal.split("x"))
            spec = parse_spec({"checkpoint": str(ckpt), "precision": RECIPES[recipe].precision, "recipe": recipe,
                               "unquantized_layers": layers,
                               "calibration": {"samples": samples, "seq_len": seq_len}}, [ckpt.parent])
            text = eval_tokens(ckpt, eval_text, spec)
            with tempfile.TemporaryDirectory() as tmp:
                t = time.perf_counter()
                record = quantize(ckpt, spec, calib_text, Path(tmp) / "q")
                q_s = time.perf_counter() - t
                t = time.perf_counter()
                m = screen(Path(tmp) / "q", reference, text, [16] * len(text.lengths))
                s_s = time.perf_counter() - t
            row = {"model": ckpt.name, "recipe": recipe, "calibration": cal, "unquantized_layers": layers,
                   "ppl_increase_pct": round(m["ppl_increase_pct"], 3), "top1_agreement": round(m["top1_agreement"], 4),
                   "mean_kl": round(m["mean_kl"], 4), "reference_perplexity": round(m["reference_perplexity"], 3),
                   "quantize_s": round(q_s, 1), "calibrate_s": record["seconds"]["calibrate"],
                   "screen_s": round(s_s, 1), "tokens": m["tokens"]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()

"""The yardstick for Kiln's accuracy verdicts: ModelOpt's own fake-quantized model in transformers, on the same
windows, against the same unquantized reference.

A recipe's ModelOpt config (``FP8_DEFAULT_CFG``, ``FP8_PER_CHANNEL_PER_TOKEN_CFG``, …) is applied to transformers'
model of the checkpoint with ``mtq.quantize``, calibrated on the rows Kiln calibrates on (validation/text.py: the
tokenizer's BOS first where it adds one), and evaluated in float32 on the evaluation's windows at every length,
against the float32 reference. Kiln's own engine of the same checkpoint and recipe should land within its
report's intervals of these figures (tests/integration/test_real_verdicts.py); docs/validation.md's table of
defaults is made with it:

    python bench/yardstick.py --model gemma3-270m --recipes fp8,fp8-pcpt --texts kiln:heldout,/usr/share/common-licenses/GPL-3

One JSON line per (model, recipe, text): perplexity increase, top-1 agreement and mean KL with their intervals,
at each window length; the CPU first. NVFP4 recipes need CUDA or Triton for ModelOpt's fake quantization.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from kiln.datasets import load_text  # noqa: E402
from kiln.recipes import RECIPES  # noqa: E402
from kiln.spec import parse_spec  # noqa: E402
from validation.accuracy import accuracy_at_lengths, window_batch  # noqa: E402
from validation.runners import open_reference  # noqa: E402
from validation.text import calibration_rows, convention_of, load_tokenizer, stream  # noqa: E402
from validation.validate import eval_tokens  # noqa: E402


class FakeQuantRunner:
    """A ModelOpt-quantized transformers model as a runner: float32 logits of its forward."""

    def __init__(self, model):
        self.model = model

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.model(input_ids).logits.float()


def fake_quantized(ckpt: Path, recipe: str, calib_text: str, samples: int = 32, seq_len: int = 128):
    """transformers' model of ``ckpt`` in float32, quantized by ModelOpt with ``recipe``'s config and calibrated on
    ``samples`` rows of ``seq_len`` tokens of ``calib_text`` as Kiln cuts them."""
    import modelopt.torch.quantization as mtq
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(ckpt)
    rows = calibration_rows(stream(tokenizer, calib_text), samples, seq_len, convention_of(tokenizer))
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    cfg = copy.deepcopy(getattr(mtq, RECIPES[recipe].modelopt_config))

    def forward_loop(m):
        with torch.no_grad():
            for i in range(0, len(rows), 8):
                m(rows[i : i + 8])

    return mtq.quantize(model, cfg, forward_loop)


def measure(ckpt: Path, recipe: str, calib_text: str, eval_text: str, *, max_tokens: int = 16384,
            profile: str | dict = "latency", reference=None) -> dict:
    """The fake-quantized model's accuracy against the float32 reference on every window of ``eval_text`` (no
    sequential stopping), at each window length of the profile."""
    spec = parse_spec({"checkpoint": str(ckpt), "precision": RECIPES[recipe].precision, "recipe": recipe,
                       "profile": profile, "evaluation": {"max_tokens": max_tokens},
                       "override_reason": "the yardstick: any evaluation length"}, [ckpt.parent])
    text = eval_tokens(ckpt, eval_text, spec)
    vocab = int(json.loads((ckpt / "config.json").read_text())["vocab_size"])
    batches = [window_batch(8, seq, vocab) for seq in text.lengths]
    engine = FakeQuantRunner(fake_quantized(ckpt, recipe, calib_text))
    return accuracy_at_lengths(engine, reference or open_reference(ckpt), text.ids, text.lengths, batches,
                               sequential=False, convention=text.convention)


def summary(m: dict) -> dict:
    def one(x: dict) -> dict:
        return {"seq_len": x["seq_len"], "windows": x["windows"], "reference_perplexity": round(x["reference_perplexity"], 3),
                **{k: round(x[k], 4) for k in ("ppl_increase_pct", "top1_agreement", "mean_kl")},
                "intervals": {k: [round(v["low"], 4), round(v["high"], 4)] for k, v in x["intervals"].items()}}
    return {"lengths": [one(m)] + [one(x) for x in m.get("long_windows") or [] if x.get("evaluated")]}


def text_of(name: str) -> str:
    if name.startswith("kiln:"):
        return load_text(name, field="evaluation.dataset", roots=[])[0]
    return Path(name).read_text(encoding="utf-8", errors="replace")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--recipes", default="fp8,fp8-pcpt")
    ap.add_argument("--texts", default="kiln:heldout")
    ap.add_argument("--max-tokens", type=int, default=16384)
    args = ap.parse_args()
    from scripts.real_models import ensure

    ckpt = Path(args.model).resolve() if Path(args.model).is_dir() else ensure(args.model)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.machine())
    print(f"# cpu: {cpu}; torch {torch.__version__}, {torch.get_num_threads()} threads; model {ckpt.name}", flush=True)
    calib = load_text("kiln:calibration", field="calibration.dataset", roots=[])[0]
    reference = open_reference(ckpt)
    for name in args.texts.split(","):
        for recipe in args.recipes.split(","):
            m = measure(ckpt, recipe, calib, text_of(name), max_tokens=args.max_tokens, reference=reference)
            print(json.dumps({"model": ckpt.name, "recipe": recipe, "text": name, **summary(m)}), flush=True)


if __name__ == "__main__":
    main()

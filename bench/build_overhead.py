"""Kiln's end-to-end build time against the sum of the raw library calls for the same stages, and the time
to answer an identical rebuild from the cache. Prints ratios.

    python bench/build_overhead.py [--precision fp8] [--profile latency]

"raw" = the library calls the stages make, called directly on the same inputs: ModelOpt quantize + both
exports, torch.export + AOTInductor compile of the rebuilt model, loading the package and running the same
accuracy and throughput passes. Kiln's extra work is hashing, keys, stage bookkeeping, publishing and indexing.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
warnings.filterwarnings("ignore")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def raw_stages(precision: str, profile_name: str, work: Path) -> dict[str, float]:
    import contextlib
    import io

    import modelopt.torch.quantization as mtq
    import torch
    from modelopt.torch.export import export_hf_checkpoint, export_tensorrt_llm_checkpoint
    from torch.export import Dim
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kiln.datasets import load_text
    from kiln.llama import KilnLlama
    from kiln.quantformat import load_quantized_checkpoint
    from kiln.spec import PROFILES
    from validation.measure import accuracy, throughput
    from validation.runners import AOTInductorRunner, TransformersRunner

    src, p = ROOT / "examples" / "tiny-llama", PROFILES[profile_name]
    t = {}
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(src)
    model = AutoModelForCausalLM.from_pretrained(src, dtype="auto").eval()
    text, _ = load_text("kiln:calibration", field="x", roots=[ROOT])
    ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"][0][: 32 * 128].view(32, 128)
    cfg = copy.deepcopy(mtq.FP8_DEFAULT_CFG if precision == "fp8" else mtq.NVFP4_DEFAULT_CFG)
    with contextlib.redirect_stdout(io.StringIO()):
        model = mtq.quantize(model, cfg, lambda m: [m(ids[i : i + 8]) for i in range(0, 32, 8)])
        export_tensorrt_llm_checkpoint(copy.deepcopy(model), "llama", dtype=model.dtype, export_dir=work / "trt",
                                       inference_tensor_parallel=1)
        export_hf_checkpoint(copy.deepcopy(model), export_dir=work / "hf")
    t["quantize"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    m = KilnLlama(load_quantized_checkpoint(work / "hf")).eval()
    batch = Dim("batch", min=1, max=p.max_batch_size) if p.max_batch_size > 1 else Dim.STATIC
    with torch.no_grad():
        ep = torch.export.export(m, (torch.zeros((2 if p.max_batch_size > 1 else 1, 8), dtype=torch.long),),
                                 dynamic_shapes={"input_ids": {0: batch, 1: Dim("seq", min=1, max=p.max_seq_len)}})
        (work / "engine").mkdir()
        torch._inductor.aoti_compile_and_package(ep, package_path=str(work / "engine" / "model.pt2"))
    (work / "engine" / "engine.json").write_text('{"device": "cpu"}')
    t["compile"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine, ref = AOTInductorRunner(work / "engine"), TransformersRunner(src)
    held, _ = load_text("kiln:heldout", field="x", roots=[ROOT])
    hid = tok(held, return_tensors="pt", add_special_tokens=False)["input_ids"][0][: 16385]
    accuracy(engine, ref, hid, min(128, p.max_seq_len), min(p.max_batch_size, 16))
    throughput(engine, p, 2048)
    t["validate"] = time.perf_counter() - t0
    return t


def kiln_build(precision: str, profile: str, home: Path) -> tuple[float, float]:
    import subprocess

    env = {**os.environ, "KILN_HOME": str(home), "KILN_CHECKPOINT_ROOTS": str(ROOT)}
    cmd = [sys.executable, "-m", "api.cli", "build", "examples/tiny-llama", "--precision", precision,
           "--profile", profile, "--json"]
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True)
        times.append(time.perf_counter() - t0)
    return times[0], times[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--precision", default="fp8")
    ap.add_argument("--profile", default="latency")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        raw = raw_stages(args.precision, args.profile, Path(d) / "raw")
        full, hit = kiln_build(args.precision, args.profile, Path(d) / "home")
    total_raw = sum(raw.values())
    print(f"raw library calls: " + ", ".join(f"{k} {v:.2f}s" for k, v in raw.items()) + f" = {total_raw:.2f}s")
    print(f"kiln build (CLI process, end to end): {full:.2f}s  ratio {full / total_raw:.3f} × raw")
    print(f"kiln build, identical rebuild (cache hit, CLI process): {hit:.2f}s  ratio {hit / full:.3f} × full build")


if __name__ == "__main__":
    main()

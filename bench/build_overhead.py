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


def kiln_build(precision: str, profile: str, home: Path, other_profile: str) -> dict[str, float]:
    """Full build, identical rebuild, and a profile-only rebuild through the CLI (separate processes)."""
    import json
    import subprocess

    env = {**os.environ, "KILN_HOME": str(home), "KILN_CHECKPOINT_ROOTS": str(ROOT)}
    out = {}
    for label, prof in (("full", profile), ("cache_hit", profile), ("profile_only", other_profile)):
        cmd = [sys.executable, "-m", "api.cli", "build", "examples/tiny-llama", "--precision", precision,
               "--profile", prof, "--json"]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, text=True)
        out[label] = time.perf_counter() - t0
        out[label + "_stages"] = {s["name"]: s["seconds"] for s in json.loads(proc.stdout.strip().splitlines()[-1])["stages"]}
    return out


def service_build(precision: str, profile: str, home: Path) -> float:
    """End to end through the embedded service: POST /v1/builds → API → broker → worker → store → succeeded."""
    import socket
    import subprocess

    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "KILN_HOME": str(home), "KILN_CHECKPOINT_ROOTS": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "api.cli", "serve", "--port", str(port)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(240):
            try:
                if httpx.get(base + "/healthz").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.25)
        time.sleep(3)  # let the worker register
        t0 = time.perf_counter()
        build = httpx.post(base + "/v1/builds", json={"checkpoint": str(ROOT / "examples" / "tiny-llama"),
                                                     "precision": precision, "profile": profile}, timeout=120).json()
        while httpx.get(f"{base}/v1/builds/{build['id']}").json()["status"] not in ("succeeded", "failed"):
            time.sleep(0.1)
        return time.perf_counter() - t0
    finally:
        import signal

        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--precision", default="fp8")
    ap.add_argument("--profile", default="latency")
    ap.add_argument("--other-profile", default="balanced")
    ap.add_argument("--raw-only", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.raw_only:  # child process: the raw calls from a cold start, like a CLI build
        import json

        print(json.dumps(raw_stages(args.precision, args.profile, Path(args.raw_only))))
        return
    with tempfile.TemporaryDirectory() as d:
        import json
        import subprocess

        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, __file__, "--precision", args.precision, "--profile", args.profile,
                              "--raw-only", str(Path(d) / "raw")], check=True, capture_output=True, text=True).stdout
        raw_process = time.perf_counter() - t0
        raw = json.loads(out.strip().splitlines()[-1])
        raw_other = raw_stages(args.precision, args.other_profile, Path(d) / "raw2")
        k = kiln_build(args.precision, args.profile, Path(d) / "home", args.other_profile)
        svc = service_build(args.precision, args.profile, Path(d) / "svc")
    total_raw = sum(raw.values())
    print("raw library calls: " + ", ".join(f"{n} {v:.2f}s" for n, v in raw.items()) + f" = {total_raw:.2f}s")
    print(f"raw calls in a fresh process (imports included, as a CLI build pays them): {raw_process:.2f}s")
    print(f"kiln build (CLI process, end to end): {k['full']:.2f}s  ratio {k['full'] / raw_process:.3f} x raw process; "
          f"stages {k['full_stages']}")
    print(f"end to end through API + worker + store (kiln serve): {svc:.2f}s  ratio {svc / raw_process:.3f} x raw process")
    print(f"identical rebuild (cache hit, CLI process incl. startup): {k['cache_hit']:.2f}s")
    cv = raw_other["compile"] + raw_other["validate"]
    print(f"profile-only rebuild ({args.other_profile}): {k['profile_only']:.2f}s vs raw compile+validate {cv:.2f}s"
          f"  ratio {k['profile_only'] / cv:.3f}; stages {k['profile_only_stages']}")


if __name__ == "__main__":
    main()

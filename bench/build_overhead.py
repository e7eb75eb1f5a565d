"""Kiln's build time against the raw library calls doing the same work, and the time to answer an identical
rebuild from the cache. Prints ratios.

    python bench/build_overhead.py [--precision fp8] [--profile latency] [--other-profile balanced]

"raw" = the calls the stages make, called directly on the same inputs, in a fresh process (its imports
included, as a CLI build and a worker pay them): ModelOpt quantize + both exports; torch.export + AOTInductor
compile of the rebuilt model; loading the package and making the same measurements Kiln's validation makes
(accuracy against the reference, the throughput sweep, TTFT/TPOT by greedy decoding, peak memory at the
envelope's corner in a fresh child process). What Kiln adds on top is its own work: spec and keys, checkpoint
and dataset hashing, the stage cache, gates and the regression comparison, the report, publishing the OCI image
and indexing it (and, through the service, the API, the broker and the worker).

Targets (issue 7): end to end ≤ 1.10 × raw; a profile-only rebuild (quantize cached) ≤ 1.05 × the raw compile
and validate for that profile.
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


def raw_stages(precision: str, profile_name: str, work: Path, quantize: bool) -> dict[str, float]:
    """The raw calls; with ``quantize`` false, compile and validate from ``work/hf`` made by an earlier run."""
    import contextlib
    import copy
    import io
    import shutil

    import torch
    from torch.export import Dim
    from transformers import AutoTokenizer

    from kiln.datasets import load_text
    from kiln.llama import KilnLlama
    from kiln.quantformat import load_quantized_checkpoint
    from kiln.spec import PROFILES
    from validation.measure import accuracy, decode_latency, peak_memory, throughput
    from validation.runners import AOTInductorRunner, TransformersRunner

    src, p = ROOT / "examples" / "tiny-llama", PROFILES[profile_name]
    t = {}
    tok = AutoTokenizer.from_pretrained(src)
    if quantize:
        import modelopt.torch.quantization as mtq
        from modelopt.torch.export import export_hf_checkpoint, export_tensorrt_llm_checkpoint
        from transformers import AutoModelForCausalLM

        t0 = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(src, dtype="auto").eval()
        text, _ = load_text("kiln:calibration", field="x", roots=[ROOT])
        ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"][0][: 32 * 128].view(32, 128)
        cfg = copy.deepcopy(mtq.FP8_DEFAULT_CFG if precision == "fp8" else mtq.NVFP4_DEFAULT_CFG)
        with contextlib.redirect_stdout(io.StringIO()), torch.no_grad():
            model = mtq.quantize(model, cfg, lambda m: [m(ids[i : i + 8]) for i in range(0, 32, 8)])
            export_tensorrt_llm_checkpoint(copy.deepcopy(model), "llama", dtype=model.dtype, export_dir=work / "trt",
                                           inference_tensor_parallel=1)
            export_hf_checkpoint(copy.deepcopy(model), export_dir=work / "hf")
        tok.save_pretrained(work / "hf")
        t["quantize"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine_dir = work / f"engine-{profile_name}"
    m = KilnLlama(load_quantized_checkpoint(work / "hf")).eval()
    batch = Dim("batch", min=1, max=p.max_batch_size) if p.max_batch_size > 1 else Dim.STATIC
    with torch.no_grad():
        ep = torch.export.export(m, (torch.zeros((2 if p.max_batch_size > 1 else 1, 8), dtype=torch.long),),
                                 dynamic_shapes={"input_ids": {0: batch, 1: Dim("seq", min=1, max=p.max_seq_len)}})
        engine_dir.mkdir()
        torch._inductor.aoti_compile_and_package(ep, package_path=str(engine_dir / "model.pt2"))
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "hf_quant_config.json"):
        if (work / "hf" / name).exists():
            shutil.copy2(work / "hf" / name, engine_dir / name)
    (engine_dir / "engine.json").write_text('{"device": "cpu"}')
    t["compile"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine, ref = AOTInductorRunner(engine_dir), TransformersRunner(src)
    held, _ = load_text("kiln:heldout", field="x", roots=[ROOT])
    hid = AutoTokenizer.from_pretrained(src)(held, return_tensors="pt", add_special_tokens=False)["input_ids"][0]
    accuracy(engine, ref, hid[: 16384 + 1], min(128, p.max_seq_len), min(p.max_batch_size, 16))
    throughput(engine, p, 2048)
    decode_latency(engine, p, 2048)
    peak_memory(engine, p, 2048, source=("aot-inductor", engine_dir))
    t["validate"] = time.perf_counter() - t0
    return t


def cold_env(tmp: Path, **extra: str) -> dict[str, str]:
    """Each process compiles cold: its own, empty TorchInductor cache under ``tmp`` (a shared one would favour
    whoever runs second with the same graph)."""
    return {**os.environ, "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="inductor-", dir=tmp), **extra}


def raw_process(precision: str, profile: str, work: Path, quantize: bool) -> tuple[float, dict[str, float]]:
    """Wall time of the raw calls in a fresh process, and the per-stage seconds it measured inside."""
    cmd = [sys.executable, __file__, "--precision", precision, "--profile", profile, "--raw-only", str(work)]
    t0 = time.perf_counter()
    out = subprocess.run(cmd + ([] if quantize else ["--no-quantize"]), check=True, capture_output=True,
                         text=True, env=cold_env(work.parent)).stdout
    return time.perf_counter() - t0, json.loads(out.strip().splitlines()[-1])


def kiln_build(precision: str, profile: str, home: Path, other_profile: str) -> dict[str, float]:
    """Full build, identical rebuild, and a profile-only rebuild through the CLI (separate processes)."""
    import json
    import subprocess

    out = {}
    for label, prof in (("full", profile), ("cache_hit", profile), ("profile_only", other_profile)):
        cmd = [sys.executable, "-m", "api.cli", "build", "examples/tiny-llama", "--precision", precision,
               "--profile", prof, "--json"]
        env = cold_env(home.parent, KILN_HOME=str(home), KILN_CHECKPOINT_ROOTS=str(ROOT))
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, text=True)
        out[label] = time.perf_counter() - t0
        out[label + "_stages"] = {s["name"]: s["seconds"] for s in json.loads(proc.stdout.strip().splitlines()[-1])["stages"]}
    return out


def service_build(precision: str, profile: str, home: Path) -> tuple[float, dict]:
    """End to end through the embedded service: POST /v1/builds → API → broker → worker → store → succeeded, on
    a worker that is up (a first, small build has run: the measured one pays no process start)."""
    import socket
    import subprocess

    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = cold_env(home.parent, KILN_HOME=str(home), KILN_CHECKPOINT_ROOTS=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "api.cli", "serve", "--port", str(port)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    base = f"http://127.0.0.1:{port}"

    def build(spec: dict) -> dict:
        """Submit and follow the build's event stream to its end, as ``kiln build --server --wait`` does (a
        client polling the API would add its own load to the two cores the build runs on)."""
        b = httpx.post(base + "/v1/builds", json=spec, timeout=120).json()
        with httpx.stream("GET", f"{base}/v1/builds/{b['id']}/events", timeout=httpx.Timeout(10, read=None)) as r:
            for line in r.iter_lines():
                if line.startswith("event: end"):
                    break
        return httpx.get(f"{base}/v1/builds/{b['id']}").json()

    try:
        for _ in range(240):
            try:
                if httpx.get(base + "/healthz").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.25)
        ckpt = str(ROOT / "examples" / "tiny-llama")
        # other calibration settings: the measured build must quantize for itself (the quantize key has no backend)
        build({"checkpoint": ckpt, "precision": precision, "backend": "checkpoint",
               "calibration": {"samples": 8, "seq_len": 64}, "evaluation": {"max_tokens": 512}})
        t0 = time.perf_counter()
        done = build({"checkpoint": ckpt, "precision": precision, "profile": profile})
        return time.perf_counter() - t0, {s["name"]: s["seconds"] for s in done["stages"]}
    finally:
        import signal

        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--precision", default="fp8")
    ap.add_argument("--profile", default="latency")
    ap.add_argument("--other-profile", default="balanced")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--raw-only", help=argparse.SUPPRESS)
    ap.add_argument("--no-quantize", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.raw_only:  # child process: the raw calls from a cold start, like a CLI build
        print(json.dumps(raw_stages(args.precision, args.profile, Path(args.raw_only), not args.no_quantize)))
        return
    rounds = []
    for r in range(args.rounds):
        with tempfile.TemporaryDirectory() as d:
            work = Path(d) / "raw"
            work.mkdir()

            def run_raw():
                return (*raw_process(args.precision, args.profile, work, quantize=True),
                        *raw_process(args.precision, args.other_profile, work, quantize=False))

            def run_kiln():
                return (kiln_build(args.precision, args.profile, Path(d) / "home", args.other_profile),
                        *service_build(args.precision, args.profile, Path(d) / "svc"))

            if r % 2 == 0:  # alternate which goes first
                (raw_full, raw, raw_cv, raw_other), (k, svc, svc_stages) = run_raw(), run_kiln()
            else:
                (k, svc, svc_stages), (raw_full, raw, raw_cv, raw_other) = run_kiln(), run_raw()
        rounds.append({"raw_full": raw_full, "raw_inproc": sum(raw.values()), "raw_cv": raw_cv, "kiln": k["full"],
                       "cache_hit": k["cache_hit"], "profile_only": k["profile_only"], "svc": svc})
        print(f"round {r + 1}: raw {raw}; raw {args.other_profile} {raw_other}; kiln {k['full_stages']}; "
              f"profile-only {k['profile_only_stages']}; service {svc_stages}")
        print("  seconds: " + ", ".join(f"{n} {v:.2f}" for n, v in rounds[-1].items()))
    med = {n: statistics.median(x[n] for x in rounds) for n in rounds[0]}
    ratios = {  # paired within a round, then the median over rounds
        "kiln CLI end to end / raw process": [x["kiln"] / x["raw_full"] for x in rounds],
        "service end to end / raw in-process seconds": [x["svc"] / x["raw_inproc"] for x in rounds],
        "profile-only rebuild / raw compile+validate process": [x["profile_only"] / x["raw_cv"] for x in rounds],
    }
    print(f"medians over {args.rounds} round(s), every process with a cold TorchInductor cache:")
    print(f"raw calls in a fresh process (imports included, as a CLI build pays them): {med['raw_full']:.2f}s "
          f"(in-process {med['raw_inproc']:.2f}s); raw compile + validate for {args.other_profile}: {med['raw_cv']:.2f}s")
    print(f"kiln build (CLI process, end to end): {med['kiln']:.2f}s")
    print(f"end to end through API + broker + worker + store (kiln serve, a running worker, its imports done): "
          f"{med['svc']:.2f}s")
    print(f"identical rebuild (cache hit, CLI process incl. startup): {med['cache_hit']:.2f}s")
    print(f"profile-only rebuild ({args.other_profile}, CLI process): {med['profile_only']:.2f}s")
    for name, values in ratios.items():
        print(f"ratio {name}: median {statistics.median(values):.3f} (rounds: "
              + ", ".join(f"{v:.3f}" for v in values) + ")")


if __name__ == "__main__":
    main()

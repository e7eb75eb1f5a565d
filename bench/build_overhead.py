"""Kiln's build time against the raw library calls doing the same work, and the time to answer an identical
rebuild from the cache. Prints ratios.

    python bench/build_overhead.py [--precision fp8] [--profile latency] [--other-profile balanced]

"raw" = the calls the stages make, called directly on the same inputs, in a fresh process (its imports
included, as a CLI build and a worker pay them; bench/raw_build.py): ModelOpt quantize, the saved calibration
and the unified HF export (the only export the stage makes); the engine model built from that export by
kiln/hfmodel.py (``load_engine_model``, ``LogitsOnly``), torch.export + AOTInductor compile of it; loading the
package and making the same measurements Kiln's validation makes
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
import resource
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
    """The raw calls (bench/raw_build.py: the calls the stages make, on the CLI's default calibration and
    evaluation settings); with ``quantize`` false, compile and validate from ``work/hf`` made by an earlier run."""
    from bench import raw_build
    from kiln.spec import PROFILES

    out = raw_build.run(ROOT / "examples" / "tiny-llama", work, precision=precision, profile=PROFILES[profile_name],
                        calib_samples=32, calib_seq_len=128, eval_seq_len=128, eval_max_tokens=16384,
                        do_quantize=quantize)
    return {**out["seconds"], "imports": out.get("quantize_import_seconds", 0.0)}


def cold_env(tmp: Path, **extra: str) -> dict[str, str]:
    """Each process compiles cold: its own, empty TorchInductor cache under ``tmp`` (a shared one would favour
    whoever runs second with the same graph)."""
    return {**os.environ, "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="inductor-", dir=tmp), **extra}


def raw_process(precision: str, profile: str, work: Path, quantize: bool) -> tuple[float, dict[str, float]]:
    """Wall time of the raw calls in a fresh process, and the per-stage seconds it measured inside."""
    cmd = [sys.executable, __file__, "--precision", precision, "--profile", profile, "--raw-only", str(work)]
    t0 = time.perf_counter()
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(cmd + ([] if quantize else ["--no-quantize"]), check=True, capture_output=True,
                         text=True, env=cold_env(work.parent)).stdout
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    seconds = json.loads(out.strip().splitlines()[-1])
    seconds["cpu"] = round(r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime, 2)  # the process and its children
    return time.perf_counter() - t0, seconds


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


def session_cpu(sid: int) -> dict[int, tuple[str, float]]:
    """pid → (command, CPU seconds including reaped children's) of every process in session ``sid``."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        if int(fields[3]) == sid:  # fields[0] is the state: session is stat's 6th field
            out[int(d.name)] = (cmd[-60:], sum(int(x) for x in fields[11:15]) / tick)
    return out


def cpu_beside(before: dict, after: dict) -> dict:
    """CPU seconds spent between two readings: by the busiest process (the pool child that built) and by all
    the others (API, broker polling, the worker's main process, the event stream)."""
    spent = sorted(((cpu - before.get(pid, ("", 0.0))[1], cmd) for pid, (cmd, cpu) in after.items()), reverse=True)
    return {"build_process_cpu_s": round(spent[0][0], 2) if spent else 0.0,
            "other_processes_cpu_s": round(sum(c for c, _ in spent[1:]), 2),
            "others": [f"{cmd}: {c:.2f}" for c, cmd in spent[1:] if c >= 0.05]}


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
               "calibration": {"samples": 8, "seq_len": 64}, "evaluation": {"max_tokens": 512},
               "override_reason": "a benchmark build: a short evaluation"})
        cpu0 = session_cpu(proc.pid)
        t0 = time.perf_counter()
        done = build({"checkpoint": ckpt, "precision": precision, "profile": profile})
        seconds = time.perf_counter() - t0
        stages = {s["name"]: s["seconds"] for s in done["stages"]}
        return seconds, {**stages, "cpu": cpu_beside(cpu0, session_cpu(proc.pid))}
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
        imports, raw_cpu = raw.pop("imports"), raw.pop("cpu")
        raw_other.pop("imports"), raw_other.pop("cpu")
        svc_cpu = svc_stages.pop("cpu")
        # a running worker has ModelOpt and transformers imported; raw's quantize seconds include their import
        rounds.append({"raw_full": raw_full, "raw_inproc": sum(raw.values()),
                       "raw_warm": sum(raw.values()) - imports, "raw_cv": raw_cv, "kiln": k["full"],
                       "cache_hit": k["cache_hit"], "profile_only": k["profile_only"], "svc": svc})
        print(f"round {r + 1}: raw {raw}; raw {args.other_profile} {raw_other}; kiln {k['full_stages']}; "
              f"profile-only {k['profile_only_stages']}; service {svc_stages}")
        print("  seconds: " + ", ".join(f"{n} {v:.2f}" for n, v in rounds[-1].items()))
        print(f"  CPU seconds: raw process {raw_cpu:.2f} (imports included); service: the build's process "
              f"{svc_cpu['build_process_cpu_s']:.2f}, every other process {svc_cpu['other_processes_cpu_s']:.2f} "
              f"({'; '.join(svc_cpu['others'])})")
    med = {n: statistics.median(x[n] for x in rounds) for n in rounds[0]}
    ratios = {  # paired within a round, then the median over rounds
        "kiln CLI end to end / raw process": [x["kiln"] / x["raw_full"] for x in rounds],
        "service end to end / raw in-process seconds": [x["svc"] / x["raw_inproc"] for x in rounds],
        "service end to end / raw in-process seconds less quantize's imports": [x["svc"] / x["raw_warm"]
                                                                               for x in rounds],
        "profile-only rebuild / raw compile+validate process": [x["profile_only"] / x["raw_cv"] for x in rounds],
    }
    print(f"medians over {args.rounds} round(s), every process with a cold TorchInductor cache:")
    print(f"raw calls in a fresh process (imports included, as a CLI build pays them): {med['raw_full']:.2f}s "
          f"(in-process {med['raw_inproc']:.2f}s, {med['raw_warm']:.2f}s less quantize's imports); raw compile + validate for {args.other_profile}: {med['raw_cv']:.2f}s")
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

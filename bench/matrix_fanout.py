"""Matrix fan-out: one calibration shared by every entry of a matrix, against the same builds made apart.

    python bench/matrix_fanout.py [--size tiny|30m|150m] [--profiles latency,balanced,throughput]
                                  [--backends checkpoint] [--rounds 1]

Every entry of the matrix is one checkpoint (the shipped tiny model, or a size of ``bench/scale_bench.py`` made
with random weights) in FP8 (one checkpoint × precision × KV cache × calibration,
so one quantize key) with its own profile and backend. Two sides, each entry a ``kiln build --json`` process:

- **shared**: every entry in one KILN_HOME, one after another — the stage cache (keyed by stage key, kept in the
  store) gives every entry after the first its quantized checkpoint, as any worker of a deployment does;
- **apart**: each entry in a fresh KILN_HOME of its own — what building the entries as unrelated builds costs.

Which side goes first alternates per round. Prints each build's stage records and per side: seconds, quantize
stages run, quantize seconds; then the shared / apart ratio. Only ``cpu`` targets can be built here (no GPU), so
the matrix varies profiles and backends, not GPU targets; the quantize key has neither, so a target varies it the
same way (``kiln/keys.py``)."""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from scale_bench import checkpoint_for, clean_env  # noqa: E402


def build(home: Path, profile: str, backend: str, args: argparse.Namespace) -> dict:
    env = clean_env(KILN_HOME=str(home), KILN_CHECKPOINT_ROOTS=str(args.checkpoint.parent),
                    TORCHINDUCTOR_CACHE_DIR=str(home / "inductor"))
    cmd = [sys.executable, "-m", "api.cli", "build", str(args.checkpoint), "--precision", "fp8", "--profile", profile,
           "--backend", backend, "--target", "cpu", "--calib-samples", str(args.calib_samples),
           "--eval-max-tokens", str(args.eval_max_tokens), "--override-reason",
           "a fan-out benchmark: a shorter evaluation", "--json"]
    t = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t
    lines = p.stdout.strip().splitlines()
    out = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {}
    if p.returncode not in (0, 1) or not out.get("digest"):  # 1: a gate failed (random weights); every stage ran
        raise SystemExit(f"kiln build {profile} {backend} exited {p.returncode}: {p.stderr.strip()[-800:]}")
    return {"profile": profile, "backend": backend, "seconds": seconds, "stages": out["stages"]}


def side(name: str, entries: list[tuple[str, str]], base: Path, args: argparse.Namespace) -> dict:
    shared = base / f"{name}-home"
    builds = []
    for i, (profile, backend) in enumerate(entries):
        home = shared if name == "shared" else base / f"{name}-home-{i}"
        builds.append(build(home, profile, backend, args))
    quantize = [s for b in builds for s in b["stages"] if s["name"] == "quantize"]
    return {"seconds": sum(b["seconds"] for b in builds), "builds": builds,
            "quantize_ran": sum(1 for s in quantize if s["status"] == "ran"),
            "quantize_seconds": sum(s["seconds"] for s in quantize if s["status"] == "ran")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="tiny", help="tiny (shipped), 30m or 150m (made with random weights)")
    ap.add_argument("--models-dir", type=Path, help="keep generated checkpoints here and reuse them")
    ap.add_argument("--profiles", default="latency,balanced,throughput")
    ap.add_argument("--backends", default="checkpoint")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--calib-samples", type=int, default=32)
    ap.add_argument("--eval-max-tokens", type=int, default=2048)
    args = ap.parse_args()
    models = args.models_dir or Path(tempfile.mkdtemp(prefix="kiln-fanout-models-"))
    args.checkpoint, _ = checkpoint_for(args.size, models)
    entries = [(p, b) for b in args.backends.split(",") for p in args.profiles.split(",")]
    print(f"{len(entries)} entries (profiles {args.profiles} × backends {args.backends}), one quantize key", flush=True)
    ratios = []
    for r in range(args.rounds):
        base = Path(tempfile.mkdtemp(prefix="kiln-fanout-"))
        try:
            order = ("shared", "apart") if r % 2 == 0 else ("apart", "shared")
            result = {name: side(name, entries, base, args) for name in order}
        finally:
            shutil.rmtree(base, ignore_errors=True)
        for name in ("shared", "apart"):
            s = result[name]
            print(f"round {r + 1} {name:6s}: {s['seconds']:7.1f} s  quantize ran {s['quantize_ran']} "
                  f"of {len(entries)} ({s['quantize_seconds']:.1f} s)", flush=True)
            for b in s["builds"]:
                stages = ", ".join(f"{x['name']} {x['status']} {x['seconds']:.1f}" for x in b["stages"])
                print(f"    {b['profile']:10s} {b['backend']:12s} {b['seconds']:6.1f} s  [{stages}]")
        ratios.append(result["shared"]["seconds"] / result["apart"]["seconds"])
        print(f"round {r + 1}: shared / apart = {ratios[-1]:.3f}", flush=True)
    if args.models_dir is None:
        shutil.rmtree(models, ignore_errors=True)
    print(json.dumps({"size": args.size, "entries": len(entries), "ratios": [round(x, 3) for x in ratios],
                      "median_ratio": round(statistics.median(ratios), 3)}))


if __name__ == "__main__":
    main()

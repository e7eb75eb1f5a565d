"""Kiln's pipeline on models of growing size against the raw library calls doing the same work: seconds and
peak memory per stage, from the shipped 1.4 M-parameter tiny Llama up to Llama-3.2-1B's shape. Prints ratios.

    python bench/scale_bench.py [--sizes tiny,30m,150m,1b] [--rounds 1] [--out results.json] [--chart chart.svg]

Kiln = ``kiln build`` (``python -m api.cli build … --json``) in a process of its own, on the embedded defaults
(its own ``KILN_HOME`` in a temp dir: SQLite, the local store; no ``KILN_*`` variable inherited), backend
aot-inductor, FP8, target cpu. "raw" = the calls the stages make, called directly on the same inputs in a fresh
process of their own (bench/raw_build.py): ModelOpt ``mtq.quantize`` with the same config and calibration
forward loop, the saved calibration and ``export_hf_checkpoint``; the engine model built from that export by
kiln/hfmodel.py, ``torch.export`` + ``torch._inductor.aoti_compile_and_package``; loading the package and making
the same measurements validation makes (accuracy against the float32 reference, the throughput sweep, TTFT/TPOT
by greedy decoding, peak memory at the corner in a fresh child process). Raw has no resolve or publish: those
are Kiln's own work (checkpoint hashing, keys, the stage cache's tarred copies in the store, gates, the report,
the OCI image and its index row), and so are the layer survey that validate waits for and the SQLite migrations
of a fresh ``KILN_HOME`` (in "startup"). Every process compiles with an empty TorchInductor cache of its own.

Same settings on both sides, small enough for the 1b size on two cores: calibration 8 samples × 64 tokens;
evaluation windows of 96 tokens, ``max_tokens`` 2048; the profile of tests/integration/test_families.py (batch
1, input 96, sequence 128, 128 tokens); accuracy gates as the defaults (random weights may fail them: a failed
gate still runs every stage, publishes the engine as rejected and exits 1, which is accepted here).

Models: ``tiny`` is examples/tiny-llama itself (float32, one file). The others are made here, before anything is
timed, by transformers from Llama configs with Llama-3.2's distinguishing fields (llama3 rope scaling, tied
embeddings, head_dim 64, grouped-query attention) and random weights, saved as sharded bf16 safetensors with
``model.safetensors.index.json``, a generation config and the tiny Llama's tokenizer (vocabulary 2048, as
tests/families.py does): ``30m`` and ``150m`` scaled down, ``1b`` Llama-3.2-1B's shape (16 layers, hidden 2048,
MLP 8192, 32 / 8 heads, vocabulary 128256). The tokenizer only produces ids below 2048, which every vocabulary
here holds; the throughput and latency sweeps draw random ids from the model's whole vocabulary.

Measured per size and stage: seconds (Kiln: the build's own stage records, ``stages[].seconds`` of ``--json``;
raw: ``time.perf_counter`` around each stage in its process; end to end: each process's wall time, imports
included) and peak RSS, sampled from outside at ~20 Hz: the sum of the RSS (``/proc/<pid>/stat``) of the process
and all its descendants (TorchInductor's compile workers, the compiler, the peak-memory probe), each sample
attributed to the stage running at that moment — Kiln's stage boundaries are the stage lines ``kiln build``
prints to stderr as each stage finishes, raw's the marks its process prints as each stage starts. RSS counts
file-backed pages too (an AOTInductor package's mapped ``.so``), and a page shared by several processes counts
in each; a peak shorter than a sampling period can be missed (each main process's exact peak is recorded beside
it: ``ru_maxrss`` from ``wait4`` for Kiln, the largest VmHWM of its steps for raw, whose process resets VmHWM
between steps to record them: bench/raw_build.py).

Targets: end to end ≤ 1.10 × raw at every size; quantize peak memory ≤ 1.5 × the unquantized model in its own
dtype plus calibration activations (one calibration batch's logits and one layer's MLP intermediates), judged
on the stage's growth over the RSS it started from less what the libraries it imports take (ModelOpt and
transformers' model classes: the CLI preloads nothing; measured in raw's process, which imports them first);
validation's cost bounded by ``evaluation.max_tokens`` and the sweep (the same work as raw's, at the same cost).

``--rounds N``: Kiln and raw alternate going first; per stage the medians are printed and each ratio is the
median of the per-round ratios.

``--out`` writes every measurement (the RSS samples included) as JSON; ``--chart`` draws seconds per stage
against parameter count (log-log) for Kiln and raw: SVG written directly, or PNG when matplotlib is importable
(``--from-json results.json --chart chart.svg`` redraws it from an earlier ``--out`` without running anything).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict, deque
from datetime import datetime, timezone
from html import escape
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
TINY = ROOT / "examples" / "tiny-llama"

PRECISION, BACKEND = "fp8", "aot-inductor"
PROFILE = {"max_batch_size": 1, "max_input_len": 96, "max_seq_len": 128, "max_num_tokens": 128}
CALIBRATION = {"samples": 8, "seq_len": 64}
EVALUATION = {"seq_len": 96, "max_tokens": 2048}
SAMPLE_HZ = 20

#: Llama-3.2's distinguishing fields (Llama-3.2-1B's config.json), with the tiny tokenizer's bos/eos ids
LLAMA32 = dict(model_type="llama", tie_word_embeddings=True, head_dim=64, hidden_act="silu", rms_norm_eps=1e-5,
               attention_bias=False, mlp_bias=False, max_position_embeddings=131072, bos_token_id=0, eos_token_id=1,
               rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192, "rope_theta": 500000.0})
#: size → (config fields, max shard size); None: the shipped examples/tiny-llama
SIZES: dict[str, tuple[dict, str] | None] = {
    "tiny": None,
    "30m": ({**LLAMA32, "vocab_size": 32000, "hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 6,
             "num_attention_heads": 8, "num_key_value_heads": 2}, "20MB"),
    "150m": ({**LLAMA32, "vocab_size": 49152, "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 13,
              "num_attention_heads": 12, "num_key_value_heads": 4}, "100MB"),
    "1b": ({**LLAMA32, "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
            "num_attention_heads": 32, "num_key_value_heads": 8}, "500MB"),
}
STAGES = ("quantize", "compile", "validate", "publish")
PHASES = ("startup", "resolve") + STAGES + ("exit",)
DTYPE_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4, "I16": 2,
               "I8": 1, "U8": 1, "BOOL": 1}
DTYPE_NAMES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
MIB = 2**20


# -- models ------------------------------------------------------------------------------------------
def make_checkpoint(size: str, dest: Path) -> None:
    """(child process) Write the ``size`` model with random weights to ``dest``: sharded bf16 safetensors, index,
    generation config, the tiny Llama's tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    fields, shard = SIZES[size]
    fields = dict(fields)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    model.config.architectures = [type(model).__name__]
    staging = dest.with_name(f".{dest.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    model.save_pretrained(staging, max_shard_size=shard)
    GenerationConfig(bos_token_id=0, eos_token_id=1, do_sample=False).save_pretrained(staging)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(TINY / name, staging / name)
    if not (staging / "model.safetensors.index.json").is_file():
        raise SystemExit(f"{size}: the checkpoint came out unsharded")
    staging.rename(dest)


def checkpoint_for(size: str, models_dir: Path) -> tuple[Path, float | None]:
    """The checkpoint of ``size`` and the seconds it took to make (None: shipped, or made by an earlier run)."""
    if SIZES[size] is None:
        return TINY, None
    dest = models_dir / f"scale-llama-{size}"
    if (dest / "config.json").is_file():
        return dest, None
    models_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, __file__, "--make-checkpoint", size, str(dest)], check=True, cwd=ROOT,
                   env=clean_env())
    return dest, time.perf_counter() - t0


def safetensors_header(path: Path) -> dict:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n))


def model_info(ckpt: Path) -> dict:
    """Parameters and bytes from the safetensors headers (tied embeddings are stored once), config fields."""
    index = ckpt / "model.safetensors.index.json"
    files = (sorted({ckpt / n for n in json.loads(index.read_text())["weight_map"].values()}) if index.is_file()
             else sorted(ckpt.glob("*.safetensors")))
    params = nbytes = 0
    by_dtype: dict[str, int] = defaultdict(int)
    for f in files:
        for name, t in safetensors_header(f).items():
            if name == "__metadata__":
                continue
            n = math.prod(t["shape"])
            params += n
            nbytes += n * DTYPE_BYTES[t["dtype"]]
            by_dtype[t["dtype"]] += n
    dtype = max(by_dtype, key=by_dtype.get)
    cfg = json.loads((ckpt / "config.json").read_text())
    keys = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings", "max_position_embeddings")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    return {"path": str(ckpt), "params": params, "dtype": DTYPE_NAMES.get(dtype, dtype),
            "dtype_bytes": DTYPE_BYTES[dtype], "model_bytes": params * DTYPE_BYTES[dtype], "file_bytes": nbytes,
            "shards": len(files), "config": {k: cfg.get(k) for k in keys}, "rope_type": rope.get("rope_type")}


def activation_allowance(info: dict) -> int:
    """The calibration activations the quantize memory target allows for: one calibration batch (8 × seq_len
    tokens)'s logits plus one layer's MLP intermediates (gate, up, their product), in the model's own dtype."""
    c = info["config"]
    return 8 * CALIBRATION["seq_len"] * (c["vocab_size"] + 3 * c["intermediate_size"]) * info["dtype_bytes"]


# -- sampling the process tree -----------------------------------------------------------------------
PAGE = os.sysconf("SC_PAGE_SIZE")


def proc_table() -> dict[int, tuple[int, int]]:
    """pid → (ppid, RSS bytes) for every process, from /proc/<pid>/stat."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue
        rest = data[data.rfind(b")") + 2:].split()  # fields from 3 (state) on; comm may hold spaces
        table[int(name)] = (int(rest[1]), int(rest[21]) * PAGE)
    return table


def tree_rss(root: int) -> tuple[int, int, int]:
    """(RSS of ``root`` and all its descendants, RSS of ``root``, number of processes)."""
    table = proc_table()
    children: dict[int, list[int]] = defaultdict(list)
    for pid, (ppid, _) in table.items():
        children[ppid].append(pid)
    total = count = 0
    stack = [root]
    while stack:
        pid = stack.pop()
        if pid in table:
            total += table[pid][1]
            count += 1
        stack.extend(children.get(pid, ()))
    return total, table.get(root, (0, 0))[1], count


class Sampler(threading.Thread):
    def __init__(self, root: int, t0: float):
        super().__init__(daemon=True)
        self.root, self.t0, self.samples, self.done = root, t0, [], threading.Event()

    def run(self) -> None:
        period, due = 1 / SAMPLE_HZ, time.perf_counter()
        while not self.done.is_set():
            total, main, n = tree_rss(self.root)
            if n:
                self.samples.append((time.perf_counter() - self.t0, total, main, n))
            due = max(due + period, time.perf_counter())  # a fixed rate; a late sample is not made up for
            self.done.wait(due - time.perf_counter())


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without any KILN_* setting (the embedded defaults), quiet transformers, no Hub."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    return {**env, "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1", **extra}


def monitored(cmd: list[str], env: dict[str, str], phase_of) -> dict:
    """Run ``cmd``, sampling its process tree's RSS; ``phase_of(stderr line)`` names the phase that line starts
    (or None). Returns wall time, exit code, stdout, the stderr tail, phase transitions and the samples."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            bufsize=1)
    sampler = Sampler(proc.pid, t0)
    sampler.start()
    transitions = [(0.0, "startup")]
    tail: deque[str] = deque(maxlen=60)
    out: list[str] = []

    def read_err():
        for line in proc.stderr:
            t = time.perf_counter() - t0
            tail.append(line.rstrip("\n"))
            phase = phase_of(line)
            if phase:
                transitions.append((t, phase))

    readers = [threading.Thread(target=read_err, daemon=True),
               threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True)]
    for r in readers:
        r.start()
    _, status, usage = os.wait4(proc.pid, 0)  # the child's own peak RSS (ru_maxrss), which Popen.wait drops
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    for r in readers:
        r.join()
    sampler.done.set()
    sampler.join()
    return {"cmd": cmd, "wall_s": wall, "rc": proc.returncode, "stdout": "".join(out), "stderr_tail": list(tail),
            "transitions": transitions, "samples": sampler.samples, "process_maxrss_bytes": usage.ru_maxrss * 1024}


def phase_stats(run: dict) -> dict[str, dict]:
    """Seconds (between boundaries seen from outside) and RSS per phase: peak of the tree, peak of the main
    process, the tree's RSS at the phase's first sample."""
    out = {}
    trans, samples = run["transitions"], run["samples"]
    for i, (start, name) in enumerate(trans):
        end = trans[i + 1][0] if i + 1 < len(trans) else run["wall_s"]
        inside = [s for s in samples if start <= s[0] <= end]
        nearest = False
        if not inside:  # shorter than a sampling period: the first sample after it started
            after = [s for s in samples if s[0] >= start][:1]
            inside, nearest = after, True
        out[name] = {"seconds": end - start, "samples": len(inside) if not nearest else 0,
                     "peak_tree_bytes": max((s[1] for s in inside), default=None),
                     "peak_main_bytes": max((s[2] for s in inside), default=None),
                     "start_tree_bytes": inside[0][1] if inside else None, "nearest_sample": nearest}
    return out


# -- the two sides -----------------------------------------------------------------------------------
KILN_LINE = re.compile(r"^\s+(resolve|quantize|compile|validate|publish)\s+(ran|cached|skip)\b")
NEXT = {"resolve": "quantize", "quantize": "compile", "compile": "validate", "validate": "publish",
        "publish": "exit"}


def kiln_phase(line: str) -> str | None:
    if line.startswith("building "):  # printed once the spec is parsed and the home opened: resolve starts
        return "resolve"
    m = KILN_LINE.match(line)
    return NEXT[m[1]] if m else None


def kiln_command(ckpt: Path) -> list[str]:
    return [sys.executable, "-m", "api.cli", "build", str(ckpt), "--precision", PRECISION, "--backend", BACKEND,
            "--target", "cpu", "--max-batch-size", str(PROFILE["max_batch_size"]),
            "--max-input-len", str(PROFILE["max_input_len"]), "--max-seq-len", str(PROFILE["max_seq_len"]),
            "--max-num-tokens", str(PROFILE["max_num_tokens"]),
            "--calib-samples", str(CALIBRATION["samples"]), "--calib-seq-len", str(CALIBRATION["seq_len"]),
            "--eval-seq-len", str(EVALUATION["seq_len"]), "--eval-max-tokens", str(EVALUATION["max_tokens"]),
            "--override-reason", "a benchmark build: a short evaluation", "--json"]


def run_kiln(ckpt: Path, d: Path, roots: str) -> dict:
    env = clean_env(KILN_HOME=str(d / "home"), KILN_CHECKPOINT_ROOTS=roots,
                    TORCHINDUCTOR_CACHE_DIR=str(d / "inductor"))
    run = monitored(kiln_command(ckpt), env, kiln_phase)
    lines = run["stdout"].strip().splitlines()
    try:
        outcome = json.loads(lines[-1])
    except (IndexError, ValueError):
        outcome = None
    # 0: passed; 1: a gate failed (every stage ran, the engine is stored as rejected)
    if outcome is None or run["rc"] not in (0, 1) or not outcome.get("digest"):
        raise SystemExit(f"kiln build failed (exit {run['rc']}):\n" + "\n".join(run["stderr_tail"][-30:]))
    m = (outcome.get("validation") or {}).get("metrics") or {}
    run["stages"] = {s["name"]: s["seconds"] for s in outcome["stages"]}
    run["stage_status"] = {s["name"]: s["status"] for s in outcome["stages"]}
    run["validation"] = {"passed": outcome["validation"].get("passed"), "tokens": m.get("tokens"),
                         "perplexity": m.get("perplexity"), "top1_agreement": m.get("top1_agreement"),
                         "sweep_points": len(m.get("throughput") or []), "decode_points": len(m.get("latency") or []),
                         "peak_memory_bytes": m.get("peak_memory_bytes")}
    run["digest"] = outcome["digest"]
    return run


def raw_phase(line: str) -> str | None:
    return line.split(None, 1)[1].strip() if line.startswith("@@stage ") else None


def run_raw(ckpt: Path, d: Path) -> dict:
    job = {"src": str(ckpt), "work": str(d / "work")}
    run = monitored([sys.executable, __file__, "--raw-child", json.dumps(job)],
                    clean_env(TORCHINDUCTOR_CACHE_DIR=str(d / "inductor")), raw_phase)
    if run["rc"] != 0:
        raise SystemExit(f"raw calls failed (exit {run['rc']}):\n" + "\n".join(run["stderr_tail"][-30:]))
    result = json.loads(run["stdout"].strip().splitlines()[-1])
    run["stages"], run["validation"], run["memory"] = result["seconds"], result["validation"], result["memory"]
    return run


def raw_child(job: dict) -> None:
    """(child process) The raw calls; imports torch first, as the kiln CLI does before its first stage."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch  # noqa: F401

    from bench import raw_build
    from kiln.spec import BatchProfile

    def mark(name: str) -> None:
        print(f"@@stage {name}", file=sys.stderr, flush=True)

    work = Path(job["work"])
    work.mkdir(parents=True)
    out = raw_build.run(Path(job["src"]), work, precision=PRECISION, profile=BatchProfile(**PROFILE),
                        calib_samples=CALIBRATION["samples"], calib_seq_len=CALIBRATION["seq_len"],
                        eval_seq_len=EVALUATION["seq_len"], eval_max_tokens=EVALUATION["max_tokens"], mark=mark)
    print(json.dumps(out))


# -- summaries ---------------------------------------------------------------------------------------
def summarize_run(run: dict) -> dict:
    phases = phase_stats(run)
    return {"wall_s": run["wall_s"], "stages": run["stages"], "phases": phases,
            "peak_tree_bytes": max((s[1] for s in run["samples"]), default=None),
            "process_maxrss_bytes": run["process_maxrss_bytes"], "validation": run["validation"]}


def ratio(a, b):
    return a / b if a is not None and b else None


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def stage_seconds(s: dict, name: str):
    """A stage's seconds: the process's own record for the stages, the boundaries seen from outside for
    startup and exit."""
    if name in s["stages"]:
        return s["stages"][name]
    if name in ("startup", "exit") and name in s["phases"]:
        return s["phases"][name]["seconds"]
    return None


def stage_peak(s: dict, name: str):
    p = s["phases"].get(name)
    return p["peak_tree_bytes"] if p else None


def main_peak(s: dict):
    return max((p["peak_main_bytes"] or 0 for p in s["phases"].values()), default=None)


def quantize_memory(s: dict) -> dict:
    p = s["phases"].get("quantize") or {}
    peak, start = p.get("peak_tree_bytes"), p.get("start_tree_bytes")
    return {"peak_bytes": peak, "start_bytes": start,
            "growth_bytes": peak - start if peak is not None and start is not None else None}


def mib(b) -> str:
    return "—" if b is None else f"{b / MIB:,.0f} MiB"


def num(v, fmt="{:.2f}") -> str:
    return "—" if v is None else fmt.format(v)


def human_params(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


def report_size(size: str, info: dict, rounds: list[dict]) -> dict:
    """Print the size's table (medians over rounds; ratios: median of per-round ratios) and return it."""
    rows = {}
    for name in PHASES:
        k = [stage_seconds(r["kiln"], name) for r in rounds]
        w = [stage_seconds(r["raw"], name) for r in rounds]
        rows[name] = {"kiln_s": median(k), "raw_s": median(w),
                      "ratio": median([ratio(a, b) for a, b in zip(k, w)]),
                      "kiln_peak_bytes": median([stage_peak(r["kiln"], name) for r in rounds]),
                      "raw_peak_bytes": median([stage_peak(r["raw"], name) for r in rounds])}
    k = [r["kiln"]["wall_s"] for r in rounds]
    w = [r["raw"]["wall_s"] for r in rounds]
    rows["end to end"] = {"kiln_s": median(k), "raw_s": median(w), "ratio": median([a / b for a, b in zip(k, w)]),
                          "ratios": [a / b for a, b in zip(k, w)],
                          "kiln_peak_bytes": median([r["kiln"]["peak_tree_bytes"] for r in rounds]),
                          "raw_peak_bytes": median([r["raw"]["peak_tree_bytes"] for r in rounds])}
    mb = info["model_bytes"]
    c = info["config"]
    print(f"\n== {size}: {c['model_type']}, {human_params(info['params'])} parameters ({info['params']:,}), "
          f"{info['dtype']}, {info['model_bytes'] / 1e6:,.1f} MB in its own dtype (params × {info['dtype_bytes']} B), "
          f"{info['shards']} safetensors file(s); vocab {c['vocab_size']}, hidden {c['hidden_size']}, "
          f"{c['num_hidden_layers']} layers, rope {info['rope_type']}, tied {c['tie_word_embeddings']}")
    print(f"   {len(rounds)} round(s); first: " + ", ".join(r["order"][0] for r in rounds))
    print(f"   {'stage':<11} {'kiln s':>9} {'raw s':>9} {'ratio':>7} {'kiln peak RSS':>14} {'raw peak RSS':>13}")
    for name, row in rows.items():
        print(f"   {name:<11} {num(row['kiln_s']):>9} {num(row['raw_s']):>9} {num(row['ratio'], '{:.3f}'):>7} "
              f"{mib(row['kiln_peak_bytes']):>14} {mib(row['raw_peak_bytes']):>13}")
    qk = [quantize_memory(r["kiln"]) for r in rounds]
    qr = [quantize_memory(r["raw"]) for r in rounds]
    kq = {key: median([q[key] for q in qk]) for key in qk[0]}
    rq = {key: median([q[key] for q in qr]) for key in qr[0]}
    act = activation_allowance(info)
    limit = 1.5 * mb + act
    print(f"   quantize peak RSS / model bytes: kiln {num(ratio(kq['peak_bytes'], mb))} × "
          f"(growth over the stage's start {mib(kq['growth_bytes'])} = {num(ratio(kq['growth_bytes'], mb))} ×), "
          f"raw {num(ratio(rq['peak_bytes'], mb))} × (growth {mib(rq['growth_bytes'])} = "
          f"{num(ratio(rq['growth_bytes'], mb))} ×)")
    # the stage imports ModelOpt and transformers' model classes itself (the CLI preloads nothing): raw's
    # process measures that growth on its own (RSS after the imports − RSS before the stage), the model's share
    # is the rest
    steps = rounds[-1]["raw"]["record"]["memory_steps"]["steps"]
    imports = steps["quantize.imports"]["rss_after_bytes"] - steps["startup"]["rss_after_bytes"]
    net = kq["growth_bytes"] - imports if kq["growth_bytes"] is not None else None
    met = net is not None and net <= limit
    print(f"   target quantize memory ≤ 1.5 × model + activations ({act / MIB:,.1f} MiB) = {limit / MIB:,.1f} MiB: "
          f"kiln growth {mib(kq['growth_bytes'])} less the libraries the stage imports ({mib(imports)}, measured "
          f"in raw's process) = {mib(net)} = {num(ratio(net, mb))} × model → {'met' if met else 'NOT met'}")
    print("   raw process's own peak per step (VmHWM, last round): " + ", ".join(
        f"{n} {mib(v['peak_bytes'])}" for n, v in steps.items()))
    last = rounds[-1]
    print(f"   each main process's exact peak (last round): kiln {mib(last['kiln']['process_maxrss_bytes'])} "
          f"(ru_maxrss), raw {mib(last['raw']['record']['memory_steps']['process_peak_bytes'])} (largest step "
          f"VmHWM); sampled main-process peaks: kiln {mib(main_peak(last['kiln']))}, raw {mib(main_peak(last['raw']))}")
    kv, rv = rounds[-1]["kiln"]["validation"], rounds[-1]["raw"]["validation"]
    vr = rows["validate"]
    same = (kv["tokens"], kv["sweep_points"], kv["decode_points"]) == (rv["tokens"], rv["sweep_points"], rv["decode_points"])
    print(f"   validation: kiln {num(vr['kiln_s'])} s, raw {num(vr['raw_s'])} s ({num(vr['ratio'], '{:.3f}')} ×); "
          f"tokens evaluated {kv['tokens']} (max_tokens {EVALUATION['max_tokens']}), sweep points {kv['sweep_points']}, "
          f"decode batch sizes {kv['decode_points']}; same work as raw: {'yes' if same else 'NO'}; "
          f"gates {'passed' if kv['passed'] else 'failed (every stage still ran; the engine is stored as rejected)'}")
    e = rows["end to end"]
    print(f"   end to end: kiln {num(e['kiln_s'])} s / raw {num(e['raw_s'])} s = {num(e['ratio'], '{:.4f}')} "
          f"(rounds: {', '.join(f'{x:.4f}' for x in e['ratios'])}; target ≤ 1.10: "
          f"{'met' if e['ratio'] <= 1.10 else 'NOT met'})")
    return {"rows": rows, "quantize_memory": {"kiln": kq, "raw": rq, "model_bytes": mb, "activation_allowance_bytes": act,
                                              "limit_bytes": limit, "import_growth_bytes": imports,
                                              "net_growth_bytes": net, "met": met}}


# -- the chart ---------------------------------------------------------------------------------------
COLORS = {"quantize": "#2b6cb0", "compile": "#c05621", "validate": "#2f855a", "publish": "#6b46c1",
          "end to end": "#1a202c"}


def chart_series(results: dict) -> dict[str, dict[str, list[tuple[int, float]]]]:
    series: dict[str, dict[str, list]] = {n: {"kiln": [], "raw": []} for n in COLORS}
    for size in results["sizes"].values():
        p = size["model"]["params"]
        for name in COLORS:
            row = size["summary"]["rows"][name]
            for side in ("kiln", "raw"):
                v = row[f"{side}_s"]
                if v is not None and v > 0:
                    series[name][side].append((p, v))
    return series


def write_chart(results: dict, path: Path) -> None:
    series = chart_series(results)
    if path.suffix.lower() == ".png":
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 5))
        for name, sides in series.items():
            for side, style in (("kiln", "-o"), ("raw", "--s")):
                if sides[side]:
                    xs, ys = zip(*sides[side])
                    ax.plot(xs, ys, style, color=COLORS[name], label=f"{name} ({side})")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("parameters")
        ax.set_ylabel("seconds")
        ax.set_title("Kiln (solid) vs raw calls (dashed): seconds per stage")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        return
    path.write_text(svg_chart(series, {name: v["model"]["params"] for name, v in results["sizes"].items()}))


def svg_chart(series: dict, sizes: dict[str, int] | None = None) -> str:
    w, h, left, right, top, bottom = 760, 460, 70, 190, 40, 56
    pw, ph = w - left - right, h - top - bottom
    xs = [p for s in series.values() for side in s.values() for p, _ in side]
    ys = [v for s in series.values() for side in s.values() for _, v in side]
    if not xs:
        return f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}"><text x="10" y="20">no data</text></svg>'
    x0, x1 = math.floor(math.log10(min(xs))), math.ceil(math.log10(max(xs)))
    y0, y1 = math.floor(math.log10(min(ys))), math.ceil(math.log10(max(ys)))
    x1, y1 = max(x1, x0 + 1), max(y1, y0 + 1)

    def px(p):
        return left + pw * (math.log10(p) - x0) / (x1 - x0)

    def py(v):
        return top + ph - ph * (math.log10(v) - y0) / (y1 - y0)

    def label_x(e):
        return {6: "1M", 7: "10M", 8: "100M", 9: "1B", 10: "10B"}.get(e, f"1e{e}")

    body = [f'<text x="{left}" y="22" font-weight="bold">Kiln (solid, ●) vs raw calls (dashed, ■): seconds per '
            'stage against parameters</text>']
    for e in range(x0, x1 + 1):
        x = px(10**e)
        body.append(f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{top + ph}" stroke="#e2e8f0"/>')
        body.append(f'<text x="{x:.1f}" y="{top + ph + 16}" text-anchor="middle">{label_x(e)}</text>')
    for e in range(y0, y1 + 1):
        y = py(10**e)
        body.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + pw}" y2="{y:.1f}" stroke="#e2e8f0"/>')
        body.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{10.0**e:g} s</text>')
    for name, p in (sizes or {}).items():  # which size each column of points is
        body.append(f'<text x="{px(p):.1f}" y="{top + ph - 6}" text-anchor="middle" fill="#718096">{escape(name)}</text>')
    body.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#a0aec0"/>')
    body.append(f'<text x="{left + pw / 2}" y="{h - 12}" text-anchor="middle">parameters (log)</text>')
    body.append(f'<text x="16" y="{top + ph / 2}" transform="rotate(-90 16 {top + ph / 2})" '
                'text-anchor="middle">seconds (log)</text>')
    legend_y = top + 8
    for name, sides in series.items():
        color = COLORS[name]
        for side, dash in (("kiln", ""), ("raw", ' stroke-dasharray="6 4"')):
            pts = sorted(sides[side])
            if not pts:
                continue
            coords = " ".join(f"{px(p):.1f},{py(v):.1f}" for p, v in pts)
            body.append(f'<polyline points="{coords}" fill="none" stroke="{color}" stroke-width="2"{dash}/>')
            for p, v in pts:
                tip = f"<title>{escape(name)} {side}: {v:.2f} s at {p:,} parameters</title>"
                if side == "kiln":
                    body.append(f'<circle cx="{px(p):.1f}" cy="{py(v):.1f}" r="4" fill="{color}">{tip}</circle>')
                else:
                    body.append(f'<rect x="{px(p) - 4:.1f}" y="{py(v) - 4:.1f}" width="8" height="8" '
                                f'fill="white" stroke="{color}" stroke-width="2">{tip}</rect>')
        body.append(f'<line x1="{left + pw + 16}" y1="{legend_y}" x2="{left + pw + 40}" y2="{legend_y}" '
                    f'stroke="{color}" stroke-width="3"/>')
        body.append(f'<text x="{left + pw + 46}" y="{legend_y + 4}">{escape(name)}</text>')
        legend_y += 20
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" '
            f'font-family="system-ui, sans-serif" font-size="12"><rect width="{w}" height="{h}" fill="white"/>'
            + "".join(body) + "</svg>")


# -- main --------------------------------------------------------------------------------------------
def meminfo() -> dict[str, int]:
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, v = line.split(":", 1)
            if k in ("MemTotal", "MemAvailable"):
                out[k] = int(v.split()[0]) * 1024
    return out


def compact(run: dict) -> dict:
    """What goes into --out for one process: everything measured, samples rounded."""
    return {**summarize_run(run), "rc": run["rc"], "cmd": run["cmd"],
            "transitions": [[round(t, 3), n] for t, n in run["transitions"]],
            "samples": [[round(t, 3), total, main, n] for t, total, main, n in run["samples"]],
            **({"memory_steps": run["memory"]} if "memory" in run else {}),
            **({"stage_status": run["stage_status"], "digest": run["digest"]} if "digest" in run else {})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default=",".join(SIZES), help="comma-separated: " + ", ".join(SIZES))
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", type=Path, help="write every measurement as JSON")
    ap.add_argument("--chart", type=Path, help="chart of seconds per stage vs parameters (.svg, or .png with matplotlib)")
    ap.add_argument("--workdir", type=Path, help="where the runs' temporary folders go (default: the system's)")
    ap.add_argument("--models-dir", type=Path, help="keep the generated checkpoints here and reuse them")
    ap.add_argument("--from-json", type=Path, help="with --chart: draw the chart of an earlier --out file, run nothing")
    ap.add_argument("--raw-child", help=argparse.SUPPRESS)
    ap.add_argument("--make-checkpoint", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.raw_child:
        raw_child(json.loads(args.raw_child))
        return
    if args.make_checkpoint:
        make_checkpoint(args.make_checkpoint[0], Path(args.make_checkpoint[1]))
        return
    if args.from_json:
        if not args.chart:
            ap.error("--from-json needs --chart")
        write_chart(json.loads(args.from_json.read_text()), args.chart)
        print(f"chart: {args.chart}")
        return
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown or args.rounds < 1:
        ap.error(f"unknown size(s) {unknown}; choose from {', '.join(SIZES)}" if unknown else "--rounds ≥ 1")
    if args.chart and args.chart.suffix.lower() not in (".svg", ".png"):
        ap.error("--chart must end in .svg or .png")
    if args.chart and args.chart.suffix.lower() == ".png":
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            ap.error("a .png chart needs matplotlib, which is not installed; use --chart chart.svg")
    work = Path(tempfile.mkdtemp(prefix="kiln-scale-", dir=args.workdir))
    models_dir = args.models_dir or work / "models"
    roots = os.pathsep.join([str(ROOT), str(models_dir.resolve())])
    results = {"meta": {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "cpus": os.cpu_count(),
                        "load_avg_1m_at_start": round(os.getloadavg()[0], 2), **meminfo(), "precision": PRECISION,
                        "backend": BACKEND, "profile": PROFILE, "calibration": CALIBRATION, "evaluation": EVALUATION,
                        "rounds": args.rounds, "sample_hz": SAMPLE_HZ, "python": sys.executable},
               "sizes": {}}
    print(f"Kiln vs raw calls, {PRECISION} {BACKEND}, profile {PROFILE}, calibration {CALIBRATION}, evaluation "
          f"{EVALUATION}; {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}, "
          f"{meminfo()['MemAvailable'] / 2**30:.1f} GiB available", flush=True)
    try:
        for size in sizes:
            t_size = time.perf_counter()
            ckpt, made_s = checkpoint_for(size, models_dir)
            info = model_info(ckpt)
            if made_s is not None:
                print(f"[{size}] checkpoint made in {made_s:.1f}s (not measured): {ckpt}", flush=True)
            rounds = []
            for r in range(args.rounds):
                order = ("raw", "kiln") if r % 2 == 0 else ("kiln", "raw")  # who goes first alternates
                rec: dict = {"order": order}
                for side in order:
                    d = Path(tempfile.mkdtemp(prefix=f"{size}-{side}-", dir=work))
                    try:
                        run = run_kiln(ckpt, d, roots) if side == "kiln" else run_raw(ckpt, d)
                    finally:
                        shutil.rmtree(d, ignore_errors=True)
                    rec[side] = summarize_run(run) | {"record": compact(run)}
                    print(f"[{size}] round {r + 1} {side}: {run['wall_s']:.1f}s, stages "
                          + ", ".join(f"{n} {v:.2f}" for n, v in run["stages"].items())
                          + f"; peak tree RSS {mib(rec[side]['peak_tree_bytes'])}", flush=True)
                rounds.append(rec)
            summary = report_size(size, info, rounds)
            took = time.perf_counter() - t_size
            print(f"   [{size} took {took:.0f}s in all]", flush=True)
            results["sizes"][size] = {"model": info, "checkpoint_made_s": made_s, "seconds_in_all": took,
                                      "summary": summary,
                                      "rounds": [{"order": r["order"], "kiln": r["kiln"]["record"],
                                                  "raw": r["raw"]["record"]} for r in rounds]}
            if args.out:
                args.out.write_text(json.dumps(results, indent=1, default=str))
    finally:  # the runs' folders (and the generated checkpoints, unless --models-dir keeps them elsewhere)
        shutil.rmtree(work, ignore_errors=True)
    if len(results["sizes"]) > 1:
        print(f"\n{'size':<6} {'params':>8} {'kiln s':>9} {'raw s':>9} {'ratio':>6} {'validate ratio':>14} "
              f"{'quantize peak/model':>19} {'net growth/model':>16}")
        for size, s in results["sizes"].items():
            rows, q = s["summary"]["rows"], s["summary"]["quantize_memory"]
            e = rows["end to end"]
            print(f"{size:<6} {human_params(s['model']['params']):>8} {num(e['kiln_s']):>9} {num(e['raw_s']):>9} "
                  f"{num(e['ratio'], '{:.3f}'):>6} {num(rows['validate']['ratio'], '{:.3f}'):>14} "
                  f"{num(ratio(q['kiln']['peak_bytes'], q['model_bytes'])):>19} "
                  f"{num(ratio(q['net_growth_bytes'], q['model_bytes'])):>16}")
    if args.chart:
        write_chart(results, args.chart)
        print(f"chart: {args.chart}")
    if args.out:
        print(f"measurements: {args.out}")


if __name__ == "__main__":
    main()

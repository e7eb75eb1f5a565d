"""A fine-tune of SmolLM2-135M built on the kernel of its base, against the same fine-tune built cold. Prints the
ratio and checks that both published engines compute the same logits.

    python bench/finetune.py [--rounds 3] [--steps 3] [--service] [--out result.json]

The base is SmolLM2-135M-Instruct (``~/.cache/kiln/real-models/smollm2-135m``, made by
``python scripts/real_models.py smollm2-135m`` when missing). A fine-tune is a real change of its weights with the
same architecture: ``--steps`` steps of Adam (``--lr``, default 1e-4) on causal-LM loss over a slice of Kiln's calibration text
(``kiln:calibration``, 2 × 128-token windows a step, a different slice for each fine-tune), trained in float32 and
saved in the base's dtype (bf16) with ``save_pretrained``; the base's config.json, generation config and tokenizer
files are copied over unchanged. Each round builds a fine-tune of its own, so no build answers another from the
registry; the bench prints the loss before and after and the share of bf16 weights that changed. A fine-tune
must stay within the FP8 recipe's accuracy gates: one that fails them makes the default ``auto`` recipe climb its
ladder to another recipe inside validate, whose kernel is another (2026-12-07: lr 3e-4 took SmolLM2 to +4.6 %
perplexity under ``fp8`` and the build published ``fp8-pcpt``). The bench checks that every published engine runs
on the base's kernel (engine.json's kernel key) and stops, saying so, when one does not.

Each round, in alternating order, through the real ``kiln build`` CLI in a fresh process (``--precision fp8`` and
every other option at its default: the ``latency`` profile, aot-inductor, ``cpu``, calibration 32 × 128,
evaluation up to 16,384 tokens), end-to-end wall clock:

- **cold**: the round's fine-tune in a fresh ``KILN_HOME`` (empty stage cache, database and store): compile must
  say ``ran``;
- **tuned**: the round's fine-tune in the home where the base was built first (that base build is not timed):
  compile must say ``reused`` (the kernel under its kernel key, only the weights written).

Every process compiles with an empty TorchInductor cache of its own (a shared one would hand the cold build the
graph the base compiled). Both engines are pulled from their homes' stores (``kiln pull``) and run on the same
token ids through ``validation.runners.AOTInductorRunner``; the bench exits 1 unless max |Δ logit| is 0.

With ``--service`` the same rounds run again through the service: PostgreSQL (a database of its own per stack),
a ``redis-server`` of its own, ``kiln api`` and one ``kiln worker`` (Celery) per stack, each build submitted with
POST /v1/builds and followed to its end on the event stream. The cold side is a fresh stack per round; the tuned
side one stack whose worker built the base first. Each worker has made one small build of the shipped tiny model
before the measured one (its imports done, as a running worker's are; the tiny kernel is not SmolLM2's).

Target (issue 44): the tuned build ≤ 0.35 × the cold build's time, median over rounds of the ratio within a
round, through ``kiln build`` and through the service; the engines' logits equal.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
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

LR = 1e-4
WINDOW, BATCH = 128, 2
COPIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
          "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja")


def cpu_name() -> str:
    """This CPU by name (/proc/cpuinfo, else lscpu) and the toolchain's ``cpu`` entry (what the kernel is keyed by)."""
    from kiln.toolchain import toolchain_for

    name = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.is_file() else []
    for line in lines:
        if line.startswith("model name"):
            name = line.split(":", 1)[1].strip()
            break
    return f"{name}, {os.cpu_count()} cores (toolchain cpu: {toolchain_for('aot-inductor', 'cpu')['cpu']})"


def base_checkpoint(given: str | None) -> Path:
    if given:
        return Path(given).expanduser().resolve()
    from scripts.real_models import ensure

    return ensure("smollm2-135m")


def finetune(base: Path, out: Path, index: int, steps: int, lr: float = LR) -> dict:
    """A fine-tune of ``base`` into ``out``: ``steps`` Adam steps on slice ``index`` of the calibration text."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kiln.datasets import load_text

    torch.manual_seed(index)
    tok = AutoTokenizer.from_pretrained(base)
    text, _ = load_text("kiln:calibration", field="calibration.dataset", roots=[])
    ids = tok(text, return_tensors="pt")["input_ids"][0]
    need = steps * BATCH * WINDOW
    start = (index * need) % max(1, ids.numel() - need - 1)
    windows = ids[start:start + need].view(steps, BATCH, WINDOW)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    before = {n: p.detach().to(torch.bfloat16).clone() for n, p in model.named_parameters()}
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    losses = []
    for batch in windows:
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(round(loss.item(), 4))
    model.eval()
    with torch.no_grad():
        after_loss = round(model(input_ids=windows[0], labels=windows[0]).loss.item(), 4)
    model = model.to(torch.bfloat16)
    changed = total = 0
    for n, p in model.named_parameters():
        changed += int((p.detach() != before[n]).sum())
        total += p.numel()
    if changed == 0:
        raise SystemExit("the fine-tune changed no bf16 weight: raise --steps")
    out.mkdir(parents=True)
    model.save_pretrained(out)
    for name in COPIED:  # the base's own config (dtype included) and tokenizer, byte for byte
        if (base / name).exists():
            shutil.copy2(base / name, out / name)
    return {"dir": str(out), "losses": losses, "loss_after_on_first_batch": after_loss,
            "changed_bf16_weights": round(changed / total, 4)}


def roots(work: Path) -> str:
    """The checkpoint roots: the repository, the fine-tunes' folder and the base's."""
    return os.pathsep.join(str(p) for p in (ROOT, work, BASE_ROOT, TUNES_ROOT))


BASE_ROOT = TUNES_ROOT = ROOT  # set by main()


def env_for(work: Path, home: Path) -> dict[str, str]:
    """A fresh TorchInductor cache for each process; the home's own database, store and stage cache."""
    return {**os.environ, "KILN_HOME": str(home), "KILN_CHECKPOINT_ROOTS": roots(work),
            "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="inductor-", dir=work),
            "PYTHONPATH": str(ROOT), "TRANSFORMERS_VERBOSITY": "error"}


def kiln(work: Path, home: Path, *args: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "api.cli", *args, "--json"], cwd=ROOT, env=env_for(work, home),
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"kiln {' '.join(args)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def cli_build(work: Path, home: Path, ckpt: Path) -> dict:
    """``kiln build CKPT --precision fp8 --json`` in a fresh process: wall seconds, stage statuses and seconds."""
    t0 = time.perf_counter()
    out = kiln(work, home, "build", str(ckpt), "--precision", "fp8")
    wall = time.perf_counter() - t0
    if out["status"] != "succeeded":
        raise SystemExit(f"the build of {ckpt.name} in {home} did not succeed: {json.dumps(out)[:2000]}")
    return {"wall": wall, "digest": out["digest"], "stages": {s["name"]: (s["status"], s["seconds"]) for s in out["stages"]}}


def kernel_key_of(engine: Path) -> str:
    return json.loads((engine / "engine.json").read_text())["kernel"]["key"]


def expect_kernel(engine: Path, kernel: str, what: str) -> None:
    """The published engine runs on ``kernel``: a ladder that climbed to another recipe in validate built another."""
    got = kernel_key_of(engine)
    if got != kernel:
        meta = json.loads((engine / "engine.json").read_text())
        raise SystemExit(f"{what}: the published engine runs on kernel {got}, not the base's {kernel} (its quant_algo "
                         f"{meta.get('quant_algo')}): the auto recipe climbed its ladder, the fine-tune failed the FP8 "
                         "recipe's gates; make a gentler fine-tune (--lr, --steps)")


def expect_compile(build: dict, status: str, what: str) -> None:
    got = build["stages"]["compile"][0]
    if got != status:
        raise SystemExit(f"{what}: compile said {got!r}, expected {status!r} (stages {build['stages']})")


def compare_logits(a: Path, b: Path, vocab_ids: int) -> dict:
    """The two engines on the same token ids: max |Δ logit| over every position and token."""
    import torch

    from validation.runners import AOTInductorRunner

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_ids, (1, 64), generator=g)
    la = AOTInductorRunner(a).logits(ids)
    lb = AOTInductorRunner(b).logits(ids)
    same_weights = (a / "weights.safetensors").read_bytes() == (b / "weights.safetensors").read_bytes()
    same_kernel = (a / "model.pt2").read_bytes() == (b / "model.pt2").read_bytes()
    return {"max_abs_delta": float((la - lb).abs().max()), "equal": bool(torch.equal(la, lb)),
            "same_weights_file": same_weights, "same_kernel_file": same_kernel, "tokens": ids.numel()}


# -- the service ---------------------------------------------------------------------------------------------------
class ServiceStack:
    """PostgreSQL database, redis-server, ``kiln api`` and one ``kiln worker`` of its own (scripts/devstack.py)."""

    def __init__(self, work: Path, name: str, redis):
        from contextlib import ExitStack

        from scripts.devstack import Stack, postgres_database

        self._exit = ExitStack()
        db_url = self._exit.enter_context(postgres_database())
        root = work / name
        root.mkdir()
        self.stack = Stack(root / "kiln", {"KILN_DATABASE_URL": db_url, "KILN_BROKER_URL": redis.database(),
                                           "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="inductor-", dir=work),
                                           "KILN_CHECKPOINT_ROOTS": roots(work)})
        self.stack.env["KILN_CHECKPOINT_ROOTS"] = roots(work)
        up = self.stack.kiln("db", "upgrade")
        if up.returncode != 0:
            raise SystemExit(f"kiln db upgrade: {up.stderr[-2000:]}")
        self.stack.start_api()
        self.stack.start_worker("w")
        # a first, small build: the worker's imports done (the tiny model's kernel is not SmolLM2's)
        warm = self.build(ROOT / "examples" / "tiny-llama")
        if warm["status"] != "succeeded":
            raise SystemExit(f"the warm-up build failed: {warm}")

    def build(self, ckpt: Path) -> dict:
        import httpx

        s = self.stack
        t0 = time.perf_counter()
        r = s.post("/v1/builds", {"checkpoint": str(ckpt), "precision": "fp8"})
        if r.status_code >= 300:
            raise SystemExit(f"POST /v1/builds {r.status_code}: {r.text[:2000]}")
        b = r.json()
        with httpx.stream("GET", f"{s.url}/v1/builds/{b['id']}/events", timeout=httpx.Timeout(10, read=None)) as ev:
            for line in ev.iter_lines():
                if line.startswith("event: end"):
                    break
        wall = time.perf_counter() - t0
        done = s.get(f"/v1/builds/{b['id']}").json()
        art = done.get("artifact") or {}
        return {"wall": wall, "status": done["status"], "digest": art.get("digest") or done.get("digest"),
                "stages": {st["name"]: (st["status"], st["seconds"]) for st in done.get("stages", [])}}

    def pull(self, digest: str, dest: Path) -> Path:
        p = self.stack.kiln("pull", digest, str(dest), "--server", self.stack.url)
        if p.returncode != 0:
            raise SystemExit(f"kiln pull --server {digest}: {p.stdout[-1000:]} {p.stderr[-2000:]}")
        return dest

    def close(self) -> None:
        try:
            self.stack.close()
        finally:
            self._exit.close()


# -- the rounds ----------------------------------------------------------------------------------------------------
def summarize(label: str, rounds: list[dict]) -> dict:
    stages = sorted({n for r in rounds for side in ("cold", "tuned") for n in r[side]["stages"]},
                    key=["resolve", "quantize", "compile", "validate", "publish"].index)
    med = {side: {"wall": statistics.median(r[side]["wall"] for r in rounds),
                  **{n: statistics.median(r[side]["stages"][n][1] for r in rounds) for n in stages}}
           for side in ("cold", "tuned")}
    for side in ("cold", "tuned"):  # process start, imports, spec and keys: what no stage counts
        med[side]["outside stages"] = statistics.median(
            r[side]["wall"] - sum(v[1] for v in r[side]["stages"].values()) for r in rounds)
    ratios = [r["tuned"]["wall"] / r["cold"]["wall"] for r in rounds]
    out = {"rounds": rounds, "medians": med, "ratios": ratios, "ratio": statistics.median(ratios)}
    print(f"{label}: medians over {len(rounds)} rounds (seconds)")
    print(f"  {'':16} {'cold':>9} {'tuned':>9}")
    for n in ["wall", *stages, "outside stages"]:
        print(f"  {n:16} {med['cold'][n]:9.1f} {med['tuned'][n]:9.1f}")
    print(f"  ratio tuned / cold: median {out['ratio']:.3f} (rounds: {', '.join(f'{x:.3f}' for x in ratios)}); "
          f"target ≤ 0.35: {'met' if out['ratio'] <= 0.35 else 'MISSED'}")
    return out


def check_logits(label: str, rounds: list[dict], vocab: int) -> list[dict]:
    checks = []
    for i, r in enumerate(rounds, 1):
        c = compare_logits(Path(r["cold"]["engine"]), Path(r["tuned"]["engine"]), vocab)
        checks.append(c)
        print(f"{label} round {i}: logits of the tuned engine against the cold one: max |Δ| {c['max_abs_delta']:.3g} "
              f"over {c['tokens']} positions (equal: {c['equal']}; same weights file: {c['same_weights_file']}, "
              f"same kernel file: {c['same_kernel_file']})")
    return checks


def cli_rounds(work: Path, base: Path, tunes: list[Path]) -> dict:
    warm_home = work / "home-tuned"
    t0 = time.perf_counter()
    b = cli_build(work, warm_home, base)
    expect_compile(b, "ran", "the base build")
    base_kernel = kernel_key_of(Path(kiln(work, warm_home, "pull", b["digest"], str(work / "pulled-base"))["dest"]))
    print(f"base build (not timed in the ratio): {time.perf_counter() - t0:.1f}s, stages {b['stages']}", flush=True)
    rounds = []
    for i, tune in enumerate(tunes, 1):
        cold_home = work / f"home-cold-{i}"

        def cold():
            return cli_build(work, cold_home, tune)

        def tuned():
            return cli_build(work, warm_home, tune)

        if i % 2:
            c, t = cold(), tuned()
        else:
            t, c = tuned(), cold()
        expect_compile(c, "ran", f"round {i} cold")
        expect_compile(t, "reused", f"round {i} tuned")
        for side, home, res in (("cold", cold_home, c), ("tuned", warm_home, t)):
            dest = work / f"pulled-{side}-{i}"
            kiln(work, home, "pull", res["digest"], str(dest))
            res["engine"] = str(dest)
            expect_kernel(dest, base_kernel, f"round {i} {side}")
        rounds.append({"cold": c, "tuned": t})
        print(f"round {i} ({'cold first' if i % 2 else 'tuned first'}): cold {c['wall']:.1f}s {c['stages']}; "
              f"tuned {t['wall']:.1f}s {t['stages']}; ratio {t['wall'] / c['wall']:.3f}", flush=True)
    return {"base": b, **summarize("kiln build (CLI)", rounds)}


def service_rounds(work: Path, base: Path, tunes: list[Path]) -> dict:
    from scripts.devstack import RedisServer

    redis = RedisServer(work / "redis.log")
    warm = None
    try:
        warm = ServiceStack(work, "svc-tuned", redis)
        t0 = time.perf_counter()
        b = warm.build(base)
        if b["status"] != "succeeded":
            raise SystemExit(f"the service's base build: {b}")
        expect_compile(b, "ran", "the service's base build")
        base_kernel = kernel_key_of(warm.pull(b["digest"], work / "svc-pulled-base"))
        print(f"service base build (not timed in the ratio): {time.perf_counter() - t0:.1f}s, stages {b['stages']}",
              flush=True)
        rounds = []
        for i, tune in enumerate(tunes, 1):
            cold_stack = ServiceStack(work, f"svc-cold-{i}", redis)
            try:
                order = [("cold", cold_stack), ("tuned", warm)] if i % 2 else [("tuned", warm), ("cold", cold_stack)]
                res = {}
                for side, stack in order:
                    res[side] = stack.build(tune)
                    if res[side]["status"] != "succeeded":
                        raise SystemExit(f"service round {i} {side}: {res[side]}")
                    res[side]["engine"] = str(stack.pull(res[side]["digest"], work / f"svc-pulled-{side}-{i}"))
                    expect_kernel(Path(res[side]["engine"]), base_kernel, f"service round {i} {side}")
            finally:
                cold_stack.close()
            expect_compile(res["cold"], "ran", f"service round {i} cold")
            expect_compile(res["tuned"], "reused", f"service round {i} tuned")
            rounds.append(res)
            print(f"service round {i}: cold {res['cold']['wall']:.1f}s {res['cold']['stages']}; tuned "
                  f"{res['tuned']['wall']:.1f}s {res['tuned']['stages']}; ratio "
                  f"{res['tuned']['wall'] / res['cold']['wall']:.3f}", flush=True)
        return {"base": b, **summarize("through the service (API + Celery worker)", rounds)}
    finally:
        if warm is not None:
            warm.close()
        redis.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", help="the base checkpoint (default: SmolLM2-135M from scripts/real_models.py)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps per fine-tune")
    ap.add_argument("--lr", type=float, default=LR, help="the fine-tune's Adam learning rate")
    ap.add_argument("--service", action="store_true", help="also through the service (API + Celery worker)")
    ap.add_argument("--service-rounds", type=int, help="rounds through the service (default: --rounds)")
    ap.add_argument("--no-cli", action="store_true", help="only the service's rounds")
    ap.add_argument("--out", type=Path, help="write the result as JSON here")
    ap.add_argument("--tunes", type=Path, help="keep the fine-tunes in this folder and reuse those already there "
                    "(default: made afresh in the run's temporary folder)")
    args = ap.parse_args()
    global BASE_ROOT, TUNES_ROOT
    base = base_checkpoint(args.checkpoint)
    BASE_ROOT = base.parent
    vocab = int(json.loads((base / "config.json").read_text())["vocab_size"])
    print(f"cpu: {cpu_name()}; base {base}", flush=True)
    result: dict = {"cpu": cpu_name(), "base": str(base), "steps": args.steps, "lr": args.lr}
    failed = False
    with tempfile.TemporaryDirectory(prefix="kiln-ftbench-") as d:
        work = Path(d)
        n = max(args.rounds, args.service_rounds or 0) if args.service else args.rounds
        tunes, where = [], (args.tunes.resolve() if args.tunes else work)
        where.mkdir(parents=True, exist_ok=True)
        TUNES_ROOT = where
        for i in range(1, n + 1):
            t0 = time.perf_counter()
            made = where / f"{base.name}-ft{i}-{args.steps}steps-lr{args.lr:g}"
            saved = where / f"{made.name}.json"
            if saved.is_file():
                info = json.loads(saved.read_text())
            else:
                shutil.rmtree(made, ignore_errors=True)  # a half-made one
                info = finetune(base, made, i, args.steps, args.lr)
                saved.write_text(json.dumps(info))
            tunes.append(Path(info["dir"]))
            result.setdefault("finetunes", []).append(info)
            print(f"fine-tune {i}: {args.steps} Adam steps in {time.perf_counter() - t0:.1f}s, loss {info['losses']} "
                  f"→ {info['loss_after_on_first_batch']} on the first batch; {info['changed_bf16_weights']:.1%} of "
                  "the bf16 weights changed", flush=True)
        sides = []
        if not args.no_cli:
            result["cli"] = cli_rounds(work, base, tunes[:args.rounds])
            sides.append(("cli", "kiln build"))
        if args.service:
            result["service"] = service_rounds(work, base, tunes[:args.service_rounds or args.rounds])
            sides.append(("service", "service"))
        for key, label in sides:
            checks = check_logits(label, result[key]["rounds"], vocab)
            result[key]["logits"] = checks
            failed |= not all(c["equal"] for c in checks)
            for r in result[key]["rounds"]:
                for side in ("cold", "tuned"):
                    r[side].pop("engine", None)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: result[k]["ratio"] for k in ("cli", "service") if k in result}))
    if failed:
        raise SystemExit("FAILED: an engine built on the reused kernel computes other logits than the cold build")


if __name__ == "__main__":
    main()

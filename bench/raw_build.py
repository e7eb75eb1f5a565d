"""The raw library calls a Kiln build's stages make, made directly on the same inputs: the baseline of
bench/build_overhead.py and bench/scale_bench.py. Each function mirrors one stage and makes the same calls it
makes (read from builder/quantize.py, builder/backends/aot_inductor.py, builder/pipeline.py and
validation/validate.py), with none of Kiln's own work around them: no spec or keys, no checkpoint or dataset
hashing, no stage cache (outputs are written straight into the work folder, never tarred into a store), no
gates, report, layer survey or publish.

- quantize: ``AutoModelForCausalLM.from_pretrained(src, dtype="auto")`` (the checkpoint's own dtype), the
  calibration text tokenized into ``samples × seq_len`` ids, ``mtq.quantize`` with a copy of the precision's
  ModelOpt config (the one its own recipe names in kiln/recipes.py) and a forward loop over batches of 8, the calibration saved (``mto.modelopt_state`` and the
  quantizers' buffers: ``calibration/calibration.pt``), ``export_hf_checkpoint`` into ``hf/`` (in place, no
  copy of the model), the tokenizer saved beside it. Only the unified HF checkpoint: the stage exports nothing
  else.
- compile: the engine model from ``hf/`` by ``kiln.hfmodel.load_engine_model(dtype=…, for_export=True)``
  (transformers' own model of the family in the backend's compute dtype, ``compute_dtype``: for the cpu target
  bf16 for a bf16 checkpoint on native bf16 units, else float32; weights dequantized, activation quantization
  emulated) wrapped in
  ``LogitsOnly``; ``torch.export.export(strict=False)`` with the profile's limits as dynamic shapes;
  ``torch._inductor.aoti_compile_and_package``.
- validate: ``AOTInductorRunner`` over the package and ``TransformersRunner`` over the source checkpoint
  (float32), then ``accuracy``, ``throughput``, ``decode_latency`` and ``peak_memory`` (in a fresh child
  process) from validation/measure.py, with the vocabulary from the source's config.json.

``mark(name)`` is called as each stage starts (and with ``"exit"`` after the last), so a caller can attribute
what it samples from outside to stages. Each stage also records this process's own memory around its steps
(``/proc/self/status`` VmRSS and VmHWM, the peak reset through ``/proc/self/clear_refs`` before each step), so the
process's overall peak is the largest of those step peaks (``getrusage`` no longer sees it after a reset).
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import shutil
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "kiln" / "data"
#: what the aot-inductor backend copies from hf/ next to model.pt2
ENGINE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                "config.json", "hf_quant_config.json", "generation_config.json")


def read_text(name: str) -> str:
    """A built-in text as ``kiln.datasets.load_text`` reads it (UTF-8, undecodable bytes replaced)."""
    return (DATA / name).read_bytes().decode("utf-8", errors="replace")


class Memory:
    """This process's resident set around named steps: ``step(name)`` records the peak since the previous
    step (VmHWM) and the RSS now, then resets the peak."""

    def __init__(self):
        self.steps: dict[str, dict[str, int]] = {}
        self.times: dict[str, float] = {}  # perf_counter() at each step
        self.reset_ok = True
        self.step("startup")  # the interpreter and the imports before the first stage

    @staticmethod
    def status() -> dict[str, int]:
        from validation.measure import _proc_status

        return _proc_status()

    @staticmethod
    def _reset() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return True
        except OSError:
            return False

    def step(self, name: str) -> None:
        s = self.status()
        self.steps[name] = {"peak_bytes": s["VmHWM"], "rss_after_bytes": s["VmRSS"]}
        self.times[name] = time.perf_counter()
        self.reset_ok = self._reset() and self.reset_ok

    def peak(self) -> int:
        return max((s["peak_bytes"] for s in self.steps.values()), default=0)


def quantize(src: Path, out: Path, *, precision: str, samples: int, seq_len: int, mem: Memory) -> None:
    import torch
    import modelopt.torch.opt as mto
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoModelForCausalLM, AutoTokenizer

    mem.step("quantize.imports")
    tok = AutoTokenizer.from_pretrained(src)
    model = AutoModelForCausalLM.from_pretrained(src, dtype="auto").eval()
    mem.step("quantize.load")
    ids = tok(read_text("calibration.txt"), return_tensors="pt", add_special_tokens=False)["input_ids"][0]
    batches = ids[: samples * seq_len].view(samples, seq_len)
    from kiln.recipes import RECIPES  # which ModelOpt config: the precision's own recipe (FP8_DEFAULT_CFG, …)

    cfg = copy.deepcopy(getattr(mtq, RECIPES[precision].modelopt_config))

    def forward_loop(m):
        with torch.no_grad():
            for i in range(0, len(batches), 8):
                m(batches[i : i + 8])

    with contextlib.redirect_stdout(io.StringIO()):  # ModelOpt prints progress
        model = mtq.quantize(model, cfg, forward_loop)
        mem.step("quantize.calibrate")
        (out / "calibration").mkdir(parents=True)
        quantizers = {k: v.detach().cpu() for k, v in model.state_dict().items() if "_quantizer." in k}
        torch.save({"modelopt_state": mto.modelopt_state(model), "quantizers": quantizers},
                   out / "calibration" / "calibration.pt")
        export_hf_checkpoint(model, export_dir=out / "hf")
    del model
    tok.save_pretrained(out / "hf")
    mem.step("quantize.export")


def compile(hf: Path, engine_dir: Path, profile, *, mem: Memory) -> None:  # noqa: A001 (the stage's name)
    import torch
    from torch.export import Dim

    from builder.backends.aot_inductor import compute_dtype, release_export_graph
    from kiln.hfmodel import LogitsOnly, load_engine_model

    # the stage's choice of compute dtype (float32 for the cpu target), then the same call
    dtype = compute_dtype("cpu", json.loads((hf / "config.json").read_text()))
    built = load_engine_model(hf, dtype=dtype, for_export=True, device="cpu")
    model = LogitsOnly(built.model).eval()
    mem.step("compile.engine_model")
    b = profile.max_batch_size
    batch = Dim("batch", min=1, max=b) if b > 1 else Dim.STATIC
    seq = Dim("seq", min=1, max=profile.max_seq_len)
    with torch.no_grad():
        exported = torch.export.export(model, (torch.zeros((2 if b > 1 else 1, 8), dtype=torch.long),),
                                       dynamic_shapes={"input_ids": {0: batch, 1: seq}}, strict=False)
        mem.step("compile.export")
        engine_dir.mkdir(parents=True)
        torch._inductor.aoti_compile_and_package(exported, package_path=str(engine_dir / "model.pt2"))
    # torch keeps the last export trace (with the model's float32 weights) alive until the next export; the stage
    # lets go of it, and so does raw, so that both carry the same memory into validation (at 1b that copy is
    # ~4.6 GiB of 23.5 GiB). Clearing a dict costs no time.
    release_export_graph()
    for name in ENGINE_FILES:
        if (hf / name).exists():
            shutil.copy2(hf / name, engine_dir / name)
    (engine_dir / "engine.json").write_text(json.dumps({"device": "cpu"}))
    mem.step("compile.aoti")


def validate(src: Path, engine_dir: Path, profile, *, seq_len: int, max_tokens: int, mem: Memory) -> dict:
    from transformers import AutoTokenizer

    from validation.measure import accuracy, decode_latency, peak_memory, throughput
    from validation.runners import AOTInductorRunner, TransformersRunner

    vocab = int(json.loads((src / "config.json").read_text())["vocab_size"])
    engine, reference = AOTInductorRunner(engine_dir), TransformersRunner(src)
    mem.step("validate.load")
    ids = AutoTokenizer.from_pretrained(src)(read_text("heldout.txt"), return_tensors="pt",
                                             add_special_tokens=False)["input_ids"][0][: max_tokens + 1]
    acc = accuracy(engine, reference, ids, min(seq_len, profile.max_seq_len), min(profile.max_batch_size, 16))
    mem.step("validate.accuracy")
    points = throughput(engine, profile, vocab)
    latency = decode_latency(engine, profile, vocab)
    mem.step("validate.speed")
    memory = peak_memory(engine, profile, vocab, source=("aot-inductor", engine_dir))
    mem.step("validate.peak_memory")
    return {"tokens": acc["tokens"], "perplexity": acc["perplexity"], "top1_agreement": acc["top1_agreement"],
            "sweep_points": len(points), "decode_points": len(latency["points"]),
            "peak_memory_bytes": memory["peak_memory_bytes"]}


def run(src: Path, work: Path, *, precision: str, profile, calib_samples: int, calib_seq_len: int,
        eval_seq_len: int, eval_max_tokens: int, do_quantize: bool = True, mark=lambda name: None) -> dict:
    """The stages in order, in this process; with ``do_quantize`` false, compile and validate from ``work/hf``
    made by an earlier run. Returns seconds per stage, the memory steps and what validation measured."""
    mem = Memory()
    seconds: dict[str, float] = {}
    out: dict = {"seconds": seconds}
    if do_quantize:
        mark("quantize")
        t0 = time.perf_counter()
        quantize(src, work, precision=precision, samples=calib_samples, seq_len=calib_seq_len, mem=mem)
        seconds["quantize"] = time.perf_counter() - t0
        # the libraries' imports, inside the quantize seconds (a running worker has them done)
        out["quantize_import_seconds"] = mem.times["quantize.imports"] - t0
    engine_dir = work / f"engine-{getattr(profile, 'name', 'custom')}"
    mark("compile")
    t0 = time.perf_counter()
    compile(work / "hf", engine_dir, profile, mem=mem)
    seconds["compile"] = time.perf_counter() - t0
    mark("validate")
    t0 = time.perf_counter()
    out["validation"] = validate(src, engine_dir, profile, seq_len=eval_seq_len, max_tokens=eval_max_tokens, mem=mem)
    seconds["validate"] = time.perf_counter() - t0
    mark("exit")
    out["memory"] = {"steps": mem.steps, "process_peak_bytes": mem.peak(), "hwm_reset": mem.reset_ok}
    return out

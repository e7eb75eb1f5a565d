"""Stage 4, validate: measure the artifact as a deployer loads it and decide with gates.

The report (``validate``'s return value) holds ``passed``, ``metrics`` (accuracy, throughput, TTFT/TPOT, peak
memory), ``gates`` (one verdict per judged gate), ``regression`` (the comparison with the previous validated
engine of the same target) and ``conditions`` (what produced each figure)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from kiln import units
from kiln.errors import SpecError, ValidationFailed
from kiln.kvcache import DEFAULT_KV_CACHE
from kiln.spec import BuildSpec
from validation.accuracy import GATE_METRIC, accuracy_at_lengths, window_batch
from validation.gates import MEMORY_GATE, TASK_GATE, evaluate, judged_gates, regression
from validation.measure import (conditions, cpu_wait, decode_latency, peak_memory, throughput,
                                throughput_point)
from validation import stats
from validation.runners import Runner
from validation.text import Convention, convention_of, load_tokenizer, stream, window_count
from validation.taskfile import TaskPolicy

ACCURACY_GATES = (*GATE_METRIC, TASK_GATE)
PREVIOUS_STATUSES = ("fresh", "stale")  # validated and not withdrawn (stale: built from an older checkpoint head)
RECHECK_REPS = 9
#: evaluation fields two engines may differ in and still be compared (the data enters through its digests)
UNCOMPARED = ("dataset", "tasks", "sequential")


@dataclass
class EvalText:
    """The held-out text as the checkpoint's tokenizer gives it (validation/text.py) and the window lengths it is
    evaluated at."""

    ids: torch.Tensor  # the text's tokens, without the tokenizer's special tokens
    convention: Convention
    lengths: list[int]  # window lengths: the evaluation's own, then the profile's max_seq_len where longer
    text: dict  # the convention as the report records it

    @property
    def seq(self) -> int:
        return self.lengths[0]


#: a longer window length is evaluated on at least this many windows (fewer: the text is too short for it)
MIN_LONG_WINDOWS = 2


def eval_lengths(spec: BuildSpec) -> list[int]:
    """The evaluation's window length and, where longer, the profile's ``max_seq_len``: the positions the engine
    will serve, past a sliding window shorter than that."""
    longest = spec.batch_profile.max_seq_len
    short = min(spec.evaluation.seq_len, longest)
    return [short] + ([longest] if longest > short else [])


def eval_tokens(tokenizer_dir: Path, text: str, spec: BuildSpec, tokenizer=None) -> EvalText:
    tokenizer = tokenizer or load_tokenizer(tokenizer_dir)
    convention = convention_of(tokenizer)
    ids = stream(tokenizer, text)[: spec.evaluation.max_tokens + 1]
    lengths = eval_lengths(spec)
    need = {seq: (1 if seq == lengths[0] else MIN_LONG_WINDOWS) for seq in lengths}
    for seq, windows in need.items():
        if window_count(len(ids), seq, convention) < windows:
            have = f"{len(ids)} tokens (evaluation.max_tokens {spec.evaluation.max_tokens})"
            raise SpecError(f"the evaluation text has {have}: {windows} window(s) of {seq} tokens need "
                            f"{windows * seq + 1}", field="evaluation.dataset",
                            fix="give a longer held-out text or raise evaluation.max_tokens, or a profile with a "
                                "shorter max_seq_len")
    return EvalText(ids, convention, lengths, convention.as_dict(tokenizer))


def sliding_window(checkpoint_dir: Path) -> int | None:
    """The checkpoint's sliding attention window (config.json), where its layers have one."""
    import json

    try:
        config = json.loads((Path(checkpoint_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    window = config.get("sliding_window") if config.get("use_sliding_window", True) is not False else None
    return int(window) if isinstance(window, int) and window > 0 else None


def eval_batch(spec: BuildSpec) -> int:
    """Windows per forward in the accuracy pass: the profile's batch, at most 16."""
    return min(spec.batch_profile.max_batch_size, 16)


def task_limits(spec: BuildSpec) -> tuple[int, int]:
    """(batch, longest request) a task is run at: what the engine's profile accepts — a request is a prompt, so at
    most ``max_input_len`` tokens, leaving one of ``max_seq_len`` to generate (a TensorRT-LLM engine needs it)."""
    profile = spec.batch_profile
    return eval_batch(spec), min(profile.max_input_len, profile.max_seq_len - 1)


def task_accuracy(engine, reference, tokenizer_dir: Path, spec: BuildSpec, tasks: dict[str, Path],
                  threshold: float | None = None, policy: TaskPolicy | None = None) -> list[dict]:
    """Each task's accuracy for engine and reference, paired item by item (validation/stats.py), with every
    item's outcome. ``reference``: a validation.reference.Reference holding the reference's outcomes (of every
    item). With the task gate's ``threshold`` (and ``evaluation.sequential``) the engine's items are evaluated as the
    windows are: in a fixed random order, looking at the planned points at Pocock's confidence, and stopping at the
    first look where the gate is decided; ``evaluated`` of ``total`` items says how far it went. ``policy``: where
    task files may lie and which may run code (validation/taskfile.py; the settings' unless given)."""
    from validation.accuracy import plan_looks
    from validation.tasks import evaluate_task

    batch, max_len = task_limits(spec)
    out = []
    for digest, path in tasks.items():
        ref = reference.tasks[digest]
        total = len(ref["items"])
        order = stats.fixed_order(total)
        planned = plan_looks(total, batch) if threshold is not None and spec.evaluation.sequential else [total]
        confidence = stats.look_confidence(planned)
        theirs = {item["id"]: item["correct"] for item in ref["items"]}
        engine_ok: dict[str, bool] = {}
        done, decision = 0, None
        for look in planned:
            mine = evaluate_task(engine, tokenizer_dir, Path(path), max_batch=batch, max_len=max_len,
                                 items=None if look == total and done == 0 else order[done:look], policy=policy)
            engine_ok.update({item["id"]: item["correct"] for item in mine["items"]})
            done = look
            if any(i not in theirs for i in engine_ok) or len(engine_ok) != done:
                raise ValueError(f"task {mine['task']}: the engine's and the reference's items do not pair")
            ids = [ref["items"][k]["id"] for k in sorted(order[:done])]
            paired = stats.paired_accuracy([engine_ok[i] for i in ids], [theirs[i] for i in ids], confidence)
            if threshold is not None:
                decision = stats.decide(TASK_GATE, paired["interval"], paired["drop_pts"], threshold)
                if decision != stats.UNDECIDED:
                    break
        out.append({"task": mine["task"], "digest": digest, "metric": mine.get("metric", "acc"),
                    "evaluated": done, "total": total,
                    "sequential": {"looks": planned, "confidence": confidence, "stopped_at": done,
                                   "decision": decision, "skipped": total - done},
                    "items": paired["items"], "engine_accuracy": paired["engine_accuracy"],
                    "reference_accuracy": paired["reference_accuracy"], "drop_pts": paired["drop_pts"],
                    "interval": paired["interval"].as_dict(), "mde_pts": paired["mde_pts"],
                    "unpaired_items_needed": paired["unpaired_items_needed"],
                    "engine_only_correct": paired["engine_only_correct"],
                    "reference_only_correct": paired["reference_only_correct"],
                    "outcomes": [{"id": i, "engine": bool(engine_ok[i]), "reference": bool(theirs[i])} for i in ids]})
    return out


def runtime_condition(engine: Runner, spec: BuildSpec) -> dict[str, str]:
    """What computed the report's numbers, and — for a build that names its serving runtime — whether that runtime
    was the one: a report never lets a number from Kiln's own runner pass for the serving runtime's."""
    out = {"computed_by": getattr(engine, "runtime", type(engine).__name__)}
    if runtime := getattr(spec, "runtime", None):
        out["serves_on"] = runtime
        if not out["computed_by"].startswith(runtime):
            out["note"] = (f"{runtime} did not compute these numbers: this worker validated the checkpoint "
                           "with Kiln's own runner; what the runtime does with the recipe on the target is "
                           "kiln/runtimes.py's (kiln models)")
    return out


def validate(engine: Runner, reference, tokenizer_dir: Path, eval_text: str, spec: BuildSpec,
             gates: dict[str, float], vocab: int, *, previous: dict | None = None,
             engine_source: tuple[str, Path] | None = None, before_timing: Callable[[], object] | None = None,
             tasks: dict[str, Path] | None = None, task_policy: TaskPolicy | None = None) -> dict:
    """``reference``: the reference's stored results (validation.reference.Reference), or a reference runner (its
    results are computed here). ``tasks``: evaluation task files by content digest, read under ``task_policy``
    (validation/taskfile.py; the settings' unless given). ``previous``: the engine to
    compare with (:func:`previous_engine`), or None. ``engine_source``: (backend, engine_dir), so that peak memory
    is measured in a fresh process that loads the engine itself. ``before_timing`` is called after the accuracy
    pass, before anything is timed (the build waits there for work it ran beside the accuracy pass, so that no
    timing shares the machine with it)."""
    from validation.reference import Reference, compute_reference

    if not isinstance(reference, Reference):
        reference = compute_reference(reference, tokenizer_dir, eval_text, spec, tasks, task_policy)
    text = eval_tokens(tokenizer_dir, eval_text, spec)
    profile = spec.batch_profile
    batch = eval_batch(spec)
    batches = [window_batch(batch, seq, vocab) for seq in text.lengths]
    metrics = accuracy_at_lengths(engine, reference.sets, text.ids, text.lengths, batches, gates,
                                  sequential=spec.evaluation.sequential, convention=text.convention)
    if tasks:
        metrics["tasks"] = task_accuracy(engine, reference, tokenizer_dir, spec, tasks, threshold=gates.get(TASK_GATE),
                                         policy=task_policy)
    accuracy_verdicts = evaluate(metrics, {k: t for k, t in gates.items() if k in ACCURACY_GATES})
    failed_accuracy = [v for v in accuracy_verdicts if not v["passed"]]
    if before_timing is not None:
        before_timing()
    # A runner with a runtime of its own (TensorRT-LLM: trtllm-bench, in-flight batching, KV cache) measures its
    # speed itself, in the same shapes; the others are timed here through their forward. An engine that failed an
    # accuracy gate is not timed at all: it is rejected whatever its speed (a ladder moves on at once).
    own_throughput, own_latency = getattr(engine, "throughput", None), getattr(engine, "decode_latency", None)
    own_speed = callable(own_throughput) and callable(own_latency)
    waited: dict = {}
    speed_cond: dict[str, object]
    latency: dict[str, Any]
    memory: dict[str, Any]
    if failed_accuracy:
        skipped = "not measured: the engine failed its accuracy gates (" + ", ".join(
            sorted({v["name"] for v in failed_accuracy})) + ")"
        metrics["throughput"], latency = [], {"ttft_ms": None, "tpot_ms": None, "points": [],
                                              "conditions": {"method": skipped}}
        speed_cond = {"method": skipped}
        memory = {"peak_memory_bytes": None, "conditions": {"method": skipped}}
    elif callable(own_throughput) and callable(own_latency):
        metrics["throughput"] = own_throughput(profile, vocab)
        latency = own_latency(profile, vocab)
        speed_cond = {"method": "the runner's own benchmark", "source": type(engine).__name__}
    else:
        with cpu_wait() as waited:  # how much the timings below waited for a CPU (the regression gate asks)
            metrics["throughput"] = throughput(engine, profile, vocab)
            latency = decode_latency(engine, profile, vocab)
        speed_cond = {"warmup": 1, "reps": 3, "input": "seeded random token ids",
                      "what": "one forward (prefill) of batch × sequence tokens per run",
                      "statistic": "tokens_per_s: median run; tokens_per_s_best: fastest run"}
    metrics.update(ttft_ms=latency["ttft_ms"], tpot_ms=latency["tpot_ms"], latency=latency["points"])
    if failed_accuracy:
        pass
    elif callable(own_memory := getattr(engine, "peak_memory", None)):
        memory = own_memory(profile, vocab)
    elif engine.kv_cache and str(engine.device).startswith("cuda"):
        memory = {"peak_memory_bytes": None, "conditions": {
            "method": "not measured: this runtime allocates its memory outside torch (KV-cache pool) and its runner "
                      "reports no peak"}}
    else:
        memory = peak_memory(engine, profile, vocab, source=engine_source)
    metrics["peak_memory_bytes"] = memory["peak_memory_bytes"]
    cond = {**conditions(engine), **waited, "runtime": runtime_condition(engine, spec)}

    judged, sources = judged_gates(gates, spec.target)
    not_judged = {}
    if failed_accuracy:  # speed and memory were not measured: they are not judged (the build fails on accuracy)
        for name in [g for g in judged if g not in ACCURACY_GATES]:
            judged.pop(name)
            not_judged[name] = str(speed_cond["method"])
    elif metrics["peak_memory_bytes"] is None and MEMORY_GATE not in gates:
        judged.pop(MEMORY_GATE)
        not_judged[MEMORY_GATE] = memory["conditions"]["method"]
    if TASK_GATE in judged and not metrics.get("tasks"):
        not_judged[TASK_GATE] = "no evaluation tasks given (evaluation.tasks, --eval-task)"
    verdicts = evaluate(metrics, judged)

    def remeasure(b: int, s: int) -> float:
        return throughput_point(engine, b, s, vocab, warmup=1, reps=RECHECK_REPS)["tokens_per_s_best"]

    if failed_accuracy:
        record, more = regression(metrics, cond, None, judged, override_reason=getattr(spec, "override_reason", None))
        record["not_judged"] = {k: speed_cond["method"] for k in record["not_judged"]}
    else:
        record, more = regression(metrics, cond, previous, judged, remeasure=None if own_speed else remeasure,
                                  override_reason=getattr(spec, "override_reason", None))
    verdicts += more
    return {
        "passed": all(v["passed"] for v in verdicts), "metrics": metrics, "gates": verdicts, "regression": record,
        "not_judged": {**not_judged, **record["not_judged"]},
        "conditions": {
            **cond, "eval_batch": batch,
            "accuracy": {"tokens": metrics["tokens"], "seq_len": text.seq, "batch": batches[0],
                         "lengths": [{"seq_len": seq, "batch": b, "positions": [0, seq - 1]}
                                     for seq, b in zip(text.lengths, batches)],
                         "sliding_window": sliding_window(tokenizer_dir), "text": text.text,
                         "reference": "transformers, float32", "reference_seconds": reference.seconds,
                         "statistic": "paired over the evaluated windows; intervals by bootstrap over windows",
                         "sequential": {k: v for k, v in metrics["sequential"].items() if k != "decisions"}},
            "throughput": speed_cond,
            "latency": latency["conditions"],
            "memory": memory["conditions"],
            "gate_sources": sources,
        },
    }


def previous_engine(sessions, spec: BuildSpec, build_key: str, data: dict | None = None) -> dict | None:
    """The newest validated engine (fresh or stale, never revoked or rejected) of the same target as ``spec`` —
    same repository, precision, KV cache, target, backend, tensor-parallel size and batch profile (name and
    limits) — with another BuildKey; None when there is none. A plain dict, detached from the session.
    ``same_evaluation`` says whether it was evaluated on the same text (``data``) with the same settings."""
    from sqlalchemy import select

    from kiln.tables import Artifact

    with sessions() as session:
        rows = session.scalars(
            select(Artifact).where(
                Artifact.repository == spec.model_name, Artifact.precision == spec.precision,
                Artifact.target == spec.target, Artifact.backend == spec.backend,
                Artifact.profile == spec.batch_profile.name, Artifact.status.in_(PREVIOUS_STATUSES),
                Artifact.build_key != build_key,
            ).order_by(Artifact.created_at.desc()).limit(50))
        for row in rows:
            pspec = (row.provenance or {}).get("spec") or {}
            prof = pspec.get("profile")
            limits = {k: prof.get(k) for k in spec.batch_profile.limits()} if isinstance(prof, dict) else None
            if limits != spec.batch_profile.limits() or pspec.get("kv_cache", DEFAULT_KV_CACHE) != spec.kv_cache \
                    or pspec.get("tp_size", 1) != spec.tp_size:
                continue
            validation = row.validation or {}
            if not validation.get("metrics"):
                continue
            pdata = (row.provenance or {}).get("data") or {}
            settings = {k: v for k, v in (pspec.get("evaluation") or {}).items() if k not in UNCOMPARED}
            same_eval = (settings == spec.evaluation.model_dump(exclude=set(UNCOMPARED))
                         and (data is None or pdata.get("evaluation") == data.get("evaluation")))
            return {"digest": row.digest, "build_key": row.build_key, "status": row.status,
                    "created_at": row.created_at.isoformat() if row.created_at else None,
                    "metrics": validation["metrics"], "conditions": validation.get("conditions") or {},
                    "same_evaluation": same_eval}
    return None


def judge_naming(sessions, spec: BuildSpec, data: dict | None, engine, gates: dict[str, float]) -> None:
    """Before another repository's engine (``engine``, with the same BuildKey) is named in ``spec.model_name``:
    its stored metrics are held to the regression gates against that repository's own previous engine, as a
    build there would be. ``ValidationFailed`` (and it is not named) when a gate fails; nothing to judge when it
    is named there already (a repeated request)."""
    from kiln.tables import EngineName

    with sessions() as session:
        if session.get(EngineName, (spec.model_name, engine.digest)) is not None:
            return
    stored = engine.validation or {}
    previous = previous_engine(sessions, spec, engine.build_key, data)
    if previous is None:  # nothing to regress against: no regression gate can fail
        return
    _, verdicts = regression(stored.get("metrics") or {}, stored.get("conditions") or {}, previous, gates,
                             override_reason=spec.override_reason)
    failed = [v for v in verdicts if not v["passed"]]
    if failed:
        what = "; ".join(f"{v['name']}: {units.gate_line(v)}" for v in failed)
        raise ValidationFailed(
            f"{engine.repository}'s engine {engine.digest} (the same build) regresses against "
            f"{spec.model_name}'s previous engine {previous['digest']}: {what}", field="gates",
            fix=f"build for {spec.model_name} with other settings, or revoke its previous engine if it is wrong")

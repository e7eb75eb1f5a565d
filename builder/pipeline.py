"""One build: resolve → quantize → compile → validate → publish. Each stage is a plain function of its
inputs; the quantize and compile outputs are kept under their stage keys in the blob store, with a bounded local
copy (builder/stagecache.py), so an equal key reuses them on any worker and a crashed build resumes, anywhere,
from its last finished stage. Every blob the build stores is leased first, so GC never sweeps it from under the
build (builder/leases.py)."""

from __future__ import annotations

import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, cast

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

import kiln
from artifacts.interfaces import BlobStore
from artifacts.oci import survey_engine_layer
from builder import ladder as ladder_stage
from builder import quantize as quantize_stage
from builder.backends import get_backend
from builder.backends.base import Kernels
from builder.leases import BlobLeases, LeasedStore
from builder.publish import name_in_repository, publish, tag_for
from builder.resolve import ResolvedCheckpoint, checkpoint_args, identify_checkpoint, materialize_checkpoint
from builder.stagecache import StageCache
from kiln.datasets import load_text, task_path
from kiln.errors import BuildCancelled, KilnError
from kiln.families import family_of
from kiln.keys import RECIPE_VERSION, build_key, compile_key, kernel_key, quantize_key, reference_key, request_key
from kiln.tables import Artifact
from kiln.progress import reporting
from kiln.recipes import AUTO
from kiln.settings import Settings
from kiln.spec import BuildSpec, check_model
from kiln.toolchain import lm_eval_version, toolchain_for
from validation.gates import effective_gates
from validation.runners import open_engine, open_reference, reference_dtype
from validation.reference import Reference, compute_reference, layout as reference_layout
from validation.accuracy import window_batch
from validation.taskfile import TaskPolicy, check_task_file
from validation.validate import eval_tokens, judge_naming, previous_engine, validate

STAGES = ("resolve", "quantize", "compile", "validate", "publish")
Event = Callable[[str, dict], None]


@dataclass
class StageRecord:
    name: str
    status: str  # ran | cached | reused (compile: the kernel was, only the weights were written) | skipped
    seconds: float = 0.0
    detail: dict = field(default_factory=dict)


@dataclass
class BuildOutcome:
    build_key: str
    status: str  # succeeded | failed
    cache_hit: bool
    digest: str | None
    stages: list[StageRecord]
    validation: dict
    artifact: dict | None

    def to_dict(self) -> dict:
        return {"build_key": self.build_key, "digest": self.digest, "status": self.status,
                "cache_hit": self.cache_hit,
                "stages": [{"name": s.name, "status": s.status, "seconds": round(s.seconds, 3)} for s in self.stages],
                "validation": {"passed": self.validation.get("passed"), "metrics": self.validation.get("metrics", {}),
                               "gates": self.validation.get("gates", []),
                               "recipe": self.validation.get("recipe"),
                               # whether this build computed the unquantized reference's results or reused them
                               "reference": ((self.validation.get("conditions") or {}).get("accuracy") or {})
                               .get("reference_cache"),
                               # what the summary reads of the conditions: what computed the numbers, and the text
                               # convention every window followed
                               "conditions": _summary_conditions(self.validation.get("conditions") or {})},
                "artifact": self.artifact}


def _summary_conditions(cond: dict) -> dict:
    out = {k: cond[k] for k in ("runtime",) if k in cond}
    if (text := (cond.get("accuracy") or {}).get("text")) is not None:
        out["accuracy"] = {"text": text}
    return out


@dataclass
class Prepared:
    spec: BuildSpec
    resolved: ResolvedCheckpoint
    model_config: dict
    toolchain: dict
    gates: dict
    calib_text: str
    eval_text: str
    data: dict
    quantize_key: str
    compile_key: str
    build_key: str
    request_key: str
    #: the spec the first stages build: ``spec`` itself, or with ``--recipe auto`` its ladder's first rung
    first: BuildSpec
    #: evaluation task files by content digest
    tasks: dict = field(default_factory=dict)

    @property
    def checkpoint_dir(self) -> Path:
        """The checkpoint's local directory: set for every source once ``resolved`` is materialized, which a build
        does before any stage that reads the weights."""
        return cast(Path, self.resolved.local_dir)


def evaluation_tasks(spec: BuildSpec, policy: TaskPolicy) -> dict:
    """The spec's task files, checked as data (validation/taskfile.py: nothing of them runs) before any work:
    content digest → path."""
    out = {}
    for name in spec.evaluation.tasks:
        path = task_path(name, roots=list(policy.roots))
        out[check_task_file(path, policy)["digest"]] = path
    return out


def kernel_of(engine_dir: Path) -> str | None:
    """The kernel key an engine's compiled code is kept under (its engine.json says), or None for a backend without."""
    meta = engine_dir / "engine.json"
    kernel = json.loads(meta.read_text()).get("kernel") if meta.is_file() else None
    return kernel.get("key") if isinstance(kernel, dict) else None


class Builder:
    def __init__(self, settings: Settings, store: BlobStore, sessions: sessionmaker[Session], *,
                 on_event: Event | None = None, should_cancel: Callable[[], bool] | None = None):
        self.settings, self.sessions = settings, sessions
        self.task_policy = TaskPolicy.of(settings)  # where task files may lie, which may run code (workers only)
        self.leases = BlobLeases(sessions, ttl_s=settings.lease_ttl_s, grace_s=settings.gc_grace_s)
        self.store = LeasedStore(store, self.leases) if store is not None else None
        self.stage_cache = StageCache(settings.cache_dir, self.store, sessions, max_bytes=settings.cache_max_bytes)
        self.on_event = on_event or (lambda kind, data: None)
        self.should_cancel = should_cancel or (lambda: False)

    # -- planning --------------------------------------------------------------------------------
    def prepare(self, spec: BuildSpec, *, check_environment: bool = True, identified: dict | None = None,
                rebuild: str | None = None) -> tuple[Prepared, StageRecord]:
        """Keys and checks, before any work. ``identified``: checkpoint identities already taken in this request
        (ref → identity), so that a matrix identifies each checkpoint once, not once per entry. ``rebuild``: a
        forced rebuild's nonce, in the quantize key and the BuildKey's data (the reference is still reused: it does
        not depend on the engine)."""
        if check_environment:  # fail at once on the wrong machine, before any work
            get_backend(spec.backend).check_environment(spec)
        self.on_event("stage", {"name": "resolve", "state": "started"})
        t = time.perf_counter()
        # identify only (no weights downloaded): the API runs this too; build() materializes on the worker
        if identified is not None and spec.checkpoint in identified:
            resolved, was_cached = identified[spec.checkpoint]
        else:
            resolved, was_cached = identify_checkpoint(spec.checkpoint, **self._checkpoint_args())
            if identified is not None:
                identified[spec.checkpoint] = (resolved, was_cached)
        config = resolved.config
        check_model(spec, config)
        roots = self.settings.roots
        calib_text, calib_digest = load_text(spec.calibration.dataset, field="calibration.dataset", roots=roots)
        eval_text, eval_digest = load_text(spec.evaluation.dataset, field="evaluation.dataset", roots=roots)
        toolchain = toolchain_for(spec.backend, spec.target)
        gates = effective_gates(spec.precision, spec.gates)
        data: dict[str, Any] = {"calibration": calib_digest, "evaluation": eval_digest}
        tasks = evaluation_tasks(spec, self.task_policy)
        if tasks:
            data["tasks"] = list(tasks)
        if rebuild:
            data["rebuild"] = rebuild
        first = spec.with_recipe(spec.rungs[0])
        qkey = quantize_key(resolved.digest, first, toolchain, calib_digest, rebuild)
        prepared = Prepared(spec, resolved, config, toolchain, gates, calib_text, eval_text, data, qkey,
                            compile_key(qkey, first, toolchain), build_key(resolved.digest, spec, toolchain, gates, data),
                            request_key(resolved.digest, spec, gates, data), first, tasks)
        record = StageRecord("resolve", "cached" if was_cached else "ran", time.perf_counter() - t,
                             {"digest": resolved.digest, "revision": resolved.revision})
        self._finished(record)
        return prepared, record

    def plan(self, spec: BuildSpec) -> dict:
        """What a build would do, without doing it (resolve only: the key needs the checkpoint's content)."""
        p, _ = self.prepare(spec, check_environment=False)
        try:
            get_backend(spec.backend).check_environment(spec)
            environment: dict[str, Any] = {"ready": True}
        except KilnError as exc:
            environment = {"ready": False, "reason": str(exc)}
        return {**self.describe(p), "environment": environment}

    def describe(self, p: Prepared) -> dict:
        """The plan of a prepared build: its keys, spec, checkpoint, toolchain, gates, what is cached and the
        compile commands (``kiln build --dry-run``; the server's ``POST /v1/builds/plan`` adds what its
        submission would do, workers/submit.py)."""
        qdir = self.stage_cache.path("quantize", p.quantize_key)
        cdir = self.stage_cache.path("compile", p.compile_key)
        existing = self._existing(p.build_key)
        return {
            "build_key": p.build_key, "quantize_key": p.quantize_key, "compile_key": p.compile_key,
            "spec": p.spec.model_dump(), "profile": p.spec.batch_profile.model_dump(), "tag": tag_for(p.spec),
            "checkpoint": p.resolved.provenance(), "toolchain": p.toolchain, "gates": p.gates,
            "cached": {"artifact": existing.digest if existing and existing.status != "revoked" else None,
                       "quantize": self.stage_cache.where("quantize", p.quantize_key) is not None,
                       "compile": self.stage_cache.where("compile", p.compile_key) is not None},
            "compile": get_backend(p.spec.backend).plan(p.first, qdir, cdir), "recipe": p.spec.recipe_name,
            **({"ladder": p.spec.rungs} if p.spec.recipe_name == AUTO else {}),
        }

    # -- running ---------------------------------------------------------------------------------
    def build(self, spec: BuildSpec, *, force: bool = False) -> BuildOutcome:
        """Build ``spec``, or answer it with the engine its BuildKey already has; ``force``: build anew (every stage
        after resolve) and keep both engines."""
        try:
            return self._build(spec, rebuild=uuid.uuid4().hex if force else None)
        finally:  # the stage outputs it held may be evicted now; its blob leases run out after the grace period
            self.stage_cache.release()
            self.leases.release()

    def _build(self, spec: BuildSpec, rebuild: str | None) -> BuildOutcome:
        p, resolve_rec = self.prepare(spec, rebuild=rebuild)
        stages = [resolve_rec]
        existing = self._existing(p.build_key)
        if existing is not None and existing.status == "revoked":  # never answers; its key is taken: a new one
            return self._build(spec, rebuild=uuid.uuid4().hex)
        if existing is not None:
            if existing.repository != spec.model_name:  # another repository's engine: judged, then named here too
                judge_naming(self.sessions, spec, p.data, existing, p.gates)
                repository = cast(str, spec.model_name)  # parse_spec sets it
                existing = name_in_repository(self.sessions, existing.digest, repository)
            stages += [StageRecord(n, "cached") for n in STAGES[1:]]
            for s in stages[1:]:
                self._finished(s)
            return self._outcome(p.build_key, existing, stages, cache_hit=True)

        backend = get_backend(spec.backend)
        self._check_cancel()
        p.resolved = materialize_checkpoint(p.resolved, **self._checkpoint_args())  # the download, bounded
        first = p.first
        qdir, _ = self._stage("quantize", lambda: self.stage_cache.get(
            "quantize", p.quantize_key,
            lambda out: quantize_stage.quantize(p.checkpoint_dir, first, p.calib_text, out)), stages)
        self._check_cancel()
        cdir, _ = self._stage("compile", lambda: self.stage_cache.get(
            "compile", p.compile_key,
            lambda out: backend.compile(first, qdir, out, checkpoint_dir=p.checkpoint_dir,
                                        kernels=self.kernels(first, p.toolchain))), stages)
        self._check_cancel()
        with ThreadPoolExecutor(1, thread_name_prefix="kiln-layer-survey") as ahead:
            # publishing's first read of the engine layer (its digest), made beside validation's accuracy pass
            survey = ahead.submit(survey_engine_layer, self.store, cdir)
            (report, built, built_dir), _ = self._stage("validate", lambda: (
                self._validate(p, cdir, survey.exception), {}), stages)
        # publish reads afresh (and reports it) where the survey failed or the ladder built another rung
        layer_survey = None if survey.exception() or built_dir != cdir else survey.result()
        cdir = built_dir
        self._check_cancel()
        provenance = {
            "created": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "kiln": kiln.__version__,
            "recipe": RECIPE_VERSION, "spec": spec.model_dump(), "build_key": p.build_key,
            "quantize_key": p.quantize_key, "compile_key": p.compile_key, "kernel_key": kernel_of(cdir),
            "checkpoint": p.resolved.provenance(),
            "family": family_of(p.model_config).name,  # what ran where (kiln/verified.py, `kiln models`)
            "toolchain": p.toolchain, "gates": p.gates, "data": p.data,
            "quantization": report["recipe"], "stages": [asdict(s) for s in stages],
            "reference_key": report["conditions"]["accuracy"]["reference_cache"]["key"],
        }
        row, _ = self._stage("publish", lambda: (publish(
            self.store, self.sessions, cdir, spec=built, build_key=p.build_key, request_key=p.request_key,
            provenance=provenance, validation=report, layer_survey=layer_survey), {}), stages)
        return self._outcome(p.build_key, row, stages, cache_hit=False)

    def _validate(self, p: Prepared, cdir, before_timing) -> tuple[dict, BuildSpec, object]:
        """Validate the first engine; with ``--recipe auto``, when it fails an accuracy gate, climb the rest of the
        ladder (builder/ladder.py) and validate the rung it chooses. Returns (report, the spec built, its engine)."""
        spec, first, backend = p.spec, p.first, get_backend(p.spec.backend)
        reference, reference_record = self._reference(p)
        vocab = int(p.model_config["vocab_size"])

        def check(built: BuildSpec, engine_dir, hook=None) -> dict:
            return validate(open_engine(spec.backend, engine_dir), reference, p.checkpoint_dir, p.eval_text, built,
                            p.gates, vocab, previous=previous_engine(self.sessions, spec, p.build_key, p.data),
                            engine_source=(spec.backend, engine_dir), before_timing=hook, tasks=p.tasks,
                            task_policy=self.task_policy)

        t = time.perf_counter()
        report = check(first, cdir, before_timing)
        built, built_dir, tried, rung_compile = first, cdir, None, None
        rest = spec.rungs[1:]
        if rest and not ladder_stage.accuracy_passed(report):
            tried = [ladder_stage.Rung.validated(first.recipe_name, p.quantize_key, report, time.perf_counter() - t)]
            text = eval_tokens(p.checkpoint_dir, p.eval_text, spec)
            batches = [window_batch(min(spec.batch_profile.max_batch_size, 16), seq, vocab) for seq in text.lengths]

            def quantize(rung: BuildSpec):
                self._check_cancel()
                key = quantize_key(p.resolved.digest, rung, p.toolchain, p.data["calibration"], p.data.get("rebuild"))
                t0 = time.perf_counter()
                qdir, _ = self.stage_cache.get("quantize", key, lambda out: quantize_stage.quantize(
                    p.checkpoint_dir, rung, p.calib_text, out))
                return key, qdir, time.perf_counter() - t0

            chosen, more = ladder_stage.climb(spec, rest, p.gates, reference.sets, text, batches, quantize,
                                              on_rung=lambda r: self.on_event("rung", r))
            tried += more
            best = chosen or min(tried, key=ladder_stage.Rung.ppl)
            if best is not tried[0]:  # compile and validate the chosen rung; the first engine is not published
                built = spec.with_recipe(best.recipe)
                self._check_cancel()
                key = compile_key(best.quantize_key, built, p.toolchain)
                quantized = cast(Path, best.quantized)  # a rung the climb quantized (only the first has none)
                built_dir, produced = self.stage_cache.get("compile", key, lambda out: backend.compile(
                    built, quantized, out, checkpoint_dir=p.checkpoint_dir, kernels=self.kernels(built, p.toolchain)))
                # the compile stage's status is the first rung's: say how the published rung's engine was made
                rung_compile = {"recipe": best.recipe, "compile_key": key, "kernel_key": kernel_of(built_dir),
                                "status": "cached" if produced is None else
                                ("reused" if (produced.get("kernel") or {}).get("reused") else "ran")}
                report = check(built, built_dir)
        # frees its hidden states before publish (check() closes over the name)
        reference = None  # type: ignore[assignment]
        report["recipe"] = {"requested": spec.recipe_name, "built": built.recipe_name,
                            **({"ladder": [r.record() for r in tried]} if tried else {}),
                            **({"compiled_in_validate": rung_compile} if rung_compile else {})}
        report["conditions"]["accuracy"]["reference_cache"] = reference_record
        return report, built, built_dir

    def _reference(self, p: Prepared) -> tuple[Reference, dict]:
        """The reference's results on this evaluation: from the stage cache (any earlier build of the checkpoint
        with this evaluation, on any worker), else computed and stored."""
        spec = p.first
        toolchain = {**p.toolchain, "lm_eval": lm_eval_version() if p.tasks else None}
        dtype = reference_dtype(p.model_config)  # this worker's CPU computes it: its bf16 units decide
        key = reference_key(p.resolved.digest, spec, toolchain, p.data, reference_layout(spec, dtype))
        folder, produced = self.stage_cache.get("reference", key, lambda out: compute_reference(
            open_reference(p.checkpoint_dir, dtype), p.checkpoint_dir, p.eval_text, spec, p.tasks,
            self.task_policy).save(out))
        reference = Reference.load(folder, p.checkpoint_dir)
        return reference, {"key": key, "reused": produced is None, "seconds_to_compute": reference.seconds}

    # -- helpers ---------------------------------------------------------------------------------
    def kernels(self, spec: BuildSpec, toolchain: dict) -> Kernels:
        """Compiled kernels in the stage cache (stage ``kernel``) under their kernel keys (kiln/keys.py): another
        checkpoint of a built architecture, recipe and profile reuses one and only its weights are written."""
        return Kernels(lambda config, quantization, code: kernel_key(config, quantization, spec, toolchain, code),
                       lambda key, produce: self.stage_cache.get("kernel", key, produce))

    def _checkpoint_args(self) -> dict:
        return checkpoint_args(self.settings)  # what each checkpoint source reads from the settings

    def _stage(self, name: str, fn: Callable[[], tuple], stages: list[StageRecord]):
        self.on_event("stage", {"name": name, "state": "started"})
        t = time.perf_counter()
        with reporting(self._progress_sink(name, t)):
            value, record = fn()
        status = "cached" if name in ("quantize", "compile") and record is None else "ran"
        if name == "compile" and ((record or {}).get("kernel") or {}).get("reused"):
            status = "reused"
        rec = StageRecord(name, status, time.perf_counter() - t, record or {})
        stages.append(rec)
        self._finished(rec)
        return value, rec

    #: at most one progress event a second per stage (a new step always goes out at once)
    PROGRESS_EVERY_S = 1.0

    def _progress_sink(self, stage: str, t0: float):
        """Turns :func:`kiln.progress.report` calls inside a stage into ``progress`` events."""
        last: dict[str, Any] = {"step": None, "at": -1e9}

        def sink(what: str, i: int | None, n: int | None) -> None:
            now = time.perf_counter()
            if what == last["step"] and now - last["at"] < self.PROGRESS_EVERY_S:
                return
            last.update(step=what, at=now)
            self.on_event("progress", {"stage": stage, "step": what, "i": i, "n": n, "elapsed": round(now - t0, 1)})
        return sink

    def _finished(self, rec: StageRecord) -> None:
        self.on_event("stage", {"name": rec.name, "state": "finished", "status": rec.status, "seconds": rec.seconds})

    def _check_cancel(self) -> None:
        if self.should_cancel():
            raise BuildCancelled("the build was cancelled")

    def _existing(self, key: str) -> Artifact | None:
        with self.sessions() as session:
            return session.scalars(select(Artifact).where(Artifact.build_key == key)).first()

    def _outcome(self, key: str, row: Artifact, stages: list[StageRecord], *, cache_hit: bool) -> BuildOutcome:
        validation = row.validation or {}
        status = "succeeded" if row.status != "rejected" else "failed"
        return BuildOutcome(key, status, cache_hit, row.digest, stages, validation, row.summary())

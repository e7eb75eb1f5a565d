"""BuildSpec: what to build. Every rule a user expects to be told about is checked here, before any work,
and each violation names its field (dotted path) and the fix."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kiln.backends import BACKENDS, DEFAULT_BACKEND
from kiln.datasets import task_path
from kiln.errors import SpecError
from kiln.families import family_of
from kiln.kvcache import DEFAULT_KV_CACHE, KV_CACHES, backend_gap, kv_cache_error
from kiln.precisions import PRECISIONS
from kiln.recipes import AUTO, RECIPES, ladder, recipes_for, resolved_recipe
from kiln.runtimes import RUNTIME_TABLE, RUNTIMES, support, target_kind
from kiln.sources import check_ref, default_model_name
from kiln.targets import GPU_ARCHS, normalize_target

GATE_NAMES = ("max_ppl_increase_pct", "min_top1_agreement", "max_mean_kl", "max_task_accuracy_drop_pts", "min_throughput_tps",
              "max_peak_memory_bytes", "max_throughput_drop_pct", "max_accuracy_regression_pct")
# Changing the regression gate (the comparison with the previous engine of the same target) needs a recorded reason.
REGRESSION_GATE_NAMES = ("max_throughput_drop_pct", "max_accuracy_regression_pct")
MODEL_NAME_RE = re.compile(r"^[a-z0-9]+(?:[._-][a-z0-9]+)*(?:/[a-z0-9]+(?:[._-][a-z0-9]+)*)*$")

MAX_TASKS = 16
LIMITS = {  # (min, max) for every integer field
    "max_batch_size": (1, 4096), "max_input_len": (1, 1 << 20), "max_seq_len": (2, 1 << 20),
    "max_num_tokens": (1, 1 << 24), "tp_size": (1, 8), "calibration.samples": (1, 4096),
    "calibration.seq_len": (8, 32768), "evaluation.seq_len": (8, 32768), "evaluation.max_tokens": (64, 1 << 22),
}


class BatchProfile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = "custom"
    max_batch_size: int
    max_input_len: int
    max_seq_len: int
    max_num_tokens: int

    def limits(self) -> dict[str, int]:
        return self.model_dump(exclude={"name"})


PROFILES = {
    "latency": BatchProfile(name="latency", max_batch_size=1, max_input_len=256, max_seq_len=512, max_num_tokens=512),
    "balanced": BatchProfile(name="balanced", max_batch_size=8, max_input_len=256, max_seq_len=512, max_num_tokens=2048),
    "throughput": BatchProfile(name="throughput", max_batch_size=32, max_input_len=256, max_seq_len=512, max_num_tokens=8192),
}


class Calibration(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    dataset: str = "kiln:calibration"  # built-in text, or a .txt path under the checkpoint roots
    samples: int = 32
    seq_len: int = 128


class Evaluation(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    dataset: str = "kiln:heldout"
    seq_len: int = 128
    max_tokens: int = 16384
    #: task files (lm-eval task YAML or multiple-choice .jsonl, docs/tasks.md) under the checkpoint roots; they
    #: enter keys by content digest, never by path
    tasks: tuple[str, ...] = ()
    #: stop evaluating once every accuracy gate is decided (validation/accuracy.py); False evaluates everything
    sequential: bool = True


class BuildSpec(BaseModel):
    """A checked build request. Construct with :func:`parse_spec`, which applies every rule."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    checkpoint: str
    model_name: str | None = None
    precision: str
    #: a recipe of the precision (kiln/recipes.py), ``auto`` (its ladder), or None for the precision's default
    recipe: str | None = None
    #: decoder layers kept in the model's dtype (indices; negative counts from the last), e.g. [0, -1]
    unquantized_layers: tuple[int, ...] = ()
    kv_cache: str = DEFAULT_KV_CACHE
    profile: BatchProfile | str = "latency"
    target: str = "cpu"
    backend: str = DEFAULT_BACKEND
    #: the serving runtime a ``checkpoint`` build is for (kiln/runtimes.py): a recipe it refuses on the target is
    #: refused before any work; None: no runtime named (the artifact carries configurations for each that loads it)
    runtime: str | None = None
    tp_size: int = 1
    calibration: Calibration = Field(default_factory=Calibration)
    evaluation: Evaluation = Field(default_factory=Evaluation)
    gates: dict[str, float] = Field(default_factory=dict)
    # Why this build changes the regression gate; recorded in provenance and the report, not part of any key.
    override_reason: str | None = None

    @property
    def batch_profile(self) -> BatchProfile:
        assert isinstance(self.profile, BatchProfile), "parse_spec expands named profiles"
        return self.profile

    @property
    def recipe_name(self) -> str:
        """The recipe this spec asks for: its own or its precision's default (``auto`` or a recipe's name)."""
        return resolved_recipe(self.precision, self.recipe)

    @property
    def rungs(self) -> list[str]:
        """The recipes this spec may build, in order: its own, or the rungs of its ladder its backend builds."""
        if self.recipe_name != AUTO:
            return [self.recipe_name]
        return [r for r in ladder(self.precision) if self.backend in RECIPES[r].backends
                and (self.runtime is None or not support(self.runtime, r, self.target).refused)]

    def with_recipe(self, name: str) -> "BuildSpec":
        """This spec with a concrete recipe (a rung of its ladder)."""
        return self.model_copy(update={"recipe": name})

    @property
    def sm(self) -> int | None:
        return GPU_ARCHS.get(self.target)

    def key_fields(self) -> dict[str, Any]:
        """The spec's part of the BuildKey: everything but the checkpoint location and names."""
        recipe = resolved_recipe(self.precision, self.recipe)
        return {
            "precision": self.precision, "recipe": recipe, "unquantized_layers": list(self.unquantized_layers),
            **({"ladder": list(ladder(self.precision))} if recipe == AUTO else {}),
            "kv_cache": self.kv_cache, "profile": self.batch_profile.limits(),
            "target": self.target, "backend": self.backend, "tp_size": self.tp_size,
            **({"runtime": self.runtime} if self.runtime else {}),
            # datasets enter keys by content digest (passed separately), never by name or path
            "calibration": self.calibration.model_dump(exclude={"dataset"}),
            "evaluation": self.evaluation.model_dump(exclude={"dataset", "tasks"}),
        }


def _bad(field: str, message: str, fix: str | None) -> dict:
    return {"field": field, "message": message, "fix": fix}


def check_checkpoint_ref(ref: str, roots: list[Path], *, resolved: dict | None = None) -> dict | None:
    """The checkpoint source's rules (kiln/sources.py). ``resolved``: where given, the reference's canonical form
    (a local path resolved, once per spec) is left in it under ``"checkpoint"``."""
    problem, canonical = check_ref(ref, roots)
    if resolved is not None:
        resolved["checkpoint"] = canonical
    return _bad("checkpoint", *problem) if problem else None


def _rules(d: dict[str, Any], roots: list[Path], resolved: dict) -> list[dict]:
    """Every rule a spec breaks, in a fixed order (the first names what to fix first): names, then shapes and
    ranges, then the descriptors' rules (target, backend, precision, recipe), then gates."""
    errs: list[dict] = []
    if (e := check_checkpoint_ref(d["checkpoint"], roots, resolved=resolved)):
        errs.append(e)
    errs += _name_rules(d)
    prof, profile_errs = _profile(d)
    errs += profile_errs
    errs += _task_rules(d, roots)
    errs += _range_rules(d, prof)
    errs += _target_rules(d)
    errs += _recipe_rules(d)
    errs += _runtime_rules(d)
    errs += _gate_rules(d)
    if len(d.get("override_reason") or "") > 2000:
        errs.append(_bad("override_reason", "is longer than 2000 characters", "say why in fewer words"))
    return errs


def _name_rules(d: dict[str, Any]) -> list[dict]:
    """Precision, KV cache and backend are names their tables know; the target is normalised (a GPU name → its
    SM) in ``d``; the repository name is one a registry takes."""
    errs: list[dict] = []
    if d["precision"] not in PRECISIONS:
        errs.append(_bad("precision", f"{d['precision']!r} is not supported", f"use one of: {', '.join(PRECISIONS)}"))
    errs += [e] if (e := kv_cache_error(d["kv_cache"])) else []
    if d["backend"] not in BACKENDS:
        errs.append(_bad("backend", f"{d['backend']!r} is not a backend", f"use one of: {', '.join(BACKENDS)}"))
    target, err = normalize_target(d["target"])
    errs += [err] if err else []
    d["target"] = target or d["target"]
    name = d.get("model_name")
    if name is not None and (len(name) > 255 or not MODEL_NAME_RE.fullmatch(name)):  # no trailing newline
        errs.append(_bad("model_name", f"{name!r} is not a valid repository name",
                         "use lowercase letters, digits, '.', '_', '-' and '/' separators, e.g. acme/tiny"))
    return errs


def _profile(d: dict[str, Any]) -> tuple[dict, list[dict]]:
    """The batch profile's fields (a named profile replaced by its own in ``d``), and the error of an unknown name
    (then ``latency``'s fields, so the other rules still run)."""
    prof = d["profile"]
    if not isinstance(prof, str):
        return prof, []
    if prof not in PROFILES:
        return PROFILES["latency"].model_dump(), [_bad(
            "profile", f"unknown profile {prof!r}",
            f"use one of: {', '.join(PROFILES)}, or give max_batch_size, max_input_len, max_seq_len, max_num_tokens")]
    d["profile"] = PROFILES[prof]
    return d["profile"].model_dump(), []


def _task_rules(d: dict[str, Any], roots: list[Path]) -> list[dict]:
    """At most MAX_TASKS task files, each where a task may be and of a kind Kiln reads (content: at resolve)."""
    errs: list[dict] = []
    if len(d["evaluation"].tasks) > MAX_TASKS:
        errs.append(_bad("evaluation.tasks", f"{len(d['evaluation'].tasks)} task files", f"give at most {MAX_TASKS}"))
    for name in d["evaluation"].tasks[:MAX_TASKS]:
        try:
            task_path(name, roots=roots)
        except SpecError as exc:
            errs.append(_bad("evaluation.tasks", exc.message, exc.fix))
    return errs


def _range_rules(d: dict[str, Any], prof: dict) -> list[dict]:
    """Every integer within its LIMITS; the profile consistent with itself; tensor parallelism a power of two."""
    errs: list[dict] = []
    ints: dict[str, int] = {f"profile.{k}": prof[k] for k in ("max_batch_size", "max_input_len", "max_seq_len",
                                                               "max_num_tokens")}
    ints |= {"tp_size": d["tp_size"], "calibration.samples": d["calibration"].samples,
             "calibration.seq_len": d["calibration"].seq_len, "evaluation.seq_len": d["evaluation"].seq_len,
             "evaluation.max_tokens": d["evaluation"].max_tokens}
    for field, value in ints.items():
        lo, hi = LIMITS[field.removeprefix("profile.")]
        if not lo <= value <= hi:
            errs.append(_bad(field, f"{value} is out of range", f"use an integer from {lo} to {hi}"))
    if prof["max_seq_len"] < prof["max_input_len"]:
        errs.append(_bad("profile.max_seq_len", f"{prof['max_seq_len']} is below max_input_len {prof['max_input_len']}",
                         "make max_seq_len ≥ max_input_len (it counts prompt plus generated tokens)"))
    if prof["max_num_tokens"] < prof["max_batch_size"]:
        errs.append(_bad("profile.max_num_tokens", f"{prof['max_num_tokens']} is below max_batch_size {prof['max_batch_size']}",
                         "make max_num_tokens ≥ max_batch_size"))
    if prof["max_num_tokens"] > prof["max_batch_size"] * prof["max_seq_len"]:
        errs.append(_bad("profile.max_num_tokens",
                         f"{prof['max_num_tokens']} exceeds max_batch_size × max_seq_len = {prof['max_batch_size'] * prof['max_seq_len']}",
                         "lower max_num_tokens (a batch can never hold more tokens; trtllm-build would cap it)"))
    if d["tp_size"] & (d["tp_size"] - 1):
        errs.append(_bad("tp_size", f"{d['tp_size']} is not a power of two", "use 1, 2, 4 or 8"))
    return errs


def _gate_rules(d: dict[str, Any]) -> list[dict]:
    """Known gates with finite values (memory: positive bytes); the regression gate and any gate looser than the
    precision's default only with an ``override_reason``."""
    errs: list[dict] = []
    for gname, value in d["gates"].items():
        if gname not in GATE_NAMES:
            errs.append(_bad(f"gates.{gname}", "unknown gate", f"use one of: {', '.join(GATE_NAMES)}"))
        elif not isinstance(value, (int, float)) or not math.isfinite(value):  # NaN and ±Infinity too
            errs.append(_bad(f"gates.{gname}", f"{value!r} is not a finite number", "give a number, e.g. 5.0"))
        elif gname == "max_peak_memory_bytes" and not 0 < value < float("inf"):
            errs.append(_bad(f"gates.{gname}", f"{value!r} is not a positive number of bytes", "give bytes, e.g. 24e9"))
        elif gname in REGRESSION_GATE_NAMES and not (d.get("override_reason") or "").strip():
            errs.append(_bad("override_reason", f"changing gates.{gname} (the regression gate) needs a recorded reason",
                             "set override_reason to why this build may differ from the previous engine"))
    if d["precision"] in PRECISIONS and all(isinstance(v, (int, float)) and math.isfinite(v) for v in d["gates"].values()):
        errs += looser_than(d, dict(PRECISIONS[d["precision"]].gates), Evaluation().model_dump(),
                            f"the {d['precision']} default")
    return errs


#: the evaluation's fields whose smaller value judges an engine on less (fewer tokens, shorter windows)
EVALUATION_STRENGTH = ("max_tokens", "seq_len")


def looser_than(d: dict[str, Any], gates: dict[str, float], evaluation: dict[str, Any], baseline: str) -> list[dict]:
    """Errors for each accuracy or speed gate of ``d`` looser than ``gates`` (a ``max_`` gate above, a ``min_``
    gate below) and each evaluation field below ``evaluation`` — unless ``d`` gives an ``override_reason``. An
    engine judged more leniently than the baseline must not take the repository's tag and resolve answer on a
    ``builds:write`` token's say alone; the reason is recorded in its provenance and report."""
    if (d.get("override_reason") or "").strip():
        return []
    errs = []
    for name, value in sorted(d.get("gates", {}).items()):
        base = gates.get(name)
        if base is None or name in REGRESSION_GATE_NAMES or name == "max_peak_memory_bytes":
            continue  # the regression gate has its own rule; the memory budget is a property of the card
        if (value > base) if name.startswith("max_") else (value < base):
            errs.append(_bad(f"gates.{name}", f"{value:g} is looser than {baseline} ({base:g})",
                             f"use {'at most' if name.startswith('max_') else 'at least'} {base:g}, or set "
                             "override_reason to why this engine may be judged more leniently"))
    ev = d["evaluation"]
    ev = ev.model_dump() if isinstance(ev, BaseModel) else ev
    for name in EVALUATION_STRENGTH:
        if name in evaluation and ev.get(name, evaluation[name]) < evaluation[name]:
            errs.append(_bad(f"evaluation.{name}", f"{ev[name]} is less than {baseline} ({evaluation[name]})",
                             f"use at least {evaluation[name]}, or set override_reason to why this engine may be "
                             "judged on less"))
    return errs


MAX_UNQUANTIZED_LAYERS = 64


def _recipe_rules(d: dict[str, Any]) -> list[dict]:
    """The recipe belongs to the precision, every backend of its ladder or itself builds it, and its calibration
    can run where this target's builds run."""
    if d["precision"] not in PRECISIONS:
        return []  # already reported
    errs, precision, name = [], d["precision"], d.get("recipe")
    known = [r.name for r in recipes_for(precision)]
    if name is not None and name != AUTO and name not in known:
        other = RECIPES.get(name)
        why = f"is a {other.precision} recipe" if other else "is not a recipe"
        errs.append(_bad("recipe", f"{name!r} {why}; precision is {precision}",
                         f"use one of: {', '.join(known + [AUTO])} (kiln models lists them)"))
        return errs
    chosen = resolved_recipe(precision, name)
    rungs = ladder(precision) if chosen == AUTO else (chosen,)
    for rung in rungs:
        recipe = RECIPES[rung]
        where = f"recipe {rung} (a rung of {precision}'s ladder)" if chosen == AUTO else f"recipe {rung}"
        if d["backend"] in BACKENDS and d["backend"] not in recipe.backends:
            if chosen == AUTO:
                continue  # the ladder skips rungs this backend cannot build (builder/ladder.py)
            errs.append(_bad("recipe", f"{where} cannot be built by the {d['backend']} backend",
                             f"use --backend {' / '.join(recipe.backends)}, or another recipe"))
        elif recipe.calibrate_on == "cuda" and d["target"] == "cpu":
            errs.append(_bad("recipe", f"{where} calibrates on a CUDA GPU (ModelOpt needs one for it)",
                             "use a GPU target, or another recipe"))
    if chosen == AUTO and d["backend"] in BACKENDS and not any(d["backend"] in RECIPES[r].backends for r in rungs):
        errs.append(_bad("recipe", f"no rung of {precision}'s ladder can be built by the {d['backend']} backend",
                         "give --recipe with a recipe that backend builds, or another backend"))
    layers = d.get("unquantized_layers") or ()
    if len(layers) > MAX_UNQUANTIZED_LAYERS:
        errs.append(_bad("unquantized_layers", f"{len(layers)} layers listed", f"list at most {MAX_UNQUANTIZED_LAYERS}"))
    elif len(set(layers)) != len(layers):
        errs.append(_bad("unquantized_layers", "lists a layer twice", "list each layer index once"))
    return errs


def _runtime_rules(d: dict[str, Any]) -> list[dict]:
    """A named runtime is one Kiln knows, for a ``checkpoint`` build, and serves the recipe (every rung, for an
    explicit recipe; at least one, for ``auto``) on the target, as far as it was measured (kiln/runtimes.py)."""
    name = d.get("runtime")
    if name is None or d["precision"] not in PRECISIONS or d["backend"] not in BACKENDS:
        return []
    if name not in RUNTIMES:
        return [_bad("runtime", f"{name!r} is not a serving runtime", f"use one of: {', '.join(RUNTIMES)}")]
    if BACKENDS[d["backend"]].runtime:
        return [_bad("runtime", f"the {d['backend']} backend's engine loads in "
                     f"{' / '.join(BACKENDS[d['backend']].runtime)}, not in a serving runtime",
                     "drop --runtime, or use --backend checkpoint to build a checkpoint for that runtime")]
    title, target = RUNTIME_TABLE[name].title, d["target"]
    if target_kind(target) not in RUNTIME_TABLE[name].runs_on:
        elsewhere = [r.name for r in RUNTIME_TABLE.values() if target_kind(target) in r.runs_on]
        return [_bad("runtime", f"{RUNTIME_TABLE[name].cpu_gap}, target is {target}",
                     f"use a GPU target, or --runtime {' / '.join(elsewhere)}")]
    chosen = resolved_recipe(d["precision"], d.get("recipe"))
    if chosen != AUTO and chosen not in RECIPES:
        return []  # already reported
    rungs = [r for r in (ladder(d["precision"]) if chosen == AUTO else (chosen,)) if d["backend"] in RECIPES[r].backends]
    verdicts = {r: support(name, r, target) for r in rungs}
    if any(not s.refused for s in verdicts.values()):
        return []
    served = [r.name for r in RECIPES.values() if d["backend"] in r.backends and not support(name, r.name, target).refused]
    same = [r for r in served if RECIPES[r].precision == d["precision"]]
    if same:
        fix = f"use --recipe {' or '.join(same)} ({title} {_serves(name, same[0], target)} on {target}), or --recipe auto"
    elif served:
        fix = (f"use --precision {RECIPES[served[0]].precision} --recipe {served[0]} ({title} "
               f"{_serves(name, served[0], target)} on {target}), or a GPU target")
    else:
        fix = "use another target or runtime"
    if chosen == AUTO:
        return [_bad("recipe", f"{title} refuses every rung of {d['precision']}'s ladder on {target}: "
                     + "; ".join(f"{r}: {s.reason}" for r, s in verdicts.items()), fix)]
    return [_bad("recipe", f"{title} refuses recipe {chosen} on {target}: {verdicts[chosen].reason}", fix)]


def _serves(runtime: str, recipe: str, target: str) -> str:
    return "serves it" if support(runtime, recipe, target).status == "serves" else "loads it, by its sources,"


def _target_rules(d: dict[str, Any]) -> list[dict]:
    """The backend's and the precision's rules (their descriptors say what they need)."""
    if d["backend"] not in BACKENDS or d["precision"] not in PRECISIONS:
        return []  # already reported
    errs, target, backend, precision = [], d["target"], BACKENDS[d["backend"]], PRECISIONS[d["precision"]]
    sm = GPU_ARCHS.get(target)
    cpu_capable = [b.name for b in BACKENDS.values() if not b.gpu_only]
    if backend.gpu_only and target == "cpu":
        errs.append(_bad("target", f"a {backend.name} build needs a GPU target",
                         f"use --target {'|'.join(GPU_ARCHS)} (or a GPU name), or --backend {' / '.join(cpu_capable)} for cpu"))
    if sm is not None and sm < precision.min_sm:
        errs.append(_bad("precision", f"{precision.name} needs sm{precision.min_sm}+, target is sm{sm}",
                         "use a newer GPU target"))
    elif (gap := backend.precision_gap(precision, sm)) is not None:
        others = [b.name for b in BACKENDS.values() if b.precision_gap(precision, sm) is None]
        errs.append(_bad("target", f"{gap}, target is {target}",
                         f"use a newer target, another precision, or --backend {' / '.join(others)}"))
    if d["tp_size"] > 1 and not backend.tensor_parallel:
        tp = [b.name for b in BACKENDS.values() if b.tensor_parallel]
        errs.append(_bad("tp_size", f"tensor parallelism is only for {' / '.join(tp)} builds, backend is {backend.name}",
                         f"use --tp 1, or --backend {' / '.join(tp)}"))
    if d["kv_cache"] in KV_CACHES and (e := backend_gap(KV_CACHES[d["kv_cache"]], backend)):
        errs.append(e)
    return errs


def check_model(spec: BuildSpec, config: dict) -> None:
    """Rules that need the checkpoint's config.json (its family, its positions); checked before any work, by
    the API before it enqueues and by the CLI before it quantizes."""
    if not config.get("architectures"):
        raise SpecError("the checkpoint's config.json has no 'architectures'", field="checkpoint",
                        fix="set architectures (e.g. [\"LlamaForCausalLM\"]) in config.json")
    family = family_of(config)
    backend = BACKENDS[spec.backend]
    if (gap := backend.family_gap(family)) is not None:
        others = [b.name for b in BACKENDS.values() if b.family_gap(family) is None]
        raise SpecError(f"{family.title} is not supported by the {backend.name} backend: {gap}", field="checkpoint",
                        fix=f"use --backend {' or '.join(others)} for {family.title}")
    layers = int(config.get("num_hidden_layers") or 0)
    outside = [i for i in spec.unquantized_layers if not -layers <= i < layers]
    if outside:
        raise SpecError(f"layer {outside[0]} is not a decoder layer of this model ({layers} layers)",
                        field="unquantized_layers", fix=f"use indices from 0 to {layers - 1} (or -{layers} to -1)")
    positions = int(config.get("max_position_embeddings") or 0)
    if positions and spec.batch_profile.max_seq_len > positions:
        raise SpecError(f"{spec.batch_profile.max_seq_len} exceeds the model's {positions} positions",
                        field="profile.max_seq_len", fix=f"use max_seq_len ≤ {positions}")


def _type_errors(exc: ValidationError) -> list[dict]:
    """Pydantic's errors as field paths. ``profile`` is a union (name | limits): report the branch the value
    was meant for (an object → its limits, a string → the name) under the plain path profile.<limit>."""
    out = []
    for e in exc.errors():
        loc = [str(p) for p in e["loc"]]
        if loc[:1] == ["profile"] and len(loc) > 1:
            branch = loc[1]
            meant = "BatchProfile" if isinstance(e.get("input"), (dict, int)) or len(loc) > 2 else "str"
            if branch in ("BatchProfile", "str") and branch != meant and not (branch == "str" and len(loc) == 2 and
                                                                              not any(x["loc"][:2] == ("profile", "BatchProfile") for x in exc.errors())):
                continue
            loc = ["profile"] + loc[2:]
        out.append(_bad(".".join(loc) or "spec", e["msg"], "see the BuildSpec schema (GET /openapi.json) for the field's type"))
    return out or [_bad("spec", "invalid", "see the BuildSpec schema (GET /openapi.json)")]


def parse_spec(data: dict[str, Any], roots: list[Path]) -> BuildSpec:
    """Check ``data`` against every rule; raise SpecError (all violations in ``details``) or return the spec
    with its profile expanded and its target canonical."""
    try:
        raw = BuildSpec.model_validate(data)
    except ValidationError as exc:
        details = _type_errors(exc)
        raise SpecError(details[0]["message"], field=details[0]["field"], fix=details[0]["fix"],
                        details=details) from None
    d = raw.model_dump()
    d["calibration"], d["evaluation"], d["profile"] = raw.calibration, raw.evaluation, raw.profile
    if isinstance(d["profile"], BatchProfile):
        d["profile"] = d["profile"].model_dump()
    resolved: dict = {}  # the canonical checkpoint, a local path resolved once (the service parses a spec per request)
    errs = _rules(d, roots, resolved)
    if errs:
        raise SpecError(errs[0]["message"], field=errs[0]["field"], fix=errs[0]["fix"], details=errs)
    if isinstance(d["profile"], dict):
        d["profile"] = BatchProfile(**d["profile"])
    d["checkpoint"] = resolved.get("checkpoint", d["checkpoint"])  # a local path: the same folder to every process
    d["model_name"] = d.get("model_name") or default_model_name(d["checkpoint"])
    return BuildSpec.model_validate(d)

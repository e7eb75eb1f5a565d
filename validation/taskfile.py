"""Evaluation task files read as data (docs/tasks.md; the threat model: docs/security.md "Task files").

:func:`read_task` is what the API checks (``POST /v1/builds``) and what a worker reads before it hands a task to
lm-eval (validation/tasks.py). It imports, renders and evaluates nothing: a YAML is parsed with a safe loader that
keeps a ``!function`` tag as a :class:`FunctionRef` (a module file and a name, not code), its ``include:`` files are
merged as lm-eval merges them, and every file a task names must lie where its :class:`TaskPolicy` allows —
``include:`` files in the task's folder, data files under the checkpoint roots. A task is data unless its file
lies in a folder of ``KILN_TRUSTED_TASK_DIRS``: only such a task may use ``!function`` (modules in that folder) and
the lm-eval fields that name code or files; any other is held to the fields in :data:`DATA_FIELDS`.

A refusal is a :class:`SpecError` in Kiln's own words — it names lines, items, positions and lm-eval's field names,
never a value a file holds or an exception's text. Content checks are cached by content (:data:`CHECKS`): copies of
a task, or one task named again, cost one reading of its items.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

from kiln.errors import SpecError
from kiln.settings import Settings, get_settings

FIELD = "evaluation.tasks"
JSONL_KEYS = ("id", "context", "choices", "answer")
METRICS = ("acc", "acc_norm")
YAML_MAX_BYTES = 1 << 20  # each task YAML and included file
MAX_YAML_FILES = 16  # a task YAML and the files it includes, in all
#: the lm-eval task fields a task outside the trusted folders may set: the others name code or files to read
DATA_FIELDS = frozenset({
    "task", "task_alias", "tag", "dataset_path", "dataset_kwargs", "training_split", "validation_split",
    "test_split", "fewshot_split", "doc_to_text", "doc_to_target", "doc_to_choice", "description",
    "target_delimiter", "fewshot_delimiter", "fewshot_config", "num_fewshot", "metric_list", "output_type",
    "repeats", "filter_list", "should_decontaminate", "doc_to_decontamination_query", "gen_prefix", "metadata",
    "generation_kwargs"})
#: lm-eval fields that run code or read files, named when a task outside the trusted folders sets them
CODE_FIELDS = ("class", "custom_dataset", "process_docs", "process_results", "use_prompt", "unsafe_code",
               "doc_to_image", "doc_to_audio")
OUTPUT_TYPES = ("multiple_choice", "loglikelihood", "loglikelihood_rolling", "generate_until")
TRUST_FIX = "code in a task file runs only from a folder of KILN_TRUSTED_TASK_DIRS (an operator's setting)"
_SafeLoader: type = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _bad(path: Path, problem: str, fix: str) -> SpecError:
    return SpecError(f"task file {path.name}: {problem}", field=FIELD, fix=fix)


class _Problem(Exception):
    """A content check's finding, without the file's name (the same content may have several)."""

    def __init__(self, problem: str, fix: str):
        super().__init__(problem)
        self.problem, self.fix = problem, fix


# -- where files may be ----------------------------------------------------------------------------
def _inside(path: Path, folder: Path) -> bool:
    return path == folder or path.is_relative_to(folder)


def _resolved(base: Path, name: str) -> Path | None:
    """``name`` (absolute, or relative to ``base``) with symlinks followed; None for a name no path can have."""
    try:
        return (base / name).resolve()
    except (OSError, ValueError, RuntimeError):
        return None


@dataclass(frozen=True)
class TaskPolicy:
    """Where a task's files may lie and which tasks may run code: ``roots`` (``KILN_CHECKPOINT_ROOTS``) hold task
    files and their data; a task file in a ``trusted`` folder (``KILN_TRUSTED_TASK_DIRS``) may use ``!function``
    modules in that folder, the fields that name code, and unsandboxed templates (on a worker)."""

    roots: tuple[Path, ...]
    trusted: tuple[Path, ...] = ()

    @classmethod
    def of(cls, settings: Settings | None = None) -> TaskPolicy:
        settings = settings or get_settings()
        return cls(tuple(settings.roots), tuple(settings.trusted_task_folders))

    def in_roots(self, path: Path) -> bool:
        return any(_inside(path, root) for root in self.roots)

    def trusted_folder(self, path: Path) -> Path | None:
        """The trusted folder that holds the (resolved) task file ``path``; None: its task is data."""
        return next((folder for folder in self.trusted if _inside(path, folder)), None)


# -- YAML as data ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class FunctionRef:
    """A ``!function module.name`` tag, kept as data: ``file`` is the module file lm-eval would import (the dotted
    module relative to the folder of the YAML it is written in, dots read as ``/``: ``..tmp.x`` is ``/tmp/x.py``),
    ``name`` the function in it, ``line`` where the tag is written."""

    qualified: str
    folder: Path
    line: int

    @property
    def name(self) -> str:
        return self.qualified.rpartition(".")[2]

    @property
    def file(self) -> Path | None:
        module = self.qualified.rpartition(".")[0]
        return _resolved(self.folder, module.replace(".", "/") + ".py") if module else None


def _parse(path: Path, raw: bytes, top: Path) -> tuple[Any, list[FunctionRef]]:
    """A YAML file's value, its ``!function`` tags as :class:`FunctionRef` (listed in the order they are written)."""
    found: list[tuple[int, FunctionRef]] = []

    def function(loader, node):
        if not isinstance(node, yaml.ScalarNode):
            raise _bad(top, f"line {node.start_mark.line + 1}: !function takes one module.function name",
                       "write !function module.function")
        ref = FunctionRef(str(loader.construct_scalar(node)), path.parent, node.start_mark.line + 1)
        found.append((node.start_mark.index, ref))
        return ref

    class Loader(_SafeLoader):  # type: ignore[valid-type, misc]
        pass

    Loader.add_constructor("!function", function)
    try:
        value = yaml.load(raw, Loader=Loader)  # noqa: S506 (a safe loader: only !function is added, as data)
    except SpecError:
        raise
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" (line {mark.line + 1}{'' if path == top else ' of an included file'})" if mark else ""
        raise _bad(top, f"not valid YAML{where}", "fix the YAML") from None
    except Exception:  # the loader's other refusals (recursion, bad encodings): nothing of their text is shown
        raise _bad(top, "not valid YAML", "fix the YAML") from None
    return value, [ref for _, ref in sorted(found, key=lambda f: f[0])]


def _sha(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


def _read(path: Path, top: Path, limit: int | None = None) -> bytes:
    try:
        with path.open("rb") as fh:
            raw = fh.read(limit + 1 if limit else -1)
    except OSError:
        raise _bad(top, "a file it names cannot be read" if path != top else "cannot be read",
                   "make the task's files readable by the server") from None
    if limit and len(raw) > limit:
        raise _bad(top, f"a YAML file is larger than {limit >> 10} KiB", "keep task YAMLs small")
    return raw


@dataclass
class _Reading:
    top: Path
    folder: Path  # include: files and !function modules must lie in it
    trusted: bool
    parts: list[str] = field(default_factory=list)  # the digest's, in order
    files: int = 0


def _merged(path: Path, r: _Reading, stack: tuple[Path, ...] = ()) -> dict:
    """One YAML file with what it includes merged in as lm-eval's loader merges them: each ``include:`` in order,
    then the file's own keys (which win); an included file's ``task_list`` is dropped. Records the digest's
    parts — the file's sha256, each of its ``!function`` modules', then its includes' — as Kiln always has."""
    r.files += 1
    if r.files > MAX_YAML_FILES:
        raise _bad(r.top, f"it includes more than {MAX_YAML_FILES - 1} files", "include fewer files")
    raw = _read(path, r.top, YAML_MAX_BYTES)
    cfg, refs = _parse(path, raw, r.top)
    if not isinstance(cfg, dict):
        raise _bad(r.top, "not a YAML mapping" if path == r.top else "an included file is not a YAML mapping",
                   "a task YAML is a mapping of lm-eval task fields")
    r.parts.append(_sha(raw))
    for ref in refs:
        if not r.trusted:
            raise _bad(r.top, f"line {ref.line}{'' if path == r.top else ' of an included file'}: !function "
                       "runs code", TRUST_FIX)
        module = ref.file
        if module is None or not _inside(module, r.folder) or not module.is_file():
            raise _bad(r.top, f"line {ref.line}: the !function module is not a file in the task's trusted folder",
                       "put the module beside the YAML (module.function names module.py in its folder)")
        r.parts.append(_sha(_read(module, r.top)))
    includes = cfg.pop("include", None)
    if includes is None:
        return cfg
    merged: dict = {}
    for name in includes if isinstance(includes, list) else [includes]:
        target = _resolved(path.parent, name) if isinstance(name, str) else None
        if target is None or not _inside(target, r.folder):
            raise _bad(r.top, "include: names a file outside the task's folder",
                       "keep included YAMLs in the task's folder (relative to the YAML that includes them)")
        if target in stack or target == path:
            raise _bad(r.top, "include: files include each other", "remove the include cycle")
        if not target.is_file():
            raise _bad(r.top, "an include: file is not found", "include files that exist, relative to the YAML")
        included = _merged(target, r, (*stack, path))
        included.pop("task_list", None)
        merged.update(included)
    merged.update(cfg)
    return merged


# -- content checks, cached by content -------------------------------------------------------------
class ContentChecks:
    """Results of content checks by (check, sha256 of the content): a file's content is checked once, whatever its
    name and however often it is named. ``misses`` counts the checks that ran."""

    def __init__(self, size: int = 1024):
        self.size, self.misses = size, 0
        self._done: dict[tuple[str, str], Any] = {}
        self._lock = threading.Lock()

    def run(self, check: Callable[[bytes], Any], raw: bytes, digest: str) -> Any:
        key = (check.__name__, digest)
        with self._lock:
            done: Any = self._done.get(key)
        if done is None:
            try:
                done = ("ok", check(raw))
            except _Problem as p:
                done = ("bad", p.problem, p.fix)
            with self._lock:
                self.misses += 1
                if len(self._done) >= self.size:
                    self._done.clear()
                self._done[key] = done
        if done[0] == "bad":
            raise _Problem(done[1], done[2])
        return done[1]


CHECKS = ContentChecks()


def _text(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise _Problem("not UTF-8 text", "save it as UTF-8") from None


def _jsonl_items(raw: bytes) -> int:
    """The items of a ``.jsonl`` task (docs/tasks.md), checked line by line."""
    fix = 'one JSON object per line: {"id": "optional", "context": "...", "choices": ["...", "..."], "answer": 0}'
    lines = _text(raw).split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    ids = []
    for n, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise _Problem(f"line {n} is not JSON ({exc.msg})", fix) from None
        except (ValueError, RecursionError):
            raise _Problem(f"line {n} is not JSON", fix) from None
        if not isinstance(row, dict):
            raise _Problem(f"line {n} is not a JSON object", fix)
        if unknown := set(row) - set(JSONL_KEYS):
            raise _Problem(f"line {n}: {len(unknown)} unknown field(s)", fix)
        if missing := [k for k in JSONL_KEYS[1:] if k not in row]:
            raise _Problem(f"line {n}: missing {', '.join(missing)}", fix)
        choices, answer = row["choices"], row["answer"]
        if not isinstance(row["context"], str) or ("id" in row and not isinstance(row["id"], str)):
            raise _Problem(f"line {n}: context and id must be strings", fix)
        if not isinstance(choices, list) or not all(isinstance(c, str) and c for c in choices):
            raise _Problem(f"line {n}: choices must be a list of non-empty strings", fix)
        if len(choices) < 2 or len(set(choices)) != len(choices):
            raise _Problem(f"line {n}: {len(choices)} choices ({len(set(choices))} distinct)",
                           "each item needs at least 2 distinct choices")
        if not isinstance(answer, int) or isinstance(answer, bool) or not 0 <= answer < len(choices):
            raise _Problem(f"line {n}: answer is not an index of its {len(choices)} choices",
                           "answer is the 0-based index of the right choice")
        ids.append(row.get("id", str(n - 1)))
    if not ids:
        raise _Problem("no items", fix)
    if len(set(ids)) != len(ids):
        raise _Problem("item ids repeat", "give every item a distinct id (or none, to use line positions)")
    return len(ids)


def _data_rows(raw: bytes) -> tuple[str | None, ...]:
    """A data file's rows (JSON Lines of objects, or a JSON list of objects, as ``datasets``' json reader takes
    them): each row's ``id`` (None where it has none)."""
    fix = "a data file holds one JSON object per line (or a JSON list of objects)"
    text = _text(raw)
    try:
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    except (ValueError, RecursionError):
        try:
            rows = [json.loads(text)]
        except (ValueError, RecursionError):
            raise _Problem("neither JSON Lines nor JSON", fix) from None
    if len(rows) == 1 and isinstance(rows[0], list):
        rows = rows[0]
    if not rows:
        raise _Problem("no rows", fix)
    if not all(isinstance(row, dict) for row in rows):
        raise _Problem("a row is not a JSON object", fix)
    return tuple(None if row.get("id") is None else str(row["id"]) for row in rows)


# -- task files ------------------------------------------------------------------------------------
@dataclass
class TaskFile:
    """A task file as :func:`read_task` read it. ``config``: a YAML's lm-eval task config (includes merged,
    ``!function`` tags as :class:`FunctionRef`), None for a ``.jsonl``; ``data``: its data files by split."""

    path: Path
    kind: str
    name: str
    items: int
    metric: str
    digest: str
    trusted: bool = False
    config: dict | None = None
    data: dict[str, list[Path]] = field(default_factory=dict)

    def summary(self) -> dict:
        return {"name": self.name, "kind": self.kind, "items": self.items, "metric": self.metric,
                "digest": self.digest}


def check_task_file(path: str | Path, policy: TaskPolicy | None = None) -> dict:
    """Check a task file as data: ``{"name", "kind": "jsonl" | "yaml", "items", "metric", "digest"}``. ``digest`` is
    the sha256 of the content (the YAML, what it includes, its ``!function`` modules and its data files; never a
    path), the part of a build key that names the task. ``policy``: the settings' (:meth:`TaskPolicy.of`) unless
    given. Raises :class:`SpecError` naming the line, item or field at fault."""
    return read_task(path, policy).summary()


def read_task(path: str | Path, policy: TaskPolicy | None = None) -> TaskFile:
    """A task file read as data and checked (see the module's docstring), without running anything of it."""
    policy = policy or TaskPolicy.of()
    path = Path(path)
    where = _resolved(Path.cwd(), str(path))
    if where is None or not policy.in_roots(where):
        raise _bad(path, "outside the checkpoint roots", "put the task file under a checkpoint root "
                   "(KILN_CHECKPOINT_ROOTS)")
    if not where.is_file():
        raise _bad(path, f"not found ({path})", "give the path of an existing .jsonl or lm-eval .yaml task file")
    if where.suffix == ".jsonl":
        raw = _read(where, path)
        digest = _sha(raw)
        try:
            items = CHECKS.run(_jsonl_items, raw, digest)
        except _Problem as p:
            raise _bad(path, p.problem, p.fix) from None
        return TaskFile(where, "jsonl", re.sub(r"[^A-Za-z0-9_.-]", "_", where.stem), items, "acc", "sha256:" + digest,
                        data={"test": [where]})
    if where.suffix not in (".yaml", ".yml"):
        raise _bad(path, f"unsupported file type {where.suffix or '(none)'!r}",
                   "use a .jsonl of items or an lm-eval .yaml")
    trusted = policy.trusted_folder(where)
    reading = _Reading(path, trusted or where.parent, trusted is not None)
    cfg = _merged(where, reading)
    _check_fields(path, cfg, reading.trusted)
    data = _data_files(path, where, cfg, policy)
    split = cfg.get("test_split") or cfg.get("validation_split")
    if split not in data:
        raise _bad(path, "test_split (or validation_split) names no split of data_files",
                   "set test_split (or validation_split) to a key of data_files")
    metric = _metric_of(path, cfg)
    rows: dict[Path, tuple[str | None, ...]] = {}
    shas: dict[Path, str] = {}
    for n, f in enumerate((f for fs in data.values() for f in fs), 1):
        raw = _read(f, path)
        shas[f] = _sha(raw)
        try:
            rows[f] = CHECKS.run(_data_rows, raw, shas[f])
        except _Problem as p:
            raise _bad(path, f"data file {n}: {p.problem}", p.fix) from None
    parts = reading.parts + [f"{name}:{shas[f]}" for name, fs in sorted(data.items()) for f in fs]
    ids = [i if i is not None else str(pos) for pos, i in enumerate(r for f in data[split] for r in rows[f])]
    if len(set(ids)) != len(ids):
        raise _bad(path, "item ids repeat", "give every item a distinct id (or none, to use positions)")
    return TaskFile(where, "yaml", cfg["task"], len(ids), metric,
                    "sha256:" + _sha("".join(f"{d}\n" for d in parts).encode()), reading.trusted, cfg, data)


def _check_fields(path: Path, cfg: dict, trusted: bool) -> None:
    if not isinstance(cfg.get("task"), str) or "group" in cfg or "task_list" in cfg:
        raise _bad(path, "not a single task (needs a task: name; groups are not supported)", "one task per YAML")
    if not trusted:
        if named := [k for k in CODE_FIELDS if k in cfg]:
            raise _bad(path, f"{named[0]} names code or files to read", TRUST_FIX)
        if any(k not in DATA_FIELDS for k in cfg):
            raise _bad(path, "a key that a task file may not set (outside KILN_TRUSTED_TASK_DIRS)",
                       "use the lm-eval task fields docs/tasks.md lists")
    output_type = cfg.get("output_type")
    if output_type != "multiple_choice":
        shown = repr(output_type) if output_type in OUTPUT_TYPES else "other than multiple_choice"
        raise _bad(path, f"output_type {shown} is not supported", "use output_type: multiple_choice")
    if missing := [k for k in ("doc_to_text", "doc_to_choice", "doc_to_target") if cfg.get(k) is None]:
        raise _bad(path, f"missing {', '.join(missing)}",
                   "say how an item becomes a prompt, its choices and its answer")


def _data_files(path: Path, where: Path, cfg: dict, policy: TaskPolicy) -> dict[str, list[Path]]:
    """The config's local ``data_files`` as {split: [resolved paths]} (a bare file or list is datasets' "train"),
    each under the checkpoint roots; relative paths are taken from the task YAML's folder."""
    if cfg.get("dataset_path") != "json":
        raise _bad(path, "dataset_path is not json: builds run offline",
                   "use dataset_path: json with local dataset_kwargs.data_files")
    kwargs = cfg.get("dataset_kwargs") or {}
    if not isinstance(kwargs, dict) or set(kwargs) - {"data_files"}:
        raise _bad(path, "dataset_kwargs holds more than data_files", "give only dataset_kwargs.data_files")
    files = kwargs.get("data_files")
    if not files:
        raise _bad(path, "no dataset_kwargs.data_files", "name the local JSON / JSONL file(s) of the items")
    files = files if isinstance(files, dict) else {"train": files}
    out: dict[str, list[Path]] = {}
    n = 0
    for split, names in files.items():
        names = [names] if isinstance(names, str) else names
        if not isinstance(split, str) or not isinstance(names, list) or not all(isinstance(f, str) for f in names):
            raise _bad(path, "data_files is not a file name, a list of them, or splits of them",
                       "name the local JSON / JSONL file(s) of the items")
        out[split] = []
        for name in names:
            n += 1
            target = _resolved(where.parent, name)
            if target is None or not policy.in_roots(target):
                raise _bad(path, f"data file {n} is outside the checkpoint roots",
                           "keep data files under a checkpoint root (KILN_CHECKPOINT_ROOTS); relative paths are "
                           "taken from the YAML's folder")
            if not target.is_file():
                raise _bad(path, f"data file {n} not found", "data_files paths are relative to the YAML's folder")
            out[split].append(target)
    return out


@functools.cache
def registered_metrics() -> tuple[frozenset[str], frozenset[str]]:
    """lm-eval's registered metric and aggregation names (nothing else is ever loaded as a metric)."""
    import lm_eval.api.metrics  # noqa: F401 (registers lm-eval's metrics)
    from lm_eval.api.registry import aggregation_registry, metric_registry

    return frozenset(metric_registry.keys()), frozenset(aggregation_registry.keys())


def _metric_of(path: Path, cfg: dict) -> str:
    """``acc`` or ``acc_norm``: the first of them in the task's metric list (lm-eval's default list: acc first).
    Every metric must be one of lm-eval's registered metrics (or, in a trusted task, a ``!function``)."""
    listed = cfg.get("metric_list") or []
    if not isinstance(listed, list):
        raise _bad(path, "metric_list is not a list", "list metrics as {metric: acc}")
    metrics, aggregations = registered_metrics()
    names = []
    for n, entry in enumerate(listed, 1):
        metric = entry.get("metric") if isinstance(entry, dict) else None
        if isinstance(metric, FunctionRef):
            continue
        if not isinstance(metric, str) or metric not in metrics or entry.get("hf_evaluate"):
            raise _bad(path, f"metric_list entry {n} is not one of lm-eval's registered metrics",
                       "name lm-eval metrics (acc, acc_norm, …): metrics are never loaded from files or the Hub")
        aggregation = entry.get("aggregation")
        if aggregation is not None and not isinstance(aggregation, FunctionRef) and aggregation not in aggregations:
            raise _bad(path, f"metric_list entry {n}: its aggregation is not one of lm-eval's",
                       "use a registered aggregation (mean) or none")
        names.append(metric)
    if chosen := next((m for m in names if m in METRICS), None if listed else "acc"):
        return chosen
    raise _bad(path, "metric_list has neither acc nor acc_norm", "list acc or acc_norm")

"""Task evaluation through lm-evaluation-harness: an engine answers multiple-choice / cloze items, scored by lm-eval.

A task is a file, in one of two forms (docs/tasks.md):

- an lm-eval task YAML (``output_type: multiple_choice``, ``dataset_path: json`` with local ``data_files``, relative
  paths taken from the YAML's folder), read with lm-eval's own YAML loader (``include:``, ``!function``);
- a ``.jsonl`` of items ``{"id": optional str, "context": str, "choices": [str, ...], "answer": int}``, turned into
  the equivalent lm-eval task config (fields named directly, the ``acc`` metric).

Both run through lm-eval's machinery — its ``TaskManager``, its request building (a choice is scored as the
continuation ``" " + choice`` of the context), its ``evaluator.evaluate`` and its per-item ``acc`` / ``acc_norm`` —
with :class:`RunnerLM`, which answers lm-eval's requests with any Kiln runner within an engine's limits, tokenizing
and truncating as lm-eval's ``hf`` model does (both agree on an unquantized checkpoint). Nothing is fetched and
nothing is written outside a temporary folder (the ``datasets`` cache of a run included).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import re
import tempfile
from pathlib import Path

import torch
from lm_eval.api.model import TemplateLM
from torch.nn import functional as F

from kiln.errors import SpecError
from kiln.progress import report

FIELD = "evaluation.tasks"
JSONL_KEYS = ("id", "context", "choices", "answer")
METRICS = ("acc", "acc_norm")


def _bad(path: Path, problem: str, fix: str) -> SpecError:
    return SpecError(f"task file {path.name}: {problem}", field=FIELD, fix=fix)


# -- task files ------------------------------------------------------------------------------------
def check_task_file(path: str | Path) -> dict:
    """Validate a task file without a model: ``{"name", "kind": "jsonl" | "yaml", "items", "metric", "digest"}``.
    ``digest`` is the sha256 of the content (the YAML, what it includes, its data and function files; never a path),
    the part of a build key that names the task. Raises :class:`SpecError` naming the line or item at fault."""
    path = Path(path)
    if not path.is_file():
        raise _bad(path, f"not found ({path})", "give the path of an existing .jsonl or lm-eval .yaml task file")
    if path.suffix == ".jsonl":
        ids = _check_jsonl(path)
        return {"name": _jsonl_name(path), "kind": "jsonl", "items": len(ids), "metric": "acc",
                "digest": "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()}
    if path.suffix not in (".yaml", ".yml"):
        raise _bad(path, f"unsupported file type {path.suffix or '(none)'!r}", "use a .jsonl of items or an lm-eval .yaml")
    with tempfile.TemporaryDirectory(prefix="kiln-task-check-") as tmp, _quiet():
        cfg = task_config(path, cache_dir=Path(tmp))
        task = _load_task(cfg, path)
        docs = list(task.eval_docs)
        for i, doc in enumerate(docs):
            try:
                task.doc_to_text(doc)
                choices, target = task.doc_to_choice(doc), task.doc_to_target(doc)
            except Exception as exc:
                raise _bad(path, f"item {i}: lm-eval cannot render it: {type(exc).__name__}: {exc}",
                           "fix doc_to_text / doc_to_choice / doc_to_target or the data") from None
            if not isinstance(choices, list) or len(choices) < 2:
                raise _bad(path, f"item {i}: {len(choices) if isinstance(choices, list) else 'no'} choices",
                           "each item needs at least 2 choices")
            if not (isinstance(target, int) and 0 <= target < len(choices)) and target not in choices:
                raise _bad(path, f"item {i}: target {target!r} is not one of its {len(choices)} choices",
                           "doc_to_target must give a choice index (0-based) or a choice's text")
        ids = _item_ids(docs)
        if len(set(ids)) != len(ids):
            raise _bad(path, "item ids repeat", "give every item a distinct id (or none, to use positions)")
        return {"name": task.config.task, "kind": "yaml", "items": len(docs), "metric": _metric_of(cfg),
                "digest": "sha256:" + hashlib.sha256("".join(f"{d}\n" for d in _yaml_files(path)).encode()).hexdigest()}


def _check_jsonl(path: Path) -> list[str]:
    fix = 'one JSON object per line: {"id": "optional", "context": "...", "choices": ["...", "..."], "answer": 0}'
    lines = path.read_text(encoding="utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    ids = []
    for n, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise _bad(path, f"line {n} is not JSON ({exc.msg})", fix) from None
        if not isinstance(row, dict):
            raise _bad(path, f"line {n} is not a JSON object", fix)
        if unknown := sorted(set(row) - set(JSONL_KEYS)):
            raise _bad(path, f"line {n}: unknown field(s) {', '.join(unknown)}", fix)
        if missing := [k for k in JSONL_KEYS[1:] if k not in row]:
            raise _bad(path, f"line {n}: missing {', '.join(missing)}", fix)
        choices, answer = row["choices"], row["answer"]
        if not isinstance(row["context"], str) or ("id" in row and not isinstance(row["id"], str)):
            raise _bad(path, f"line {n}: context and id must be strings", fix)
        if not isinstance(choices, list) or not all(isinstance(c, str) and c for c in choices):
            raise _bad(path, f"line {n}: choices must be a list of non-empty strings", fix)
        if len(choices) < 2 or len(set(choices)) != len(choices):
            raise _bad(path, f"line {n}: {len(choices)} choices ({len(set(choices))} distinct)",
                       "each item needs at least 2 distinct choices")
        if not isinstance(answer, int) or isinstance(answer, bool) or not 0 <= answer < len(choices):
            raise _bad(path, f"line {n}: answer {answer!r} is not an index of its {len(choices)} choices",
                       "answer is the 0-based index of the right choice")
        ids.append(row.get("id", str(n - 1)))
    if not ids:
        raise _bad(path, "no items", fix)
    if len(set(ids)) != len(ids):
        raise _bad(path, "item ids repeat", "give every item a distinct id (or none, to use line positions)")
    return ids


def _jsonl_name(path: Path) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", path.stem)


def _yaml_files(path: Path, top: bool = True) -> list[str]:
    """sha256 of the YAML, of what it includes (recursively), of its ``!function`` modules and of its data files."""
    from lm_eval.tasks._yaml_loader import load_yaml

    out = [hashlib.sha256(path.read_bytes()).hexdigest()]
    for module in re.findall(r"!function\s+([\w.]+)", path.read_text(encoding="utf-8")):
        py = path.parent / (module.rpartition(".")[0].replace(".", "/") + ".py")
        if py.is_file():
            out.append(hashlib.sha256(py.read_bytes()).hexdigest())
    includes = load_yaml(path, resolve_func=False, recursive=False).get("include") or []
    for inc in includes if isinstance(includes, list) else [includes]:
        out += _yaml_files(Path(inc) if Path(inc).is_absolute() else path.parent / inc, top=False)
    if top:
        files = _data_files(path, load_yaml(path, resolve_func=False))
        out += [f"{split}:{hashlib.sha256(Path(f).read_bytes()).hexdigest()}"
                for split, fs in sorted(files.items()) for f in fs]
    return out


def _data_files(path: Path, cfg: dict) -> dict[str, list[str]]:
    """The config's local ``data_files`` as {split: [absolute paths]} (a bare file or list is datasets' "train")."""
    if cfg.get("dataset_path") != "json":
        raise _bad(path, f"dataset_path {cfg.get('dataset_path')!r} is not supported (builds run offline)",
                   "use dataset_path: json with local dataset_kwargs.data_files")
    files = (cfg.get("dataset_kwargs") or {}).get("data_files")
    if not files:
        raise _bad(path, "no dataset_kwargs.data_files", "name the local JSON / JSONL file(s) of the items")
    files = files if isinstance(files, dict) else {"train": files}
    out = {}
    for split, fs in files.items():
        out[split] = [str(f if Path(f).is_absolute() else (path.parent / f).resolve())
                      for f in ([fs] if isinstance(fs, str) else fs)]
        if missing := [f for f in out[split] if not Path(f).is_file()]:
            raise _bad(path, f"data file {missing[0]} not found", "data_files paths are relative to the YAML's folder")
    return out


def task_config(path: str | Path, *, cache_dir: Path) -> dict:
    """The lm-eval task config (a dict for ``TaskManager.load``) of a task file, reading data through ``cache_dir``.
    A YAML is read with lm-eval's own loader; its ``data_files`` become absolute (relative to the YAML's folder)."""
    path = Path(path)
    if path.suffix == ".jsonl":
        return {"task": _jsonl_name(path), "dataset_path": "json", "output_type": "multiple_choice",
                "dataset_kwargs": {"data_files": {"test": str(path.resolve())}, "cache_dir": str(cache_dir)},
                "test_split": "test", "doc_to_text": "context", "doc_to_choice": "choices", "doc_to_target": "answer",
                "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]}
    from lm_eval.tasks._yaml_loader import load_yaml

    try:
        cfg = load_yaml(path, resolve_func=True)
    except Exception as exc:
        raise _bad(path, f"lm-eval cannot read it: {type(exc).__name__}: {exc}", "fix the YAML") from None
    if not isinstance(cfg.get("task"), str) or "group" in cfg or "task_list" in cfg:
        raise _bad(path, "not a single task (needs a task: name; groups are not supported)", "one task per YAML")
    if cfg.get("output_type") != "multiple_choice":
        raise _bad(path, f"output_type {cfg.get('output_type')!r} is not supported", "use output_type: multiple_choice")
    if missing := [k for k in ("doc_to_text", "doc_to_choice", "doc_to_target") if cfg.get(k) is None]:
        raise _bad(path, f"missing {', '.join(missing)}", "say how an item becomes a prompt, its choices and its answer")
    split = cfg.get("test_split") or cfg.get("validation_split")
    files = _data_files(path, cfg)
    if split not in files:
        raise _bad(path, f"split {split!r} is not among data_files ({', '.join(files)})",
                   "set test_split (or validation_split) to a key of data_files")
    _metric_of(cfg, path)
    cfg["dataset_kwargs"] = {**cfg["dataset_kwargs"], "data_files": files, "cache_dir": str(cache_dir)}
    return cfg


def _metric_of(cfg: dict, path: Path | None = None) -> str:
    """``acc`` or ``acc_norm``: the first of them in the task's metric list (lm-eval's default list: acc first)."""
    listed = [m.get("metric") if isinstance(m, dict) else m for m in cfg.get("metric_list") or []]
    if chosen := next((m for m in listed if m in METRICS), None if listed else "acc"):
        return chosen
    raise _bad(path or Path("?"), f"metric_list {listed} has neither acc nor acc_norm", "list acc or acc_norm")


def _load_task(cfg: dict, path: Path):
    from lm_eval.tasks import TaskManager

    try:
        return next(iter(TaskManager(include_defaults=False).load([cfg])["tasks"].values()))
    except Exception as exc:
        raise _bad(path, f"lm-eval cannot load the task: {type(exc).__name__}: {exc}", "fix the task file") from None


def _item_ids(docs: list, start: int = 0) -> list[str]:
    """An item's ``id`` field where it has one, else its position in the task: stable across runs and models."""
    return [str(d["id"]) if isinstance(d, dict) and d.get("id") is not None else str(i)
            for i, d in enumerate(docs, start)]


@contextlib.contextmanager
def _quiet():
    """lm-eval's logging at WARNING, its request-building progress bar and datasets' off, for the duration."""
    import datasets
    import lm_eval.api.task as lm_task

    logger = logging.getLogger("lm_eval")
    level, bars, bar = logger.level, datasets.is_progress_bar_enabled(), lm_task.tqdm
    logger.setLevel(logging.WARNING)
    datasets.disable_progress_bars()
    lm_task.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        logger.setLevel(level)
        lm_task.tqdm = bar
        if bars:
            datasets.enable_progress_bars()


# -- the LM ----------------------------------------------------------------------------------------
class RunnerLM(TemplateLM):
    """lm-eval's model interface over a Kiln runner (``logits([batch, seq] int64) -> [batch, seq, vocab]``) and a
    transformers tokenizer, within an engine's limits: at most ``max_batch`` rows and ``max_len`` tokens a call.

    Tokenization, truncation and scoring are those of lm-eval's ``hf`` model (``HFLM``): context and continuation
    encoded together and split (lm-eval's ``TemplateLM``), the input left-truncated to ``max_len`` tokens, the
    continuation's log-probabilities summed in float32, greedy when every continuation token is the argmax. Rows of
    a call are right-padded to the longest (and to 2 tokens, the least an exported engine takes): a causal model's
    logits at a position do not depend on later tokens. Identical inputs (the choices of a one-token cloze share
    one) run once. ``generate_until`` decodes greedily with one full forward per token (no KV cache)."""

    def __init__(self, runner, tokenizer, *, max_batch: int, max_len: int, max_gen_toks: int = 256):
        super().__init__()
        if max_batch < 1 or max_len < 2:
            raise ValueError(f"max_batch must be ≥ 1 and max_len ≥ 2 (got {max_batch}, {max_len})")
        if isinstance(tokenizer, (str, Path)):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(tokenizer))
        self.runner, self.tokenizer = runner, tokenizer
        self.max_batch, self.max_len, self.max_gen_toks = max_batch, max_len, max_gen_toks
        self.calls = 0  # runner.logits calls made, for the curious

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:  # HFLM's: BOS, else EOS (what an empty context is conditioned on)
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self.max_len

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        from lm_eval.models.utils import has_bos_prefix

        kw = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            kw["add_special_tokens"] = False
        return self.tokenizer.encode(string, **kw)

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def loglikelihood(self, requests, disable_tqdm: bool = True) -> list[tuple[float, bool]]:
        return super().loglikelihood(requests, disable_tqdm=True)

    def _forward(self, rows: list[list[int]]) -> torch.Tensor:
        """Log-probabilities [len(rows), width, vocab] of right-padded rows (width = longest row, at least 2)."""
        width = max(2, max(len(r) for r in rows))
        pad = self.eot_token_id if self.eot_token_id is not None else 0
        x = torch.tensor([list(r) + [pad] * (width - len(r)) for r in rows], dtype=torch.long)
        self.calls += 1
        return F.log_softmax(self.runner.logits(x).float().cpu(), dim=-1)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = True, **kwargs) -> list[tuple[float, bool]]:
        rows: list[tuple[list[int], list[int]]] = []
        for _, context, continuation in requests:
            if not 0 < len(continuation) <= self.max_len or not context:
                raise ValueError(f"a continuation of {len(continuation)} tokens does not fit {self.max_len} tokens")
            rows.append(((list(context) + list(continuation))[-(self.max_len + 1):][:-1], list(continuation)))
        by_input: dict[tuple[int, ...], list[int]] = {}
        for i, (row_input, _) in enumerate(rows):
            by_input.setdefault(tuple(row_input), []).append(i)
        inputs = sorted(by_input, key=lambda t: (-len(t), t))  # longest first: little padding within a batch
        out: list[tuple[float, bool]] = [(0.0, False)] * len(rows)
        for start in range(0, len(inputs), self.max_batch):
            chunk = inputs[start : start + self.max_batch]
            report("task sequence", start + len(chunk), len(inputs))
            for logprobs, inp in zip(self._forward([list(t) for t in chunk]), chunk):
                for i in by_input[inp]:
                    cont = torch.tensor(rows[i][1])
                    lp = logprobs[len(inp) - len(cont) : len(inp)]
                    out[i] = (float(lp.gather(1, cont[:, None]).sum()), bool((lp.argmax(-1) == cont).all()))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = True) -> list[float]:
        """Log-likelihood of whole strings in disjoint windows of ``max_len`` tokens (lm-eval's rolling windows)."""
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        owner, windows = [], []
        for n, (string,) in enumerate(r.args for r in requests):
            for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_len, context_len=1)):
                owner.append(n)
                windows.append((None, ctx, cont))
        totals = [0.0] * len(requests)
        for n, (ll, _) in zip(owner, self._loglikelihood_tokens(windows)):
            totals[n] += ll
        return totals

    def generate_until(self, requests, disable_tqdm: bool = True) -> list[str]:
        """Greedy continuations, stopped at a stop sequence, the end-of-text token, ``max_gen_toks`` or ``max_len``."""
        from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

        eos = self.tokenizer.decode([self.eot_token_id]) if self.eot_token_id is not None else None
        plans = []
        for context, gen_kwargs in (r.args for r in requests):
            kw = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
            if kw.get("do_sample"):
                raise ValueError("RunnerLM decodes greedily; the task asks for sampling (do_sample: true)")
            until, new = handle_stop_sequences(kw.get("until"), eos=eos), min(kw["max_gen_toks"], self.max_len - 1)
            plans.append((self.tok_encode(context)[-(self.max_len - new):], until, new))
        results = [""] * len(plans)
        order = sorted(range(len(plans)), key=lambda i: -len(plans[i][0]))
        for start in range(0, len(order), self.max_batch):
            seqs = {i: list(plans[i][0]) for i in order[start : start + self.max_batch]}
            made: dict[int, list[int]] = {i: [] for i in seqs}
            active = list(seqs)
            while active:
                logprobs = self._forward([seqs[i] for i in active])
                for row, i in zip(logprobs, list(active)):
                    tok = int(row[len(seqs[i]) - 1].argmax())
                    seqs[i].append(tok)
                    made[i].append(tok)
                    text = self.tok_decode(made[i])
                    if (tok == self.eot_token_id or any(s and s in text for s in plans[i][1])
                            or len(made[i]) >= plans[i][2] or len(seqs[i]) >= self.max_len):
                        active.remove(i)
            for i in seqs:
                results[i] = postprocess_generated_text(self.tok_decode(made[i]), plans[i][1], None)
        return results


# -- running ---------------------------------------------------------------------------------------
def evaluate_lm(lm, task_path: str | Path, *, limit: int | None = None, items: list[int] | None = None) -> dict:
    """Run one task file with an lm-eval model (a :class:`RunnerLM`, or e.g. lm-eval's own ``HFLM``):
    ``{"task", "metric", "items": [{"id", "correct", "score", "loglikelihoods"}...], "accuracy", "n"}``, items in
    the task's order, ``score`` the item's metric value (1.0 or 0.0), ``loglikelihoods`` one per choice.
    ``items``: only these items (positions in the task; lm-eval's ``samples``), e.g. one look of a sequential
    evaluation."""
    from lm_eval import evaluator

    path = Path(task_path)
    info = check_task_file(path)
    with tempfile.TemporaryDirectory(prefix="kiln-tasks-") as tmp, _quiet():
        task = _load_task(task_config(path, cache_dir=Path(tmp)), path)
        if task.get_config("num_fewshot") is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=1234)  # simple_evaluate's default fewshot seed
        out = evaluator.evaluate(lm=lm, task_dict={"tasks": {task.task_name: task}, "groups": {}, "group_map": {}},
                                 limit=limit, samples={task.task_name: sorted(items)} if items is not None else None,
                                 log_samples=True, bootstrap_iters=0)
    samples = sorted(out["samples"][task.task_name], key=lambda s: s["doc_id"])
    metric = info["metric"]
    scored = [{"id": _item_ids([s["doc"]], start=s["doc_id"])[0], "correct": bool(s[metric] == 1.0),
               "score": float(s[metric]), "loglikelihoods": [float(r[0]) for r in s["filtered_resps"]]}
              for s in samples]
    n = len(scored)
    return {"task": info["name"], "metric": metric, "items": scored, "n": n,
            "accuracy": sum(float(s[metric]) for s in samples) / n if n else 0.0}


def evaluate_task(runner, tokenizer_dir: str | Path, task_path: str | Path, *, max_batch: int, max_len: int,
                  limit: int | None = None, items: list[int] | None = None) -> dict:
    """One task file on a runner within an engine's limits (see :func:`evaluate_lm` for the result)."""
    return evaluate_lm(RunnerLM(runner, tokenizer_dir, max_batch=max_batch, max_len=max_len), task_path, limit=limit,
                       items=items)


def run_tasks(runner, tokenizer_dir: str | Path, paths: list[str | Path], *, max_batch: int, max_len: int,
              limit: int | None = None) -> list[dict]:
    """:func:`evaluate_task` for each task file, the tokenizer loaded once; every file is checked before any runs."""
    for p in paths:
        check_task_file(p)
    lm = RunnerLM(runner, tokenizer_dir, max_batch=max_batch, max_len=max_len)
    return [evaluate_lm(lm, p, limit=limit) for p in paths]

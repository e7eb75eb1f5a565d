"""Task evaluation through lm-evaluation-harness: an engine answers multiple-choice / cloze items, scored by lm-eval.

A task is a file, in one of two forms (docs/tasks.md):

- an lm-eval task YAML (``output_type: multiple_choice``, ``dataset_path: json`` with local ``data_files``, relative
  paths taken from the YAML's folder), read as data by validation/taskfile.py (``include:`` merged, ``!function``
  only in a trusted folder);
- a ``.jsonl`` of items ``{"id": optional str, "context": str, "choices": [str, ...], "answer": int}``, turned into
  the equivalent lm-eval task config (fields named directly, the ``acc`` metric).

Both run through lm-eval's machinery — its ``TaskManager``, its request building (a choice is scored as the
continuation ``" " + choice`` of the context), its ``evaluator.evaluate`` and its per-item ``acc`` / ``acc_norm`` —
with :class:`RunnerLM`, which answers lm-eval's requests with any Kiln runner within an engine's limits, tokenizing
and truncating as lm-eval's ``hf`` model does (both agree on an unquantized checkpoint). While a task is loaded and
evaluated (:func:`opened_task`) its templates render in Jinja's immutable sandbox and its metrics come only from
lm-eval's registry; a task of a trusted folder (``KILN_TRUSTED_TASK_DIRS``) has its ``!function`` modules imported
and its templates rendered unsandboxed. Nothing is fetched (data only from local files under the checkpoint roots,
metrics only from lm-eval's registry) and nothing is written outside a temporary folder (the ``datasets`` cache of a
run included).
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import functools
import hashlib
import importlib.util
import logging
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Iterator

import torch
from lm_eval.api.model import TemplateLM
from torch.nn import functional as F

from kiln.errors import SpecError
from kiln.progress import report
from validation.taskfile import FIELD, FunctionRef, TaskFile, TaskPolicy, check_task_file, read_task

__all__ = ["FIELD", "RunnerLM", "TaskPolicy", "check_task_file", "evaluate_lm", "evaluate_task", "opened_task",
           "run_tasks", "task_config"]
log = logging.getLogger(__name__)


def _bad(path: Path, problem: str, fix: str) -> SpecError:
    return SpecError(f"task file {path.name}: {problem}", field=FIELD, fix=fix)


# -- what a task may run ---------------------------------------------------------------------------
_TRUSTED = contextvars.ContextVar("kiln_trusted_task", default=False)
_GUARD = threading.Lock()
_GUARDED: dict[str, Any] = {"depth": 0}  # and, while depth > 0, lm-eval's own apply_template and get_metric


@functools.cache
def _sandbox():
    """lm-eval's template environment (``lm_eval.utils.env``: StrictUndefined, trailing newlines kept, its
    ``regex_replace`` filter), sandboxed: no attribute starting with ``_``, no mutating method."""
    from jinja2 import BaseLoader, StrictUndefined
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from lm_eval.utils import regex_replace

    env = ImmutableSandboxedEnvironment(loader=BaseLoader, undefined=StrictUndefined, keep_trailing_newline=True)
    env.filters["regex_replace"] = regex_replace
    return env


def _render(template: str, doc: dict) -> str:
    """lm-eval's ``apply_template`` while a task is guarded: sandboxed unless the task is trusted."""
    import lm_eval.utils

    env = lm_eval.utils.env if _TRUSTED.get() else _sandbox()
    return env.from_string(template).render(**doc)


def _registered_metric(name, hf_evaluate_metric: bool = False):
    """lm-eval's ``get_metric`` while a task is guarded: a registered metric, never ``evaluate.load`` of a name."""
    from lm_eval.api.registry import metric_registry

    if hf_evaluate_metric or not isinstance(name, str) or name not in metric_registry.keys():
        raise ValueError("only lm-eval's registered metrics are used")
    return metric_registry.get(name)


@contextlib.contextmanager
def guarded(*, trusted: bool) -> Iterator[None]:
    """For the duration, lm-eval renders templates in :func:`_sandbox` (unless ``trusted``: its own environment)
    and looks metrics up only in its registry. The patch stays while any guarded load runs, in any thread; each
    context (thread, task) sees its own ``trusted``, and a thread lm-eval starts sees the sandbox."""
    import lm_eval.api.task as lm_task
    import lm_eval.utils as lm_utils

    with _GUARD:
        if _GUARDED["depth"] == 0:
            _GUARDED.update(apply_template=lm_utils.apply_template, get_metric=lm_task.get_metric)
            lm_utils.apply_template, lm_task.get_metric = _render, _registered_metric  # type: ignore[assignment]
        _GUARDED["depth"] += 1
    token = _TRUSTED.set(trusted)
    try:
        yield
    finally:
        _TRUSTED.reset(token)
        with _GUARD:
            _GUARDED["depth"] -= 1
            if _GUARDED["depth"] == 0:
                lm_utils.apply_template, lm_task.get_metric = _GUARDED["apply_template"], _GUARDED["get_metric"]


def _imported(ref: FunctionRef, path: Path) -> Any:
    """A trusted task's ``!function``: its module file (checked to lie in the trusted folder) imported."""
    module_file = ref.file
    assert module_file is not None  # read_task refuses a !function without a module file
    name = "kiln_task_" + hashlib.sha256(str(module_file).encode()).hexdigest()[:16]
    spec = importlib.util.spec_from_file_location(name, module_file)
    try:
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return getattr(module, ref.name)
    except Exception as exc:
        log.warning("task file %s: its !function at line %d cannot be imported", path, ref.line, exc_info=True)
        raise _bad(path, f"line {ref.line}: its !function cannot be imported ({type(exc).__name__})",
                   "fix the module (the worker's log has the error)") from None


def _with_functions(value: Any, path: Path, seen: dict[int, Any]) -> Any:
    """``value`` with every :class:`FunctionRef` replaced by the function it names (shared parts replaced once)."""
    if isinstance(value, FunctionRef):
        return _imported(value, path)
    if id(value) in seen:
        return seen[id(value)]
    seen[id(value)] = value
    if isinstance(value, dict):
        for k, v in value.items():
            value[k] = _with_functions(v, path, seen)
    elif isinstance(value, list):
        value[:] = [_with_functions(v, path, seen) for v in value]
    return value


# -- task files ------------------------------------------------------------------------------------
def task_config(path: str | Path, *, cache_dir: Path, policy: TaskPolicy | None = None) -> dict:
    """The lm-eval task config (a dict for ``TaskManager.load``) of a task file, reading data through ``cache_dir``.
    A YAML is read as data (validation/taskfile.py); its ``data_files`` become absolute; a trusted task's
    ``!function`` modules are imported."""
    return _lm_eval_config(read_task(path, policy), cache_dir)


def _lm_eval_config(task: TaskFile, cache_dir: Path) -> dict:
    data_files = {split: [str(f) for f in fs] for split, fs in task.data.items()}
    if task.config is None:  # a .jsonl
        return {"task": task.name, "dataset_path": "json", "output_type": "multiple_choice",
                "dataset_kwargs": {"data_files": data_files, "cache_dir": str(cache_dir)},
                "test_split": "test", "doc_to_text": "context", "doc_to_choice": "choices", "doc_to_target": "answer",
                "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]}
    cfg = _with_functions(copy.deepcopy(task.config), task.path, {})
    cfg["dataset_kwargs"] = {"data_files": data_files, "cache_dir": str(cache_dir)}
    return cfg


def _load_task(cfg: dict, path: Path):
    from lm_eval.tasks import TaskManager

    try:
        return next(iter(TaskManager(include_defaults=False).load([cfg])["tasks"].values()))
    except SpecError:
        raise
    except Exception as exc:
        log.warning("task file %s: lm-eval cannot load it", path, exc_info=True)
        raise _bad(path, f"lm-eval cannot load the task ({type(exc).__name__})",
                   "fix the task file (templates render in Jinja's sandbox: no attribute starting with _)") from None


def _check_items(task, path: Path) -> None:
    """Every item renders to a prompt, at least 2 choices and a target among them (an index or a choice's text)."""
    for i, doc in enumerate(task.eval_docs):
        try:
            task.doc_to_text(doc)
            choices, target = task.doc_to_choice(doc), task.doc_to_target(doc)
        except Exception as exc:
            raise _bad(path, f"item {i}: lm-eval cannot render it ({type(exc).__name__})",
                       "fix doc_to_text / doc_to_choice / doc_to_target or the data (templates render in Jinja's "
                       "sandbox: no attribute starting with _)") from None
        if not isinstance(choices, list) or len(choices) < 2:
            raise _bad(path, f"item {i}: {len(choices) if isinstance(choices, list) else 'no'} choices",
                       "each item needs at least 2 choices")
        if not (isinstance(target, int) and 0 <= target < len(choices)) and target not in choices:
            shown = f"target {target}" if isinstance(target, int) else "its target"
            raise _bad(path, f"item {i}: {shown} is not one of its {len(choices)} choices",
                       "doc_to_target must give a choice index (0-based) or a choice's text")


@contextlib.contextmanager
def opened_task(path: str | Path, *, policy: TaskPolicy | None = None) -> Iterator[tuple[TaskFile, Any]]:
    """A task file read (validation/taskfile.py) and loaded as lm-eval's task, every item checked, for the duration:
    its ``datasets`` cache in a temporary folder, lm-eval quiet, and :func:`guarded` (a trusted task's templates
    unsandboxed). Raises :class:`SpecError` naming the item or field at fault, before any model runs."""
    task_file = read_task(path, policy)
    with tempfile.TemporaryDirectory(prefix="kiln-tasks-") as tmp, _quiet(), guarded(trusted=task_file.trusted):
        task = _load_task(_lm_eval_config(task_file, Path(tmp)), task_file.path)
        _check_items(task, Path(path))
        yield task_file, task


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
def evaluate_lm(lm, task_path: str | Path, *, limit: int | None = None, items: list[int] | None = None,
                policy: TaskPolicy | None = None) -> dict:
    """Run one task file with an lm-eval model (a :class:`RunnerLM`, or e.g. lm-eval's own ``HFLM``):
    ``{"task", "metric", "items": [{"id", "correct", "score", "loglikelihoods"}...], "accuracy", "n"}``, items in
    the task's order, ``score`` the item's metric value (1.0 or 0.0), ``loglikelihoods`` one per choice.
    ``items``: only these items (positions in the task; lm-eval's ``samples``), e.g. one look of a sequential
    evaluation. ``policy``: where the task's files may lie and whether it may run code (the settings' unless
    given)."""
    from lm_eval import evaluator

    with opened_task(task_path, policy=policy) as (info, task):
        if task.get_config("num_fewshot") is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=1234)  # simple_evaluate's default fewshot seed
        out = evaluator.evaluate(lm=lm, task_dict={"tasks": {task.task_name: task}, "groups": {}, "group_map": {}},
                                 limit=limit, samples={task.task_name: sorted(items)} if items is not None else None,
                                 log_samples=True, bootstrap_iters=0)
    samples = sorted(out["samples"][task.task_name], key=lambda s: s["doc_id"])
    metric = info.metric
    scored = [{"id": _item_ids([s["doc"]], start=s["doc_id"])[0], "correct": bool(s[metric] == 1.0),
               "score": float(s[metric]), "loglikelihoods": [float(r[0]) for r in s["filtered_resps"]]}
              for s in samples]
    n = len(scored)
    return {"task": info.name, "metric": metric, "items": scored, "n": n,
            "accuracy": sum(float(s[metric]) for s in samples) / n if n else 0.0}


def evaluate_task(runner, tokenizer_dir: str | Path, task_path: str | Path, *, max_batch: int, max_len: int,
                  limit: int | None = None, items: list[int] | None = None, policy: TaskPolicy | None = None) -> dict:
    """One task file on a runner within an engine's limits (see :func:`evaluate_lm` for the result)."""
    return evaluate_lm(RunnerLM(runner, tokenizer_dir, max_batch=max_batch, max_len=max_len), task_path, limit=limit,
                       items=items, policy=policy)


def run_tasks(runner, tokenizer_dir: str | Path, paths: list[str | Path], *, max_batch: int, max_len: int,
              limit: int | None = None, policy: TaskPolicy | None = None) -> list[dict]:
    """:func:`evaluate_task` for each task file, the tokenizer loaded once; every file is checked (read, loaded, its
    items rendered) before any runs."""
    policy = policy or TaskPolicy.of()
    for p in paths:
        with opened_task(p, policy=policy):
            pass
    lm = RunnerLM(runner, tokenizer_dir, max_batch=max_batch, max_len=max_len)
    return [evaluate_lm(lm, p, limit=limit, policy=policy) for p in paths]

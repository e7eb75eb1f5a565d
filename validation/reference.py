"""The unquantized reference's results on a build's evaluation — computed once per checkpoint × evaluation and
reused by every build of that checkpoint (any precision, recipe, profile, backend; any worker: the pipeline keeps
the folder :meth:`Reference.save` writes in the blob store under :func:`kiln.keys.reference_key`).

What is kept: the reference's final hidden states on the held-out text's windows (validation/accuracy.py's
:class:`~validation.accuracy.ReferenceWindows`; its logits are recomputed from them and the checkpoint's LM head)
and its per-item outcomes on each evaluation task
(validation/tasks.py). An engine is then compared with them item by item and window by window.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kiln.spec import BuildSpec
from validation.accuracy import ReferenceWindows, reference_windows
from validation.runners import LogitsHead
from validation.taskfile import TaskPolicy
from validation.text import RULE as TEXT_RULE
from validation.validate import eval_lengths, eval_tokens, task_limits

#: the reference runner has no shape limits: it runs at this batch whatever the engine's profile (results do not
#: depend on the batch beyond float rounding)
REFERENCE_BATCH = 16


@dataclass
class Reference:
    windows: ReferenceWindows  # at the evaluation's window length
    #: task file digest → the reference's outcomes (validation.tasks.evaluate_task's return value)
    tasks: dict[str, dict] = field(default_factory=dict)
    seconds: float = 0.0
    #: at each longer window length (validation/validate.eval_lengths), in order
    long: list[ReferenceWindows] = field(default_factory=list)

    @property
    def sets(self) -> list[ReferenceWindows]:
        """The windows at every evaluated length, the evaluation's own first."""
        return [self.windows, *self.long]

    def save(self, folder: Path) -> dict:
        self.windows.save(folder)
        for windows in self.long:
            windows.save(folder / f"seq-{windows.seq_len}")
        (folder / "tasks.json").write_text(json.dumps(self.tasks, sort_keys=True))
        record = {"seconds": round(self.seconds, 3), "windows": len(self.windows), "tasks": len(self.tasks),
                  "long": [w.seq_len for w in self.long]}
        (folder / "reference.json").write_text(json.dumps(record, sort_keys=True))
        return record

    @classmethod
    def load(cls, folder: Path, checkpoint_dir: Path) -> "Reference":
        """The stored results, with the LM head read from the checkpoint (validation/accuracy.py)."""
        meta = json.loads((folder / "reference.json").read_text())
        head = LogitsHead.load(checkpoint_dir)
        return cls(ReferenceWindows.load(folder, head), json.loads((folder / "tasks.json").read_text()),
                   meta["seconds"], [ReferenceWindows.load(folder / f"seq-{n}", head) for n in meta.get("long", [])])


def layout(spec: BuildSpec, dtype: torch.dtype = torch.float32) -> dict:
    """The evaluation's shape and what the reference computes in (validation/runners.reference_dtype), which its
    results depend on (part of the reference key): window lengths, the text convention's rule."""
    lengths = eval_lengths(spec)
    out = {"seq_len": lengths[0], "lengths": lengths, "max_tokens": spec.evaluation.max_tokens,
           "kept": "final hidden states, float32", "computed_in": str(dtype).removeprefix("torch."),
           "text": TEXT_RULE}
    if spec.evaluation.tasks:
        out["task_max_len"] = task_limits(spec)[1]
    return out


def compute_reference(runner, checkpoint_dir: Path, eval_text: str, spec: BuildSpec,
                      tasks: dict[str, Path] | None = None, task_policy: TaskPolicy | None = None) -> Reference:
    """Run the reference ``runner`` over the evaluation windows at every length and ``tasks`` (digest → task file,
    read under ``task_policy``: validation/taskfile.py, the settings' unless given)."""
    t = time.perf_counter()
    text = eval_tokens(checkpoint_dir, eval_text, spec)
    sets = [reference_windows(runner, text.ids, seq, max(1, REFERENCE_BATCH * text.seq // seq), text.convention)
            for seq in text.lengths]
    outcomes = {}
    if tasks:
        from validation.tasks import evaluate_task

        _, max_len = task_limits(spec)  # the engine's length limit (it decides truncation), not its batch limit
        for digest, path in tasks.items():
            outcomes[digest] = evaluate_task(runner, checkpoint_dir, Path(path), max_batch=REFERENCE_BATCH,
                                             max_len=max_len, policy=task_policy)
    return Reference(sets[0], outcomes, time.perf_counter() - t, sets[1:])

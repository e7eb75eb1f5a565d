"""Accuracy against the unquantized reference on held-out text, window by window, decided with confidence.

The text is cut into non-overlapping windows. The **reference** runs once per checkpoint × text × evaluation
settings (:func:`reference_windows`) and is kept as :class:`ReferenceWindows`: its final hidden states (the LM
head's input) on every window, with its LM head. From them its exact logits on any window cost one matrix product
— a fifth of a small model's forward, far less of a large one's — so every build of the checkpoint (any precision,
recipe, profile, backend) compares with the full reference distribution (exact KL over the whole vocabulary)
without running the reference again. (Keeping logits instead would take vocabulary-size floats per token; keeping
only their top k under-states the KL: the top 512 of SmolLM2's 49,152 tokens miss 4 % of an FP8 engine's KL.)

The **engine** is evaluated window by window in a random but fixed order (:func:`accuracy`), and with gates given
stops at the first planned look where every accuracy gate is decided (validation/stats.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.nn import functional as F

from kiln.progress import report
from validation import stats
from validation.runners import LogitsHead
from validation.text import Convention, cut

#: sequential evaluation: at least this share of the windows (and this many) before the first look
FLOOR_FRACTION, FLOOR_MIN = 0.125, 16
LOOKS = 6  # planned looks after the floor, at most
WINDOW_METRICS = ("ppl_increase_pct", "mean_kl", "top1_agreement")
GATE_METRIC = {"max_ppl_increase_pct": "ppl_increase_pct", "max_mean_kl": "mean_kl",
               "min_top1_agreement": "top1_agreement"}


#: the most logits (floats) one forward of the accuracy pass may hold: a window batch is cut to fit
#: (Gemma 3's 262,144-token vocabulary × 512 positions is 134 M floats a window)
LOGITS_BUDGET = 1 << 27


def windows(token_ids: torch.Tensor, seq_len: int, convention: Convention = Convention()) -> torch.Tensor:
    """Windows of ``seq_len + 1`` tokens (inputs plus the shifted targets), the tokenizer's prefix first
    (validation/text.py)."""
    return cut(token_ids, seq_len, convention)


def window_batch(batch: int, seq_len: int, vocab: int) -> int:
    """``batch`` windows a forward, fewer where their logits would pass :data:`LOGITS_BUDGET`."""
    return max(1, min(batch, LOGITS_BUDGET // max(1, seq_len * vocab)))


@dataclass
class ReferenceWindows:
    """The reference's final hidden states on every window (in window order) and its LM head: its exact logits on
    any window, for the price of one matrix product."""

    seq_len: int
    hidden: np.ndarray  # [W, seq, hidden] float32
    head: LogitsHead

    def __len__(self) -> int:
        return len(self.hidden)

    def logits(self, rows: list[int]) -> torch.Tensor:
        return self.head(torch.from_numpy(np.ascontiguousarray(self.hidden[rows])))

    def save(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        np.save(folder / "hidden.npy", self.hidden)
        (folder / "windows.json").write_text(json.dumps({"seq_len": self.seq_len, "windows": len(self),
                                                         "hidden_size": int(self.hidden.shape[-1])}))

    @classmethod
    def load(cls, folder: Path, head: LogitsHead) -> "ReferenceWindows":
        meta = json.loads((folder / "windows.json").read_text())
        return cls(int(meta["seq_len"]), np.load(folder / "hidden.npy", mmap_mode="r"), head)


def reference_windows(reference, token_ids: torch.Tensor, seq_len: int, batch: int,
                      convention: Convention = Convention()) -> ReferenceWindows:
    """Run the reference runner (a :class:`~validation.runners.TransformersRunner`) over every window of
    ``token_ids``, keeping its final hidden states."""
    w = windows(token_ids, seq_len, convention)
    hidden = []
    for i in range(0, len(w), batch):
        report("reference window", min(i + batch, len(w)), len(w))
        hidden.append(reference.hidden(w[i : i + batch, :-1]))
    return ReferenceWindows(seq_len, torch.cat(hidden).numpy(), reference.head())


def _window_sums(le: torch.Tensor, lr: torch.Tensor, y: torch.Tensor, skip: int = 0) -> dict:
    """Per window: the engine's and the reference's summed NLL, KL(reference ‖ engine) and top-1 agreement over
    its scored positions (all but the first ``skip``: targets that are the tokenizer's prefix). Per token in
    float32 (the logits' own precision: a per-token KL is off by ~1e-7, against gates of 1e-2), summed over tokens
    in float64."""
    le, lr, y = le[:, skip:], lr[:, skip:], y[:, skip:]
    out: dict[str, torch.Tensor] = {}
    step = max(1, LOGITS_BUDGET // 4 // max(1, le.shape[0] * le.shape[-1]))  # positions a pass: bounded copies
    for i in range(0, le.shape[1], step):
        e, r, t = le[:, i : i + step], lr[:, i : i + step], y[:, i : i + step, None]
        lpe, lpr = F.log_softmax(e.float(), -1), F.log_softmax(r.float(), -1)
        part = {"nll_engine": -lpe.gather(-1, t)[..., 0].double().sum(-1),
                "nll_reference": -lpr.gather(-1, t)[..., 0].double().sum(-1),
                "kl": F.kl_div(lpe, lpr, reduction="none", log_target=True).sum(-1).double().sum(-1),
                "agree": (e.argmax(-1) == r.argmax(-1)).sum(-1).double()}
        out = {k: out[k] + v for k, v in part.items()} if out else part
    return out


def plan_looks(total: int, batch: int) -> list[int]:
    """Window counts at which a sequential evaluation looks (at most :data:`LOOKS` + 1)."""
    floor = min(total, max(FLOOR_MIN, math.ceil(FLOOR_FRACTION * total)))
    step = max(batch, math.ceil((total - floor) / LOOKS)) if total > floor else total
    return stats.looks(total, floor=floor, step=step)


def accuracy(engine, reference, token_ids: torch.Tensor, seq_len: int, batch: int,
             gates: dict[str, float] | None = None, *, sequential: bool = True,
             convention: Convention = Convention()) -> dict:
    """Perplexity of engine and reference, top-1 agreement and mean per-token KL(reference ‖ engine), each with
    its paired interval and minimum detectable change. ``reference``: a :class:`ReferenceWindows`, or a runner
    (computed here). With ``gates`` (and ``sequential``), evaluation stops at the first planned look where every
    accuracy gate among them is decided; ``decisions`` holds each gate's decision there. ``convention``: the
    tokenizer's prefix, first in every window and never scored (validation/text.py)."""
    w = windows(token_ids, seq_len, convention)
    scored = seq_len - convention.skip
    if isinstance(reference, ReferenceWindows):
        if len(w) != len(reference) or reference.seq_len != seq_len:
            raise ValueError(f"the reference holds {len(reference)} windows of {reference.seq_len} tokens, the text "
                             f"gives {len(w)} of {seq_len}")
        reference_logits = reference.logits
    else:  # a runner: computed on the windows evaluated
        def reference_logits(rows):
            return reference.logits(w[rows, :-1])
    judged = {g: t for g, t in (gates or {}).items() if g in GATE_METRIC}
    order = stats.fixed_order(len(w))
    planned = plan_looks(len(w), batch) if judged and sequential else [len(w)]
    confidence = stats.look_confidence(planned)
    sums: dict[str, list] = {"nll_engine": [], "nll_reference": [], "kl": [], "agree": []}
    done, decisions, intervals = 0, {}, {}
    for look in planned:
        while done < look:
            rows = order[done : min(done + batch, look)]
            report("evaluation window", done + len(rows), len(w))
            chunk = w[rows]
            part = _window_sums(engine.logits(chunk[:, :-1]), reference_logits(rows), chunk[:, 1:], convention.skip)
            for k, v in part.items():
                sums[k].extend(v.tolist())
            done += len(rows)
        per_window = {**{k: np.asarray(v) for k, v in sums.items()}, "tokens": np.full(done, scored, dtype=np.float64)}
        intervals = stats.window_intervals(per_window, confidence)
        decisions = {g: stats.decide(g, intervals[m], intervals[m].value, t) for g, t in judged.items()
                     for m in (GATE_METRIC[g],)}
        if judged and stats.settled(list(decisions.values())):
            break
    count = done * scored
    nll_e, nll_r = float(np.sum(sums["nll_engine"])), float(np.sum(per_window["nll_reference"]))
    ppl, ref_ppl = _exp(nll_e / count), _exp(nll_r / count)
    return {
        "perplexity": ppl, "reference_perplexity": ref_ppl,
        "ppl_increase_pct": intervals["ppl_increase_pct"].value if math.isfinite(ppl) else math.inf,
        "top1_agreement": intervals["top1_agreement"].value,
        "mean_kl": intervals["mean_kl"].value if math.isfinite(intervals["mean_kl"].value) else math.inf,
        "tokens": count, "seq_len": seq_len, "positions": [0, seq_len - 1], "windows": done,
        "intervals": {m: intervals[m].as_dict() for m in WINDOW_METRICS},
        "mde": stats.window_mde(per_window),
        "sequential": {"windows": done, "of": len(w), "looks": planned, "confidence_per_look": confidence,
                       "stopped_early": done < len(w), "decisions": decisions, "order_seed": stats.SEED,
                       "alpha": stats.ALPHA},
        "per_window": {"index": order[:done], **{k: [round(float(x), 6) for x in v] for k, v in sums.items()}},
    }


def _exp(x: float) -> float:
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


def accuracy_at_lengths(engine, references, token_ids: torch.Tensor, lengths: list[int], batches: list[int],
                        gates: dict[str, float] | None = None, *, sequential: bool = True,
                        convention: Convention = Convention()) -> dict:
    """:func:`accuracy` at each window length of ``lengths`` (the evaluation's own, then the longer ones up to the
    profile's ``max_seq_len``: positions short windows never reach — a sliding window's edge, a long-context rope
    base). The first length's metrics are the report's headline; each longer length's are in ``long_windows``,
    judged by the same gates (validation/gates.py gives each its verdicts). Once the first length fails a gate the
    longer ones are not evaluated: the engine is rejected either way. ``references``: one
    :class:`ReferenceWindows` per length, or a reference runner."""
    def ref(i: int):
        return references[i] if isinstance(references, (list, tuple)) else references

    out = accuracy(engine, ref(0), token_ids, lengths[0], batches[0], gates, sequential=sequential,
                   convention=convention)
    out["long_windows"] = []
    for i, seq_len in enumerate(lengths[1:], 1):
        if stats.FAIL in out["sequential"]["decisions"].values():
            out["long_windows"].append({"seq_len": seq_len, "evaluated": False,
                                        "why": f"the {lengths[0]}-token windows failed a gate"})
            continue
        more = accuracy(engine, ref(i), token_ids, seq_len, batches[i], gates, sequential=sequential,
                        convention=convention)
        more.pop("per_window")
        out["long_windows"].append({**more, "evaluated": True})
    return out

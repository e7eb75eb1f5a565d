"""Measurements of a loaded artifact: accuracy against the unquantized reference and speed across the batch
profile's envelope. Each figure carries the conditions that produced it."""

from __future__ import annotations

import math
import os
import statistics
import time

import torch
from torch.nn import functional as F

from kiln.spec import BatchProfile


def windows(token_ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Non-overlapping windows of ``seq_len + 1`` tokens (inputs plus the shifted targets)."""
    n = (len(token_ids) - 1) // seq_len
    return torch.stack([token_ids[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)])


def accuracy(engine, reference, token_ids: torch.Tensor, seq_len: int, batch: int) -> dict:
    """Perplexity of engine and reference, top-1 agreement and mean per-token KL(reference ‖ engine)."""
    w = windows(token_ids, seq_len)
    nll_e = nll_r = kl = 0.0
    agree = count = 0
    for i in range(0, len(w), batch):
        chunk = w[i : i + batch]
        x, y = chunk[:, :-1], chunk[:, 1:].reshape(-1)
        le = engine.logits(x)
        lr = reference.logits(x)
        le, lr = le.reshape(-1, le.shape[-1]).double(), lr.reshape(-1, lr.shape[-1]).double()
        lpe, lpr = F.log_softmax(le, -1), F.log_softmax(lr, -1)
        nll_e += -lpe.gather(1, y[:, None]).sum().item()
        nll_r += -lpr.gather(1, y[:, None]).sum().item()
        kl += (lpr.exp() * (lpr - lpe)).sum().item()
        agree += (le.argmax(-1) == lr.argmax(-1)).sum().item()
        count += y.numel()
    ppl, ref_ppl = _exp(nll_e / count), _exp(nll_r / count)
    return {
        "perplexity": ppl, "reference_perplexity": ref_ppl,
        "ppl_increase_pct": (ppl / ref_ppl - 1.0) * 100.0 if math.isfinite(ppl) else math.inf,
        "top1_agreement": agree / count, "mean_kl": kl / count if math.isfinite(kl) else math.inf,
        "tokens": count, "seq_len": seq_len,
    }


def _exp(x: float) -> float:
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


def batch_points(max_batch: int) -> list[int]:
    """At least three batch sizes up to the profile's maximum where it allows (1, middle, max)."""
    return sorted({1, max(1, max_batch // 2), max_batch} | ({2} if max_batch >= 2 else set()))


def seq_points(profile: BatchProfile) -> list[int]:
    top = profile.max_input_len
    return sorted({max(1, top // 4), max(1, top // 2), top})


def throughput(engine, profile: BatchProfile, vocab: int, *, warmup: int = 1, reps: int = 3, seed: int = 0) -> list[dict]:
    """Prefill tokens/s at several (batch, sequence) points inside the envelope (median of ``reps``)."""
    gen = torch.Generator().manual_seed(seed)
    points = [(b, profile.max_input_len) for b in batch_points(profile.max_batch_size)]
    points += [(1, s) for s in seq_points(profile) if (1, s) not in points]
    out = []
    for b, s in points:
        x = torch.randint(0, vocab, (b, s), generator=gen)
        for _ in range(warmup):
            engine.logits(x)
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            engine.logits(x)
            times.append(time.perf_counter() - t)
        med = statistics.median(times)
        out.append({"batch_size": b, "seq_len": s, "tokens_per_s": b * s / med, "seconds_median": med,
                    "seconds_spread": max(times) - min(times), "reps": reps, "warmup": warmup})
    return out


def conditions(engine) -> dict:
    return {"device": engine.device, "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
            "torch": torch.__version__, "kv_cache": engine.kv_cache}

"""Where an engine's speed is measured: the (batch, sequence) points of the throughput sweep for a batch profile.
Its own module because both the measurements (validation/measure.py) and a runner that measures with its own
runtime (validation/runners.py TRTLLMRunner) read it, and measure imports the runners: here neither imports the
other for it."""

from __future__ import annotations

from kiln.spec import BatchProfile


def batch_points(max_batch: int) -> list[int]:
    """At least three batch sizes up to the profile's maximum where it allows (1, middle, max)."""
    return sorted({1, max(1, max_batch // 2), max_batch} | ({2} if max_batch >= 2 else set()))


def seq_points(profile: BatchProfile) -> list[int]:
    """Sequence lengths of the batch-1 sweep: fractions of the prompt length, the prompt length, and the longest
    sequence the engine accepts (``max_seq_len``: prompt plus generated tokens)."""
    top = profile.max_input_len
    return sorted({max(1, top // 4), max(1, top // 2), top, profile.max_seq_len})


def envelope_points(profile: BatchProfile) -> list[tuple[int, int]]:
    """(batch, sequence) points of the throughput sweep: every batch size at ``max_input_len``, then the
    sequence sweep at batch 1."""
    points = [(b, profile.max_input_len) for b in batch_points(profile.max_batch_size)]
    return points + [(1, s) for s in seq_points(profile) if (1, s) not in points]

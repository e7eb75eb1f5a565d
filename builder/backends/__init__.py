"""Backends by name. A backend turns the quantize stage's output into the artifact that ships."""

from __future__ import annotations

from builder.backends.aot_inductor import AOTInductorBackend
from builder.backends.base import Backend
from builder.backends.checkpoint import CheckpointBackend
from builder.backends.trtllm import TRTLLMBackend

BACKENDS: dict[str, type[Backend]] = {
    b.name: b for b in (AOTInductorBackend, CheckpointBackend, TRTLLMBackend)
}


def get_backend(name: str) -> Backend:
    return BACKENDS[name]()

"""Backends by name: the compile step each descriptor in kiln/backends.py names."""

from __future__ import annotations

from builder.backends.base import CompileStep
from kiln.backends import BACKENDS


def get_backend(name: str) -> CompileStep:
    return BACKENDS[name].load("compiler")()

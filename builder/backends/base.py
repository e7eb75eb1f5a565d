"""The backend seam: how a quantized checkpoint becomes the artifact a deployer loads. Each implementation is
named by its descriptor in kiln/backends.py, which owns the backend's rules and what it supports."""

from __future__ import annotations

import abc
from pathlib import Path

from kiln.backends import get_backend_info
from kiln.spec import BuildSpec


class Backend(abc.ABC):
    name: str

    @property
    def info(self):
        return get_backend_info(self.name)

    @abc.abstractmethod
    def plan(self, spec: BuildSpec, quantized_dir: Path, out_dir: Path) -> dict:
        """What compile would do, without doing it: ``{"commands": [[argv...]], "steps": [text...]}``."""

    def compute_dtype(self, spec: BuildSpec, quantized_dir: Path):
        """The dtype this backend's engine computes ``spec``'s quantized checkpoint in (what the ladder screens a
        rung in): float32, the checkpoint runner's, unless the backend computes in another."""
        import torch

        return torch.float32

    def check_environment(self, spec: BuildSpec) -> None:
        """Raise ToolchainMissing when this machine cannot build ``spec`` with this backend."""

    @abc.abstractmethod
    def compile(self, spec: BuildSpec, quantized_dir: Path, out_dir: Path, *, checkpoint_dir: Path) -> dict:
        """Build the engine directory ``out_dir`` (absent on entry) from the quantize stage's output
        ``quantized_dir`` (and the source checkpoint, for exports made from the saved calibration). Returns the
        stage's record."""

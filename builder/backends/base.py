"""The backend seam: how a quantized checkpoint becomes the artifact a deployer loads. Each implementation is
named by its descriptor in kiln/backends.py, which owns the backend's rules and what it supports."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kiln.backends import get_backend_info
from kiln.spec import BuildSpec


@dataclass(frozen=True)
class Kernels:
    """Where compiled kernels are kept for reuse by other weights. ``key(config, quantization, code)`` names one
    (kiln/keys.py ``kernel_key`` with the build's spec and toolchain); ``get(key, produce)`` returns its folder,
    made by ``produce(folder)`` when it is absent, and ``produce``'s record, or None when the kernel was reused. A
    build's are the stage cache's ``kernel`` stage (builder/pipeline.py)."""

    key: Callable[[dict, dict, dict], str]
    get: Callable[[str, Callable[[Path], dict]], tuple[Path, dict | None]]

    @classmethod
    def fresh(cls, spec: BuildSpec, root: Path) -> "Kernels":
        """Kernels made under ``root`` and kept nowhere else: a compile outside a build (tests, benchmarks)."""
        from kiln.keys import kernel_key
        from kiln.toolchain import toolchain_for

        toolchain = toolchain_for(spec.backend, spec.target)

        def get(key: str, produce: Callable[[Path], dict]) -> tuple[Path, dict | None]:
            folder = root / key.split(":", 1)[1]
            return (folder, None) if folder.is_dir() else (folder, produce(folder))

        return cls(lambda config, quantization, code: kernel_key(config, quantization, spec, toolchain, code), get)


class CompileStep(abc.ABC):
    """A backend's compile step (its descriptor, with the rest of what the backend is, is kiln/backends.py's
    ``Backend``)."""
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
    def compile(self, spec: BuildSpec, quantized_dir: Path, out_dir: Path, *, checkpoint_dir: Path,
                kernels: Kernels | None = None) -> dict:
        """Build the engine directory ``out_dir`` (absent on entry) from the quantize stage's output
        ``quantized_dir`` (and the source checkpoint, for exports made from the saved calibration). ``kernels``:
        where a backend that compiles code apart from its weights finds and keeps it. Returns the stage's record."""

"""The backend seam: how a quantized checkpoint becomes the artifact a deployer loads."""

from __future__ import annotations

import abc
from pathlib import Path

from kiln.spec import BuildSpec


class Backend(abc.ABC):
    name: str
    #: which export of the quantize stage this backend consumes: "hf" (unified) or "trtllm"
    consumes: str

    @abc.abstractmethod
    def plan(self, spec: BuildSpec, quantized_dir: Path, out_dir: Path) -> dict:
        """What compile would do, without doing it: ``{"commands": [[argv...]], "steps": [text...]}``."""

    def check_environment(self, spec: BuildSpec) -> None:
        """Raise ToolchainMissing when this machine cannot build ``spec`` with this backend."""

    @abc.abstractmethod
    def compile(self, spec: BuildSpec, quantized_dir: Path, out_dir: Path) -> dict:
        """Build the engine directory ``out_dir`` (absent on entry). Returns the stage's record."""

"""Toolchain versions that bind an artifact. They enter the BuildKey: change one and the engine is rebuilt."""

from __future__ import annotations

import platform
from importlib import metadata


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def cpu_capability() -> str:
    """The ISA level that AOTInductor generates code for on this host (an engine for AVX512 may not load on AVX2)."""
    import torch

    try:
        return torch.backends.cpu.get_cpu_capability()
    except Exception:  # older torch
        return "unknown"


def toolchain_for(backend: str, target: str) -> dict[str, str]:
    """Versions that can change the bytes of a ``backend`` build for ``target``."""
    import torch

    tc = {
        "kiln_recipe": "1",
        "torch": torch.__version__,
        "modelopt": _version("nvidia-modelopt") or "absent",
        "transformers": _version("transformers") or "absent",
    }
    if target == "cpu":
        tc["cpu"] = f"{platform.machine()}-{cpu_capability()}"
    elif backend == "aot-inductor":
        tc["cuda"] = str(torch.version.cuda)
    if backend == "trtllm-engine":
        tc["tensorrt_llm"] = _version("tensorrt-llm") or _version("tensorrt_llm") or "absent"
        tc["tensorrt"] = _version("tensorrt") or _version("tensorrt-cu12") or "absent"
        tc["cuda"] = str(torch.version.cuda)
    return tc

"""What this worker can build: importable backends, GPUs found through NVML (name, SM, memory) and the
toolchain versions that bind its engines. Queue names are derived from backend and target, so a build is only
ever consumed by a worker that can produce a valid engine for it."""

from __future__ import annotations

import importlib.util
import shutil

from kiln.spec import GPU_ARCHS
from kiln.toolchain import toolchain_for

QUEUE_PREFIX = "kiln"


def queue_name(backend: str, target: str) -> str:
    return f"{QUEUE_PREFIX}.{backend}.{target}"


def detect_gpus() -> list[dict]:
    """GPUs through NVML; an empty list where there is no driver or no NVML library."""
    try:
        import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except Exception:  # NVMLError_LibraryNotFound / DriverNotLoaded: a machine without NVIDIA GPUs
        return []
    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
            name = pynvml.nvmlDeviceGetName(handle)
            gpus.append({"index": i, "name": name.decode() if isinstance(name, bytes) else name,
                         "sm": f"sm{major}{minor}", "memory_bytes": int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)})
        return gpus
    finally:
        pynvml.nvmlShutdown()


def trtllm_available() -> bool:
    return importlib.util.find_spec("tensorrt_llm") is not None and shutil.which("trtllm-build") is not None


def cuda_torch() -> bool:
    import torch

    return torch.cuda.is_available()


def detect(gpus: list[dict] | None = None, *, trtllm: bool | None = None, cuda: bool | None = None) -> dict:
    """Capabilities and queues. Arguments override detection (for tests and for operators who pin a worker)."""
    gpus = detect_gpus() if gpus is None else gpus
    trtllm = trtllm_available() if trtllm is None else trtllm
    cuda = cuda_torch() if cuda is None else cuda
    gpu_targets = sorted({g["sm"] for g in gpus if g["sm"] in GPU_ARCHS})
    pairs = [("aot-inductor", "cpu"), ("checkpoint", "cpu")]
    if cuda:
        pairs += [(b, t) for t in gpu_targets for b in ("aot-inductor", "checkpoint")]
    if trtllm and cuda:
        pairs += [("trtllm-engine", t) for t in gpu_targets]
    queues = [queue_name(b, t) for b, t in pairs]
    return {
        "backends": sorted({b for b, _ in pairs}), "targets": sorted({t for _, t in pairs}), "gpus": gpus,
        "queues": queues, "toolchains": {queue_name(b, t): toolchain_for(b, t) for b, t in pairs},
    }

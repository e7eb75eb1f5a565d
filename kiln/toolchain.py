"""Toolchain versions that bind an artifact, and the GPUs this machine has.

The versions enter the BuildKey: change one and the engine is rebuilt. A TensorRT-LLM engine loads only on the
exact TensorRT / TensorRT-LLM version and GPU architecture that built it ("The engine plan file is not compatible
with this version of TensorRT", "generated on an incompatible device"), so for ``trtllm-engine`` these versions also
name the worker queue that builds it (workers/capabilities.py).

Versions are read from the installed distributions' metadata, never by importing the libraries: importing
``tensorrt_llm`` needs libcuda and MPI and takes seconds, which a worker's start-up and every build key must not.
GPUs are read through NVML (``pynvml`` from the ``nvidia-ml-py`` distribution), which needs only the driver.
"""

from __future__ import annotations

import logging
import os
import platform
from functools import lru_cache
from importlib import metadata

log = logging.getLogger(__name__)

#: distribution names TensorRT is published under (the release containers install one of these)
TENSORRT_DISTS = ("tensorrt", "tensorrt-cu12", "tensorrt_cu12", "tensorrt-cu13", "tensorrt_cu13",
                  "tensorrt-cu12-libs", "tensorrt_cu12_libs", "tensorrt-cu13-libs", "tensorrt_cu13_libs")
TENSORRT_LLM_DISTS = ("tensorrt-llm", "tensorrt_llm")
ABSENT = "absent"
#: version of the serving configurations the ``checkpoint`` backend writes beside its files (builder/serving.py);
#: part of that backend's toolchain, so a change to them is a new artifact, never a stale cached one
SERVING_CONFIG_VERSION = "1"


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _first_version(dists: tuple[str, ...]) -> str | None:
    for dist in dists:
        if (v := _version(dist)) is not None:
            return v
    return None


def tensorrt_version() -> str | None:
    return _first_version(TENSORRT_DISTS)


def tensorrt_llm_version() -> str | None:
    return _first_version(TENSORRT_LLM_DISTS)


def cpu_capability() -> str:
    """The ISA level that AOTInductor generates code for on this host (an engine for AVX512 may not load on AVX2)."""
    import torch

    try:
        return torch.backends.cpu.get_cpu_capability()
    except Exception:  # older torch
        return "unknown"


def toolchain_for(backend: str, target: str) -> dict[str, str]:
    """Versions that can change the bytes of a ``backend`` build for ``target`` (a copy: callers may change it)."""
    return dict(_toolchain_for(backend, target))


@lru_cache(maxsize=64)
def _toolchain_for(backend: str, target: str) -> dict[str, str]:
    """Read once per process: each metadata lookup scans every installed distribution (milliseconds), and the
    libraries a process has loaded cannot change under it."""
    import torch

    tc = {
        "kiln_recipe": "1",
        "torch": torch.__version__,
        "modelopt": _version("nvidia-modelopt") or ABSENT,
        "transformers": _version("transformers") or ABSENT,
    }
    from kiln.backends import get_backend_info

    if target == "cpu":
        tc["cpu"] = f"{platform.machine()}-{cpu_capability()}"
    readers = {"tensorrt_llm": lambda: tensorrt_llm_version() or ABSENT, "tensorrt": lambda: tensorrt_version() or ABSENT,
               "cuda": lambda: str(torch.version.cuda), "kiln_serving": lambda: SERVING_CONFIG_VERSION}
    for name in get_backend_info(backend).toolchain:  # what binds this backend's output (its descriptor says)
        if name != "cuda" or target != "cpu" or get_backend_info(backend).gpu_only:
            tc[name] = readers[name]()
    return tc


# -- GPUs ------------------------------------------------------------------------------------------
def _visible(gpus: list[dict], env: str | None) -> list[dict]:
    """The GPUs a CUDA process would see under ``CUDA_VISIBLE_DEVICES=env`` (None: all of them).

    NVML lists every GPU regardless of the variable; CUDA honours it. Entries are indices (in PCI bus order, the
    order NVML uses; Kiln's GPU image sets CUDA_DEVICE_ORDER=PCI_BUS_ID so CUDA agrees) or UUIDs (``GPU-…``,
    prefixes allowed). CUDA stops at the first entry it cannot resolve, and so does this function."""
    if env is None:
        return gpus
    chosen: list[dict] = []
    for token in (t.strip() for t in env.split(",")):
        if not token:
            break
        if token.lstrip("-").isdigit():
            idx = int(token)
            match = [g for g in gpus if g["index"] == idx]
        elif token.upper().startswith("GPU-"):
            match = [g for g in gpus if str(g.get("uuid", "")).upper().startswith(token.upper())][:1]
        else:  # MIG-… or anything else: not resolvable to a whole GPU here
            match = []
        if not match or match[0] in chosen:
            break
        chosen.append(match[0])
    return chosen


def detect_gpus(*, respect_visible_devices: bool = True) -> list[dict]:
    """GPUs through NVML: ``[{index, name, sm, memory_bytes, uuid}]``; an empty list where there is no NVML
    library or no driver (a machine without NVIDIA GPUs). Only the GPUs ``CUDA_VISIBLE_DEVICES`` leaves visible
    are returned unless ``respect_visible_devices`` is false."""
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
            try:
                uuid = pynvml.nvmlDeviceGetUUID(handle)
                uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
            except Exception:
                uuid = None
            gpus.append({"index": i, "name": name.decode() if isinstance(name, bytes) else str(name),
                         "sm": f"sm{major}{minor}", "memory_bytes": int(pynvml.nvmlDeviceGetMemoryInfo(handle).total),
                         "uuid": uuid})
    except Exception as exc:  # a GPU NVML cannot query: offer no GPU work rather than fail to start
        log.warning("NVML could not enumerate the GPUs (%s: %s); treating this machine as GPU-less",
                    type(exc).__name__, exc)
        return []
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
    return _visible(gpus, os.environ.get("CUDA_VISIBLE_DEVICES")) if respect_visible_devices else gpus


def gpus_of(gpus: list[dict], target: str) -> list[dict]:
    """The GPUs of architecture ``target`` (``sm90``)."""
    return [g for g in gpus if g.get("sm") == target]

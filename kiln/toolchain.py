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
from typing import Callable

log = logging.getLogger(__name__)

#: distribution names TensorRT is published under (the release containers install one of these)
TENSORRT_DISTS = ("tensorrt", "tensorrt-cu12", "tensorrt_cu12", "tensorrt-cu13", "tensorrt_cu13",
                  "tensorrt-cu12-libs", "tensorrt_cu12_libs", "tensorrt-cu13-libs", "tensorrt_cu13_libs")
TENSORRT_LLM_DISTS = ("tensorrt-llm", "tensorrt_llm")
ABSENT = "absent"
#: version of the serving configurations the ``checkpoint`` backend writes beside its files (builder/serving.py);
#: part of that backend's toolchain, so a change to them is a new artifact, never a stale cached one
SERVING_CONFIG_VERSION = "2"  # 2: vLLM on a CPU gets its KV-cache size and a command that starts


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


def lm_eval_version() -> str | None:
    """lm-evaluation-harness, which scores evaluation tasks (its version binds a stored reference's task outcomes)."""
    return _version("lm_eval")


def cpu_capability() -> str:
    """The ISA level that ATen and AOTInductor generate code for on this host (``AVX512``, ``AVX2``, ``DEFAULT``, …;
    ``ATEN_CPU_CAPABILITY`` lowers it). An engine compiled for AVX512 does not load on an AVX2 CPU."""
    import torch

    try:
        return torch.backends.cpu.get_cpu_capability()
    except Exception:  # older torch
        return "unknown"


#: capability levels per machine, lowest first: code for a level runs on every higher one
CPU_LEVELS = {"x86_64": ("DEFAULT", "AVX2", "AVX512"), "aarch64": ("DEFAULT", "SVE256")}
#: the feature that means "native bf16 matrix units": the ``cpu`` target computes a bf16 checkpoint in bf16
BF16 = "bf16"


def _proc_cpu_flags() -> set[str]:
    """``flags`` (x86) / ``Features`` (arm) of /proc/cpuinfo; empty where there is none."""
    try:
        text = open("/proc/cpuinfo", encoding="utf-8", errors="replace").read()
    except OSError:
        return set()
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip().lower() in ("flags", "features"):
            return set(value.split())
    return set()


def _has(probe: str, flag: str, flags: set[str]) -> bool:
    """torch's own cpuinfo probe (``torch.cpu._is_…_supported``), else the /proc/cpuinfo flag."""
    import torch

    fn = getattr(torch.cpu, probe, None)
    if fn is not None:
        try:
            return bool(fn())
        except Exception:
            pass
    return flag in flags


def cpu_features(machine: str | None = None, capability: str | None = None) -> frozenset[str]:
    """What an engine compiled here requires beyond its capability level, and whether bf16 is native.

    On x86 at the AVX512 level AOTInductor also compiles for the host's AVX512-VNNI, AMX (``-mamx-tile -mamx-bf16``)
    and AVX512-BF16 (``-mavx512bf16``) when it has them (``torch._inductor.cpu_vec_isa``: VecAVX512VNNI, VecAMX), so
    such a ``.so`` may not run on an AVX512 CPU without them: they are named (read through torch's cpuinfo probes
    — no compile — which can only name more than inductor used, never less). ``bf16`` is named where the CPU has
    native bf16 matrix units: AVX512-BF16 or AMX at the AVX512 level (oneDNN's ``_is_mkldnn_bf16_supported()``
    is no test of that on x86: it is also true on AVX512 CPUs without them, where oneDNN emulates bf16), or Arm's
    BF16 extension (there ``_is_mkldnn_bf16_supported()`` is exactly that cpuinfo flag)."""
    import torch

    machine = machine or platform.machine()
    capability = capability or cpu_capability()
    flags = _proc_cpu_flags()
    out: set[str] = set()
    if machine in ("x86_64", "AMD64") and capability == "AVX512":
        if _has("_is_vnni_supported", "avx512_vnni", flags):
            out.add("avx512_vnni")
        if _has("_is_amx_tile_supported", "amx_tile", flags):
            out.add("amx_tile")
        if _has("_is_avx512_bf16_supported", "avx512_bf16", flags):
            out.add("avx512_bf16")
        if "avx512_bf16" in out or ("amx_tile" in out and ("amx_bf16" in flags or not flags)):
            out.add(BF16)
    elif machine in ("aarch64", "arm64"):
        try:
            if torch.ops.mkldnn._is_mkldnn_bf16_supported():
                out.add(BF16)
        except Exception:
            pass
    return frozenset(out)


def host_cpu() -> str:
    """This host as the ``cpu`` entry of a toolchain: ``<machine>-<capability>[+feature…]``, e.g.
    ``x86_64-AVX2`` or ``x86_64-AVX512+amx_tile+avx512_bf16+avx512_vnni+bf16``. What a deployer passes to
    ``kiln resolve --runtime cpu=…`` (``python -c 'from kiln.toolchain import host_cpu; print(host_cpu())'``)."""
    machine, capability = platform.machine(), cpu_capability()
    return format_cpu(machine, capability, cpu_features(machine, capability))


def format_cpu(machine: str, capability: str, features) -> str:
    return f"{machine}-{capability}" + "".join(f"+{f}" for f in sorted(features))


def parse_cpu(value: str) -> tuple[str, str, frozenset[str]]:
    """``x86_64-AVX512+avx512_vnni`` → (machine, capability, features)."""
    head, *features = value.strip().split("+")
    machine, _, capability = head.rpartition("-")
    return machine, capability, frozenset(f for f in features if f)


def cpu_bf16_native(cpu: str) -> bool:
    """Whether a toolchain's ``cpu`` entry says native bf16 units."""
    return BF16 in parse_cpu(cpu)[2]


#: node-feature-discovery's label prefix for CPUID flags (``feature.node.kubernetes.io/cpu-cpuid.<FLAG>: "true"``)
NFD_CPUID = "feature.node.kubernetes.io/cpu-cpuid."
#: a cpu engine's requirement (capability level or feature of its ``cpu`` entry) → the CPUID flag NFD labels it by
#: (klauspost/cpuid's names). AVX2 and below are the x86-64 baseline Kiln assumes of every node; ``bf16`` is Kiln's
#: summary of AVX512-BF16 / AMX, already named by those.
NFD_FLAGS = {"AVX512": "AVX512F", "avx512_vnni": "AVX512VNNI", "avx512_bf16": "AVX512BF16", "amx_tile": "AMXTILE"}
#: a ``cpu`` entry's machine → the kubelet's ``kubernetes.io/arch`` label value
NODE_ARCH = {"x86_64": "amd64", "aarch64": "arm64"}


def node_requirements(cpu: str) -> dict[str, str]:
    """The node labels a pod must select (nodeSelector, or a required node-affinity term) for a cpu engine built
    on ``cpu`` to load on its node: the architecture (``kubernetes.io/arch``) and, for what the engine's ``.so``
    was compiled to use beyond the baseline, node-feature-discovery's CPUID labels. Admission checks them
    (api/admission.py), so an AVX512 engine is never scheduled onto an AVX2 node to die there with SIGILL."""
    machine, level, features = parse_cpu(cpu)
    out = {"kubernetes.io/arch": NODE_ARCH[machine]} if machine in NODE_ARCH else {}
    flags = [NFD_FLAGS[level]] if level in NFD_FLAGS else []
    flags += [NFD_FLAGS[f] for f in sorted(features) if f in NFD_FLAGS]
    out.update({NFD_CPUID + f: "true" for f in flags})
    return out


def cpu_incompatibility(built: str | None, asked: str) -> str | None:
    """Why an engine compiled on CPU ``built`` (a toolchain's ``cpu`` entry) may not load on CPU ``asked``, or
    None. Same machine; the engine's capability level at most the asked one's (AVX2 code runs on an AVX512 CPU,
    never the reverse); every feature the engine names present on the asked CPU (an asked value names its
    features: one that names none has none)."""
    if not built:
        return "built with cpu absent"
    b_machine, b_level, b_features = parse_cpu(built)
    a_machine, a_level, a_features = parse_cpu(asked)
    if b_machine != a_machine:
        return f"built for {b_machine}, asked {a_machine}"
    levels = CPU_LEVELS.get(b_machine, ())
    if b_level != a_level:
        if b_level not in levels or a_level not in levels:
            return f"built for {b_level}, asked {a_level}"
        if levels.index(b_level) > levels.index(a_level):
            return f"built for {b_level} code, which {a_level} cannot run"
    missing = sorted(b_features - a_features)
    if missing:
        return f"built with {', '.join(missing)}, which the asked CPU lacks"
    return None


def _cuda_version() -> str:
    import torch

    return str(torch.version.cuda)


#: toolchain entry → how it is read; a backend's descriptor names the entries that bind its output (``toolchain``)
READERS: dict[str, Callable[[], str]] = {
    "tensorrt_llm": lambda: tensorrt_llm_version() or ABSENT, "tensorrt": lambda: tensorrt_version() or ABSENT,
    "cuda": _cuda_version, "kiln_serving": lambda: SERVING_CONFIG_VERSION,
}


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
        tc["cpu"] = host_cpu()
    for name in get_backend_info(backend).toolchain:  # what binds this backend's output (its descriptor says)
        if name != "cuda" or target != "cpu" or get_backend_info(backend).gpu_only:
            tc[name] = READERS[name]()
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

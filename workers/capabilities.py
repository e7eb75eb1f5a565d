"""What this worker can build: importable backends, GPUs found through NVML (name, SM, memory, count) and the
toolchain versions that bind its engines. Queue names are derived from backend, target, tensor-parallel size and
(for ``trtllm-engine``) the TensorRT-LLM and TensorRT versions, so a build is only ever consumed by a worker that
can produce a valid engine for it.

Queue names (``kiln.<backend>.<target>[.trtllm-<v>.trt-<v>][.tp<N>]``):

- ``kiln.aot-inductor.cpu``, ``kiln.checkpoint.cpu``: every worker.
- ``kiln.aot-inductor.sm90``, ``kiln.checkpoint.sm90``: workers with CUDA torch and a GPU of that SM.
- ``kiln.trtllm-engine.sm90``: the **generic** engine queue — any worker with TensorRT-LLM and an sm90 GPU. An
  engine built from it is valid for whatever TensorRT-LLM / TensorRT that worker has (recorded in provenance).
- ``kiln.trtllm-engine.sm90.trtllm-1.2.1.trt-10.13.3``: the **versioned** queue — only workers whose TensorRT-LLM
  is 1.2.1 and TensorRT 10.13.3. A submitter that needs an engine loadable by a given runtime routes here.
- ``….tp2`` / ``.tp4`` / ``.tp8`` suffixes: tensor-parallel engines, consumed only by workers with at least that
  many visible GPUs of the SM (``tp1`` has no suffix). A TP build therefore waits for a worker that can hold it
  instead of failing on a smaller one.

Every worker serving ``trtllm-engine`` consumes both the generic and the versioned queues for each TP size it can
hold. ``queue_name(backend, target)`` (what workers/submit.py calls today) returns the generic, TP-1 name.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
from collections import Counter
from typing import Callable, Iterable

from kiln.backends import BACKENDS
from kiln.targets import CPU, GPU_ARCHS
from kiln.toolchain import ABSENT, detect_gpus, toolchain_for

QUEUE_PREFIX = "kiln"
TP_SIZES = (1, 2, 4, 8)
_VERSION_SAFE = re.compile(r"[^0-9A-Za-z.]+")
_QUEUE_RE = re.compile(
    r"^(?P<prefix>[^.]+)\.(?P<backend>[a-z-]+)\.(?P<target>[a-z0-9]+)"
    r"(?:\.trtllm-(?P<trtllm>[0-9A-Za-z.]+?)\.trt-(?P<trt>[0-9A-Za-z.]+?))?(?:\.tp(?P<tp>\d+))?$")

__all__ = ["QUEUE_PREFIX", "TP_SIZES", "cuda_torch", "detect", "detect_gpus", "parse_queue_name", "queue_name",
           "routing_queues", "trtllm_available", "versioned_suffix"]


def _clean(version: str) -> str:
    """A version as a queue-name segment: ``1.2.1+cu12`` → ``1.2.1.cu12`` (only digits, letters and dots)."""
    return _VERSION_SAFE.sub(".", version).strip(".")


def versioned_suffix(toolchain: dict | None) -> str | None:
    """``trtllm-<v>.trt-<v>`` for a toolchain that has both versions, else None."""
    if not toolchain:
        return None
    trtllm, trt = toolchain.get("tensorrt_llm"), toolchain.get("tensorrt")
    if not trtllm or not trt or ABSENT in (trtllm, trt):
        return None
    return f"trtllm-{_clean(str(trtllm))}.trt-{_clean(str(trt))}"


def queue_name(backend: str, target: str, *, tp_size: int = 1, toolchain: dict | None = None) -> str:
    """The queue a build of ``backend`` for ``target`` goes to.

    With the defaults this is the generic name (``kiln.trtllm-engine.sm90``). For a backend with versioned queues
    (its descriptor's ``versioned_queues``: ``trtllm-engine``), ``toolchain`` (with ``tensorrt_llm`` and
    ``tensorrt`` versions) selects the versioned queue; for a ``tensor_parallel`` one ``tp_size > 1`` the
    tensor-parallel queue; other backends ignore both."""
    name = f"{QUEUE_PREFIX}.{backend}.{target}"
    info = BACKENDS.get(backend)
    if info is None:
        return name
    if info.versioned_queues and (suffix := versioned_suffix(toolchain)) is not None:
        name += f".{suffix}"
    if info.tensor_parallel and tp_size > 1:
        name += f".tp{tp_size}"
    return name


def _one_queue(backend: str) -> bool:
    """A backend with one queue per target: no tensor-parallel and no versioned queues (its descriptor says)."""
    info = BACKENDS.get(backend)
    return info is None or not (info.tensor_parallel or info.versioned_queues)


def parse_queue_name(name: str) -> dict | None:
    """``kiln.trtllm-engine.sm90.trtllm-1.2.1.trt-10.13.3.tp2`` → {backend, target, tp_size, tensorrt_llm,
    tensorrt}; None for a name that is not a Kiln queue."""
    m = _QUEUE_RE.match(name)
    if m is None or m["prefix"] != QUEUE_PREFIX:
        return None
    return {"backend": m["backend"], "target": m["target"], "tp_size": int(m["tp"] or 1),
            "tensorrt_llm": m["trtllm"], "tensorrt": m["trt"]}


def _matches_runtime(parsed: dict, runtime: dict[str, str]) -> bool:
    for name in ("tensorrt_llm", "tensorrt"):
        want = runtime.get(name)
        if want is not None and parsed[name] != _clean(want):
            return False
    return True


def routing_queues(backend: str, target: str, tp_size: int, advertised: Iterable[str],
                   runtime: dict[str, str] | None = None) -> list[str]:
    """Queues a build may be sent to, best first, among the queues workers ``advertised``.

    Without ``runtime`` (``{"tensorrt_llm": "1.2.1", "tensorrt": "10.13.3"}``, either key optional): the versioned
    queues for (backend, target, tp_size) that some worker serves, newest version first, then the generic queue.
    With ``runtime``: only the versioned queues matching it — an engine for a pinned runtime must not be built by
    a worker with another one. A backend with neither versioned nor tensor-parallel queues has exactly one."""
    generic = queue_name(backend, target, tp_size=tp_size)
    if _one_queue(backend):
        return [generic]
    versioned = []
    for q in sorted(set(advertised)):
        p = parse_queue_name(q)
        if (p and p["backend"] == backend and p["target"] == target and p["tp_size"] == tp_size
                and p["tensorrt_llm"] is not None and _matches_runtime(p, runtime or {})):
            versioned.append((p["tensorrt_llm"], p["tensorrt"], q))

    def key(item):
        return tuple(tuple(int(x) if x.isdigit() else -1 for x in v.split(".")) for v in item[:2])

    ordered = [q for *_, q in sorted(versioned, key=key, reverse=True)]
    return ordered if runtime else ordered + [generic]


def trtllm_available() -> bool:
    return importlib.util.find_spec("tensorrt_llm") is not None and shutil.which("trtllm-build") is not None


def cuda_torch() -> bool:
    import torch

    return torch.cuda.is_available()


def detect(gpus: list[dict] | None = None, *, trtllm: bool | None = None, cuda: bool | None = None,
           toolchain: Callable[[str, str], dict] = toolchain_for) -> dict:
    """Capabilities and queues. Arguments override detection (for tests and for operators who pin a worker):
    ``gpus`` the NVML list, ``trtllm`` whether TensorRT-LLM is usable, ``cuda`` whether torch has CUDA,
    ``toolchain`` the version lookup (``toolchain_for``)."""
    gpus = detect_gpus() if gpus is None else gpus
    trtllm = trtllm_available() if trtllm is None else trtllm
    cuda = cuda_torch() if cuda is None else cuda
    counts = Counter(g["sm"] for g in gpus if g.get("sm") in GPU_ARCHS)
    gpu_targets = sorted(counts)
    have = {"tensorrt_llm": bool(trtllm)}  # what a backend's worker_needs may name
    plain = [b.name for b in BACKENDS.values() if not b.worker_needs]
    needing = [b.name for b in BACKENDS.values() if b.worker_needs and all(have[n] for n in b.worker_needs)]
    pairs = [(b, CPU) for b in plain if not BACKENDS[b].gpu_only]
    if cuda:
        pairs += [(b, t) for t in gpu_targets for b in plain]
        pairs += [(b, t) for b in needing for t in gpu_targets]
    queues: list[str] = []
    toolchains: dict[str, dict] = {}
    tp_sizes: dict[str, list[int]] = {}
    for backend, target in pairs:
        tc = toolchain(backend, target)
        if _one_queue(backend):
            names = [queue_name(backend, target)]
        else:
            info = BACKENDS[backend]
            tp_sizes[target] = [tp for tp in TP_SIZES if tp <= counts[target] and (info.tensor_parallel or tp == 1)]
            names = []
            for tp in tp_sizes[target]:
                names.append(queue_name(backend, target, tp_size=tp))
                if info.versioned_queues and versioned_suffix(tc) is not None:
                    names.append(queue_name(backend, target, tp_size=tp, toolchain=tc))
        for q in names:
            queues.append(q)
            toolchains[q] = tc
    return {
        "backends": sorted({b for b, _ in pairs}), "targets": sorted({t for _, t in pairs}), "gpus": gpus,
        "gpu_counts": dict(sorted(counts.items())), "tp_sizes": tp_sizes, "cuda": bool(cuda),
        "trtllm": bool(trtllm and cuda), "queues": queues, "toolchains": toolchains,
    }

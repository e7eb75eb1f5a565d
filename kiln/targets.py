"""Targets: one home for what Kiln knows of where an engine runs — ``cpu``, or a GPU architecture with its SM
number, the GPU products of it (as users type them and as GPU feature discovery labels nodes), the GPUs too old
for any precision, and the node labels a pod selects a GPU by — and the parsing of a target a user gives. What each
precision and backend needs of a target is theirs to say (kiln/precisions.py, kiln/backends.py); what a cpu
engine needs of a node's CPU is the toolchain's (kiln/toolchain.node_requirements)."""

from __future__ import annotations

import re
from dataclasses import dataclass

CPU = "cpu"


@dataclass(frozen=True)
class Target:
    name: str  # the canonical spelling, e.g. sm90
    sm: int
    title: str
    products: tuple[str, ...]  # GPU names as users type them: lower case, without "nvidia", spaces or dashes
    #: the memory of the smallest common data-centre card of the architecture, in decimal bytes as vendors state
    #: it (a little below the GiB the card has, so the default peak-memory budget errs on the safe side), and that
    #: card; a build for another card overrides the gate (L4: 24e9, H200: 141e9, B300: 288e9)
    memory_budget: tuple[float, str]


TARGETS: dict[str, Target] = {t.name: t for t in (
    Target("sm89", 89, "Ada Lovelace", ("l4", "l40", "l40s", "rtx4090", "rtx6000ada"), (48e9, "L40S, 48 GB")),
    Target("sm90", 90, "Hopper", ("h100", "h200", "gh200", "h20", "h800"), (80e9, "H100, 80 GB")),
    Target("sm100", 100, "Blackwell (data centre)", ("b100", "b200", "gb200"), (180e9, "B200, 180 GB")),
    Target("sm120", 120, "Blackwell (workstation)", ("rtx5090", "rtxpro6000"), (32e9, "RTX 5090, 32 GB")),
)}
#: architecture name → SM number
GPU_ARCHS = {t.name: t.sm for t in TARGETS.values()}
#: GPU product name → architecture name
GPU_NAMES = {p: t.name for t in TARGETS.values() for p in t.products}
#: GPUs users ask for that no Kiln precision supports, with their SM, so the error can say why
OLD_GPUS = {"a100": 80, "a10": 86, "a10g": 86, "a30": 80, "a40": 86, "rtx3090": 86, "t4": 75, "v100": 70}
#: the oldest architecture Kiln builds for (every precision's floor is at or above it)
FLOOR_SM = min(GPU_ARCHS.values())
#: node labels a pod selects a GPU by: Kiln's own (an architecture name) and GPU feature discovery's product
SM_LABEL = "kiln.dev/sm"
PRODUCT_LABEL = "nvidia.com/gpu.product"


def _error(message: str, fix: str) -> dict:
    return {"field": "target", "message": message, "fix": fix}


def normalize_target(value: str) -> tuple[str | None, dict | None]:
    """``cpu``, ``sm90`` or a GPU name (``h100``, ``NVIDIA H100``) → the canonical target, or an error dict naming
    the field ``target`` and how to fix it."""
    v = str(value).strip().lower().replace(" ", "").replace("_", "").replace("nvidia", "")
    v = v.replace("-", "") if not v.startswith("sm") else v
    if v == CPU or v in GPU_ARCHS:
        return v, None
    if v in GPU_NAMES:
        return GPU_NAMES[v], None
    digits = v[2:].isascii() and v[2:].isdigit() and len(v) <= 8  # "sm²" is a digit to str.isdigit, not to int()
    if v.startswith("sm") and digits and int(v[2:]) >= FLOOR_SM:
        return None, _error(f"{value!r} is not an architecture Kiln builds for", f"use one of {', '.join(GPU_ARCHS)} (or cpu)")
    if v in OLD_GPUS or (v.startswith("sm") and digits):
        sm = OLD_GPUS.get(v) or int(v[2:])
        return None, _error(f"{value!r} is sm{sm}; Kiln's precisions need sm{FLOOR_SM}+",
                            f"use a target of sm{FLOOR_SM} or newer ({', '.join(GPU_ARCHS)}) or cpu")
    return None, _error(f"unknown target {value!r}",
                        f"use cpu, one of {', '.join(GPU_ARCHS)}, or a GPU name such as {', '.join(list(GPU_NAMES)[:6])}")


def sm_of_product(product: str) -> str | None:
    """``NVIDIA-H100-80GB-HBM3`` (GPU feature discovery's product label) → ``sm90``; None if unknown."""
    tokens = [t for t in re.split(r"[-_ ]+", product.lower()) if t and t not in ("nvidia", "tesla", "geforce")]
    for n in range(len(tokens), 0, -1):
        name = "".join(tokens[:n])
        if name in GPU_NAMES:
            return GPU_NAMES[name]
        if name in OLD_GPUS:
            return f"sm{OLD_GPUS[name]}"
    return None

"""Line scans over the product's source, for tests that pin where something may happen (only the enqueue home
sends a task, only the services factory builds a service): each hit as ``path:line: text``."""

from __future__ import annotations

import re
from pathlib import Path

#: the shipped packages, and the scripts and benches that use them
PRODUCT = ("api", "workers", "builder", "artifacts", "validation", "kiln", "migrations", "scripts", "bench")


def lines_outside(root: Path, home: Path, pattern: re.Pattern, *, unless: re.Pattern | None = None,
                  packages=PRODUCT) -> list[str]:
    """Every line of ``packages`` under ``root`` that ``pattern`` finds, except in ``home`` (relative to ``root``)
    and except lines ``unless`` matches from their start."""
    found = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root)
            if rel == home:
                continue
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if pattern.search(line) and not (unless and unless.match(line)):
                    found.append(f"{rel}:{n}: {line.strip()}")
    return found

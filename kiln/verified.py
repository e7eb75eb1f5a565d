"""What ran where: the evidence behind each row of the support matrix (kiln/backends.py ``support_matrix``).

"Supported" says only that the descriptors allow a family × precision × backend; this module says what has run:

- the validated engines a registry holds of the row (its count and latest date, per target), read from the index
  (an engine is counted when its validation passed; its family is the one its provenance names);
- whether the test suite builds and validates it (:data:`SUITE`, the one table of what the suite runs:
  tests/integration/test_families.py reads its NVFP4 choice from here).

Each row gets ``verified.state``: ``built`` (the registry holds validated engines of it), ``test suite`` (none
here, but the default test suite builds it), ``never built`` (the registry holds none and the suite does not build
it) or ``no build history`` (no registry was read and the suite does not build it). ``kiln models`` and
``GET /v1/support`` both answer :func:`support_report`.
"""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any

from kiln.backends import support_matrix
from kiln.families import FAMILIES

if TYPE_CHECKING:  # SQLAlchemy is imported where an index is read: the client install has none
    from sqlalchemy.orm import Session

FAMILIES_TEST = "tests/integration/test_families.py"
CLI_BUILD_TEST = "tests/integration/test_cli_build.py"
#: the families whose NVFP4 test_families.py compiles with AOTInductor by default (the rest: the checkpoint
#: backend); with ``KILN_TEST_ALL_FAMILIES=1`` every family, and none on the checkpoint backend
SUITE_NVFP4_AOT = frozenset({"qwen3_moe"})
ALL_FAMILIES_ENV = "KILN_TEST_ALL_FAMILIES"
#: the target every build of the test suite runs on (no GPU here)
SUITE_TARGET = "cpu"


def _suite() -> dict[tuple[str, str, str], dict[str, Any]]:
    """(family, precision, backend) → where the test suite builds and validates it; ``default``: in the default
    run (false: only with KILN_TEST_ALL_FAMILIES=1)."""
    table: dict[tuple[str, str, str], dict[str, Any]] = {}

    def add(key: tuple[str, str, str], test: str, default: bool) -> None:
        row = table.setdefault(key, {"target": SUITE_TARGET, "tests": [], "default": False})
        row["tests"].append(test)
        row["default"] = row["default"] or default

    for family in FAMILIES:
        add((family, "fp8", "aot-inductor"), FAMILIES_TEST, True)
        add((family, "fp8", "checkpoint"), FAMILIES_TEST, True)
        aot = family in SUITE_NVFP4_AOT
        add((family, "nvfp4", "aot-inductor" if aot else "checkpoint"), FAMILIES_TEST, True)
        if not aot:
            add((family, "nvfp4", "aot-inductor"), f"{FAMILIES_TEST} with {ALL_FAMILIES_ENV}=1", False)
    add(("llama", "nvfp4", "aot-inductor"), CLI_BUILD_TEST, True)  # the shipped tiny Llama, default backend
    return table


#: What the test suite builds and validates: (family, precision, backend) → {target, tests, default}.
SUITE = _suite()


def suite_entry(family: str, precision: str, backend: str) -> dict[str, Any] | None:
    """Where the test suite builds and validates this row ({target, tests, default}); None where it does not."""
    s = SUITE.get((family, precision, backend))
    return None if s is None else {"target": s["target"], "tests": list(s["tests"]), "default": s["default"]}


def _iso(when: datetime | None) -> str | None:
    return when.isoformat() if when else None


def engine_counts(session: "Session") -> tuple[dict[tuple[str, str, str], dict[str, dict[str, Any]]], int, int]:
    """Validated engines in the index: (family, precision, backend) → target → {engines, latest}; with the number
    of validated engines counted and of those whose provenance names no family (built before it was recorded)."""
    from sqlalchemy import func, select

    from kiln.tables import Artifact

    # one grouped query: the family and the verdict read from the JSON columns by the database (PostgreSQL's
    # ``->>``, SQLite's ``json_extract``), not every artifact's provenance and report loaded here
    family = Artifact.provenance["family"].as_string()
    rows = session.execute(
        select(family, Artifact.precision, Artifact.backend, Artifact.target, func.count(),
               func.max(Artifact.created_at))
        .where(Artifact.validation["passed"].as_boolean().is_(True))
        .group_by(family, Artifact.precision, Artifact.backend, Artifact.target))
    counts: dict[tuple[str, str, str], dict[str, dict[str, Any]]] = {}
    total = unattributed = 0
    for fam, precision, backend, target, engines, latest in rows:
        total += engines
        if fam not in FAMILIES:
            unattributed += engines
            continue
        counts.setdefault((fam, precision, backend), {})[target] = {"engines": engines, "latest": latest}
    return counts, total, unattributed


def verified(row: dict, counts: dict | None) -> dict:
    """The evidence for one support-matrix row; ``counts`` from :func:`engine_counts`, None without a registry."""
    key = (row["family"], row["precision"], row["backend"])
    suite = SUITE.get(key)
    targets = (counts or {}).get(key, {})
    latest = max((t["latest"] for t in targets.values() if t["latest"] is not None), default=None)
    engines = sum(t["engines"] for t in targets.values())
    if engines:
        state = "built"
    elif suite is not None and suite["default"]:
        state = "test suite"
    else:
        state = "never built" if counts is not None else "no build history"
    return {"state": state, "engines": engines if counts is not None else None, "latest": _iso(latest),
            "targets": {t: {"engines": c["engines"], "latest": _iso(c["latest"])} for t, c in sorted(targets.items())},
            "suite": suite_entry(*key)}


def support_report(session: "Session | None", *, no_history: str = "") -> dict:
    """The support matrix with each row's ``verified`` evidence, and ``history``: whether a registry was read
    (``session``; None: no registry, ``no_history`` says why), how many validated engines it holds and how many of
    them name no family."""
    counts: dict | None
    history: dict[str, Any]
    if session is None:
        counts, history = None, {"registry": False, "engines": None, "unattributed": None,
                                 "note": no_history or "no build history: no registry database"}
    else:
        counts, total, unattributed = engine_counts(session)
        note = f"{total} validated engine{'s' if total != 1 else ''} in the registry"
        if unattributed:
            note += f" ({unattributed} built before engines recorded their family, not counted per row)"
        history = {"registry": True, "engines": total, "unattributed": unattributed, "note": note}
    return {"support": [{**row, "verified": verified(row, counts)} for row in support_matrix()], "history": history}

"""docs/models.md's table of what the test suite builds, read from the test that builds it.

    python scripts/models_doc.py          # rewrites the table between the markers in docs/models.md
    python scripts/models_doc.py --check  # exits 1 when docs/models.md differs from what this would write

The table sits between ``<!-- models-suite: begin -->`` and ``<!-- models-suite: end -->``: one row per family, one
column per backend × precision (the order of kiln/backends.py and kiln/precisions.py), each cell saying in which
runs tests/integration/test_families.py builds that family with that precision on that backend — every run, the
default run only, or only with ``KILN_TEST_ALL_FAMILIES=1``. It is read from the test's own source (its
``NVFP4_AOT`` assignment and the ``precision=`` / ``backend=`` of each ``builder.build(_spec(...))`` call,
evaluated for each family in both runs), not written by hand, so a change of what the test builds makes the page
stale until this script runs again (tests/unit/test_docs.py checks it). The script reads the test as text: nothing
outside tests/ imports the tests (pyproject.toml's import contracts). The test runs over every family of
kiln/families.py (tests/unit/kiln/test_families.py pins ``FAMILY_CONFIGS`` to ``FAMILIES``)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "models.md"
TEST = REPO / "tests" / "integration" / "test_families.py"
BEGIN, END = "<!-- models-suite: begin -->", "<!-- models-suite: end -->"
ENV = "KILN_TEST_ALL_FAMILIES"
#: the runs a cell can name: the default run, and the run with KILN_TEST_ALL_FAMILIES=1
RUNS = {"default": {}, "all": {ENV: "1"}}
WORDS = {frozenset(RUNS): "yes", frozenset({"default"}): "default run only",
         frozenset({"all"}): f"only with {ENV}=1", frozenset(): "—"}


def _fail(what: str) -> SystemExit:
    return SystemExit(f"models_doc: {what} in {TEST.relative_to(REPO)}; update scripts/models_doc.py to read it")


def _expression(node: ast.expr, names: dict) -> object:
    """Evaluate one expression of the test's source with the names it uses bound to ``names``."""
    try:
        return eval(compile(ast.Expression(node), str(TEST), "eval"), {"__builtins__": {"set": set}}, names)
    except Exception as exc:  # a name or a form this script does not know
        raise _fail(f"cannot evaluate {ast.unparse(node)!r} ({exc})") from None


def suite_builds(source: str | None = None) -> dict[tuple[str, str, str], frozenset[str]]:
    """(family, backend, precision) → the runs (``default``, ``all``) in which the family test builds it."""
    from kiln.families import FAMILIES

    tree = ast.parse(source if source is not None else TEST.read_text())
    assigns = [n.value for n in tree.body if isinstance(n, ast.Assign)
               and any(isinstance(t, ast.Name) and t.id == "NVFP4_AOT" for t in n.targets)]
    calls = [(kw["precision"], kw["backend"]) for n in ast.walk(tree)
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "build"
             and n.args and isinstance(n.args[0], ast.Call) and isinstance(n.args[0].func, ast.Name)
             and n.args[0].func.id == "_spec"
             for kw in [{k.arg: k.value for k in n.args[0].keywords}] if {"precision", "backend"} <= kw.keys()]
    if len(assigns) != 1:
        raise _fail("no single NVFP4_AOT assignment")
    if not calls:
        raise _fail("no builder.build(_spec(..., precision=..., backend=...)) call")
    cells: dict[tuple[str, str, str], set[str]] = {}
    for run, environ in RUNS.items():
        nvfp4_aot = _expression(assigns[0], {"os": SimpleNamespace(environ=environ), "FAMILY_CONFIGS": dict(FAMILIES)})
        for family in FAMILIES:
            for precision, backend in calls:
                names = {"family": family, "NVFP4_AOT": nvfp4_aot}
                key = (family, _expression(backend, names), _expression(precision, names))
                cells.setdefault(key, set()).add(run)
    return {k: frozenset(v) for k, v in cells.items()}


def table(source: str | None = None) -> str:
    """The block between the markers: the table and its legend."""
    from kiln.backends import BACKENDS
    from kiln.families import FAMILIES
    from kiln.precisions import PRECISIONS

    builds = suite_builds(source)
    unknown = {(b, p) for _, b, p in builds} - {(b, p) for b in BACKENDS for p in PRECISIONS}
    if unknown:
        raise _fail(f"builds with an unknown backend or precision {sorted(unknown)}")
    cols = [(b, p) for b in BACKENDS for p in PRECISIONS]
    lines = ["| family | model_type | " + " | ".join(f"{b} {p}" for b, p in cols) + " |",
             "|" + "---|" * (2 + len(cols))]
    for name, family in FAMILIES.items():
        cells = [WORDS[builds.get((name, b, p), frozenset())] for b, p in cols]
        lines.append(f"| {family.title} | {', '.join(family.model_types)} | " + " | ".join(cells) + " |")
    lines += ["", f"Generated by `python scripts/models_doc.py` from `{TEST.relative_to(REPO)}`: \"yes\" — built, "
              f"validated and published in every run of the suite; \"default run only\" — in a plain run, not with "
              f"`{ENV}=1`; \"only with {ENV}=1\" — "
              "not in a plain run; \"—\" — not built by this test."]
    return "\n".join(lines) + "\n"


def render(text: str, source: str | None = None) -> str:
    """``text`` (docs/models.md) with the block between the markers replaced by :func:`table`."""
    if BEGIN not in text or END not in text:
        raise SystemExit(f"models_doc: {DOC.relative_to(REPO)} has no {BEGIN} … {END} markers")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{table(source)}{END}{tail}"


def main() -> int:
    sys.path.insert(0, str(REPO))
    text = DOC.read_text()
    if "--check" in sys.argv[1:]:
        if render(text) != text:
            print("models_doc: docs/models.md is stale; run python scripts/models_doc.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(render(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())

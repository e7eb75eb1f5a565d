"""The docs against the code they describe: docs/architecture.md names every module there is and none that is not,
what `kiln models` and docs/models.md say the suite builds (kiln/verified.py's SUITE) is what
tests/integration/test_families.py builds, and every link between the Markdown pages reaches a page and a heading that exist."""

from __future__ import annotations

import ast
import re
import tomllib
from fnmatch import fnmatch
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import REPO

ARCHITECTURE = REPO / "docs" / "architecture.md"


def shipped_modules() -> set[str]:
    """Every Python file of the packages pyproject.toml ships, and of client/ (kiln-client's build backend); an empty
    ``__init__.py`` is only a package marker and is left out."""
    include = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    roots = [d for d in REPO.iterdir() if d.is_dir() and any(fnmatch(d.name, pattern) for pattern in include)
             and (d / "__init__.py").is_file()] + [REPO / "client"]
    found = set()
    for root in roots:
        for path in root.rglob("*.py"):
            if "__pycache__" in path.parts or (path.name == "__init__.py" and not path.read_text().strip()):
                continue
            found.add(path.relative_to(REPO).as_posix())
    return found


def per_value_modules() -> dict[str, set[str]]:
    """The packages with one module per value of an axis, which architecture.md lists as one row naming the pattern:
    pattern → the modules the axis's table names."""
    from builder.resolve import SOURCE_IO
    from kiln.backends import BACKENDS

    return {"builder/backends/<backend>.py": {b.compiler.partition(":")[0].replace(".", "/") + ".py"
                                              for b in BACKENDS.values()},
            "builder/sources/<kind>.py": {f"builder/sources/{kind}.py" for kind in SOURCE_IO}}


def listed_modules(text: str) -> dict[str, str]:
    """The rows of architecture.md's "Modules" section: module path → its line; a per-value row stands for every
    module its axis's table names."""
    section = text.split("\n## Modules\n", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| `([^`]+\.py)` \| (.*) \|$", section, flags=re.M))
    for pattern, modules in per_value_modules().items():
        if pattern in rows:
            line = rows.pop(pattern)
            rows.update({module: line for module in modules})
    return rows


def test_architecture_md_names_every_module_and_only_modules_that_exist():
    listed = listed_modules(ARCHITECTURE.read_text())
    modules = shipped_modules()
    assert len(modules) > 100  # the walk found the packages
    missing, extra = sorted(modules - set(listed)), sorted(set(listed) - modules)
    assert not missing, f"docs/architecture.md 'Modules' does not name {missing}: add a row (module | what it does)"
    assert not extra, f"docs/architecture.md 'Modules' names {extra}, which do not exist: remove or rename the rows"
    assert all(len(line.strip()) > 10 for line in listed.values()), "every module has a line saying what it does"


def test_every_python_path_architecture_md_mentions_exists():
    named = set(re.findall(r"\b((?:[\w.-]+/)+[\w-]+\.py)\b", ARCHITECTURE.read_text()))
    assert named
    gone = sorted(p for p in named if not (REPO / p).is_file())
    assert not gone, f"docs/architecture.md names files that do not exist: {gone}"


def test_architecture_md_states_the_layer_rule_pyproject_enforces():
    text = ARCHITECTURE.read_text()
    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = next(c for c in contracts if c["type"] == "layers")["layers"]
    assert "  →  ".join(layer.replace(" | ", "/ | ") + "/" for layer in layers) in text  # api/  →  workers/  →  …
    assert "tests/unit/test_layers.py" in text and "[tool.importlinter]" in text


# -- kiln/verified.py's SUITE: what the family test builds ----------------------------------------------------------
FAMILIES_TEST = REPO / "tests" / "integration" / "test_families.py"
RUNS = {"default": {}, "all": {"KILN_TEST_ALL_FAMILIES": "1"}}


def _evaluate(node: ast.expr, names: dict) -> object:
    return eval(compile(ast.Expression(node), "test_families.py", "eval"), {"__builtins__": {"set": set}}, names)


def suite_builds(source: str) -> dict[tuple[str, str, str], frozenset[str]]:
    """(family, precision, backend) → the runs (``default``, ``all``) in which a test of test_families.py's form
    builds it: its ``NVFP4_AOT`` assignment evaluated in each run, the ``precision=`` / ``backend=`` of each
    ``builder.build(_spec(...))`` call evaluated per family. Read as text: the test's source, not its import."""
    from kiln.families import FAMILIES
    from kiln.verified import ALL_FAMILIES_ENV, SUITE_NVFP4_AOT

    tree = ast.parse(source)
    assigns = [n.value for n in tree.body if isinstance(n, ast.Assign)
               and any(isinstance(t, ast.Name) and t.id == "NVFP4_AOT" for t in n.targets)]
    calls = [(kw["precision"], kw["backend"]) for n in ast.walk(tree)
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "build"
             and n.args and isinstance(n.args[0], ast.Call) and isinstance(n.args[0].func, ast.Name)
             and n.args[0].func.id == "_spec"
             for kw in [{k.arg: k.value for k in n.args[0].keywords}] if {"precision", "backend"} <= kw.keys()]
    assert len(assigns) == 1 and calls, "test_families.py no longer has one NVFP4_AOT and builder.build(_spec(...)) calls"
    cells: dict[tuple[str, str, str], set[str]] = {}
    for run, environ in RUNS.items():
        nvfp4_aot = _evaluate(assigns[0], {"os": SimpleNamespace(environ=environ), "FAMILY_CONFIGS": dict(FAMILIES),
                                           "ALL_FAMILIES_ENV": ALL_FAMILIES_ENV, "SUITE_NVFP4_AOT": SUITE_NVFP4_AOT})
        for family in FAMILIES:
            for precision, backend in calls:
                names = {"family": family, "NVFP4_AOT": nvfp4_aot}
                cells.setdefault((family, _evaluate(precision, names), _evaluate(backend, names)), set()).add(run)
    return {k: frozenset(v) for k, v in cells.items()}


def suite_disagreements(builds: dict[tuple[str, str, str], frozenset[str]]) -> list[str]:
    """Where kiln/verified.py's SUITE (what `kiln models` and docs/models.md say the suite runs) and the family
    test's builds differ."""
    from kiln.verified import FAMILIES_TEST as NAME, SUITE

    # per row, whether SUITE says the family test builds it in a plain run (its name alone) or only in the
    # KILN_TEST_ALL_FAMILIES=1 run (its name "with …")
    said = {key: NAME in row["tests"] for key, row in SUITE.items() if any(t.startswith(NAME) for t in row["tests"])}
    done = {key: "default" in runs for key, runs in builds.items()}
    return ([f"{k}: SUITE says default={said[k]}, the test builds it in {sorted(builds[k])}"
             for k in said.keys() & done.keys() if said[k] != done[k]]
            + [f"{k}: the test builds it, SUITE does not say so" for k in done.keys() - said.keys()]
            + [f"{k}: SUITE says the test builds it; it does not" for k in said.keys() - done.keys()])


def test_what_kiln_models_says_the_suite_runs_is_what_the_family_test_builds():
    assert suite_disagreements(suite_builds(FAMILIES_TEST.read_text())) == []


def test_a_family_test_building_something_else_disagrees_with_suite():
    """The check above is not vacuous: a test that compiles Llama's NVFP4 with AOTInductor by default, or builds FP8
    on one backend only, disagrees with SUITE."""
    source = FAMILIES_TEST.read_text()
    moved = source.replace("set(SUITE_NVFP4_AOT)", 'set(SUITE_NVFP4_AOT) | {"llama"}')
    assert moved != source and any("llama" in d for d in suite_disagreements(suite_builds(moved)))
    one = suite_builds(source)
    one = {k: v for k, v in one.items() if k[1:] != ("fp8", "checkpoint")}
    assert any("SUITE says the test builds it" in d for d in suite_disagreements(one))


# -- links between the pages ---------------------------------------------------------------------------------------
def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_slug(h) for h in re.findall(r"^#{1,6} (.+)$", page.read_text(), flags=re.M)}


PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_link_between_the_pages_reaches_a_page_and_heading(page):
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{page.relative_to(REPO)}: {broken}"


@pytest.mark.parametrize("page, log", [("testing.md", "log/testing.md"), ("performance.md", "log/performance.md")])
def test_reference_pages_link_their_dated_log(page, log):
    assert f"]({log})" in (REPO / "docs" / page).read_text()
    assert (REPO / "docs" / log).is_file()

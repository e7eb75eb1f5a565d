"""The docs against the code they describe: docs/architecture.md names every module there is and none that is not,
docs/models.md's table of what the suite builds is what tests/integration/test_families.py builds
(scripts/models_doc.py), and every link between the Markdown pages reaches a page and a heading that exist."""

from __future__ import annotations

import re
import tomllib
from fnmatch import fnmatch
from pathlib import Path

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


def listed_modules(text: str) -> dict[str, str]:
    """The rows of architecture.md's "Modules" section: module path → its line."""
    section = text.split("\n## Modules\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([^`]+\.py)` \| (.*) \|$", section, flags=re.M)
    return dict(rows)


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


# -- docs/models.md: what the suite builds ------------------------------------------------------------------------
def test_docs_models_md_suite_table_is_what_the_family_test_builds():
    from scripts.models_doc import DOC, render

    text = DOC.read_text()
    assert render(text) == text, "docs/models.md is stale: run python scripts/models_doc.py"


SOURCE = """
import os
NVFP4_AOT = set(FAMILY_CONFIGS) if os.environ.get("KILN_TEST_ALL_FAMILIES") == "1" else DEFAULT


def test_family(family):
    fp8 = builder.build(_spec(ckpt, settings, precision="fp8", backend="checkpoint"))
    nvfp4 = builder.build(_spec(ckpt, settings, precision="nvfp4",
                                backend="aot-inductor" if family in NVFP4_AOT else "checkpoint"))
"""


def test_the_suite_table_follows_the_test_source():
    """The cells are what a test of that form builds: its NVFP4_AOT evaluated in each run, its build calls' precision
    and backend evaluated per family; a family added to the default set moves its NVFP4 cells."""
    from scripts.models_doc import suite_builds, table

    now = suite_builds(SOURCE.replace("DEFAULT", '{"qwen3_moe"}'))
    changed = suite_builds(SOURCE.replace("DEFAULT", '{"qwen3_moe", "llama"}'))
    assert now[("llama", "aot-inductor", "nvfp4")] == {"all"} and now[("llama", "checkpoint", "nvfp4")] == {"default"}
    assert now[("qwen3_moe", "aot-inductor", "nvfp4")] == {"default", "all"}
    assert now[("llama", "checkpoint", "fp8")] == {"default", "all"} and ("llama", "aot-inductor", "fp8") not in now
    assert changed[("llama", "aot-inductor", "nvfp4")] == {"default", "all"}
    assert ("llama", "checkpoint", "nvfp4") not in changed
    assert "| Llama 2 / Llama 3.x | llama | — | only with KILN_TEST_ALL_FAMILIES=1 | yes | default run only |" in table(
        SOURCE.replace("DEFAULT", '{"qwen3_moe"}'))
    with pytest.raises(SystemExit, match="NVFP4_AOT"):
        suite_builds(SOURCE.replace("NVFP4_AOT =", "NVFP4_COMPILED ="))
    with pytest.raises(SystemExit, match="cannot evaluate"):
        suite_builds(SOURCE.replace("DEFAULT", "SOMETHING_ELSE"))


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

"""The layers, the lint rules and the types, as the tools check them (mypy on every layer): import-linter's contracts in pyproject.toml
(``api → workers → builder → artifacts | validation → kiln``; nothing imports the migrations; nothing shipped
imports the tests; the runners do not import the measurements), and ruff. Each contract is shown to break on a planted violation, in a copy of the tree, so a
contract that checks nothing fails here."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

BIN = Path(sys.executable).parent
PACKAGES = ("api", "workers", "builder", "artifacts", "validation", "kiln", "migrations", "scripts", "bench", "tests")


def _tool(name: str) -> str:
    path = BIN / name
    if not path.exists():
        pytest.skip(f"{name} is not installed: pip install -c constraints.txt -e '.[test]'")
    return str(path)


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    # lint-imports puts its working directory first on sys.path, so the tree under ``root`` is the one analysed
    return subprocess.run([_tool("lint-imports"), "--config", str(root / "pyproject.toml"), "--no-cache"], cwd=root,
                          capture_output=True, text=True, timeout=300)


def test_the_import_contracts_hold():
    proc = lint_imports(REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "4 kept, 0 broken" in proc.stdout


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """A copy of the packages' Python files and pyproject.toml, to plant violations in."""
    root = tmp_path_factory.mktemp("tree")
    shutil.copy(REPO / "pyproject.toml", root)
    for package in PACKAGES:
        for src in (REPO / package).rglob("*.py"):
            if ".venv" in src.parts:
                continue
            dest = root / src.relative_to(REPO)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src, dest)
    return root


@pytest.mark.parametrize("where,code,broken", [
    # an import inside a function counts: kiln (the bottom layer) reaching up into the CLI
    ("kiln/_planted.py", "def f():\n    import api.cli\n    return api.cli\n", "layers"),
    # artifacts and validation are siblings: neither imports the other
    ("validation/_planted.py", "from artifacts import oci\n", "layers"),
    ("kiln/_planted.py", "import migrations.env\n", "nothing imports the migrations"),
    ("bench/_planted.py", "from tests.conftest import REPO\n", "do not import the tests"),
    # appended to the module itself: the measure ↔ runners cycle, opened by validation/points.py, stays open
    ("validation/runners.py", "\ndef _planted():\n    from validation.measure import throughput\n    return throughput\n",
     "the runners do not import the measurements"),
])
def test_a_planted_violation_breaks_its_contract(tree, where, code, broken):
    planted = tree / where
    before = planted.read_text() if planted.exists() else None
    planted.write_text((before or "") + code)
    try:
        proc = lint_imports(tree)
    finally:
        planted.write_text(before) if before is not None else planted.unlink()
    assert proc.returncode != 0, proc.stdout
    assert "1 broken" in proc.stdout
    line = next(line for line in proc.stdout.splitlines() if line.endswith("BROKEN"))
    assert broken in line, proc.stdout


def test_ruff_finds_nothing():
    proc = subprocess.run([_tool("ruff"), "check", "--no-cache", "."], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ruff_finds_a_planted_unused_import(tmp_path):
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    (tmp_path / "kiln").mkdir()
    (tmp_path / "kiln" / "planted.py").write_text("import os\n")
    proc = subprocess.run([_tool("ruff"), "check", "--no-cache", "."], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1 and "F401" in proc.stdout


def imports_of(source: str) -> set[str]:
    import ast

    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_the_command_modules_do_not_import_the_cli_module_that_registers_them():
    """api/cli.py imports every api/cli_*.py to register its commands; they take the group and what they share from
    api/cli_base.py, so the imports run one way (the cycle the structure review found stays open)."""
    modules = sorted((REPO / "api").glob("cli_*.py"))
    assert len(modules) >= 8
    back = {m.name for m in modules if "api.cli" in imports_of(m.read_text())}
    assert not back, f"{sorted(back)} import api.cli: take main, _context, _find_artifact from api.cli_base"
    assert "api.cli" in imports_of("def f():\n    from api.cli import main\n")  # the check sees a planted one


def test_mypy_finds_nothing_in_the_packages_it_checks():
    proc = subprocess.run([_tool("mypy"), "--config-file", str(REPO / "pyproject.toml"), "--no-incremental"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Success: no issues found" in proc.stdout


def test_mypy_finds_a_planted_type_error(tmp_path):
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    (tmp_path / "kiln").mkdir()
    (tmp_path / "kiln" / "__init__.py").write_text("")
    (tmp_path / "kiln" / "planted.py").write_text("def f(x: int) -> str:\n    return x\n")
    proc = subprocess.run([_tool("mypy"), "--config-file", str(tmp_path / "pyproject.toml"), "--no-incremental",
                           "kiln"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "return-value" in proc.stdout, proc.stdout


def test_ci_runs_the_fast_checks_first_then_the_readme_test_command():
    """.ci/run fails fast: scripts/check.sh (the three tools above, seconds) is its first step, before the services,
    the system tools and the full install; its last line is README's second command as README writes it."""
    steps = [line for line in (REPO / ".ci" / "run").read_text().splitlines()
             if line.strip() and not line.startswith(("#", "set ", "cd "))]
    commands = re.findall(r"```bash\n(.*?)\n```", (REPO / "README.md").read_text(), flags=re.S)
    assert "scripts/check.sh" in steps[0], steps
    assert steps[-1] == commands[1], (steps[-1], commands[1])
    check = (REPO / "scripts" / "check.sh").read_text()
    assert all(f"run {tool} " in check for tool in ("ruff", "lint-imports", "mypy"))

"""client/: the kiln-client distribution's wheel, as its in-tree backend packs it (the full install's version, the
`kiln` script, the client's packages and nothing of the workers, no heavy dependency), and the one-line refusal
of a command that needs the full install. tests/integration/test_client_install.py installs it for real."""

from __future__ import annotations

import importlib.util
import re
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from click.testing import CliRunner

import kiln.install
from api.cli import main

REPO = Path(__file__).resolve().parents[2]
HEAVY = {"torch", "nvidia-modelopt", "transformers", "celery", "sqlalchemy", "alembic", "lm-eval", "fastapi",
         "uvicorn", "boto3", "numpy", "redis", "psycopg"}


def backend():
    spec = importlib.util.spec_from_file_location("kiln_client_build", REPO / "client" / "kiln_client_build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].lower()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    return zipfile.ZipFile(out / backend().build_wheel(str(out)))


def test_the_wheel_carries_the_client_packages_with_the_full_installs_version(wheel):
    full = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = wheel.namelist()
    info = f"kiln_client-{full['version']}.dist-info"
    assert f"{info}/METADATA" in names and f"{info}/RECORD" in names
    assert wheel.read(f"{info}/entry_points.txt").decode() == "[console_scripts]\nkiln = api.cli:main\n"
    for module in ("api/cli.py", "api/remote.py", "api/pull.py", "api/cli_report.py", "kiln/install.py",
                   "artifacts/verify.py", "artifacts/signing.py", "validation/report.py"):
        assert module in names, module
    assert not [n for n in names if n.startswith(("workers/", "migrations/", "tests/", "api/static/"))
                or "__pycache__" in n]
    metadata = wheel.read(f"{info}/METADATA").decode()
    assert f"Version: {full['version']}\n" in metadata and "Name: kiln-client\n" in metadata
    requires = {name(line.split(": ", 1)[1]) for line in metadata.splitlines() if line.startswith("Requires-Dist")}
    assert requires and not requires & HEAVY
    assert requires <= {name(d) for d in full["dependencies"]}  # nothing the full install does not also carry


def test_the_sdist_builds_the_same_wheel(tmp_path, wheel):
    import tarfile

    sdist = tmp_path / backend().build_sdist(str(tmp_path))
    with tarfile.open(sdist) as tf:
        tf.extractall(tmp_path / "src", filter="data")
    top = next((tmp_path / "src").iterdir())
    sys.path.insert(0, str(top))
    try:
        spec = importlib.util.spec_from_file_location("kiln_client_build_sdist", top / "kiln_client_build.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        again = zipfile.ZipFile(tmp_path / module.build_wheel(str(tmp_path)))
    finally:
        sys.path.remove(str(top))
    assert sorted(again.namelist()) == sorted(wheel.namelist())


@pytest.mark.parametrize("args,what", [(["build", "examples/tiny-llama"], "a local build"),
                                       (["artifacts", "list"], "kiln artifacts")])
def test_the_client_install_refuses_full_install_commands_in_one_line(monkeypatch, tmp_path, args, what):
    monkeypatch.setattr(kiln.install, "is_client", lambda: True)
    monkeypatch.setenv("KILN_HOME", str(tmp_path))
    real_import = __import__

    def no_sqlalchemy(module, *a, **k):
        if module.split(".")[0] == "sqlalchemy":
            raise ModuleNotFoundError(f"No module named {module!r}", name=module)
        return real_import(module, *a, **k)

    monkeypatch.setattr("builtins.__import__", no_sqlalchemy)
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 3, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kiln: error: this is the kiln-client install"), lines
    assert what in lines[0] and "install kiln" in lines[0]


def test_the_full_install_is_not_the_client():
    kiln.install.is_client.cache_clear()
    assert kiln.install.is_client() is False

"""A PEP 517 build backend for kiln-client (client/pyproject.toml): setuptools will not package directories above
its project folder, so this packs the repository's source packages itself into a pure-Python wheel (and an sdist
that carries them beside pyproject.toml, from which a wheel builds the same way). Standard library only."""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import re
import sys
import tarfile
import time
import zipfile
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

HERE = Path(__file__).resolve().parent
# reproducible archives: a fixed timestamp (SOURCE_DATE_EPOCH when set)
EPOCH = int(os.environ.get("SOURCE_DATE_EPOCH", "315532800"))


def _project() -> dict:
    return tomllib.loads((HERE / "pyproject.toml").read_text(encoding="utf-8"))


def _source_root(packages: list[str]) -> Path:
    """The folder holding the packages: this one (an unpacked sdist) or the repository root above it."""
    for root in (HERE, HERE.parent):
        if all((root / p / "__init__.py").is_file() for p in packages):
            return root
    raise RuntimeError(f"kiln-client: none of {HERE}, {HERE.parent} holds the packages {packages}")


def _version(root: Path) -> str:
    text = (root / "kiln" / "__init__.py").read_text(encoding="utf-8")
    m = re.search(r'^__version__\s*=\s*["\']([^"\']+)["\']', text, re.M)
    if not m:
        raise RuntimeError("kiln-client: kiln/__init__.py has no __version__")
    return m.group(1)


def _files(root: Path, config: dict) -> list[Path]:
    """Every file of the packages, relative to ``root``, sorted; caches, compiled files and the excluded paths out."""
    exclude = [Path(p) for p in config.get("exclude", [])]
    out = []
    for package in config["packages"]:
        for path in sorted((root / package).rglob("*")):
            rel = path.relative_to(root)
            if not path.is_file() or "__pycache__" in rel.parts or path.suffix in (".pyc", ".pyo"):
                continue
            if any(rel == x or x in rel.parents for x in exclude):
                continue
            out.append(rel)
    return sorted(out)


def _metadata(project: dict, version: str) -> str:
    lines = ["Metadata-Version: 2.1", f"Name: {project['name']}", f"Version: {version}",
             f"Summary: {project.get('description', '')}", f"Requires-Python: {project.get('requires-python', '>=3')}"]
    if "license" in project and "text" in project["license"]:
        lines.append(f"License: {project['license']['text']}")
    lines += [f"Requires-Dist: {dep}" for dep in project.get("dependencies", [])]
    return "\n".join(lines) + "\n"


def _dist_name(project: dict) -> str:
    return re.sub(r"[-_.]+", "_", project["name"]).lower()


def _layout() -> tuple[dict, dict, Path, str]:
    data = _project()
    project, config = data["project"], data["tool"]["kiln-client"]
    root = _source_root(config["packages"])
    return project, config, root, _version(root)


def _dist_info(project: dict, version: str) -> dict[str, bytes]:
    scripts = project.get("scripts", {})
    entry_points = "[console_scripts]\n" + "".join(f"{k} = {v}\n" for k, v in scripts.items())
    wheel = "Wheel-Version: 1.0\nGenerator: kiln_client_build\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    return {"METADATA": _metadata(project, version).encode(), "WHEEL": wheel.encode(),
            "entry_points.txt": entry_points.encode()}


def _zip_write(zf: zipfile.ZipFile, name: str, data: bytes) -> None:
    info = zipfile.ZipInfo(name, date_time=time.gmtime(max(EPOCH, 315532800))[:6])
    info.external_attr = 0o644 << 16
    info.compress_type = zipfile.ZIP_DEFLATED
    zf.writestr(info, data)


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


# -- PEP 517 hooks -------------------------------------------------------------------------------------
def get_requires_for_build_wheel(config_settings=None) -> list[str]:
    return []


def get_requires_for_build_sdist(config_settings=None) -> list[str]:
    return []


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None) -> str:
    project, _, _, version = _layout()
    info = Path(metadata_directory) / f"{_dist_name(project)}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    for name, data in _dist_info(project, version).items():
        (info / name).write_bytes(data)
    return info.name


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None) -> str:
    project, config, root, version = _layout()
    name = f"{_dist_name(project)}-{version}"
    wheel = Path(wheel_directory) / f"{name}-py3-none-any.whl"
    records = []
    with zipfile.ZipFile(wheel, "w") as zf:
        for rel in _files(root, config):
            data = (root / rel).read_bytes()
            _zip_write(zf, rel.as_posix(), data)
            records.append((rel.as_posix(), _record_hash(data), str(len(data))))
        for fname, data in _dist_info(project, version).items():
            arc = f"{name}.dist-info/{fname}"
            _zip_write(zf, arc, data)
            records.append((arc, _record_hash(data), str(len(data))))
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerows(records)
        writer.writerow((f"{name}.dist-info/RECORD", "", ""))
        _zip_write(zf, f"{name}.dist-info/RECORD", buf.getvalue().encode())
    return wheel.name


def build_sdist(sdist_directory, config_settings=None) -> str:
    project, config, root, version = _layout()
    name = f"{_dist_name(project)}-{version}"
    sdist = Path(sdist_directory) / f"{name}.tar.gz"
    members = [(HERE / "pyproject.toml", "pyproject.toml"), (HERE / Path(__file__).name, Path(__file__).name)]
    members += [(root / rel, rel.as_posix()) for rel in _files(root, config)]
    with tarfile.open(sdist, "w:gz", format=tarfile.PAX_FORMAT) as tf:
        pkg_info = _metadata(project, version).encode()
        for arc, data in [("PKG-INFO", pkg_info)] + [(arc, src.read_bytes()) for src, arc in members]:
            info = tarfile.TarInfo(f"{name}/{arc}")
            info.size, info.mtime, info.mode = len(data), EPOCH, 0o644
            tf.addfile(info, io.BytesIO(data))
    return sdist.name

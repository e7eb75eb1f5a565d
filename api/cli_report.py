"""``kiln report``: an engine's validation report as JSON, HTML or JUnit XML, from the local index; and the
report files ``kiln build --junit FILE --report-html FILE`` writes at the end of a build (local or remote)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable
from xml.etree import ElementTree as ET

import click

from api.cli_base import _context, _find_artifact, main


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def build_error_junit(out: dict) -> str:
    """JUnit for a build that ended without a validated engine (a stage failed, it was cancelled): one test
    case with an ``<error>``, so a CI system shows why instead of finding no results."""
    err = out.get("error") or {}
    message = err.get("message") or out.get("reason") or out.get("status") or "the build produced no engine"
    root = ET.Element("testsuites", name="kiln validation", tests="1", failures="0", errors="1", skipped="0")
    suite = ET.SubElement(root, "testsuite", name="kiln.build", tests="1", failures="0", errors="1", skipped="0")
    props = ET.SubElement(suite, "properties")
    for k in ("id", "build_key", "status"):
        ET.SubElement(props, "property", name=k, value=str(out.get(k)))
    case = ET.SubElement(suite, "testcase", classname="kiln.build", name="build", time="0")
    ET.SubElement(case, "error", message=str(message), type=str(err.get("code") or out.get("status"))).text = str(message)
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def write_build_reports(paths: dict[str, Path | None], out: dict,
                        load: Callable[[str], tuple[dict, str | None]]) -> None:
    """Write the requested report files (``{"junit": path, "html": path}``) for the build outcome ``out``.
    ``load(digest)`` returns the engine's report document and status. Without an engine there is nothing to
    report on: the JUnit file then holds one error case, and no HTML file is written (said on stderr)."""
    from validation.report import render

    wanted = {fmt: p for fmt, p in paths.items() if fmt in ("junit", "html") and p is not None}
    if not wanted:
        return
    if not out.get("digest"):
        if "junit" in wanted:
            write_atomic(wanted["junit"], build_error_junit(out))
            click.echo(f"wrote the build error as JUnit to {wanted['junit']}", err=True)
        if "html" in wanted:
            click.echo(f"kiln: no HTML report written to {wanted['html']}: the build produced no engine", err=True)
        return
    doc, status = load(out["digest"])
    for fmt, path in wanted.items():
        write_atomic(path, render(doc, fmt, status=status))
        click.echo(f"wrote the {fmt} report of {out['digest']} to {path}", err=True)


def local_document(sessions) -> Callable[[str], tuple[dict, str | None]]:
    """``load`` for :func:`write_build_reports` from the local index."""
    from validation.report import document_for_row

    def load(digest: str) -> tuple[dict, str | None]:
        row = _find_artifact(sessions, digest)
        return document_for_row(row), row.status

    return load


@main.command()
@click.argument("digest")
@click.option("--format", "fmt", type=click.Choice(["json", "html", "junit"]), default="json", show_default=True,
              help="json (machines; the report attached to the image), html (people), junit (CI test results)")
@click.option("-o", "--output", default="-", show_default=True, help="file to write; - for stdout")
@click.option("--server", help="the report of an engine on a remote Kiln (http://host:8000) instead of the local index")
def report(digest: str, fmt: str, output: str, server: str | None) -> None:
    """Print or write the validation report of engine DIGEST ([model@]sha256:..., a unique digest prefix of 8+ hex
    digits, or repository:tag; with --server a [model@]digest). Exits 0 whatever the verdict
    (the verdict is in the report; `kiln build` is what fails a pipeline)."""
    from kiln.digests import parse_digest
    from validation.report import render

    if server:
        from api.remote import fetch_report_document

        doc, status = fetch_report_document(server, parse_digest(digest.rsplit("@", 1)[-1], field="digest"))
    else:
        from validation.report import document_for_row

        _, _, sessions = _context()
        row = _find_artifact(sessions, digest)
        doc, status = document_for_row(row), row.status
    text = render(doc, fmt, status=status)
    if output == "-":
        click.echo(text, nl=False)
        return
    path = Path(output)
    write_atomic(path, text)
    click.echo(f"wrote the {fmt} report of {doc['digest']} ({'PASS' if doc.get('passed') else 'FAIL'}) to {path}",
               err=True)

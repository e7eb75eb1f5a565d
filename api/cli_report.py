"""``kiln report``: an engine's validation report as JSON, HTML or JUnit XML, from the local index."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import click

from api.cli import _context, _find_artifact, main


@main.command()
@click.argument("digest")
@click.option("--format", "fmt", type=click.Choice(["json", "html", "junit"]), default="json", show_default=True,
              help="json (machines; the report attached to the image), html (people), junit (CI test results)")
@click.option("-o", "--output", default="-", show_default=True, help="file to write; - for stdout")
def report(digest: str, fmt: str, output: str) -> None:
    """Print or write the validation report of engine DIGEST ([model@]sha256:...). Exits 0 whatever the verdict
    (the verdict is in the report; `kiln build` is what fails a pipeline)."""
    from validation.report import document_for_row, render

    _, _, sessions = _context()
    row = _find_artifact(sessions, digest)
    text = render(document_for_row(row), fmt, status=row.status)
    if output == "-":
        click.echo(text, nl=False)
        return
    path = Path(output)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)  # a reader never sees half a report
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    click.echo(f"wrote the {fmt} report of {row.digest} ({'PASS' if (row.validation or {}).get('passed') else 'FAIL'}) "
               f"to {path}", err=True)

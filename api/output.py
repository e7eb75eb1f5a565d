"""Machine output of the CLI: with ``--json`` a command prints one JSON object as the last line of stdout — its
result, or, when it fails before printing one, its error (``{"error": {code, message, field, fix}, "exit": N}``) —
so a script reading stdout always gets a line to parse. The error's line on stderr is printed either way."""

from __future__ import annotations

import json

import click

_printed = {"result": False}


def begin() -> None:
    """A command starts: nothing printed yet (the group calls it, so a second command in one process — tests driving
    the group in-process — is not taken for one that printed its result)."""
    _printed["result"] = False


def gate_table(out: dict) -> None:
    """With ``--json``, a build's verdict and gate table on stderr, so a CI log that keeps stdout for a file still
    shows why an engine was rejected (or passed) at a glance."""
    from kiln import units

    v = out.get("validation") or {}
    if not v.get("gates"):
        return
    click.echo(f"validation {'PASSED' if v.get('passed') else 'FAILED'} ({len(v['gates'])} gates):", err=True)
    for g in v["gates"]:
        click.echo("  " + units.gate_line(g), err=True)


def json_line(obj) -> None:
    """Print a command's JSON result (and remember that one was printed)."""
    click.echo(json.dumps(obj, sort_keys=True))
    _printed["result"] = True


def error_line(error: dict, exit_code: int) -> None:
    """Print the error as the JSON line, unless a result was printed already (a build that printed its rejected
    engine and then exits 1 has said what it has to say)."""
    if not _printed["result"]:
        click.echo(json.dumps({"error": error, "exit": exit_code}, sort_keys=True))

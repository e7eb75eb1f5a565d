"""``kiln build -f FILE``: build every spec of a build document (kiln/document.py: one spec, or a matrix with optional
defaults; YAML or JSON; ``-`` reads stdin), the same document ``POST /v1/builds`` takes.

Every entry is checked before any work: one bad entry is one line naming the file, the entry and the field
(``matrix.2.precision``), exit 2, nothing built. Locally the entries then build one after another, a line each on
stderr as it ends, and a table at the end (``--json``: one object, ``{"file", "builds": [...], "exit"}``). With
``--server`` the whole document goes to the server in one request (it checks every entry before it submits any)
and, with ``--wait``, each build is followed in turn; ``--dry-run`` with ``--server`` prints the server's plan of
every entry (``POST /v1/builds/plan``) and submits nothing. The exit code is the highest of the entries' (0 every entry
succeeded, 1 one failed validation, 3 a stage or the environment failed, 4 a wait timed out), its line the first
entry with that code."""

from __future__ import annotations

import json

import click

from api.output import json_line
from api.progress import Progress
from kiln.errors import KilnError, SpecError, ValidationFailed

#: ``kiln build`` options that apply to every entry of a document, so they may be given with -f; every other option
#: (and CHECKPOINT) describes one spec and is refused with it
GLOBAL_OPTIONS = ("spec_file", "server", "wait", "as_json", "dry_run", "timeout", "force")


def refuse_spec_options(ctx: click.Context, spec_file: str) -> None:
    """One line naming the first per-spec option (or CHECKPOINT) given with -f."""
    from click.core import ParameterSource

    for param in ctx.command.params:
        if param.name in GLOBAL_OPTIONS:
            continue
        if ctx.get_parameter_source(param.name) in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT):
            what = "CHECKPOINT" if isinstance(param, click.Argument) else param.opts[-1]
            if param.name in ("junit_path", "html_path"):  # a report is one engine's
                raise SpecError(f"{what} writes one engine's report; -f builds one engine per entry",
                                field=what.lstrip("-"), fix="drop it, and write each entry's report with "
                                "kiln report DIGEST --format junit|html -o FILE (the digests are in the table)")
            raise SpecError(f"{what} cannot be given with -f: the specs come from {spec_file}",
                            field=param.name.replace("_path", ""),
                            fix="put it in the file (in an entry, or under defaults: for every entry), or drop -f")


def _in_file(exc: SpecError, name: str) -> SpecError:
    if exc.field == "file":  # it names the file already
        return exc
    return SpecError(f"{exc.message}, in {name}", field=exc.field, fix=exc.fix, details=exc.details)


def _label(entry: dict) -> dict:
    profile = entry.get("profile", "latency")
    return {"checkpoint": entry.get("checkpoint"), "model_name": entry.get("model_name"),
            "precision": entry.get("precision"), "profile": profile if isinstance(profile, str) else "custom",
            "target": entry.get("target", "cpu"), "backend": entry.get("backend")}


def _entry_line(i: int, n: int, row: dict) -> str:
    what = " ".join(str(row[k]) for k in ("precision", "profile", "target", "backend") if row.get(k))
    text = f"entry {i + 1}/{n} ({what}): {row['status']}"
    if row.get("cache_hit"):
        text += " (cache hit: an identical engine answered, only resolve ran)"
    m = ((row.get("validation") or {}).get("metrics")) or {}
    if m.get("ppl_increase_pct") is not None:
        text += (f", perplexity {m['ppl_increase_pct']:+.2f}%, top-1 {m.get('top1_agreement', 0) * 100:.1f}%, "
                 f"validation {'PASSED' if row['validation'].get('passed') else 'FAILED'}")
    if row.get("digest"):
        text += f", engine {row['digest']}"
    elif row.get("id") and row["status"] in ("queued", "running"):  # --no-wait: where to follow it
        text += f", build {row['id']}"
    if row.get("error"):
        text += f": {row['error'].get('message')}"
    return text


def _table(rows: list[dict]) -> list[str]:
    cols = ("entry", "model", "precision", "profile", "target", "backend", "status", "exit", "digest")
    cells = [[str(r["entry"]), str(r.get("model_name") or ""), str(r.get("precision") or ""), str(r.get("profile")),
              str(r.get("target")), str(r.get("backend") or ""), r["status"], str(r["exit"]), r.get("digest") or "-"]
             for r in rows]
    widths = [max(len(c), *(len(row[j]) for row in cells)) for j, c in enumerate(cols)]
    return ["  ".join(v.ljust(w) for v, w in zip(line, widths)).rstrip() for line in [list(cols), *cells]]


def build_file(spec_file: str, *, dry_run: bool, as_json: bool, server: str | None, wait: bool,
               timeout: float | None, force: bool) -> None:
    from api.errors import exit_code
    from kiln.document import document_entries, is_matrix, read_document

    name = "<stdin>" if spec_file == "-" else spec_file
    try:
        data, name = read_document(spec_file)
        entries = document_entries(data)
    except SpecError as exc:
        raise _in_file(exc, name) from None
    matrix = is_matrix(data)
    rows: list[dict] = []
    failures: list[tuple[int, KilnError]] = []

    def record(i: int, label: dict, out: dict, error: KilnError | None) -> None:
        row = {"entry": i, **label, **out, "exit": exit_code(error) if error else 0}
        if label.get("model_name") and not out.get("model_name"):
            row["model_name"] = label["model_name"]
        rows.append(row)
        if error is not None:
            failures.append((i, error))
        click.echo(_entry_line(i, len(entries), row), err=True)

    if server:
        from api.remote import remote_matrix, remote_plan

        try:
            json.dumps(data, allow_nan=True)
        except (TypeError, ValueError) as exc:  # YAML dates, sets: not a JSON document
            raise SpecError(f"holds a value JSON cannot carry ({exc}), in {name}", field="document",
                            fix="quote it as a string") from None
        if dry_run:  # the server plans the document (POST /v1/builds/plan): nothing is submitted
            try:
                answer = remote_plan(server, data)
            except SpecError as exc:
                raise _in_file(exc, name) from None
            _print_plans(name, answer["plans"] if "plans" in answer else [answer], as_json)
            return
        labels = [_label(e) for e in entries]
        try:
            remote_matrix(server, data, wait=wait, progress=Progress(quiet=False), timeout=timeout,
                          on_entry=lambda i, out, error: record(i, labels[i], out, error))
        except SpecError as exc:  # the server refused an entry (422 naming matrix.N.field): nothing was submitted
            raise _in_file(exc, name) from None
    else:
        _build_here(data, name, dry_run=dry_run, as_json=as_json, force=force, record=record)
        if dry_run:
            return
    worst = max((exit_code(err) for _, err in failures), default=0)
    if as_json:
        json_line({"file": name, "builds": rows, "exit": worst})
    else:
        for line in _table(rows):
            click.echo(line)
    if worst:
        i, err = next((i, err) for i, err in failures if exit_code(err) == worst)
        where = f"matrix.{i}" if matrix else ""
        field = ".".join(p for p in (where, err.field or "") if p) or None
        raise type(err)(f"{len(failures)} of {len(entries)} entries did not succeed; entry {i + 1}: {err.message}",
                        field=field, fix=err.fix)


def _print_plans(name: str, plans: list[dict], as_json: bool) -> None:
    body = {"file": name, "plans": plans}
    click.echo(json.dumps(body, sort_keys=True) if as_json else json.dumps(body, indent=2, sort_keys=True))


def _build_here(data: dict, name: str, *, dry_run: bool, as_json: bool, force: bool,
                record) -> None:
    from kiln.install import client_refusal, is_client

    if is_client():  # one line, exit 3: nothing here can quantize or compile
        raise client_refusal("a local build" if not dry_run else "a local build plan")
    from api.cli_base import _context
    from builder.pipeline import Builder
    from kiln.document import parse_document
    from kiln.settings import get_settings

    try:
        specs = parse_document(data, get_settings().roots)  # every entry, before any work
    except SpecError as exc:
        raise _in_file(exc, name) from None
    settings, store, sessions = _context()
    builder = Builder(settings, store, sessions, on_event=Progress(quiet=False))
    if dry_run:
        _print_plans(name, [builder.plan(spec) for spec in specs], as_json)
        return
    for i, spec in enumerate(specs):
        label = {"checkpoint": spec.checkpoint, "model_name": spec.model_name, "precision": spec.precision,
                 "profile": spec.batch_profile.name, "target": spec.target, "backend": spec.backend}
        click.echo(f"[{i + 1}/{len(specs)}] building {spec.model_name} {spec.precision} {spec.batch_profile.name} "
                   f"for {spec.target} with {spec.backend}", err=True)
        try:
            out = builder.build(spec, force=force).to_dict()
        except KilnError as exc:  # this entry's stage failed: the others still build
            record(i, label, {"status": "error", "error": exc.to_dict()}, exc)
            continue
        error = None if out["status"] == "succeeded" else ValidationFailed(
            "the engine failed validation; it is stored as rejected and will not be served")
        record(i, label, out, error)

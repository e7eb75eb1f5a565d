"""``kiln gc`` and ``kiln fsck``: registry housekeeping."""

from __future__ import annotations

import json
from datetime import timedelta

import click

from api.cli_base import _context, main
from kiln import units


@main.command()
@click.option("--dry-run", is_flag=True, help="show what would be deleted, delete nothing")
@click.option("--keep", default=2, show_default=True, type=int, help="newest non-fresh engines kept per tag, for rollbacks")
@click.option("--older-than-days", default=7.0, show_default=True, type=float)
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def gc(dry_run: bool, keep: int, older_than_days: float, as_json: bool) -> None:
    """Delete old stale, revoked and rejected engines, stage outputs no engine needs and unreachable blobs
    (never a tagged or fresh engine, nor a blob a running build holds)."""
    from builder.gc import run_gc

    settings, store, sessions = _context()
    plan = run_gc(sessions, store, dry_run=dry_run, keep=keep, older_than=timedelta(days=older_than_days),
                  grace=timedelta(seconds=settings.gc_grace_s))
    if as_json:
        click.echo(json.dumps({"dry_run": dry_run, **plan.to_dict()}, sort_keys=True))
        return
    verb = "would delete" if dry_run else "deleted"
    click.echo(f"{verb} {len(plan.artifacts)} engine(s), {len(plan.referrers)} referrer(s), "
               f"{len(plan.stage_outputs)} stage output(s), {len(plan.blobs)} blob(s), {units.bytes_iec(plan.bytes)}"
               + (f"; kept {len(plan.leased)} blob(s) a running build holds" if plan.leased else "")
               + (f" ({plan.deferred})" if plan.deferred else ""))
    for d in plan.artifacts:
        click.echo(f"  engine {d}")


@main.command()
@click.option("--json", "as_json", is_flag=True, help="print one JSON object (the exit code still says corrupted)")
def fsck(as_json: bool) -> None:
    """Check every blob in the store against its digest, and that every blob an engine, referrer or stored stage
    output needs is there; exit 3 when any is corrupted or missing."""
    from builder.gc import missing_blobs
    from kiln.errors import DigestMismatch

    _, store, sessions = _context()
    bad, n = [], 0
    for digest in store.list_digests():
        n += 1
        if not store.verify(digest):
            bad.append(digest)
            if not as_json:
                click.echo(f"corrupted {digest}")
    with sessions() as s:
        missing = missing_blobs(s, store)
    if as_json:
        click.echo(json.dumps({"checked": n, "corrupted": bad,
                               "missing": [{"digest": d, "needed_by": who} for d, who in missing]}, sort_keys=True))
    else:
        for digest, who in missing:
            click.echo(f"missing {digest} (needed by {who})")
        click.echo(f"checked {n} blob(s): {len(bad)} corrupted, {len(missing)} missing")
    if bad or missing:
        raise DigestMismatch(f"{len(bad)} corrupted and {len(missing)} missing blob(s) in {store.url}",
                             fix="restore them or rebuild the engines")

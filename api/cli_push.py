"""``kiln push``: copy a published engine, with its referrers (signature, provenance, validation report), to a
standard OCI registry (builder/replicate.py, artifacts/push.py; docs/registry.md "Pushing to your registry")."""

from __future__ import annotations

import click

from api.cli_base import _context, _find_artifact, main
from api.output import json_line


@main.command()
@click.argument("ref")
@click.argument("dest")
@click.option("--insecure", is_flag=True, help="talk plain http to DEST's host (always so for localhost, "
                                               "127.0.0.1 and ::1)")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object (reference, digest, referrers, "
                                                      "referrers_api, blobs sent)")
@click.option("--verbose", "-v", is_flag=True, help="a line on stderr per blob and manifest sent")
def push(ref: str, dest: str, insecure: bool, as_json: bool, verbose: bool) -> None:
    """Push engine REF ([model@]sha256:..., a unique digest prefix, or repository:tag) by digest to DEST
    (host[:port]/repository[:tag]) with its referrers. Credentials: DEST's host's entry in KILN_REGISTRY_AUTHS
    (JSON, as a docker config's auths), else in the docker config, else anonymous; sent to that host only. The copy is recorded:
    the admission webhook then admits DEST's repository@digest as this engine, and `kiln resolve --registry` prints
    it."""
    from builder.replicate import push_engine

    settings, store, sessions = _context()
    row = _find_artifact(sessions, ref)
    step = (lambda text: click.echo(f"kiln: {text}", err=True)) if verbose else None
    result = push_engine(store, sessions, row.digest, dest, insecure=insecure, auths=settings.registry_auths,
                         on_step=step, model=_named_repository(ref))
    if row.status != "fresh":
        click.echo(f"kiln: warning: {row.digest} is {row.status}; pushed anyway (pinned by digest)", err=True)
    if as_json:
        json_line({**result.to_dict(), "status": row.status})
        return
    n = len(result.referrers)
    where = "" if result.referrers_api or not n else " (listed under the referrers tag schema)"
    click.echo(f"pushed {result.reference} with {n} referrer{'s' if n != 1 else ''}{where}"
               + (f", tagged {result.destination.tag}" if result.destination.tag else ""))


def _named_repository(ref: str) -> str | None:
    """The Kiln repository REF names (``repository@sha256:…``, ``repository:tag``), whose tracked head then judges
    the copy; None for a bare digest or prefix (the engine's own repository)."""
    ref = ref.strip()
    if "@" in ref:
        return ref.rpartition("@")[0] or None
    repository, colon, _ = ref.rpartition(":")
    return repository if colon and repository.lower() != "sha256" else None

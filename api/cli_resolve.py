"""``kiln resolve``: which engine should a deployer run? Prints the one servable engine's digest (for deploy
scripts: ``digest=$(kiln resolve …)``) — or, with ``--registry``, its copy in the deployer's registry
(``host/repository@sha256:…``, for a pod spec) —, or exits non-zero with one line saying why none is."""

from __future__ import annotations

import json

import click

from api.cli_base import _context, main
from kiln.backends import BACKENDS, DEFAULT_BACKEND
from kiln.precisions import PRECISIONS
from kiln.targets import GPU_ARCHS


def _resolve_local(query: dict) -> dict:
    from workers.replicas import replica_reference
    from api.resolution import resolve_engine

    registry = query.pop("registry", None)
    _, _, sessions = _context()
    with sessions() as session:
        r = resolve_engine(session, **query)
        if r.artifact is None:
            raise r.error()
        a = r.artifact
        body = {"digest": a.digest, "repository": a.repository, "tag": a.tag, "status": a.status,
                "reference": f"{a.repository}@{a.digest}", "provenance": a.provenance}
        if registry is not None:
            body["replica"] = replica_reference(session, a.digest, query["model"], registry)
    return body


@main.command()
@click.argument("model")
@click.option("--precision", required=True, help=" | ".join(PRECISIONS))
@click.option("--target", required=True, help=f"cpu, {'|'.join(GPU_ARCHS)}, or a GPU name (h100)")
@click.option("--profile", default="latency", show_default=True, help="the batch profile's name")
@click.option("--backend", help=f"{' | '.join(BACKENDS)} (default: the one kiln build uses, {DEFAULT_BACKEND})")
@click.option("--runtime", help="the deployer's toolchain, e.g. tensorrt_llm=1.2.1,tensorrt=10.13.3: only an "
                                "engine built with exactly these versions is returned")
@click.option("--registry", help="host[:port][/path] of your registry: print the engine's copy Kiln pushed there "
                                 "(kiln push, KILN_REPLICATE_TO) as host/repository@sha256:…, for a pod spec")
@click.option("--server", help="ask a remote Kiln (http://host:8000) instead of the local index")
@click.option("--json", "as_json", is_flag=True, help="print the whole answer as one JSON object")
def resolve(model: str, precision: str, target: str, profile: str, backend: str | None, runtime: str | None,
            registry: str | None, server: str | None, as_json: bool) -> None:
    """Print the digest of the one fresh, validated engine of MODEL for this precision, target, profile, backend
    (and runtime); with --registry, the reference of its copy in that registry. Exits 2 when none is servable
    (not built yet, only stale engines, none for the runtime) or Kiln pushed none there."""
    from kiln.backends import default_backend
    from kiln.targets import normalize_target

    canonical, _ = normalize_target(target)  # an unknown target is refused by resolve itself, by field name
    query = {"model": model, "precision": precision, "profile": profile, "target": target,
             "backend": backend or default_backend(canonical or target), "runtime": runtime, "registry": registry}
    if server:
        from api.remote import remote_resolve

        body = remote_resolve(server, query)
        if registry and "replica" not in body:
            from kiln.errors import InvalidRequest

            raise InvalidRequest(f"{server} does not answer --registry (a Kiln older than this client)",
                                 field="registry", fix="upgrade the server, or resolve without --registry")
    else:
        body = _resolve_local(query)
    click.echo(json.dumps(body, sort_keys=True) if as_json else body["replica"] if registry else body["digest"])

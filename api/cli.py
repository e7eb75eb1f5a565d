"""``kiln``: the command line. Local builds run the same stage functions as the service's workers.
Exit codes: 0 success, 1 validation failed, 2 bad input (one line naming the field), 3 environment or internal,
4 a wait that timed out. The group and what the command modules share: api/cli_base.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import click

from api.cli_base import KilnGroup, _context, _find_artifact, main  # noqa: F401 (the group; what commands share)
from api.output import gate_table, json_line
from api.progress import Progress
from kiln import units
from kiln.backends import BACKENDS, DEFAULT_BACKEND
from kiln.runtimes import RUNTIMES
from kiln.errors import KilnError, SpecError
from kiln.kvcache import DEFAULT_KV_CACHE, KV_CACHES
from kiln.sources import ANY_FORMS
from kiln.precisions import PRECISIONS
from kiln.targets import GPU_ARCHS

PROFILE_FIELDS = ("max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens")


def _parse_gates(values: tuple[str, ...]) -> dict[str, float]:
    gates = {}
    for item in values:
        name, sep, value = item.partition("=")
        try:
            gates[name.strip()] = float(value)
        except ValueError:
            raise SpecError(f"{item!r} is not name=number", field=f"gates.{name.strip() or '?'}",
                            fix="write --gate max_ppl_increase_pct=5") from None
        if not sep:
            raise SpecError(f"{item!r} is not name=number", field="gates", fix="write --gate max_ppl_increase_pct=5")
    return gates


def _parse_layers(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise SpecError(f"{text!r} is not a list of layer indices", field="unquantized_layers",
                        fix="give comma-separated integers, e.g. 0,-1") from None


def spec_from_options(checkpoint: str, o: dict) -> dict:
    """The BuildSpec dict that the options describe (explicit limits override the named profile's)."""
    from kiln.spec import PROFILES

    explicit = {k: o[k] for k in PROFILE_FIELDS if o.get(k) is not None}
    profile: str | dict = o["profile"]
    if explicit:
        base = PROFILES[o["profile"]].limits() if o["profile"] in PROFILES else {}
        missing = [k for k in PROFILE_FIELDS if k not in explicit and k not in base]
        if missing:
            raise SpecError(f"{missing[0]} is missing", field=f"profile.{missing[0]}",
                            fix="give all four limits, or a named --profile to start from")
        profile = {"name": o["profile"] if o["profile"] in PROFILES and not explicit else "custom", **base, **explicit}
    spec = {"checkpoint": checkpoint, "precision": o["precision"], "kv_cache": o["kv_cache"], "profile": profile,
            "target": o["target"], "backend": o["backend"], "tp_size": o["tp"], "gates": _parse_gates(o["gate"]),
            "calibration": {"dataset": o["calib_dataset"], "samples": o["calib_samples"], "seq_len": o["calib_seq_len"]},
            "evaluation": {"dataset": o["eval_dataset"], "seq_len": o["eval_seq_len"], "max_tokens": o["eval_max_tokens"],
                           "tasks": list(o.get("eval_task") or ()), "sequential": not o.get("eval_all")}}
    if o.get("recipe"):
        spec["recipe"] = o["recipe"]
    if o.get("runtime"):
        spec["runtime"] = o["runtime"]
    if o.get("unquantized_layers"):
        spec["unquantized_layers"] = _parse_layers(o["unquantized_layers"])
    if o.get("model_name"):
        spec["model_name"] = o["model_name"]
    if o.get("override_reason"):
        spec["override_reason"] = o["override_reason"]
    return spec


def _print_summary(out: dict) -> None:
    v = out["validation"]
    m = v.get("metrics") or {}
    verdict = "PASSED" if v.get("passed") else "FAILED"
    if out["cache_hit"]:
        click.echo("identical build found: answered from the registry, only resolve ran (cache hit)")
    if out.get("status") in ("cancelled",) or (out.get("error") and not m):
        click.echo(f"build {out['status']}: {(out.get('error') or {}).get('message', out.get('reason'))}")
    if m:
        peak = max((p["tokens_per_s"] for p in m.get("throughput", [])), default=0.0)
        click.echo(f"validation {verdict}: perplexity {units.number(m['perplexity'])} vs reference "
                   f"{units.number(m['reference_perplexity'])} ({units.percent(m['ppl_increase_pct'])}), "
                   f"top-1 agreement {units.fraction(m['top1_agreement'])}, mean KL {units.number(m['mean_kl'])}, "
                   f"peak {units.rate(peak)}")
        extra = []
        if isinstance(m.get("ttft_ms"), (int, float)):
            extra.append(f"TTFT {units.duration(m['ttft_ms'] / 1000)}")
        if isinstance(m.get("tpot_ms"), (int, float)):
            extra.append(f"TPOT {units.duration(m['tpot_ms'] / 1000)}")
        if isinstance(m.get("peak_memory_bytes"), (int, float)):
            extra.append(f"peak memory {units.bytes_iec(m['peak_memory_bytes'])} at the envelope corner")
        if extra:
            click.echo("  " + ", ".join(extra))
        seq = m.get("sequential") or {}
        if seq:
            click.echo(f"  evaluated {units.count(seq['windows'])} of {units.count(seq['of'])} windows "
                       f"({units.count(m.get('tokens', 0))} tokens)"
                       + (": stopped once every accuracy gate was decided" if seq.get("stopped_early") else "")
                       + f"; one-sided bounds at {units.fraction(seq['confidence_per_look'])} per look, "
                       f"{units.fraction(1 - seq['alpha'])} over {len(seq['looks'])} looks")
        for longer in m.get("long_windows") or []:
            click.echo(f"  {longer['seq_len']}-token windows (positions 0–{longer['seq_len'] - 1}): "
                       + (f"perplexity {units.number(longer['perplexity'])} vs reference "
                          f"{units.number(longer['reference_perplexity'])} ({units.percent(longer['ppl_increase_pct'])}),"
                          f" top-1 agreement {units.fraction(longer['top1_agreement'])}, mean KL "
                          f"{units.number(longer['mean_kl'])} on {units.count(longer['windows'])} windows"
                          if longer.get("evaluated") else f"not evaluated: {longer.get('why')}"))
        text = ((v.get("conditions") or {}).get("accuracy") or {}).get("text") or {}
        if text.get("prefix_tokens"):
            click.echo(f"  every window starts with {' '.join(text['prefix_tokens'])}, as the tokenizer starts a text "
                       "(not scored)")
        runtime = (v.get("conditions") or {}).get("runtime") or {}
        if runtime.get("serves_on"):
            click.echo(f"  computed by {runtime['computed_by']}, for {runtime['serves_on']}"
                       + (f": {runtime['note']}" if runtime.get("note") else ""))
        for t in m.get("tasks") or []:
            iv = t["interval"]
            click.echo(f"  task {t['task']}: engine {units.fraction(t['engine_accuracy'])} vs reference "
                       f"{units.fraction(t['reference_accuracy'])} on {units.count(t['items'])}"
                       + (f" of {units.count(t['total'])}" if t.get("total", t["items"]) != t["items"] else "")
                       + " items, drop "
                       f"{units.points(t['drop_pts'])} [{units.points(iv['low'])}, {units.points(iv['high'])}], "
                       f"detectable {units.points(t['mde_pts'])}")
        for g in v.get("gates", []):
            click.echo("  " + units.gate_line(g))
    _print_recipe(v.get("recipe") or {})
    a = out.get("artifact") or {}
    if out.get("digest"):
        click.echo(f"engine {out['digest']}  {a.get('repository')}:{a.get('tag')}  [{a.get('status')}]")


def _print_recipe(recipe: dict) -> None:
    """The recipe built, and with ``--recipe auto`` every rung the ladder tried (its accuracy screen). A rung's
    gates that failed and those its evaluation stopped before deciding (another gate had already failed) are
    named apart: an undecided gate is not a measured failure."""
    if not recipe:
        return
    rungs = recipe.get("ladder")
    why = ""
    if rungs:
        why = (f" (chosen by the {recipe.get('requested')} ladder)" if any(r.get("passed") for r in rungs)
               else f" (no rung of the {recipe.get('requested')} ladder passed: the one with the smallest "
                    "perplexity increase was built)")
    click.echo(f"recipe {recipe.get('built')}{why}")
    for r in rungs or []:
        m = r.get("metrics") or {}
        secs = r.get("seconds") or {}
        click.echo(f"  rung {r['recipe']:<15} perplexity {units.percent(m.get('ppl_increase_pct', math.nan)):>7}  "
                   f"top-1 {units.fraction(m.get('top1_agreement', math.nan)):>6}  "
                   f"KL {units.number(m.get('mean_kl', math.nan))}  {units.rung_verdict(r)}  "
                   f"[{r.get('judged_on')}; " + ", ".join(f"{k} {units.duration(v)}" for k, v in secs.items()) + "]")


@main.command(help=f"Build, validate and publish an engine for CHECKPOINT ({ANY_FORMS}), or one for each spec of "
              "the build document FILE (-f; docs/cli.md: exit code the highest of its entries').")
@click.argument("checkpoint", required=False)
@click.option("-f", "--file", "spec_file", metavar="FILE", help="build every spec of a build document (YAML or JSON: "
              "one spec, or a matrix; - for stdin), the document POST /v1/builds takes; its JSON Schema: kiln schema. "
              "Not with CHECKPOINT or the spec's options")
@click.option("--precision", default="fp8", show_default=True, help=" | ".join(PRECISIONS))
@click.option("--recipe", help="quantization recipe of the precision, or auto (its ladder); default: the "
              "precision's (auto). kiln models lists them")
@click.option("--unquantized-layers", help="decoder layers kept unquantized, comma-separated indices (0,-1: the "
              "first and the last)")
@click.option("--kv-cache", default=DEFAULT_KV_CACHE, show_default=True, help=" | ".join(KV_CACHES))
@click.option("--profile", default="latency", show_default=True, help="latency | balanced | throughput")
@click.option("--max-batch-size", type=int)
@click.option("--max-input-len", type=int)
@click.option("--max-seq-len", type=int)
@click.option("--max-num-tokens", type=int)
@click.option("--target", default="cpu", show_default=True, help=f"cpu, {'|'.join(GPU_ARCHS)}, or a GPU name (h100)")
@click.option("--backend", default=DEFAULT_BACKEND, show_default=True, help=" | ".join(BACKENDS))
@click.option("--runtime", help=f"with --backend checkpoint: the serving runtime it is for ({' | '.join(RUNTIMES)}); a "
              "recipe it refuses on the target is refused before any work (kiln models shows what was measured)")
@click.option("--tp", default=1, show_default=True, type=int, help="tensor-parallel size")
@click.option("--model-name", help="repository name of the engine (default: from the checkpoint)")
@click.option("--calib-dataset", default="kiln:calibration", show_default=True)
@click.option("--calib-samples", default=32, show_default=True, type=int)
@click.option("--calib-seq-len", default=128, show_default=True, type=int)
@click.option("--eval-dataset", default="kiln:heldout", show_default=True)
@click.option("--eval-seq-len", default=128, show_default=True, type=int)
@click.option("--eval-max-tokens", default=16384, show_default=True, type=int)
@click.option("--eval-task", multiple=True, metavar="PATH", help="an evaluation task: lm-eval task YAML or "
              "multiple-choice .jsonl (docs/tasks.md); repeatable")
@click.option("--eval-all", is_flag=True, help="evaluate every window, not only until the accuracy gates are decided")
@click.option("--gate", multiple=True, help="override a validation gate: name=value (repeatable)")
@click.option("--override-reason", help="why gates are looser than the defaults, the evaluation shorter, or the "
              "regression gate changed (required for any of them; recorded)")
@click.option("--dry-run", is_flag=True, help="print the plan (keys, cache state, exact commands) and do no work; "
              "with --server the server's plan (POST /v1/builds/plan): nothing is submitted")
@click.option("--force", is_flag=True, help="build anew even when an identical engine exists (every stage after "
              "resolve runs; both engines are kept, the tag moves to the new one)")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object as the last line of stdout")
@click.option("--server", help="submit to a remote Kiln (http://host:8000) instead of building here")
@click.option("--wait/--no-wait", default=True, show_default=True, help="with --server: follow the build to its end "
              "(--no-wait: print the build's id and where to follow it, and return)")
@click.option("--timeout", type=click.FloatRange(min=1), metavar="SECONDS",
              help="with --server --wait: give up waiting after this long (exit 4; the build goes on)")
@click.option("--junit", "junit_path", type=click.Path(dir_okay=False, path_type=Path),
              help="also write the validation report as JUnit XML to this file (CI test results)")
@click.option("--report-html", "html_path", type=click.Path(dir_okay=False, path_type=Path),
              help="also write the validation report as HTML to this file")
def build(checkpoint: str | None, spec_file: str | None, dry_run: bool, force: bool, as_json: bool, server: str | None,
          wait: bool, timeout: float | None, junit_path: Path | None, html_path: Path | None, **options) -> None:
    """``kiln build``: its help (above) names the checkpoint forms from kiln/sources.py."""
    reports: dict = {"junit": junit_path, "html": html_path, "timeout": timeout, "force": force}
    if spec_file is not None:
        from api.cli_file import build_file, refuse_spec_options

        refuse_spec_options(click.get_current_context(), spec_file)
        _check_modes(server, wait, dry_run, reports)
        return build_file(spec_file, dry_run=dry_run, as_json=as_json, server=server, wait=wait, timeout=timeout,
                          force=force)
    if checkpoint is None:
        raise SpecError("no checkpoint given", field="checkpoint",
                        fix=f"give CHECKPOINT ({ANY_FORMS}), or -f FILE")
    try:
        _build(checkpoint, dry_run, as_json, server, wait, reports, options)
    except KilnError as exc:
        if junit_path and not reports.get("written"):  # refused or failed before any report: say why in JUnit
            from api.cli_report import build_error_junit, write_atomic

            write_atomic(junit_path, build_error_junit({"status": "error", "error": {"code": exc.code,
                                                                                      "message": str(exc)}}))
        raise


def _check_modes(server: str | None, wait: bool, dry_run: bool, reports: dict) -> None:
    if reports["timeout"] is not None and not (server and wait):
        raise SpecError("--timeout limits a wait on a remote build", field="timeout",
                        fix="use it with --server (and without --no-wait), or drop it")
    if reports["force"] and (server or dry_run):
        raise SpecError("--force rebuilds here", field="force",
                        fix="drop --force (a remote Kiln answers identical requests from its registry), or --dry-run")


def _build(checkpoint: str, dry_run: bool, as_json: bool, server: str | None, wait: bool, reports: dict,
           options: dict) -> None:
    junit_path, html_path = reports["junit"], reports["html"]
    _check_modes(server, wait, dry_run, reports)
    if server and dry_run:  # the server plans it (POST /v1/builds/plan): nothing is submitted
        from api.remote import remote_plan

        plan = remote_plan(server, spec_from_options(checkpoint, options))
        click.echo(json.dumps(plan, sort_keys=True) if as_json else json.dumps(plan, indent=2, sort_keys=True))
        return
    if server:
        from api.cli_report import write_build_reports
        from api.remote import exit_for, fetch_report_document, remote_build

        if (junit_path or html_path) and not wait:
            raise SpecError("--junit and --report-html need the build's verdict", field="wait",
                            fix="drop --no-wait, or fetch the report later with kiln report")
        out = remote_build(server, spec_from_options(checkpoint, options), wait=wait, as_json=as_json,
                           progress=Progress(quiet=False), summary=_print_summary, timeout=reports["timeout"])
        if wait:
            write_build_reports(reports, out, lambda digest: fetch_report_document(server, digest))
            reports["written"] = True
        if wait and (err := exit_for(out)) is not None:
            raise err
        return
    from kiln.install import client_refusal, is_client

    if is_client():  # one line, exit 3: nothing here can quantize or compile
        raise client_refusal("a local build" if not dry_run else "a local build plan")
    from builder.pipeline import Builder
    from kiln.errors import ValidationFailed
    from kiln.settings import get_settings
    from kiln.spec import parse_spec

    spec = parse_spec(spec_from_options(checkpoint, options), get_settings().roots)  # before any work
    settings, store, sessions = _context()
    builder = Builder(settings, store, sessions, on_event=Progress(quiet=False))
    if dry_run:
        plan = builder.plan(spec)
        click.echo(json.dumps(plan, sort_keys=True) if as_json else json.dumps(plan, indent=2, sort_keys=True))
        return
    click.echo(f"building {spec.model_name} {spec.precision} {spec.batch_profile.name} for {spec.target} "
               f"with {spec.backend}", err=True)
    out = builder.build(spec, force=reports["force"]).to_dict()
    if out["cache_hit"] and not as_json:
        click.echo(f"cache hit: an identical engine is already in KILN_HOME {settings.home} (built "
                   f"{(out.get('artifact') or {}).get('created_at', 'earlier')}); only resolve ran — "
                   "--force builds anew", err=True)
    if as_json:
        json_line(out)
        gate_table(out)
    else:
        _print_summary(out)
    if junit_path or html_path:
        from api.cli_report import local_document, write_build_reports

        write_build_reports(reports, out, local_document(sessions))
        reports["written"] = True
    if out["status"] != "succeeded":
        raise ValidationFailed("the engine failed validation; it is stored as rejected and will not be served")


@main.command()
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path),
              help="write it to this file instead of stdout")
def schema(output: Path | None) -> None:
    """The JSON Schema of a build document (kiln build -f FILE, POST /v1/builds): one spec, or a matrix with optional
    defaults. Published as docs/kiln-build.schema.json; editors and check-jsonschema read it."""
    from kiln.document import schema_text

    if output is None:
        click.echo(schema_text(), nl=False)
        return
    output.write_text(schema_text(), encoding="utf-8")
    click.echo(f"wrote {output}", err=True)


@main.group()
def artifacts() -> None:
    """Query published engines."""


@artifacts.command("list")
@click.option("--json", "as_json", is_flag=True)
def artifacts_list(as_json: bool) -> None:
    """Every engine in the local index, oldest first: digest, repository:tag, status, backend."""
    from sqlalchemy import select

    from kiln.tables import Artifact

    _, _, sessions = _context()
    with sessions() as s:
        rows = [a.summary() for a in s.scalars(select(Artifact).order_by(Artifact.created_at))]
    if as_json:
        click.echo(json.dumps(rows))
        return
    for r in rows:
        click.echo(f"{r['digest']}  {r['repository']}:{r['tag']}  {r['status']}  {r['backend']}")


@artifacts.command("show")
@click.argument("digest")
def artifacts_show(digest: str) -> None:
    """One engine's index row as JSON (provenance, validation, status), by [model@]sha256:… digest, a unique
    digest prefix (8+ hex digits) or repository:tag."""
    _, _, sessions = _context()
    row = _find_artifact(sessions, digest)
    click.echo(json.dumps({**row.summary(), "provenance": row.provenance, "validation": row.validation}, indent=2))


@main.command()
@click.argument("ref")
@click.argument("dest", type=click.Path(path_type=Path))
@click.option("--server", help="pull from a remote Kiln's /v2 registry API (http://host:8000) instead of the local store")
@click.option("--insecure", is_flag=True, help="with a registry reference (host/repository@sha256:…): talk plain "
                                               "http to its host (always so for localhost, 127.0.0.1 and ::1)")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object (digest, repository, status, dest)")
@click.option("--verify-key", help="public key (PEM file): write nothing unless the engine's files and signed "
                                   "provenance verify with it")
@click.option("--no-cache", is_flag=True, help="with --server or a registry reference: download every layer, keep "
                                               "none in the local blob cache (KILN_PULL_CACHE_DIR)")
def pull(ref: str, dest: Path, server: str | None, insecure: bool, as_json: bool, verify_key: str | None,
         no_cache: bool) -> None:
    """Pull engine REF ([model@]sha256:..., a unique digest prefix, or repository:tag) into DEST, verifying every
    blob against its digest; its signature is written beside the files as DEST/model.sig (model_signing verify key
    checks it offline). REF host[:port]/repository@sha256:... pulls from that OCI registry (where `kiln push` put
    it), with that host's credentials from KILN_REGISTRY_AUTHS or the docker config, sent to it only; signatures
    through its referrers API or the referrers tag schema. With --server or a registry, layers already in the local
    blob cache (a fine-tune's kernel, say) are checked there and not downloaded again, and a DEST that already holds
    exactly this engine's files (checked by digest) is left as it is."""
    from artifacts.push import is_registry_reference
    from artifacts.verify import keys_from

    keys = keys_from(verify_key) if verify_key else None  # a bad key file is refused before any download
    registry = is_registry_reference(ref)
    if server and registry:
        raise SpecError(f"{ref!r} names a registry host, and --server a Kiln", field="server",
                        fix="drop --server to pull from that registry, or write model@sha256:… for the Kiln")
    if insecure and not registry:
        raise SpecError("--insecure applies to a registry reference (host[:port]/repository@sha256:…) only",
                        field="insecure", fix="drop --insecure")
    if no_cache and not (server or registry):
        raise SpecError("--no-cache applies to pulls from a server or a registry only", field="no_cache",
                        fix="drop --no-cache (a local pull copies from the store), or add --server")
    if server or registry:
        from api.pull import pull_registry, pull_remote

        if registry:
            got = pull_registry(ref, dest, insecure=insecure, verify_keys=keys, cache=not no_cache)
            source, where = got.repository.partition("/")[0], "registry"
        else:
            assert server is not None
            got = pull_remote(server, ref, dest, verify_keys=keys, cache=not no_cache)
            source, where = server, "server"
        note = ""
        if got.status not in (None, "fresh"):
            note = f" (warning: this engine is {got.status})"
            click.echo(f"kiln: warning: {got.repository}@{got.digest} is {got.status} on {source}; "
                       "pulled anyway (pinned by digest)", err=True)
        if as_json:
            click.echo(json.dumps({"digest": got.digest, "repository": got.repository, "status": got.status,
                                   "dest": str(dest), "server": server, "registry": source if registry else None,
                                   "signed": got.signed, "verified_key": got.verified_key, "layers": got.layers,
                                   "size": got.size, "layers_cached": list(got.cached),
                                   "transferred": got.transferred, "already": got.already}, sort_keys=True))
            return
        signed = f"; verified, signed by {got.verified_key}" if got.verified_key else (
            "" if got.signed else "; unsigned: no model.sig")
        if got.already:
            click.echo(f"{dest} already holds {got.repository}@{got.digest}{note}{signed}; nothing rewritten")
            return
        reuse = f"{len(got.cached)} of {got.layers} layers already here, " if got.cached else ""
        origin = "" if where == "registry" else f" from {server}"
        click.echo(f"pulled {got.repository}@{got.digest}{origin} into {dest}{note}{signed}; "
                   f"{reuse}{units.bytes_iec(got.transferred)} transferred")
        return
    from artifacts.verify import pull_local

    _, store, sessions = _context()
    row = _find_artifact(sessions, ref)
    if dest.exists():
        raise SpecError(f"{dest} already exists", field="dest", fix="give a path that does not exist yet")
    has_sig, verified = pull_local(store, sessions, row.digest, dest, keys=keys)
    if as_json:
        click.echo(json.dumps({"digest": row.digest, "repository": row.repository, "status": row.status,
                               "dest": str(dest), "server": None, "signed": has_sig,
                               "verified_key": verified.key if verified else None}, sort_keys=True))
        return
    note = f" (warning: this engine is {row.status})" if row.status != "fresh" else ""
    signed = f"; verified, signed by {verified.key}" if verified else ("" if has_sig else "; unsigned: no model.sig")
    click.echo(f"pulled {row.digest} into {dest}{note}{signed}")


@main.group("db")
def db_group() -> None:
    """Database schema (Alembic migrations)."""


@db_group.command("upgrade")
@click.option("--revision", default="head", show_default=True)
def db_upgrade(revision: str) -> None:
    """Migrate the database (KILN_DATABASE_URL, default SQLite under KILN_HOME) up to --revision (default: the
    newest)."""
    from kiln import db
    from kiln.settings import get_settings

    db.upgrade(get_settings().db_url, revision)
    click.echo(f"database at {revision}")


@db_group.command("downgrade")
@click.argument("revision")
def db_downgrade(revision: str) -> None:
    """Migrate the database (KILN_DATABASE_URL, default SQLite under KILN_HOME) down to REVISION (an Alembic
    revision id, or -1 for one step)."""
    from kiln import db
    from kiln.settings import get_settings

    db.downgrade(get_settings().db_url, revision)
    click.echo(f"database at {revision}")


def _register_commands() -> None:
    import api.cli_admin  # noqa: F401  (gc, fsck)
    import api.cli_service  # noqa: F401  (adds api, worker, serve to the group)
    import api.cli_fit  # noqa: F401
    import api.cli_report  # noqa: F401  (report)
    import api.cli_models  # noqa: F401  (models)
    import api.cli_resolve  # noqa: F401  (resolve)
    import api.cli_sign  # noqa: F401  (verify, keys)
    import api.cli_push  # noqa: F401  (push)


_register_commands()

if __name__ == "__main__":  # python -m api.cli: run the importable module's group, where all commands live
    from api.cli import main as _main

    _main()

"""``kiln models``: the support matrix — family × precision × backend, with the reason for each gap — as the
descriptors in kiln/families.py, kiln/precisions.py and kiln/backends.py state it, and what ran where
(kiln/verified.py: validated engines in the index, what the test suite builds). The same document as
``GET /v1/support``; docs/models.md shows its static part."""

from __future__ import annotations

import json

import click

from api.cli_base import main


def support_table_markdown() -> str:
    """The matrix as a Markdown table: one row per family, one column per backend × precision; each cell says
    what the test suite runs (kiln/verified.py), not only what the descriptors allow."""
    from kiln.backends import BACKENDS, support_matrix
    from kiln.families import FAMILIES
    from kiln.precisions import PRECISIONS
    from kiln.verified import SUITE

    rows = {(r["family"], r["backend"], r["precision"]): r for r in support_matrix()}
    cols = [(b, p) for b in BACKENDS for p in PRECISIONS]
    head = "| family | model_type | " + " | ".join(f"{b} {p}" for b, p in cols) + " |"
    lines = [head, "|" + "---|" * (2 + len(cols))]
    notes: dict[str, int] = {}
    for name, family in FAMILIES.items():
        cells = []
        for b, p in cols:
            r, suite = rows[(name, b, p)], SUITE.get((name, p, b))
            if not r["supported"]:
                mark = "no"
            elif suite is not None:
                mark = "yes" if suite["default"] else "opt-in"
            else:
                mark = BACKENDS[b].status.split(":")[0] if BACKENDS[b].status.startswith(("planned", "legacy")) \
                    else "untested"
            if r["reason"]:
                mark += f" [{notes.setdefault(r['reason'], len(notes) + 1)}]"
            cells.append(mark)
        lines.append(f"| {family.title} | {', '.join(family.model_types)} | " + " | ".join(cells) + " |")
    lines.append("")
    lines += [f"[{n}] {reason}" for reason, n in notes.items()]
    lines.append("")
    lines += [f"- **{b.name}**: {b.title} — {b.status}" for b in BACKENDS.values()]
    return "\n".join(lines) + "\n"


def recipe_table_markdown() -> str:
    """The recipes (kiln/recipes.py) with their export, backends and the runtimes that load them."""
    from kiln.recipes import recipe_table
    from kiln.runtimes import RUNTIMES, support_table

    head = "| recipe | ModelOpt config | quant_algo | activations | in auto's ladder | backends here | " + \
        " | ".join(RUNTIMES) + " |"
    lines = [head, "|" + "---|" * (6 + len(RUNTIMES))]
    for r in recipe_table():
        rt = " | ".join(f"`{r['runtimes'][k]}`" if r["runtimes"][k] else "no" for k in RUNTIMES)
        lines.append(f"| `{r['recipe']}` | `{r['modelopt_config']}` | `{r['quant_algo']}` | {r['activations']} | "
                     f"{'yes' if r['in_ladder'] else 'no'} | {', '.join(r['backends'])} | {rt} |")
    lines += ["", "What each runtime does with a recipe's checkpoint (`--runtime`), per kind of target: *serves* and "
              "*refused* were measured (the runtime ran here), *refused* without a run is the runtime's own rule, "
              "*unmeasured* means only its sources say it loads:", "",
              "| recipe | runtime | cpu | gpu |", "|---|---|---|---|"]
    cells: dict[tuple[str, str], dict[str, str]] = {}
    for row in support_table():
        measured = f" ({row['measured']['version']}, {row['measured']['date']})" if row.get("measured") else ""
        cells.setdefault((row["recipe"], row["runtime"]), {})[row["target"]] = \
            f"{row['status']}{measured}: {row['reason']}" if row["status"] != "unmeasured" else "unmeasured"
    for (recipe, runtime), c in cells.items():
        lines.append(f"| `{recipe}` | {runtime} | {c['cpu']} | {c['gpu']} |")
    return "\n".join(lines) + "\n"


def verified_text(v: dict) -> str:
    """One row's evidence, compactly: ``built 3× (cpu 2×, sm90 1×), latest 2026-12-05; test suite (cpu)``,
    ``test suite (cpu)``, ``never built`` or ``no build history``."""
    from kiln.verified import ALL_FAMILIES_ENV

    s = v.get("suite")
    suite = (f"test suite ({s['target']})" + ("" if s["default"] else f" with {ALL_FAMILIES_ENV}=1 only")) if s else ""
    if v["state"] == "built":
        where = ", ".join(f"{t} {c['engines']}×" for t, c in v["targets"].items())
        text = f"built {v['engines']}× ({where})" + (f", latest {v['latest'][:10]}" if v.get("latest") else "")
        return text + (f"; {suite}" if suite else "")
    if v["state"] == "test suite":
        return suite + ("; never built in this registry" if v.get("engines") == 0 else "")
    return v["state"] + (f"; {suite}" if suite else "")


def local_support() -> dict:
    """The support matrix with what ran where in this machine's index: KILN_DATABASE_URL's database, else the
    embedded SQLite index under KILN_HOME where one exists (read only: nothing is created or migrated); without
    one, each row says what the test suite runs and "no build history"."""
    from kiln.settings import get_settings
    from kiln.verified import support_report

    settings = get_settings()
    if settings.database_url is None and not (settings.home_dir / "kiln.db").is_file():
        return support_report(None, no_history=f"no build history: no index under KILN_HOME ({settings.home_dir}) "
                                               "and no KILN_DATABASE_URL; --server URL reads a server's")
    try:
        from sqlalchemy.exc import SQLAlchemyError

        from workers.services import build_services
    except ImportError:  # the client install: no SQLAlchemy and no workers package, no index
        return support_report(None, no_history="no build history: this install has no index; "
                                               "--server URL reads a server's")
    where = "KILN_DATABASE_URL" if settings.database_url else f"the index under KILN_HOME ({settings.home_dir})"
    try:
        with build_services(settings).sessions() as session:
            return support_report(session, no_history="")
    except SQLAlchemyError as exc:
        return support_report(None, no_history=f"no build history: {where} could not be read "
                                               f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]})")


@main.command()
@click.option("--json", "as_json", is_flag=True, help="one JSON object: the rows of the matrix, each with what ran "
              "where (verified), the build history read, and the recipes")
@click.option("--markdown", is_flag=True, help="the tables docs/models.md shows")
@click.option("--server", help="what ran where on a remote Kiln (http://host:8000): its GET /v1/support, instead of "
              "the local index")
def models(as_json: bool, markdown: bool, server: str | None) -> None:
    """Which model families Kiln builds, for each precision and backend, and why a pair is not supported; what ran
    where (validated engines in the index, per target, and what the test suite builds); and the quantization
    recipes, with the runtimes that serve each."""
    from kiln.backends import BACKENDS
    from kiln.families import FAMILIES
    from kiln.precisions import PRECISIONS
    from kiln.recipes import recipe_table
    from kiln.runtimes import RUNTIME_TABLE, support_table

    if markdown:
        click.echo(support_table_markdown() + "\n" + recipe_table_markdown(), nl=False)
        return
    if server:
        from api.remote import fetch_support

        doc = fetch_support(server)
    else:
        doc = {**local_support(), "recipes": recipe_table(), "runtime_support": support_table()}
    if as_json:
        click.echo(json.dumps(doc))
        return
    click.echo("recipes (--recipe; auto climbs its precision's ladder):")
    for r in doc["recipes"]:
        served = ", ".join(f"{k} as {v}" for k, v in r["runtimes"].items() if v) or "no runtime"
        click.echo(f"  {r['precision']:<6} {r['recipe']:<15} {r['title']} — served by {served}; "
                   f"builds with {', '.join(r['backends'])}")
    for p in PRECISIONS.values():
        click.echo(f"  {p.name} ladder: {' → '.join(p.ladder)} (default recipe: {p.default_recipe})")
    if doc.get("runtime_support"):
        click.echo("runtimes (--runtime, with --backend checkpoint): what was measured, per recipe and kind of target:")
        for row in doc["runtime_support"]:
            if not row.get("measured"):
                continue
            when = f" [{row['measured']['version']}, {row['measured']['date']}]" if row.get("measured") else ""
            click.echo(f"  {row['runtime']:<12} {row['recipe']:<15} {row['target']:<4} {row['status']}{when}: "
                       f"{row['reason']}")
        click.echo("  every other pair: its runtime's loader takes the recipe's export by its sources (kiln models "
                   "--markdown), or the runtime does not run there: " + "; ".join(
                       f"{r.name}: {r.cpu_gap}" for r in RUNTIME_TABLE.values() if r.cpu_gap))
    click.echo("backends:")
    for b in BACKENDS.values():
        click.echo(f"  {b.name:<13} {b.status}")
    click.echo(f"what ran where — {doc['history']['note']}")
    for name, family in FAMILIES.items():
        click.echo(f"{family.title} ({', '.join(family.model_types)}): {', '.join(family.features)}")
        for r in (r for r in doc["support"] if r["family"] == name):
            state = "supported" if r["supported"] else "not supported"
            reason = f" ({r['reason']})" if r["reason"] else ""
            click.echo(f"  {r['precision']:<6} {r['backend']:<13} {state}{reason} · {verified_text(r['verified'])}")

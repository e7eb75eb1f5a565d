"""``kiln models``: the support matrix — family × precision × backend, with the reason for each gap — as the
descriptors in kiln/families.py, kiln/precisions.py and kiln/backends.py state it (the same table as
``GET /v1/support`` and docs/models.md)."""

from __future__ import annotations

import json

import click

from api.cli_base import main


def support_table_markdown() -> str:
    """The matrix as a Markdown table: one row per family, one column per backend × precision."""
    from kiln.backends import BACKENDS, support_matrix
    from kiln.families import FAMILIES
    from kiln.precisions import PRECISIONS

    rows = {(r["family"], r["backend"], r["precision"]): r for r in support_matrix()}
    cols = [(b, p) for b in BACKENDS for p in PRECISIONS]
    head = "| family | model_type | " + " | ".join(f"{b} {p}" for b, p in cols) + " |"
    lines = [head, "|" + "---|" * (2 + len(cols))]
    notes: dict[str, int] = {}
    for name, family in FAMILIES.items():
        cells = []
        for b, p in cols:
            r = rows[(name, b, p)]
            mark = ("yes" if "runs here" in r["status"] else "planned") if r["supported"] else "no"
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
    from kiln.recipes import RUNTIMES, recipe_table

    head = "| recipe | ModelOpt config | quant_algo | activations | in auto's ladder | backends here | " + \
        " | ".join(RUNTIMES) + " |"
    lines = [head, "|" + "---|" * (6 + len(RUNTIMES))]
    for r in recipe_table():
        rt = " | ".join(f"`{r['runtimes'][k]}`" if r["runtimes"][k] else "no" for k in RUNTIMES)
        lines.append(f"| `{r['recipe']}` | `{r['modelopt_config']}` | `{r['quant_algo']}` | {r['activations']} | "
                     f"{'yes' if r['in_ladder'] else 'no'} | {', '.join(r['backends'])} | {rt} |")
    return "\n".join(lines) + "\n"


@main.command()
@click.option("--json", "as_json", is_flag=True, help="one JSON object: the rows of the matrix")
@click.option("--markdown", is_flag=True, help="the tables docs/models.md shows")
def models(as_json: bool, markdown: bool) -> None:
    """Which model families Kiln builds, for each precision and backend, and why a pair is not supported; and the
    quantization recipes, with the runtimes that serve each."""
    from kiln.backends import support_matrix
    from kiln.families import FAMILIES
    from kiln.precisions import PRECISIONS
    from kiln.recipes import recipe_table

    if as_json:
        click.echo(json.dumps({"support": support_matrix(), "recipes": recipe_table()}))
        return
    if markdown:
        click.echo(support_table_markdown() + "\n" + recipe_table_markdown(), nl=False)
        return
    click.echo("recipes (--recipe; auto climbs its precision's ladder):")
    for r in recipe_table():
        served = ", ".join(f"{k} as {v}" for k, v in r["runtimes"].items() if v) or "no runtime"
        click.echo(f"  {r['precision']:<6} {r['recipe']:<15} {r['title']} — served by {served}; "
                   f"builds with {', '.join(r['backends'])}")
    for p in PRECISIONS.values():
        click.echo(f"  {p.name} ladder: {' → '.join(p.ladder)} (default recipe: {p.default_recipe})")
    rows = support_matrix()
    for name, family in FAMILIES.items():
        click.echo(f"{family.title} ({', '.join(family.model_types)}): {', '.join(family.features)}")
        for r in (r for r in rows if r["family"] == name):
            state = r["status"] if r["supported"] else "not supported"
            click.echo(f"  {r['precision']:<6} {r['backend']:<13} {state}{' — ' + r['reason'] if r['reason'] else ''}")

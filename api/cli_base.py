"""The ``kiln`` command group and what every command module shares: the group (domain errors → one line and the
exit code from api/errors.py; with ``--json`` the error as the stdout JSON line), quiet libraries, the local context
(settings, store, sessions) and engine references. Every ``api/cli*.py`` module imports this one, and api/cli.py
imports them to register their commands: the imports run one way."""

from __future__ import annotations

import sys

import click

import kiln

from api.errors import exit_code
from api.output import begin, error_line
from kiln.errors import KilnError


class KilnGroup(click.Group):
    """Turns domain errors into one line on stderr and the exit code from api/errors.py."""

    def invoke(self, ctx):
        wants_json = "--json" in [*getattr(ctx, "_protected_args", []), *ctx.args]
        begin()
        try:
            return super().invoke(ctx)
        except KilnError as exc:
            click.echo(f"kiln: error: {exc}", err=True)
            if wants_json:
                error_line(exc.to_dict(), exit_code(exc))
            sys.exit(exit_code(exc))
        except (click.exceptions.Exit, click.ClickException, SystemExit, KeyboardInterrupt):
            raise
        except ModuleNotFoundError as exc:  # the kiln-client install (client/) lacks what builds and serves
            from kiln.install import COMMAND_FIX, client_refusal, is_client

            if not is_client():
                raise
            command = ctx.invoked_subcommand or "this command"
            refusal = client_refusal(f"kiln {command}", missing=(exc.name or "").split(".")[0] or None,
                                     fix=COMMAND_FIX)
            click.echo(f"kiln: error: {refusal}", err=True)
            sys.exit(exit_code(refusal))
        except Exception as exc:  # a bug or an environment failure: one line, exit 3 (KILN_DEBUG=1 for the trace)
            import os

            if os.environ.get("KILN_DEBUG"):
                raise
            message = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            click.echo(f"kiln: internal error: {message}", err=True)
            if wants_json:
                error_line({"code": "internal_error", "message": message}, 3)
            sys.exit(3)


def _quiet_libraries() -> None:
    """Library progress bars and deprecation chatter are not Kiln's output; stage lines are."""
    import logging
    import os
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TQDM_DISABLE", "1")
    logging.getLogger("torch").setLevel(logging.ERROR)


@click.group(cls=KilnGroup)
@click.version_option(kiln.__version__, "--version", prog_name="kiln", message="%(prog)s %(version)s")
def main() -> None:
    """Kiln: checkpoints in, validated, versioned engines out."""
    _quiet_libraries()


def _context():
    """Settings, store and database for local work (embedded defaults: SQLite + a directory under KILN_HOME),
    built as the API and the worker build them (workers/services.py)."""
    from workers.services import build_services

    services = build_services(upgrade_embedded=True)
    return services.settings, services.store, services.sessions


def _find_artifact(sessions, ref: str):
    """The engine ``ref`` names: a digest, a unique prefix of one, or repository:tag (workers/references.py)."""
    from workers.references import find_engine

    with sessions() as s:
        return find_engine(s, ref)

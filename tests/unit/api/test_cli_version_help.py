"""Small CLI manners: ``--version``, help text on every command, a missing checkpoint said as missing."""

from __future__ import annotations

from pathlib import Path

import click
from click.testing import CliRunner

import kiln
from api.cli import main


def test_version_prints_the_package_version():
    out = CliRunner().invoke(main, ["--version"])
    assert out.exit_code == 0 and out.output.strip() == f"kiln {kiln.__version__}"


def _commands(group: click.Group, prefix: str = ""):
    for name, cmd in group.commands.items():
        yield prefix + name, cmd
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, prefix + name + " ")


def test_every_command_has_help_text():
    main_group = main
    from api.cli import _register_commands

    _register_commands()
    missing = [name for name, cmd in _commands(main_group) if not (cmd.help or "").strip()]
    assert missing == []


def test_a_missing_checkpoint_directory_is_said_to_not_exist(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("KILN_CHECKPOINT_ROOTS", str(Path.cwd()))
    out = CliRunner().invoke(main, ["build", "examples/no-such-model"])
    assert out.exit_code == 2
    assert "'examples/no-such-model' does not exist" in out.output

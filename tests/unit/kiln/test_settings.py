"""Settings from the environment: an empty variable means the setting is not set (the Kubernetes base writes
``KILN_S3_ENDPOINT_URL: ""`` for AWS S3; read as an endpoint of "", botocore refuses it and every process stops);
a shipped placeholder (``REPLACE-ME``…) is refused, naming its variable, and the processes exit before anything."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kiln.errors import SettingsInvalid
from kiln.settings import Settings


def test_an_empty_variable_is_the_default_not_an_empty_value(monkeypatch):
    monkeypatch.setenv("KILN_S3_ENDPOINT_URL", "")
    assert Settings().s3_endpoint_url is None
    monkeypatch.setenv("KILN_S3_ENDPOINT_URL", "http://127.0.0.1:9000")
    assert Settings().s3_endpoint_url == "http://127.0.0.1:9000"


def test_the_aws_configuration_opens_an_s3_store_without_an_endpoint(monkeypatch, tmp_path):
    from artifacts.factory import open_store

    monkeypatch.setenv("KILN_S3_ENDPOINT_URL", "")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    s = Settings()
    store = open_store("s3://kiln-bucket/engines", s)  # no ValueError: Invalid endpoint
    assert store is not None


def test_every_setting_reads_an_empty_variable_as_unset(monkeypatch):
    """Each field of Settings, set to "" in the environment, keeps the value it has with the variable absent:
    the model's env_ignore_empty (an int, bool or Path field would otherwise refuse "" and stop the process)."""
    assert Settings.model_config.get("env_ignore_empty") is True
    for field in Settings.model_fields:
        monkeypatch.delenv(f"KILN_{field.upper()}", raising=False)
    defaults = Settings()
    for field in Settings.model_fields:
        with monkeypatch.context() as mp:
            mp.setenv(f"KILN_{field.upper()}", "")
            assert getattr(Settings(), field) == getattr(defaults, field), f"KILN_{field.upper()}=''"


def test_tuning_variables_read_outside_settings_treat_empty_as_unset():
    """The few KILN_* variables read straight from the environment (worker heartbeat and liveness windows) take
    their defaults when empty, like every setting, instead of float('') stopping the worker at import."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "KILN_HEARTBEAT_S": "", "KILN_WORKER_LIVE_WINDOW_S": ""}
    out = subprocess.run([sys.executable, "-c", "from workers import liveness as r; print(r.HEARTBEAT_S, r.LIVE_WINDOW_S)"],
                         cwd=Path(__file__).resolve().parents[3], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["5.0", "30.0"]


# -- placeholders --------------------------------------------------------------------------------------------------
REPO = Path(__file__).resolve().parents[3]
SIGNING_PLACEHOLDER = "-----BEGIN EC PRIVATE KEY-----\nREPLACE-ME\n-----END EC PRIVATE KEY-----\n"


@pytest.mark.parametrize("name,value", [
    ("KILN_BOOTSTRAP_TOKEN", "REPLACE-ME-openssl-rand-hex-32"),
    ("KILN_WEBHOOK_SECRET", "REPLACE-ME-openssl-rand-hex-32"),
    ("KILN_TOKEN_SECRET", "replace_me"),
    ("KILN_SIGNING_KEY", SIGNING_PLACEHOLDER),
    ("KILN_TRUSTED_KEYS", "-----BEGIN PUBLIC KEY-----\nREPLACE-ME-openssl-ec-in-signing-key.pem-pubout\n"),
    ("KILN_DATABASE_URL", "postgresql+psycopg://kiln:REPLACE-ME-postgres@kiln-postgres:5432/kiln"),
    ("KILN_BROKER_URL", "redis://:REPLACE-ME@redis.example.com:6379/0"),
    ("KILN_REGISTRY_AUTHS", '{"r.example.com": {"username": "u", "password": "REPLACE-ME"}}'),
    ("AWS_SECRET_ACCESS_KEY", "REPLACE-ME-minio"),
    ("AWS_ACCESS_KEY_ID", "REPLACE-ME"),
    ("AWS_SECRET_ACCESS_KEY", "kiln-minio-secret"),  # docker-compose.yml's old default
])
def test_a_shipped_placeholder_is_refused_naming_its_variable(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(SettingsInvalid) as info:
        Settings()
    assert info.value.field == name and "placeholder" in info.value.message
    assert "\n" not in str(info.value)  # one line, and never the value itself
    assert value.strip() == "REPLACE-ME" or value.strip() not in str(info.value)


def test_several_placeholders_are_named_together(monkeypatch):
    monkeypatch.setenv("KILN_BOOTSTRAP_TOKEN", "REPLACE-ME-openssl-rand-hex-32")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "REPLACE-ME")
    with pytest.raises(SettingsInvalid) as info:
        Settings()
    assert info.value.field == "KILN_BOOTSTRAP_TOKEN" and "AWS_SECRET_ACCESS_KEY" in info.value.message


def test_real_secrets_are_taken(monkeypatch):
    monkeypatch.setenv("KILN_BOOTSTRAP_TOKEN", "9f" * 32)
    monkeypatch.setenv("KILN_DATABASE_URL", "postgresql+psycopg://kiln:s3cr3t@db:5432/kiln")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY")
    assert Settings().bootstrap_token == "9f" * 32


@pytest.mark.parametrize("command", [["api", "--port", "1"], ["worker"], ["db", "upgrade"]])
def test_the_processes_exit_at_once_naming_the_variable(tmp_path, command):
    """The API answered POST /v1/tokens with a new admin token when started with the shipped bootstrap token: the
    processes (API, worker, migrations) now exit non-zero before serving anything, with one line naming it."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "KILN_HOME": str(tmp_path / "home"),
           "PYTHONPATH": str(REPO), "KILN_BOOTSTRAP_TOKEN": "REPLACE-ME-openssl-rand-hex-32"}
    out = subprocess.run([sys.executable, "-m", "api.cli", *command], env=env, cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        "kiln: error: KILN_BOOTSTRAP_TOKEN: is a placeholder (REPLACE-ME…), not a secret; Kiln does not start with it "
        "(make one with openssl rand -hex 32)"]
    assert not (tmp_path / "home").exists()  # nothing was made (no database, no key)

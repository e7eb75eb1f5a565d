"""Settings from the environment: an empty variable means the setting is not set (the Kubernetes base writes
``KILN_S3_ENDPOINT_URL: ""`` for AWS S3; read as an endpoint of "", botocore refuses it and every process stops)."""

from __future__ import annotations

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

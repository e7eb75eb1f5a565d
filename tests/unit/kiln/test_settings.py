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
    store = open_store("s3://kiln-bucket/engines", s3_endpoint_url=s.s3_endpoint_url)  # no ValueError: Invalid endpoint
    assert store is not None

"""The admission webhook's TLS, as the Kubernetes API server would check it: the documented self-signed setup
(deploy/kubernetes/components/admission/self-signed-cert.sh) makes a CA and a serving certificate, and `kiln
api --ssl-certfile --ssl-keyfile` (what the admission Deployment runs) serves HTTPS that verifies against that
CA under the Service's DNS name. No cluster here: a local process stands in for the pod."""

from __future__ import annotations

import os
import shutil
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "deploy" / "kubernetes" / "components" / "admission" / "self-signed-cert.sh"
SERVICE_DNS = "kiln-admission.kiln.svc"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def https_get(port: int, path: str, ca: Path, server_hostname: str) -> bytes:
    ctx = ssl.create_default_context(cafile=str(ca))
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        with ctx.wrap_socket(raw, server_hostname=server_hostname) as tls:
            tls.sendall(f"GET {path} HTTP/1.1\r\nHost: {server_hostname}\r\nConnection: close\r\n\r\n".encode())
            chunks = []
            while chunk := tls.recv(65536):
                chunks.append(chunk)
    return b"".join(chunks)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_self_signed_setup_serves_tls_that_verifies_under_the_service_name(tmp_path):
    certs = tmp_path / "tls"
    made = subprocess.run(["bash", str(SCRIPT), str(certs)], capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    assert "kubectl -n kiln create secret tls kiln-admission-tls" in made.stdout and "caBundle" in made.stdout
    port = free_port()
    env = {**os.environ, "KILN_HOME": str(tmp_path / "home")}
    proc = subprocess.Popen([sys.executable, "-m", "api.cli", "api", "--host", "127.0.0.1", "--port", str(port),
                             "--ssl-certfile", str(certs / "tls.crt"), "--ssl-keyfile", str(certs / "tls.key")],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline, answer = time.monotonic() + 90, b""
        while time.monotonic() < deadline:
            try:
                answer = https_get(port, "/healthz", certs / "ca.crt", SERVICE_DNS)
                break
            except (ConnectionRefusedError, ConnectionResetError, ssl.SSLEOFError):
                time.sleep(0.5)
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
        with pytest.raises(ssl.SSLCertVerificationError):  # another name is refused, as the API server would
            https_get(port, "/healthz", certs / "ca.crt", "kiln-api.kiln.svc")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_api_refuses_a_certificate_without_its_key(tmp_path):
    cert = tmp_path / "tls.crt"
    cert.write_text("not used")
    proc = subprocess.run([sys.executable, "-m", "api.cli", "api", "--ssl-certfile", str(cert)], cwd=REPO,
                          env={**os.environ, "KILN_HOME": str(tmp_path / "home")}, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "ssl_keyfile" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1

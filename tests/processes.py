"""Waiting for a server a test started as a process: until it answers, or failing the test with its log's tail
when it exits or stays silent."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import httpx
import pytest


def wait_answering(proc: subprocess.Popen, base: str, path: str, *, log: Path, what: str,
                   timeout: float = 30) -> None:
    """Poll ``GET base+path`` every 0.1 s until it answers 200; fail the test naming ``what`` if ``proc`` exits
    first (with the last 2,000 characters of ``log``) or nothing answers within ``timeout`` seconds."""
    for _ in range(int(timeout * 10)):
        try:
            if httpx.get(f"{base}{path}", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            pytest.fail(f"{what} exited: {log.read_text()[-2000:]}")
        time.sleep(0.1)
    pytest.fail(f"{what} did not answer {path} in {timeout:g} s")

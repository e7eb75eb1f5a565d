"""The GitHub Actions template's build step (examples/ci/github/kiln-build.yml, step ``build``), run by bash as a
runner runs it against a real Kiln, for the tests that drive it with the full install and with the client's."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from tests.conftest import REPO

WORKFLOW = REPO / "examples" / "ci" / "github" / "kiln-build.yml"
ENTRY = "fp8-cpu-latency-checkpoint"


def run_github_build_step(served, root: Path, *, env: dict[str, str], model: str,
                          build_file: Path | None = None) -> tuple[str, Path, str]:
    """Run the step in ``root/work`` with ``env`` (PATH with the ``kiln`` to use, and anything else) for an FP8
    checkpoint-backend build of the shipped model as ``model`` — or, with ``build_file``, the step's build-file path
    (``kiln build -f``; the per-entry inputs left as GitHub passes them for the one build-file job); checks that it
    passed and returns (the digest it output, its work folder, its job summary)."""
    step = next(s for s in yaml.safe_load(WORKFLOW.read_text())["jobs"]["build"]["steps"] if s.get("id") == "build")
    work, out, summary = root / "work", root / "output", root / "summary"
    work.mkdir(parents=True)
    env = {**env, "GITHUB_OUTPUT": str(out), "GITHUB_STEP_SUMMARY": str(summary), "KILN_URL": served.url,
           "KILN_TOKEN": "", "CHECKPOINT": str(REPO / "examples" / "tiny-llama"), "MODEL_NAME": model,
           "PRECISION": "fp8", "TARGET": "cpu", "PROFILE": "latency", "BACKEND": "checkpoint", "KV_CACHE": "none",
           "ENTRY": ENTRY, "BUILD_FILE": "", "MATRIX": "", "WAIT_MINUTES": "120"}
    if build_file is not None:
        env.update({"BUILD_FILE": str(build_file), "ENTRY": "build-file", "PRECISION": "", "TARGET": "",
                    "PROFILE": "", "BACKEND": "", "KV_CACHE": "none", "CHECKPOINT": "", "MODEL_NAME": ""})
    proc = subprocess.run(["bash", "-e", "-c", step["run"]], cwd=work, env=env, capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, proc.stdout + proc.stderr + served.log("serve")[-3000:]
    outputs = dict(line.split("=", 1) for line in out.read_text().splitlines())
    digest = outputs["digest"]
    assert digest.startswith("sha256:") and outputs["exit-code"] == "0"
    text = summary.read_text()
    assert "validated and published" in text
    return digest, work, text

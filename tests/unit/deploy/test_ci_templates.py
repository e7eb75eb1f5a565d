"""examples/ci: the reusable GitHub Actions workflow and the GitLab CI template, checked against GitHub's and
GitLab's published schemas (check-jsonschema's vendored copies) and by actionlint, their ``kiln`` command lines
against the real CLI's options, and the GitHub build step's script run for real with the real CLI (against a
server that is not there: it must record the exit code and still fail the step)."""

from __future__ import annotations

import json
import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import click
import pytest
import yaml

from api.cli import main as kiln_main

REPO = Path(__file__).resolve().parents[3]
GITHUB = REPO / "examples" / "ci" / "github" / "kiln-build.yml"
GITLAB = REPO / "examples" / "ci" / "gitlab" / "kiln-build.gitlab-ci.yml"
BIN = Path(sys.executable).parent


def tool(name: str) -> str:
    path = BIN / name
    if not path.exists():
        pytest.fail(f"{name} is not installed: pip install -e '.[test]' (it is in the test extra)")
    return str(path)


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def build_options() -> set[str]:
    cmd = kiln_main.commands["build"]
    return {opt for p in cmd.params if isinstance(p, click.Option) for opt in p.opts + p.secondary_opts}


def report_options() -> set[str]:
    cmd = kiln_main.commands["report"]
    return {opt for p in cmd.params if isinstance(p, click.Option) for opt in p.opts + p.secondary_opts}


def kiln_flags(script: str, *, command: str = "build") -> set[str]:
    """Every --flag the script passes to `kiln build` (the args array / `set --` lines), or to `kiln report`."""
    lines = script.replace("\\\n", " ").splitlines()
    picked = [ln for ln in lines if ("kiln report" in ln) == (command == "report")]
    flags = set()
    for token in shlex.split("\n".join(picked), comments=True, posix=True):
        if token.startswith("--") and token != "--" and "=" not in token:  # `set --` is the shell's
            flags.add(token.rstrip(")"))
    return flags


@pytest.mark.parametrize("schema,path", [("vendor.github-workflows", GITHUB), ("vendor.gitlab-ci", GITLAB)])
def test_templates_validate_against_the_vendor_schemas(schema, path):
    proc = subprocess.run([tool("check-jsonschema"), "--builtin-schema", schema, str(path)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_actionlint_finds_nothing_in_the_workflow():
    proc = subprocess.run([tool("actionlint"), "-no-color", str(GITHUB)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def github_build_step() -> dict:
    steps = load(GITHUB)["jobs"]["build"]["steps"]
    return next(s for s in steps if s.get("id") == "build")


def test_github_workflow_is_reusable_with_the_inputs_a_ci_job_needs():
    wf = load(GITHUB)
    call = wf[True]["workflow_call"] if True in wf else wf["on"]["workflow_call"]  # YAML 1.1 reads `on` as True
    assert {"kiln-url", "checkpoint", "matrix"} <= set(call["inputs"])
    assert "kiln-token" in call["secrets"] and "digests" in call["outputs"]
    build = wf["jobs"]["build"]
    include = build["strategy"]["matrix"]["include"]
    assert include.startswith("${{ fromJSON(inputs.build-file != '' && '[{\"name\": \"build-file\"}]' || inputs.matrix")
    assert "{\"precision\": \"fp8\", \"target\": \"h100\", \"profile\": \"throughput\"}" in include
    assert build["strategy"]["fail-fast"] is False
    step = github_build_step()
    assert step["env"]["KILN_TOKEN"] == "${{ secrets.kiln-token }}"  # the token only ever comes from a secret
    assert "${{" not in step["run"]  # inputs reach the shell through env, never spliced into the script
    upload = next(s for s in build["steps"] if str(s.get("uses", "")).startswith("actions/upload-artifact"))
    assert upload["if"] == "always()" and upload["with"]["path"] == "kiln-reports/"


def test_github_and_gitlab_command_lines_use_real_kiln_build_options():
    real = build_options()
    gitlab_script = "\n".join(load(GITLAB)[".kiln-build"]["script"])
    for script in (github_build_step()["run"], gitlab_script):
        used = kiln_flags(script)
        assert {"--server", "--wait", "--junit", "--report-html", "--json"} <= used
        assert used <= real, used - real
        assert {"--timeout"} <= used  # the bounded wait
        reported = kiln_flags(script, command="report")  # -f writes no report: each engine's is fetched
        assert {"--server", "--format"} <= reported <= report_options(), reported


def test_gitlab_template_reports_junit_always_and_passes_the_digest_on():
    job = load(GITLAB)[".kiln-build"]
    assert job["artifacts"]["when"] == "always"
    assert job["artifacts"]["reports"]["junit"] == "kiln-reports/junit*.xml"  # junit.xml, or junit-ENTRY.xml (-f)
    assert job["artifacts"]["reports"]["dotenv"] == "kiln-reports/kiln.env"
    assert load(GITLAB)["kiln-build"]["extends"] == ".kiln-build"


def test_github_build_step_records_the_exit_code_and_fails_with_it(tmp_path):
    """The step's own script, run by bash with the real CLI: no Kiln server listens on the URL, so kiln exits
    3; the step must still write its outputs and summary, and exit 3 (failing the job)."""
    shim = tmp_path / "bin" / "kiln"
    shim.parent.mkdir()
    shim.write_text(f"#!/bin/sh\nPYTHONPATH={shlex.quote(str(REPO))} exec {shlex.quote(sys.executable)} -m api.cli \"$@\"\n")
    shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    step = github_build_step()
    work = tmp_path / "work"
    work.mkdir()
    out, summary = tmp_path / "output", tmp_path / "summary"
    env = {**os.environ, "PATH": f"{shim.parent}{os.pathsep}{BIN}{os.pathsep}{os.environ['PATH']}",
           "GITHUB_OUTPUT": str(out), "GITHUB_STEP_SUMMARY": str(summary), "KILN_URL": "http://127.0.0.1:9",
           "KILN_TOKEN": "", "CHECKPOINT": "hf://acme/tiny@" + "a" * 40, "MODEL_NAME": "acme/tiny",
           "PRECISION": "fp8", "TARGET": "h100", "PROFILE": "throughput", "BACKEND": "", "KV_CACHE": "none",
           "ENTRY": "fp8-h100-throughput", "BUILD_FILE": "", "MATRIX": "", "WAIT_MINUTES": "120", "KILN_HOME": str(tmp_path / "home")}
    proc = subprocess.run(["bash", "-e", "-c", step["run"]], cwd=work, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "cannot reach http://127.0.0.1:9" in proc.stderr
    outputs = dict(line.split("=", 1) for line in out.read_text().splitlines())
    assert outputs == {"digest": "", "exit-code": "3"}
    assert "error (exit 3)" in summary.read_text() and "fp8-h100-throughput" in summary.read_text()
    assert (work / "kiln-reports" / "digest.json").read_text().strip() == '{"fp8-h100-throughput": ""}'
    # no engine: the JUnit file holds the build error, so the CI test view says why
    assert "<error" in (work / "kiln-reports" / "junit.xml").read_text()


def test_gitlab_script_records_the_digest_file_and_fails_with_kilns_exit_code(tmp_path):
    """The template's script (all but the pip install), run as GitLab's bash runner runs it (errexit, pipefail),
    with the real CLI against an unreachable server: exit 3, the dotenv and JUnit files still written."""
    shim = tmp_path / "bin" / "kiln"
    shim.parent.mkdir()
    shim.write_text(f"#!/bin/sh\nPYTHONPATH={shlex.quote(str(REPO))} exec {shlex.quote(sys.executable)} -m api.cli \"$@\"\n")
    shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    script = load(GITLAB)[".kiln-build"]["script"]
    assert script[0].startswith("python -m pip install")
    variables = {k: str(v) for k, v in load(GITLAB)["variables"].items()}
    env = {**os.environ, **variables, "PATH": f"{shim.parent}{os.pathsep}{BIN}{os.pathsep}{os.environ['PATH']}",
           "KILN_URL": "http://127.0.0.1:9", "KILN_CHECKPOINT": "hf://acme/tiny@" + "a" * 40,
           "KILN_HOME": str(tmp_path / "home")}
    work = tmp_path / "work"
    work.mkdir()
    proc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", "\n".join(script[1:])], cwd=work, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert (work / "kiln-reports" / "kiln.env").read_text() == "KILN_DIGEST_FP8_H100_THROUGHPUT=\n"
    assert "<error" in (work / "kiln-reports" / "junit.xml").read_text()
    assert "exit 3: error (exit 3)" in proc.stdout


def test_templates_install_the_client_with_a_pip_cache_on_images_that_can():
    """The kiln-client distribution (no torch), pip's cache kept; GitLab's image has git for a git+https install."""
    steps = load(GITHUB)["jobs"]["build"]["steps"]
    setup = next(s for s in steps if str(s.get("uses", "")).startswith("actions/setup-python"))
    assert setup["with"]["cache"] == "pip" and setup["with"]["cache-dependency-path"] == "kiln-client-requirements.txt"
    assert any("pip install -r kiln-client-requirements.txt" in s.get("run", "") for s in steps)
    gitlab = load(GITLAB)
    job = gitlab[".kiln-build"]
    image = job["image"].replace("$KILN_PYTHON_IMAGE", gitlab["variables"]["KILN_PYTHON_IMAGE"])
    assert image.startswith("python:") and "slim" not in image and "alpine" not in image
    assert job["variables"]["PIP_CACHE_DIR"] == "$CI_PROJECT_DIR/.cache/pip" and job["cache"]["paths"] == [".cache/pip"]
    for path in (GITHUB, GITLAB):  # the usage examples name the client distribution, never the CI commit as revision
        text = path.read_text()
        assert "subdirectory=client" in text and "kiln-client @" in text
        assert "@${{ github.sha }}" not in text and "@$CI_COMMIT_SHA" not in text


def run_github_step(tmp_path, **env_overrides) -> tuple[subprocess.CompletedProcess, Path, Path]:
    """The GitHub build step with a `kiln` that records its arguments and exits 1 (a rejected engine), unless the
    test put its own `kiln` in tmp_path/bin."""
    shim = tmp_path / "bin" / "kiln"
    shim.parent.mkdir(exist_ok=True)
    if not shim.exists():
        shim.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {shlex.quote(str(tmp_path / 'argv'))}\n"
                        "echo '{\"digest\": \"sha256:" + "b" * 64 + "\", \"status\": \"failed\"}'\nexit 1\n")
    shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    out, summary = tmp_path / "output", tmp_path / "summary"
    env = {**os.environ, "PATH": f"{shim.parent}{os.pathsep}{BIN}{os.pathsep}{os.environ['PATH']}",
           "GITHUB_OUTPUT": str(out), "GITHUB_STEP_SUMMARY": str(summary), "KILN_URL": "http://127.0.0.1:9",
           "KILN_TOKEN": "", "CHECKPOINT": "hf://acme/tiny", "REVISION": "c" * 40, "MODEL_NAME": "",
           "PRECISION": "nvfp4", "TARGET": "b200", "PROFILE": "latency", "BACKEND": "checkpoint", "KV_CACHE": "none",
           "ENTRY": "nvfp4-b200", "BUILD_FILE": "", "MATRIX": "", "WAIT_MINUTES": "120", **env_overrides}
    proc = subprocess.run(["bash", "-e", "-c", github_build_step()["run"]], cwd=work, env=env, capture_output=True,
                          text=True, timeout=60)
    return proc, work, summary


def test_github_step_builds_the_models_revision_and_fails_on_a_rejected_engine(tmp_path):
    proc, work, summary = run_github_step(tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # the job fails: the engine was rejected
    argv = (tmp_path / "argv").read_text().splitlines()
    assert argv[:2] == ["build", "hf://acme/tiny@" + "c" * 40]
    assert "FAILED validation" in summary.read_text() and "::error title=kiln nvfp4-b200::" in proc.stdout
    assert (work / "kiln-reports" / "digest.json").read_text().strip() == '{"nvfp4-b200": "sha256:' + "b" * 64 + '"}'


def test_github_step_refuses_two_revisions(tmp_path):
    proc, _, _ = run_github_step(tmp_path, CHECKPOINT="hf://acme/tiny@main")
    assert proc.returncode == 2 and "already names a revision" in proc.stdout
    assert not (tmp_path / "argv").exists()


def test_gitlab_entries_write_their_digests_under_their_own_names(tmp_path):
    script = load(GITLAB)[".kiln-build"]["script"]
    shim = tmp_path / "bin" / "kiln"
    shim.parent.mkdir()
    shim.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {shlex.quote(str(tmp_path / 'argv'))}\n"
                    "echo '{\"digest\": \"sha256:" + "d" * 64 + "\"}'\n")
    shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    variables = {k: str(v) for k, v in load(GITLAB)["variables"].items()}
    names = set()
    for target, backend in (("h100", ""), ("l40s", ""), ("h100", "trtllm-engine")):
        work = tmp_path / f"work-{target}-{backend}"
        work.mkdir()
        env = {**os.environ, **variables, "PATH": f"{shim.parent}{os.pathsep}{BIN}{os.pathsep}{os.environ['PATH']}",
               "KILN_URL": "http://127.0.0.1:9", "KILN_CHECKPOINT": "hf://acme/tiny", "KILN_REVISION": "v1.0",
               "KILN_TARGET": target, "KILN_BACKEND": backend}
        proc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", "\n".join(script[1:])], cwd=work, env=env,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert (tmp_path / "argv").read_text().splitlines()[1] == "hf://acme/tiny@v1.0"
        name, value = (work / "kiln-reports" / "kiln.env").read_text().strip().split("=", 1)
        assert value == "sha256:" + "d" * 64
        names.add(name)
    assert names == {"KILN_DIGEST_FP8_H100_THROUGHPUT", "KILN_DIGEST_FP8_L40S_THROUGHPUT",
                     "KILN_DIGEST_FP8_H100_THROUGHPUT_TRTLLM_ENGINE"}


def recording_kiln(tmp_path: Path, *, stdout: str, rc: int) -> Path:
    """A `kiln` that appends each call's arguments (one per line, then ---) to tmp_path/argv, prints ``stdout`` for
    `kiln build` and exits ``rc``; `kiln report … -o FILE` writes FILE (what the template fetches per engine)."""
    shim = tmp_path / "bin" / "kiln"
    shim.parent.mkdir(exist_ok=True)
    (tmp_path / "build.out").write_text(stdout + "\n")
    shim.write_text("#!/bin/sh\n"
                    f"{{ printf '%s\\n' \"$@\"; echo ---; }} >> {shlex.quote(str(tmp_path / 'argv'))}\n"
                    "if [ \"$1\" = report ]; then while [ $# -gt 1 ]; do [ \"$1\" = -o ] && echo \"report $2\" > \"$2\";"
                    " shift; done; exit 0; fi\n"
                    f"cat {shlex.quote(str(tmp_path / 'build.out'))}\nexit {rc}\n")
    shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    return shim


def calls(tmp_path: Path) -> list[list[str]]:
    text = (tmp_path / "argv").read_text() if (tmp_path / "argv").exists() else ""
    return [c.strip("\n").splitlines() for c in text.split("---\n") if c.strip()]


def file_result(exit_code: int) -> str:
    """The last stdout line of `kiln build -f examples/kiln.yaml --server --wait --json`: three entries."""
    rows = [{"entry": 0, "precision": "fp8", "target": "cpu", "profile": "latency", "backend": None,
             "status": "succeeded", "exit": 0, "digest": "sha256:" + "1" * 64},
            {"entry": 1, "precision": "nvfp4", "target": "cpu", "profile": "balanced", "backend": None,
             "status": "failed", "exit": 1, "digest": "sha256:" + "2" * 64},
            {"entry": 2, "precision": "fp8", "target": "cpu", "profile": "latency", "backend": None,
             "status": "running", "exit": 4, "digest": None}]
    return json.dumps({"file": "examples/kiln.yaml", "builds": rows, "exit": exit_code})


def test_github_step_builds_a_build_file_with_a_bounded_wait(tmp_path):
    """build-file set: one `kiln build -f FILE --server --wait --json --timeout` (no per-entry flags), every entry's
    digest under its own name, each engine's report fetched, and exit 1 failing the job."""
    recording_kiln(tmp_path, stdout=file_result(1), rc=1)
    proc, work, summary = run_github_step(tmp_path, BUILD_FILE="examples/kiln.yaml", REVISION="",
                                          WAIT_MINUTES="30", ENTRY="build-file", PRECISION="", TARGET="", PROFILE="")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    build, *reports = calls(tmp_path)
    assert build == ["build", "-f", "examples/kiln.yaml", "--server", "http://127.0.0.1:9", "--wait", "--json",
                     "--timeout", "1800"]
    digests = json.loads((work / "kiln-reports" / "digest.json").read_text())
    assert digests == {"fp8-cpu-latency": "sha256:" + "1" * 64, "nvfp4-cpu-balanced": "sha256:" + "2" * 64,
                       "fp8-cpu-latency-3": ""}
    assert sorted(r[r.index("--format") + 1] + " " + r[1] for r in reports) == [
        "html sha256:" + "1" * 64, "html sha256:" + "2" * 64, "junit sha256:" + "1" * 64, "junit sha256:" + "2" * 64]
    assert (work / "kiln-reports" / "junit-nvfp4-cpu-balanced.xml").exists()
    text = summary.read_text()
    assert "build file: `examples/kiln.yaml`" in text and "FAILED validation" in text
    assert "- nvfp4-cpu-balanced: `sha256:" + "2" * 64 + "`" in text and "- fp8-cpu-latency-3: `none`" in text
    outputs = dict(line.split("=", 1) for line in (tmp_path / "output").read_text().splitlines())
    assert outputs == {"digest": "sha256:" + "1" * 64, "exit-code": "1"}


def test_github_step_says_a_timed_out_wait_is_still_building(tmp_path):
    recording_kiln(tmp_path, stdout="", rc=4)
    proc, work, summary = run_github_step(tmp_path, WAIT_MINUTES="5")
    assert proc.returncode == 4, proc.stdout + proc.stderr
    i = calls(tmp_path)[0].index("--timeout")
    assert calls(tmp_path)[0][i + 1] == "300"
    assert "still building on Kiln: the job's wait of 5 min ran out; follow it on http://127.0.0.1:9" in \
        summary.read_text()
    assert "::error title=kiln nvfp4-b200::still building on Kiln" in proc.stdout


@pytest.mark.parametrize("overrides,message", [
    ({"BUILD_FILE": "kiln.yaml", "MATRIX": '[{"precision": "fp8"}]', "REVISION": ""},
     "::error::matrix and build-file were both given"),
    ({"BUILD_FILE": "kiln.yaml"}, "::error::revision is not used with build-file"),
    ({"WAIT_MINUTES": "0"}, "::error::wait-minutes 0 is not a whole number of minutes from 1 to 340"),
    ({"WAIT_MINUTES": "341"}, "::error::wait-minutes 341 is not"),
    ({"WAIT_MINUTES": "1.5"}, "::error::wait-minutes 1.5 is not"),
    ({"CHECKPOINT": ""}, "::error::checkpoint is empty; give the checkpoint input"),
])
def test_github_step_refuses_a_bad_combination_before_calling_kiln(tmp_path, overrides, message):
    recording_kiln(tmp_path, stdout="{}", rc=0)
    proc, _, _ = run_github_step(tmp_path, **overrides)
    assert proc.returncode == 2 and proc.stdout.startswith(message), proc.stdout + proc.stderr
    assert len(proc.stdout.strip().splitlines()) == 1 and not calls(tmp_path)


def run_gitlab_script(tmp_path, **env_overrides) -> tuple[subprocess.CompletedProcess, Path]:
    script = load(GITLAB)[".kiln-build"]["script"]
    variables = {k: str(v) for k, v in load(GITLAB)["variables"].items()}
    env = {**os.environ, **variables, "PATH": f"{tmp_path / 'bin'}{os.pathsep}{BIN}{os.pathsep}{os.environ['PATH']}",
           "KILN_URL": "http://127.0.0.1:9", "KILN_CHECKPOINT": "hf://acme/tiny", "KILN_HOME": str(tmp_path / "home"),
           **env_overrides}
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    proc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", "\n".join(script[1:])], cwd=work, env=env,
                          capture_output=True, text=True, timeout=300)
    return proc, work


def test_gitlab_script_builds_a_build_file_with_a_bounded_wait(tmp_path):
    recording_kiln(tmp_path, stdout=file_result(4), rc=4)
    proc, work = run_gitlab_script(tmp_path, KILN_BUILD_FILE="examples/kiln.yaml", KILN_WAIT_MINUTES="10",
                                   KILN_CHECKPOINT="")
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert calls(tmp_path)[0] == ["build", "-f", "examples/kiln.yaml", "--server", "http://127.0.0.1:9", "--wait",
                                  "--json", "--timeout", "600"]
    assert (work / "kiln-reports" / "kiln.env").read_text().splitlines() == [
        "KILN_DIGEST_FP8_CPU_LATENCY=sha256:" + "1" * 64, "KILN_DIGEST_NVFP4_CPU_BALANCED=sha256:" + "2" * 64,
        "KILN_DIGEST_FP8_CPU_LATENCY_3="]
    assert (work / "kiln-reports" / "junit-NVFP4_CPU_BALANCED.xml").exists()
    assert "still building on Kiln: the job's wait of 10 min ran out" in proc.stdout


@pytest.mark.parametrize("overrides,message", [
    ({"KILN_BUILD_FILE": "kiln.yaml", "CI_NODE_TOTAL": "2"}, "kiln: KILN_BUILD_FILE builds every entry"),
    ({"KILN_BUILD_FILE": "kiln.yaml", "KILN_REVISION": "v1"}, "kiln: KILN_REVISION is not used with KILN_BUILD_FILE"),
    ({"KILN_CHECKPOINT": ""}, "kiln: KILN_CHECKPOINT is empty"),
    ({"KILN_WAIT_MINUTES": "600"}, "kiln: KILN_WAIT_MINUTES 600 is not a whole number of minutes from 1 to 340"),
])
def test_gitlab_script_refuses_a_bad_combination_before_calling_kiln(tmp_path, overrides, message):
    recording_kiln(tmp_path, stdout="{}", rc=0)
    proc, _ = run_gitlab_script(tmp_path, **overrides)
    assert proc.returncode == 2 and proc.stdout.startswith(message), proc.stdout + proc.stderr
    assert not calls(tmp_path)


def test_build_file_step_runs_the_real_cli_and_fails_with_its_exit_code(tmp_path):
    """The build-file command line as the real CLI takes it (-f with --timeout): examples/kiln.yaml submitted to a
    server that is not there, exit 3, the digest file still written (empty)."""
    shim = tmp_path / "bin" / "kiln"
    shim.parent.mkdir()
    shim.write_text(f"#!/bin/sh\nPYTHONPATH={shlex.quote(str(REPO))} exec {shlex.quote(sys.executable)} -m api.cli \"$@\"\n")
    shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    proc, work, summary = run_github_step(tmp_path, BUILD_FILE=str(REPO / "examples" / "kiln.yaml"), REVISION="",
                                          ENTRY="build-file", KILN_HOME=str(tmp_path / "home"))
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "cannot reach http://127.0.0.1:9" in proc.stderr
    assert json.loads((work / "kiln-reports" / "digest.json").read_text()) == {"build-file": ""}
    assert "error (exit 3)" in summary.read_text() and "build file: `" in summary.read_text()

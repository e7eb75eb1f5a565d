"""The main job end to end through the real CLI process on the embedded defaults (SQLite, local store):
real ModelOpt calibration, real AOTInductor compile, real validation of the compiled artifact."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow


def kiln(*args: str, home: Path, check: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, "KILN_HOME": str(home), "KILN_CHECKPOINT_ROOTS": f"{REPO}{os.pathsep}{home.parent}"}
    proc = subprocess.run([sys.executable, "-m", "api.cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"kiln {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


def last_json(proc: subprocess.CompletedProcess) -> dict:
    return json.loads(proc.stdout.strip().splitlines()[-1])


def stages(out: dict) -> dict[str, str]:
    return {s["name"]: s["status"] for s in out["stages"]}


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("e2e") / "kiln"


@pytest.fixture(scope="module")
def fp8(home) -> dict:
    proc = kiln("build", "examples/tiny-llama", "--precision", "fp8", "--profile", "latency", "--json",
                home=home, check=True)
    return last_json(proc)


class TestTheQuickStartBuild:
    """The README's first command's build (FP8, ``latency``) and what follows from it in the same home; these
    tests share it, so they run on one xdist worker (tests/conftest.py ``work_unit``)."""

    def test_fp8_build_runs_every_stage_and_validates(self, fp8):
        assert fp8["status"] == "succeeded" and fp8["cache_hit"] is False
        assert fp8["digest"].startswith("sha256:") and len(fp8["digest"]) == 71
        assert stages(fp8) == {"resolve": "ran", "quantize": "ran", "compile": "ran", "validate": "ran", "publish": "ran"}
        m = fp8["validation"]["metrics"]
        assert fp8["validation"]["passed"] is True
        # FP8 W8A8 on this model costs well under 3 % perplexity (README's sample run: +0.34 %)
        assert 0 <= m["ppl_increase_pct"] < 3
        assert m["reference_perplexity"] < 100  # the shipped model is trained: far below uniform (2048)
        assert m["top1_agreement"] > 0.85
        assert len(m["throughput"]) >= 3 and all(p["tokens_per_s"] > 0 for p in m["throughput"])

    def test_readmes_sample_has_the_shape_of_what_the_cli_prints_now(self, fp8, capsys):
        """README's sample (scripts/readme_sample.py writes it from a real run) against this same command's result
        rendered as the CLI renders it: stale when the CLI's words or layout change (numbers and digests masked)."""
        from api.cli import _print_summary
        from api.progress import Progress
        from scripts.readme_sample import mask, sample

        a = fp8["artifact"]
        print(f"building {a['repository']} {a['precision']} {a['profile']} for {a['target']} with {a['backend']}")
        progress = Progress(quiet=False, tty=False, ticker=False)
        for stage in fp8["stages"]:
            progress("stage", {"name": stage["name"], "state": "started"})
            progress("stage", {**stage, "state": "finished"})
        _print_summary(fp8)
        got = capsys.readouterr()
        rendered = got.out.splitlines()[:1] + got.err.splitlines() + got.out.splitlines()[1:]
        assert [mask(x) for x in rendered] == [mask(x) for x in sample()], (
            "README's sample is stale: run python scripts/readme_sample.py")

    def test_identical_rebuild_is_a_cache_hit_with_no_stage_run(self, home, fp8):
        proc = kiln("build", "examples/tiny-llama", "--precision", "fp8", "--profile", "latency", "--json",
                    home=home, check=True)
        again = last_json(proc)
        assert again["cache_hit"] is True
        assert again["digest"] == fp8["digest"] and again["build_key"] == fp8["build_key"]
        assert set(stages(again).values()) == {"cached"}
        assert "cached" in proc.stderr

    def test_profile_only_change_reuses_the_quantized_checkpoint(self, home, fp8):
        out = last_json(kiln("build", "examples/tiny-llama", "--precision", "fp8", "--profile", "balanced", "--json",
                             home=home, check=True))
        assert stages(out)["quantize"] == "cached"
        assert stages(out)["compile"] == "ran" and stages(out)["validate"] == "ran"
        assert out["digest"] != fp8["digest"] and out["build_key"] != fp8["build_key"]
        # the same evaluation (windows capped by the same max_seq_len): the unquantized reference is not run again
        assert fp8["validation"]["reference"]["reused"] is False and out["validation"]["reference"]["reused"] is True
        assert out["validation"]["reference"]["key"] == fp8["validation"]["reference"]["key"]
        assert out["artifact"]["tag"] == "fp8-cpu-balanced"
        batches = {p["batch_size"] for p in out["validation"]["metrics"]["throughput"]}
        assert batches == {1, 2, 4, 8}

    def test_checkpoint_backend_and_impossible_gate(self, home, fp8):
        ok = last_json(kiln("build", "examples/tiny-llama", "--backend", "checkpoint", "--json", home=home, check=True))
        assert ok["status"] == "succeeded" and stages(ok)["quantize"] == "cached"
        proc = kiln("build", "examples/tiny-llama", "--backend", "checkpoint", "--gate", "min_top1_agreement=1.01",
                    "--json", home=home)
        assert proc.returncode == 1, proc.stderr
        out = last_json(proc)
        assert out["status"] == "failed" and out["artifact"]["status"] == "rejected"
        failed = [g["name"] for g in out["validation"]["gates"] if not g["passed"]]
        # the impossible gate fails; the only other gate that may is the throughput regression against the first
        # checkpoint engine (its speed, measured on two shared cores, moves with whatever else runs)
        assert "min_top1_agreement" in failed and set(failed) <= {"min_top1_agreement", "max_throughput_drop_pct"}, failed
        assert "failed validation" in proc.stderr
        # --json keeps stdout for the file; the CI log still shows why (the gate table on stderr)
        assert "validation FAILED (" in proc.stderr and "≥ 101.0%  FAIL" in proc.stderr

    def test_a_checkpoint_for_a_named_runtime_says_what_computed_its_numbers(self, home, fp8):
        refused = kiln("build", "examples/tiny-llama", "--backend", "checkpoint", "--runtime", "vllm", "--recipe",
                       "fp8", home=home)
        assert refused.returncode == 2 and "vLLM refuses recipe fp8 on cpu" in refused.stderr
        proc = kiln("build", "examples/tiny-llama", "--backend", "checkpoint", "--runtime", "vllm", "--json",
                    home=home, check=True)
        out = last_json(proc)
        assert out["status"] == "succeeded" and out["validation"]["recipe"]["built"] == "fp8-pcpt"  # auto skipped fp8
        runtime = out["validation"]["conditions"]["runtime"]
        assert runtime["computed_by"].startswith("kiln") and runtime["serves_on"] == "vllm"
        assert "vllm did not compute these numbers" in runtime["note"]
        again = kiln("build", "examples/tiny-llama", "--backend", "checkpoint", "--runtime", "vllm", home=home, check=True)
        assert "only resolve ran" in again.stdout  # the same spec: answered from the registry, summary and all
        assert "computed by kiln" in again.stdout and "for vllm: vllm did not compute" in again.stdout

    def test_a_cache_hit_says_where_the_engine_is_and_force_builds_anew_keeping_both(self, home, fp8):
        kiln("build", "examples/tiny-llama", "--backend", "checkpoint", home=home, check=True)  # built, or a hit
        hit = kiln("build", "examples/tiny-llama", "--backend", "checkpoint", home=home, check=True)
        assert f"cache hit: an identical engine is already in KILN_HOME {home}" in hit.stderr
        assert "only resolve ran" in hit.stderr and "--force" in hit.stderr
        before = last_json(kiln("build", "examples/tiny-llama", "--backend", "checkpoint", "--json", home=home,
                                check=True))
        forced = last_json(kiln("build", "examples/tiny-llama", "--backend", "checkpoint", "--force", "--json",
                                home=home, check=True))
        assert forced["cache_hit"] is False and forced["status"] == "succeeded"
        assert {k: v for k, v in stages(forced).items() if k != "resolve"} == {
            "quantize": "ran", "compile": "ran", "validate": "ran", "publish": "ran"}
        assert forced["digest"] != before["digest"] and forced["build_key"] != before["build_key"]
        assert forced["validation"]["reference"]["reused"] is True  # the reference does not depend on the engine
        listed = {r["digest"]: r for r in json.loads(kiln("artifacts", "list", "--json", home=home, check=True).stdout)}
        assert listed[before["digest"]]["status"] == "fresh" and listed[forced["digest"]]["status"] == "fresh"
        art = forced["artifact"]
        shown = json.loads(kiln("artifacts", "show", f"{art['repository']}:{art['tag']}", home=home, check=True).stdout)
        assert shown["digest"] == forced["digest"]  # the tag moved to the new engine
        refused = kiln("build", "examples/tiny-llama", "--force", "--server", "http://127.0.0.1:9", home=home)
        assert refused.returncode == 2 and "force" in refused.stderr

    def test_the_quick_start_engine_is_signed_and_verifies_offline(self, home, fp8, tmp_path):
        """The embedded defaults sign with a key generated under KILN_HOME; the pulled engine verifies with the real
        model_signing CLI and the public key alone."""
        key = home / "keys" / "signing-key.pem"
        assert key.is_file() and (key.stat().st_mode & 0o777) == 0o600
        pub = tmp_path / "kiln.pub"
        pub.write_text(kiln("keys", "public", home=home, check=True).stdout)
        dest = tmp_path / "engine"
        pulled = kiln("pull", f"tiny-llama@{fp8['digest']}", str(dest), "--verify-key", str(pub), home=home, check=True)
        assert "verified, signed by sha256:" in pulled.stdout and (dest / "model.sig").is_file()
        ok = subprocess.run([sys.executable, "-m", "model_signing", "verify", "key", "--signature", str(dest / "model.sig"),
                             "--public_key", str(pub), str(dest)], capture_output=True, text=True, timeout=300)
        assert ok.returncode == 0 and "Verification succeeded" in ok.stdout, ok.stderr
        verified = kiln("verify", fp8["digest"], home=home)
        assert verified.returncode == 0 and "verified tiny-llama@" in verified.stdout, verified.stderr

    def test_pull_verifies_digests_and_refuses_a_corrupted_blob(self, home, fp8, tmp_path):
        dest = tmp_path / "engine"
        kiln("pull", f"tiny-llama@{fp8['digest']}", str(dest), home=home, check=True)
        meta = json.loads((dest / "engine.json").read_text())
        assert meta["precision"] == "fp8" and (dest / "model.pt2").stat().st_size > 0

        import torch

        from validation.runners import open_engine

        runner = open_engine("aot-inductor", dest)  # the kernel (model.pt2), then its weights (weights.safetensors)
        logits = runner.prefill(torch.tensor([[1, 2, 3, 4, 5]]))
        assert tuple(logits.shape) == (1, 5, 2048) and torch.isfinite(logits).all()

        shown = json.loads(kiln("artifacts", "show", fp8["digest"], home=home, check=True).stdout)
        layer_blobs = [p for p in (home / "store").rglob("*") if p.is_file() and p.stat().st_size > 1_000_000]
        assert layer_blobs, shown
        originals = {blob: (blob.read_bytes(), blob.stat().st_mode) for blob in layer_blobs}
        try:
            for blob, (data, _) in originals.items():  # flip one byte in the middle of each large blob (the layer)
                blob.chmod(0o644)
                flipped = bytearray(data)
                flipped[len(flipped) // 2] ^= 0xFF
                blob.write_bytes(bytes(flipped))
            bad = tmp_path / "bad"
            proc = kiln("pull", fp8["digest"], str(bad), home=home)
            assert proc.returncode == 3 and "corrupted" in proc.stderr, proc.stderr
            assert not bad.exists()
        finally:  # the module's store is shared with the other tests: put the bytes back, whatever happened
            for blob, (data, mode) in originals.items():
                blob.chmod(0o644)
                blob.write_bytes(data)
                blob.chmod(mode)


def test_nvfp4_build_validates_from_the_exported_tensors(tmp_path):
    out = last_json(kiln("build", "examples/tiny-llama", "--precision", "nvfp4", "--json", home=tmp_path / "kiln",
                         check=True))
    assert out["status"] == "succeeded"
    m = out["validation"]["metrics"]
    # NVFP4 W4A4 costs more than FP8 but stays inside its gate on this model (measured about +6 % before the suite)
    assert 1 < m["ppl_increase_pct"] < 15


@pytest.mark.parametrize("args, field", [
    (["--precision", "int8"], "precision"),
    (["--target", "a100"], "target"),
    (["--backend", "tensorrt"], "backend"),
    (["--profile", "huge"], "profile"),
    (["--max-input-len", "300", "--max-seq-len", "200"], "profile.max_seq_len"),
    (["--max-batch-size", "0"], "profile.max_batch_size"),
    (["--gate", "speed=3"], "gates.speed"),
    (["--backend", "trtllm-engine", "--target", "h100", "--precision", "nvfp4"], "target"),
    (["--eval-task", "examples/tasks/no-such-task.jsonl"], "evaluation.tasks"),
    (["--eval-task", "README.md"], "evaluation.tasks"),
    (["--eval-task", "/etc/hostname"], "evaluation.tasks"),
])
def test_bad_spec_exits_2_naming_the_field_and_writes_nothing(tmp_path, args, field):
    home = tmp_path / "fresh"
    proc = kiln("build", "examples/tiny-llama", *args, home=home)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kiln: error: {field}:"), proc.stderr
    assert not home.exists()


def test_checkpoint_outside_roots_and_missing_dir_exit_2(tmp_path):
    home = tmp_path / "fresh"
    for ref in ("/etc", "examples/no-such-model", "examples/../../etc"):
        proc = kiln("build", ref, home=home)
        assert proc.returncode == 2 and "checkpoint:" in proc.stderr, proc.stderr
    assert not home.exists()


def test_dry_run_prints_the_plan_and_does_no_work(tmp_path):
    home = tmp_path / "dry"
    proc = kiln("build", "examples/tiny-llama", "--backend", "trtllm-engine", "--target", "h100", "--profile",
                "throughput", "--dry-run", "--json", home=home, check=True)
    plan = last_json(proc)
    argv = plan["compile"]["commands"][0]
    assert argv[0] == "trtllm-build" and argv[argv.index("--max_batch_size") + 1] == "32"
    assert plan["environment"]["ready"] is False and "TensorRT-LLM is not installed" in plan["environment"]["reason"]
    assert not (home / "cache" / "quantize").exists() and not (home / "cache" / "compile").exists()
    assert not [p for p in (home / "store").rglob("*") if p.is_file()]

"""kiln/verified.py: each support-matrix row says what ran where — validated engines in the index (per target,
with the count and latest date), what the test suite builds, or that it was never built — not only "supported"."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone

import pytest

from kiln import db
from kiln.backends import BACKENDS, support_matrix
from kiln.families import FAMILIES
from kiln.tables import Artifact
from kiln.settings import Settings
from kiln.verified import SUITE, SUITE_NVFP4_AOT, engine_counts, support_report, verified
from tests.families import FAMILY_CONFIGS

T0 = datetime(2026, 12, 1, 9, 30, tzinfo=timezone.utc)


@pytest.fixture(params=["sqlite", "postgresql"])
def sessions(request, tmp_path):
    """The index on both databases Kiln runs on: the counts are read from the JSON columns by the database itself
    (SQLite's json_extract, PostgreSQL's ->>)."""
    if request.param == "sqlite":
        settings = Settings(home=tmp_path / "home")
        db.upgrade(settings.db_url)
        yield db.session_factory(settings.db_url)
        return
    from scripts.devstack import postgres_database

    with postgres_database() as url:
        db.upgrade(url)
        yield db.session_factory(url)
        db.get_engine(url).dispose()


def add_engine(sessions, *, family="llama", precision="fp8", backend="checkpoint", target="cpu", passed=True,
               created=T0, status="fresh") -> str:
    d = "sha256:" + uuid.uuid4().hex * 2
    provenance = {"toolchain": {"torch": "2.13"}, **({"family": family} if family else {})}
    with sessions() as s:
        s.add(Artifact(digest=d, build_key=d, repository="acme/tiny", tag=f"{precision}-{target}-latency-{backend}",
                       status=status, precision=precision, target=target, profile="latency", backend=backend,
                       checkpoint_ref="hf://acme/tiny@main", checkpoint_digest=d, size=1, provenance=provenance,
                       validation={"passed": passed, "metrics": {}, "gates": []}, created_at=created))
        s.commit()
    return d


def rows(report: dict) -> dict[tuple[str, str, str], dict]:
    return {(r["family"], r["precision"], r["backend"]): r["verified"] for r in report["support"]}


def test_the_suite_table_names_every_family_the_suite_builds():
    # every family of the test suite's checkpoints (tests/families.py) and no other
    assert set(FAMILY_CONFIGS) == set(FAMILIES) == {f for f, _, _ in SUITE}
    assert SUITE_NVFP4_AOT <= set(FAMILIES)
    for f in FAMILIES:  # FP8 on both backends by default; NVFP4 on one by default, on aot-inductor with the opt-in
        assert SUITE[f, "fp8", "aot-inductor"]["default"] and SUITE[f, "fp8", "checkpoint"]["default"]
        assert (f, "nvfp4", "aot-inductor") in SUITE
    assert not SUITE["mistral", "nvfp4", "aot-inductor"]["default"]  # KILN_TEST_ALL_FAMILIES=1 only
    assert SUITE["llama", "nvfp4", "aot-inductor"]["default"]  # the shipped Llama in test_cli_build.py
    assert ("qwen3_moe", "nvfp4", "checkpoint") not in SUITE  # its NVFP4 is compiled, not run as a checkpoint
    assert not any(b == "trtllm-engine" for _, _, b in SUITE)  # never run: no TensorRT-LLM, no GPU
    assert all(s["target"] == "cpu" for s in SUITE.values())


def test_without_a_registry_each_row_says_suite_or_no_build_history():
    report = support_report(None, no_history="no build history: nothing here")
    assert report["history"] == {"registry": False, "engines": None, "unattributed": None,
                                 "note": "no build history: nothing here"}
    v = rows(report)
    assert len(v) == len(support_matrix())
    assert v["llama", "fp8", "checkpoint"]["state"] == "test suite"
    assert v["llama", "fp8", "checkpoint"]["suite"] == {"target": "cpu", "default": True,
                                                        "tests": ["tests/integration/test_families.py"]}
    assert v["llama", "fp8", "checkpoint"]["engines"] is None  # not "0": nothing was read
    for key in (("llama", "fp8", "trtllm-engine"), ("mistral", "nvfp4", "aot-inductor")):
        assert v[key]["state"] == "no build history" and v[key]["targets"] == {}
    assert v["mistral", "nvfp4", "aot-inductor"]["suite"]["default"] is False


def test_a_recorded_engine_turns_never_built_into_built_with_count_latest_and_target(sessions):
    key = ("qwen3", "fp8", "trtllm-engine")  # supported by the tables, never run by the suite
    with sessions() as s:
        before = rows(support_report(s))
    assert before[key] == {"state": "never built", "engines": 0, "latest": None, "targets": {}, "suite": None}
    assert before["qwen3", "fp8", "checkpoint"]["state"] == "test suite"  # none here, but the suite builds it

    add_engine(sessions, family="qwen3", backend="trtllm-engine", target="sm90", created=T0)
    add_engine(sessions, family="qwen3", backend="trtllm-engine", target="sm90", created=T0 + timedelta(days=2))
    add_engine(sessions, family="qwen3", backend="trtllm-engine", target="sm100", created=T0 + timedelta(days=1))
    add_engine(sessions, family="qwen3", backend="trtllm-engine", target="sm90", passed=False,
               created=T0 + timedelta(days=5), status="rejected")  # failed validation: not evidence
    add_engine(sessions, family="qwen3", precision="nvfp4", backend="trtllm-engine", target="sm100")  # another row
    add_engine(sessions, family=None)  # an engine from before provenance named its family
    with sessions() as s:
        report = support_report(s)
    after = rows(report)[key]
    assert after["state"] == "built" and after["engines"] == 3 and after["suite"] is None
    assert set(after["targets"]) == {"sm90", "sm100"}
    assert after["targets"]["sm90"]["engines"] == 2 and after["targets"]["sm100"]["engines"] == 1
    assert after["latest"].startswith("2026-12-03T09:30") and after["targets"]["sm100"]["latest"].startswith("2026-12-02")
    assert rows(report)["qwen3", "nvfp4", "trtllm-engine"]["engines"] == 1
    assert rows(report)["llama", "fp8", "checkpoint"]["state"] == "test suite"  # the unattributed one: no row's
    assert report["history"]["engines"] == 6 - 1 and report["history"]["unattributed"] == 1
    assert "5 validated engines" in report["history"]["note"] and "1 built before" in report["history"]["note"]


def test_revoked_and_stale_engines_that_passed_still_count(sessions):
    add_engine(sessions, status="stale")
    add_engine(sessions, status="revoked", created=T0 + timedelta(hours=1))
    with sessions() as s:
        counts, total, unattributed = engine_counts(s)
    assert total == 2 and unattributed == 0
    assert counts["llama", "fp8", "checkpoint"]["cpu"]["engines"] == 2


def test_every_row_has_one_of_four_states():
    row = next(r for r in support_matrix() if r["backend"] == "checkpoint")
    cell = {"cpu": {"engines": 1, "latest": T0}}
    assert verified(row, {(row["family"], row["precision"], row["backend"]): cell})["state"] == "built"
    assert verified(row, {})["state"] in ("test suite", "never built")
    assert {verified(r, None)["state"] for r in support_matrix()} == {"test suite", "no build history"}
    assert {verified(r, {})["state"] for r in support_matrix()} == {"test suite", "never built"}
    assert {r["backend"] for r in support_matrix() if verified(r, {})["state"] == "never built"} == set(BACKENDS)

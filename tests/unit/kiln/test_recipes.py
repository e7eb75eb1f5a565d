"""Recipes: every entry of the table conforms (its ModelOpt config exists, its format is readable, its ladder
rungs are its precision's recipes), and the spec refuses what a recipe cannot do, by field, before any work."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.backends import BACKENDS
from kiln.errors import SpecError
from kiln.keys import build_key, quantize_key
from kiln.precisions import FORMATS, PRECISIONS
from kiln.recipes import AUTO, RECIPES, recipe_table, recipes_for
from kiln.runtimes import RUNTIMES
from kiln.spec import check_model, parse_spec

REPO = Path(__file__).resolve().parents[3]
CKPT = str(REPO / "examples" / "tiny-llama")


def spec(**kw):
    return parse_spec({"checkpoint": CKPT, "precision": "fp8", **kw}, [REPO])


def refuse(**kw) -> SpecError:
    with pytest.raises(SpecError) as info:
        spec(**kw)
    return info.value


# -- conformance: every entry of every table ---------------------------------------------------------
@pytest.mark.parametrize("name", list(RECIPES))
def test_every_recipe_names_a_modelopt_config_and_a_format_kiln_reads(name):
    import modelopt.torch.quantization as mtq

    recipe = RECIPES[name]
    assert isinstance(getattr(mtq, recipe.modelopt_config), dict)
    assert recipe.quant_algo in FORMATS and FORMATS[recipe.quant_algo].precision == recipe.precision
    assert recipe.backends and set(recipe.backends) <= set(BACKENDS)
    assert set(recipe.runtimes) == set(RUNTIMES) and recipe.calibrate_on in ("any", "cuda")


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_every_ladder_is_its_precisions_recipes_starting_with_the_fastest(precision):
    p = PRECISIONS[precision]
    assert p.ladder and all(RECIPES[r].precision == precision for r in p.ladder)
    assert p.ladder[0] == precision  # the per-tensor / full 4-bit recipe serves fastest: tried first
    assert p.default_recipe == AUTO or p.default_recipe in RECIPES


def test_the_table_lists_every_recipe_with_its_runtimes():
    rows = {r["recipe"]: r for r in recipe_table()}
    assert set(rows) == set(RECIPES)
    assert rows["fp8"]["runtimes"]["vllm"] == "modelopt" and rows["nvfp4"]["runtimes"]["sglang"] == "modelopt_fp4"
    assert rows["nvfp4-w4a16"]["activations"] == "none" and rows["fp8-pcpt"]["activations"] == "dynamic"


# -- the spec's rules --------------------------------------------------------------------------------
def test_a_spec_without_a_recipe_runs_its_precisions_ladder():
    s = spec()
    assert s.recipe is None and s.recipe_name == AUTO
    assert s.with_recipe("fp8-pcpt").recipe_name == "fp8-pcpt"


def test_a_recipe_of_another_precision_is_refused_naming_the_field_and_the_choices():
    err = refuse(recipe="nvfp4-w4a16")
    assert err.field == "recipe" and "nvfp4 recipe" in err.message
    assert all(r.name in err.fix for r in recipes_for("fp8")) and AUTO in err.fix


def test_an_unknown_recipe_is_refused():
    err = refuse(recipe="int3")
    assert err.field == "recipe" and "not a recipe" in err.message


def test_a_recipe_its_backend_cannot_build_is_refused():
    err = refuse(recipe="fp8-pcpt", backend="trtllm-engine", target="sm90")
    assert err.field == "recipe" and "trtllm-engine" in err.message and "aot-inductor" in err.fix


def test_auto_skips_rungs_its_backend_cannot_build():
    assert spec(backend="trtllm-engine", target="sm90").rungs == ["fp8"]
    assert spec().rungs == list(PRECISIONS["fp8"].ladder) and spec(recipe="fp8-pcpt").rungs == ["fp8-pcpt"]


@pytest.mark.parametrize("layers, message", [([0, 0], "twice"), (list(range(65)), "at most")])
def test_unquantized_layers_are_checked(layers, message):
    err = refuse(unquantized_layers=layers)
    assert err.field == "unquantized_layers" and message in (err.message + err.fix)


def test_an_unquantized_layer_outside_the_model_is_refused_before_any_work():
    import json

    config = json.loads((Path(CKPT) / "config.json").read_text())
    n = config["num_hidden_layers"]
    check_model(spec(unquantized_layers=[0, -n, n - 1]), config)
    for bad in (n, -n - 1):
        with pytest.raises(SpecError) as info:
            check_model(spec(unquantized_layers=[bad]), config)
        assert info.value.field == "unquantized_layers" and str(n - 1) in info.value.fix


def test_the_recipe_and_the_unquantized_layers_are_in_the_keys():
    tc = {"torch": "t", "modelopt": "m", "transformers": "x"}
    data = {"calibration": "c", "evaluation": "e"}
    keys = {quantize_key("d", s, tc, "c") for s in (spec(recipe="fp8"), spec(recipe="fp8-pcpt"),
                                                     spec(recipe="fp8", unquantized_layers=[0]))}
    assert len(keys) == 3
    # auto's key holds its ladder: a build of "auto" is not the build of its first rung
    assert build_key("d", spec(), tc, {}, data) != build_key("d", spec(recipe="fp8"), tc, {}, data)
    assert spec().key_fields()["ladder"] == list(PRECISIONS["fp8"].ladder)

"""``--recipe auto`` climbing its ladder, through the real CLI on the shipped model: a KL gate between the two FP8
recipes' measured KL (per tensor 0.0080, per channel / per token 0.0073 on examples/tiny-llama, a float32 model,
so the screen computes what the engine computes) fails the first rung's engine and passes the second rung's
screen; the second rung is compiled, validated and published, every rung in the report."""

from __future__ import annotations

import pytest

from tests.conftest import REPO
from tests.realmodels import kiln_json, rungs

pytestmark = pytest.mark.slow


def test_the_ladder_climbs_to_the_next_recipe_when_the_first_fails_a_gate(tmp_path):
    tiny = REPO / "examples" / "tiny-llama"
    # a 128-token context: windows of one length, where the two recipes' KL sit either side of the gate
    code, out, err = kiln_json("build", str(tiny), "--precision", "fp8", "--gate", "max_mean_kl=0.0077",
                               "--max-input-len", "64", "--max-seq-len", "128", "--max-num-tokens", "128",
                               home=tmp_path / "kiln", checkpoint=tiny)
    assert code == 0, err[-3000:]
    ladder = rungs(out)
    assert [r["recipe"] for r in ladder] == ["fp8", "fp8-pcpt"]
    assert not ladder[0]["passed"] and ladder[0]["judged_on"] == "engine"
    assert [g["name"] for g in ladder[0]["gates"] if not g["passed"]] == ["max_mean_kl"]
    assert ladder[0]["speed"].startswith("not measured: the engine failed its accuracy gates")  # no time on speed
    assert ladder[1]["passed"] and ladder[1]["judged_on"] == "screen" and ladder[1]["seconds"]["screen"] > 0
    assert out["validation"]["recipe"]["built"] == "fp8-pcpt" and out["status"] == "succeeded"
    # the compile stage's status is the first rung's; the published rung's engine was compiled inside validate
    assert out["validation"]["recipe"]["compiled_in_validate"]["recipe"] == "fp8-pcpt"
    assert out["validation"]["recipe"]["compiled_in_validate"]["status"] == "ran"
    assert out["validation"]["metrics"]["mean_kl"] <= 0.0077
    assert out["artifact"]["status"] == "fresh"

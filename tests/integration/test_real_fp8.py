"""FP8 on a real trained model (SmolLM2-135M-Instruct), on the defaults a user gets: a plain ``kiln build`` publishes
an engine, and the ladder climbs to the next recipe when the first one fails a gate — judged on real weights, not
on random ones."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.realmodels import kiln_json, rungs, smollm2

pytestmark = [pytest.mark.slow, pytest.mark.realmodel]


@pytest.fixture(scope="module")
def ckpt() -> Path:
    return smollm2()


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("real-fp8") / "kiln"


@pytest.fixture(scope="module")
def plain(ckpt, home) -> dict:
    code, out, err = kiln_json("build", str(ckpt), "--precision", "fp8", home=home, checkpoint=ckpt)
    assert code == 0, err[-3000:]
    return out


class TestFP8OnSmolLM2:
    def test_a_plain_build_on_the_default_gates_publishes_an_engine(self, plain):
        assert plain["status"] == "succeeded" and plain["artifact"]["status"] == "fresh"
        m = plain["validation"]["metrics"]
        assert 20 < m["reference_perplexity"] < 60  # a trained model (a random one of this shape: ~49,000)
        assert 0 < m["ppl_increase_pct"] < 3 and m["mean_kl"] < 0.05 and m["top1_agreement"] > 0.85
        recipe = plain["validation"]["recipe"]
        assert recipe == {"requested": "auto", "built": "fp8"}  # the first rung passed: no other rung was tried

    def test_the_ladder_climbs_to_per_channel_per_token_when_per_tensor_fails(self, ckpt, home, plain):
        """A KL gate between the two recipes' measured KL (docs/validation.md): per-tensor FP8 fails it, the
        per-channel/per-token recipe passes; the engine published is the second rung's, every rung reported."""
        first_kl = plain["validation"]["metrics"]["mean_kl"]
        code, out, err = kiln_json("build", str(ckpt), "--precision", "fp8", "--gate", f"max_mean_kl={first_kl * 0.9:.4f}",
                                   home=home, checkpoint=ckpt)
        assert code == 0, err[-3000:]
        ladder = rungs(out)
        assert [r["recipe"] for r in ladder] == ["fp8", "fp8-pcpt"]
        assert not ladder[0]["passed"] and ladder[0]["judged_on"] == "engine"
        assert [g["name"] for g in ladder[0]["gates"] if not g["passed"]] == ["max_mean_kl"]
        assert ladder[1]["passed"] and ladder[1]["judged_on"] == "screen"
        assert out["validation"]["recipe"]["built"] == "fp8-pcpt" and out["status"] == "succeeded"
        assert out["validation"]["metrics"]["mean_kl"] < first_kl * 0.9
        assert {s["name"]: s["status"] for s in out["stages"]}["quantize"] == "cached"  # rung 1's, from the plain build

"""FP8 on a real trained model (SmolLM2-135M-Instruct), on the defaults a user gets: a plain ``kiln build`` publishes
an engine — judged on real weights, not on random ones (the ladder's climb is tests/integration/test_ladder.py on
the shipped model and test_real_nvfp4.py on this one)."""

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

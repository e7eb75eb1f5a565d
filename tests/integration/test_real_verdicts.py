"""Verdicts on a second real family, checked against the yardstick: ``kiln build <gemma3-270m> --precision fp8``
(Gemma 3 270M: BOS-first tokenizer, 262,144-token vocabulary, a 512-token sliding window on five of six layers)
gives accuracy figures that ModelOpt's own fake-quantized model in transformers reproduces on the same windows
(bench/yardstick.py) within the report's intervals, decides its gates on windows of 128 tokens and of the
profile's max_seq_len, and is published on the default gates. The report shows the convention (every window
starts with ``<bos>``) and the positions covered."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.datasets import load_text
from tests.realmodels import gemma3, kiln_json, report

pytestmark = [pytest.mark.slow, pytest.mark.realmodel]

MAX_TOKENS = "4096"  # 32 windows of 128 and 4 of 1,024: enough to decide the default gates on this model
#: the latency profile with a 1,024-token context: its long windows pass Gemma 3's 512-token sliding window
PROFILE = {"max_batch_size": 1, "max_input_len": 256, "max_seq_len": 1024, "max_num_tokens": 1024}


@pytest.fixture(scope="module")
def ckpt() -> Path:
    return gemma3()


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("real-gemma") / "kiln"


@pytest.fixture(scope="module")
def build(ckpt, home) -> tuple[int, dict, str]:
    code, out, err = kiln_json("build", str(ckpt), "--precision", "fp8", "--recipe", "fp8", "--eval-max-tokens",
                               MAX_TOKENS, "--max-seq-len", str(PROFILE["max_seq_len"]), "--max-num-tokens",
                               str(PROFILE["max_num_tokens"]), "--override-reason", "a test: a shorter evaluation",
                               home=home, checkpoint=ckpt)
    return code, {**out, "home": str(home)}, err


@pytest.fixture(scope="module")
def yardstick(ckpt) -> dict:
    from bench.yardstick import measure

    calib = load_text("kiln:calibration", field="calibration.dataset", roots=[])[0]
    heldout = load_text("kiln:heldout", field="evaluation.dataset", roots=[])[0]
    return measure(ckpt, "fp8", calib, heldout, max_tokens=int(MAX_TOKENS), profile=PROFILE)


def test_gemma3_fp8_is_published_on_the_default_gates(build):
    code, out, err = build
    assert code == 0 and out["status"] == "succeeded", err[-3000:]
    gates = out["validation"]["gates"]
    assert {g.get("seq_len") for g in gates if g["name"] == "max_mean_kl"} == {None, 1024}  # both lengths judged
    assert all(g["passed"] for g in gates)


def test_every_window_starts_with_bos_and_the_positions_pass_the_sliding_window(build, ckpt):
    _, out, err = build
    acc = report(out["digest"], Path(out["home"]), ckpt)["conditions"]["accuracy"]
    assert acc["text"]["prefix_tokens"] == ["<bos>"] and acc["sliding_window"] == 512
    assert [x["positions"] for x in acc["lengths"]] == [[0, 127], [0, 1023]]  # past the 512-token window


def test_kilns_figures_are_modelopts_own_within_the_reports_intervals(build, yardstick):
    _, out, _ = build
    m = out["validation"]["metrics"]
    for mine, theirs in [(m, yardstick), (m["long_windows"][0], yardstick["long_windows"][0])]:
        assert mine["seq_len"] == theirs["seq_len"]
        for metric in ("ppl_increase_pct", "mean_kl", "top1_agreement"):
            low, high = mine["intervals"][metric]["low"], mine["intervals"][metric]["high"]
            width = high - low
            # ModelOpt's model is evaluated on every window, Kiln's engine on the windows it needed: the yardstick's
            # figure lies inside Kiln's interval, widened by half its width for the windows Kiln did not evaluate
            assert low - width / 2 <= theirs[metric] <= high + width / 2, (metric, mine["seq_len"], low, high,
                                                                           theirs[metric])

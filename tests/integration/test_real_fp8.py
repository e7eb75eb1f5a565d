"""FP8 on a real trained model (SmolLM2-135M-Instruct), on the defaults a user gets: a plain ``kiln build`` publishes
an engine — judged on real weights, not on random ones (the ladder's climb is tests/integration/test_ladder.py on
the shipped model and test_real_nvfp4.py on this one). The build brings one local task (the shipped held-out
cloze task): its accuracy for engine and reference, paired, with an interval; every accuracy gate decided on its
interval; and a second build of the same checkpoint (a stricter gate: another BuildKey) reuses the reference."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.realmodels import kiln_json, report, smollm2

pytestmark = [pytest.mark.slow, pytest.mark.realmodel]

TASK = REPO / "examples" / "tasks" / "heldout-cloze.jsonl"
ACCURACY_GATES = ("max_ppl_increase_pct", "min_top1_agreement", "max_mean_kl", "max_task_accuracy_drop_pts")


@pytest.fixture(scope="module")
def ckpt() -> Path:
    return smollm2()


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("real-fp8") / "kiln"


@pytest.fixture(scope="module")
def plain_run(ckpt, home) -> tuple[dict, str]:
    code, out, err = kiln_json("build", str(ckpt), "--precision", "fp8", "--eval-task", str(TASK), home=home,
                               checkpoint=ckpt)
    assert code == 0, err[-3000:]
    return out, err


@pytest.fixture(scope="module")
def plain(plain_run) -> dict:
    return plain_run[0]


def test_a_ci_log_shows_the_build_alive_inside_its_long_stages(plain_run):
    """stderr is a pipe here, as in a CI log: no live line, a heartbeat every 10 s in a stage that runs longer."""
    _, err = plain_run
    # "  validate  evaluation window 37/128  41.0 s" — the stage, its step, the time in the stage
    from api.progress import HEARTBEAT_LINE

    beats = [m for line in err.splitlines() if (m := HEARTBEAT_LINE.match(line))]
    assert any(m.group(1) == "validate" and "/" in m.group(2) for m in beats), err[-3000:]
    assert any(m.group(1) == "compile" for m in beats), err[-3000:]  # a long compile that reports nothing: the ticker
    assert "\x1b[" not in err and "\r" not in err  # no terminal control in a log


@pytest.fixture(scope="module")
def second(ckpt, home, plain) -> dict:
    # a stricter KL gate: another BuildKey, so validation runs again on the same compiled engine (its quantize and
    # compile outputs are reused) with the same evaluation: the reference must not run again
    code, out, err = kiln_json("build", str(ckpt), "--precision", "fp8", "--gate", "max_mean_kl=0.049",
                               "--eval-task", str(TASK), home=home, checkpoint=ckpt)
    assert code in (0, 1), err[-3000:]
    return out


class TestFP8OnSmolLM2:
    def test_a_plain_build_on_the_default_gates_publishes_an_engine(self, plain):
        assert plain["status"] == "succeeded" and plain["artifact"]["status"] == "fresh"
        m = plain["validation"]["metrics"]
        assert 20 < m["reference_perplexity"] < 60  # a trained model (a random one of this shape: ~49,000)
        assert 0 < m["ppl_increase_pct"] < 3 and m["mean_kl"] < 0.05 and m["top1_agreement"] > 0.85
        recipe = plain["validation"]["recipe"]
        assert recipe == {"requested": "auto", "built": "fp8"}  # the first rung passed: no other rung was tried

    def test_every_accuracy_gate_is_decided_on_its_interval(self, plain):
        gates = [g for g in plain["validation"]["gates"] if g["name"] in ACCURACY_GATES]
        assert {g["name"] for g in gates} == set(ACCURACY_GATES)
        for g in gates:
            low, high = g["interval"]
            assert low <= g["value"] <= high and g["decision"] == "pass", g
            assert (high <= g["threshold"]) if g["name"].startswith("max_") else (low >= g["threshold"])
        m = plain["validation"]["metrics"]
        assert m["sequential"]["windows"] <= m["sequential"]["of"] == 128
        assert m["mde"]["ppl_increase_pct"]["paired"] < 3  # this evaluation could see a change the gate cares about

    def test_the_task_shows_engine_and_reference_accuracy_paired(self, plain):
        [task] = plain["validation"]["metrics"]["tasks"]
        n = task["items"]  # sequential: the items evaluated until the task gate was decided, of all 200
        assert task["task"] == "heldout-cloze" and n == len(task["outcomes"]) == task["evaluated"] <= task["total"] == 200
        assert task["sequential"]["skipped"] == 200 - n and (n == 200 or task["sequential"]["decision"] != "undecided")
        assert task["reference_accuracy"] > 0.6  # a trained model; a guess gets 0.25
        engine = sum(o["engine"] for o in task["outcomes"]) / n
        reference = sum(o["reference"] for o in task["outcomes"]) / n
        assert task["engine_accuracy"] == pytest.approx(engine) and task["reference_accuracy"] == pytest.approx(reference)
        assert task["drop_pts"] == pytest.approx((reference - engine) * 100)
        assert task["interval"]["low"] <= task["drop_pts"] <= task["interval"]["high"]
        assert task["unpaired_items_needed"] > task["items"]  # pairing is what makes 200 items enough

    def test_a_second_build_of_the_checkpoint_reuses_the_reference(self, plain, second, home, ckpt):
        first, again = report(plain["digest"], home, ckpt), report(second["digest"], home, ckpt)
        one, two = first["conditions"]["accuracy"], again["conditions"]["accuracy"]
        assert one["reference_cache"]["reused"] is False and two["reference_cache"]["reused"] is True
        assert one["reference_cache"]["key"] == two["reference_cache"]["key"]
        [t1], [t2] = first["tasks"], again["tasks"]
        assert [o["reference"] for o in t1["outcomes"]] == [o["reference"] for o in t2["outcomes"]]
        assert [s["status"] for s in again["stages"]][1:3] == ["cached", "cached"]  # quantize, compile
        assert first["tpot_ms"] is None and again["tpot_ms"] is None  # the aot-inductor engine has no KV cache


GPL3 = Path("/usr/share/common-licenses/GPL-3")  # English prose nobody on the team chose (Debian's base-files)


@pytest.fixture(scope="module")
def other_text(ckpt, home, plain) -> dict:
    """The same FP8 build evaluated on another English text than the one the defaults were measured on."""
    if not GPL3.is_file():
        pytest.skip(f"{GPL3} is not on this machine (Debian's base-files ships it)")
    text = ckpt.parent / "texts" / "gpl-3.txt"  # under a checkpoint root the CLI is given
    text.parent.mkdir(exist_ok=True)
    text.write_bytes(GPL3.read_bytes())
    code, out, err = kiln_json("build", str(ckpt), "--precision", "fp8", "--eval-dataset", str(text), home=home,
                               checkpoint=ckpt)
    assert code == 0, err[-3000:]
    return out


def test_the_default_fp8_build_is_published_on_a_text_the_defaults_were_not_tuned_on(other_text):
    assert other_text["status"] == "succeeded" and other_text["artifact"]["status"] == "fresh"
    m = other_text["validation"]["metrics"]
    assert 5 < m["reference_perplexity"] < 60 and [x["seq_len"] for x in m["long_windows"]] == [512]
    assert all(g["passed"] for g in other_text["validation"]["gates"])

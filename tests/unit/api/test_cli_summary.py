"""``kiln build``'s summary on stdout: every number through kiln/units.py, gate lines that read like
``peak memory 42.4 MiB ≤ 17.7 GiB  pass``."""

from __future__ import annotations

from api.cli import _print_summary

OUT = {
    "cache_hit": False, "status": "succeeded", "digest": "sha256:" + "0a" * 32,
    "artifact": {"repository": "tiny-llama", "tag": "fp8-cpu-latency", "status": "fresh"},
    "validation": {
        "passed": True,
        "metrics": {"perplexity": 41.264, "reference_perplexity": 41.126, "ppl_increase_pct": 0.3365,
                    "top1_agreement": 0.9424, "mean_kl": 0.0077, "tokens": 2048, "ttft_ms": 12.34,
                    "peak_memory_bytes": 44453888.0,
                    "throughput": [{"batch_size": 1, "seq_len": 64, "tokens_per_s": 30307.4}],
                    "sequential": {"windows": 16, "of": 128, "stopped_early": True, "confidence_per_look": 0.993,
                                   "alpha": 0.05, "looks": [1, 2, 3, 4, 5, 6, 7]}},
        "gates": [{"name": "min_top1_agreement", "value": 0.9424, "threshold": 0.85, "passed": True,
                   "decision": "pass", "interval": [0.9284, 0.9564], "confidence": 0.993},
                  {"name": "min_throughput_tps", "value": 30307.4, "threshold": 1.0, "passed": True},
                  {"name": "max_peak_memory_bytes", "value": 44453888.0, "threshold": 1.89571e10, "passed": True}],
        "recipe": {"requested": "auto", "built": "fp8", "ladder": [
            {"recipe": "fp8", "passed": True, "judged_on": "screen", "seconds": {"quantize": 16.04, "screen": 245},
             "metrics": {"ppl_increase_pct": 0.3365, "top1_agreement": 0.9424, "mean_kl": 0.0077}, "gates": []}]},
    },
}


def test_the_summary_reads_like_a_sentence(capsys):
    _print_summary(OUT)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("validation PASSED: perplexity 41.26 vs reference 41.13 (+0.34%), top-1 agreement 94.2%, "
                        "mean KL 0.0077, peak 30,307 tokens/s")
    assert lines[1] == "  TTFT 12.3 ms, peak memory 42.4 MiB at the envelope corner"
    assert lines[2] == ("  evaluated 16 of 128 windows (2,048 tokens): stopped once every accuracy gate was decided; "
                        "one-sided bounds at 99.3% per look, 95.0% over 7 looks")
    assert lines[3:6] == ["  top-1 agreement 94.2% [92.8%, 95.6%] (99.3%) ≥ 85.0%  pass",
                          "  throughput 30,307 tokens/s ≥ 1.00 tokens/s  pass",
                          "  peak memory 42.4 MiB ≤ 17.7 GiB  pass"]
    assert "4 min 05 s" in lines[7] and "16.0 s" in lines[7] and "+0.34%" in lines[7]
    assert lines[-1].startswith("engine sha256:0a0a")
    assert "e+" not in "\n".join(lines) and "MB" not in "\n".join(lines)


def _rung(recipe: str, ppl: float, gates: list[dict]) -> dict:
    return {"recipe": recipe, "passed": all(g["passed"] for g in gates), "judged_on": "screen",
            "seconds": {"quantize": 6.2, "screen": 3.6},
            "metrics": {"ppl_increase_pct": ppl, "top1_agreement": 0.72, "mean_kl": 0.2403}, "gates": gates}


PPL_FAIL = {"name": "max_ppl_increase_pct", "value": 21.4, "threshold": 15.0, "passed": False, "decision": "fail"}
KL_UNDECIDED = {"name": "max_mean_kl", "value": 0.2403, "threshold": 0.25, "passed": False, "decision": "undecided"}
KL_FAIL = {"name": "max_mean_kl", "value": 0.44, "threshold": 0.25, "passed": False, "decision": "fail"}
TOP1_PASS = {"name": "min_top1_agreement", "value": 0.72, "threshold": 0.70, "passed": True, "decision": "pass"}


def test_a_ladder_where_no_rung_passed_says_so_and_tells_an_undecided_gate_from_a_failed_one(capsys):
    """The evaluation stops once one gate fails, so a rung's other gates may be undecided: a KL of 0.24 under a
    0.25 gate is not a failure the user should read as one."""
    out = {**OUT, "validation": {**OUT["validation"], "passed": False, "gates": [], "recipe": {
        "requested": "auto", "built": "nvfp4-w4a16", "ladder": [
            _rung("nvfp4", 46.6, [PPL_FAIL, KL_FAIL, TOP1_PASS]),
            _rung("nvfp4-w4a16", 21.4, [PPL_FAIL, KL_UNDECIDED, TOP1_PASS])]}}}
    _print_summary(out)
    lines = capsys.readouterr().out.splitlines()
    recipe = next(i for i, line in enumerate(lines) if line.startswith("recipe "))
    assert lines[recipe] == ("recipe nvfp4-w4a16 (no rung of the auto ladder passed: the one with the smallest "
                             "perplexity increase was built)")
    assert "FAIL perplexity increase, mean KL  [" in lines[recipe + 1]
    assert "FAIL perplexity increase; undecided mean KL  [" in lines[recipe + 2]
    assert "top-1" not in lines[recipe + 2].split("FAIL")[1]


def test_a_ladder_whose_last_rung_passed_names_it_chosen(capsys):
    out = {**OUT, "validation": {**OUT["validation"], "recipe": {
        "requested": "auto", "built": "fp8-pcpt", "ladder": [
            _rung("fp8", 3.5, [PPL_FAIL, KL_UNDECIDED]), _rung("fp8-pcpt", 1.2, [TOP1_PASS])]}}}
    _print_summary(out)
    lines = capsys.readouterr().out.splitlines()
    recipe = next(i for i, line in enumerate(lines) if line.startswith("recipe "))
    assert lines[recipe] == "recipe fp8-pcpt (chosen by the auto ladder)"
    assert lines[recipe + 1].endswith("FAIL perplexity increase; undecided mean KL  [screen; quantize 6.20 s, screen 3.60 s]")
    assert "  pass  [screen;" in lines[recipe + 2]


def test_with_json_the_gate_table_goes_to_stderr_and_stdout_keeps_one_json_line(capsys):
    from api.output import gate_table, json_line

    rejected = {**OUT, "validation": {**OUT["validation"], "passed": False, "gates": [
        {**OUT["validation"]["gates"][0], "threshold": 0.99, "passed": False, "decision": "fail"},
        *OUT["validation"]["gates"][1:]]}}
    json_line(rejected)
    gate_table(rejected)
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 1 and out.startswith("{")
    assert err.splitlines() == ["validation FAILED (3 gates):",
                                "  top-1 agreement 94.2% [92.8%, 95.6%] (99.3%) ≥ 99.0%  FAIL",
                                "  throughput 30,307 tokens/s ≥ 1.00 tokens/s  pass",
                                "  peak memory 42.4 MiB ≤ 17.7 GiB  pass"]

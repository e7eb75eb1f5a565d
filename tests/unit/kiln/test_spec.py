"""parse_spec: every rule a user expects to be told about, by field name and with a fix, before any work."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from kiln.backends import BACKENDS
from kiln.errors import SpecError
from kiln.kvcache import KV_CACHES
from kiln.spec import LIMITS, MODEL_NAME_RE, PROFILES, BatchProfile, BuildSpec, parse_spec

REPO = Path(__file__).resolve().parents[3]
ROOTS = [REPO]
CKPT = str(REPO / "examples" / "tiny-llama")
PROFILE_FIELDS = ("max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens")


def spec_data(**overrides) -> dict:
    data = {"checkpoint": CKPT, "precision": "fp8"}
    data.update(overrides)
    return data


def refuse(roots=ROOTS, **overrides) -> SpecError:
    with pytest.raises(SpecError) as info:
        parse_spec(spec_data(**overrides), roots)
    err = info.value
    assert err.fix, f"{err.field}: no fix given"
    assert all(d["fix"] for d in err.details)
    assert err.details and err.details[0]["field"] == err.field
    return err


def custom(**limits) -> dict:
    prof = {"max_batch_size": 4, "max_input_len": 64, "max_seq_len": 128, "max_num_tokens": 256}
    prof.update(limits)
    return prof


# -- defaults --------------------------------------------------------------------------------------
def test_minimal_spec_gets_the_documented_defaults():
    spec = parse_spec(spec_data(), ROOTS)
    assert spec.kv_cache == "none" and spec.backend == "aot-inductor" and spec.target == "cpu"
    assert spec.tp_size == 1 and spec.gates == {}
    assert spec.batch_profile == PROFILES["latency"]
    assert spec.calibration.dataset == "kiln:calibration" and spec.evaluation.dataset == "kiln:heldout"
    assert spec.sm is None


def test_parsed_spec_is_frozen():
    spec = parse_spec(spec_data(), ROOTS)
    with pytest.raises(ValidationError):
        spec.precision = "nvfp4"
    with pytest.raises(ValidationError):
        spec.batch_profile.max_batch_size = 99
    with pytest.raises(ValidationError):
        spec.calibration.samples = 1


# -- known values only -----------------------------------------------------------------------------
@pytest.mark.parametrize("field, value", [
    ("precision", "int4"), ("precision", "FP8"), ("backend", "onnx"), ("kv_cache", "int8"),
    ("target", "tpu-v5"), ("profile", "turbo"),
])
def test_unknown_values_are_refused_naming_the_field(field, value):
    err = refuse(**{field: value})
    assert err.field == field
    assert repr(value) in err.message


def test_unknown_profile_fix_lists_the_named_profiles():
    err = refuse(profile="turbo")
    assert all(name in err.fix for name in PROFILES)


@pytest.mark.parametrize("name, sm", [
    ("h100", "sm90"), ("H100", "sm90"), ("NVIDIA H200", "sm90"), ("l40s", "sm89"), ("L4", "sm89"),
    ("b200", "sm100"), ("gb200", "sm100"), ("rtx5090", "sm120"), ("RTX-5090", "sm120"),
    ("sm90", "sm90"), ("SM_89", "sm89"), ("cpu", "cpu"), ("CPU", "cpu"),
])
def test_gpu_names_map_to_their_sm(name, sm):
    spec = parse_spec(spec_data(target=name), ROOTS)
    assert spec.target == sm
    assert spec.sm == (None if sm == "cpu" else int(sm[2:]))


@pytest.mark.parametrize("name, sm", [("a100", 80), ("A100", 80), ("t4", 75), ("v100", 70), ("a10g", 86), ("sm80", 80)])
def test_old_gpus_are_refused_with_their_sm(name, sm):
    err = refuse(target=name)
    assert err.field == "target"
    assert f"sm{sm}" in err.message
    assert "sm89" in err.fix


def test_newer_unsupported_sm_is_not_called_too_old():
    err = refuse(target="sm103")
    assert err.field == "target"
    assert "sm89+" not in err.message


# -- target × backend × precision ------------------------------------------------------------------
def test_trtllm_engine_needs_a_gpu_target():
    err = refuse(backend="trtllm-engine", target="cpu")
    assert err.field == "target"
    assert "GPU" in err.message


@pytest.mark.parametrize("target", ["sm89", "sm90", "h100", "l40s"])
def test_nvfp4_trtllm_engine_below_sm100_is_refused(target):
    err = refuse(precision="nvfp4", backend="trtllm-engine", target=target)
    assert err.field == "target"
    assert "sm100" in err.message


@pytest.mark.parametrize("target, sm", [("sm100", "sm100"), ("b200", "sm100"), ("sm120", "sm120")])
def test_nvfp4_trtllm_engine_on_blackwell_is_accepted(target, sm):
    spec = parse_spec(spec_data(precision="nvfp4", backend="trtllm-engine", target=target), ROOTS)
    assert (spec.precision, spec.backend, spec.target) == ("nvfp4", "trtllm-engine", sm)


@pytest.mark.parametrize("backend, target", [("aot-inductor", "sm90"), ("checkpoint", "sm89"), ("aot-inductor", "cpu")])
def test_nvfp4_outside_trtllm_is_accepted_below_sm100(backend, target):
    assert parse_spec(spec_data(precision="nvfp4", backend=backend, target=target), ROOTS).target == target


@pytest.mark.parametrize("backend", ["trtllm-engine", "aot-inductor", "checkpoint"])
def test_fp8_on_sm89_is_accepted(backend):
    spec = parse_spec(spec_data(precision="fp8", backend=backend, target="l40s"), ROOTS)
    assert spec.target == "sm89" and spec.sm == 89


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_tp_size_power_of_two_accepted_for_trtllm(tp):
    assert parse_spec(spec_data(backend="trtllm-engine", target="sm90", tp_size=tp), ROOTS).tp_size == tp


@pytest.mark.parametrize("tp", [3, 5, 6, 7])
def test_tp_size_not_power_of_two_is_refused(tp):
    err = refuse(backend="trtllm-engine", target="sm90", tp_size=tp)
    assert err.field == "tp_size"
    assert "power of two" in err.message


@pytest.mark.parametrize("backend", [b.name for b in BACKENDS.values() if not b.tensor_parallel])
def test_tensor_parallel_only_for_trtllm(backend):
    err = refuse(backend=backend, tp_size=2)
    assert err.field == "tp_size"
    assert backend in err.message


QUANTIZED_KV = [k.name for k in KV_CACHES.values() if k.quantized]


@pytest.mark.parametrize("kv_cache", QUANTIZED_KV)
@pytest.mark.parametrize("backend", [b.name for b in BACKENDS.values() if not b.kv_cache_quant])
def test_fp8_kv_cache_with_aot_inductor_is_refused(kv_cache, backend):
    err = refuse(kv_cache=kv_cache, backend=backend)
    assert err.field == "kv_cache" and backend in err.message


@pytest.mark.parametrize("kv_cache", QUANTIZED_KV)
@pytest.mark.parametrize("backend, target", [(b.name, "sm90" if b.gpu_only else "cpu") for b in BACKENDS.values()
                                             if b.kv_cache_quant])
def test_fp8_kv_cache_accepted_where_there_is_a_kv_cache(kv_cache, backend, target):
    assert parse_spec(spec_data(kv_cache=kv_cache, backend=backend, target=target), ROOTS).kv_cache == kv_cache


# -- batch profile ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(PROFILES))
def test_named_profiles_expand(name):
    spec = parse_spec(spec_data(profile=name), ROOTS)
    assert isinstance(spec.profile, BatchProfile)
    assert spec.batch_profile == PROFILES[name]
    assert spec.batch_profile.name == name


def test_explicit_profile_is_kept():
    spec = parse_spec(spec_data(profile=custom()), ROOTS)
    assert spec.batch_profile.limits() == custom()
    assert spec.batch_profile.name == "custom"


def test_max_seq_len_below_max_input_len_is_refused():
    err = refuse(profile=custom(max_input_len=256, max_seq_len=128))
    assert err.field == "profile.max_seq_len"
    assert "max_input_len" in err.message and "max_input_len" in err.fix


def test_max_seq_len_equal_to_max_input_len_is_accepted():
    assert parse_spec(spec_data(profile=custom(max_input_len=128, max_seq_len=128)), ROOTS)


def test_max_num_tokens_below_max_batch_size_is_refused():
    err = refuse(profile=custom(max_batch_size=64, max_num_tokens=32))
    assert err.field == "profile.max_num_tokens"
    assert "max_batch_size" in err.message


def _limit_cases():
    cases = []
    for key in PROFILE_FIELDS:
        lo, hi = LIMITS[key]
        for bad in sorted({0, -1, lo - 1, hi + 1, 1 << 40}):
            if lo <= bad <= hi:
                continue
            cases.append(pytest.param(f"profile.{key}", {"profile": "PROF", key: bad}, id=f"{key}={bad}"))
    for dotted in ("tp_size", "calibration.samples", "calibration.seq_len", "evaluation.seq_len", "evaluation.max_tokens"):
        lo, hi = LIMITS[dotted]
        for bad in sorted({0, -1, lo - 1, hi + 1, 1 << 40}):
            if lo <= bad <= hi:
                continue
            cases.append(pytest.param(dotted, {dotted: bad}, id=f"{dotted}={bad}"))
    return cases


def _overrides(case: dict) -> dict:
    if "profile" in case:
        case = dict(case)
        del case["profile"]
        (key, value), = case.items()
        # keep the two ordering rules satisfied so that only the range rule fires
        prof = {"max_batch_size": 1, "max_input_len": 1, "max_seq_len": 1 << 20, "max_num_tokens": 1 << 24}
        prof[key] = value
        if key == "max_input_len":
            prof["max_seq_len"] = LIMITS["max_seq_len"][1]
        return {"profile": prof}
    (dotted, value), = case.items()
    if "." in dotted:
        section, key = dotted.split(".")
        return {section: {key: value}}
    extra = {"backend": "trtllm-engine", "target": "sm90"} if dotted == "tp_size" else {}
    return {dotted: value, **extra}


@pytest.mark.parametrize("field, case", _limit_cases())
def test_out_of_range_integers_are_refused(field, case):
    err = refuse(**_overrides(case))
    assert field in [d["field"] for d in err.details]
    detail = next(d for d in err.details if d["field"] == field)
    assert "out of range" in detail["message"]
    lo, hi = LIMITS[field.removeprefix("profile.")]
    assert f"{lo} to {hi}" in detail["fix"]


@pytest.mark.parametrize("field", ["calibration.samples", "calibration.seq_len", "evaluation.seq_len", "evaluation.max_tokens"])
def test_integer_limits_are_inclusive(field):
    lo, hi = LIMITS[field]
    section, key = field.split(".")
    reason = {"override_reason": "a shorter evaluation"} if section == "evaluation" else {}
    for value in (lo, hi):
        assert getattr(getattr(parse_spec(spec_data(**{section: {key: value}}, **reason), ROOTS), section), key) == value


# -- gates -----------------------------------------------------------------------------------------
def test_unknown_gate_name_is_refused_naming_the_gate():
    err = refuse(gates={"max_latency_ms": 5.0})
    assert err.field == "gates.max_latency_ms"
    assert "max_ppl_increase_pct" in err.fix


def test_nan_gate_is_refused():
    err = refuse(gates={"max_mean_kl": float("nan")})
    assert err.field == "gates.max_mean_kl"


def test_known_gates_are_accepted():
    gates = {"max_ppl_increase_pct": 5.0, "min_top1_agreement": 0.9, "max_mean_kl": 0.1, "min_throughput_tps": 10}
    assert parse_spec(spec_data(gates=gates, override_reason="looser accuracy gates"), ROOTS).gates == gates


# -- checkpoint references -------------------------------------------------------------------------
def test_checkpoint_outside_roots_is_refused(tmp_path):
    root = tmp_path.resolve() / "root"
    err = refuse(roots=[root], checkpoint=str(tmp_path.resolve() / "elsewhere" / "model"))
    assert err.field == "checkpoint"
    assert "outside" in err.message


def test_path_traversal_out_of_a_root_is_refused(tmp_path):
    root = tmp_path.resolve() / "root"
    (root / "ckpt").mkdir(parents=True)
    err = refuse(roots=[root], checkpoint=f"{root}/../x")
    assert err.field == "checkpoint"
    err = refuse(roots=[root], checkpoint=f"file://{root}/ckpt/../../x")
    assert err.field == "checkpoint"


@pytest.mark.parametrize("ref", ["\x00", "/models/a\x00b", "hf://org/name@main\n", "s3://bucket/pre\x1bfix"])
def test_a_checkpoint_with_a_control_character_is_refused(tmp_path, ref):
    err = refuse(roots=[tmp_path.resolve()], checkpoint=ref)
    assert err.field == "checkpoint" and "control character" in err.message


def test_a_dataset_path_with_a_nul_is_refused_naming_its_field(tmp_path):
    from kiln.datasets import load_text

    with pytest.raises(SpecError) as exc:
        load_text(f"{tmp_path}/calib\x00.txt", field="calibration.dataset", roots=[tmp_path.resolve()])
    assert exc.value.field == "calibration.dataset" and "NUL" in exc.value.message


def test_sibling_directory_sharing_a_prefix_is_not_inside_the_root(tmp_path):
    root = tmp_path.resolve() / "models"
    err = refuse(roots=[root], checkpoint=str(tmp_path.resolve() / "models-private" / "m"))
    assert err.field == "checkpoint"


def make_ckpt(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text('{"model_type": "llama"}')
    return directory


@pytest.mark.parametrize("form", ["plain", "file", "dotdot-inside"])
def test_local_checkpoint_inside_roots_is_accepted(tmp_path, form):
    root = tmp_path.resolve()
    make_ckpt(root / "ckpt")
    ref = {"plain": f"{root}/ckpt", "file": f"file://{root}/ckpt", "dotdot-inside": f"{root}/a/../ckpt"}[form]
    spec = parse_spec(spec_data(checkpoint=ref), [root])
    assert spec.checkpoint == str(root / "ckpt")  # normalized: the same folder to every process
    assert spec.model_name == "ckpt"


def test_relative_local_checkpoint_is_made_absolute(tmp_path, monkeypatch):
    root = tmp_path.resolve()
    make_ckpt(root / "models" / "tiny")
    monkeypatch.chdir(root / "models")
    spec = parse_spec(spec_data(checkpoint="tiny"), [root])
    assert spec.checkpoint == str(root / "models" / "tiny")


def test_remote_references_are_kept_verbatim():
    for ref in ("hf://Org/Name@main", "s3://bucket/a/../b"):
        assert parse_spec(spec_data(checkpoint=ref), ROOTS).checkpoint == ref


def test_local_directory_without_config_json_is_refused(tmp_path):
    root = tmp_path.resolve()
    (root / "empty").mkdir()
    err = refuse(roots=[root], checkpoint=f"{root}/empty")
    assert err.field == "checkpoint" and "config.json" in err.message


def test_a_missing_local_checkpoint_is_said_not_to_exist(tmp_path):
    root = tmp_path.resolve()
    err = refuse(roots=[root], checkpoint=f"{root}/missing")
    assert err.field == "checkpoint" and err.message.endswith("does not exist") and "config.json" not in err.message


def test_root_itself_is_accepted(tmp_path):
    root = make_ckpt(tmp_path.resolve())
    assert parse_spec(spec_data(checkpoint=str(root)), [root])


def test_second_root_is_honoured(tmp_path):
    a, b = tmp_path.resolve() / "a", tmp_path.resolve() / "b"
    make_ckpt(b / "m")
    assert parse_spec(spec_data(checkpoint=f"{b}/m"), [a, b]).model_name == "m"


@pytest.mark.parametrize("ref", ["hf://org/name", "hf://org/name@main", "hf://Org-1/Name_2.5@0123abcd",
                                 "hf://org/name@" + "a" * 40, "hf://org/name@refs/pr/1", "hf://org/name@v1.0",
                                 "s3://bucket/prefix", "s3://bucket/a/b/", "s3://bucket"])
def test_remote_reference_shapes_are_accepted(ref):
    assert parse_spec(spec_data(checkpoint=ref), ROOTS).checkpoint == ref


@pytest.mark.parametrize("ref", ["hf://name-only", "hf://org/name/extra", "hf://", "hf://org/na me",
                                 "hf://../..", "hf://org/..", "hf://org/name@/etc", "hf://org/name@../../x",
                                 "hf://org/name@a/../b", "hf://org/name@", "hf://org/name@x.lock",
                                 "hf://org/name@refs/pr/1/", "hf://org/name@" + "/" * 2 + "x",
                                 "s3:///prefix-without-bucket", "gs://bucket/x", "http://example.com/model", ""])
def test_malformed_references_are_refused(ref):
    err = refuse(checkpoint=ref)
    assert err.field == "checkpoint"


# -- model name ------------------------------------------------------------------------------------
@pytest.mark.parametrize("ref, name", [
    ("hf://Org/Llama-3.1_8B@main", "org/llama-3.1_8b"), ("hf://org/name", "org/name"),
    ("s3://bucket/models/Tiny_Llama/", "tiny_llama"), ("s3://my-bucket", "my-bucket"),
    (CKPT, "tiny-llama"), (f"file://{CKPT}", "tiny-llama"),
])
def test_default_model_name_is_derived_from_the_reference(ref, name):
    spec = parse_spec(spec_data(checkpoint=ref), ROOTS)
    assert spec.model_name == name
    assert MODEL_NAME_RE.match(spec.model_name)


def test_local_default_model_name_is_normalized(tmp_path):
    root = tmp_path.resolve()
    make_ckpt(root / "My Model__V2.")
    make_ckpt(root / "___")
    assert parse_spec(spec_data(checkpoint=f"{root}/My Model__V2."), [root]).model_name == "my-model-v2"
    assert parse_spec(spec_data(checkpoint=f"{root}/___"), [root]).model_name == "model"


def test_explicit_model_name_is_kept_and_checked():
    assert parse_spec(spec_data(model_name="acme/tiny"), ROOTS).model_name == "acme/tiny"
    err = refuse(model_name="Acme/Tiny!")
    assert err.field == "model_name"


# -- pydantic type errors --------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, field", [
    ({"tp_size": "abc"}, "tp_size"), ({"calibration": {"samples": "many"}}, "calibration.samples"),
    ({"evaluation": {"seq_len": 1.5}}, "evaluation.seq_len"), ({"gates": {"max_mean_kl": "low"}}, "gates.max_mean_kl"),
    ({"colour": "blue"}, "colour"), ({"precision": None}, "precision"),
])
def test_type_errors_name_the_field(overrides, field):
    err = refuse(**overrides)
    assert err.field == field


def test_missing_required_field_is_named():
    with pytest.raises(SpecError) as info:
        parse_spec({"checkpoint": CKPT}, ROOTS)
    assert info.value.field == "precision" and info.value.fix


def test_profile_type_error_mentions_the_profile_field():
    err = refuse(profile=custom(max_batch_size="abc"))
    assert err.field.startswith("profile") and err.field.endswith("max_batch_size")


def test_profile_type_error_uses_the_dotted_field_path():
    err = refuse(profile=custom(max_batch_size="abc"))
    assert err.field == "profile.max_batch_size"
    assert [d["field"] for d in err.details] == ["profile.max_batch_size"]


# -- all violations --------------------------------------------------------------------------------
def test_details_hold_every_violation():
    err = refuse(precision="int4", kv_cache="int8", backend="onnx", target="a100", model_name="Bad Name",
                 profile=custom(max_input_len=256, max_seq_len=128, max_batch_size=64, max_num_tokens=32),
                 gates={"nope": 1.0}, calibration={"samples": 0})
    fields = [d["field"] for d in err.details]
    assert set(fields) == {"precision", "kv_cache", "backend", "target", "model_name", "profile.max_seq_len",
                           "profile.max_num_tokens", "gates.nope", "calibration.samples"}
    assert err.field == fields[0]
    assert err.to_dict()["errors"] == err.details


def test_details_hold_every_type_error():
    err = refuse(tp_size="x", calibration={"samples": "y"})
    assert {d["field"] for d in err.details} == {"tp_size", "calibration.samples"}


def test_unknown_profile_does_not_hide_later_violations():
    err = refuse(profile="turbo", tp_size=3, gates={"nope": 1.0})
    assert {"profile", "tp_size", "gates.nope"} <= {d["field"] for d in err.details}


# -- property --------------------------------------------------------------------------------------
def _limit(key):
    lo, hi = LIMITS[key]
    return st.one_of(st.integers(lo, min(hi, lo + 64)), st.integers(lo, hi))


@settings(max_examples=150, deadline=None)
@given(batch=st.integers(-2, LIMITS["max_batch_size"][1] + 2), inp=st.integers(-2, 5000),
       seq=st.integers(-2, 5000), tokens=st.integers(-2, 10_000))
def test_explicit_profile_parses_exactly_when_every_rule_holds(batch, inp, seq, tokens):
    prof = {"max_batch_size": batch, "max_input_len": inp, "max_seq_len": seq, "max_num_tokens": tokens}
    ok = all(LIMITS[k][0] <= prof[k] <= LIMITS[k][1] for k in PROFILE_FIELDS) and seq >= inp and tokens >= batch \
        and tokens <= batch * seq
    try:
        spec = parse_spec(spec_data(profile=prof), ROOTS)
    except SpecError as err:
        assert not ok, f"valid profile refused: {err}"
        assert err.fix and all(d["field"].startswith("profile.") for d in err.details)
    else:
        assert ok, f"invalid profile accepted: {prof}"
        assert spec.batch_profile.limits() == prof


@settings(max_examples=60, deadline=None)
@given(batch=_limit("max_batch_size"), inp=_limit("max_input_len"), extra_seq=st.integers(0, 1000),
       extra_tokens=st.integers(0, 1000))
def test_any_profile_within_limits_and_ordered_parses(batch, inp, extra_seq, extra_tokens):
    seq = min(max(inp + extra_seq, LIMITS["max_seq_len"][0]), LIMITS["max_seq_len"][1])
    tokens = min(batch + extra_tokens, LIMITS["max_num_tokens"][1], batch * seq)
    prof = {"max_batch_size": batch, "max_input_len": inp, "max_seq_len": seq, "max_num_tokens": tokens}
    assert parse_spec(spec_data(profile=prof), ROOTS).batch_profile.limits() == prof


def test_build_spec_direct_construction_leaves_profile_unexpanded():
    # parse_spec is the only entry that applies the rules; BuildSpec alone only checks types.
    raw = BuildSpec.model_validate(spec_data(profile="latency"))
    assert raw.profile == "latency"


@pytest.mark.parametrize("data", [
    {"target": "h100", "backend": "trtllm-engine", "profile": "balanced", "gates": {"max_mean_kl": 0.1},
     "override_reason": "a looser KL gate"},
    {"checkpoint": "hf://Org/X@main", "precision": "nvfp4", "kv_cache": "fp8", "backend": "checkpoint",
     "profile": {"max_batch_size": 2, "max_input_len": 3, "max_seq_len": 4, "max_num_tokens": 5}},
])
def test_parsed_spec_round_trips_through_json(data):
    # the service stores the spec as JSON and the worker parses it again: same spec, same rules pass
    spec = parse_spec(spec_data(**data), ROOTS)
    assert parse_spec(spec.model_dump(mode="json"), ROOTS) == spec


@pytest.mark.parametrize("target", ["sm²", "sm٩٠", "sm" + "9" * 5000])
def test_a_target_with_non_ascii_or_huge_digits_is_refused(target):
    assert refuse(target=target).field == "target"


@pytest.mark.parametrize("name", ["acme/tiny\n", "acme/tiny\n\n", "a" * 256, "acme/" + "b" * 251])
def test_a_model_name_with_a_trailing_newline_or_over_255_characters_is_refused(name):
    assert refuse(model_name=name).field == "model_name"


def test_refusals_name_the_reference_as_given_not_server_paths(tmp_path, monkeypatch):
    import os

    monkeypatch.chdir(tmp_path)
    for ref in ("relative/model", "~/model"):
        err = refuse(checkpoint=ref)
        assert err.field == "checkpoint" and str(tmp_path) not in err.message
        assert os.environ.get("HOME", "/nonexistent-home") not in err.message


# -- an engine judged more leniently than the defaults needs a recorded reason -----------------------------------
@pytest.mark.parametrize("gates, field", [
    ({"max_mean_kl": 0.101}, "gates.max_mean_kl"), ({"max_ppl_increase_pct": 5.5}, "gates.max_ppl_increase_pct"),
    ({"min_top1_agreement": 0.79}, "gates.min_top1_agreement"), ({"min_throughput_tps": 0.5}, "gates.min_throughput_tps"),
])
def test_a_gate_looser_than_the_precisions_default_needs_an_override_reason(gates, field):
    err = refuse(gates=gates)
    assert err.field == field and "fp8 default" in err.message and "override_reason" in err.fix
    assert parse_spec(spec_data(gates=gates, override_reason="a candidate checkpoint, judged loosely"), ROOTS).gates == gates


@pytest.mark.parametrize("evaluation, field", [({"max_tokens": 64}, "evaluation.max_tokens"),
                                                ({"seq_len": 127}, "evaluation.seq_len")])
def test_an_evaluation_shorter_than_the_default_needs_an_override_reason(evaluation, field):
    err = refuse(evaluation=evaluation)
    assert err.field == field and "override_reason" in err.fix
    assert refuse(evaluation=evaluation, override_reason="  ").field == field  # blank is no reason
    parse_spec(spec_data(evaluation=evaluation, override_reason="a smoke build"), ROOTS)


def test_stricter_gates_a_longer_evaluation_and_the_nvfp4_defaults_need_no_reason():
    parse_spec(spec_data(gates={"max_mean_kl": 0.01, "min_top1_agreement": 0.99, "max_ppl_increase_pct": 3.0},
                         evaluation={"max_tokens": 32768, "seq_len": 256}), ROOTS)
    parse_spec(spec_data(precision="nvfp4", gates={"max_mean_kl": 0.25, "max_ppl_increase_pct": 15.0}), ROOTS)
    assert refuse(precision="nvfp4", gates={"max_mean_kl": 0.26}).field == "gates.max_mean_kl"
    parse_spec(spec_data(gates={"max_peak_memory_bytes": 1e12}), ROOTS)  # the budget is the card's, not leniency

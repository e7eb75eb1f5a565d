"""Keys: quantize_key (no profile), compile_key (profile, target, backend), kernel_key (what shapes the compiled
code, no weight value), build_key (the BuildKey).
A checkpoint enters only through its content digest, never its path or its name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kiln.keys import build_key, compile_key, kernel_key, quantize_key, request_key
from kiln.recipes import recipes_for
from kiln.spec import parse_spec

DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
CKPT_A = "sha256:" + "a" * 64
CKPT_B = "sha256:" + "b" * 64
CAL_DATA = "sha256:" + "c" * 64
EVAL_DATA = "sha256:" + "e" * 64
TOOLCHAIN = {"kiln_recipe": "1", "torch": "2.13.0+cpu", "modelopt": "0.47.0", "transformers": "5.14.1", "cpu": "x86_64-AVX2"}
GATES = {"max_ppl_increase_pct": 3.0, "min_top1_agreement": 0.85, "max_mean_kl": 0.05, "min_throughput_tps": 1.0}
DATA = {"calibration": CAL_DATA, "evaluation": EVAL_DATA}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("roots").resolve()
    for name in ("a/model", "b/model", "calib"):
        (root / name).mkdir(parents=True)
    for name in ("a/model", "b/model"):
        (root / name / "config.json").write_text("{}")
    return root


@pytest.fixture(scope="module")
def make(root):
    def make(**overrides):
        data = {"checkpoint": str(root / "a" / "model"), "precision": "fp8", "backend": "checkpoint"}
        data.update(overrides)
        return parse_spec(data, [root])
    return make


def keys(spec, *, ckpt=CKPT_A, toolchain=TOOLCHAIN, cal=CAL_DATA, gates=GATES, data=DATA):
    q = quantize_key(ckpt, spec, toolchain, cal)
    return q, compile_key(q, spec, toolchain), build_key(ckpt, spec, toolchain, gates, data)


def test_every_key_is_a_sha256_digest(make):
    for key in keys(make()):
        assert DIGEST.match(key)


def test_keys_are_deterministic(make):
    assert keys(make()) == keys(make())


def test_the_three_keys_differ(make):
    assert len(set(keys(make()))) == 3


# -- quantize_key ----------------------------------------------------------------------------------
@pytest.mark.parametrize("profile", ["balanced", "throughput",
                                     {"max_batch_size": 3, "max_input_len": 7, "max_seq_len": 9, "max_num_tokens": 27}])
def test_quantize_key_ignores_the_profile(make, profile):
    assert quantize_key(CKPT_A, make(), TOOLCHAIN, CAL_DATA) == quantize_key(CKPT_A, make(profile=profile), TOOLCHAIN, CAL_DATA)


@pytest.mark.parametrize("overrides", [{"target": "sm90"}, {"backend": "aot-inductor"}, {"evaluation": {"seq_len": 256}},
                                       {"model_name": "other/name"}])
def test_quantize_key_ignores_what_happens_after_quantize(make, overrides):
    assert quantize_key(CKPT_A, make(), TOOLCHAIN, CAL_DATA) == quantize_key(CKPT_A, make(**overrides), TOOLCHAIN, CAL_DATA)


@pytest.mark.parametrize("overrides", [{"precision": "nvfp4"}, {"kv_cache": "fp8"}, {"calibration": {"samples": 64}},
                                       {"calibration": {"seq_len": 256}}])
def test_quantize_key_changes_with_quantize_inputs(make, overrides):
    assert quantize_key(CKPT_A, make(), TOOLCHAIN, CAL_DATA) != quantize_key(CKPT_A, make(**overrides), TOOLCHAIN, CAL_DATA)


def test_tensor_parallel_size_is_a_compile_input_not_a_calibration_input(make):
    """The TensorRT-LLM checkpoint (where tp_size matters) is exported at compile time from the shared
    calibration, so tp_size keys the compile stage only."""
    a = make(backend="trtllm-engine", target="sm90")
    b = make(backend="trtllm-engine", target="sm90", tp_size=2)
    qa, qb = quantize_key(CKPT_A, a, TOOLCHAIN, CAL_DATA), quantize_key(CKPT_A, b, TOOLCHAIN, CAL_DATA)
    assert qa == qb
    assert compile_key(qa, a, TOOLCHAIN) != compile_key(qb, b, TOOLCHAIN)


@pytest.mark.parametrize("backend, target", [("checkpoint", "cpu"), ("trtllm-engine", "sm90"), ("aot-inductor", "sm90")])
def test_every_backend_shares_one_calibration(make, backend, target):
    base = quantize_key(CKPT_A, make(), TOOLCHAIN, CAL_DATA)
    assert quantize_key(CKPT_A, make(backend=backend, target=target), TOOLCHAIN, CAL_DATA) == base


def test_quantize_key_changes_with_calibration_data_and_checkpoint_digest(make):
    spec = make()
    base = quantize_key(CKPT_A, spec, TOOLCHAIN, CAL_DATA)
    assert quantize_key(CKPT_A, spec, TOOLCHAIN, "sha256:" + "d" * 64) != base
    assert quantize_key(CKPT_B, spec, TOOLCHAIN, CAL_DATA) != base


@pytest.mark.parametrize("tool", ["torch", "modelopt", "transformers"])
def test_quantize_key_changes_with_the_quantizer_toolchain(make, tool):
    spec = make()
    assert quantize_key(CKPT_A, spec, {**TOOLCHAIN, tool: "9.9"}, CAL_DATA) != quantize_key(CKPT_A, spec, TOOLCHAIN, CAL_DATA)


def test_quantize_key_ignores_compiler_only_toolchain_entries(make):
    spec = make()
    other = {**TOOLCHAIN, "tensorrt_llm": "1.2.1", "cpu": "aarch64-NEON"}
    assert quantize_key(CKPT_A, spec, other, CAL_DATA) == quantize_key(CKPT_A, spec, TOOLCHAIN, CAL_DATA)


def test_quantize_key_is_independent_of_the_calibration_file_path(make, root):
    a = make(calibration={"dataset": str(root / "calib" / "one.txt")})
    b = make(calibration={"dataset": str(root / "calib" / "two.txt")})
    assert quantize_key(CKPT_A, a, TOOLCHAIN, CAL_DATA) == quantize_key(CKPT_A, b, TOOLCHAIN, CAL_DATA)


# -- compile_key -----------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides", [
    {"profile": "balanced"}, {"profile": {"max_batch_size": 1, "max_input_len": 256, "max_seq_len": 513, "max_num_tokens": 512}},
    {"target": "sm90"}, {"backend": "aot-inductor"},
])
def test_compile_key_changes_with_profile_target_backend(make, overrides):
    base, other = make(), make(**overrides)
    q = quantize_key(CKPT_A, base, TOOLCHAIN, CAL_DATA)
    assert q == quantize_key(CKPT_A, other, TOOLCHAIN, CAL_DATA)  # same calibrated checkpoint is reused
    assert compile_key(q, base, TOOLCHAIN) != compile_key(q, other, TOOLCHAIN)


def test_profile_name_alone_does_not_change_compile_key(make):
    limits = {"max_batch_size": 1, "max_input_len": 256, "max_seq_len": 512, "max_num_tokens": 512}
    named, custom = make(profile="latency"), make(profile=limits)
    q = quantize_key(CKPT_A, named, TOOLCHAIN, CAL_DATA)
    assert compile_key(q, named, TOOLCHAIN) == compile_key(q, custom, TOOLCHAIN)


def test_compile_key_follows_the_quantize_key_and_toolchain(make):
    spec = make()
    q1 = quantize_key(CKPT_A, spec, TOOLCHAIN, CAL_DATA)
    q2 = quantize_key(CKPT_B, spec, TOOLCHAIN, CAL_DATA)
    assert compile_key(q1, spec, TOOLCHAIN) != compile_key(q2, spec, TOOLCHAIN)
    assert compile_key(q1, spec, TOOLCHAIN) != compile_key(q1, spec, {**TOOLCHAIN, "tensorrt": "10.14"})


# -- kernel_key ------------------------------------------------------------------------------------
#: the shipped tiny Llama's config.json, as the quantize stage exports it
CONFIG = {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 0,
          "dtype": "float32", "eos_token_id": 1, "head_dim": 32, "hidden_act": "silu", "hidden_size": 128,
          "initializer_range": 0.02, "intermediate_size": 384, "max_position_embeddings": 512, "mlp_bias": False,
          "model_type": "llama", "num_attention_heads": 4, "num_hidden_layers": 4, "num_key_value_heads": 4,
          "pad_token_id": None, "rms_norm_eps": 1e-06, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
          "tie_word_embeddings": False, "transformers_version": "5.14.1", "use_cache": True, "vocab_size": 2048,
          "_name_or_path": "/work/acme/tiny", "quantization_config": {"quant_algo": "FP8", "producer": {"version": "0.47.0"}}}
QUANT = {"quant_algo": "FP8", "kv_cache_quant_algo": None, "exclude_modules": ["lm_head", "model.embed_tokens"],
         "producer": {"name": "modelopt", "version": "0.47.0"}}
CODE = {"graph": "sha256:" + "9" * 64, "compiler": "g++ (Debian 12.2.0-14+deb12u1) 12.2.0"}


def kkey(spec, *, config=CONFIG, quant=QUANT, toolchain=TOOLCHAIN, code=CODE):
    return kernel_key(config, quant, spec, toolchain, code)


@pytest.fixture()
def engine(make):
    return lambda **kw: make(**{"backend": "aot-inductor", "target": "cpu", "recipe": "fp8", **kw})


def test_kernel_key_is_a_digest_of_its_own_and_ignores_which_checkpoint(engine):
    """No checkpoint digest, quantize key or path enters it: a fine-tune (other weights, other calibration) of the
    same architecture, recipe and profile has the same kernel key, and its own quantize and compile keys."""
    spec = engine()
    assert DIGEST.match(kkey(spec)) and kkey(spec) == kkey(engine())
    assert kkey(spec) not in keys(spec) and keys(spec) != keys(spec, ckpt=CKPT_B)


@pytest.mark.parametrize("field, value", [
    ("_name_or_path", "/elsewhere/finetune"), ("transformers_version", "5.15.0"), ("bos_token_id", 7),
    ("eos_token_id", [1, 2]), ("pad_token_id", 0), ("initializer_range", 0.5), ("use_cache", False),
    ("quantization_config", {"quant_algo": "FP8", "producer": {"version": "0.48.0"}}),
])
def test_kernel_key_ignores_config_fields_that_are_only_values(engine, field, value):
    assert kkey(engine()) == kkey(engine(), config={**CONFIG, field: value})


@pytest.mark.parametrize("field, value", [
    ("num_hidden_layers", 5), ("hidden_size", 256), ("intermediate_size", 512), ("num_attention_heads", 8),
    ("num_key_value_heads", 2), ("head_dim", 16), ("vocab_size", 4096), ("rms_norm_eps", 1e-5),
    ("rope_parameters", {"rope_theta": 500000.0, "rope_type": "default"}), ("dtype", "bfloat16"),
    ("max_position_embeddings", 1024), ("tie_word_embeddings", True), ("hidden_act", "gelu"),
    ("architectures", ["MistralForCausalLM"]), ("sliding_window", 256),
])
def test_kernel_key_changes_with_every_config_field_that_shapes_code(engine, field, value):
    assert kkey(engine()) != kkey(engine(), config={**CONFIG, field: value})


@pytest.mark.parametrize("overrides", [
    {"recipe": "fp8-pcpt"}, {"precision": "nvfp4", "recipe": "nvfp4"}, {"unquantized_layers": [0]},
    {"profile": "balanced"}, {"profile": {"max_batch_size": 1, "max_input_len": 256, "max_seq_len": 513, "max_num_tokens": 512}},
    {"target": "sm90"}, {"backend": "checkpoint"},
])
def test_kernel_key_changes_with_the_recipe_profile_target_and_backend(engine, overrides):
    assert kkey(engine()) != kkey(engine(**overrides))


@pytest.mark.parametrize("quant", [
    {**QUANT, "quant_algo": "FP8_PER_CHANNEL_PER_TOKEN"}, {**QUANT, "exclude_modules": ["lm_head"]},
    {**QUANT, "kv_cache_quant_algo": "FP8"}, {},
])
def test_kernel_key_changes_with_the_quantization_layout_not_its_producer(engine, quant):
    assert kkey(engine()) != kkey(engine(), quant=quant)
    assert kkey(engine()) == kkey(engine(), quant={**QUANT, "producer": {"name": "modelopt", "version": "0.48.0"}})


@pytest.mark.parametrize("toolchain, code", [
    ({**TOOLCHAIN, "torch": "2.14.0"}, CODE), ({**TOOLCHAIN, "cpu": "x86_64-AVX512-BF16"}, CODE),
    (TOOLCHAIN, {**CODE, "compiler": "g++ 13.1.0"}), (TOOLCHAIN, {**CODE, "graph": "sha256:" + "8" * 64}),
])
def test_kernel_key_changes_with_the_toolchain_the_cpu_the_compiler_and_the_graph(engine, toolchain, code):
    assert kkey(engine()) != kkey(engine(), toolchain=toolchain, code=code)


def test_kernel_key_changes_when_the_recipe_version_is_bumped(engine, monkeypatch):
    import kiln.keys

    before = kkey(engine())
    monkeypatch.setattr(kiln.keys, "RECIPE_VERSION", "kiln-recipe-test-bump")
    assert kkey(engine()) != before


# -- build_key -------------------------------------------------------------------------------------
def test_build_key_changes_with_gates(make):
    spec = make()
    assert keys(spec)[2] != keys(spec, gates={**GATES, "max_mean_kl": 0.04})[2]
    assert keys(spec)[2] != keys(spec, gates={k: v for k, v in GATES.items() if k != "min_throughput_tps"})[2]


@pytest.mark.parametrize("which", ["calibration", "evaluation"])
def test_build_key_changes_with_data_digests(make, which):
    spec = make()
    assert keys(spec)[2] != keys(spec, data={**DATA, which: "sha256:" + "f" * 64})[2]


def test_build_key_changes_with_checkpoint_digest_and_toolchain(make):
    spec = make()
    assert keys(spec)[2] != keys(spec, ckpt=CKPT_B)[2]
    assert keys(spec)[2] != keys(spec, toolchain={**TOOLCHAIN, "torch": "2.14.0"})[2]


@pytest.mark.parametrize("overrides", [{"precision": "nvfp4"}, {"profile": "throughput"}, {"target": "sm100"},
                                       {"backend": "aot-inductor"}, {"evaluation": {"max_tokens": 32768}}])
def test_build_key_changes_with_the_spec(make, overrides):
    assert keys(make())[2] != keys(make(**overrides))[2]


def test_build_key_is_independent_of_the_checkpoint_path(make, root):
    here = make(checkpoint=str(root / "a" / "model"))
    there = make(checkpoint=str(root / "b" / "model"))
    as_url = make(checkpoint=f"file://{root}/b/model")
    assert here.checkpoint != there.checkpoint
    assert keys(here) == keys(there) == keys(as_url)


def test_build_key_is_independent_of_the_model_name(make):
    assert keys(make(model_name="acme/tiny")) == keys(make(model_name="other/name"))


def test_gpu_name_and_sm_give_the_same_keys(make):
    assert keys(make(target="h100")) == keys(make(target="sm90"))


# -- request_key -----------------------------------------------------------------------------------
def test_request_key_ignores_the_toolchain_but_not_the_build_inputs(make):
    spec = make()
    base = request_key(CKPT_A, spec, GATES, DATA)
    assert DIGEST.match(base) and base not in keys(spec)
    assert request_key(CKPT_A, make(model_name="x/y"), GATES, DATA) == base
    assert request_key(CKPT_B, spec, GATES, DATA) != base
    assert request_key(CKPT_A, make(profile="balanced"), GATES, DATA) != base
    assert request_key(CKPT_A, spec, {**GATES, "max_mean_kl": 1.0}, DATA) != base
    assert request_key(CKPT_A, spec, GATES, {**DATA, "evaluation": CAL_DATA}) != base
    # two toolchains: two BuildKeys, one request
    assert keys(spec)[2] != keys(spec, toolchain={**TOOLCHAIN, "torch": "9"})[2]


def test_every_key_changes_when_the_recipe_version_is_bumped(make, monkeypatch):
    """A bump of RECIPE_VERSION must reach every stage. The quantize key once wrote its recipe's name under the same
    dict key as the version, so the version was overwritten and a bump left every calibration reused."""
    import kiln.keys

    spec = make()
    before = (*keys(spec), request_key(CKPT_A, spec, GATES, DATA))
    monkeypatch.setattr(kiln.keys, "RECIPE_VERSION", "kiln-recipe-test-bump")
    after = (*keys(spec), request_key(CKPT_A, spec, GATES, DATA))
    assert [b != a for b, a in zip(before, after)] == [True] * 4, "a RECIPE_VERSION bump left a key unchanged"


def test_the_quantize_key_separates_recipe_names(make):
    names = [r.name for r in recipes_for("fp8")]
    assert len(names) >= 2
    assert len({keys(make(recipe=n))[0] for n in names}) == len(names)

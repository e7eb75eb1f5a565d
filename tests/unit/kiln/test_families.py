"""The descriptors of what Kiln varies — families, precisions, backends — and the refusals they make before any
work: an unsupported family × backend pair, an encoder-only or multimodal checkpoint, an unknown model type."""

from __future__ import annotations

import json
import shutil
import time

import pytest

from kiln.backends import BACKENDS, backends_for, support_matrix
from kiln.errors import SpecError
from kiln.families import FAMILIES, family_of
from kiln.precisions import PRECISIONS
from kiln.spec import check_model, parse_spec
from tests.conftest import REPO, TINY
from tests.families import FAMILY_CONFIGS, make_config


@pytest.mark.parametrize("family", list(FAMILY_CONFIGS))
def test_every_tested_family_is_recognised_from_its_transformers_config(family):
    config = make_config(family).to_dict()
    config["architectures"] = [FAMILIES[family].architectures[0]]
    assert family_of(config).name == family


def test_every_family_has_a_tested_tiny_model():
    assert set(FAMILY_CONFIGS) == set(FAMILIES)


@pytest.mark.parametrize("config, says", [
    ({"model_type": "bert", "architectures": ["BertForMaskedLM"]}, "encoder-only"),
    ({"model_type": "t5", "architectures": ["T5ForConditionalGeneration"], "is_encoder_decoder": True}, "encoder-decoder"),
    ({"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"]}, "multimodal"),
    ({"model_type": "llama", "architectures": ["LlamaForSequenceClassification"]}, "not a causal language model"),
    ({"model_type": "falcon_h9", "architectures": ["FalconH9ForCausalLM"]}, "not a family Kiln builds"),
])
def test_what_is_not_a_supported_causal_lm_is_refused_naming_the_checkpoint(config, says):
    with pytest.raises(SpecError) as info:
        family_of(config)
    assert info.value.field == "checkpoint" and says in info.value.message
    assert "Llama" in info.value.fix and "Qwen3-MoE" in info.value.fix  # says what is supported


def _spec(**kw):
    return parse_spec({"checkpoint": str(TINY), "precision": "fp8", **kw}, [REPO])


def test_an_unsupported_family_backend_pair_names_the_family_and_the_backends_that_take_it():
    config = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "max_position_embeddings": 4096}
    with pytest.raises(SpecError) as info:
        check_model(_spec(backend="trtllm-engine", target="sm90"), config)
    err = info.value
    assert err.field == "checkpoint" and "Qwen3-MoE" in err.message and "trtllm-engine" in err.message
    assert "aot-inductor" in err.fix and "checkpoint" in err.fix
    check_model(_spec(backend="checkpoint"), config)  # the same family on a backend that takes it is fine
    check_model(_spec(backend="aot-inductor"), config)


@pytest.mark.parametrize("family", [f for f in FAMILIES if FAMILIES[f].trtllm_decoder])
def test_families_with_an_engine_path_are_planned_for_trtllm_engine(family):
    assert backends_for(FAMILIES[family]) == list(BACKENDS)


def test_support_matrix_is_every_family_precision_backend_with_a_reason_for_each_gap():
    rows = support_matrix()
    assert len(rows) == len(FAMILIES) * len(PRECISIONS) * len(BACKENDS)
    gaps = [r for r in rows if not r["supported"]]
    assert {(r["family"], r["backend"]) for r in gaps} == {("qwen3_moe", "trtllm-engine")}
    assert all(r["reason"] for r in gaps)
    nvfp4_engine = [r for r in rows if r["precision"] == "nvfp4" and r["backend"] == "trtllm-engine" and r["supported"]]
    assert nvfp4_engine and all("sm100" in r["reason"] for r in nvfp4_engine)


def test_docs_models_md_is_the_generated_table():
    from api.cli_models import support_table_markdown

    text = (REPO / "docs" / "models.md").read_text()
    assert support_table_markdown() in text, "regenerate with: kiln models --markdown"


def test_the_checkpoint_backend_error_names_the_checkpoint_backend():
    """The old code said "aot-inductor backend (Llama only)" for a checkpoint build: the message names the
    backend asked for."""
    config = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"]}
    with pytest.raises(SpecError, match="trtllm-engine backend"):
        check_model(_spec(backend="trtllm-engine", target="sm90"), config)


# -- refused before any stage runs ---------------------------------------------------------------------------
@pytest.fixture
def encoder_only(tmp_path):
    ckpt = tmp_path / "bert"
    shutil.copytree(TINY, ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "model_type": "bert", "architectures": ["BertForMaskedLM"]}))
    return ckpt


def test_the_pipeline_refuses_an_encoder_only_checkpoint_before_quantize(encoder_only, tmp_path):
    from artifacts.factory import open_store
    from builder.pipeline import Builder
    from kiln import db
    from kiln.settings import Settings

    settings = Settings(home=tmp_path / "home")
    db.upgrade(settings.db_url)
    events = []
    builder = Builder(settings, open_store(settings.store), db.session_factory(settings.db_url),
                      on_event=lambda kind, data: events.append(data))
    spec = parse_spec({"checkpoint": str(encoder_only), "precision": "fp8"}, [tmp_path])
    t = time.perf_counter()
    with pytest.raises(SpecError) as info:
        builder.build(spec)
    assert time.perf_counter() - t < 5  # config.json only: no model is loaded
    assert info.value.field == "checkpoint" and "encoder-only" in info.value.message
    assert not (settings.cache_dir / "quantize").exists()
    assert [e["name"] for e in events if e.get("state") == "started"] == ["resolve"]


def test_docs_models_md_has_the_generated_recipe_table():
    from api.cli_models import recipe_table_markdown

    text = (REPO / "docs" / "models.md").read_text()
    assert recipe_table_markdown() in text, "regenerate with: kiln models --markdown"

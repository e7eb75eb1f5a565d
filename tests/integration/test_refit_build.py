"""A fine-tune through the whole pipeline on the embedded defaults: the shipped tiny Llama is built (FP8,
aot-inductor, cpu), then a copy with every weight perturbed. The second build quantizes its own checkpoint, finds
the kernel of the first under its kernel key in the stage cache, writes only its weights (the compile stage says
``reused``), validates and publishes its own engine; the two engines share the kernel's bytes — one kernel layer
blob in the store — and differ in their weights."""

from __future__ import annotations

import json

import pytest

from tests.unit.builder.test_refit import TINY, perturbed_copy

pytestmark = pytest.mark.slow

PROFILE = {"max_batch_size": 1, "max_input_len": 64, "max_seq_len": 64, "max_num_tokens": 64}
EVALUATION = {"seq_len": 64, "max_tokens": 2048, "sequential": False}
CALIBRATION = {"samples": 8, "seq_len": 64}


def test_a_finetune_build_reuses_the_kernel_of_its_base_and_publishes_its_own_engine(tmp_path):
    from artifacts.factory import open_store
    from artifacts.oci import read_manifest
    from builder.pipeline import Builder
    from kiln import db
    from kiln.settings import Settings
    from kiln.spec import parse_spec
    from kiln.tables import Artifact, StageOutput

    settings = Settings(home=tmp_path / "home")
    db.upgrade(settings.db_url)
    sessions = db.session_factory(settings.db_url)
    builder = Builder(settings, open_store(settings.store), sessions)

    def build(ckpt):
        spec = parse_spec({"checkpoint": str(ckpt), "precision": "fp8", "recipe": "fp8", "target": "cpu",
                           "profile": PROFILE, "evaluation": EVALUATION, "calibration": CALIBRATION,
                           "override_reason": "a test build: a short evaluation"}, settings.roots)
        outcome = builder.build(spec)
        return outcome, {s.name: s for s in outcome.stages}

    base, base_stages = build(TINY)
    tuned, tuned_stages = build(perturbed_copy(tmp_path / "tiny-finetune"))
    compiled, refit = base_stages["compile"], tuned_stages["compile"]
    print(f"compile stage: cold {compiled.seconds:.1f} s {compiled.detail['seconds']}, "
          f"reused {refit.seconds:.1f} s {refit.detail['seconds']}")
    assert compiled.status == "ran" and refit.status == "reused"
    assert tuned_stages["quantize"].status == "ran"  # its own calibration: its own weights
    assert refit.detail["kernel"]["key"] == compiled.detail["kernel"]["key"]
    assert refit.detail["kernel"]["digest"] == compiled.detail["kernel"]["digest"]
    assert refit.detail["seconds"]["compile"] < compiled.detail["seconds"]["compile"] / 4
    assert base.status == tuned.status == "succeeded" and base.digest != tuned.digest
    with sessions() as s:
        kernels = [o.key for o in s.query(StageOutput).all() if o.stage == "kernel"]
        provenance = [s.get(Artifact, o.digest).provenance for o in (base, tuned)]
    assert kernels == [compiled.detail["kernel"]["key"]]  # one kernel, kept in the store
    # the engines name it, so GC keeps it while either is fresh or tagged (builder/gc.py)
    assert [p["kernel_key"] for p in provenance] == kernels * 2
    # the images: kernel, weights and the rest as titled layers, the kernel's blob shared
    images = [read_manifest(builder.store, o.digest)["layers"] for o in (base, tuned)]
    assert [[d["annotations"]["org.opencontainers.image.title"] for d in i] for i in images] == \
        [["kernel.tar", "weights.tar", "engine.tar"]] * 2
    assert images[0][0]["digest"] == images[1][0]["digest"] and images[0][1]["digest"] != images[1][1]["digest"]
    cache = settings.cache_dir / "compile"
    engines = [json.loads((d / "engine.json").read_text()) for d in cache.iterdir() if not d.name.startswith(".")]
    assert len(engines) == 2 and engines[0]["kernel"] == engines[1]["kernel"]
    assert engines[0]["weights"]["digest"] != engines[1]["weights"]["digest"]

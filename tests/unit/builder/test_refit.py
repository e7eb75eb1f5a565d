"""A kernel and its weights: the aot-inductor backend compiles code without constants, keeps it under its kernel
key, and an engine of another checkpoint of the architecture (a fine-tune: same config, recipe and profile, new
weights and calibration) reuses it and writes only its weights — with the logits of its own cold compile.

Real exports and compiles of the shipped tiny Llama (FP8, static activation scales) and of a copy with every
weight perturbed, calibrated afresh."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from builder.backends.aot_inductor import KERNEL, KERNEL_MANIFEST, WEIGHTS, AOTInductorBackend, kernel_weights
from builder.backends.base import Kernels
from kiln.errors import StageFailed
from kiln.spec import parse_spec
from validation.runners import AOTInductorRunner

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "examples" / "tiny-llama"
PROFILE = {"max_batch_size": 2, "max_input_len": 64, "max_seq_len": 64, "max_num_tokens": 128}


def engine_spec(checkpoint: Path = TINY):
    return parse_spec({"checkpoint": str(checkpoint), "precision": "fp8", "recipe": "fp8", "backend": "aot-inductor",
                       "target": "cpu", "profile": PROFILE}, [REPO, checkpoint.parent])


def perturbed_copy(out: Path, seed: int = 1) -> Path:
    """The tiny Llama with every tensor moved by noise of 2 % of its own spread: a fine-tune's weights."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(TINY, out)
    g = torch.Generator().manual_seed(seed)
    state = load_file(out / "model.safetensors")
    save_file({k: v + 0.02 * v.std() * torch.randn(v.shape, generator=g) for k, v in state.items()},
              out / "model.safetensors")
    return out


@pytest.fixture(scope="module")
def finetune(tmp_path_factory) -> tuple[Path, Path]:
    """(the fine-tune's checkpoint, its FP8 quantize output)."""
    from builder.quantize import quantize
    from kiln.datasets import load_text
    from tests.unit.conftest import CALIBRATION

    root = tmp_path_factory.mktemp("finetune")
    ckpt = perturbed_copy(root / "tiny-finetune")
    spec = parse_spec({"checkpoint": str(ckpt), "precision": "fp8", "recipe": "fp8", "backend": "checkpoint",
                       "calibration": CALIBRATION}, [REPO, root])
    text, _ = load_text(spec.calibration.dataset, field="calibration.dataset", roots=[REPO])
    quantize(ckpt, spec, text, root / "q")
    return ckpt, root / "q"


def logits(engine_dir: Path) -> torch.Tensor:
    ids = torch.randint(0, 2048, (2, 48), generator=torch.Generator().manual_seed(0))
    return AOTInductorRunner(engine_dir).logits(ids)


def test_a_finetune_reuses_its_bases_kernel_with_the_logits_of_its_own_cold_compile(fp8_export, finetune, tmp_path):
    ckpt, quantized = finetune
    from kiln.quantformat import load_exported

    base_scales, tuned_scales = load_exported(fp8_export / "hf").input_scales, load_exported(quantized / "hf").input_scales
    assert base_scales.keys() == tuned_scales.keys() and base_scales != tuned_scales  # the premise: recalibrated
    backend, spec = AOTInductorBackend(), engine_spec()
    kernels = Kernels.fresh(spec, tmp_path / "kernels")

    base = backend.compile(spec, fp8_export, tmp_path / "base", checkpoint_dir=TINY, kernels=kernels)
    tuned = backend.compile(spec, quantized, tmp_path / "tuned", checkpoint_dir=ckpt, kernels=kernels)
    cold = backend.compile(spec, quantized, tmp_path / "cold", checkpoint_dir=ckpt)  # a kernel of its own
    assert base["kernel"]["reused"] is False and tuned["kernel"]["reused"] is True and cold["kernel"]["reused"] is False
    assert base["kernel"]["key"] == tuned["kernel"]["key"] == cold["kernel"]["key"]
    assert tuned["kernel"]["digest"] == base["kernel"]["digest"]  # the very kernel, not a recompile
    assert (tmp_path / "tuned" / KERNEL).read_bytes() == (tmp_path / "base" / KERNEL).read_bytes()
    assert tuned["seconds"]["compile"] < base["seconds"]["compile"] / 4
    # the weights file is the checkpoint's own, whichever kernel it runs on
    assert (tmp_path / "tuned" / WEIGHTS).read_bytes() == (tmp_path / "cold" / WEIGHTS).read_bytes()
    assert (tmp_path / "tuned" / WEIGHTS).read_bytes() != (tmp_path / "base" / WEIGHTS).read_bytes()
    meta = json.loads((tmp_path / "tuned" / "engine.json").read_text())
    assert meta["kernel"] == {"file": KERNEL, "key": tuned["kernel"]["key"], "digest": tuned["kernel"]["digest"]}

    refit, own = logits(tmp_path / "tuned"), logits(tmp_path / "cold")
    assert torch.equal(refit, own)  # bit for bit
    assert not torch.allclose(refit, logits(tmp_path / "base"), atol=1e-3)  # and they are the fine-tune's logits


def test_every_constant_the_kernel_reads_is_in_the_weights_file_none_in_the_package(fp8_export, tmp_path):
    """The package holds code only (its size does not grow with the weights); the weights file holds what the
    kernel expects — weights and the static activation scales among them — and the runner refuses a partial one."""
    from safetensors.torch import load_file, save_file

    spec = engine_spec()
    AOTInductorBackend().compile(spec, fp8_export, tmp_path / "e", checkpoint_dir=TINY)
    weights = load_file(tmp_path / "e" / WEIGHTS)
    assert any(k.endswith(".kiln_input_scale") for k in weights)
    assert sum(t.numel() * t.element_size() for t in weights.values()) > (tmp_path / "e" / KERNEL).stat().st_size
    save_file({k: v for k, v in weights.items() if "layers.0.mlp" not in k}, tmp_path / "e" / WEIGHTS)
    with pytest.raises(StageFailed, match="does not load"):
        AOTInductorRunner(tmp_path / "e")


def test_weights_that_do_not_fit_the_kernel_are_refused(tmp_path):
    """A dtype, shape or name the kernel does not expect means its key missed an input that shapes the code."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    exported = torch.export.export(model, (torch.zeros(2, 4),))
    manifest = {"constants": {"0.weight": {"dtype": "float32", "shape": [3, 4]}, "0.bias": {"dtype": "float32", "shape": [3]}}}
    assert set(kernel_weights(exported, manifest)) == {"0.weight", "0.bias"}
    for wrong in ({"0.weight": {"dtype": "bfloat16", "shape": [3, 4]}}, {"0.weight": {"dtype": "float32", "shape": [4, 4]}},
                  {"1.weight": {"dtype": "float32", "shape": [3, 4]}}):
        with pytest.raises(StageFailed, match="key missed"):
            kernel_weights(exported, {"constants": {**manifest["constants"], **wrong}})


def test_a_tied_head_gets_its_own_copy_in_the_weights_file(tmp_path):
    """safetensors keeps no shared storage; the kernel may name both tied tensors."""
    from safetensors.torch import save_file

    emb = torch.nn.Embedding(8, 4)
    model = torch.nn.ModuleDict({"embed": emb, "head": torch.nn.Linear(4, 8, bias=False)})
    model["head"].weight = emb.weight
    named = {"embed.weight": emb.weight, "head.weight": emb.weight}
    exported = type("Exported", (), {"state_dict": named, "constants": {}})()
    manifest = {"constants": {k: {"dtype": "float32", "shape": [8, 4]} for k in named}}
    weights = kernel_weights(exported, manifest)
    assert weights["embed.weight"].data_ptr() != weights["head.weight"].data_ptr()
    save_file(weights, str(tmp_path / "w.safetensors"))  # would raise on shared storage


def test_the_kernel_manifest_names_what_the_kernel_reads(fp8_export, tmp_path):
    spec = engine_spec()
    record = AOTInductorBackend().compile(spec, fp8_export, tmp_path / "e", checkpoint_dir=TINY,
                                          kernels=Kernels.fresh(spec, tmp_path / "k"))
    kernel_dir = tmp_path / "k" / record["kernel"]["key"].split(":", 1)[1]
    manifest = json.loads((kernel_dir / KERNEL_MANIFEST).read_text())
    loaded = torch._inductor.aoti_load_package(str(kernel_dir / KERNEL))
    assert sorted(loaded.get_constant_fqns()) == sorted(manifest["constants"])
    assert manifest["code"]["graph"].startswith("sha256:") and manifest["code"]["compiler"]

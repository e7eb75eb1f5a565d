"""kiln/hfmodel.py's attention for exported engines: ``is_causal`` SDPA on a plain causal layer, transformers' own
masked SDPA on every other, with the same logits as transformers' SDPA path for every kind of layer the families
have (GQA, sliding windows shorter than the input, soft-capping, Gemma 3's mix of sliding and full layers)."""

from __future__ import annotations

import pytest
import torch

from kiln.hfmodel import CAUSAL_SDPA, LogitsOnly, _register_causal_sdpa, _SharedInput, tabulate_rotary
from tests.families import family_checkpoint

SDPA = torch.ops.aten.scaled_dot_product_attention.default
#: families whose every layer is plain causal attention in the tiny configs (tests/families.py)
PLAIN = ("llama", "qwen2", "qwen3", "phi3")
#: families with layers that need their mask: sliding windows of 32 tokens (inputs here are 48), soft-capping
MASKED = ("mistral", "gemma2", "gemma3")


def _model(ckpt, attn: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation=attn).eval()


def _sdpa_calls(model, x: torch.Tensor) -> list[tuple[bool, bool]]:
    """(has a mask, is_causal) of each SDPA in the graph torch.export traces (as the aot-inductor backend does)."""
    from torch.export import Dim

    with torch.no_grad():
        exported = torch.export.export(LogitsOnly(model), (x,), dynamic_shapes={"input_ids": {
            0: Dim("batch", min=1, max=4), 1: Dim("seq", min=1, max=64)}}, strict=False)
    calls = []
    for node in exported.graph.nodes:
        if node.target is SDPA:
            args = list(node.args) + [None] * (6 - len(node.args))
            mask = node.kwargs.get("attn_mask", args[3])
            causal = node.kwargs.get("is_causal", args[5])
            calls.append((mask is not None, bool(causal)))
    return calls


@pytest.mark.parametrize("family", PLAIN + MASKED)
def test_the_engines_attention_gives_transformers_logits_and_skips_the_mask_only_on_plain_layers(family,
                                                                                                tmp_path_factory):
    ckpt = family_checkpoint(tmp_path_factory, family)
    _register_causal_sdpa()
    ours, theirs = _model(ckpt, CAUSAL_SDPA), _model(ckpt, "sdpa")
    x = torch.randint(0, 2048, (2, 48), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.allclose(LogitsOnly(ours)(x), LogitsOnly(theirs)(x), atol=1e-5, rtol=0)
    calls = _sdpa_calls(ours, x)
    layers = ours.config.num_hidden_layers
    assert len(calls) == layers
    if family in PLAIN:  # no mask built or read: SDPA skips the upper triangle
        assert calls == [(False, True)] * layers
    else:  # sliding-window and soft-capped layers keep their mask; Gemma 3's full layer does not need one
        assert any(has_mask for has_mask, _ in calls)
        assert all(has_mask != causal for has_mask, causal in calls)
    # what transformers' own SDPA path exports: a mask on every layer (it cannot rule out padding while traced)
    assert all(has_mask for has_mask, _ in _sdpa_calls(theirs, x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_engine_returns_transformers_logits_in_the_dtype_it_computes_in(dtype, tmp_path_factory):
    """The export surface widens nothing: a bf16 model's logits come out in bf16 (what transformers returns and
    what a runtime serves), not as a float32 copy twice the size of the engine's largest tensor."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(family_checkpoint(tmp_path_factory, "llama"), dtype=dtype).eval()
    x = torch.randint(0, 2048, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out, theirs = LogitsOnly(model)(x), model(input_ids=x, use_cache=False).logits
    assert out.dtype == dtype and torch.equal(out, theirs)


def _trig_nodes(model, x: torch.Tensor) -> int:
    from torch.export import Dim

    with torch.no_grad():
        exported = torch.export.export(LogitsOnly(model), (x,), dynamic_shapes={"input_ids": {
            0: Dim("batch", min=1, max=4), 1: Dim("seq", min=1, max=64)}}, strict=False)
    return sum(1 for n in exported.graph.nodes if n.target in (torch.ops.aten.cos.default, torch.ops.aten.sin.default))


@pytest.mark.parametrize("family", PLAIN + MASKED)
def test_a_tabulated_rotary_embedding_gives_the_same_logits_and_leaves_no_trigonometry_in_the_engine(
        family, tmp_path_factory):
    """The engine looks its cos/sin up by position instead of recomputing them in every layer's kernel: the same
    logits as transformers' own computation, to the bit, for every family (Gemma 3's local and global layers each
    get their own table), and no sin or cos left in the exported graph."""
    ckpt = family_checkpoint(tmp_path_factory, family)
    model, untouched = _model(ckpt, "sdpa"), _model(ckpt, "sdpa")
    x = torch.randint(0, 2048, (2, 48), generator=torch.Generator().manual_seed(5))
    assert _trig_nodes(untouched, x) > 0  # the premise: traced as written, the engine computes them
    done = tabulate_rotary(model, 64)
    assert done.startswith("cos/sin tabulated for positions < 64"), done
    assert ("(2 tables)" in done) == (family == "gemma3")
    with torch.no_grad():
        assert torch.equal(LogitsOnly(model)(x), LogitsOnly(untouched)(x))
        assert torch.equal(LogitsOnly(model)(x[:, :7]), LogitsOnly(untouched)(x[:, :7]))
    assert _trig_nodes(model, x) == 0


def test_a_rotary_embedding_whose_frequencies_follow_the_sequence_is_left_as_it_is(tmp_path_factory):
    model = _model(family_checkpoint(tmp_path_factory, "llama"), "sdpa")
    model.model.rotary_emb.rope_type = "dynamic"
    assert tabulate_rotary(model, 64).startswith("computed in every forward")
    assert not any(name.startswith("kiln_") for name, _ in model.named_buffers(recurse=True)
                   if "rotary" in name)


# -- activation emulation: one quantize-dequantize per shared input ------------------------------------
def _qdq_count(model, x: torch.Tensor) -> int:
    """FP8 quantize-dequantizes in the graph torch.export traces: each clamps to ±448 once."""
    from torch.export import Dim

    with torch.no_grad():
        exported = torch.export.export(LogitsOnly(model), (x,), dynamic_shapes={"input_ids": {
            0: Dim("batch", min=1, max=4), 1: Dim("seq", min=1, max=64)}}, strict=False)
    return sum(1 for n in exported.graph.nodes if n.target is torch.ops.aten.clamp.default
               and tuple(n.args[1:3]) == (-448.0, 448.0))


def test_linears_sharing_an_input_share_its_quantize_dequantize(fp8_export):
    """q, k and v read one tensor at one exported input_scale, as do gate and up: the engine quantizes it once per
    group (4 per layer, not 7), with exactly the logits of quantizing it before each linear."""
    from kiln.hfmodel import load_engine_model
    from kiln.precisions import fake_quant_fp8

    built = load_engine_model(fp8_export / "hf")
    layers = built.model.config.num_hidden_layers
    x = torch.randint(0, built.model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    scales = built.checkpoint.input_scales
    assert scales["model.layers.0.self_attn.q_proj"] == scales["model.layers.0.self_attn.v_proj"]  # the premise
    assert _qdq_count(built.model, x) == 4 * layers

    each = load_engine_model(fp8_export / "hf").model  # every linear quantizing its own input
    for module in each.modules():
        module._forward_pre_hooks.clear()
        module._forward_hooks.clear()
    modules = dict(each.named_modules())
    for name, scale in scales.items():
        modules[name].register_forward_pre_hook(lambda _, args, s=scale: (fake_quant_fp8(args[0], s), *args[1:]))
    assert _qdq_count(each, x) == 7 * layers
    with torch.no_grad():
        assert torch.equal(LogitsOnly(built.model)(x), LogitsOnly(each)(x))
    # and nothing is held after a forward (the last activation and its quantized copy would stay alive)
    shared = [h.__self__ for h in built.model._forward_hooks.values() if isinstance(getattr(h, "__self__", None), _SharedInput)]
    assert shared and all(s.last is None for s in shared)

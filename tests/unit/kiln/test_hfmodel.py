"""kiln/hfmodel.py's attention for exported engines: ``is_causal`` SDPA on a plain causal layer, transformers' own
masked SDPA on every other, with the same logits as transformers' SDPA path for every kind of layer the families
have (GQA, sliding windows shorter than the input, soft-capping, Gemma 3's mix of sliding and full layers)."""

from __future__ import annotations

import pytest
import torch

from kiln.hfmodel import CAUSAL_SDPA, LogitsOnly, _register_causal_sdpa
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

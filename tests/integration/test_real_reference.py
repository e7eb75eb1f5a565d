"""An independent check of Kiln's reference on both real models: the reference perplexity Kiln computes on its
windows (validation/reference.py: the checkpoint's tokenizer conventions, stored hidden states, its LM head) equals
the perplexity transformers alone gives on the same windows — each window as the checkpoint's tokenizer starts a
text, its BOS included where it adds one, scored on the text's tokens only — within 0.5 %. The yardstick is
written here without Kiln's code (not lm-eval's ``loglikelihood_rolling``, which puts a BOS before the first window
only). Gemma 3 is trained with ``<bos>`` first: without it its perplexity is several times higher, so a Kiln that
dropped the BOS would fail the check."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from kiln.datasets import load_text
from kiln.spec import parse_spec
from tests.realmodels import gemma3, smollm2

pytestmark = [pytest.mark.slow, pytest.mark.realmodel]

MAX_TOKENS = 1024  # 8 windows of 128, 2 of 512: the check is exact per window, a few suffice


def independent_perplexity(ckpt: Path, text: str, seq_len: int, dtype: torch.dtype, *, bos: bool = True) -> float:
    """transformers alone, in ``dtype``: the text's tokens, cut into stretches; each window the tokenizer's own prefix
    (what it puts before a text) then a stretch; the model's NLL of the stretch's tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype).eval()
    raw = tokenizer(text, add_special_tokens=False)["input_ids"][: MAX_TOKENS + 1]
    with_special = tokenizer("x")["input_ids"]
    prefix = with_special[: with_special.index(tokenizer("x", add_special_tokens=False)["input_ids"][0])] if bos else []
    step = seq_len + 1 - len(prefix)
    nll, count = 0.0, 0
    for i in range(len(raw) // step if prefix else (len(raw) - 1) // seq_len):
        window = prefix + (raw[i * step : (i + 1) * step] if prefix else raw[i * seq_len : i * seq_len + seq_len + 1])
        x = torch.tensor([window])
        with torch.no_grad():
            logp = torch.log_softmax(model(x[:, :-1]).logits.float(), -1)[0]
        nll -= logp[len(prefix) - 1 if prefix else 0 :].gather(-1, x[0, max(1, len(prefix)) :, None]).double().sum().item()
        count += len(window) - max(1, len(prefix))
    return math.exp(nll / count)


def kiln_reference_perplexities(ckpt: Path, text: str, dtype: torch.dtype) -> dict[int, float]:
    """Kiln's reference perplexity at each window length, from its stored reference (hidden states → its head),
    computed in ``dtype`` as a build on this CPU computes it."""
    from validation.accuracy import accuracy_at_lengths
    from validation.reference import compute_reference
    from validation.runners import open_reference
    from validation.validate import eval_tokens

    spec = parse_spec({"checkpoint": str(ckpt), "precision": "fp8", "evaluation": {"max_tokens": MAX_TOKENS},
                       "override_reason": "a test: a shorter evaluation"},
                      [ckpt.parent])
    runner = open_reference(ckpt, dtype)
    reference = compute_reference(runner, ckpt, text, spec)
    evaluation = eval_tokens(ckpt, text, spec)
    m = accuracy_at_lengths(runner, reference.sets, evaluation.ids, evaluation.lengths, [4, 1][: len(evaluation.lengths)],
                            convention=evaluation.convention)
    assert m["mean_kl"] < 1e-3  # the runner against its own stored hidden states (bf16 logits vs a float32 head)
    return {m["seq_len"]: m["reference_perplexity"],
            **{x["seq_len"]: x["reference_perplexity"] for x in m["long_windows"]}}


@pytest.fixture(scope="module")
def heldout() -> str:
    return load_text("kiln:heldout", field="evaluation.dataset", roots=[])[0]


@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
def test_kilns_reference_perplexity_is_transformers_own_on_the_same_windows(model, heldout):
    import json

    from validation.runners import reference_dtype

    ckpt = {"smollm2-135m": smollm2, "gemma3-270m": gemma3}[model]()
    dtype = reference_dtype(json.loads((ckpt / "config.json").read_text()))  # bf16 where this CPU has bf16 units
    kiln = kiln_reference_perplexities(ckpt, heldout, dtype)
    assert sorted(kiln) == [128, 512]
    for seq_len, ppl in kiln.items():
        theirs = independent_perplexity(ckpt, heldout, seq_len, dtype)
        assert abs(ppl / theirs - 1) < 0.005, (model, seq_len, ppl, theirs, dtype)
    if model == "gemma3-270m":  # the convention matters: without its BOS Gemma is another model
        assert independent_perplexity(ckpt, heldout, 128, dtype, bos=False) > 3 * kiln[128]
        assert kiln[128] < 25  # a trained model on English prose (measured: 17)

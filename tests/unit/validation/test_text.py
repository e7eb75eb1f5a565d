"""The text conventions calibration and evaluation follow (validation/text.py): what the checkpoint's tokenizer
puts before a text is first in every window and never scored."""

from __future__ import annotations

import pytest
import torch
from tokenizers import processors
from transformers import AutoTokenizer

from tests.conftest import REPO
from validation.text import Convention, calibration_rows, convention_of, cut, stream, window_count

TINY = REPO / "examples" / "tiny-llama"


@pytest.fixture(scope="module")
def plain():
    return AutoTokenizer.from_pretrained(TINY)


@pytest.fixture(scope="module")
def with_bos():
    """The tiny model's tokenizer made to put its BOS (<s>, id 0) before every text, as Gemma's and Llama 3's do."""
    tok = AutoTokenizer.from_pretrained(TINY)
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.bos_token_id)])
    return tok


def test_the_convention_is_read_from_the_tokenizer(plain, with_bos):
    assert convention_of(plain) == Convention()
    assert convention_of(with_bos) == Convention((0,))
    record = convention_of(with_bos).as_dict(with_bos)
    assert record["prefix"] == [0] and record["prefix_tokens"] == ["<s>"] and record["chat_template"] is False


def test_the_stream_never_holds_the_special_tokens(with_bos):
    ids = stream(with_bos, "hello world")
    assert ids.tolist() == with_bos("hello world", add_special_tokens=False)["input_ids"] and 0 not in ids.tolist()


def test_windows_with_a_prefix_start_with_it_and_score_every_text_token_once():
    ids = torch.arange(10, 40)
    w = cut(ids, 8, Convention((0,)))
    assert w.shape == (3, 9) and (w[:, 0] == 0).all()
    targets = w[:, 1:].flatten().tolist()  # every target is a text token, each once, in order
    assert targets == list(range(10, 34))
    assert window_count(30, 8, Convention((0,))) == 3


def test_windows_without_a_prefix_share_one_token_and_score_every_text_token_once():
    ids = torch.arange(10, 40)
    w = cut(ids, 8, Convention())
    assert w.shape == (3, 9) and w[1, 0] == w[0, -1]
    assert w[:, 1:].flatten().tolist() == list(range(11, 35))


def test_calibration_rows_start_as_the_model_sees_a_text():
    rows = calibration_rows(torch.arange(10, 40), 3, 8, Convention((0,)))
    assert rows.shape == (3, 8) and (rows[:, 0] == 0).all() and rows[:, 1:].flatten().tolist() == list(range(10, 31))
    assert calibration_rows(torch.arange(10, 40), 3, 8, Convention()).shape == (3, 8)
    with pytest.raises(ValueError):
        calibration_rows(torch.arange(10, 20), 3, 8, Convention((0,)))


def test_the_prefix_is_conditioned_on_and_not_scored(with_bos):
    """A window's first target is the text's first token, predicted from the BOS; the BOS itself is never a target,
    so the scored token count is the text's."""
    from validation.accuracy import accuracy

    class Echo:  # a runner whose logits put all mass on the input token: KL 0, agreement 1
        def logits(self, x):
            return torch.nn.functional.one_hot(x, 64).float() * 10

    ids = torch.arange(1, 60) % 50 + 2
    m = accuracy(Echo(), Echo(), ids, 8, 4, convention=Convention((0,)))
    assert m["tokens"] == m["windows"] * 8 and m["mean_kl"] == pytest.approx(0.0, abs=1e-9)
    assert m["positions"] == [0, 7]

"""Text as the checkpoint's own tokenizer gives it to the model: the conventions calibration and evaluation follow.

A runtime (vLLM, TensorRT-LLM, SGLang, lm-eval's HF model) encodes a prompt with the tokenizer's special tokens:
a tokenizer that puts ``<bos>`` before a text (Gemma, Llama 3) has its model see it first, always. A window of
held-out text evaluated without it is a regime the model never runs in (Gemma 3 270M: perplexity 107 without its
BOS, 16.5 with it), so Kiln reads the convention from the tokenizer instead of assuming one:

- :func:`convention_of` asks the tokenizer what it puts before a text (``prefix``: the BOS where it adds one,
  nothing where it adds none, as SmolLM2's does not) and after it (``suffix``, never used inside a window);
- :func:`stream` is the text's tokens without them, documents already joined by the dataset (kiln/datasets.py:
  a blank line between a ``.jsonl``'s documents), no chat template (a task that wants one asks for it);
- :func:`cut` makes windows of ``seq_len`` model inputs: the prefix, then the next stretch of the stream. The
  prefix is conditioned on and never scored: every scored target is a text token, each scored once per length.

:data:`RULE` names these rules; it enters the keys of the calibration and of the reference (kiln/keys.py's
recipe version), and the report records the convention a build used (``conditions.accuracy.text``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

RULE = "tokenizer-special-tokens/1"
PROBE = "Kiln reads what the tokenizer adds around a text."


@dataclass(frozen=True)
class Convention:
    prefix: tuple[int, ...] = ()  # what the tokenizer puts before a text: first in every window, never scored
    suffix: tuple[int, ...] = ()  # what it puts after one (an EOS some tokenizers add): not used in a window

    @property
    def skip(self) -> int:
        """Targets at the start of a window that are prefix tokens (a prefix of n tokens: n − 1), not scored."""
        return max(0, len(self.prefix) - 1)

    def as_dict(self, tokenizer=None) -> dict:
        out: dict = {"rule": RULE, "prefix": list(self.prefix), "suffix": list(self.suffix),
                     "documents": "joined by a blank line", "chat_template": False}
        if tokenizer is not None:
            out["prefix_tokens"] = tokenizer.convert_ids_to_tokens(list(self.prefix))
        return out


def convention_of(tokenizer) -> Convention:
    """What ``tokenizer`` adds around a text when asked for its special tokens (as every runtime asks)."""
    plain = tokenizer(PROBE, add_special_tokens=False)["input_ids"]
    full = tokenizer(PROBE, add_special_tokens=True)["input_ids"]
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return Convention(tuple(full[:start]), tuple(full[start + len(plain):]))
    # a tokenizer whose special tokens change the text's own tokens: keep only a leading BOS it adds
    bos = tokenizer.bos_token_id
    return Convention((bos,) if bos is not None and full[:1] == [bos] and plain[:1] != [bos] else ())


def load_tokenizer(tokenizer_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def stream(tokenizer, text: str) -> torch.Tensor:
    """The text's tokens, without the special tokens the tokenizer adds around a text."""
    return torch.as_tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)


def text_tokens_per_window(seq_len: int, convention: Convention) -> int:
    """How much of the stream one window of ``seq_len`` model inputs (plus its last target) takes."""
    return seq_len + 1 - len(convention.prefix)


def window_count(tokens: int, seq_len: int, convention: Convention) -> int:
    if convention.prefix:
        return tokens // text_tokens_per_window(seq_len, convention)
    return max(0, (tokens - 1) // seq_len)


def cut(ids: torch.Tensor, seq_len: int, convention: Convention) -> torch.Tensor:
    """Windows of ``seq_len + 1`` tokens (``w[:, :-1]`` the model's input, ``w[:, 1:]`` its targets). With a
    prefix, each is the prefix then the next ``seq_len + 1 − len(prefix)`` text tokens (the stretches do not
    overlap); without one, consecutive windows share one token (the last target of one is the first input of the
    next), as every text token is scored once."""
    n = window_count(len(ids), seq_len, convention)
    if convention.prefix:
        step = text_tokens_per_window(seq_len, convention)
        head = torch.as_tensor(convention.prefix, dtype=ids.dtype)
        return torch.stack([torch.cat([head, ids[i * step : (i + 1) * step]]) for i in range(n)])
    return torch.stack([ids[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)])


def calibration_rows(ids: torch.Tensor, samples: int, seq_len: int, convention: Convention) -> torch.Tensor:
    """``samples`` model inputs of ``seq_len`` tokens for calibration, each starting with the prefix (the
    activations a runtime's model sees, BOS included); ValueError when the text is too short."""
    step = seq_len - len(convention.prefix)
    need = samples * step
    if len(ids) < need:
        raise ValueError(f"{len(ids)} tokens, {samples}×{step} = {need} needed")
    rows = ids[:need].view(samples, step)
    if not convention.prefix:
        return rows
    return torch.cat([torch.as_tensor(convention.prefix, dtype=ids.dtype).expand(samples, -1), rows], 1)

"""Accuracy against a stored reference, evaluated sequentially (validation/accuracy.py), on the shipped tiny Llama
and its real FP8 export."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from kiln.datasets import load_text
from validation import stats
from validation.accuracy import ReferenceWindows, accuracy, plan_looks, reference_windows, windows
from validation.runners import CheckpointRunner, LogitsHead, TransformersRunner

TINY = Path(__file__).resolve().parents[3] / "examples" / "tiny-llama"
SEQ = 128


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    from transformers import AutoTokenizer

    text, _ = load_text("kiln:heldout", field="evaluation.dataset", roots=[])
    tok = AutoTokenizer.from_pretrained(TINY)
    return tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"][0][: 64 * SEQ + 1]


@pytest.fixture(scope="module")
def reference() -> TransformersRunner:
    return TransformersRunner(TINY)


@pytest.fixture(scope="module")
def stored(reference, ids) -> ReferenceWindows:
    return reference_windows(reference, ids, SEQ, 8)


class Shifted:
    """The reference with its logits pushed towards a fixed random direction: a controllable, real degradation."""

    device, kv_cache = "cpu", False

    def __init__(self, runner, strength: float):
        self.runner, self.strength = runner, strength
        self.noise = torch.randn(2048, generator=torch.Generator().manual_seed(0))

    def logits(self, x):
        out = self.runner.logits(x)
        return out + self.strength * self.noise * out.std()


def test_the_stored_reference_round_trips_and_gives_the_reference_exactly(stored, reference, ids, tmp_path):
    stored.save(tmp_path / "ref")
    again = ReferenceWindows.load(tmp_path / "ref", LogitsHead.load(TINY))  # the head read from safetensors alone
    assert len(again) == len(windows(ids, SEQ)) == 64 and again.seq_len == SEQ
    assert np.array_equal(np.asarray(again.hidden), stored.hidden)
    w = windows(ids, SEQ)
    assert torch.equal(again.logits([5, 2]), reference.logits(w[[5, 2], :-1]))  # exact logits, every token
    engine = Shifted(reference, 0.02)
    a = accuracy(engine, again, ids, SEQ, 8, sequential=False)
    b = accuracy(engine, reference, ids, SEQ, 8, sequential=False)
    for key in ("perplexity", "reference_perplexity", "ppl_increase_pct", "top1_agreement", "mean_kl"):
        assert a[key] == b[key], key


def test_the_kl_is_over_the_whole_vocabulary(stored, reference, ids, fp8_export):
    engine = CheckpointRunner(fp8_export / "hf")
    w = windows(ids, SEQ)[:16]
    lr = F.log_softmax(reference.logits(w[:, :-1]).double(), -1)
    le = F.log_softmax(engine.logits(w[:, :-1]).double(), -1)
    full = float((lr.exp() * (lr - le)).sum(-1).mean())
    short = ReferenceWindows(SEQ, stored.hidden[:16], stored.head)
    assert accuracy(engine, short, ids[: 16 * SEQ + 1], SEQ, 8, sequential=False)["mean_kl"] == pytest.approx(full, rel=1e-5)


def test_a_clean_engine_is_decided_at_the_first_look(stored, reference, ids):
    gates = {"max_ppl_increase_pct": 3.0, "max_mean_kl": 0.05, "min_top1_agreement": 0.85}
    m = accuracy(Shifted(reference, 0.0), stored, ids, SEQ, 8, gates)
    seq = m["sequential"]
    assert seq["stopped_early"] and seq["windows"] == seq["looks"][0] < 64
    assert set(seq["decisions"].values()) == {stats.PASS}
    assert m["tokens"] == seq["windows"] * SEQ
    assert m["per_window"]["index"] == stats.fixed_order(64)[: seq["windows"]]  # random but fixed order


def test_a_damaged_engine_fails_early_too(stored, reference, ids):
    gates = {"max_ppl_increase_pct": 3.0, "max_mean_kl": 0.05, "min_top1_agreement": 0.85}
    m = accuracy(Shifted(reference, 0.5), stored, ids, SEQ, 8, gates)
    assert m["sequential"]["stopped_early"] and stats.FAIL in m["sequential"]["decisions"].values()


def test_an_engine_at_the_threshold_is_evaluated_in_full_and_left_undecided(stored, reference, ids):
    engine = Shifted(reference, 0.05)
    full = accuracy(engine, stored, ids, SEQ, 8, sequential=False)
    gate = {"max_ppl_increase_pct": full["ppl_increase_pct"]}  # the threshold at the engine's own value
    m = accuracy(engine, stored, ids, SEQ, 8, gate)
    assert m["sequential"]["windows"] == 64 and not m["sequential"]["stopped_early"]
    assert m["sequential"]["decisions"] == {"max_ppl_increase_pct": stats.UNDECIDED}
    iv = m["intervals"]["ppl_increase_pct"]
    assert iv["low"] < gate["max_ppl_increase_pct"] < iv["high"]


def test_without_gates_every_window_is_evaluated_at_95_percent(stored, reference, ids):
    m = accuracy(Shifted(reference, 0.02), stored, ids, SEQ, 8)
    assert m["sequential"]["windows"] == 64 and m["sequential"]["confidence_per_look"] == pytest.approx(0.95)
    assert m["mde"]["ppl_increase_pct"]["windows"] == 64 and m["mde"]["ppl_increase_pct"]["paired"] > 0


def test_the_looks_start_at_an_eighth_and_at_16_windows_and_are_at_most_seven():
    assert plan_looks(128, 16) == [16, 35, 54, 73, 92, 111, 128]
    assert plan_looks(512, 16) == [64, 139, 214, 289, 364, 439, 512]
    assert plan_looks(64, 8) == [16, 24, 32, 40, 48, 56, 64]
    assert plan_looks(10, 8) == [10]


def test_a_reference_of_another_text_is_refused(stored, reference, ids):
    with pytest.raises(ValueError, match="windows"):
        accuracy(reference, stored, ids[: 32 * SEQ + 1], SEQ, 8)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2", "phi3"])
def test_every_familys_head_recomputes_its_logits_from_the_stored_hidden_states(family, tmp_path_factory):
    """Tied (llama) and untied heads, Gemma 2's final soft-capping, Phi-3's fused layers; sharded bf16 checkpoints."""
    from tests.families import family_checkpoint

    ckpt = family_checkpoint(tmp_path_factory, family)
    runner = TransformersRunner(ckpt)
    x = torch.randint(0, 2048, (2, 24), generator=torch.Generator().manual_seed(1))
    hidden, logits = runner.hidden_and_logits(x)
    assert torch.allclose(LogitsHead.load(ckpt)(hidden), logits, atol=1e-5, rtol=0)
    assert torch.equal(runner.head()(hidden), logits)
    assert torch.equal(runner.hidden(x), hidden)  # the decoder alone gives the head's input, for every family


@pytest.mark.parametrize("ckpt_dtype,cpu,expected", [
    ("bfloat16", "x86_64-AVX512+avx512_vnni+bf16", torch.bfloat16),  # native bf16 units: served dtype, ~2x faster
    ("bfloat16", "x86_64-AVX2", torch.float32),  # none: bf16 would be the slower choice
    ("float32", "x86_64-AVX512+bf16", torch.float32),
    ("float16", "x86_64-AVX512+bf16", torch.float32),
])
def test_the_reference_computes_in_bf16_only_for_a_bf16_checkpoint_on_a_cpu_with_bf16_units(ckpt_dtype, cpu, expected):
    from validation.runners import reference_dtype

    assert reference_dtype({"torch_dtype": ckpt_dtype}, cpu) is expected
    assert reference_dtype({"dtype": ckpt_dtype}, cpu) is expected


def test_a_bf16_head_on_bf16_hidden_states_keeps_float32_logits_and_anything_else_is_plain_float32():
    """The head's fast path (bf16 units, float32 accumulation and result) is taken only where converting the
    operands to bf16 loses nothing: its logits match a float64 product as closely as float32's do — nowhere near
    bf16-rounded logits — and any other operand gets exactly the plain float32 product."""
    from validation.runners import _bf16_units

    torch.manual_seed(0)
    weight = torch.randn(4096, 256).bfloat16()
    head = LogitsHead(weight)
    hidden = (torch.randn(64, 256) * 3).bfloat16().float()  # a bf16 reference's hidden states
    exact = torch.nn.functional.linear(hidden.double(), weight.double())
    got = head(hidden)
    assert got.dtype == torch.float32
    float32_error = (torch.nn.functional.linear(hidden, weight.float()).double() - exact).abs().max()
    bf16_rounding = (exact.bfloat16().double() - exact).abs().max()
    assert (got.double() - exact).abs().max() <= max(4 * float32_error, 1e-4) < bf16_rounding / 50
    assert head._bf16_operands == _bf16_units()  # the head's own tensors qualify wherever the units exist
    assert torch.backends.mkldnn.matmul.fp32_precision != "bf16"  # the setting does not outlive the call
    other = torch.randn(64, 256)  # float32 values with bits below bf16's: plain float32, bit for bit
    assert torch.equal(head(other), torch.nn.functional.linear(other, weight.float()))
    full = LogitsHead(torch.randn(4096, 256))  # a float32 head: never the fast path
    assert not full._bf16_operands
    assert torch.equal(full(hidden), torch.nn.functional.linear(hidden, full.weight))


def test_window_sums_are_the_same_in_chunks_of_positions(monkeypatch):
    """A large vocabulary's windows are summed a few positions at a time (bounded copies): the same sums."""
    from validation import accuracy as acc

    g = torch.Generator().manual_seed(0)
    le, lr = torch.randn(3, 40, 97, generator=g), torch.randn(3, 40, 97, generator=g)
    y = torch.randint(0, 97, (3, 40), generator=g)
    whole = acc._window_sums(le, lr, y, skip=1)
    monkeypatch.setattr(acc, "LOGITS_BUDGET", 4 * 3 * 97 * 7)  # 7 positions a pass
    chunked = acc._window_sums(le, lr, y, skip=1)
    for k in whole:
        assert torch.allclose(whole[k], chunked[k], rtol=1e-9, atol=1e-9), k

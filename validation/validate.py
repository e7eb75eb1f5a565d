"""Stage 4, validate: measure the artifact as a deployer loads it and decide with gates."""

from __future__ import annotations

from pathlib import Path

import torch

from kiln.errors import SpecError
from kiln.spec import BuildSpec
from validation.gates import evaluate
from validation.measure import accuracy, conditions, throughput
from validation.runners import Runner


def eval_tokens(tokenizer_dir: Path, text: str, spec: BuildSpec) -> tuple[torch.Tensor, int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
    seq = min(spec.evaluation.seq_len, spec.batch_profile.max_seq_len)
    ids = ids[: spec.evaluation.max_tokens + 1]
    if len(ids) < seq + 1:
        raise SpecError(f"the evaluation text has {len(ids)} tokens, at least {seq + 1} needed",
                        field="evaluation.dataset", fix="give a longer held-out text")
    return ids, seq


def validate(engine: Runner, reference: Runner, tokenizer_dir: Path, eval_text: str, spec: BuildSpec,
             gates: dict[str, float], vocab: int) -> dict:
    ids, seq = eval_tokens(tokenizer_dir, eval_text, spec)
    batch = min(spec.batch_profile.max_batch_size, 16)
    metrics = accuracy(engine, reference, ids, seq, batch)
    metrics["throughput"] = throughput(engine, spec.batch_profile, vocab)
    verdicts = evaluate(metrics, gates)
    return {"passed": all(v["passed"] for v in verdicts), "metrics": metrics, "gates": verdicts,
            "conditions": {**conditions(engine), "eval_batch": batch}}

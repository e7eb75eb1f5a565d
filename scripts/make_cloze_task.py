"""Make ``examples/tasks/heldout-cloze.jsonl``: next-word cloze items from Kiln's held-out text (kiln/data/heldout.txt).

Each item is a passage of 30–60 words of the text's prose (headings, tables, grammar rules and code left out) that
stops mid-sentence, and four choices for the next word: the true one and three distractor words from the same text
of about the same frequency and length (never the answer, in any case). The answer's position is random; every
draw comes from one seeded generator, so the file is the same on every run:

    python scripts/make_cloze_task.py            # writes examples/tasks/heldout-cloze.jsonl
    python scripts/make_cloze_task.py --check    # exits 1 if the shipped file differs from what it would write
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SOURCE = REPO / "kiln" / "data" / "heldout.txt"
OUT = REPO / "examples" / "tasks" / "heldout-cloze.jsonl"
WORD = re.compile(r"[A-Za-z]{3,}")  # an answer or distractor: letters only, at least three


def prose_words(text: str) -> list[str]:
    """Words of the text's prose paragraphs, in order (a paragraph: lines between blank lines, none of them a
    heading underline, a table row, a grammar rule, code or an indented block)."""
    words = []
    for para in re.split(r"\n\s*\n", text):
        lines = para.strip("\n").splitlines()
        if not lines or any(ln[:1] in " \t+|*=-" or "::=" in ln or ">>>" in ln for ln in lines):
            continue
        w = " ".join(lines).split()
        if len(w) >= 12 and w[-1][-1:] in ".:":
            words += w
    return words


def make_items(text: str, n: int = 200, seed: int = 20260101) -> list[dict]:
    rng = random.Random(seed)
    words = prose_words(text)
    counts = Counter(w for w in words if WORD.fullmatch(w))
    vocab = sorted(counts)

    def similar(answer: str) -> list[str]:
        band = math.log2(counts[answer])
        return [w for w in vocab if w.lower() != answer.lower() and abs(len(w) - len(answer)) <= 2
                and abs(math.log2(counts[w]) - band) <= 1.0 and w[0].isupper() == answer[0].isupper()]

    items, pos = [], 60
    stride = max(1, (len(words) - 60) // n)
    while len(items) < n and pos < len(words):
        t = pos
        # the next word to guess: a plain word, mid-sentence, with enough look-alikes to draw distractors from
        while t < len(words) and not (WORD.fullmatch(words[t]) and words[t - 1][-1:] not in ".:!?"
                                      and len(similar(words[t])) >= 3):
            t += 1
        if t >= len(words):
            break
        start = t - rng.randint(30, 60)
        choices = rng.sample(similar(words[t]), 3)
        answer = rng.randrange(4)
        choices.insert(answer, words[t])
        items.append({"id": f"heldout-{t}", "context": " ".join(words[start:t]), "choices": choices, "answer": answer})
        pos = max(t + 1, pos + stride)
    return items


def render(items: list[dict]) -> str:
    return "".join(json.dumps(item, ensure_ascii=False) + "\n" for item in items)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare with the shipped file instead of writing it")
    args = ap.parse_args(argv)
    text = render(make_items(SOURCE.read_text(encoding="utf-8")))
    if args.check:
        same = OUT.is_file() and OUT.read_text(encoding="utf-8") == text
        print(f"{OUT.relative_to(REPO)} {'is up to date' if same else 'differs from what this script writes'}")
        return 0 if same else 1
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {text.count(chr(10))} items to {OUT.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

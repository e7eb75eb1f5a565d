"""README's sample of `kiln build` output, from a real run.

    python scripts/readme_sample.py          # runs README's first command in a fresh KILN_HOME, rewrites the sample
    python scripts/readme_sample.py --check  # exits 1 when the sample's shape differs from what the CLI prints now

The sample sits between the markers ``<!-- readme-sample: begin -->`` and ``<!-- readme-sample: end -->``. It is the
command's output as a CI log shows it (stderr and stdout in order, no terminal), without the heartbeat lines a slow
machine adds. tests/integration/test_cli_build.py renders the quick-start build's own result the way the CLI does
and compares its shape with the sample (numbers and digests masked: they change from run to run), so a change of
what the CLI prints fails there until this script is run again."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
COMMAND = ["kiln", "build", "examples/tiny-llama", "--precision", "fp8", "--profile", "latency"]
BEGIN, END = "<!-- readme-sample: begin -->", "<!-- readme-sample: end -->"
_NUMBER = re.compile(r"sha256:[0-9a-f]+…?|[+-]?\d[\d,]*(\.\d+)?(e[+-]?\d+)?")


def mask(line: str) -> str:
    """The line's shape: every number and digest one ``#``, runs of spaces one space (widths follow the numbers)."""
    return re.sub(r" +", " ", _NUMBER.sub("#", line)).rstrip()


def sample(text: str = "") -> list[str]:
    """The sample's lines (after the ``$ command`` line) in README's text."""
    text = text or README.read_text()
    block = text.split(BEGIN, 1)[1].split(END, 1)[0]
    lines = block.strip().splitlines()
    body = [line for line in lines if not line.startswith("```")]
    return body[1:]  # the first is "$ kiln build …"


def run() -> list[str]:
    """README's first command in a fresh KILN_HOME, its output as a CI log shows it."""
    with tempfile.TemporaryDirectory(prefix="kiln-readme-") as home:
        env = {**os.environ, "KILN_HOME": home}
        proc = subprocess.run([sys.executable, "-m", "api.cli", *COMMAND[1:]], cwd=REPO, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"readme_sample: the build exited {proc.returncode}:\n{proc.stdout[-3000:]}")
    from api.progress import HEARTBEAT_LINE  # present only on slow runs: not part of the sample

    return [line for line in proc.stdout.splitlines() if not HEARTBEAT_LINE.match(line)]


def write(lines: list[str]) -> None:
    text = README.read_text()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    block = "\n".join(["```", "$ " + " ".join(COMMAND), *lines, "```"])
    README.write_text(f"{head}{BEGIN}\n{block}\n{END}{tail}")


def main() -> int:
    if "--check" in sys.argv[1:]:
        got, have = [mask(x) for x in run()], [mask(x) for x in sample()]
        if got != have:
            print("readme_sample: README's sample is stale; run python scripts/readme_sample.py", file=sys.stderr)
            return 1
        return 0
    write(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())

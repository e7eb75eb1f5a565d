"""Worker capabilities: GPU detection through NVML and the queue names derived from backend, SM, tensor-parallel
size and (for trtllm-engine) the TensorRT-LLM / TensorRT versions.

"Without NVML" is this machine (no NVIDIA driver). "With NVML" uses FakeNVML below: a STAND-IN for the
``pynvml`` module, injected into ``sys.modules``, because a GPU cannot exist here. It answers the handful of NVML
calls kiln.toolchain.detect_gpus makes, the way nvidia-ml-py's pynvml answers them (names and UUIDs as str,
compute capability as a (major, minor) tuple, memory info with ``.total`` in bytes)."""

from __future__ import annotations

import os
import sys
import types

import pytest

from kiln.toolchain import detect_gpus, toolchain_for
from workers.capabilities import detect, parse_queue_name, queue_name, routing_queues, versioned_suffix

#: the backends these tests know the queues of; a backend added later has its own queues, which they leave out
THESE = ("aot-inductor", "checkpoint", "trtllm-engine")


def of_these(names: list[str]) -> list[str]:
    """The backends or queues of ``names`` that are THESE backends' (a queue is ``kiln.<backend>.<target>…``)."""
    return [n for n in names if (n.split(".")[1] if n.startswith("kiln.") else n) in THESE]

H100 = ("NVIDIA H100 80GB HBM3", (9, 0), 80 * 1024**3)
L40S = ("NVIDIA L40S", (8, 9), 48 * 1024**3)
A100 = ("NVIDIA A100-SXM4-80GB", (8, 0), 80 * 1024**3)
VERSIONS = {"tensorrt_llm": "1.2.1", "tensorrt": "10.13.3"}


def fake_nvml(devices, *, init_error: bool = False) -> types.ModuleType:
    """FAKE pynvml (see the module docstring): ``devices`` = [(name, (major, minor), total_bytes)]."""
    mod = types.ModuleType("pynvml")
    state = {"inited": False}

    class NVMLError(Exception):
        pass

    def nvmlInit():
        if init_error:
            raise NVMLError("NVML Shared Library Not Found")
        state["inited"] = True

    def nvmlShutdown():
        state["inited"] = False

    def nvmlDeviceGetCount():
        assert state["inited"]
        return len(devices)

    mod.NVMLError = NVMLError
    mod.nvmlInit, mod.nvmlShutdown, mod.nvmlDeviceGetCount = nvmlInit, nvmlShutdown, nvmlDeviceGetCount
    mod.nvmlDeviceGetHandleByIndex = lambda i: i
    mod.nvmlDeviceGetName = lambda h: devices[h][0]
    mod.nvmlDeviceGetCudaComputeCapability = lambda h: devices[h][1]
    mod.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=devices[h][2], free=devices[h][2], used=0)
    mod.nvmlDeviceGetUUID = lambda h: f"GPU-0000000{h}-aaaa-bbbb-cccc-dddddddddddd"
    mod.state = state
    return mod


@pytest.fixture
def nvml(monkeypatch):
    """Install FAKE pynvml answering for the given devices; CUDA_VISIBLE_DEVICES unset unless a test sets it."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    def install(devices, **kw):
        mod = fake_nvml(devices, **kw)
        monkeypatch.setitem(sys.modules, "pynvml", mod)
        return mod

    return install


def with_versions(backend, target):
    """toolchain_for, plus the TensorRT-LLM / TensorRT versions a GPU worker's container would report."""
    tc = toolchain_for(backend, target)
    return {**tc, **VERSIONS} if backend == "trtllm-engine" else tc


# -- queue names -----------------------------------------------------------------------------------
def test_generic_queue_names_are_what_submit_computes_today():
    assert queue_name("aot-inductor", "cpu") == "kiln.aot-inductor.cpu"
    assert queue_name("checkpoint", "sm90") == "kiln.checkpoint.sm90"
    assert queue_name("trtllm-engine", "sm90") == "kiln.trtllm-engine.sm90"


def test_versioned_and_tensor_parallel_trtllm_queue_names():
    assert queue_name("trtllm-engine", "sm90", toolchain=VERSIONS) == "kiln.trtllm-engine.sm90.trtllm-1.2.1.trt-10.13.3"
    assert queue_name("trtllm-engine", "sm100", tp_size=4) == "kiln.trtllm-engine.sm100.tp4"
    assert (queue_name("trtllm-engine", "sm100", tp_size=2, toolchain=VERSIONS)
            == "kiln.trtllm-engine.sm100.trtllm-1.2.1.trt-10.13.3.tp2")
    # other backends have neither TensorRT nor tensor parallelism
    assert queue_name("aot-inductor", "sm90", tp_size=2, toolchain=VERSIONS) == "kiln.aot-inductor.sm90"


def test_versioned_suffix_needs_both_versions_and_cleans_them():
    assert versioned_suffix(VERSIONS) == "trtllm-1.2.1.trt-10.13.3"
    assert versioned_suffix({"tensorrt_llm": "1.2.1+cu12", "tensorrt": "10.13.3.9"}) == "trtllm-1.2.1.cu12.trt-10.13.3.9"
    assert versioned_suffix({"tensorrt_llm": "1.2.1", "tensorrt": "absent"}) is None
    assert versioned_suffix({"tensorrt_llm": "1.2.1"}) is None and versioned_suffix(None) is None
    assert queue_name("trtllm-engine", "sm90", toolchain={"tensorrt_llm": "absent"}) == "kiln.trtllm-engine.sm90"


@pytest.mark.parametrize("name, parsed", [
    ("kiln.aot-inductor.cpu", {"backend": "aot-inductor", "target": "cpu", "tp_size": 1, "tensorrt_llm": None, "tensorrt": None}),
    ("kiln.trtllm-engine.sm90", {"backend": "trtllm-engine", "target": "sm90", "tp_size": 1, "tensorrt_llm": None, "tensorrt": None}),
    ("kiln.trtllm-engine.sm90.tp8", {"backend": "trtllm-engine", "target": "sm90", "tp_size": 8, "tensorrt_llm": None, "tensorrt": None}),
    ("kiln.trtllm-engine.sm100.trtllm-1.2.1.trt-10.13.3.tp2",
     {"backend": "trtllm-engine", "target": "sm100", "tp_size": 2, "tensorrt_llm": "1.2.1", "tensorrt": "10.13.3"}),
])
def test_parse_queue_name(name, parsed):
    assert parse_queue_name(name) == parsed


@pytest.mark.parametrize("name", ["celery", "other.trtllm-engine.sm90", "kiln", "kiln.trtllm-engine.sm90.tp"])
def test_parse_queue_name_rejects_foreign_names(name):
    assert parse_queue_name(name) is None


def test_parse_inverts_queue_name():
    for tp in (1, 2, 4, 8):
        for tc in (None, VERSIONS):
            p = parse_queue_name(queue_name("trtllm-engine", "sm120", tp_size=tp, toolchain=tc))
            assert p["tp_size"] == tp and p["tensorrt_llm"] == (tc or {}).get("tensorrt_llm")


ADVERTISED = [
    "kiln.aot-inductor.cpu", "kiln.trtllm-engine.sm90", "kiln.trtllm-engine.sm90.tp2",
    "kiln.trtllm-engine.sm90.trtllm-1.2.0.trt-10.13.2", "kiln.trtllm-engine.sm90.trtllm-1.2.1.trt-10.13.3",
    "kiln.trtllm-engine.sm90.trtllm-1.2.1.trt-10.13.3.tp2", "kiln.trtllm-engine.sm100.trtllm-1.2.1.trt-10.13.3",
]


def test_routing_without_a_runtime_prefers_the_newest_versioned_queue_then_the_generic_one():
    assert routing_queues("trtllm-engine", "sm90", 1, ADVERTISED) == [
        "kiln.trtllm-engine.sm90.trtllm-1.2.1.trt-10.13.3", "kiln.trtllm-engine.sm90.trtllm-1.2.0.trt-10.13.2",
        "kiln.trtllm-engine.sm90"]
    assert routing_queues("trtllm-engine", "sm90", 2, ADVERTISED) == [
        "kiln.trtllm-engine.sm90.trtllm-1.2.1.trt-10.13.3.tp2", "kiln.trtllm-engine.sm90.tp2"]
    assert routing_queues("trtllm-engine", "sm120", 1, ADVERTISED) == ["kiln.trtllm-engine.sm120"]  # waits
    assert routing_queues("aot-inductor", "cpu", 1, ADVERTISED) == ["kiln.aot-inductor.cpu"]


def test_routing_with_a_pinned_runtime_only_offers_matching_versioned_queues():
    assert routing_queues("trtllm-engine", "sm90", 1, ADVERTISED, {"tensorrt_llm": "1.2.0"}) == [
        "kiln.trtllm-engine.sm90.trtllm-1.2.0.trt-10.13.2"]
    assert routing_queues("trtllm-engine", "sm90", 1, ADVERTISED, VERSIONS) == [
        "kiln.trtllm-engine.sm90.trtllm-1.2.1.trt-10.13.3"]
    assert routing_queues("trtllm-engine", "sm90", 4, ADVERTISED, VERSIONS) == []  # no worker can: submit waits


def test_versioned_queues_are_offered_newest_first_by_number_not_by_spelling():
    def q(trtllm, trt):
        return f"kiln.trtllm-engine.sm90.trtllm-{trtllm}.trt-{trt}"

    advertised = [q("1.9.3", "10.13.3"), q("1.2.0rc1", "10.13.3"), q("1.10.0", "10.9.0"), q("1.10.0", "10.13.3"),
                  q("1.2.0", "10.13.3")]
    # 1.10 after 1.9 as numbers; a pre-release segment ranks below any released number; then TensorRT's version
    assert routing_queues("trtllm-engine", "sm90", 1, advertised) == [
        q("1.10.0", "10.13.3"), q("1.10.0", "10.9.0"), q("1.9.3", "10.13.3"), q("1.2.0", "10.13.3"),
        q("1.2.0rc1", "10.13.3"), "kiln.trtllm-engine.sm90"]


# -- detection without NVML (this machine) ---------------------------------------------------------
def test_detection_on_this_machine_without_nvidia_gpus():
    gpus = detect_gpus()
    if gpus:
        pytest.skip("this machine has NVIDIA GPUs")
    caps = detect()
    assert caps["gpus"] == [] and caps["gpu_counts"] == {} and caps["tp_sizes"] == {}
    assert of_these(caps["queues"]) == ["kiln.aot-inductor.cpu", "kiln.checkpoint.cpu"]
    assert all(q.endswith(".cpu") for q in caps["queues"])
    assert set(caps["toolchains"]) == set(caps["queues"]) and caps["trtllm"] is False
    # even told that CUDA and TensorRT-LLM were there, no GPU means no GPU queue
    told = detect(trtllm=True, cuda=True)["queues"]
    assert of_these(told) == ["kiln.aot-inductor.cpu", "kiln.checkpoint.cpu"] and all(q.endswith(".cpu") for q in told)


def test_detection_without_the_nvml_module(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
    assert detect_gpus() == []


def test_detection_when_nvml_cannot_initialise(nvml):
    nvml([H100], init_error=True)  # FAKE: the library is there, the driver is not
    assert detect_gpus() == []


# -- detection with NVML (FAKE pynvml: two H100s) -----------------------------------------------
def test_two_h100s_are_found_with_name_sm_memory_and_count(nvml):
    mod = nvml([H100, H100])
    gpus = detect_gpus()
    assert [(g["index"], g["name"], g["sm"], g["memory_bytes"]) for g in gpus] == [
        (0, "NVIDIA H100 80GB HBM3", "sm90", 80 * 1024**3), (1, "NVIDIA H100 80GB HBM3", "sm90", 80 * 1024**3)]
    assert all(g["uuid"].startswith("GPU-") for g in gpus)
    assert mod.state["inited"] is False  # NVML shut down again


def test_two_h100s_with_cuda_and_tensorrt_llm_serve_sm90_queues(nvml):
    nvml([H100, H100])
    caps = detect(cuda=True, trtllm=True, toolchain=with_versions)
    assert caps["gpu_counts"] == {"sm90": 2} and caps["tp_sizes"] == {"sm90": [1, 2]}
    assert of_these(caps["backends"]) == list(THESE) and caps["targets"] == ["cpu", "sm90"]
    assert of_these(caps["queues"]) == [
        "kiln.aot-inductor.cpu", "kiln.checkpoint.cpu", "kiln.aot-inductor.sm90", "kiln.checkpoint.sm90",
        "kiln.trtllm-engine.sm90", "kiln.trtllm-engine.sm90.trtllm-1.2.1.trt-10.13.3",
        "kiln.trtllm-engine.sm90.tp2", "kiln.trtllm-engine.sm90.trtllm-1.2.1.trt-10.13.3.tp2",
    ]
    assert not any("sm100" in q or "sm89" in q or ".tp4" in q for q in caps["queues"])
    assert set(caps["toolchains"]) == set(caps["queues"])
    tc = caps["toolchains"]["kiln.trtllm-engine.sm90.tp2"]
    assert tc["tensorrt_llm"] == "1.2.1" and tc["tensorrt"] == "10.13.3" and "cuda" in tc
    assert "tensorrt_llm" not in caps["toolchains"]["kiln.aot-inductor.sm90"]
    # what submit.py sends today is consumed by this worker
    assert queue_name("trtllm-engine", "sm90") in caps["queues"] and queue_name("aot-inductor", "sm90") in caps["queues"]


def test_gpus_without_cuda_torch_or_tensorrt_llm_serve_fewer_queues(nvml):
    nvml([H100, H100])
    assert of_these(detect(cuda=False, trtllm=True)["queues"]) == ["kiln.aot-inductor.cpu", "kiln.checkpoint.cpu"]
    no_trt = detect(cuda=True, trtllm=False)
    assert of_these(no_trt["queues"]) == ["kiln.aot-inductor.cpu", "kiln.checkpoint.cpu", "kiln.aot-inductor.sm90",
                                "kiln.checkpoint.sm90"]
    assert no_trt["trtllm"] is False and no_trt["tp_sizes"] == {}


def test_without_known_versions_only_the_generic_engine_queues_are_served(nvml):
    nvml([H100])
    caps = detect(cuda=True, trtllm=True)  # this machine's toolchain: tensorrt_llm / tensorrt "absent"
    assert [q for q in caps["queues"] if "trtllm-engine" in q] == ["kiln.trtllm-engine.sm90"]


def test_cuda_visible_devices_limits_what_is_counted(nvml, monkeypatch):
    nvml([H100, H100])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert [g["index"] for g in detect_gpus()] == [1]
    caps = detect(cuda=True, trtllm=True, toolchain=with_versions)
    assert caps["tp_sizes"] == {"sm90": [1]} and not any(q.endswith(".tp2") for q in caps["queues"])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-00000001")  # a UUID prefix, as CUDA accepts
    assert [g["index"] for g in detect_gpus()] == [1]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert detect_gpus() == []
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,7,1")  # CUDA stops at the first invalid entry
    assert [g["index"] for g in detect_gpus()] == [0]
    assert len(detect_gpus(respect_visible_devices=False)) == 2


def test_mixed_gpus_each_get_their_own_queues_and_old_ones_none(nvml):
    nvml([H100, L40S, A100])
    caps = detect(cuda=True, trtllm=True, toolchain=with_versions)
    assert caps["gpu_counts"] == {"sm89": 1, "sm90": 1}  # the A100 (sm80) builds nothing Kiln offers
    assert caps["tp_sizes"] == {"sm89": [1], "sm90": [1]}
    assert "kiln.trtllm-engine.sm89" in caps["queues"] and "kiln.trtllm-engine.sm90" in caps["queues"]
    assert not any("sm80" in q or ".tp2" in q for q in caps["queues"])
    assert [g["sm"] for g in caps["gpus"]] == ["sm90", "sm89", "sm80"]  # reported, all of them


def test_eight_gpus_serve_every_tensor_parallel_size(nvml):
    nvml([H100] * 8)
    caps = detect(cuda=True, trtllm=True)
    assert caps["tp_sizes"] == {"sm90": [1, 2, 4, 8]}
    assert [q for q in caps["queues"] if "trtllm" in q] == [
        "kiln.trtllm-engine.sm90", "kiln.trtllm-engine.sm90.tp2", "kiln.trtllm-engine.sm90.tp4",
        "kiln.trtllm-engine.sm90.tp8"]


# -- scripts/gpu_check.py on this machine (no CUDA) -------------------------------------------------------
def test_gpu_check_without_cuda_prints_one_json_object_and_exits_0(tmp_path):
    import json
    import subprocess
    from pathlib import Path

    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the check would run the whole GPU pipeline")
    repo = Path(__file__).resolve().parents[3]
    out = tmp_path / "gpu-check.json"
    proc = subprocess.run([sys.executable, str(repo / "scripts" / "gpu_check.py"), "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout[-2000:]  # library chatter went to stderr
    summary = json.loads(lines[0])
    assert summary == json.loads(out.read_text())
    assert summary["cuda"] is False and summary["gpu"] is None and summary["ok"] is True and summary["failed"] == []
    assert summary["skipped"]["trtllm"].startswith("no CUDA device")
    assert {"quantize.fp8", "quantize.nvfp4", "aot-inductor.compile.fp8", "aot-inductor.validate.nvfp4"} <= set(
        summary["skipped"])
    imports = summary["imports"]
    assert all(imports[m] == "ok" for m in ("kiln", "builder.quantize", "builder.backends.trtllm",
                                            "validation.runners", "workers.capabilities", "modelopt.torch.quantization"))
    assert summary["capabilities"]["queues"][:2] == ["kiln.aot-inductor.cpu", "kiln.checkpoint.cpu"]
    assert summary["versions"]["torch"] == torch.__version__


def test_tensorrt_llm_is_usable_only_with_its_package_and_trtllm_build(tmp_path, monkeypatch):
    """A real package directory on sys.path and a real executable on PATH (not patched lookups)."""
    from workers.capabilities import trtllm_available

    site, bindir = tmp_path / "site", tmp_path / "bin"
    (site / "tensorrt_llm").mkdir(parents=True)
    (site / "tensorrt_llm" / "__init__.py").write_text("")
    bindir.mkdir()
    (bindir / "trtllm-build").write_text("#!/bin/sh\n")
    (bindir / "trtllm-build").chmod(0o755)
    assert trtllm_available() is False  # neither here
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    assert trtllm_available() is False  # trtllm-build without the package
    monkeypatch.syspath_prepend(str(site))
    assert trtllm_available() is True
    monkeypatch.setenv("PATH", "/nonexistent")
    assert trtllm_available() is False  # the package without trtllm-build


def test_versions_as_queue_segments_and_runtime_matching():
    from workers.capabilities import _clean, _matches_runtime

    assert _clean("1.2.1+cu12") == "1.2.1.cu12" and _clean("+10.13.3~") == "10.13.3"
    parsed = {"tensorrt_llm": "1.2.1", "tensorrt": "10.13.3"}
    assert _matches_runtime(parsed, {}) and _matches_runtime(parsed, {"tensorrt_llm": "1.2.1", "tensorrt": "10.13.3"})
    assert not _matches_runtime(parsed, {"tensorrt": "10.14.0"})
    assert not _matches_runtime(parsed, {"tensorrt_llm": "1.2.0"})


def test_the_gpus_given_are_the_ones_advertised_with_each_targets_toolchain():
    gpus = [{"index": 0, "name": "NVIDIA H100 80GB HBM3", "sm": "sm90"},
            {"index": 1, "name": "NVIDIA H100 80GB HBM3", "sm": "sm90"},
            {"index": 2, "name": "Some Future GPU", "sm": "sm999"}]  # an architecture Kiln does not build for
    asked = []

    def toolchain(backend, target):
        asked.append((backend, target))
        return {"backend": backend, "target": target}

    caps = detect(gpus, trtllm=False, cuda=True, toolchain=toolchain)
    assert caps["gpus"] == gpus and caps["gpu_counts"] == {"sm90": 2}
    assert (caps["cuda"], caps["trtllm"]) == (True, False)
    assert of_these(caps["queues"]) == ["kiln.aot-inductor.cpu", "kiln.checkpoint.cpu", "kiln.aot-inductor.sm90",
                                        "kiln.checkpoint.sm90"]
    assert [a for a in asked if a[0] in THESE] == [("aot-inductor", "cpu"), ("checkpoint", "cpu"), ("aot-inductor", "sm90"), ("checkpoint", "sm90")]
    assert caps["toolchains"]["kiln.checkpoint.sm90"] == {"backend": "checkpoint", "target": "sm90"}
    assert detect(gpus, trtllm=True, cuda=False, toolchain=toolchain)["cuda"] is False

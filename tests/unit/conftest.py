"""Real ModelOpt quantizations of the shipped tiny Llama, made once per test session and shared read-only.

Shared by the builder and validation tests; the first test that asks pays for them (about 5 s for FP8, which also
imports ModelOpt, and 2 s for NVFP4)."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "examples" / "tiny-llama"
CALIBRATION = {"samples": 8, "seq_len": 64}


def quantized_export(tmp_path_factory: pytest.TempPathFactory, precision: str) -> Path:
    from builder.quantize import quantize
    from kiln.datasets import load_text
    from kiln.spec import parse_spec

    out = tmp_path_factory.getbasetemp() / "kiln-quantized" / precision
    if not (out / "quantize.json").is_file():
        spec = parse_spec({"checkpoint": str(TINY), "precision": precision, "recipe": precision, "backend": "checkpoint",
                           "calibration": CALIBRATION}, [REPO])
        text, _ = load_text(spec.calibration.dataset, field="calibration.dataset", roots=[REPO])
        quantize(TINY, spec, text, out)
    return out


@pytest.fixture(scope="session")
def fp8_export(tmp_path_factory) -> Path:
    return quantized_export(tmp_path_factory, "fp8")


@pytest.fixture(scope="session")
def nvfp4_export(tmp_path_factory) -> Path:
    return quantized_export(tmp_path_factory, "nvfp4")

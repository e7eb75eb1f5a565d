"""Datasets: the built-in texts and files under the checkpoint roots, entering keys by content digest."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.datasets import BUILTIN, DATA_DIR, load_text
from kiln.digests import sha256_bytes
from kiln.errors import SpecError


@pytest.fixture
def root(tmp_path) -> Path:
    return tmp_path.resolve()


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_builtin_datasets_load_with_a_stable_digest(name):
    text, digest = load_text(name, field="calibration.dataset", roots=[])
    again, digest2 = load_text(name, field="evaluation.dataset", roots=[])
    assert text == again and digest == digest2
    assert digest == sha256_bytes((DATA_DIR / BUILTIN[name]).read_bytes())
    assert len(text) > 50_000  # enough for the default calibration (32 × 128 tokens) and evaluation
    assert text.isprintable() or "\n" in text


def test_builtin_calibration_and_heldout_are_different_texts():
    cal, d1 = load_text("kiln:calibration", field="f", roots=[])
    held, d2 = load_text("kiln:heldout", field="f", roots=[])
    assert d1 != d2
    assert cal[:2000] not in held


def test_unknown_builtin_is_refused_with_the_field(root):
    with pytest.raises(SpecError) as info:
        load_text("kiln:wikitext", field="evaluation.dataset", roots=[root])
    assert info.value.field == "evaluation.dataset"
    assert "kiln:calibration" in info.value.fix


def test_text_file_under_a_root(root):
    path = root / "calib.txt"
    path.write_text("hello wörld\n" * 10, encoding="utf-8")
    text, digest = load_text(str(path), field="calibration.dataset", roots=[root])
    assert text == "hello wörld\n" * 10
    assert digest == sha256_bytes(path.read_bytes())
    assert load_text(f"file://{path}", field="calibration.dataset", roots=[root]) == (text, digest)


def test_digest_is_content_not_path(root):
    (root / "a").mkdir()
    (root / "b").mkdir()
    (root / "a" / "t.txt").write_text("same text")
    (root / "b" / "u.txt").write_text("same text")
    assert load_text(str(root / "a" / "t.txt"), field="f", roots=[root])[1] == \
        load_text(str(root / "b" / "u.txt"), field="f", roots=[root])[1]


def test_file_outside_roots_is_refused(tmp_path):
    root = tmp_path.resolve() / "root"
    root.mkdir()
    outside = tmp_path.resolve() / "secret.txt"
    outside.write_text("x")
    for name in (str(outside), f"{root}/../secret.txt", f"file://{outside}"):
        with pytest.raises(SpecError) as info:
            load_text(name, field="calibration.dataset", roots=[root])
        assert info.value.field == "calibration.dataset"
        assert "outside" in info.value.message and info.value.fix


@pytest.mark.parametrize("name", ["data.csv", "data.json", "data", "data.txt.gz"])
def test_wrong_suffix_is_refused(root, name):
    (root / name).write_text("some text")
    with pytest.raises(SpecError) as info:
        load_text(str(root / name), field="evaluation.dataset", roots=[root])
    assert info.value.field == "evaluation.dataset"
    assert ".txt" in info.value.fix


def test_missing_file_and_directory_are_refused(root):
    (root / "dir.txt").mkdir()
    for name in ("missing.txt", "dir.txt"):
        with pytest.raises(SpecError) as info:
            load_text(str(root / name), field="calibration.dataset", roots=[root])
        assert info.value.field == "calibration.dataset"


def test_jsonl_joins_the_text_fields(root):
    path = root / "data.jsonl"
    rows = [{"text": "first line", "id": 1}, {"text": "second"}, {"other": "no text"}, {"text": "third"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    text, digest = load_text(str(path), field="calibration.dataset", roots=[root])
    assert text == "first line\n\nsecond\n\n\n\nthird"
    assert digest == sha256_bytes(path.read_bytes())


def test_invalid_utf8_is_replaced_not_fatal(root):
    path = root / "bad.txt"
    path.write_bytes(b"ok \xff\xfe end")
    text, _ = load_text(str(path), field="f", roots=[root])
    assert text.startswith("ok ") and text.endswith(" end") and "\ufffd" in text


@pytest.mark.parametrize("line", ["not json", "[1, 2]", '{"text": 5}', "[" * 5000, '"just a string"'])
def test_a_malformed_jsonl_line_is_a_spec_error_naming_the_field(root, line):
    path = root / "bad.jsonl"
    path.write_text('{"text": "fine"}\n' + line + "\n")
    with pytest.raises(SpecError) as info:
        load_text(str(path), field="evaluation.dataset", roots=[root])
    assert info.value.field == "evaluation.dataset" and "line 2" in info.value.message


def test_refusals_name_the_dataset_as_given(root, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SpecError) as info:
        load_text("elsewhere/data.txt", field="calibration.dataset", roots=[root])
    assert str(tmp_path) not in info.value.message and "'elsewhere/data.txt'" in info.value.message

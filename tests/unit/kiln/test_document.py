"""The build document (kiln/document.py): YAML or JSON, one spec or a matrix (with defaults), every entry checked with
its field named ``matrix.<entry>.<field>``; its JSON Schema, published as docs/kiln-build.schema.json and the API's
OpenAPI request body; examples/kiln.yaml valid against it (check-jsonschema) and parsed by Kiln."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from kiln.document import (MAX_MATRIX, document_entries, document_schema, is_matrix, load_document, parse_document,
                           read_document, schema_text)
from kiln.errors import SpecError
from tests.conftest import REPO, TINY

SPEC = {"checkpoint": str(TINY), "precision": "fp8"}
PUBLISHED = REPO / "docs" / "kiln-build.schema.json"
EXAMPLE = REPO / "examples" / "kiln.yaml"


def refused(fn, *args, **kw) -> SpecError:
    with pytest.raises(SpecError) as err:
        fn(*args, **kw)
    return err.value


# -- reading ---------------------------------------------------------------------------------------------------------
def test_yaml_and_json_of_the_same_matrix_load_the_same_data():
    text_yaml = "defaults: &d\n  checkpoint: examples/tiny-llama\nmatrix:\n  - precision: fp8\n  - {precision: nvfp4}\n"
    text_json = json.dumps({"defaults": {"checkpoint": "examples/tiny-llama"},
                            "matrix": [{"precision": "fp8"}, {"precision": "nvfp4"}]})
    assert load_document(text_yaml, name="kiln.yaml") == load_document(text_json, name="kiln.json")
    assert load_document(text_json.encode(), name="-") == load_document(text_yaml.encode(), name="-")  # by content


def test_yaml_anchors_and_merge_keys_are_fine():
    text = "base: &b {checkpoint: x, precision: fp8}\n"
    assert load_document(text)["base"] == {"checkpoint": "x", "precision": "fp8"}
    merged = load_document("a: &a {precision: fp8}\nb: {<<: *a, target: cpu}\n")
    assert merged["b"] == {"precision": "fp8", "target": "cpu"}


@pytest.mark.parametrize("text,name,words", [
    ("precision: fp8\nprecision: nvfp4\n", "kiln.yaml", "key 'precision' is given twice (line 2)"),
    ('{"precision": "fp8", "precision": "nvfp4"}', "kiln.json", "key 'precision' is given twice"),
    ("matrix: [\n", "kiln.yaml", "is not valid YAML"),
    ('{"matrix": [}', "kiln.json", "is not valid JSON"),
    ("a: 1\n---\nb: 2\n", "kiln.yaml", "holds 2 YAML documents"),
    ("", "kiln.yaml", "is empty"),
    ("key: !!python/object:os.system ls\n", "kiln.yaml", "is not valid YAML"),  # safe loading only
])
def test_unreadable_documents_are_refused_on_the_document_with_where(text, name, words):
    err = refused(load_document, text, name=name)
    assert err.field == "document" and words in err.message and err.fix


def test_a_syntax_error_gives_its_line_and_column():
    err = refused(load_document, "matrix:\n  - precision: fp8\n   bad: [\n", name="kiln.yaml")
    assert "(line " in err.message and "column" in err.message


def test_too_large_or_not_utf8_documents_are_refused(tmp_path):
    assert "bytes" in refused(load_document, b"#" * (2 << 20)).message
    assert refused(load_document, b"\xff\xfe\xfa").fix == "save the file as UTF-8"
    err = refused(read_document, tmp_path / "missing.yaml")
    assert err.field == "file" and "missing.yaml" in err.message


# -- the shape ------------------------------------------------------------------------------------------------------
def test_one_spec_is_one_entry_and_a_matrix_its_entries_over_the_defaults():
    assert document_entries(SPEC) == [SPEC] and not is_matrix(SPEC)
    doc = {"defaults": {"checkpoint": "c", "target": "cpu", "calibration": {"samples": 8, "seq_len": 64},
                        "gates": {"max_mean_kl": 0.01}, "profile": {"max_batch_size": 2}},
           "matrix": [{"precision": "fp8"},
                      {"precision": "nvfp4", "target": "sm100", "calibration": {"samples": 16},
                       "gates": {"min_top1_agreement": 0.9}, "profile": "balanced"}]}
    first, second = document_entries(doc)
    assert first == {"checkpoint": "c", "target": "cpu", "precision": "fp8", "calibration": {"samples": 8, "seq_len": 64},
                     "gates": {"max_mean_kl": 0.01}, "profile": {"max_batch_size": 2}}
    # the entry wins; calibration, evaluation and gates merge field by field; a profile is replaced whole
    assert second["target"] == "sm100" and second["calibration"] == {"samples": 16, "seq_len": 64}
    assert second["gates"] == {"max_mean_kl": 0.01, "min_top1_agreement": 0.9} and second["profile"] == "balanced"
    assert doc["defaults"]["calibration"] == {"samples": 8, "seq_len": 64}  # not modified


@pytest.mark.parametrize("doc,field,words", [
    ([SPEC], "document", "the document is a list, not a mapping"),
    ("fp8", "document", "is a string"),
    ({"matrix": []}, "matrix", "not 0 entries"),
    ({"matrix": [SPEC] * (MAX_MATRIX + 1)}, "matrix", f"not {MAX_MATRIX + 1} entries"),
    ({"matrix": SPEC}, "matrix", "not dict"),
    ({"matrix": [SPEC], "precision": "fp8"}, "precision", "unknown keys ['precision']"),
    ({"defaults": {"target": "cpu"}, **SPEC}, "defaults", "without a matrix"),
    ({"defaults": ["x"], "matrix": [SPEC]}, "defaults", "is a list"),
    ({"matrix": [SPEC, "examples/tiny-llama"]}, "matrix.1", "entry 1 is a string, not a build spec"),
    ({"matrix": [SPEC, None]}, "matrix.1", "empty (null)"),
])
def test_a_bad_shape_names_its_field(doc, field, words):
    err = refused(document_entries, doc)
    assert err.field == field and words in err.message and err.fix


def test_the_api_names_a_body_that_is_no_mapping_body():
    assert refused(document_entries, [1, 2], where="body").field == "body"


# -- the specs ------------------------------------------------------------------------------------------------------
def test_every_entry_is_parsed_in_order():
    specs = parse_document({"defaults": {"checkpoint": str(TINY), "target": "cpu"},
                            "matrix": [{"precision": "fp8"}, {"precision": "nvfp4", "backend": "checkpoint"}]},
                           [REPO])
    assert [(s.precision, s.backend) for s in specs] == [("fp8", "aot-inductor"), ("nvfp4", "checkpoint")]
    assert [s.precision for s in parse_document(SPEC, [REPO])] == ["fp8"]


def test_a_bad_entry_names_its_index_and_field_with_every_violation():
    doc = {"matrix": [SPEC, SPEC, {**SPEC, "precision": "int3", "tp_size": 3}]}
    err = refused(parse_document, doc, [REPO])
    assert err.field == "matrix.2.precision" and "fp8" in err.fix
    assert {d["field"] for d in err.details} >= {"matrix.2.precision", "matrix.2.tp_size"}
    assert refused(parse_document, {**SPEC, "precision": "int3"}, [REPO]).field == "precision"  # one spec: plain
    assert refused(parse_document, {"matrix": [SPEC, {"checkpoint": str(TINY)}]}, [REPO]).field == "matrix.1.precision"
    nested = refused(parse_document, {"matrix": [{**SPEC, "calibration": {"samples": "many"}}]}, [REPO])
    assert nested.field == "matrix.0.calibration.samples"


def test_an_error_from_the_defaults_says_so():
    err = refused(parse_document, {"defaults": {"checkpoint": str(TINY), "target": "a100"},
                                   "matrix": [{"precision": "fp8"}]}, [REPO])
    assert err.field == "matrix.0.target" and err.message.endswith("(from defaults)")
    own = refused(parse_document, {"defaults": {"checkpoint": str(TINY)},
                                   "matrix": [{"precision": "fp8", "target": "a100"}]}, [REPO])
    assert own.field == "matrix.0.target" and "from defaults" not in own.message


# -- the schema -----------------------------------------------------------------------------------------------------
def validator() -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(document_schema())


def test_the_schema_takes_what_the_api_takes_and_refuses_what_it_refuses_by_shape():
    v = validator()
    jsonschema.Draft202012Validator.check_schema(document_schema())
    for ok in (SPEC, {"matrix": [SPEC]}, {"defaults": {"checkpoint": "c"}, "matrix": [{"precision": "fp8"}]},
               {**SPEC, "profile": {"max_batch_size": 1, "max_input_len": 8, "max_seq_len": 16, "max_num_tokens": 16}}):
        assert v.is_valid(ok), list(v.iter_errors(ok))
    for bad in ({"precision": "fp8"}, {**SPEC, "precison": "fp8"}, {"matrix": []}, {"matrix": [SPEC] * 65},
                {"matrix": [{"precision": "fp8"}]}, {"matrix": [SPEC], "target": "cpu"}, {"defaults": SPEC},
                {"matrix": [SPEC, "examples/tiny-llama"]}, [SPEC]):
        assert not v.is_valid(bad), bad


def test_the_published_schema_is_current():
    assert PUBLISHED.read_text(encoding="utf-8") == schema_text(), \
        "docs/kiln-build.schema.json is stale: run kiln schema -o docs/kiln-build.schema.json"


def test_the_api_request_body_is_the_same_schema():
    from api.routes.builds import BODY_SCHEMA, SPEC_BODY

    assert SPEC_BODY == {"oneOf": document_schema("#/components/schemas/")["oneOf"]}
    assert json.dumps(BODY_SCHEMA).replace("#/components/schemas/", "#/$defs/") == json.dumps(document_schema())


def test_the_example_matrix_is_valid_against_the_published_schema_and_parsed_by_kiln():
    tool = Path(sys.executable).parent / "check-jsonschema"
    if not tool.exists():
        pytest.skip("check-jsonschema is not installed")
    proc = subprocess.run([str(tool), "--schemafile", str(PUBLISHED), str(EXAMPLE)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data, _ = read_document(EXAMPLE)
    entries = document_entries(data)
    assert {(e["precision"], e.get("backend", "aot-inductor")) for e in entries} >= {
        ("fp8", "aot-inductor"), ("nvfp4", "aot-inductor"), ("fp8", "checkpoint")}
    specs = parse_document({**data, "defaults": {**data["defaults"], "checkpoint": str(TINY)}}, [REPO])
    assert len(specs) == len(entries) and all(s.target == "cpu" for s in specs)

"""The build document: what ``POST /v1/builds`` takes and what ``kiln build -f FILE`` reads from a repository.

A document is one build spec, or ``{"matrix": [spec, ...]}`` with an optional ``defaults`` spec merged under every
entry (an entry's own fields win; ``calibration``, ``evaluation`` and ``gates`` merge field by field). The CLI reads
it as YAML or JSON (:func:`load_document`); the API takes the JSON form. Both turn it into specs with
:func:`document_entries` and :func:`parse_document`, so a matrix is checked the same way everywhere, every entry
before any work, each error naming its field as ``matrix.<entry>.<field>``. :func:`document_schema` is its JSON
Schema (published as docs/kiln-build.schema.json, ``kiln schema``; the API's OpenAPI request body)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from kiln.errors import SpecError

#: the most entries a matrix may hold (the API's and the CLI's limit)
MAX_MATRIX = 64
#: the largest document the CLI reads (a matrix of 64 specs is a few KiB)
MAX_DOCUMENT_BYTES = 1 << 20
#: fields of a spec that merge field by field when both ``defaults`` and an entry give them (the others: the entry's)
MERGED_FIELDS = ("calibration", "evaluation", "gates")
DOCUMENT_KEYS = ("defaults", "matrix")
FIX_SHAPE = 'give one build spec, or {"matrix": [spec, ...]} (optionally with "defaults": {...}); see kiln schema'
SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"


# -- reading text ----------------------------------------------------------------------------------------------------
def _yaml_loader():
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        """yaml.safe_load that refuses a key given twice in one mapping (YAML keeps the last one silently)."""

        def construct_mapping(self, node, deep=False):
            seen: set = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # "<<: *anchor" merges, it is not a key
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    if key in seen:
                        raise SpecError(f"key {key!r} is given twice (line {key_node.start_mark.line + 1})",
                                        field="document", fix="give each key once in a mapping")
                    seen.add(key)
                except TypeError:  # an unhashable key: yaml reports it itself
                    pass
            return super().construct_mapping(node, deep=deep)

    return UniqueKeyLoader


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise SpecError(f"key {key!r} is given twice", field="document", fix="give each key once in an object")
        out[key] = value
    return out


def load_document(text: str | bytes, *, name: str = "-") -> Any:
    """The data of a document given as YAML or JSON: JSON when ``name`` ends in ``.json`` or the text starts with
    ``{``, YAML otherwise (anchors and aliases allowed, one document, duplicate keys refused). A syntax error is a
    :class:`SpecError` on ``document`` giving its line and column."""
    if isinstance(text, bytes):
        if len(text) > MAX_DOCUMENT_BYTES:
            raise SpecError(f"the document is {len(text):,} bytes", field="document",
                            fix=f"keep it under {MAX_DOCUMENT_BYTES:,} bytes (at most {MAX_MATRIX} entries)")
        try:
            text = text.decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            raise SpecError(f"is not UTF-8 text (byte {exc.start})", field="document",
                            fix="save the file as UTF-8") from None
    if len(text) > MAX_DOCUMENT_BYTES:
        raise SpecError(f"the document is {len(text):,} characters", field="document",
                        fix=f"keep it under {MAX_DOCUMENT_BYTES:,} bytes (at most {MAX_MATRIX} entries)")
    if name.lower().endswith(".json") or text.lstrip().startswith("{"):
        try:
            return json.loads(text, object_pairs_hook=_unique_pairs)  # NaN and Infinity: refused by parse_spec
        except json.JSONDecodeError as exc:
            raise SpecError(f"is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})",
                            field="document", fix="fix the JSON syntax there") from None
    import yaml

    try:
        docs = list(yaml.load_all(text, Loader=_yaml_loader()))  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise SpecError(f"is not valid YAML: {problem}{where}", field="document",
                        fix="fix the YAML syntax there") from None
    if len(docs) != 1:
        raise SpecError(f"holds {len(docs)} YAML documents" if docs else "is empty", field="document",
                        fix="give one document: a build spec or a matrix")
    return docs[0]


def read_document(path: str | Path, *, stdin=None) -> tuple[Any, str]:
    """Read and load the document at ``path`` (``-``: ``stdin``, bytes); returns (data, the name to show)."""
    if str(path) == "-":
        import sys

        stream = stdin if stdin is not None else sys.stdin.buffer
        return load_document(stream.read(MAX_DOCUMENT_BYTES + 1), name="-"), "<stdin>"
    p = Path(path)
    try:
        with p.open("rb") as f:
            raw = f.read(MAX_DOCUMENT_BYTES + 1)
    except OSError as exc:
        raise SpecError(f"cannot read {path}: {exc.strerror or exc}", field="file",
                        fix="give the path of a YAML or JSON build document, or - for stdin") from None
    return load_document(raw, name=p.name), str(path)


# -- the document's shape --------------------------------------------------------------------------------------------
def _merge(defaults: dict, entry: dict) -> dict:
    out = {**defaults, **entry}
    for key in MERGED_FIELDS:
        if isinstance(defaults.get(key), dict) and isinstance(entry.get(key), dict):
            out[key] = {**defaults[key], **entry[key]}
    return out


def _kind(value: Any) -> str:
    return {list: "a list", str: "a string", bool: "a boolean", int: "a number", float: "a number",
            type(None): "empty (null)"}.get(type(value), type(value).__name__)


def is_matrix(data: Any) -> bool:
    """Whether the document is a matrix (the API answers it with ``{"builds": [...]}``)."""
    return isinstance(data, dict) and "matrix" in data


def document_entries(data: Any, *, where: str = "document") -> list[dict]:
    """The spec dicts a document describes, in order: one spec → ``[spec]``; a matrix → its entries, each with the
    defaults merged under it. Only the shape is checked here (the specs themselves by :func:`parse_document`).
    ``where``: the field a document that is not a mapping is reported on (the API's: ``body``)."""
    if not isinstance(data, dict):
        raise SpecError(f"the {where} is {_kind(data)}, not a mapping", field=where, fix=FIX_SHAPE)
    if "matrix" not in data:
        if "defaults" in data:
            raise SpecError("defaults is given without a matrix", field="defaults",
                            fix="put the entries under matrix: [...], or move the defaults' fields into the spec")
        return [data]
    extra = sorted(set(data) - set(DOCUMENT_KEYS))
    if extra:
        raise SpecError(f"a matrix document has unknown keys {extra}", field=extra[0],
                        fix="put spec fields in defaults: {...} or in each entry of matrix: [...]")
    matrix, defaults = data["matrix"], data.get("defaults", {})
    if not isinstance(matrix, list) or not 1 <= len(matrix) <= MAX_MATRIX:
        what = f"{len(matrix)} entries" if isinstance(matrix, list) else _kind(matrix)
        raise SpecError(f"matrix must be a list of 1 to {MAX_MATRIX} build specs, not {what}", field="matrix",
                        fix="give matrix: [spec, ...] (split a larger matrix across documents)")
    if not isinstance(defaults, dict):
        raise SpecError(f"defaults is {_kind(defaults)}, not a mapping", field="defaults",
                        fix="give defaults as a mapping of spec fields, e.g. {checkpoint: ..., target: cpu}")
    entries = []
    for i, entry in enumerate(matrix):
        if not isinstance(entry, dict):
            raise SpecError(f"entry {i} is {_kind(entry)}, not a build spec", field=f"matrix.{i}",
                            fix="give each entry as a mapping of spec fields, e.g. {precision: fp8}")
        entries.append(_merge(defaults, entry))
    return entries


def parse_document(data: Any, roots: list[Path], *, where: str = "document") -> list:
    """Every spec of the document checked against every rule (kiln/spec.py ``parse_spec``) before any is returned;
    the first entry that breaks one raises its SpecError with each field named ``matrix.<entry>.<field>`` (a
    single-spec document: the plain field)."""
    from kiln.spec import parse_spec

    entries = document_entries(data, where=where)
    if not is_matrix(data):
        return [parse_spec(entries[0], roots)]
    defaults = data.get("defaults") or {}
    specs = []
    for i, entry in enumerate(entries):
        try:
            specs.append(parse_spec(entry, roots))
        except SpecError as exc:
            top = (exc.field or "").split(".", 1)[0]
            inherited = top in defaults and top not in data["matrix"][i]
            message = exc.message + (" (from defaults)" if inherited else "")
            raise SpecError(message, field=f"matrix.{i}.{exc.field}", fix=exc.fix,
                            details=[{**d, "field": f"matrix.{i}.{d['field']}"} for d in exc.details]) from None
    return specs


# -- the JSON Schema -------------------------------------------------------------------------------------------------
def document_schema(ref_prefix: str = "#/$defs/") -> dict:
    """The JSON Schema of a build document, built from BuildSpec's pydantic schema: one spec, or a matrix (its entries
    full specs), or a matrix with defaults (defaults and entries partial specs: the merged entry is checked by
    parse_spec). Its definitions are under ``$defs``; ``ref_prefix`` is where its references point (the API's
    OpenAPI document lifts them into ``#/components/schemas/``)."""
    from kiln.spec import BuildSpec

    spec = BuildSpec.model_json_schema(ref_template=ref_prefix + "{model}")
    defs = spec.pop("$defs", {})
    spec["description"] = ("A build request: the checkpoint and what to build from it (docs/api.md). Every rule is "
                           "checked by Kiln before any work; each error names its field.")
    partial = copy.deepcopy(spec)
    partial.pop("required", None)
    partial["title"] = "BuildSpecEntry"
    partial["description"] = ("A matrix entry or the matrix's defaults: any BuildSpec fields. An entry merged over the "
                              "defaults must be a full BuildSpec (checkpoint and precision at least).")
    defs["BuildSpec"], defs["BuildSpecEntry"] = spec, partial

    def matrix(items: str) -> dict:
        return {"type": "array", "minItems": 1, "maxItems": MAX_MATRIX, "items": {"$ref": ref_prefix + items},
                "description": f"1 to {MAX_MATRIX} build specs, checked together before any is built"}

    return {
        "$schema": SCHEMA_DIALECT,
        "title": "Kiln build document",
        "description": ("One build spec, or a matrix of them (POST /v1/builds, kiln build -f FILE). With defaults, "
                        "each entry is merged over them: its own fields win; calibration, evaluation and gates "
                        "merge field by field."),
        "oneOf": [
            {"$ref": ref_prefix + "BuildSpec"},
            {"title": "Matrix", "type": "object", "required": ["matrix"], "additionalProperties": False,
             "properties": {"matrix": matrix("BuildSpec")}},
            {"title": "MatrixWithDefaults", "type": "object", "required": ["defaults", "matrix"],
             "additionalProperties": False,
             "properties": {"defaults": {"$ref": ref_prefix + "BuildSpecEntry"}, "matrix": matrix("BuildSpecEntry")}},
        ],
        "$defs": defs,
    }


def schema_text() -> str:
    """The published schema's text (docs/kiln-build.schema.json, ``kiln schema``)."""
    return json.dumps(document_schema(), indent=2) + "\n"

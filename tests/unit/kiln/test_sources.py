"""Checkpoint sources (kiln/sources.py): every entry of the table obeys the same contract — its examples parse,
format back and name a model; its malformed examples are refused naming ``checkpoint`` with a fix — and no module
outside the source home compares a reference's scheme."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kiln.errors import SpecError
from kiln.sources import (FILE_PREFIX, SOURCES, TRACKED, check_ref, default_model_name, source_link, source_of,
                          tracked_parts)
from kiln.spec import MODEL_NAME_RE, parse_spec
from tests.conftest import REPO

ENTRIES = list(SOURCES.values())


@pytest.fixture
def root(tmp_path) -> Path:
    """A checkpoint root holding ``tiny/config.json`` (what the local examples name)."""
    root = tmp_path.resolve()
    (root / "tiny").mkdir()
    (root / "tiny" / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    return root


def test_the_table_is_well_formed():
    assert len({s.kind for s in ENTRIES}) == len(ENTRIES) == len(SOURCES)
    prefixes = [s.prefix for s in ENTRIES if s.prefix]
    assert len(set(prefixes)) == len(prefixes) and all(p.endswith("://") for p in prefixes)
    assert sum(s.prefix is None for s in ENTRIES) == 1  # one fallback: a path
    assert TRACKED in ENTRIES and TRACKED.follows


@pytest.mark.parametrize("source", ENTRIES, ids=lambda s: s.kind)
def test_every_example_parses_formats_back_and_names_a_model(source, root):
    assert source.examples and source.bad_examples
    for example in source.examples:
        ref = example.format(root=root)
        problem, canonical = check_ref(ref, [root])
        assert problem is None, (ref, problem)
        assert source_of(ref) is source and source_of(canonical) is source
        parts = source.parse(canonical)
        again = source.format(*parts)
        assert source.parse(again) == parts and check_ref(again, [root]) == (None, again)  # round trip, canonical
        name = default_model_name(canonical)
        assert name and MODEL_NAME_RE.fullmatch(name), (ref, name)
        assert "://" in source_link(canonical)
        spec = parse_spec({"checkpoint": ref, "precision": "fp8"}, [root])
        assert (spec.checkpoint, spec.model_name) == (canonical, name)


@pytest.mark.parametrize("source", ENTRIES, ids=lambda s: s.kind)
def test_every_malformed_example_is_refused_naming_the_field_and_the_fix(source, root):
    for example in source.bad_examples:
        ref = example.format(root=root)
        problem, _ = check_ref(ref, [root])
        assert problem is not None and all(problem), ref
        with pytest.raises(SpecError) as err:
            parse_spec({"checkpoint": ref, "precision": "fp8"}, [root])
        assert (err.value.field, err.value.message, err.value.fix) == ("checkpoint", *problem)
        if source.prefix:  # a malformed reference has no parts either (a local path's rules are where it lies)
            with pytest.raises(SpecError) as err:
                source.parse(ref)
            assert err.value.field == "checkpoint" and err.value.fix


@pytest.mark.parametrize("ref", ["gs://bucket/x", "http://example.com/model", "HF://org/name"])
def test_a_scheme_no_source_reads_is_refused_naming_every_source(ref):
    with pytest.raises(SpecError) as err:
        source_of(ref)
    assert err.value.field == "checkpoint"
    assert all(s.schemes in err.value.fix for s in ENTRIES)
    assert check_ref(ref, []) == ((f"unsupported scheme in {ref!r}", err.value.fix), ref)


@pytest.mark.parametrize("ref", ["", "  ", None, "hf://org/name\n"])
def test_empty_and_control_characters_name_every_form(ref):
    problem, _ = check_ref(ref, [])
    assert problem is not None and all(s.form in problem[1] for s in ENTRIES)


@pytest.mark.parametrize("source", [s for s in ENTRIES if s is not TRACKED], ids=lambda s: s.kind)
def test_only_the_tracked_source_can_be_followed(source, root):
    for example in source.examples:
        with pytest.raises(SpecError) as err:
            tracked_parts(example.format(root=root))
        assert (err.value.field, err.value.message, err.value.fix) == (
            "checkpoint", "a tracked model follows a Hugging Face branch", "give hf://org/name@branch")
    assert tracked_parts(TRACKED.format("acme/tiny", "dev")) == ("acme/tiny", "dev")


# -- one home: nobody else compares a scheme -------------------------------------------------------
HOME = {Path("kiln/sources.py")}
SCANNED = ("kiln", "builder", "workers", "api")
SCHEMES = tuple(s.prefix for s in ENTRIES if s.prefix) + (FILE_PREFIX, "://")
STRING_TESTS = {"startswith", "endswith", "removeprefix", "partition", "split", "find", "index"}
SCHEME_NAMES = {p.removesuffix("://") for p in SCHEMES if p != "://"}


def _is_scheme(node: ast.AST) -> bool:
    if isinstance(node, ast.Tuple):
        return any(_is_scheme(e) for e in node.elts)
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith(SCHEMES)


def scheme_tests(source: str, where: str) -> list[str]:
    """Where ``source`` tests a checkpoint reference's scheme: a string method or ``len`` given a scheme
    (``ref.startswith("hf://")``, ``ref[len("s3://"):]``), a comparison with one (``"://" in ref``), or a URL's
    ``.scheme`` compared with a scheme's name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        hit = False
        if isinstance(node, ast.Call) and any(_is_scheme(a) for a in node.args):
            func = node.func
            hit = (isinstance(func, ast.Attribute) and func.attr in STRING_TESTS) or (
                isinstance(func, ast.Name) and func.id == "len")
        elif isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            hit = any(_is_scheme(o) for o in operands) or (
                any(isinstance(o, ast.Attribute) and o.attr == "scheme" for o in operands)
                and any(isinstance(o, ast.Constant) and o.value in SCHEME_NAMES for o in operands))
        if hit:
            found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return found


@pytest.mark.parametrize("code", [
    'ref.startswith("hf://")', 'ref.startswith(("s3://", "gs://"))', '"://" in ref', 'ref[len("hf://"):]',
    'ref.removeprefix("file://")', 'urlparse(ref).scheme == "s3"', 'ref[:5] == "hf://"',
])
def test_the_scan_finds_a_scheme_test(code):
    assert scheme_tests(code, "planted.py")


def test_no_module_outside_the_source_home_compares_a_checkpoint_scheme():
    found = []
    for package in SCANNED:
        for path in sorted((REPO / package).rglob("*.py")):
            rel = path.relative_to(REPO)
            if rel not in HOME:
                found += scheme_tests(path.read_text(), str(rel))
    assert not found, "compare a reference's scheme only in kiln/sources.py (source_of):\n" + "\n".join(found)


def test_kiln_builds_help_and_its_missing_checkpoint_error_name_every_form():
    """The CLI's words for a checkpoint come from the table: a new source appears there without an edit."""
    from click.testing import CliRunner

    from api.cli import main

    runner = CliRunner()
    usage = " ".join(runner.invoke(main, ["build", "--help"]).output.split())
    missing = runner.invoke(main, ["build"])
    assert missing.exit_code != 0
    for source in SOURCES.values():
        assert source.form in usage and source.form in missing.output, source.kind

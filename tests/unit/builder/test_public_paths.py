"""builder/publish.py's path scrubbing: an absolute local path is replaced whole, as itself, as ``file://…`` or as
the folder of a longer path, and never inside another name (tests/integration/test_public_paths.py builds)."""

from __future__ import annotations

import pytest

from builder.publish import public_paths, without_paths
from kiln.spec import parse_spec


@pytest.mark.parametrize("given, text, expected", [
    ("/w/tiny", "/w/tiny", "file:tiny"),
    ("/w/tiny", "file:///w/tiny", "file:tiny"),
    ("/w/tiny", "read /w/tiny/config.json: ok", "read file:tiny/config.json: ok"),
    ("/w/tiny", "'/w/tiny' then \"/w/tiny\"", "'file:tiny' then \"file:tiny\""),
    ("/w/tiny", "/w/tiny2 and /w/tiny.old", "/w/tiny2 and /w/tiny.old"),  # another folder: not this path
])
def test_paths_are_replaced_whole_and_only_whole(given, text, expected):
    spec = parse_spec({"checkpoint": "hf://acme/tiny@" + "a" * 40, "precision": "fp8"}, [])
    paths = {**public_paths(spec), given: "file:tiny"}
    assert without_paths({"k": [text], text: 1}, paths) == {"k": [expected], expected: 1}

"""Digests: ``sha256:<64 lowercase hex>``, canonical JSON, streaming hashes."""

from __future__ import annotations

import hashlib
import io

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kiln import digests
from kiln.digests import canonical_json, hex_of, parse_digest, sha256_bytes, sha256_file, sha256_json, sha256_stream
from kiln.errors import InvalidDigest

EMPTY = "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"


def test_known_digest_of_empty_bytes():
    assert sha256_bytes(b"") == EMPTY
    assert sha256_bytes(b"abc") == "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"


@pytest.mark.parametrize("value", ["sha256:" + "0" * 64, EMPTY])
def test_parse_digest_accepts_well_formed(value):
    assert parse_digest(value) == value
    assert hex_of(value) == value.split(":")[1]


@pytest.mark.parametrize("value", ["", "sha256:", "sha256:" + "A" * 64, "sha256:" + "0" * 63, "sha256:" + "0" * 65,
                                   "sha512:" + "0" * 64, "0" * 64, " sha256:" + "0" * 64, None, 42])
def test_parse_digest_refuses_malformed_naming_the_field(value):
    with pytest.raises(InvalidDigest) as info:
        parse_digest(value, field="manifest.config.digest")
    assert info.value.field == "manifest.config.digest"
    assert info.value.fix


def test_parse_digest_refuses_a_trailing_newline():
    with pytest.raises(InvalidDigest):
        parse_digest("sha256:" + "0" * 64 + "\n")


def test_hex_of_refuses_malformed():
    with pytest.raises(InvalidDigest):
        hex_of("md5:abcd")


def test_canonical_json_is_sorted_compact_utf8():
    assert canonical_json({"b": 1, "a": [1, {"d": "é", "c": None}]}) == '{"a":[1,{"c":null,"d":"é"}],"b":1}'.encode()


@given(st.dictionaries(st.text(), st.one_of(st.integers(), st.text(), st.booleans(), st.none()), max_size=8))
def test_sha256_json_ignores_key_order(d):
    reversed_d = dict(reversed(list(d.items())))
    assert sha256_json(d) == sha256_json(reversed_d)
    assert sha256_json(d) == sha256_bytes(canonical_json(d))


def test_sha256_json_changes_with_any_value():
    assert sha256_json({"a": 1}) != sha256_json({"a": 2})
    assert sha256_json({"a": 1}) != sha256_json({"a": "1"})


@given(st.binary(max_size=5000), st.integers(1, 600))
def test_stream_hash_equals_one_shot_hash_for_any_chunk_size(data, chunk):
    old = digests.CHUNK
    digests.CHUNK = chunk
    try:
        digest, size = sha256_stream(io.BytesIO(data))
    finally:
        digests.CHUNK = old
    assert digest == "sha256:" + hashlib.sha256(data).hexdigest()
    assert size == len(data)


def test_sha256_file(tmp_path):
    data = bytes(range(256)) * 9000  # larger than one chunk
    path = tmp_path / "blob"
    path.write_bytes(data)
    assert sha256_file(path) == (sha256_bytes(data), len(data))

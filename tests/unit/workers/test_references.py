"""workers/references.find_engine: what a person types for an engine — a digest, a unique prefix, repository:tag."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from kiln.errors import ArtifactUnknown, InvalidDigest
from kiln.tables import Artifact, Base, EngineName, Tag
from workers.references import find_engine

A = "sha256:" + "ab12cd34" + "0" * 56
B = "sha256:" + "ab12cd35" + "1" * 56
C = "sha256:" + "ab12cd34" + "2" * 56  # shares A's first 8 hex digits


def artifact(digest: str, repository: str, tag: str) -> Artifact:
    return Artifact(digest=digest, build_key="sha256:" + digest[-64:][::-1], repository=repository, tag=tag,
                    status="fresh", precision="fp8", target="cpu", profile="latency", backend="aot-inductor",
                    checkpoint_ref="/m", checkpoint_digest="sha256:" + "c" * 64, size=1, provenance={},
                    validation={})


@pytest.fixture()
def session():
    engine = sa.create_engine("sqlite://")
    Base.metadata.create_all(engine)
    with Session(engine) as s:
        s.add_all([artifact(A, "acme/tiny", "fp8-cpu-latency"), artifact(B, "acme/tiny", "fp8-cpu-balanced"),
                   artifact(C, "acme/other", "fp8-cpu-latency"), Tag(repository="acme/tiny", name="fp8-cpu-latency",
                                                                     digest=A),
                   EngineName(repository="team/alias", digest=B, reason="same BuildKey")])
        s.commit()
        yield s


@pytest.mark.parametrize("ref,expected", [
    (A, A), (f"acme/tiny@{A}", A), (f"team/alias@{B}", B),  # full digests, with the publishing or another name
    ("ab12cd35", B), ("sha256:ab12cd35", B), ("AB12CD35", B), ("ab12cd340000", A),  # unique prefixes
    ("acme/tiny:fp8-cpu-latency", A),  # a tag: the tags table's current engine
])
def test_a_reference_finds_its_one_engine(session, ref, expected):
    assert find_engine(session, ref).digest == expected


@pytest.mark.parametrize("ref,error,words", [
    ("ab12cd34", InvalidDigest, "start of 2 engines"),  # ambiguous: both listed, never one picked
    ("ab12cd3", InvalidDigest, "names no engine"),  # 7 digits: too short to be a prefix, and not a tag
    ("ffffffff", ArtifactUnknown, "starts with ffffffff"),
    ("sha256:" + "f" * 64, ArtifactUnknown, "no engine"),
    (f"acme/other@{A}", ArtifactUnknown, "no engine"),  # a digest under a name it does not have
    ("acme/tiny:nvfp4-cpu-latency", ArtifactUnknown, "no tag"),
    ("acme/tiny:fp8-cpu-balanced", ArtifactUnknown, "no tag"),  # published, but never tagged so
    ("not a reference", InvalidDigest, "names no engine"),
])
def test_a_reference_that_names_none_or_several_says_so_and_how_to_fix_it(session, ref, error, words):
    with pytest.raises(error) as raised:
        find_engine(session, ref, field="ref")
    assert words in raised.value.message and raised.value.field == "ref" and raised.value.fix


def test_a_tag_whose_engine_is_gone_is_unknown_not_none(session):
    # the tag row and the engine row are read apart: an engine collected between the two reads is an error a
    # person can read, not None handed to the caller
    session.add(Tag(repository="acme/tiny", name="fp8-cpu-gone", digest="sha256:" + "9" * 64))
    session.commit()
    with pytest.raises(ArtifactUnknown) as raised:
        find_engine(session, "acme/tiny:fp8-cpu-gone", field="ref")
    assert "no longer holds" in raised.value.message and raised.value.field == "ref"

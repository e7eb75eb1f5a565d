"""The shape of a Hugging Face checkpoint reference, ``hf://org/name[@revision]``.

A revision is a branch or tag name (git's ref-name rules, as ``git check-ref-format`` states them) or a commit
(40 hex digits); nothing else. huggingface_hub opens ``refs/<revision>`` in the local cache as a path, so a
revision such as ``../../x`` or ``/etc`` would otherwise name any file on the server. Every bad reference is
the same error (a :class:`SpecError` naming ``checkpoint``), so the answer never tells which paths exist.
"""

from __future__ import annotations

import re

from kiln.errors import SpecError

#: The Hub's repo id rule (huggingface_hub's validate_repo_id): word characters, '-' and '.', 1–96 of them,
#: starting and ending with a word character, no '--' or '..'.
_REPO_PART = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?")
COMMIT_RE = re.compile(r"[0-9a-f]{40}")
_REF_FORBIDDEN = re.compile(r"[\x00-\x20\x7f~^:?*\[\\]")
FIX = "write hf://org/name@revision, where revision is a branch or tag name or a 40-hex commit"


def hf_ref_problem(ref: str) -> str | None:
    """Why ``ref`` (``hf://…``) is not a valid Hub reference, or None."""
    repo, at, revision = ref[len("hf://"):].partition("@")
    parts = repo.split("/")
    if len(parts) != 2 or not all(_REPO_PART.fullmatch(p) and "--" not in p and ".." not in p for p in parts):
        return "is not hf://org/name[@revision] (a Hub repository id)"
    if at and not is_revision(revision):
        return "names a revision that is neither a branch or tag name nor a 40-hex commit"
    return None


def is_revision(revision: str) -> bool:
    """A 40-hex commit, or a ref name by git's rules (at most 255 characters)."""
    if COMMIT_RE.fullmatch(revision):
        return True
    if not revision or len(revision) > 255 or _REF_FORBIDDEN.search(revision) or revision == "@":
        return False
    if "@{" in revision or ".." in revision or "//" in revision:
        return False
    if revision.startswith("/") or revision.endswith(("/", ".")):
        return False
    return all(part and not part.startswith(".") and not part.endswith(".lock") for part in revision.split("/"))


def parse_hf_ref(ref: str) -> tuple[str, str]:
    """``(repo, revision)`` of a valid reference (revision ``main`` when none is given); SpecError otherwise."""
    problem = hf_ref_problem(ref)
    if problem:
        raise SpecError(f"{ref!r} {problem}", field="checkpoint", fix=FIX)
    repo, _, revision = ref[len("hf://"):].partition("@")
    return repo, revision or "main"

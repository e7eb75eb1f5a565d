"""Checkpoint sources: the one home of every rule about how a checkpoint is named. One entry per kind:

- ``hf``: ``hf://org/name[@revision]``, a Hugging Face Hub repository at a branch, tag or commit;
- ``s3``: ``s3://bucket/prefix``, the objects under a prefix;
- ``local``: ``file:///abs/dir`` or a plain directory path, under the configured checkpoint roots.

Each entry owns its reference's shape check (a :class:`SpecError` naming ``checkpoint`` and the fix), its parts
and the reference they format back to, its canonical form, the name a spec without ``model_name`` gets, and the
URL a registry UI links. :func:`source_of` is the only place a reference's scheme is compared. Reading a
checkpoint (identify, materialize, freshness) is I/O and lives in ``builder/sources/``, one module per kind, in
the table of ``builder/resolve.py``.

A Hub revision is a branch or tag name (git's ref-name rules, as ``git check-ref-format`` states them) or a commit
(40 hex digits); nothing else. huggingface_hub opens ``refs/<revision>`` in the local cache as a path, so a
revision such as ``../../x`` or ``/etc`` would otherwise name any file on the server. Every bad Hub reference is
the same error, so the answer never tells which paths exist.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from kiln.errors import SpecError

FIELD = "checkpoint"
#: (what is wrong, how to fix it)
Problem = tuple[str, str]


@dataclass(frozen=True)
class Source:
    kind: str  # the ResolvedCheckpoint kind and the key of builder/resolve.py's I/O table
    prefix: str | None  # the scheme prefix that selects it; None: the fallback (a path or file://)
    form: str  # how a reference is written, for help and errors
    schemes: str  # how its scheme is written, for the unsupported-scheme fix
    #: (what is wrong or None, the canonical reference); ``roots``: where local checkpoints may lie
    check: Callable[[str, Sequence[Path]], tuple[Problem | None, str]]
    #: the reference's parts (a SpecError naming ``checkpoint`` when it is malformed); ``format(*parts)`` is the
    #: reference again, in canonical form
    parse: Callable[[str], tuple[str, ...]]
    format: Callable[..., str]
    base_name: Callable[[str], str]  # the name a canonical reference gives a model, before normalising
    link: Callable[[str], str]  # where it came from, as a URL a registry UI can link
    #: what a tracked model follows on it ("a Hugging Face branch"), None: no tracked model follows it
    follows: str | None
    #: well-formed and malformed references, for the conformance tests (``{root}``: a checkpoint root holding
    #: ``tiny/config.json``)
    examples: tuple[str, ...]
    bad_examples: tuple[str, ...]


# -- hf:// -----------------------------------------------------------------------------------------
HF_PREFIX = "hf://"
#: The Hub's repo id rule (huggingface_hub's validate_repo_id): word characters, '-' and '.', 1–96 of them,
#: starting and ending with a word character, no '--' or '..'.
_REPO_PART = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?")
COMMIT_RE = re.compile(r"[0-9a-f]{40}")
_REF_FORBIDDEN = re.compile(r"[\x00-\x20\x7f~^:?*\[\\]")
HF_FIX = "write hf://org/name@revision, where revision is a branch or tag name or a 40-hex commit"


def hf_ref_problem(ref: str) -> str | None:
    """Why ``ref`` (``hf://…``) is not a valid Hub reference, or None."""
    repo, at, revision = ref[len(HF_PREFIX):].partition("@")
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
        raise SpecError(f"{ref!r} {problem}", field=FIELD, fix=HF_FIX)
    repo, _, revision = ref[len(HF_PREFIX):].partition("@")
    return repo, revision or "main"


def _hf_check(ref: str, roots: Sequence[Path]) -> tuple[Problem | None, str]:
    problem = hf_ref_problem(ref)
    return ((f"{ref!r} {problem}", HF_FIX) if problem else None), ref


def _hf_repo(ref: str) -> str:
    return ref[len(HF_PREFIX):].split("@", 1)[0]


HF = Source(
    "hf", HF_PREFIX, "hf://org/name@revision", "hf://", _hf_check, parse_hf_ref,
    lambda repo, revision: f"{HF_PREFIX}{repo}@{revision}", _hf_repo,
    lambda ref: "https://huggingface.co/" + _hf_repo(ref), "a Hugging Face branch",
    ("hf://org/name", "hf://org/name@main", "hf://Org-1/Name_2.5@0123abcd", "hf://org/name@" + "a" * 40,
     "hf://org/name@refs/pr/1", "hf://org/name@v1.0"),
    ("hf://name-only", "hf://org/name/extra", "hf://", "hf://org/na me", "hf://../..", "hf://org/..",
     "hf://org/name@/etc", "hf://org/name@../../x", "hf://org/name@a/../b", "hf://org/name@", "hf://org/name@x.lock",
     "hf://org/name@refs/pr/1/", "hf://org/name@//x"))


# -- s3:// -----------------------------------------------------------------------------------------
S3_PREFIX = "s3://"
S3_FIX = "write s3://bucket/prefix"


def _s3_check(ref: str, roots: Sequence[Path]) -> tuple[Problem | None, str]:
    return ((f"{ref!r} names no bucket", S3_FIX) if not urlparse(ref).netloc else None), ref


def parse_s3_ref(ref: str) -> tuple[str, str]:
    """``(bucket, prefix)``, the prefix empty or ending in ``/`` (so ``models/tiny`` and ``models/tiny/`` are
    the same objects, and ``models/tiny-v2`` is not among them); SpecError when it names no bucket."""
    (problem, _) = _s3_check(ref, ())
    if problem:
        raise SpecError(problem[0], field=FIELD, fix=problem[1])
    url = urlparse(ref)
    prefix = url.path.lstrip("/")
    return url.netloc, prefix if not prefix or prefix.endswith("/") else prefix + "/"


S3 = Source(
    "s3", S3_PREFIX, "s3://bucket/prefix", "s3://", _s3_check, parse_s3_ref,
    lambda bucket, prefix: f"{S3_PREFIX}{bucket}/{prefix}",
    lambda ref: urlparse(ref).path.strip("/").split("/")[-1] or urlparse(ref).netloc, lambda ref: ref, None,
    ("s3://bucket/prefix", "s3://bucket/a/b/", "s3://bucket", "s3://my-bucket/models/Tiny_Llama/"),
    ("s3:///prefix-without-bucket", "s3://"))


# -- a directory or file:// ------------------------------------------------------------------------
FILE_PREFIX = "file://"


def local_path(ref: str, *, field: str = FIELD) -> Path:
    """A local reference (a path or file://) as an absolute path. ``~`` is expanded where a home directory is
    known and left as a literal folder name where it is not (services often run without $HOME). A NUL character,
    which no file name can hold, is a :class:`SpecError` naming ``field``."""
    if "\x00" in ref:
        raise SpecError(f"{ref!r} contains a NUL character, which no path can hold", field=field,
                        fix="give the path without it")
    path = Path(urlparse(ref).path if ref.startswith(FILE_PREFIX) else ref)
    try:
        path = path.expanduser()
    except RuntimeError:
        pass
    return path.resolve()


def written_path(ref: str) -> str | None:
    """A local file reference's absolute path as written (``file://`` dropped, nothing resolved), or None for
    anything else: a built-in dataset name, a relative path, a remote reference."""
    path = urlparse(ref).path if ref.startswith(FILE_PREFIX) else ref
    return path if path.startswith("/") else None


def _local_check(ref: str, roots: Sequence[Path]) -> tuple[Problem | None, str]:
    """Only under the configured roots (no traversal), existing, holding config.json; the canonical form is the
    resolved path (the same folder to every process), resolved once."""
    path = local_path(ref)
    if not any(path == root or path.is_relative_to(root) for root in roots):
        # the reference as given: its resolved form would show the server's working directory or $HOME
        return (f"{ref!r} is outside the allowed checkpoint roots",
                "move it under a root or add its parent to KILN_CHECKPOINT_ROOTS"), str(path)
    if not path.exists():
        return (f"{ref!r} does not exist", "give the path of a checkpoint directory"), str(path)
    if not (path / "config.json").is_file():
        return (f"{ref!r} is not a checkpoint directory (no config.json)",
                "give a Hugging Face format directory holding config.json and *.safetensors"), str(path)
    return None, str(path)


LOCAL = Source(
    "local", None, "a directory", "file:// or a directory path", _local_check, lambda ref: (str(local_path(ref)),),
    lambda path: path, lambda ref: Path(ref).name, lambda ref: ref if ref.startswith(FILE_PREFIX) else FILE_PREFIX + ref,
    None,
    ("{root}/tiny", "file://{root}/tiny", "{root}/tiny/", "{root}/./tiny"),
    ("{root}/missing", "{root}", "/", "file:///nowhere/tiny"))

#: every kind, in the order help texts name them
SOURCES: dict[str, Source] = {s.kind: s for s in (HF, S3, LOCAL)}
#: the source tracked models follow (their rows hold its repository and branch)
TRACKED = HF
#: every form a checkpoint reference takes, for help texts
ANY_FORMS = ", ".join(s.form for s in SOURCES.values())
ANY_FIX = "give " + ", ".join(s.form for s in SOURCES.values() if s.prefix) + " or " + LOCAL.form


def source_of(ref: str) -> Source:
    """The source ``ref`` names; a SpecError naming ``checkpoint`` for a scheme no source reads."""
    for source in SOURCES.values():
        if source.prefix and ref.startswith(source.prefix):
            return source
    if "://" in ref and not ref.startswith(FILE_PREFIX):
        raise SpecError(f"unsupported scheme in {ref!r}", field=FIELD,
                        fix="use " + ", ".join(s.schemes for s in SOURCES.values()))
    return LOCAL


def check_ref(ref: object, roots: Sequence[Path]) -> tuple[Problem | None, str]:
    """What is wrong with ``ref`` (or None), and its canonical form (a local path resolved; others as given)."""
    if not isinstance(ref, str) or not ref.strip():
        return ("is empty", ANY_FIX), ""
    if any(ord(c) < 32 or c == "\x7f" for c in ref):
        return (f"{ref!r} contains a control character", f"{ANY_FIX}, without control characters"), ref
    try:
        source = source_of(ref)
    except SpecError as exc:
        return (exc.message, exc.fix or ANY_FIX), ref
    return source.check(ref, roots)


def default_model_name(ref: str) -> str:
    """The repository name a spec without ``model_name`` gets, from its canonical reference (:func:`check_ref`)."""
    name = re.sub(r"[^a-z0-9./_-]+", "-", source_of(ref).base_name(ref).lower()).strip("-._/")
    return re.sub(r"[-._]{2,}", "-", name) or "model"


def source_link(ref: str) -> str:
    """Where the checkpoint came from, as a URL a registry UI can link (hf:// → the Hub page)."""
    return source_of(ref).link(ref)


def tracked_parts(ref: object) -> tuple[str, str]:
    """``(repository, branch)`` of a reference a tracked model may follow; SpecError naming ``checkpoint``."""
    try:
        source = source_of(ref) if isinstance(ref, str) else None
    except SpecError:
        source = None
    if source is not TRACKED or not isinstance(ref, str):
        raise SpecError(f"a tracked model follows {TRACKED.follows}", field=FIELD,
                        fix=f"give {TRACKED.format('org/name', 'branch')}")
    repo, branch = TRACKED.parse(ref)
    return repo, branch

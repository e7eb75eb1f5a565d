"""SQLAlchemy 2 models: the index over the content-addressed store. The store holds bytes by digest; these
rows say what an engine is, where it came from, and whether it may be served."""

from __future__ import annotations

from datetime import datetime, timezone

from sqlalchemy import JSON, BigInteger, Boolean, DateTime, ForeignKey, Index, Integer, String, Text, false
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

DIGEST = String(71)  # "sha256:" + 64 hex


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class Base(DeclarativeBase):
    pass


class Artifact(Base):
    """One published engine image. ``status``: fresh (servable), stale (built from an outdated checkpoint
    head), revoked (withdrawn by an operator), rejected (failed validation; kept for inspection only)."""

    __tablename__ = "artifacts"
    # resolve's lookup: one variant of one model (api/resolution.py)
    __table_args__ = (Index("ix_artifacts_variant", "repository", "precision", "target", "profile", "backend"),)

    digest: Mapped[str] = mapped_column(DIGEST, primary_key=True)
    build_key: Mapped[str] = mapped_column(DIGEST, unique=True, index=True)
    request_key: Mapped[str | None] = mapped_column(DIGEST, index=True, nullable=True)
    repository: Mapped[str] = mapped_column(String(255), index=True)
    tag: Mapped[str] = mapped_column(String(128))
    status: Mapped[str] = mapped_column(String(16), index=True)
    precision: Mapped[str] = mapped_column(String(16))
    target: Mapped[str] = mapped_column(String(16))
    profile: Mapped[str] = mapped_column(String(64))
    backend: Mapped[str] = mapped_column(String(32))
    checkpoint_ref: Mapped[str] = mapped_column(Text)
    checkpoint_digest: Mapped[str] = mapped_column(DIGEST, index=True)
    checkpoint_revision: Mapped[str | None] = mapped_column(String(64), nullable=True)
    size: Mapped[int] = mapped_column(BigInteger)
    provenance: Mapped[dict] = mapped_column(JSON)
    validation: Mapped[dict] = mapped_column(JSON)
    status_reason: Mapped[str | None] = mapped_column(Text, nullable=True)  # why stale / revoked / rejected
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)

    def summary(self) -> dict:
        v = self.validation or {}
        return {
            "digest": self.digest, "build_key": self.build_key, "repository": self.repository, "tag": self.tag,
            "status": self.status, "status_reason": self.status_reason, "precision": self.precision, "target": self.target, "profile": self.profile,
            "backend": self.backend, "checkpoint": {"ref": self.checkpoint_ref, "digest": self.checkpoint_digest,
                                                    "revision": self.checkpoint_revision},
            "size": self.size, "validation": {"passed": v.get("passed")},
            "created_at": self.created_at.isoformat() if self.created_at else None,
        }


BUILD_STATES = ("queued", "running", "succeeded", "failed", "cancelled")
TERMINAL = ("succeeded", "failed", "cancelled")


class Build(Base):
    """One build request. ``active_key`` is the request key within its repository (workers/submit.py) while the
    build is queued or running and NULL afterwards: its unique constraint is what makes concurrent identical
    submissions for one repository one build."""

    __tablename__ = "builds"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    request_key: Mapped[str] = mapped_column(DIGEST, index=True)
    active_key: Mapped[str | None] = mapped_column(DIGEST, unique=True, nullable=True)
    build_key: Mapped[str | None] = mapped_column(DIGEST, nullable=True)
    spec: Mapped[dict] = mapped_column(JSON)
    queue: Mapped[str] = mapped_column(String(128))
    status: Mapped[str] = mapped_column(String(16), index=True)
    stage: Mapped[str | None] = mapped_column(String(16), nullable=True)
    stages: Mapped[list] = mapped_column(JSON, default=list)
    #: the running stage's latest progress event ({stage, step, i, n, elapsed}); None between stages
    progress: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    digest: Mapped[str | None] = mapped_column(DIGEST, nullable=True, index=True)  # the producer of an engine
    error: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    worker: Mapped[str | None] = mapped_column(String(255), nullable=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, index=True)
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class BuildEvent(Base):
    """Stage changes and log lines of a build, in order (``id``), for server-sent events."""

    __tablename__ = "build_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    build_id: Mapped[str] = mapped_column(ForeignKey("builds.id", ondelete="CASCADE"), index=True)
    kind: Mapped[str] = mapped_column(String(16))
    data: Mapped[dict] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Worker(Base):
    """A worker process and what it can build; alive while its heartbeat is recent."""

    __tablename__ = "workers"

    name: Mapped[str] = mapped_column(String(255), primary_key=True)
    queues: Mapped[list] = mapped_column(JSON)
    capabilities: Mapped[dict] = mapped_column(JSON)
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    last_heartbeat: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, index=True)


class Referrer(Base):
    """An OCI artifact manifest whose ``subject`` is an engine (provenance, validation report, signatures)."""

    __tablename__ = "referrers"

    digest: Mapped[str] = mapped_column(DIGEST, primary_key=True)
    subject: Mapped[str] = mapped_column(DIGEST, index=True)
    repository: Mapped[str] = mapped_column(String(255))
    artifact_type: Mapped[str] = mapped_column(String(255))
    size: Mapped[int] = mapped_column(BigInteger)
    annotations: Mapped[dict] = mapped_column(JSON, default=dict)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Tag(Base):
    """``<repository>:<name>`` → engine digest. Moves only to validated, fresh engines."""

    __tablename__ = "tags"

    repository: Mapped[str] = mapped_column(String(255), primary_key=True)
    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    digest: Mapped[str] = mapped_column(DIGEST)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class EngineName(Base):
    """An engine also named in another repository than the one that published it (``Artifact.repository``):
    a build for repository A whose BuildKey B's engine already has gets the same bytes under A's name. A's tags
    and resolve answers may then name it, and A's clients pull it by digest; whether it is stale *for A* is
    decided by A's tracked head (workers/freshness.py), its revocation for every name at once."""

    __tablename__ = "engine_names"

    repository: Mapped[str] = mapped_column(String(255), primary_key=True)
    digest: Mapped[str] = mapped_column(DIGEST, ForeignKey("artifacts.digest", ondelete="CASCADE"), primary_key=True,
                                        index=True)
    reason: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Replica(Base):
    """An engine pushed, with its referrers, to another registry (``kiln push``, ``KILN_REPLICATE_TO``): at
    ``host/repository@digest`` there are the same bytes. Admission judges such a reference as this engine, and
    ``kiln resolve --registry`` prints it (workers/replicas.py). ``host`` is spelled as admission compares hosts
    (lower case, no ``:443``); ``model`` is the Kiln repository the copy stands for (its tracked head decides
    whether the copy is stale, as for a reference to this registry)."""

    __tablename__ = "replicas"
    # admission's question: is this host/repository a place Kiln pushes engines to?
    __table_args__ = (Index("ix_replicas_place", "host", "repository"),)

    digest: Mapped[str] = mapped_column(DIGEST, ForeignKey("artifacts.digest", ondelete="CASCADE"), primary_key=True)
    host: Mapped[str] = mapped_column(String(255), primary_key=True)
    repository: Mapped[str] = mapped_column(String(255), primary_key=True)
    model: Mapped[str] = mapped_column(String(255))
    tag: Mapped[str | None] = mapped_column(String(128), nullable=True)  # the tag pushed with it, if any
    pushed_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class TagEvent(Base):
    """Every tag move, for audit and rollback."""

    __tablename__ = "tag_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    repository: Mapped[str] = mapped_column(String(255), index=True)
    name: Mapped[str] = mapped_column(String(128))
    old_digest: Mapped[str | None] = mapped_column(DIGEST, nullable=True)
    new_digest: Mapped[str | None] = mapped_column(DIGEST, nullable=True)
    reason: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class TrackedModel(Base):
    """A model whose checkpoint branch Kiln follows: when the head moves, engines of the old head go stale and
    the registered matrix is rebuilt for the new one."""

    __tablename__ = "models"

    name: Mapped[str] = mapped_column(String(255), primary_key=True)
    checkpoint: Mapped[str] = mapped_column(Text)  # hf://org/name@branch
    hf_repo: Mapped[str | None] = mapped_column(String(255), index=True, nullable=True)
    branch: Mapped[str | None] = mapped_column(String(255), nullable=True)
    head_sha: Mapped[str | None] = mapped_column(String(64), nullable=True)
    matrix: Mapped[list] = mapped_column(JSON, default=list)
    gates: Mapped[dict] = mapped_column(JSON, default=dict)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class ModelEvent(Base):
    """Every registration of a tracked model (``PUT /v1/models/{name}``): the matrix and gates it set, and the
    ``override_reason`` given when they loosen what they replaced."""

    __tablename__ = "model_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    model: Mapped[str] = mapped_column(String(255), index=True)
    checkpoint: Mapped[str] = mapped_column(Text)
    matrix: Mapped[list] = mapped_column(JSON)
    gates: Mapped[dict] = mapped_column(JSON)
    override_reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class ApiToken(Base):
    """An API token. Only its hash is stored (HMAC-SHA256 keyed with KILN_TOKEN_SECRET when set, else SHA-256);
    the token itself is shown once, when created."""

    __tablename__ = "api_tokens"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(255))
    token_sha256: Mapped[str] = mapped_column(String(64), unique=True, index=True)
    scopes: Mapped[list] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    # False for a token minted while auth was off (or before this was recorded): never honoured.
    issued_with_auth: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class StageOutput(Base):
    """A finished quantize or compile output kept in the blob store: ``key`` (its stage key) → ``digest`` (the
    deterministic tar of the output directory). Any worker reuses it (builder/stagecache.py); ``last_used_at``
    moves on every use, and ``kiln gc`` drops rows no engine needs that were unused for the grace period."""

    __tablename__ = "stage_outputs"

    key: Mapped[str] = mapped_column(DIGEST, primary_key=True)
    stage: Mapped[str] = mapped_column(String(16))
    digest: Mapped[str] = mapped_column(DIGEST, index=True)
    size: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    last_used_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, index=True)


class StageClaim(Base):
    """A worker producing a stage output (builder/claims.py): of the builds that need one quantize or compile
    output at once, on whatever workers, one produces it and the others wait for it. ``expires_at`` moves on while
    the holder works; a claim whose holder died lapses and is taken over."""

    __tablename__ = "stage_claims"

    key: Mapped[str] = mapped_column(DIGEST, primary_key=True)
    holder: Mapped[str] = mapped_column(String(64))
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class BlobLease(Base):
    """A claim on a blob (builder/leases.py). ``purpose`` "use": a writer relies on the blob (dedupe) and has not
    yet recorded a reference to it; "sweep": GC is about to delete it. Each side writes its row, then reads the
    other's, so of a concurrent publish and sweep at least one sees the other."""

    __tablename__ = "blob_leases"

    digest: Mapped[str] = mapped_column(DIGEST, primary_key=True)
    holder: Mapped[str] = mapped_column(String(64), primary_key=True)
    purpose: Mapped[str] = mapped_column(String(8))
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), index=True)
    # when its build ended: it then binds only GC plans made before that (their reference lists predate it)
    released_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)

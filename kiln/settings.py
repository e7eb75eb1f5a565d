"""The one settings object, read from ``KILN_*`` environment variables.

Embedded defaults need no server: SQLite and a local artifact directory under ``KILN_HOME``.

Settings that still hold a shipped placeholder are refused when they are read (:class:`SettingsInvalid`, one line
naming the variables): a ``KILN_*`` value, or boto3's ``AWS_*`` credentials, containing ``REPLACE-ME`` or equal to
a placeholder Kiln once shipped. Every process (API, worker, migrations, CLI) reads its settings before it does
anything, so none starts with a guessable secret.
"""

from __future__ import annotations

import os
import re
from functools import cached_property
from pathlib import Path

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from kiln.errors import SettingsInvalid

#: A value that was never replaced: the manifests' and chart's ``REPLACE-ME…`` (any case, ``_`` or a space too)
PLACEHOLDER_RE = re.compile(r"replace[-_ ]?me", re.IGNORECASE)
#: Secrets Kiln once shipped as defaults (docker-compose.yml's MinIO password)
SHIPPED_PLACEHOLDERS = frozenset({"kiln-minio-secret"})
#: Credentials read from the environment by libraries, not by Settings (boto3), checked the same way
SECRET_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
_FIXES = {
    "KILN_BOOTSTRAP_TOKEN": "make one with openssl rand -hex 32",
    "KILN_WEBHOOK_SECRET": "make one with openssl rand -hex 32",
    "KILN_TOKEN_SECRET": "make one with openssl rand -hex 32",
    "KILN_SIGNING_KEY": "make one with openssl ecparam -name prime256v1 -genkey -noout",
    "KILN_TRUSTED_KEYS": "give the signing key's public half: openssl ec -in signing-key.pem -pubout",
    "KILN_DATABASE_URL": "put the database's real password in the URL",
    "KILN_BROKER_URL": "put the broker's real password in the URL (or none, where it has none)",
}


def is_placeholder(value: str) -> bool:
    return bool(PLACEHOLDER_RE.search(value)) or value.strip() in SHIPPED_PLACEHOLDERS


class Settings(BaseSettings):
    # an empty variable means "not set" (a manifest's `KILN_S3_ENDPOINT_URL: ""` is AWS S3, not an endpoint of "")
    model_config = SettingsConfigDict(env_prefix="KILN_", extra="ignore", env_ignore_empty=True)

    home: Path = Field(default_factory=lambda: Path(os.environ["HOME"]) / ".kiln" if os.environ.get("HOME")
                       else Path("/var/lib/kiln"))
    database_url: str | None = None  # default: sqlite under home
    broker_url: str | None = None  # default: SQLite broker under home (no server)
    store_url: str | None = None  # default: file://<home>/store
    s3_endpoint_url: str | None = None
    # file:// and plain-path checkpoints must lie under one of these (os.pathsep separated).
    # Default: the current working directory.
    checkpoint_roots: str | None = None
    # s3:// checkpoints only from these buckets (comma separated); unset: none. The server reads them with its
    # own credentials, so which buckets a build may name is the operator's choice, not the caller's.
    checkpoint_buckets: str | None = None
    # Folders (os.pathsep separated, under the checkpoint roots) whose evaluation task files may run code: `!function`
    # modules and unsandboxed Jinja templates, on workers only. Unset: none; every task file is data
    # (validation/taskfile.py, docs/security.md).
    trusted_task_dirs: str | None = None
    # The most bytes a worker downloads for one hf:// or s3:// checkpoint (checked from metadata before).
    checkpoint_max_bytes: int = 200 << 30
    webhook_secret: str | None = None
    # API tokens: "required" (every /v1 and /v2 call needs a token with the right scope) or "off" (embedded,
    # single user). Default: required when a bootstrap token is configured, off otherwise.
    auth: str | None = None
    bootstrap_token: str | None = None
    # Tokens are stored as HMAC-SHA256 keyed with this secret (a stolen table then reveals nothing usable);
    # unset: plain SHA-256. Tokens stored before a secret was set keep working after.
    token_secret: str | None = None
    anonymous_read: bool = False  # allow artifacts:read endpoints (resolve, /v2 pulls) without a token
    # allow POST /v1/admission/validate (only) without a token: the Kubernetes API server calls webhooks without one
    anonymous_admission: bool = False
    max_body_bytes: int = 1 << 20
    # The proxies (uvicorn's --forwarded-allow-ips: comma-separated addresses, or "*") whose X-Forwarded-For names
    # the client, e.g. for failed token checks; unset: none, a request's address is its connection's.
    forwarded_allow_ips: str | None = None
    # `kiln pull --server`: the most bytes an engine's layers may declare together (a hostile server is refused
    # before anything is downloaded)
    pull_max_bytes: int = Field(default=256 << 30, gt=0)
    # `kiln pull --server` keeps the layers it downloads in a content-addressed blob cache (api/pull.py), so a
    # fine-tune whose kernel layer is already here downloads only its weights. Default: <cache_dir>/blobs.
    # Least recently used blobs are removed past pull_cache_max_bytes (0: nothing is kept).
    pull_cache_dir: Path | None = None
    pull_cache_max_bytes: int = Field(default=100 << 30, ge=0)
    # Signing: an ECDSA P-256 private key as PEM text or a PEM file's path; default: generated under home/keys.
    signing_key: str | None = None
    # Keys that verify besides the signing key (rotation): PEM text, or PEM files separated by os.pathsep.
    trusted_keys: str | None = None
    # Admission webhook: the registry host names (host[:port], comma separated) whose image references it checks;
    # unset: it denies every image (it cannot tell this registry's). Tag references are denied unless allowed here.
    registry_hosts: str | None = None
    admission_allow_tags: bool = False
    # Admission webhook: places in other registries (host[:port][/path], comma separated) where every image is a Kiln
    # engine copied there by other means than kiln push / replicate_to (which are recorded and need no entry):
    # references there are judged by digest as this registry's (workers/replicas.py)
    trusted_registries: str | None = None
    redirect_blobs: bool = False  # /v2 blob GETs answer 307 to a short-lived presigned S3 URL (S3 stores only)
    # The local stage cache (KILN_HOME/cache) is a bounded cache of the stage outputs kept in the store:
    # least recently used entries are evicted past this many bytes (entries in use by a build never are).
    cache_max_bytes: int = Field(default=100 << 30, ge=0)
    # GC: a blob lease lasts this long after its build ended (and at most lease_ttl_s in all); a GC plan older
    # than the grace period is not swept (builder/leases.py). Stage outputs unused this long may be collected.
    gc_grace_s: float = Field(default=3600.0, gt=0)
    lease_ttl_s: float = Field(default=6 * 3600.0, gt=0)
    # `kiln push` (and replication): credentials per registry host, JSON in the docker config's `auths` shape:
    # {"host[:port]": {"username": "…", "password": "…"} | {"auth": "<base64 user:password>"}}. A host's entry is
    # sent to that host only; a host without one: the docker config's entry, or anonymous (artifacts/push.py).
    registry_auths: str | None = None
    # No longer read (they went to every destination host): set, they are refused (below).
    registry_username: str | None = None
    registry_password: str | None = None
    # After a build succeeds, push its engine with its referrers to host[:port][/prefix] (as
    # <prefix>/<repository>:<tag>); a failed push is recorded in the build's events, the build still succeeds
    # (workers/replication.py). Plain http to a non-loopback host only with replicate_insecure.
    replicate_to: str | None = None
    replicate_insecure: bool = False
    # /docs and /redoc load Swagger UI / ReDoc scripts from a CDN: off unless asked for (/openapi.json always)
    api_docs: bool = False

    @model_validator(mode="after")
    def _refuse_placeholders(self) -> Settings:
        """Refuse a shipped placeholder left in place, and the unscoped registry credentials (see the module's
        doc): raised as :class:`SettingsInvalid` (not a ValueError: pydantic would wrap it in several lines)."""
        names = [f"KILN_{name.upper()}" for name, value in self if isinstance(value, str) and is_placeholder(value)]
        names += [name for name in SECRET_ENV if is_placeholder(os.environ.get(name) or "")]
        if names:
            others = f", and so {'is' if len(names) == 2 else 'are'} {', '.join(names[1:])}" if names[1:] else ""
            raise SettingsInvalid(f"is a placeholder (REPLACE-ME…), not a secret{others}; Kiln does not start with "
                                  f"{'them' if others else 'it'}", field=names[0],
                                  fix=_FIXES.get(names[0], "replace it with a value of your own"))
        unscoped = [n for n, v in (("KILN_REGISTRY_USERNAME", self.registry_username),
                                   ("KILN_REGISTRY_PASSWORD", self.registry_password)) if v]
        if unscoped:
            raise SettingsInvalid("is no longer read: not scoped to a registry host, it went to every host pushed to"
                                  + (f" (so did {unscoped[1]})" if unscoped[1:] else ""), field=unscoped[0],
                                  fix='set KILN_REGISTRY_AUTHS=\'{"host[:port]": {"username": "…", "password": "…"}}\','
                                      ' an entry per host')
        return self

    @property
    def auth_required(self) -> bool:
        return (self.auth or ("required" if self.bootstrap_token else "off")) == "required"

    @cached_property
    def home_dir(self) -> Path:
        return _expand(self.home)

    @property
    def db_url(self) -> str:
        return self.database_url or f"sqlite:///{self.home_dir / 'kiln.db'}"

    @property
    def store(self) -> str:
        return self.store_url or f"file://{self.home_dir / 'store'}"

    @property
    def broker(self) -> str:
        return self.broker_url or f"sqla+sqlite:///{self.home_dir / 'broker.db'}"

    @property
    def cache_dir(self) -> Path:
        """Local stage cache: quantized checkpoints and compiled engines by stage key, a bounded copy of the
        stage outputs in the store (builder/stagecache.py); also resolve's memos and S3 checkpoint downloads."""
        return self.home_dir / "cache"

    @property
    def blob_cache_dir(self) -> Path:
        """`kiln pull --server`'s blob cache: layers by digest (``blobs/sha256/<hex>``, as a store lays them out)."""
        return _expand(self.pull_cache_dir) if self.pull_cache_dir else self.cache_dir / "blobs"

    @property
    def buckets(self) -> list[str]:
        return [b.strip() for b in (self.checkpoint_buckets or "").split(",") if b.strip()]

    @cached_property
    def roots(self) -> list[Path]:
        raw = self.checkpoint_roots or os.getcwd()
        return [_expand(Path(p)) for p in raw.split(os.pathsep) if p]

    @cached_property
    def trusted_task_folders(self) -> list[Path]:
        return [_expand(Path(p)) for p in (self.trusted_task_dirs or "").split(os.pathsep) if p]


def _expand(path: Path) -> Path:
    try:
        path = path.expanduser()
    except RuntimeError:  # no home directory known: keep "~" literally
        pass
    return path.resolve()


def get_settings() -> Settings:
    return Settings()

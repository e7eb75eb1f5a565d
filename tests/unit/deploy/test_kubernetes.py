"""deploy/kubernetes: every manifest validates against the Kubernetes 1.36 schemas (kubernetes-validate, strict:
no unknown fields), and the kustomizations hold together the way ``kustomize build`` would need them to —
listed files exist, names are unique, selectors select the pods they are meant to, Services reach container
ports, NetworkPolicies select real pods, every referenced ConfigMap/Secret/ServiceAccount exists — plus what
the deployment promises: API replicas ≥ 2 with /readyz and /healthz probes, one GPU worker per product on the
TensorRT-LLM 1.2.1 image with nvidia.com/gpu resources, a KILN_HOME of its own for every worker, non-root
security contexts, requests and limits everywhere, real ``kiln`` commands and settings.

No cluster exists here: this is the whole of what was checked (docs/deploy.md says so)."""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path

import click
import kubernetes_validate
import pytest
import yaml

from api.cli import main as kiln_main
from builder.serving import commands as serving_commands
from kiln.settings import Settings

REPO = Path(__file__).resolve().parents[3]
K8S = REPO / "deploy" / "kubernetes"
K8S_VERSION = "1.36"
CERT_MANAGER = "cert-manager.io/v1"
# Settings and options another change was to add; issue 14's (signing, the admission webhook) are real now.
SETTINGS_ELSEWHERE: set[str] = set()
OPTIONS_ELSEWHERE: dict[str, set[str]] = {}
CLUSTER_SCOPED = {"Namespace", "ValidatingWebhookConfiguration"}
WORKLOADS = {"Deployment", "StatefulSet", "Job"}
KILN_IMAGES = {"kiln", "kiln-worker-gpu"}
GPU_PRODUCTS = {"NVIDIA-L40S", "NVIDIA-H100-80GB-HBM3", "NVIDIA-B200"}


def manifest_files() -> list[Path]:
    return sorted(p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml")


def docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


# -- a small kustomize: resources, components, namespace, strategic-merge patches of maps --------------------------
def merge(base: dict, patch: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in patch.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def kustomization(directory: Path) -> dict:
    return yaml.safe_load((directory / "kustomization.yaml").read_text())


def render(directory: Path, components: tuple[Path, ...] = ()) -> list[dict]:
    k = kustomization(directory)
    out: list[dict] = []
    for entry in k.get("resources", []):
        path = (directory / entry).resolve()
        assert path.exists(), f"{directory / 'kustomization.yaml'} lists {entry}, which does not exist"
        out += render(path) if path.is_dir() else docs(path)
    for entry in [*k.get("components", []), *components]:
        path = (directory / entry).resolve()
        assert kustomization(path)["kind"] == "Component", path
        out += render(path)
    for patch in k.get("patches", []):
        p = docs(directory / patch["path"])[0]
        hits = [i for i, d in enumerate(out) if (d["kind"], d["metadata"]["name"]) == (p["kind"], p["metadata"]["name"])]
        assert len(hits) == 1, f"patch {patch['path']} targets {p['kind']}/{p['metadata']['name']}: {len(hits)} matches"
        out[hits[0]] = merge(out[hits[0]], p)
    if k.get("namespace"):
        for d in out:
            if d["kind"] not in CLUSTER_SCOPED:
                d.setdefault("metadata", {})["namespace"] = k["namespace"]
    images = {i["name"]: i for i in k.get("images", [])}
    for pod in (pod_spec(d) for d in out if pod_spec(d)):
        for c in containers(pod):
            if c["image"] in images:
                c["image"] = f"{images[c['image']].get('newName', c['image'])}:{images[c['image']]['newTag']}"
    return out


SHAPES = {
    "base": (K8S / "base", ()),
    "base+admission": (K8S / "base", (K8S / "components" / "admission",)),
    "in-cluster": (K8S / "overlays" / "in-cluster-backends", ()),
    "in-cluster+admission": (K8S / "overlays" / "in-cluster-backends", (K8S / "components" / "admission",)),
}


@pytest.fixture(params=list(SHAPES), scope="module")
def rendered(request) -> list[dict]:
    directory, comps = SHAPES[request.param]
    return render(directory, comps)


@pytest.fixture(params=[name for name in SHAPES if name.startswith("in-cluster")], scope="module")
def in_cluster(request) -> list[dict]:
    """The shapes that run their own PostgreSQL, Redis and MinIO (the base uses managed ones)."""
    directory, comps = SHAPES[request.param]
    return render(directory, comps)


def pod_spec(d: dict) -> dict | None:
    if d["kind"] in ("Deployment", "StatefulSet", "Job"):
        return d["spec"]["template"]["spec"]
    return None


def pod_labels(d: dict) -> dict:
    return d["spec"]["template"]["metadata"]["labels"]


def containers(pod: dict) -> list[dict]:
    return pod.get("initContainers", []) + pod["containers"]


def selects(selector: dict, labels: dict) -> bool:
    for k, v in (selector.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for e in selector.get("matchExpressions") or []:
        present = e["key"] in labels
        if e["operator"] == "In" and labels.get(e["key"]) not in e["values"]:
            return False
        if e["operator"] == "NotIn" and present and labels[e["key"]] in e["values"]:
            return False
        if e["operator"] == "Exists" and not present or e["operator"] == "DoesNotExist" and present:
            return False
    return True


def by_kind(objs: list[dict], kind: str) -> list[dict]:
    return [d for d in objs if d["kind"] == kind]


def names(objs: list[dict], kind: str) -> set[str]:
    return {d["metadata"]["name"] for d in by_kind(objs, kind)}


# -- schemas ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: str(p.relative_to(K8S)))
def test_manifest_validates_against_the_kubernetes_schema(path):
    for d in docs(path):
        if d["apiVersion"] == CERT_MANAGER:  # a CRD: no Kubernetes schema; its fields are checked below
            assert d["kind"] in ("Issuer", "Certificate")
            continue
        kubernetes_validate.validate(d, K8S_VERSION, strict=True)


def test_the_validator_bundles_the_asked_kubernetes_version():
    assert K8S_VERSION in {".".join(v.split(".")[:2]) for v in kubernetes_validate.utils.all_versions()}
    bad = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}, "dat": {}}
    with pytest.raises(kubernetes_validate.ValidationError):  # strict: a misspelt field is an error
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_cert_manager_certificate_serves_the_webhook_service():
    objs = render(K8S / "base", (K8S / "components" / "admission",))
    cert = by_kind(objs, "Certificate")[0]
    issuer = cert["spec"]["issuerRef"]
    assert issuer["kind"] == "Issuer" and issuer["name"] in names(objs, "Issuer")
    svc = next(s for s in by_kind(objs, "Service") if s["metadata"]["name"] == "kiln-admission")
    ns = svc["metadata"]["namespace"]
    assert f"{svc['metadata']['name']}.{ns}.svc" in cert["spec"]["dnsNames"]
    vwc = by_kind(objs, "ValidatingWebhookConfiguration")[0]
    assert vwc["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == f"{ns}/{cert['metadata']['name']}"
    admission = next(d for d in by_kind(objs, "Deployment") if d["metadata"]["name"] == "kiln-admission")
    secrets = {v["secret"]["secretName"] for v in pod_spec(admission)["volumes"] if "secret" in v}
    assert cert["spec"]["secretName"] in secrets


# -- structure -----------------------------------------------------------------------------------------------------
def test_every_kustomization_lists_files_that_exist():
    for k in K8S.rglob("kustomization.yaml"):
        data = yaml.safe_load(k.read_text())
        for entry in data.get("resources", []) + data.get("components", []) + [p["path"] for p in data.get("patches", [])]:
            assert (k.parent / entry).exists(), f"{k}: {entry}"
    listed = set()
    for k in K8S.rglob("kustomization.yaml"):
        data = yaml.safe_load(k.read_text())
        listed |= {(k.parent / e).resolve() for e in data.get("resources", []) + [p["path"] for p in data.get("patches", [])]}
    orphans = [p for p in manifest_files() if p.resolve() not in listed and "examples" not in p.parts]
    assert not orphans, f"manifests no kustomization lists: {orphans}"


def test_names_are_unique_and_selectors_select_their_own_pods(rendered):
    keys = [(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]) for d in rendered]
    assert len(keys) == len(set(keys))
    workloads = [d for d in rendered if d["kind"] in WORKLOADS]
    for w in workloads:
        if w["kind"] != "Job":
            assert selects(w["spec"]["selector"], pod_labels(w)), w["metadata"]["name"]
        for other in workloads:
            if other is not w and w["kind"] != "Job":
                assert not selects(w["spec"]["selector"], pod_labels(other)), \
                    f"{w['metadata']['name']}'s selector also selects {other['metadata']['name']}'s pods"


def test_services_reach_container_ports(rendered):
    workloads = [d for d in rendered if d["kind"] in ("Deployment", "StatefulSet")]
    for svc in by_kind(rendered, "Service"):
        backing = [w for w in workloads if selects({"matchLabels": svc["spec"]["selector"]}, pod_labels(w))]
        assert len(backing) == 1, f"Service {svc['metadata']['name']} selects {len(backing)} workloads"
        ports = [p for c in pod_spec(backing[0])["containers"] for p in c.get("ports", [])]
        for sp in svc["spec"]["ports"]:
            target = sp.get("targetPort", sp["port"])
            assert any(p.get("name") == target or p["containerPort"] == target for p in ports), (svc, sp)
    for st in by_kind(rendered, "StatefulSet"):
        assert st["spec"]["serviceName"] in names(rendered, "Service")


def test_network_policies_select_real_pods(rendered):
    pods = [pod_labels(d) for d in rendered if d["kind"] in WORKLOADS]
    policies = by_kind(rendered, "NetworkPolicy")
    assert any(p["spec"]["podSelector"] == {} and set(p["spec"]["policyTypes"]) == {"Ingress", "Egress"}
               and not p["spec"].get("ingress") and not p["spec"].get("egress") for p in policies), "default deny"
    for p in policies:
        sel = p["spec"]["podSelector"]
        if sel:
            assert any(selects(sel, labels) for labels in pods), f"{p['metadata']['name']} selects no pod"
        for rule in p["spec"].get("ingress", []) + p["spec"].get("egress", []):
            for peer in rule.get("from", []) + rule.get("to", []):
                if "podSelector" in peer and "namespaceSelector" not in peer:
                    assert any(selects(peer["podSelector"], labels) for labels in pods), p["metadata"]["name"]
    # workers and the migrations Job accept no connections: no ingress rule selects them
    for d in rendered:
        component = pod_labels(d).get("app.kubernetes.io/component") if d["kind"] in WORKLOADS else None
        if component in ("worker-cpu", "worker-gpu", "migrate"):
            assert not [p for p in policies if p["spec"].get("ingress") and p["spec"]["podSelector"]
                        and selects(p["spec"]["podSelector"], pod_labels(d))], d["metadata"]["name"]


def test_references_exist(rendered):
    configmaps, secrets = names(rendered, "ConfigMap"), names(rendered, "Secret")
    generated = {c["spec"]["secretName"] for c in by_kind(rendered, "Certificate")}
    accounts = names(rendered, "ServiceAccount")
    for d in rendered:
        pod = pod_spec(d)
        if not pod:
            continue
        if "serviceAccountName" in pod:
            assert pod["serviceAccountName"] in accounts
        for c in containers(pod):
            for src in c.get("envFrom", []):
                if "configMapRef" in src:
                    assert src["configMapRef"]["name"] in configmaps
                if "secretRef" in src:
                    assert src["secretRef"]["name"] in secrets
        for v in pod.get("volumes", []):
            if "secret" in v:
                assert v["secret"]["secretName"] in secrets | generated
            if "configMap" in v:
                assert v["configMap"]["name"] in configmaps
        mounts = {m["name"] for c in containers(pod) for m in c.get("volumeMounts", [])}
        claims = {t["metadata"]["name"] for t in d["spec"].get("volumeClaimTemplates", [])}
        assert mounts <= {v["name"] for v in pod.get("volumes", [])} | claims, d["metadata"]["name"]
    for vwc in by_kind(rendered, "ValidatingWebhookConfiguration"):
        for hook in vwc["webhooks"]:
            ref = hook["clientConfig"]["service"]
            svc = next(s for s in by_kind(rendered, "Service") if s["metadata"]["name"] == ref["name"])
            assert svc["metadata"]["namespace"] == ref["namespace"]
            assert ref["port"] in {p["port"] for p in svc["spec"]["ports"]}


# -- what the deployment promises ------------------------------------------------------------------------------------
def workload(objs: list[dict], name: str) -> dict:
    return next(d for d in objs if d["kind"] in WORKLOADS and d["metadata"]["name"] == name)


def test_api_has_two_replicas_and_health_probes(rendered):
    api = workload(rendered, "kiln-api")
    assert api["spec"]["replicas"] >= 2
    c = pod_spec(api)["containers"][0]
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert workload(rendered, "kiln-migrate")["kind"] == "Job"
    assert pod_spec(workload(rendered, "kiln-migrate"))["containers"][0]["args"] == ["db", "upgrade"]


def test_one_gpu_worker_per_product_on_the_trtllm_image(rendered):
    gpu = [d for d in rendered if d["kind"] == "Deployment" and pod_labels(d).get("app.kubernetes.io/component") == "worker-gpu"]
    products = [pod_spec(d)["nodeSelector"]["nvidia.com/gpu.product"] for d in gpu]
    assert sorted(products) == sorted(GPU_PRODUCTS)
    dockerfile = (REPO / "docker" / "worker-gpu.Dockerfile").read_text()
    tag = re.search(r"^ARG TRTLLM_TAG=(\S+)$", dockerfile, re.M).group(1)
    assert tag == "1.2.1"
    for d in gpu:
        c = pod_spec(d)["containers"][0]
        assert c["image"] == f"kiln-worker-gpu:trtllm-{tag}"
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1 == c["resources"]["requests"]["nvidia.com/gpu"]


def test_every_worker_has_a_kiln_home_of_its_own(rendered):
    for d in rendered:
        if d["kind"] not in WORKLOADS or not pod_labels(d).get("app.kubernetes.io/component", "").startswith("worker"):
            continue
        pod = pod_spec(d)
        mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] == "/var/lib/kiln")
        volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
        assert "emptyDir" in volume or "ephemeral" in volume, f"{d['metadata']['name']}: KILN_HOME must not be shared"


def test_security_contexts_and_resources(rendered):
    for d in rendered:
        pod = pod_spec(d)
        if not pod:
            continue
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        assert pod.get("automountServiceAccountToken") is False
        for c in containers(pod):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c["resources"][kind]), (d["metadata"]["name"], c["name"], kind)


def kiln_args_ok(args: list[str]) -> None:
    cmd = kiln_main.commands[args[0]]
    real = {o for p in cmd.params if isinstance(p, click.Option) for o in p.opts + p.secondary_opts}
    used = {a for a in args[1:] if a.startswith("--")}
    assert used <= real | OPTIONS_ELSEWHERE.get(args[0], set()), (args, used - real)


def test_kiln_containers_run_real_commands_with_real_settings(rendered):
    fields = {f"KILN_{n.upper()}" for n in Settings.model_fields}
    for d in by_kind(rendered, "ConfigMap") + by_kind(rendered, "Secret"):
        data = {**(d.get("data") or {}), **(d.get("stringData") or {})}
        unknown = {k for k in data if k.startswith("KILN_")} - fields - SETTINGS_ELSEWHERE
        assert not unknown, f"{d['metadata']['name']}: {unknown} are not settings (kiln/settings.py)"
    for d in rendered:
        pod = pod_spec(d)
        for c in containers(pod) if pod else []:
            if c["image"].split(":")[0] in KILN_IMAGES:
                kiln_args_ok(c["args"])


# -- the deployer's pod ------------------------------------------------------------------------------------------------
EXAMPLES = K8S / "examples" / "inference"


def example(name: str) -> dict:
    return next(d for f in EXAMPLES.glob("*.yaml") for d in docs(f) if d["metadata"]["name"] == name)


def test_inference_pod_mounts_the_engine_image_by_digest_and_runs_its_serving_config():
    d = example("llama-trtllm")
    pod = pod_spec(d)
    volume = next(v for v in pod["volumes"] if v["name"] == "engine")
    assert re.fullmatch(r"[a-z0-9.:-]+/[a-z0-9./_-]+@sha256:[0-9a-f]{64}", volume["image"]["reference"])
    server = pod["containers"][0]
    mount = next(m for m in server["volumeMounts"] if m["name"] == "engine")
    assert mount["readOnly"] is True and server["workingDir"] == mount["mountPath"]
    assert server["command"] == serving_commands_for_trtllm()
    assert pod["nodeSelector"]["nvidia.com/gpu.product"] in GPU_PRODUCTS
    ns = example("inference")
    assert ns["metadata"]["labels"]["kiln.dev/admission"] == "enabled"
    vwc = docs(K8S / "components" / "admission" / "webhook.yaml")[0]
    assert all(selects(h["namespaceSelector"], ns["metadata"]["labels"]) for h in vwc["webhooks"])
    assert not any(selects(h["namespaceSelector"], docs(K8S / "base" / "namespace.yaml")[0]["metadata"]["labels"])
                   for h in vwc["webhooks"]), "Kiln's own namespace must not be gated by its webhook"


def serving_commands_for_trtllm() -> list[str]:
    from kiln.spec import parse_spec

    spec = parse_spec({"checkpoint": str(REPO / "examples" / "tiny-llama"), "precision": "fp8",
                       "backend": "checkpoint", "target": "sm90"}, [REPO])
    return serving_commands(spec)["tensorrt-llm"]


def test_init_container_alternative_pulls_by_digest_and_verifies_the_signature():
    d = example("llama-trtllm-pulled")
    pod = pod_spec(d)
    init = pod["initContainers"][0]
    args = init["args"]
    assert args[0] == "pull" and re.fullmatch(r"[a-z0-9./_-]+@sha256:[0-9a-f]{64}", args[1])
    assert "--verify-key" in args and "--server" in args
    kiln_args_ok(args)
    key_dir = next(m for m in init["volumeMounts"] if m["name"] == "keys")["mountPath"]
    assert args[args.index("--verify-key") + 1].startswith(key_dir + "/")
    server = pod["containers"][0]
    assert server["workingDir"] == args[2] and server["command"] == serving_commands_for_trtllm()


NEEDS = {  # what each Kiln component must reach: PostgreSQL, Redis, S3 / the Hub
    "api": {5432, 6379, 443}, "admission": {5432}, "worker-cpu": {5432, 6379, 443}, "worker-gpu": {5432, 6379, 443},
    "migrate": {5432},
}


def allowed_ports(policies: list[dict], labels: dict, direction: str) -> set[int]:
    ports: set[int] = set()
    for p in policies:
        if direction.capitalize() in p["spec"]["policyTypes"] and selects(p["spec"]["podSelector"], labels):
            for rule in p["spec"].get(direction, []):
                ports |= {x["port"] for x in rule.get("ports", [])}
    return ports


def test_network_policies_let_every_kiln_pod_reach_what_it_needs(rendered):
    policies = by_kind(rendered, "NetworkPolicy")
    seen = set()
    for d in rendered:
        if d["kind"] not in WORKLOADS:
            continue
        labels = pod_labels(d)
        component = labels.get("app.kubernetes.io/component")
        if component in NEEDS:
            seen.add(component)
            assert NEEDS[component] <= allowed_ports(policies, labels, "egress"), d["metadata"]["name"]
            assert 53 in allowed_ports(policies, labels, "egress")
    assert {"api", "worker-cpu", "worker-gpu", "migrate"} <= seen
    backends = {"postgres": 5432, "redis": 6379, "minio": 9000}
    for d in rendered:  # in-cluster backends: their ingress admits the Kiln pods that need them
        component = pod_labels(d).get("app.kubernetes.io/component") if d["kind"] in WORKLOADS else None
        if component not in backends:
            continue
        port = backends[component]
        rules = [r for p in policies if p["spec"]["podSelector"] and selects(p["spec"]["podSelector"], pod_labels(d))
                 for r in p["spec"].get("ingress", []) if port in {x["port"] for x in r.get("ports", [])}]
        for client in rendered:
            c = pod_labels(client).get("app.kubernetes.io/component") if client["kind"] in WORKLOADS else None
            needed = port in NEEDS.get(c, set()) or (port == 9000 and c in ("api", "worker-cpu", "worker-gpu"))
            if needed:
                assert any(selects(peer["podSelector"], pod_labels(client)) for r in rules for peer in r["from"]), \
                    f"{client['metadata']['name']} cannot reach {d['metadata']['name']}"


def test_only_the_admission_webhook_is_anonymous_and_it_holds_no_token_or_private_key():
    """The base set KILN_ANONYMOUS_READ=true so that the API server could call the webhook: every /v1 GET and /v2
    pull was then anonymous. Only the admission Deployment answers without a token, and only the webhook."""
    objs = render(K8S / "base", (K8S / "components" / "admission",))
    configmaps = {d["metadata"]["name"]: d.get("data") or {} for d in by_kind(objs, "ConfigMap")}
    assert all("KILN_ANONYMOUS_READ" not in data for data in configmaps.values())
    deployments = {d["metadata"]["name"]: d for d in by_kind(objs, "Deployment")}
    for name, d in deployments.items():
        sources = [s for c in containers(pod_spec(d)) for s in c.get("envFrom", [])]
        maps = {s["configMapRef"]["name"] for s in sources if "configMapRef" in s}
        secrets = {s["secretRef"]["name"] for s in sources if "secretRef" in s}
        anonymous = {k for m in maps for k, v in configmaps[m].items() if k.startswith("KILN_ANONYMOUS") and v == "true"}
        if name == "kiln-admission":
            assert anonymous == {"KILN_ANONYMOUS_ADMISSION"}
            assert secrets == {"kiln-backends"}, "the webhook needs the index only: no bootstrap token, no signing key"
            assert "BEGIN PUBLIC KEY" in configmaps["kiln-trusted-keys"]["KILN_TRUSTED_KEYS"]
            assert "kiln-trusted-keys" in maps
        else:
            assert not anonymous, f"{name} answers without a token"


def test_the_webhook_covers_what_docs_admission_says_it_must():
    """docs/admission.md: pods, pods/ephemeralcontainers and the workloads' templates (ephemeral containers are
    added through their own subresource, which a rule on pods alone does not match)."""
    vwc = docs(K8S / "components" / "admission" / "webhook.yaml")[0]
    resources = {(g, r) for h in vwc["webhooks"] for rule in h["rules"] for g in rule["apiGroups"]
                 for r in rule["resources"]}
    assert {("", "pods"), ("", "pods/ephemeralcontainers"), ("apps", "deployments"), ("apps", "statefulsets"),
            ("apps", "daemonsets"), ("apps", "replicasets"), ("batch", "jobs"), ("batch", "cronjobs")} <= resources


def test_every_kiln_container_image_is_tagged_in_every_shape(rendered):
    """A component's resources are not touched by the base's `images` (kustomize applies a kustomization's image
    settings to its own resources): the admission webhook once came out as a bare `kiln`, i.e. `:latest`."""
    for d in rendered:
        pod = pod_spec(d)
        for c in containers(pod) if pod else []:
            name, _, tag = c["image"].rpartition(":")
            if c["image"].split(":")[0].split("/")[-1].startswith("kiln"):
                assert name and tag and tag != "latest", (d["metadata"]["name"], c["image"])


# -- secrets ---------------------------------------------------------------------------------------------------------
def env_of(objs: list[dict], c: dict) -> dict[str, str]:
    """A container's environment from its envFrom, as the kubelet makes it (later sources win)."""
    sources = {(d["kind"], d["metadata"]["name"]): {**(d.get("data") or {}), **(d.get("stringData") or {})}
               for d in objs if d["kind"] in ("ConfigMap", "Secret")}
    env: dict[str, str] = {}
    for src in c.get("envFrom", []):
        kind, ref = ("ConfigMap", src["configMapRef"]) if "configMapRef" in src else ("Secret", src["secretRef"])
        env.update(sources[(kind, ref["name"])])
    env.update({e["name"]: e["value"] for e in c.get("env", []) if "value" in e})
    return {k: str(v) for k, v in env.items()}


def kiln_containers(objs: list[dict]):
    for d in objs:
        pod = pod_spec(d)
        for c in containers(pod) if pod else []:
            if c["image"].split(":")[0] in KILN_IMAGES:
                yield d, c


def test_every_kiln_container_refuses_the_shipped_placeholders(rendered, monkeypatch):
    """The base shipped a bootstrap admin token (REPLACE-ME-openssl-rand-hex-32) that worked: an API started with it
    minted admin tokens; the in-cluster overlay's database and MinIO placeholders matched each other, so the stack
    ran as shipped. Every Kiln container's settings, as shipped, are now refused when read, naming a variable that
    holds a placeholder (tests/integration/test_shipped_configs.py runs the processes)."""
    from kiln.errors import SettingsInvalid

    seen = set()
    for d, c in kiln_containers(rendered):
        env = env_of(rendered, c)
        for k in [k for k in os.environ if k.startswith(("KILN_", "AWS_"))]:
            monkeypatch.delenv(k)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        with pytest.raises(SettingsInvalid) as info:
            Settings()
        assert "REPLACE-ME" in env[info.value.field], (d["metadata"]["name"], info.value.field)
        seen.add(pod_labels(d)["app.kubernetes.io/component"])
    assert {"api", "worker-cpu", "worker-gpu", "migrate"} <= seen


def full_env(objs: list[dict], c: dict) -> dict[str, str]:
    """:func:`env_of` plus the ``valueFrom`` entries (a Secret's or ConfigMap's key), resolved."""
    sources = {(d["kind"], d["metadata"]["name"]): {**(d.get("data") or {}), **(d.get("stringData") or {})}
               for d in objs if d["kind"] in ("ConfigMap", "Secret")}
    env = env_of(objs, c)
    for e in c.get("env", []):
        for kind, ref in (("Secret", "secretKeyRef"), ("ConfigMap", "configMapKeyRef")):
            if ref in e.get("valueFrom", {}):
                key = e["valueFrom"][ref]
                env[e["name"]] = str(sources[(kind, key["name"])][key["key"]])
    return env


def run_shipped(c: dict, env: dict[str, str]):
    """A container's command and args exactly as shipped, run here (its image's /bin/sh is a POSIX shell too)."""
    import subprocess

    assert c["command"][0] == "/bin/sh", c["name"]
    return subprocess.run(["/bin/sh", *c["command"][1:], *c.get("args", [])], env={"PATH": "/usr/bin:/bin", **env},
                          capture_output=True, text=True, timeout=10)


def test_no_backend_pod_starts_with_a_placeholder(rendered):
    """The in-cluster overlay's PostgreSQL and MinIO (third-party images, which know nothing of Kiln's placeholder
    rule) started with its REPLACE-ME passwords. Every pod with a container that is not Kiln's (Kiln's refuse a
    placeholder when reading their settings) and is given a placeholder has an initContainer that refuses it: its
    command, run here as shipped, exits non-zero with one line naming the Secret and key for the shipped value and
    the other spellings Kiln refuses, and exits 0 saying nothing for a real password."""
    import secrets

    from kiln.settings import is_placeholder

    guarded = set()
    for d in rendered:
        pod = pod_spec(d)
        for c in pod["containers"] if pod else []:
            if c["image"].split(":")[0] in KILN_IMAGES:
                continue
            for key, value in full_env(rendered, c).items():
                if not is_placeholder(value):
                    continue
                checks = [(i, k) for i in pod.get("initContainers", []) for k, v in full_env(rendered, i).items()
                          if v == value]  # an initContainer given the same value (the same Secret's key)
                assert checks, f"{d['metadata']['name']}: {c['name']} starts with {key}={value} (a placeholder)"
                for i, k in checks:
                    secret = next(e["valueFrom"]["secretKeyRef"] for e in i["env"] if e["name"] == k)
                    for bad in (value, "", "replace_me", "Replace Me 2", "x-REPLACEME-x", "kiln-minio-secret"):
                        r = run_shipped(i, {k: bad})
                        assert r.returncode != 0, (d["metadata"]["name"], bad)
                        assert r.stdout == "" and len(r.stderr.splitlines()) == 1, r.stderr
                        assert f"Secret {secret['name']} key {secret['key']}" in r.stderr, r.stderr
                        assert "openssl rand" in r.stderr, r.stderr
                    r = run_shipped(i, {k: secrets.token_hex(32)})
                    assert (r.returncode, r.stdout, r.stderr) == (0, "", ""), (d["metadata"]["name"], r.stderr)
                guarded.add(d["metadata"]["name"])
    if any(d["kind"] == "StatefulSet" for d in rendered):  # the in-cluster overlay
        assert guarded == {"kiln-postgres", "kiln-redis", "kiln-minio", "kiln-minio-init"}


def test_in_cluster_backends_require_the_passwords_kilns_urls_carry(in_cluster):
    """Redis ran without a password. Each in-cluster backend now requires the password of its Secret, and Kiln's
    URLs in kiln-backends carry that same value (the operator changes both: docs/deploy.md)."""
    from urllib.parse import urlsplit

    rendered = in_cluster
    kiln = next(d for d in rendered if d["kind"] == "Secret" and d["metadata"]["name"] == "kiln-backends")["stringData"]
    redis = workload(rendered, "kiln-redis")["spec"]["template"]["spec"]["containers"][0]
    env = full_env(rendered, redis)
    args = redis["args"]
    assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"  # expanded by the kubelet from env
    assert env["REDISCLI_AUTH"] == env["REDIS_PASSWORD"] == urlsplit(kiln["KILN_BROKER_URL"]).password
    postgres = full_env(rendered, workload(rendered, "kiln-postgres")["spec"]["template"]["spec"]["containers"][0])
    assert postgres["POSTGRES_PASSWORD"] == urlsplit(kiln["KILN_DATABASE_URL"]).password
    minio = full_env(rendered, workload(rendered, "kiln-minio")["spec"]["template"]["spec"]["containers"][0])
    assert (minio["MINIO_ROOT_USER"], minio["MINIO_ROOT_PASSWORD"]) == (kiln["AWS_ACCESS_KEY_ID"],
                                                                        kiln["AWS_SECRET_ACCESS_KEY"])


def test_only_workers_hold_the_private_signing_key(rendered):
    """API pods held the signing key (a private key); they get its public half (kiln-trusted-keys), as the admission
    webhook always did. Workers, which sign, get the private key."""
    for d, c in kiln_containers(rendered):
        component = pod_labels(d)["app.kubernetes.io/component"]
        sources = c.get("envFrom", [])
        holds_key = {"secretRef": {"name": "kiln-signing-key"}} in sources
        assert holds_key == component.startswith("worker"), (d["metadata"]["name"], component)
        if component in ("api", "admission"):
            assert {"configMapRef": {"name": "kiln-trusted-keys"}} in sources, d["metadata"]["name"]
            assert "BEGIN PUBLIC KEY" in env_of(rendered, c)["KILN_TRUSTED_KEYS"]


def test_the_api_accepts_connections_from_labelled_namespaces_only(rendered):
    """The API's NetworkPolicy admitted any source. It admits pods in namespaces labelled kiln.dev/api-access=true
    (the ingress controller's, CI runners'; docs/deploy.md); the kubelet's probes are always let through."""
    api = workload(rendered, "kiln-api")
    rules = [r for p in by_kind(rendered, "NetworkPolicy") if p["spec"]["podSelector"]
             and selects(p["spec"]["podSelector"], pod_labels(api)) for r in p["spec"].get("ingress", [])]
    assert rules == [{"from": [{"namespaceSelector": {"matchLabels": {"kiln.dev/api-access": "true"}}}],
                      "ports": [{"protocol": "TCP", "port": 8000}]}]

"""The Kubernetes manifests (deploy/k8s), checked without a cluster.

Each overlay is rendered (by `kubectl kustomize` where kubectl is installed, and always by the
small renderer below, which must agree with it), every object is validated against the
Kubernetes JSON schemas bundled in the `kubernetes-validate` package (strict: unknown fields
fail), and then checked for what the schemas cannot see: probes, resources, references
between objects, agreement with docker-compose.yml and openbook's settings. The shell that
the retriever and the index-build Job run is executed for real.
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from openbook.config.settings import CommonSettings
from openbook_gateway.settings import GatewaySettings
from openbook_generator.settings import GeneratorSettings
from openbook_retriever.settings import RetrieverSettings
from openbook_trainer.settings import TrainerSettings

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if p.is_dir())
JOBS = sorted((K8S / "jobs").glob("*.yaml"))
# Oldest Kubernetes we claim (gRPC probes are GA since 1.27) and the newest bundled schemas.
K8S_VERSIONS = ["1.28.0", kubernetes_validate.latest_version()]
NAMESPACE = "openbook"
WORKLOADS = ("Deployment", "StatefulSet", "Job")
GRPC_SERVICES = {"retriever": 8051, "generator": 8052}
# Variables only the manifests' own shell reads (not openbook settings).
MANIFEST_ONLY_VARS = {"OPENBOOK_RETRIEVER_SHARDING"}
# ConfigMaps the operator creates from files in the repository (docs/deploy.md says how).
OPERATOR_CONFIGMAPS = {"openbook-train"}
SETTINGS_CLASSES = (
    CommonSettings,
    RetrieverSettings,
    GeneratorSettings,
    GatewaySettings,
    TrainerSettings,
)


def setting_variables() -> set[str]:
    """Every environment variable some service's settings read: a field's own name
    (``validation_alias``, the deployment-wide ones) or its class's prefix plus its name."""
    names = set()
    for cls in SETTINGS_CLASSES:
        prefix = cls.model_config.get("env_prefix", "")
        for name, field in cls.model_fields.items():
            alias = field.validation_alias
            names.add(alias if isinstance(alias, str) else f"{prefix}{name}".upper())
    return names


# ----------------------------------------------------------------------------- rendering


def _load(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _merge(base, patch):
    """Strategic merge as far as these manifests need it: maps merge, lists of named maps
    (containers, ports, env, volumes) merge by name, other lists are replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for key, value in patch.items():
            out[key] = _merge(base[key], value) if key in base else copy.deepcopy(value)
        return out
    if (
        isinstance(base, list)
        and isinstance(patch, list)
        and all(isinstance(x, dict) and "name" in x for x in base + patch)
    ):
        out = [copy.deepcopy(x) for x in base]
        index = {x["name"]: i for i, x in enumerate(out)}
        for item in patch:
            if item["name"] in index:
                out[index[item["name"]]] = _merge(out[index[item["name"]]], item)
            else:
                out.append(copy.deepcopy(item))
        return out
    return copy.deepcopy(patch)


def _apply_patches(objs: list[dict], kdir: Path, spec: dict) -> list[dict]:
    for entry in spec.get("patches", []):
        for patch in _load(kdir / entry["path"]):
            key = (patch["kind"], patch["metadata"]["name"])
            hits = [i for i, o in enumerate(objs) if (o["kind"], o["metadata"]["name"]) == key]
            assert hits, f"{kdir}/{entry['path']}: no {key} to patch"
            for i in hits:
                objs[i] = _merge(objs[i], patch)
    return objs


def render(kdir: Path) -> list[dict]:
    """A small kustomize: resources, components, patches, namespace, labels."""
    spec = yaml.safe_load((kdir / "kustomization.yaml").read_text())
    objs: list[dict] = []
    for res in spec.get("resources", []):
        path = kdir / res
        objs += render(path) if path.is_dir() else _load(path)
    for comp in spec.get("components", []):
        cdir = kdir / comp
        cspec = yaml.safe_load((cdir / "kustomization.yaml").read_text())
        assert cspec["kind"] == "Component", cdir
        for res in cspec.get("resources", []):
            objs += _load(cdir / res)
        objs = _apply_patches(objs, cdir, cspec)
    objs = _apply_patches(objs, kdir, spec)
    for obj in objs:
        if "namespace" in spec and obj["kind"] != "Namespace":
            obj["metadata"]["namespace"] = spec["namespace"]
        for group in spec.get("labels", []):
            obj["metadata"].setdefault("labels", {}).update(group["pairs"])
    return objs


def _key(obj: dict) -> tuple[str, str]:
    return obj["kind"], obj["metadata"]["name"]


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request) -> tuple[str, list[dict]]:
    return request.param, render(K8S / "overlays" / request.param)


def by_kind(objs: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


def containers(obj: dict) -> list[dict]:
    return obj["spec"]["template"]["spec"]["containers"]


def env_of(container: dict, objs: list[dict]) -> dict[str, str]:
    """The container's environment as the kubelet would set it (ConfigMaps resolved)."""
    env: dict[str, str] = {}
    maps = by_kind(objs, "ConfigMap")
    for source in container.get("envFrom", []):
        env.update(maps[source["configMapRef"]["name"]]["data"])
    for var in container.get("env", []):
        env[var["name"]] = var.get(
            "value", "<from " + next(iter(var.get("valueFrom", {})), "") + ">"
        )
    return env


def all_objects() -> list[dict]:
    objs = render(K8S / "overlays" / "gpu")
    for job in JOBS:
        objs += _load(job)
    return objs


# ----------------------------------------------------------------------------- structure


def test_layout_has_every_piece_the_system_needs():
    assert {"gpu", "cpu", "gpu-sharded"} <= set(OVERLAYS)
    objs = all_objects()
    kinds = {_key(o) for o in objs}
    assert {
        ("Deployment", "redis"),
        ("StatefulSet", "retriever"),
        ("Deployment", "generator"),
        ("Deployment", "gateway"),
        ("HorizontalPodAutoscaler", "gateway"),
        ("Job", "trainer"),
        ("Job", "index-build"),
        ("Secret", "openbook-admin"),
        ("Job", "openbook-secrets"),
        ("ServiceAccount", "openbook-secrets"),
        ("Role", "openbook-secrets"),
        ("RoleBinding", "openbook-secrets"),
        ("NetworkPolicy", "default-deny-ingress"),
        ("PersistentVolumeClaim", "openbook-indexes"),
        ("PersistentVolumeClaim", "openbook-checkpoints"),
    } <= kinds
    assert len(kinds) == len(objs), "an object is defined twice"


def test_patches_only_touch_maps_and_named_lists():
    # The small renderer merges lists by name; a patch with another kind of list would need
    # kustomize's full strategic-merge rules, which it does not implement.
    def check(node, where):
        if isinstance(node, dict):
            for k, v in node.items():
                check(v, f"{where}.{k}")
        elif isinstance(node, list):
            assert all(isinstance(x, dict) and "name" in x for x in node), where
            for x in node:
                check(x, where)

    for kfile in K8S.rglob("kustomization.yaml"):
        for entry in yaml.safe_load(kfile.read_text()).get("patches", []):
            for patch in _load(kfile.parent / entry["path"]):
                check(patch, f"{kfile.parent.name}/{entry['path']}")


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
def test_small_renderer_agrees_with_kubectl_kustomize(overlay):
    name, objs = overlay
    try:
        out = subprocess.run(
            ["kubectl", "kustomize", str(K8S / "overlays" / name)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"kubectl kustomize unusable here: {exc}")
    assert out.returncode == 0, out.stderr
    theirs = {_key(o): o for o in yaml.safe_load_all(out.stdout) if o}
    ours = {_key(o): o for o in objs}
    assert set(theirs) == set(ours)
    for key in ours:
        assert ours[key] == theirs[key], key


# ----------------------------------------------------------------------------- schemas


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_rendered_overlays_match_the_kubernetes_schemas(overlay, version):
    name, objs = overlay
    for obj in objs:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{name}: {_key(obj)} invalid for Kubernetes {version}: {exc.message}")


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("path", JOBS, ids=lambda p: p.name)
def test_jobs_match_the_kubernetes_schemas(path, version):
    for obj in _load(path):
        assert obj["metadata"].get("namespace") == NAMESPACE, path
        kubernetes_validate.validate(obj, version, strict=True)


def test_the_schema_check_catches_typos():
    deployment = copy.deepcopy(by_kind(render(K8S / "overlays" / "gpu"), "Deployment")["gateway"])
    containers(deployment)[0]["readinessProbe"]["httpGet"]["paht"] = "/readyz"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[0], strict=True)


# ----------------------------------------------------------------------------- semantics


def test_every_object_is_in_the_namespace(overlay):
    _, objs = overlay
    for obj in objs:
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == NAMESPACE, _key(obj)


def test_workloads_have_probes_and_resources():
    for obj in all_objects():
        if obj["kind"] not in WORKLOADS:
            continue
        for c in containers(obj):
            res = c.get("resources", {})
            for part in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(res.get(part, {})), (_key(obj), part)
            assert c["securityContext"]["allowPrivilegeEscalation"] is False, _key(obj)
            if obj["kind"] != "Job":
                assert "readinessProbe" in c and "livenessProbe" in c, _key(obj)


def test_grpc_services_are_probed_with_grpc_health(overlay):
    _, objs = overlay
    workloads = {**by_kind(objs, "Deployment"), **by_kind(objs, "StatefulSet")}
    for name, port in GRPC_SERVICES.items():
        c = containers(workloads[name])[0]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"]["port"] == port, (name, probe)
        assert c["readinessProbe"]["grpc"]["service"] == f"openbook.v1.{name.capitalize()}"
    gateway = containers(workloads["gateway"])[0]
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert gateway["livenessProbe"]["httpGet"]["path"] == "/healthz"


def test_services_select_pods_and_name_their_ports(overlay):
    _, objs = overlay
    pods = [
        (o["spec"]["template"]["metadata"]["labels"], containers(o))
        for o in objs
        if o["kind"] in ("Deployment", "StatefulSet")
    ]
    for name, svc in by_kind(objs, "Service").items():
        selector = svc["spec"]["selector"]
        matched = [cs for labels, cs in pods if selector.items() <= labels.items()]
        assert matched, f"Service {name} selects no pods"
        port_names = {p.get("name") for cs in matched for c in cs for p in c.get("ports", [])}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in port_names, (name, port)
    for obj in objs:
        if obj["kind"] in ("Deployment", "StatefulSet"):
            selector = obj["spec"]["selector"]["matchLabels"]
            assert selector.items() <= obj["spec"]["template"]["metadata"]["labels"].items()


def test_references_between_objects_resolve():
    objs = all_objects()
    names = {_key(o) for o in objs}
    for obj in objs:
        if obj["kind"] not in WORKLOADS:
            continue
        spec = obj["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for v in volumes.values():
            if "persistentVolumeClaim" in v:
                claim = v["persistentVolumeClaim"]["claimName"]
                assert ("PersistentVolumeClaim", claim) in names, (_key(obj), claim)
        for v in volumes.values():
            if "configMap" in v:
                name = v["configMap"]["name"]
                assert ("ConfigMap", name) in names or name in OPERATOR_CONFIGMAPS, name
        for c in spec["containers"]:
            for mount in c.get("volumeMounts", []):
                assert mount["name"] in volumes, (_key(obj), mount["name"])
            for source in c.get("envFrom", []):
                assert ("ConfigMap", source["configMapRef"]["name"]) in names
            for var in c.get("env", []):
                ref = var.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ("Secret", ref["name"]) in names, (_key(obj), ref)
    for hpa in by_kind(objs, "HorizontalPodAutoscaler").values():
        target = hpa["spec"]["scaleTargetRef"]
        assert (target["kind"], target["name"]) in names
    for pdb in by_kind(objs, "PodDisruptionBudget").values():
        assert any(
            pdb["spec"]["selector"]["matchLabels"].items()
            <= o["spec"]["template"]["metadata"]["labels"].items()
            for o in objs
            if o["kind"] in ("Deployment", "StatefulSet")
        ), pdb["metadata"]["name"]


def test_operator_made_configmaps_are_documented():
    doc = (ROOT / "docs" / "deploy.md").read_text()
    for name in OPERATOR_CONFIGMAPS:
        assert f"create configmap {name}" in doc


def test_gateway_is_autoscaled_and_gets_the_admin_token_from_the_secret():
    objs = render(K8S / "overlays" / "gpu")
    hpa = by_kind(objs, "HorizontalPodAutoscaler")["gateway"]
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "gateway",
    }
    assert 1 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    gateway = containers(by_kind(objs, "Deployment")["gateway"])[0]
    token = next(v for v in gateway["env"] if v["name"] == "OPENBOOK_ADMIN_TOKEN")
    assert token["valueFrom"]["secretKeyRef"]["name"] == "openbook-admin"
    secret = by_kind(objs, "Secret")["openbook-admin"]
    assert secret["stringData"]["token"] == "", "never commit an admin token"


def test_services_with_admin_rpcs_get_the_admin_token_from_the_secret(overlay):
    # The gateway forwards its token on SwapIndex / ReloadModel: all three must share it.
    _, objs = overlay
    workloads = {**by_kind(objs, "Deployment"), **by_kind(objs, "StatefulSet")}
    for name in ("gateway", "retriever", "generator"):
        env = {v["name"]: v for v in containers(workloads[name])[0]["env"]}
        ref = env["OPENBOOK_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert (ref["name"], ref["key"]) == ("openbook-admin", "token"), name


def _ingress_peers(policies: list[dict], pod_labels: dict, port_name: str) -> list[dict]:
    """Every ``from`` peer that some policy selecting these pods admits on ``port_name``
    ([{}] when a rule admits everyone)."""
    peers = []
    for policy in policies:
        if not policy["spec"]["podSelector"].get("matchLabels", {}).items() <= pod_labels.items():
            continue
        for rule in policy["spec"].get("ingress", []):
            ports = [p.get("port") for p in rule.get("ports", [])]
            if ports and port_name not in ports:
                continue
            peers += rule.get("from") or [{}]
    return peers


def test_network_policies_admit_only_the_gateway_to_internal_ports(overlay):
    _, objs = overlay
    policies = list(by_kind(objs, "NetworkPolicy").values())
    deny = by_kind(objs, "NetworkPolicy")["default-deny-ingress"]["spec"]
    assert deny["podSelector"] == {} and deny["policyTypes"] == ["Ingress"]
    assert "ingress" not in deny
    workloads = {**by_kind(objs, "Deployment"), **by_kind(objs, "StatefulSet")}
    labels = {n: w["spec"]["template"]["metadata"]["labels"] for n, w in workloads.items()}
    gateway_only = [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "gateway"}}}]
    for name in ("retriever", "generator"):
        assert _ingress_peers(policies, labels[name], "grpc") == gateway_only, name
        # Metrics are read-only: open to the cluster's Prometheus, never to the world.
        assert _ingress_peers(policies, labels[name], "metrics") == [{"namespaceSelector": {}}]
    redis_peers = _ingress_peers(policies, labels["redis"], "redis")
    assert {p["podSelector"]["matchLabels"]["app.kubernetes.io/name"] for p in redis_peers} == {
        "gateway",
        "retriever",
        "generator",
    }
    assert all(set(p) == {"podSelector"} for p in redis_peers)  # this namespace only
    assert _ingress_peers(policies, labels["gateway"], "http") == [{}]  # the public API
    # Every port a policy names is a named port of the pods it selects.
    for policy in policies:
        selected = [
            containers(w)
            for w in workloads.values()
            if policy["spec"]["podSelector"].get("matchLabels", {}).items()
            <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
        names = {p["name"] for cs in selected for c in cs for p in c.get("ports", [])}
        for rule in policy["spec"].get("ingress", []):
            for port in rule.get("ports", []):
                assert port["port"] in names, (policy["metadata"]["name"], port)


def test_services_mirror_docker_compose():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    objs = render(K8S / "overlays" / "cpu")
    workloads = {**by_kind(objs, "Deployment"), **by_kind(objs, "StatefulSet")}
    ports = {"retriever": 8051, "generator": 8052, "gateway": 8000}
    for name, port in ports.items():
        service, c = compose[name], containers(workloads[name])[0]
        assert c["image"] == service["image"], name
        assert " ".join(c["command"] + c.get("args", [])).rstrip().endswith(service["command"])
        assert port in [p["containerPort"] for p in c["ports"]], name
        # compose's default port, and where the service listens in its container
        assert service["environment"][f"OPENBOOK_{name.upper()}_PORT"].endswith(f":-{port}}}")
        assert env_of(c, objs)[f"OPENBOOK_{name.upper()}_PORT"] == str(port), name
        assert service["environment"][f"OPENBOOK_{name.upper()}_HOST"] == "0.0.0.0", name
        assert env_of(c, objs)[f"OPENBOOK_{name.upper()}_HOST"] == "0.0.0.0", name
        # Every variable compose sets reaches the pod too (the token from the Secret).
        assert set(service["environment"]) <= set(env_of(c, objs)), name
    # The same volumes at the same paths.
    mounts = {m["mountPath"] for c in containers(workloads["retriever"]) for m in c["volumeMounts"]}
    assert {"/var/openbook/indexes", "/var/openbook/models"} <= mounts
    trainer = containers(_load(K8S / "jobs" / "trainer.yaml")[0])[0]
    assert compose["trainer"]["command"].startswith(" ".join(trainer["command"][:3]))
    assert trainer["image"].startswith(compose["trainer"]["image"])


def test_every_openbook_variable_is_a_real_setting():
    # A misspelt OPENBOOK_* variable is silently ignored by pydantic-settings: catch it here.
    settings = setting_variables()
    compose = (ROOT / "docker-compose.yml").read_text()
    objs = all_objects()
    for obj in objs:
        if obj["kind"] not in WORKLOADS:
            continue
        for c in containers(obj):
            for var in env_of(c, objs):
                if var.startswith("OPENBOOK_") and var not in MANIFEST_ONLY_VARS:
                    assert var in settings or var in compose, (_key(obj), var)
    # ... and so is every one docker-compose.yml sets in a service's environment.
    for name, service in yaml.safe_load(compose)["services"].items():
        for var in service.get("environment") or {}:
            if var.startswith("OPENBOOK_"):
                assert var in settings, (f"docker-compose.yml {name}", var)


def test_generator_variants():
    gpu = containers(by_kind(render(K8S / "overlays" / "gpu"), "Deployment")["generator"])[0]
    cpu_objs = render(K8S / "overlays" / "cpu")
    cpu = containers(by_kind(cpu_objs, "Deployment")["generator"])[0]
    for part in ("requests", "limits"):
        assert gpu["resources"][part]["nvidia.com/gpu"] == 1
        assert "nvidia.com/gpu" not in cpu["resources"][part]
    assert env_of(gpu, cpu_objs)["OPENBOOK_GENERATOR_DEVICE"] == "cuda"
    assert env_of(cpu, cpu_objs)["OPENBOOK_GENERATOR_DEVICE"] == "cpu"
    trainer = containers(_load(K8S / "jobs" / "trainer.yaml")[0])[0]
    assert trainer["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_retriever_mode_is_selectable():
    for name in ("gpu", "cpu"):
        objs = render(K8S / "overlays" / name)
        config = by_kind(objs, "ConfigMap")["openbook-config"]["data"]
        assert config["OPENBOOK_RETRIEVER_SHARDING"] == "replicated"
        assert (
            config["OPENBOOK_GATEWAY_RETRIEVER_ADDR"] == "retriever.openbook.svc.cluster.local:8051"
        )

    objs = render(K8S / "overlays" / "gpu-sharded")
    config = by_kind(objs, "ConfigMap")["openbook-config"]["data"]
    retriever = by_kind(objs, "StatefulSet")["retriever"]
    headless = by_kind(objs, "Service")[retriever["spec"]["serviceName"]]
    assert headless["spec"]["clusterIP"] == "None"
    assert config["OPENBOOK_RETRIEVER_SHARDING"] == "sharded"
    n = retriever["spec"]["replicas"]
    assert n >= 2
    assert config["OPENBOOK_GATEWAY_RETRIEVER_ADDR"].split(",") == [
        f"retriever-{i}.{headless['metadata']['name']}.openbook.svc.cluster.local:8051"
        for i in range(n)
    ]
    # The patch kept everything else of the container.
    assert containers(retriever)[0]["readinessProbe"]["grpc"]["port"] == 8051


# ----------------------------------------------------------------------------- the shell


def _shell_env(job_env: dict[str, str], **overrides: str) -> dict[str, str]:
    """The environment a Job's shell runs in here: this process's (without openbook settings),
    the Job's own variables, this virtualenv's commands first on PATH, then ``overrides``."""
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith("OPENBOOK_")},
        **job_env,
        "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}",
        **overrides,
    }


def _script(obj: dict) -> str:
    c = containers(obj)[0]
    assert c["command"] == ["/bin/sh", "-c"]
    return c["args"][0]


def _fake_openbook(tmp_path: Path, command: str = "openbook-retriever") -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / command
    fake.write_text(f'#!/bin/sh\necho "{command} $* root=$OPENBOOK_INDEX_ROOT"\n')
    fake.chmod(0o755)
    return bin_dir


@pytest.mark.parametrize(
    ("mode", "hostname", "root"),
    [
        ("replicated", "retriever-3", "/var/openbook/indexes"),
        ("sharded", "retriever-0", "/var/openbook/indexes/shards/shard-0"),
        ("sharded", "retriever-12", "/var/openbook/indexes/shards/shard-12"),
    ],
)
def test_retriever_pod_serves_its_shard(tmp_path, mode, hostname, root):
    script = _script(by_kind(render(K8S / "overlays" / "gpu"), "StatefulSet")["retriever"])
    env = {
        "PATH": f"{_fake_openbook(tmp_path)}:/usr/bin:/bin",
        "HOSTNAME": hostname,
        "OPENBOOK_INDEX_ROOT": "/var/openbook/indexes",
        "OPENBOOK_RETRIEVER_SHARDING": mode,
    }
    out = subprocess.run(
        ["/bin/sh", "-c", script], env=env, capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1].split() == ["openbook-retriever", f"root={root}"]


def test_index_build_job_builds_then_shards_for_real(tmp_path):
    from openbook_testkit.index import fact_rows, write_jsonl

    job = _load(K8S / "jobs" / "index-build.yaml")[0]
    data, indexes = tmp_path / "data", tmp_path / "indexes"
    write_jsonl(data / "facts.jsonl", fact_rows())
    env = _shell_env(
        {v["name"]: v["value"] for v in containers(job)[0]["env"]},
        OPENBOOK_INDEX_ROOT=str(indexes),
        OPENBOOK_DATA_DIR=str(data),
        INDEX_NAME="facts",
        PASSAGES="facts.jsonl",
        PASSAGES_FORMAT="jsonl",
        INDEX_TYPE="flat",
        ENCODER="all-MiniLM-L6-v2",
        QUERY_ENCODER="",
        SHARDS="2",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )

    def run() -> subprocess.CompletedProcess:
        return subprocess.run(
            ["/bin/sh", "-c", _script(job)], env=env, capture_output=True, text=True, timeout=300
        )

    out = run()
    assert out.returncode == 0, out.stdout + out.stderr
    assert "index facts ready" in out.stdout
    assert (indexes / "facts" / "manifest.json").is_file()
    for i in range(2):
        assert (indexes / "shards" / f"shard-{i}" / "facts" / "manifest.json").is_file()
    assert not (indexes / ".split-facts").exists()

    from openbook.index.loaded import open_index

    with open_index(indexes / "shards" / "shard-1" / "facts", verify=True) as shard:
        assert shard.name == "facts"

    # A retry skips the finished build and refuses to overwrite shards in use.
    again = run()
    assert again.returncode == 1
    assert "skipping the build" in again.stdout
    assert "exists: build under a new INDEX_NAME" in again.stderr


def test_distributed_training_job_runs_torchrun_for_real(tmp_path):
    """The multi-node training Job: pods find pod 0 through the headless Service, and the
    container's script is torchrun running `openbook train` (here: one node of two ranks on the
    CPU, rendezvous on localhost) to a checkpoint."""
    import socket

    from openbook.storage.checkpoint import latest_checkpoint
    from openbook_trainer.experiments.synthetic import make_task

    objs = _load(K8S / "jobs" / "trainer-distributed.yaml")
    service, job = by_kind(objs, "Service"), by_kind(objs, "Job")
    (svc_name, svc), (job_name, job) = *service.items(), *job.items()
    pod = job["spec"]["template"]
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert pod["spec"]["subdomain"] == svc_name
    assert job["spec"]["completionMode"] == "Indexed"
    container = containers(job)[0]
    env = {v["name"]: v["value"] for v in container["env"]}
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == int(env["NNODES"])
    assert container["resources"]["limits"]["nvidia.com/gpu"] == int(env["NPROC_PER_NODE"])
    assert env["RDZV_HOST"] == f"{job_name}-0.{svc_name}"  # Indexed Job pod 0's DNS name
    assert {p["port"] for p in svc["spec"]["ports"]} == {int(env["RDZV_PORT"])}

    task = make_task(tmp_path / "task", n_entities=6)
    config = tmp_path / "train.yaml"
    out = tmp_path / "checkpoints"
    config.write_text(
        yaml.safe_dump(
            {
                "train": str(task.train),
                "index": str(task.index),
                "generator": str(task.generator),
                "out": str(out),
                "k": 2,
                "batch_size": 4,
                "steps": 2,
                "dist_timeout": 120,
            }
        )
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run_env = _shell_env(
        env,
        NNODES="1",
        NPROC_PER_NODE="2",
        RDZV_HOST="127.0.0.1",
        RDZV_PORT=str(port),
        TRAIN_DEVICE="cpu",
        TRAIN_CONFIG=str(config),
        OMP_NUM_THREADS="1",
    )
    done = subprocess.run(
        ["/bin/sh", "-c", _script(job)], env=run_env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr
    ckpt = latest_checkpoint(out)
    assert ckpt is not None and ckpt.name == "step-000002"
    import torch

    state = torch.load(ckpt / "trainer_state.pt", weights_only=True)
    assert state["world_size"] == 2


def test_parallel_index_build_job_builds_slices_then_the_last_pod_joins_for_real(tmp_path):
    """The Indexed Job of docs/deploy.md's parallel build: one pod per slice and GPU, each
    resumable on its own; run here as two pods at once on the CPU, then a retried pod, then the
    merged variant."""
    from openbook.index.loaded import open_index
    from openbook_testkit.index import fact_rows, write_jsonl

    job = _load(K8S / "jobs" / "index-build-parallel.yaml")[0]
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    container = containers(job)[0]
    env = {v["name"]: v["value"] for v in container["env"]}
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == int(env["SHARDS"])
    assert spec["backoffLimitPerIndex"] >= 1 and pod["restartPolicy"] == "Never"
    for part in ("requests", "limits"):
        assert container["resources"][part]["nvidia.com/gpu"] == 1
    assert env["ENCODE_DEVICE"] == "cuda" and env["SERVE_AS"] == "sharded"
    assert env["INDEX_TYPE"] not in ("hnsw-sq8", "ivfpq")  # refused per slice
    # The sharded retrievers serve what --into installs: OPENBOOK_INDEX_ROOT/shards/shard-<i>.
    assert '--into "$OPENBOOK_INDEX_ROOT/shards"' in _script(job)

    data, indexes = tmp_path / "data", tmp_path / "indexes"
    write_jsonl(data / "facts.jsonl", fact_rows())
    base = _shell_env(
        env,
        OPENBOOK_INDEX_ROOT=str(indexes),
        OPENBOOK_DATA_DIR=str(data),
        INDEX_NAME="facts",
        PASSAGES="facts.jsonl",
        PASSAGES_FORMAT="jsonl",
        INDEX_TYPE="flat",
        ENCODER="all-MiniLM-L6-v2",
        QUERY_ENCODER="",
        BATCH_SIZE="8",
        SHARDS="2",
        ENCODE_DEVICE="cpu",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )

    def start(index: int, **more: str) -> subprocess.Popen:
        return subprocess.Popen(
            ["/bin/sh", "-c", _script(job)],
            env={**base, "JOB_COMPLETION_INDEX": str(index), **more},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def finish(proc: subprocess.Popen) -> str:
        out = proc.communicate(timeout=300)[0]
        assert proc.returncode == 0, out
        return out

    outs = [finish(p) for p in [start(0), start(1)]]
    assert sum("joined 'facts': 2 shards, 30 passages" in o for o in outs) >= 1
    for i in range(2):
        with open_index(indexes / "shards" / f"shard-{i}" / "facts", verify=True) as shard:
            assert shard.name == "facts" and shard.manifest.shard["index"] == i
    assert (indexes / "sets" / "facts" / "shards.json").is_file()
    assert not (indexes / "facts").exists()  # sharded: nothing for the replicated retrievers

    # A retried pod (say its first attempt died after the join) changes nothing.
    again = finish(start(1))
    assert "already joined" in again and "installed" in again

    # SERVE_AS=merged: one unsharded index, here rebuilt as hnsw from the flat slices.
    merged = finish(start(0, SERVE_AS="merged", MERGE_TYPE="hnsw"))
    assert "merged hnsw index, 30 passages" in merged
    with open_index(indexes / "facts", verify=True) as idx:
        assert idx.manifest.index_type == "hnsw" and idx.manifest.shard is None


def test_every_job_is_in_the_deploy_docs_listing():
    listing = (ROOT / "docs" / "deploy.md").read_text().split("## What is in `deploy/k8s/`")[1]
    listing = listing.split("```")[1]
    for job in JOBS:
        assert f"    {job.name} " in listing, job.name


# ------------------------------------------------------------ redis: authenticated (issue 29)


def _secret_files(obj: dict, container: dict) -> dict[str, str]:
    """Container path -> key of Secret openbook-redis, for every file the pod mounts of it."""
    spec = obj["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    files = {}
    for mount in container.get("volumeMounts", []):
        secret = volumes[mount["name"]].get("secret")
        if secret and secret["secretName"] == "openbook-redis":
            assert mount.get("readOnly") is True
            for item in secret["items"]:
                files[f"{mount['mountPath']}/{item['path']}"] = item["key"]
    return files


def test_redis_lets_in_only_the_acl_user_of_the_secret(overlay, tmp_path):
    from openbook_deploy.secrets import k8s_secret

    _, objs = overlay
    redis = by_kind(objs, "Deployment")["redis"]
    (c,) = containers(redis)
    args = c["args"]
    acl = args[args.index("--aclfile") + 1]
    files = _secret_files(redis, c)
    assert files[acl] == "redis-users.acl"
    # Ready only when openbook's password gets in, as compose's health check.
    probe = " ".join(c["readinessProbe"]["exec"]["command"])
    assert "--user openbook" in probe and "acl whoami" in probe
    password = next(path for path, key in files.items() if key == "redis-password")
    assert password in probe
    # Redis runs as 999: the Secret's files are readable by its group, nobody else.
    spec = redis["spec"]["template"]["spec"]
    assert spec["securityContext"]["fsGroup"] == spec["securityContext"]["runAsUser"] == 999
    volume = next(v for v in spec["volumes"] if "secret" in v)
    assert volume["secret"]["defaultMode"] == 0o440
    # The keys the manifests use are the ones `openbook-secrets k8s` writes.
    written = set(k8s_secret(tmp_path / "s")["stringData"])
    assert set(files.values()) <= written


def test_every_service_reads_the_password_and_key_the_secret_mounts(overlay, tmp_path):
    from openbook_deploy.secrets import k8s_secret

    _, objs = overlay
    written = set(k8s_secret(tmp_path / "s")["stringData"])
    workloads = {**by_kind(objs, "Deployment"), **by_kind(objs, "StatefulSet")}
    for name in ("gateway", "retriever", "generator"):
        c = containers(workloads[name])[0]
        env = env_of(c, objs)
        files = _secret_files(workloads[name], c)
        assert files[env["OPENBOOK_REDIS_PASSWORD_FILE"]] == "redis-password", name
        assert files[env["OPENBOOK_SERVER_KEY_FILE"]] == "server-key", name
        assert "redis-users.acl" not in files.values(), name  # only Redis needs it
        assert env["OPENBOOK_REDIS_USERNAME"] == "openbook", name
        assert set(files.values()) <= written
    # The Secret is made in the cluster (the openbook-secrets Job) or by the operator, never a
    # committed placeholder (an empty ACL file would let anyone in); the docs say how.
    assert "openbook-redis" not in by_kind(objs, "Secret")
    assert "openbook-secrets k8s" in (ROOT / "docs" / "security.md").read_text()


def test_the_secrets_job_makes_the_secret_as_its_own_service_account(overlay):
    """First start in Kubernetes: a Job runs ``openbook-secrets k8s-ensure`` (which creates
    Secret openbook-redis, tests/test_secrets_k8s.py) as a service account allowed exactly
    that: create secrets, read openbook-redis, in the namespace."""
    _, objs = overlay
    job = by_kind(objs, "Job")["openbook-secrets"]
    pod = job["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["command"] == ["openbook-secrets", "k8s-ensure"]
    assert "args" not in c  # the API server and namespace come from the pod itself
    # The image compose's one-shot `secrets` service runs the same command family in.
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    assert c["image"] == compose["secrets"]["image"]
    assert compose["secrets"]["command"].startswith("openbook-secrets init")
    assert pod["restartPolicy"] in ("OnFailure", "Never") and job["spec"]["backoffLimit"] >= 1
    assert pod["serviceAccountName"] == "openbook-secrets"
    assert pod.get("automountServiceAccountToken", True) is True
    assert ("ServiceAccount", "openbook-secrets") in {_key(o) for o in objs}
    # Secrets never touch the image's disk: its temporary folder is in memory.
    tmp = next(v for v in pod["volumes"] if v["name"] == "tmp")
    assert tmp["emptyDir"]["medium"] == "Memory"
    assert {m["mountPath"] for m in c["volumeMounts"]} == {"/tmp"}
    assert c["securityContext"]["readOnlyRootFilesystem"] is True

    role = by_kind(objs, "Role")["openbook-secrets"]
    rules = [
        (
            tuple(r["apiGroups"]),
            tuple(r["resources"]),
            tuple(sorted(r["verbs"])),
            tuple(r.get("resourceNames", ())),
        )
        for r in role["rules"]
    ]
    assert sorted(rules) == sorted(
        [
            (("",), ("secrets",), ("create",), ()),
            (("",), ("secrets",), ("get",), ("openbook-redis",)),
        ]
    ), "least privilege: no list, update, patch or delete"
    assert not by_kind(objs, "ClusterRole") and not by_kind(objs, "ClusterRoleBinding")

    binding = by_kind(objs, "RoleBinding")["openbook-secrets"]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "openbook-secrets",
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "openbook-secrets", "namespace": NAMESPACE}
    ]
    # It must reach the API server: no NetworkPolicy limits its pod's egress.
    labels = job["spec"]["template"]["metadata"]["labels"]
    for policy in by_kind(objs, "NetworkPolicy").values():
        selector = policy["spec"]["podSelector"].get("matchLabels", {})
        if selector.items() <= labels.items():
            assert "Egress" not in policy["spec"]["policyTypes"], policy["metadata"]["name"]

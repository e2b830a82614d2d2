"""Cluster infrastructure: KubeRay manifests against the real CRD schemas, the cluster-launcher YAML against
Ray's own validator, the fields that make a deployment safe (pinned image, token auth, no exposed dashboard,
GPU resources, MLflow on a database), and infra/local/cluster.sh really starting and stopping Ray + MLflow.
"""
from __future__ import annotations

import copy
import functools
import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ports import free_port_block

REPO = Path(__file__).resolve().parents[1]
INFRA = REPO / "infra"
CRD_DIR = REPO.parent / "shared" / "schemas" / "kuberay"
CLUSTER_SH = INFRA / "local" / "cluster.sh"
TOKEN_SECRET_KEY = "auth_token"  # the data key KubeRay reads from the auth Secret


def load(rel: str) -> dict:
    return yaml.safe_load((INFRA / rel).read_text())


def load_all(rel: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((INFRA / rel).read_text()) if d]


def strict(schema):
    """Forbid unknown fields wherever the CRD lists properties, as the API server's pruning / kubectl's
    strict validation would: plain JSON-schema validation of a CRD accepts any misspelt field."""
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out \
                and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


@functools.lru_cache(maxsize=None)
def _crd(path: Path) -> dict:
    # The CRDs are ~20k lines: libyaml's loader takes a fraction of the pure-Python one's time.
    return yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def crd_validator(crd_file: str):
    jsonschema = pytest.importorskip("jsonschema")
    path = CRD_DIR / crd_file
    if not path.is_file():
        pytest.skip(f"KubeRay CRD schemas not present at {CRD_DIR} (../shared is only on developer machines)")
    crd = _crd(path)
    served = [v for v in crd["spec"]["versions"] if v.get("served") and v.get("storage")]
    assert len(served) == 1, "expected exactly one served storage version"
    return served[0]["name"], jsonschema.Draft7Validator(strict(served[0]["schema"]["openAPIV3Schema"]))


def errors(validator, doc) -> list[str]:
    return [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(doc)]


def pod_specs(cluster_spec: dict) -> dict[str, dict]:
    """groupName ('head' for the head) -> pod spec of a RayCluster spec."""
    specs = {"head": cluster_spec["headGroupSpec"]["template"]["spec"]}
    for group in cluster_spec.get("workerGroupSpecs", []):
        specs[group["groupName"]] = group["template"]["spec"]
    return specs


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def walk(node, key: str):
    """Every value stored under `key` anywhere in a nested YAML document."""
    if isinstance(node, dict):
        for k, v in node.items():
            if k == key:
                yield v
            yield from walk(v, key)
    elif isinstance(node, list):
        for v in node:
            yield from walk(v, key)


# ---------------------------------------------------------------------------------------------------------
# Schemas


@pytest.mark.parametrize("rel,crd_file,kind", [
    ("kuberay/raycluster.yaml", "ray.io_rayclusters.yaml", "RayCluster"),
    ("kuberay/rayjob.yaml", "ray.io_rayjobs.yaml", "RayJob"),
])
def test_kuberay_manifests_validate_against_crd(rel, crd_file, kind):
    version, validator = crd_validator(crd_file)
    doc = load(rel)
    assert doc["kind"] == kind and doc["apiVersion"] == f"ray.io/{version}"
    assert errors(validator, doc) == []


def test_crd_validation_catches_misspelt_and_mistyped_fields():
    _, validator = crd_validator("ray.io_rayclusters.yaml")
    doc = load("kuberay/raycluster.yaml")
    bad = copy.deepcopy(doc)
    bad["spec"]["workerGroupSpecs"][0]["minReplica"] = 1          # misspelt
    bad["spec"]["workerGroupSpecs"][0]["rayStartParams"]["num-gpus"] = 8   # must be a string
    bad["spec"]["authOptions"]["mode"] = "tokens"                 # not in the enum
    found = "\n".join(errors(validator, bad))
    assert "minReplica" in found and "num-gpus" in found and "tokens" in found


def test_every_infra_yaml_parses():
    files = sorted(INFRA.rglob("*.yaml"))
    assert len(files) >= 4
    for path in files:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        assert docs and all(isinstance(d, dict) for d in docs), path


def test_cluster_launcher_yaml_passes_rays_validator():
    ray_util = pytest.importorskip("ray.autoscaler._private.util")
    config = ray_util.prepare_config(load("cluster-launcher/aws.yaml"))  # fills defaults as `ray up` does
    ray_util.validate_config(config)
    assert config["provider"]["type"] == "aws"
    assert config["available_node_types"][config["head_node_type"]]["resources"] == {"CPU": 0}


# ---------------------------------------------------------------------------------------------------------
# The fields that matter


def all_images() -> dict[str, str]:
    images = {}
    for rel in ("kuberay/raycluster.yaml", "kuberay/rayjob.yaml", "mlflow/mlflow.yaml"):
        for doc in load_all(rel):
            for i, image in enumerate(walk(doc, "image")):
                images[f"{rel}#{i}"] = image
    images["cluster-launcher/aws.yaml"] = load("cluster-launcher/aws.yaml")["docker"]["image"]
    return images


def test_images_are_pinned_and_the_same_everywhere():
    images = all_images()
    assert len(images) >= 8
    for where, image in images.items():
        name, _, tag = image.rpartition(":")
        assert "@sha256:" in image or (name and "/" not in tag and tag not in ("", "latest")), (where, image)
    # One image for head, workers, submitter and MLflow: a version skew between them breaks Ray.
    assert len(set(images.values())) == 1, images

    base = re.search(r"^FROM\s+(\S+)", (INFRA / "docker" / "Dockerfile").read_text(), re.M).group(1)
    assert re.fullmatch(r"nvidia/cuda:\d+\.\d+\.\d+-[a-z-]+-ubuntu\d+\.\d+(@sha256:[0-9a-f]{64})?", base), base


def test_image_pins_are_the_tested_versions():
    """The image installs exactly what the test suite runs against (torch there is +cpu of the same release):
    locks/cuda.txt, the Dockerfile's default LOCK (tests/test_lock.py checks it against the product's closure)."""
    import importlib.metadata as md

    from test_lock import pins as lock_pins  # the strict reader: an entry that is not an exact pin fails there

    pins = lock_pins("cuda.txt")
    for package in ("ray", "torch", "deepspeed", "mlflow", "tokenizers", "pyarrow"):
        assert pins[package] == md.version(package).split("+")[0], package
    assert "psycopg2-binary" in pins  # the MLflow server's PostgreSQL driver lives in the same image
    # The Jobs API needs the dashboard, which needs ray[default]: its own dependencies are in the image.
    assert {"aiohttp-cors", "opencensus", "py-spy", "prometheus-client"} <= set(pins)
    for rel in ("kuberay/raycluster.yaml", "kuberay/rayjob.yaml"):
        spec = load(rel)["spec"]
        assert (spec.get("rayClusterSpec") or spec)["rayVersion"] == pins["ray"]


def test_gpu_worker_groups_request_gpus_and_tell_ray():
    for rel in ("kuberay/raycluster.yaml", "kuberay/rayjob.yaml"):
        spec = load(rel)["spec"]
        spec = spec.get("rayClusterSpec", spec)
        gpu_groups = [g for g in spec["workerGroupSpecs"] if "num-gpus" in g["rayStartParams"]]
        assert gpu_groups, rel
        for group in gpu_groups:
            container = group["template"]["spec"]["containers"][0]
            limits = container["resources"]["limits"]
            assert int(limits["nvidia.com/gpu"]) == int(group["rayStartParams"]["num-gpus"]) > 0
            assert group["minReplicas"] == 0 or rel.endswith("rayjob.yaml")  # long-lived cluster scales to zero
        head_params = spec["headGroupSpec"]["rayStartParams"]
        assert head_params.get("num-cpus") == "0"  # nothing scheduled on the head
    assert load("kuberay/raycluster.yaml")["spec"]["enableInTreeAutoscaling"] is True
    launcher = load("cluster-launcher/aws.yaml")["available_node_types"]
    assert launcher["gpu_worker"]["resources"]["GPU"] == 8 and launcher["gpu_worker"]["min_workers"] == 0


def test_rayjob_entrypoint_is_the_cli_with_a_valid_config():
    from bertpipe.jobs.config import load_config

    spec = load("kuberay/rayjob.yaml")["spec"]
    argv = shlex.split(spec["entrypoint"])
    assert argv[:4] == ["bertpipe", "run", "--config", "configs/bert_large.yaml"]
    opts = {"--set": []}
    for flag, value in zip(argv[4::2], argv[5::2]):
        if flag == "--set":
            opts["--set"].append(value)
        else:
            opts[flag] = value
    cfg = load_config(str(REPO / argv[3]), overrides=opts["--set"], workdir=opts.get("--workdir"))
    assert cfg.pretrain.use_gpu and cfg.workdir.startswith("s3://")
    # The job's cluster must be able to hold every training worker at once.
    gpu_group = next(g for g in spec["rayClusterSpec"]["workerGroupSpecs"] if g["groupName"] == "gpu")
    gpus_per_pod = int(gpu_group["rayStartParams"]["num-gpus"])
    cpus_per_pod = int(gpu_group["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"])
    assert cfg.pretrain.num_workers <= gpu_group["maxReplicas"] * gpus_per_pod
    assert cfg.pretrain.cpus_per_worker * gpus_per_pod < cpus_per_pod  # CPUs left for Ray Data tasks
    # Resources only: nothing in the manifest that belongs in the config.
    assert "env_vars" in yaml.safe_load(spec["runtimeEnvYAML"]) and "working_dir" not in spec["runtimeEnvYAML"]

    launcher = load("cluster-launcher/aws.yaml")
    assert any(c.startswith("bertpipe ") for c in launcher["setup_commands"])


def test_token_auth_everywhere_and_token_only_from_a_secret():
    for rel in ("kuberay/raycluster.yaml", "kuberay/rayjob.yaml"):
        spec = load(rel)["spec"]
        containers = [pod["containers"][0] for pod in pod_specs(spec.get("rayClusterSpec", spec)).values()]
        if "submitterPodTemplate" in spec:
            containers.append(spec["submitterPodTemplate"]["spec"]["containers"][0])
        cluster = spec.get("rayClusterSpec", spec)
        secret = cluster["authOptions"]["secretName"]
        assert cluster["authOptions"]["mode"] == "token"
        for container in containers:
            env = env_of(container)
            assert env["RAY_AUTH_MODE"]["value"] == "token", (rel, container["name"])
            ref = env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
            assert (ref["name"], ref["key"]) == (secret, TOKEN_SECRET_KEY), (rel, container["name"])
            assert "value" not in env["RAY_AUTH_TOKEN"]
    text = "".join((INFRA / rel).read_text() for rel in ("kuberay/raycluster.yaml", "kuberay/rayjob.yaml"))
    assert not re.search(r"\b[0-9a-f]{32,}\b", text), "something that looks like a token is committed"

    launcher = load("cluster-launcher/aws.yaml")
    run_options = " ".join(launcher["docker"]["run_options"])
    assert "--env RAY_AUTH_MODE=token" in run_options
    token_path = re.search(r"--env RAY_AUTH_TOKEN_PATH=(\S+)", run_options).group(1)
    assert token_path in launcher["file_mounts"]  # the token travels as a file, never on a command line
    assert "RAY_AUTH_TOKEN=" not in yaml.safe_dump(launcher)


def test_dashboard_is_not_exposed():
    for rel in ("kuberay/raycluster.yaml", "kuberay/rayjob.yaml", "mlflow/mlflow.yaml"):
        for doc in load_all(rel):
            for service_type in walk(doc, "serviceType"):
                assert service_type == "ClusterIP", rel
            if doc["kind"] == "Service":
                assert doc["spec"].get("type", "ClusterIP") == "ClusterIP", rel
    spec = load("kuberay/raycluster.yaml")["spec"]
    assert spec["headGroupSpec"]["serviceType"] == "ClusterIP"
    head_cmd = " ".join(load("cluster-launcher/aws.yaml")["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head_cmd and "0.0.0.0" not in head_cmd


def test_mlflow_server_uses_a_database_and_an_object_store():
    docs = {d["kind"]: d for d in load_all("mlflow/mlflow.yaml")}
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    server = pod["containers"][0]
    argv = server["command"] + server["args"]
    assert argv[:2] == ["mlflow", "server"]
    # The backend URI (with its password) comes from a Secret through mlflow's env var, not argv.
    ref = env_of(server)["MLFLOW_BACKEND_STORE_URI"]["valueFrom"]["secretKeyRef"]
    assert ref["name"] and ref["key"]
    assert not any("sqlite" in a or "--backend-store-uri" in a for a in argv)
    assert any(re.fullmatch(r"--artifacts-destination=s3://\S+", a) for a in argv)
    assert server["readinessProbe"]["httpGet"]["path"] == "/health"
    upgrade = pod["initContainers"][0]
    assert "mlflow db upgrade" in " ".join(upgrade["command"])
    assert env_of(upgrade)["MLFLOW_BACKEND_STORE_URI"]["valueFrom"]["secretKeyRef"] == ref
    assert docs["Service"]["spec"]["ports"][0]["port"] == 5000
    # The manifests point Ray at this Service.
    uri = env_of(pod_specs(load("kuberay/raycluster.yaml")["spec"])["head"]["containers"][0])
    assert uri["MLFLOW_TRACKING_URI"]["value"] == "http://mlflow.bertpipe.svc.cluster.local:5000"


# ---------------------------------------------------------------------------------------------------------
# Hardening: unprivileged pods, and NetworkPolicies that admit only the project's own pods

K8S_MANIFESTS = ("kuberay/raycluster.yaml", "kuberay/rayjob.yaml", "kuberay/networkpolicy.yaml", "mlflow/mlflow.yaml")


def pod_templates() -> dict[str, dict]:
    """Every pod template: 'file#group' -> {"labels": the labels the pod will carry, "spec": its pod spec}. KubeRay
    adds ray.io/node-type (head / worker) to the Ray pods it creates; the template's own labels are kept."""
    out = {}
    for rel in ("kuberay/raycluster.yaml", "kuberay/rayjob.yaml"):
        spec = load(rel)["spec"]
        cluster = spec.get("rayClusterSpec", spec)
        groups = [("head", "head", cluster["headGroupSpec"])]
        groups += [(g["groupName"], "worker", g) for g in cluster["workerGroupSpecs"]]
        for name, node_type, group in groups:
            template = group["template"]
            labels = {**template.get("metadata", {}).get("labels", {}), "ray.io/node-type": node_type}
            out[f"{rel}#{name}"] = {"labels": labels, "spec": template["spec"]}
        if "submitterPodTemplate" in spec:
            template = spec["submitterPodTemplate"]
            out[f"{rel}#submitter"] = {"labels": template.get("metadata", {}).get("labels", {}),
                                       "spec": template["spec"]}
    for doc in load_all("mlflow/mlflow.yaml"):
        if doc["kind"] == "Deployment":
            template = doc["spec"]["template"]
            out[f"mlflow/mlflow.yaml#{doc['metadata']['name']}"] = {"labels": template["metadata"]["labels"],
                                                                   "spec": template["spec"]}
    return out


def check_container(where: str, container: dict, volumes: dict[str, dict]) -> None:
    sc = container.get("securityContext", {})
    assert sc.get("allowPrivilegeEscalation") is False, where
    assert sc.get("privileged", False) is False and sc.get("runAsUser", 1000) != 0, where
    assert sc.get("capabilities", {}).get("drop") == ["ALL"] and not sc["capabilities"].get("add"), where
    assert sc.get("readOnlyRootFilesystem") is True, where
    # A read-only root needs somewhere to write: /tmp, and every directory the env points a writer at, on an emptyDir.
    mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
    assert "/tmp" in mounts and "emptyDir" in volumes[mounts["/tmp"]], where
    for name in ("MPLCONFIGDIR", "TRITON_CACHE_DIR"):
        value = env_of(container).get(name, {}).get("value")
        if value:
            assert any(value.startswith(path.rstrip("/") + "/") for path in mounts), (where, name, value)


def test_every_pod_and_container_runs_unprivileged():
    templates = pod_templates()
    # Every pod spec in the manifests is one of these: a new one must be hardened (and listed above) too.
    assert len(templates) == sum(1 for rel in K8S_MANIFESTS for doc in load_all(rel) for _ in walk(doc, "containers"))
    assert len(templates) == 8
    for where, pod in templates.items():
        spec = pod["spec"]
        psc = spec.get("securityContext", {})
        assert psc.get("runAsNonRoot") is True and psc.get("runAsUser", 0) != 0, where
        assert psc.get("seccompProfile", {}).get("type") == "RuntimeDefault", where
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        containers = spec["containers"] + spec.get("initContainers", [])
        for container in containers:
            check_container(f"{where}/{container['name']}", container, volumes)
        if where.endswith("#head"):
            # KubeRay adds the autoscaler as a sidecar of the head pod, from autoscalerOptions.
            rel = where.split("#")[0]
            cluster = load(rel)["spec"]
            cluster = cluster.get("rayClusterSpec", cluster)
            if cluster.get("enableInTreeAutoscaling"):
                check_container(f"{where}/autoscaler", cluster["autoscalerOptions"], volumes)
    containers = [c for pod in templates.values() for c in pod["spec"]["containers"]]
    assert any(c["name"] == "mlflow" for c in containers) and any(c["name"] == "ray-head" for c in containers)


def selects(selector: dict, labels: dict[str, str]) -> bool:
    """A Kubernetes label selector ({} selects everything)."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        if (op == "Exists" and key not in labels) or (op == "DoesNotExist" and key in labels) \
                or (op == "In" and labels.get(key) not in values) or (op == "NotIn" and labels.get(key) in values):
            return False
    return True


def admitted(policies: list[dict], target: tuple[str, dict], source: tuple[str, dict], port: int) -> bool:
    """Whether a pod (namespace, labels) may open `port` on the target pod, by NetworkPolicy's rules: a pod that no
    Ingress policy selects admits everyone; one that some select admits the union of their rules."""
    target_ns, target_labels = target
    source_ns, source_labels = source
    selecting = [p for p in policies if p["metadata"]["namespace"] == target_ns
                 and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
                 and selects(p["spec"]["podSelector"], target_labels)]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress", []):
            if rule.get("ports") and not any(p.get("port") == port for p in rule["ports"]):
                continue
            if "from" not in rule:
                return True  # from anywhere
            for peer in rule["from"]:
                ns_ok = (selects(peer["namespaceSelector"], {"kubernetes.io/metadata.name": source_ns})
                         if "namespaceSelector" in peer else source_ns == target_ns)
                if ns_ok and selects(peer.get("podSelector", {}), source_labels):
                    return True
    return False


def test_network_policies_admit_only_the_projects_pods():
    policies = [d for rel in K8S_MANIFESTS for d in load_all(rel) if d["kind"] == "NetworkPolicy"]
    assert policies and all(p["apiVersion"] == "networking.k8s.io/v1" for p in policies)
    assert not list(walk(policies, "ipBlock"))  # no address range is ever let in
    templates = pod_templates()
    ns = "bertpipe"
    assert {load(rel)["metadata"]["namespace"] for rel in ("kuberay/raycluster.yaml", "kuberay/rayjob.yaml")} == {ns}
    mlflow = (ns, templates["mlflow/mlflow.yaml#mlflow"]["labels"])
    ray_pods = [(ns, t["labels"]) for where, t in templates.items() if "ray.io/node-type" in t["labels"]]
    heads = [pod for pod in ray_pods if pod[1]["ray.io/node-type"] == "head"]
    project = [(ns, t["labels"]) for where, t in templates.items() if not where.startswith("mlflow/")]
    stranger = (ns, {"app.kubernetes.io/name": "someone-else"})
    operator = ("ray-system", {"app.kubernetes.io/name": "kuberay-operator"})
    assert len(heads) == 2 and len(project) == 7

    # MLflow (no login): every Ray pod and the job submitter reach port 5000; no other pod, here or elsewhere.
    assert all(admitted(policies, mlflow, src, 5000) for src in project)
    assert not admitted(policies, mlflow, stranger, 5000)
    assert not admitted(policies, mlflow, ("default", project[0][1]), 5000)  # the same labels in another namespace

    # Ray pods: each other on every port (GCS, dashboard, Ray Client, object manager); the operator on the head's
    # dashboard only; nobody else.
    for target in ray_pods:
        assert all(admitted(policies, target, src, port) for src in project for port in (6379, 8265, 10001, 12345))
        assert not any(admitted(policies, target, stranger, port) for port in (6379, 8265, 10001))
        assert not admitted(policies, target, operator, 6379)
    for head in heads:
        assert admitted(policies, head, operator, 8265)
        assert not admitted(policies, head, ("default", operator[1]), 8265)


# ---------------------------------------------------------------------------------------------------------
# infra/local/cluster.sh


def script_env(state: Path, base: int, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RAY_", "MLFLOW_", "BERTPIPE_"))}  # the developer's own cluster must not leak in
    env.update(BERTPIPE_LOCAL_DIR=str(state), BERTPIPE_RAY_TOKEN_FILE=str(state / "token"),
               BERTPIPE_RAY_PORT=str(base), BERTPIPE_DASHBOARD_PORT=str(base + 8),
               BERTPIPE_MLFLOW_PORT=str(base + 9), **extra)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def run_script(args: list[str], env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(CLUSTER_SH), *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_cluster_sh_env_usage_and_refusals(tmp_path):
    base = free_port_block(10)
    env = script_env(tmp_path / "state", base)
    out = run_script(["env"], env)
    assert out.returncode == 0
    exports = dict(re.findall(r"^export (\w+)=(\S+)$", out.stdout, re.M))
    assert exports == {"RAY_API_SERVER_ADDRESS": f"http://127.0.0.1:{base + 8}", "RAY_ADDRESS": f"127.0.0.1:{base}",
                       "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(tmp_path / "state" / "token"),
                       "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{base + 9}"}
    assert run_script(["restart"], env).returncode == 2

    bad = run_script(["start"], {**env, "BERTPIPE_NUM_CPUS": "four"})
    assert bad.returncode == 1 and "NUM_CPUS must be an integer" in bad.stderr

    # A busy port (Ray's or MLflow's) stops the start before anything is spawned or any token is written.
    for port in (base + 8, base + 9):
        with socket.socket() as busy:
            busy.bind(("127.0.0.1", port))
            busy.listen()
            out = run_script(["start"], env)
        assert out.returncode == 1 and f"port {port} is in use" in out.stderr
        assert not (tmp_path / "state" / "token").exists() and not (tmp_path / "state" / "ray.pid").exists()
    assert run_script(["status"], env).returncode == 3


# A real start and stop of infra/local/cluster.sh (token, loopback only, the printed client lines, idempotent start,
# nothing left after stop) is tests/test_cluster_e2e.py's: its cluster serves the submitted workflow too.


def test_every_ray_node_the_project_starts_runs_with_the_node_settings():
    """bertpipe.jobs.cluster.NODE_ENV reaches every kind of node the project starts: the image (KubeRay and the
    cluster launcher run it), the local cluster script and the multi-node test rig (a local Ray: ensure_ray, tested
    with a real one in tests/test_local_ray_start.py)."""
    from bertpipe.jobs.cluster import NODE_ENV

    dockerfile = (INFRA / "docker" / "Dockerfile").read_text()
    env_block = re.search(r"^ENV ((?:.*\\\n)*.*)$", dockerfile, re.M).group(1)
    image_env = dict(re.findall(r"(\w+)=(\S+?)\s*(?:\\|$)", env_block, re.M))
    script = CLUSTER_SH.read_text()
    rig = (REPO / "tests" / "multinode.py").read_text()
    assert NODE_ENV
    for key, value in NODE_ENV.items():
        assert image_env.get(key) == value, (key, image_env)
        assert f'{key}="${{{key}:-{value}}}"' in script, key
    assert "NODE_ENV.items()" in rig

"""The two KubeRay manifests describe one cluster at two sizes: the RayJob's cluster (infra/kuberay/rayjob.yaml) is
the RayCluster's (raycluster.yaml) but for replica counts, GPUs per pod, resource quantities, emptyDir sizes and the
autoscaler's idle timeout. Within each, every Ray container (head, each worker group, the autoscaler sidecar) gets the
same image and env (token auth, MLflow, region), every Ray pod a memory-backed /dev/shm, and the GPU pods prefer the
cards the presets are sized for without requiring a label that only NVIDIA's GPU feature discovery sets (issue 40,
item 1). The schema checks are tests/test_infra.py's; this reads files and starts nothing.
"""
from __future__ import annotations

import copy
import re

import yaml

from test_infra import INFRA, env_of, load

RAYCLUSTER, RAYJOB = "kuberay/raycluster.yaml", "kuberay/rayjob.yaml"
PRODUCT_LABEL = "nvidia.com/gpu.product"
SIZE = "<size>"  # what a quantity that may differ between the two manifests is replaced by


def cluster_of(doc: dict) -> dict:
    spec = doc["spec"]
    return spec.get("rayClusterSpec", spec)


def groups_of(doc: dict) -> dict[str, dict]:
    """'head' and each worker group by its name -> the group."""
    cluster = cluster_of(doc)
    return {"head": cluster["headGroupSpec"], **{g["groupName"]: g for g in cluster["workerGroupSpecs"]}}


def shape(doc: dict) -> dict:
    """A manifest's cluster with every size replaced by SIZE: what must be the same in both manifests. Resources keep
    which of them a container asks for (cpu, memory, nvidia.com/gpu), not how much."""
    cluster = copy.deepcopy(cluster_of(doc))
    cluster["autoscalerOptions"]["idleTimeoutSeconds"] = SIZE  # how long an idle (paid-for) node waits
    groups = {"head": cluster.pop("headGroupSpec")}
    groups.update((g.pop("groupName"), g) for g in cluster.pop("workerGroupSpecs"))
    for group in groups.values():
        for key in ("replicas", "minReplicas", "maxReplicas"):
            if key in group:
                group[key] = SIZE
        if "num-gpus" in group["rayStartParams"]:
            group["rayStartParams"]["num-gpus"] = SIZE
        pod = group["template"]["spec"]
        for container in pod["containers"]:
            if "resources" in container:
                container["resources"] = {kind: sorted(asked) for kind, asked in container["resources"].items()}
        for volume in pod.get("volumes", []):
            if "sizeLimit" in volume.get("emptyDir", {}):
                volume["emptyDir"]["sizeLimit"] = SIZE
    return {"cluster": cluster, **groups}


def named(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) and "name" in v for v in value)


def differences(a, b, path: str = "", names: tuple[str, str] = ("RayCluster", "RayJob")) -> list[str]:
    """Where two YAML trees differ, one line per path; lists of named items (env, volumes, mounts, ports,
    containers) are compared by name, so a missing env entry reads as such rather than as a shifted list."""
    if named(a) and named(b):
        a, b = {v["name"]: v for v in a}, {v["name"]: v for v in b}
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in [*a, *(k for k in b if k not in a)]:
            where = f"{path}.{key}" if path else str(key)
            if key not in b:
                out.append(f"{where}: only in the {names[0]}")
            elif key not in a:
                out.append(f"{where}: only in the {names[1]}")
            else:
                out += differences(a[key], b[key], where, names)
        return out
    return [] if a == b else [f"{path}: {a!r} ({names[0]}) != {b!r} ({names[1]})"]


def ray_containers(doc: dict) -> dict[str, dict]:
    """Every Ray container of a manifest's cluster: the autoscaler sidecar, the head's, each worker group's."""
    out = {"autoscaler": cluster_of(doc)["autoscalerOptions"]}
    out.update((name, group["template"]["spec"]["containers"][0]) for name, group in groups_of(doc).items())
    return out


def group_problems(doc: dict) -> list[str]:
    """What keeps the groups of one manifest from running as one cluster ([] = nothing)."""
    problems = []
    containers = ray_containers(doc)
    head = containers["head"]
    for role, container in containers.items():
        for key in ("image", "imagePullPolicy", "env"):
            if container.get(key) != head.get(key):
                problems.append(f"{role}: its {key} is not the head's")
    env = env_of(head)
    secret = cluster_of(doc)["authOptions"]["secretName"]
    if env.get("RAY_AUTH_MODE", {}).get("value") != "token" or \
            env.get("RAY_AUTH_TOKEN", {}).get("valueFrom", {}).get("secretKeyRef", {}).get("name") != secret:
        problems.append(f"the Ray containers' env lacks token auth from the Secret {secret}")
    if not env.get("AWS_DEFAULT_REGION", {}).get("value"):
        problems.append("the Ray containers' env sets no AWS_DEFAULT_REGION")
    for role, group in groups_of(doc).items():
        pod = group["template"]["spec"]
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0].get("volumeMounts", [])}
        shm = volumes.get(mounts.get("/dev/shm"), {}).get("emptyDir", {})
        if shm.get("medium") != "Memory":
            problems.append(f"{role}: no memory-backed /dev/shm (the object store and NCCL live there)")
    return problems


def gpu_affinity(doc: dict) -> dict:
    gpu = [g for g in cluster_of(doc)["workerGroupSpecs"] if "num-gpus" in g["rayStartParams"]]
    assert len(gpu) == 1
    return gpu[0]["template"]["spec"]


# ---------------------------------------------------------------------------------------------------------
# Tests


def test_the_rayjobs_cluster_is_the_rayclusters_but_for_sizes():
    assert differences(shape(load(RAYCLUSTER)), shape(load(RAYJOB))) == []


def test_every_group_of_each_manifest_has_the_same_image_env_auth_region_and_shm():
    for rel in (RAYCLUSTER, RAYJOB):
        doc = load(rel)
        assert group_problems(doc) == [], rel
        # The four kinds of Ray container are all there (a group missing from both manifests would agree).
        assert set(ray_containers(doc)) == {"autoscaler", "head", "gpu", "cpu"}, rel
    submitter = load(RAYJOB)["spec"]["submitterPodTemplate"]["spec"]["containers"][0]
    assert submitter["image"] == ray_containers(load(RAYJOB))["head"]["image"]


def test_gpu_pods_prefer_the_80gb_cards_and_require_no_label():
    for rel in (RAYCLUSTER, RAYJOB):
        pod = gpu_affinity(load(rel))
        affinity = pod["affinity"]["nodeAffinity"]
        # A required product label, which only NVIDIA's GPU feature discovery sets, keeps every GPU pod Pending on a
        # cluster without it; the GPU resource request alone is what must fit.
        assert "requiredDuringSchedulingIgnoredDuringExecution" not in affinity, rel
        assert PRODUCT_LABEL not in pod.get("nodeSelector", {}), rel
        products = {v for p in affinity["preferredDuringSchedulingIgnoredDuringExecution"]
                    for e in p["preference"]["matchExpressions"] if e["key"] == PRODUCT_LABEL for v in e["values"]}
        assert {"NVIDIA-H100-80GB-HBM3", "NVIDIA-H200", "NVIDIA-A100-SXM4-80GB"} <= products, rel
        assert not any(re.search(r"40GB|A10G|L4|T4", p) for p in products), rel
        assert int(pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]) > 0


def test_a_difference_where_the_manifests_must_agree_is_named_and_a_size_is_not():
    cluster = load(RAYCLUSTER)

    def diff(change) -> list[str]:
        job = load(RAYJOB)
        change(cluster_of(job), groups_of(job))
        return differences(shape(cluster), shape(job))

    def drop_region_on_cpu(_, groups):
        # A new list for this container only: the YAML alias makes every group's env one shared list.
        container = groups["cpu"]["template"]["spec"]["containers"][0]
        container["env"] = [e for e in container["env"] if e["name"] != "AWS_DEFAULT_REGION"]

    def drop_shm_on_head(_, groups):
        container = groups["head"]["template"]["spec"]["containers"][0]
        container["volumeMounts"] = [m for m in container["volumeMounts"] if m["mountPath"] != "/dev/shm"]

    def require_the_product(_, groups):
        affinity = groups["gpu"]["template"]["spec"]["affinity"]["nodeAffinity"]
        preferred = affinity.pop("preferredDuringSchedulingIgnoredDuringExecution")
        affinity["requiredDuringSchedulingIgnoredDuringExecution"] = {
            "nodeSelectorTerms": [p["preference"] for p in preferred]}

    def another_image(_, groups):
        groups["gpu"]["template"]["spec"]["containers"][0]["image"] = "ghcr.io/CHANGE-ME/bertpipe:0.1.1"

    def autoscaler_without_env(cluster_spec, _):
        del cluster_spec["autoscalerOptions"]["env"]

    assert diff(drop_region_on_cpu) == ["cpu.template.spec.containers.ray-worker.env.AWS_DEFAULT_REGION: only in "
                                        "the RayCluster"]
    assert diff(drop_shm_on_head) == ["head.template.spec.containers.ray-head.volumeMounts.dshm: only in the "
                                      "RayCluster"]
    assert diff(another_image)[0].startswith("gpu.template.spec.containers.ray-worker.image: ")
    assert diff(autoscaler_without_env) == ["cluster.autoscalerOptions.env: only in the RayCluster"]
    found = diff(require_the_product)
    assert any("preferredDuringSchedulingIgnoredDuringExecution: only in the RayCluster" in d for d in found)
    assert any("requiredDuringSchedulingIgnoredDuringExecution: only in the RayJob" in d for d in found)

    def resize(cluster_spec, groups):
        cluster_spec["autoscalerOptions"]["idleTimeoutSeconds"] = 60
        groups["gpu"]["maxReplicas"] = 64
        groups["gpu"]["rayStartParams"]["num-gpus"] = "4"
        groups["gpu"]["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"] = "44"
        groups["cpu"]["template"]["spec"]["volumes"][0]["emptyDir"]["sizeLimit"] = "1Gi"

    assert diff(resize) == []

    # The same checks within one manifest: one group out of step is named.
    job = load(RAYJOB)
    drop_region_on_cpu(None, groups_of(job))
    autoscaler_without_env(cluster_of(job), None)
    drop_shm_on_head(None, groups_of(job))
    assert group_problems(job) == ["autoscaler: its env is not the head's", "cpu: its env is not the head's",
                                   "head: no memory-backed /dev/shm (the object store and NCCL live there)"]


def test_a_manifest_copy_without_the_region_fails_both_checks(tmp_path):
    """The negative control on a file: rayjob.yaml with its AWS_DEFAULT_REGION entry deleted, as an edit would."""
    text = (INFRA / RAYJOB).read_text()
    edited, count = re.subn(r"\n +- name: AWS_DEFAULT_REGION[^\n]*\n +value: [^\n]*", "", text)
    assert count == 1  # one entry, the anchor every Ray container aliases
    copy_path = tmp_path / "rayjob.yaml"
    copy_path.write_text(edited)
    job = yaml.safe_load(copy_path.read_text())
    assert "the Ray containers' env sets no AWS_DEFAULT_REGION" in group_problems(job)
    found = differences(shape(load(RAYCLUSTER)), shape(job))
    assert "cluster.autoscalerOptions.env.AWS_DEFAULT_REGION: only in the RayCluster" in found
    assert "gpu.template.spec.containers.ray-worker.env.AWS_DEFAULT_REGION: only in the RayCluster" in found

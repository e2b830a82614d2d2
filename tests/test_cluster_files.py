"""The presets and the cluster files agree: every command a manifest runs or infra/README.md shows loads its preset
through the real CLI parser and config loader, and fits the GPU group of the cluster it runs on, on the cards the
preset is sized for (its `# sized for: N GB` line). The README's "Scaling to N GPUs" one-liners keep the preset's
global batches (the accumulation adapts), and the learning-rate rules the docs state match the presets' numbers.
No Ray is started: this reads files.
"""
from __future__ import annotations

import copy
import os
import re
import shlex
from dataclasses import dataclass

import pytest

from bertpipe.jobs.cli import build_parser
from bertpipe.jobs.config import RootConfig, find_preset, load_config
from bertpipe.jobs.services.configtools import ConfigError
from bertpipe.jobs.pretrain.config import layout_warning
from test_infra import INFRA, REPO, load

README = INFRA / "README.md"
RAYJOB, RAYCLUSTER, LAUNCHER = "kuberay/rayjob.yaml", "kuberay/raycluster.yaml", "cluster-launcher/aws.yaml"

# Memory (GB) of one card, by what a manifest names. Kubernetes: the `nvidia.com/gpu.product` label NVIDIA's GPU
# feature discovery (GPU operator) sets, the card's name with spaces as dashes. EC2: the GPU instance type.
GPU_PRODUCT_GB = {
    "NVIDIA-H100-80GB-HBM3": 80,
    "NVIDIA-H100-PCIe": 80,
    "NVIDIA-H100-NVL": 94,
    "NVIDIA-H200": 141,
    "NVIDIA-H200-NVL": 141,
    "NVIDIA-A100-SXM4-80GB": 80,
    "NVIDIA-A100-80GB-PCIe": 80,
    "NVIDIA-A100-SXM4-40GB": 40,
    "NVIDIA-A100-PCIE-40GB": 40,
}
INSTANCE_GPU_GB = {
    "p5.48xlarge": 80,      # 8 × H100
    "p5e.48xlarge": 141,    # 8 × H200
    "p4de.24xlarge": 80,    # 8 × A100 80 GB
    "p4d.24xlarge": 40,     # 8 × A100 40 GB
    "g5.48xlarge": 24,      # 8 × A10G
}
PRODUCT_LABEL = "nvidia.com/gpu.product"
SIZED_FOR = re.compile(r"^\s*#\s*sized for:\s*(\d+)\s*GB\b", re.M)

# infra/README.md section -> the manifests its commands run on (a new section with a `run` must be added here).
README_TARGETS = {
    "Local": (),                                    # infra/local/cluster.sh: no GPU group, CPU presets
    "KubeRay": (RAYCLUSTER,),                       # submitted through the port-forward to the RayCluster
    "Cluster launcher (AWS)": (LAUNCHER,),
    "Scaling to N GPUs": (RAYCLUSTER, LAUNCHER),    # "on the RayCluster or the launcher's cluster"
}


# ---------------------------------------------------------------------------------------------------------
# What a manifest provides


@dataclass(frozen=True)
class GpuGroup:
    where: str
    max_gpus: int            # maxReplicas × GPUs per pod, or the launcher's max_workers × GPUs per node
    min_gpus: int            # what is there before any autoscaling
    gpus_per_node: int
    cpus_per_node: float
    card_gb: tuple[int, ...]  # memory of every card the group may be scheduled on; () = it does not say


def cpus(quantity) -> float:
    text = str(quantity)
    return int(text[:-1]) / 1000 if text.endswith("m") else float(text)


def kuberay_cards(pod_spec: dict) -> tuple[int, ...]:
    """GB of every card a pod is sent to by the product label: its nodeSelector, else its required node affinity,
    else its preferred one (the manifests' way: a required label that no node carries keeps the pod Pending)."""
    selector = pod_spec.get("nodeSelector", {})
    if PRODUCT_LABEL in selector:
        return (GPU_PRODUCT_GB[selector[PRODUCT_LABEL]],)
    affinity = pod_spec.get("affinity", {}).get("nodeAffinity", {})
    required = affinity.get("requiredDuringSchedulingIgnoredDuringExecution", {})
    cards = []
    for term in required.get("nodeSelectorTerms", []):  # terms are ORed: every one must pin the product
        values = product_values(term)
        if not values:
            return ()
        cards += values
    if cards:
        return tuple(cards)
    for preferred in affinity.get("preferredDuringSchedulingIgnoredDuringExecution", []):
        cards += product_values(preferred["preference"])
    return tuple(cards)


def product_values(term: dict) -> list[int]:
    """GB of the cards a node selector term names by the product label (an unknown product is a KeyError: add it)."""
    return [GPU_PRODUCT_GB[v] for e in term.get("matchExpressions", [])
            if e["key"] == PRODUCT_LABEL and e["operator"] == "In" for v in e["values"]]


def kuberay_group(spec: dict, where: str) -> GpuGroup:
    cluster = spec.get("rayClusterSpec", spec)
    groups = [g for g in cluster["workerGroupSpecs"] if "num-gpus" in g.get("rayStartParams", {})]
    assert len(groups) == 1, f"{where}: one GPU worker group expected (teach GpuGroup about several)"
    group = groups[0]
    gpus = int(group["rayStartParams"]["num-gpus"])
    pod = group["template"]["spec"]
    return GpuGroup(where, group["maxReplicas"] * gpus, group.get("minReplicas", 0) * gpus, gpus,
                    cpus(pod["containers"][0]["resources"]["limits"]["cpu"]), kuberay_cards(pod))


def launcher_group(config: dict, where: str) -> GpuGroup:
    nodes = [n for n in config["available_node_types"].values() if n.get("resources", {}).get("GPU", 0) > 0]
    assert len(nodes) == 1, f"{where}: one GPU node type expected (teach GpuGroup about several)"
    node = nodes[0]
    gpus = node["resources"]["GPU"]
    most = min(node["max_workers"], config["max_workers"])  # the cluster-wide cap bounds every node type
    instance = node["node_config"]["InstanceType"]
    return GpuGroup(where, most * gpus, node.get("min_workers", 0) * gpus, gpus, node["resources"]["CPU"],
                    (INSTANCE_GPU_GB[instance],))


def group_of(rel: str, doc: dict | None = None) -> GpuGroup:
    doc = load(rel) if doc is None else doc
    return launcher_group(doc, rel) if rel == LAUNCHER else kuberay_group(doc["spec"], rel)


# ---------------------------------------------------------------------------------------------------------
# The commands


def run_args(command: str):
    """The `bertpipe run` arguments of a command (`bertpipe submit ... -- run ...` too), by the real CLI parser."""
    argv = shlex.split(command)
    while argv and re.fullmatch(r"[A-Z_]+=\S*", argv[0]):  # RAY_AUTH_MODE=token bertpipe ...
        argv.pop(0)
    assert argv[0] == "bertpipe", command
    args = build_parser().parse_args(argv[1:])
    if args.command == "submit":
        inner = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
        args = build_parser().parse_args(inner)
    assert args.command == "run", command
    return args


def config_of(command: str) -> RootConfig:
    """The config as the job's driver loads it on the cluster: Ray sets RAY_ADDRESS for the driver of a submitted
    job (a RayJob's too), so an unset ray.wait_for_resources_s resolves as it does on any cluster."""
    args = run_args(command)
    saved = os.environ.get("RAY_ADDRESS")
    os.environ["RAY_ADDRESS"] = "http://127.0.0.1:8265"
    try:
        return load_config(args.config, args.overrides, args.workdir, base=str(REPO))
    finally:
        if saved is None:
            del os.environ["RAY_ADDRESS"]
        else:
            os.environ["RAY_ADDRESS"] = saved


def is_run(line: str) -> bool:
    return bool(re.search(r"\bbertpipe\b.*\brun\b.*--config", line))


def readme_commands() -> list[tuple[str, str]]:
    """(section, command) of every `run` in a code block of infra/README.md (one line each, as test_readme reads)."""
    out, section, in_block = [], "", False
    for line in README.read_text().splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
        elif line.startswith("```"):
            in_block = not in_block
        elif in_block and is_run(line):
            out.append((section, line.split(" #", 1)[0].strip()))
    return out


def manifest_commands() -> list[tuple[str, str, str]]:
    """(where, command, manifest it runs on) for every command the manifests and infra/README.md run."""
    out = [(f"{RAYJOB} entrypoint", load(RAYJOB)["spec"]["entrypoint"], RAYJOB)]
    for rel in (RAYCLUSTER, LAUNCHER):  # commands in the files' own comments run on the file's cluster
        for line in (INFRA / rel).read_text().splitlines():
            if line.lstrip().startswith("#") and is_run(line):
                out.append((f"{rel} comment", line.lstrip().lstrip("#").strip(), rel))
    for section, command in readme_commands():
        assert section in README_TARGETS, f"infra/README.md section {section!r} runs {command!r}: add it to TARGETS"
        out += [(f"infra/README.md {section}", command, rel) for rel in README_TARGETS[section]]
    return out


def sized_for_gb(config: str) -> int | None:
    found = SIZED_FOR.findall(find_preset(config).read_text())
    assert len(found) <= 1, f"{config}: more than one `# sized for:` line"
    return int(found[0]) if found else None


def problems(command: str, group: GpuGroup) -> list[str]:
    """What keeps `command` from running on `group` as its preset intends ([] = it fits)."""
    try:
        args = run_args(command)
        cfg = config_of(command)
    except (ConfigError, SystemExit) as exc:
        return [f"does not load: {exc}"]
    p = cfg.pretrain
    out = []
    gpus = p.num_workers * (1 if p.use_gpu else 0)  # one GPU per worker
    if not gpus:
        out.append(f"{args.config} trains on the CPU (pretrain.use_gpu false) on GPU group {group.where}")
    if gpus > group.max_gpus:
        out.append(f"pretrain.num_workers {p.num_workers} needs {gpus} GPUs; {group.where} holds at most "
                   f"{group.max_gpus}")
    if min(p.num_workers, group.gpus_per_node) * p.cpus_per_worker >= group.cpus_per_node:
        out.append(f"{group.gpus_per_node} workers × cpus_per_worker {p.cpus_per_worker} leave no CPU of a "
                   f"{group.cpus_per_node}-CPU node of {group.where} to Ray Data's feeding tasks")
    sized = sized_for_gb(args.config)
    if sized is None:
        out.append(f"{args.config} has no `# sized for: N GB` line")
    elif not group.card_gb:
        out.append(f"{group.where} does not say which cards its GPU group gets ({args.config}: {sized} GB)")
    elif min(group.card_gb) < sized:
        out.append(f"{args.config} is sized for {sized} GB cards; {group.where} may get {min(group.card_gb)} GB")
    if gpus > group.min_gpus and cfg.ray.wait_for_resources_s <= 0:
        out.append(f"{group.where} starts with {group.min_gpus} GPUs and the run needs {gpus}: without "
                   f"ray.wait_for_resources_s the stage refuses before the autoscaler adds them")
    if layout_warning(p):
        out.append(layout_warning(p))
    if cfg.pairs.num_shards % p.num_workers:
        out.append(f"pairs.num_shards {cfg.pairs.num_shards} does not split over {p.num_workers} workers")
    return out


# ---------------------------------------------------------------------------------------------------------
# Tests


COMMANDS = manifest_commands()


@pytest.mark.parametrize("where,command,rel", COMMANDS, ids=[f"{w}->{r}" for w, _, r in COMMANDS])
def test_every_command_fits_the_cluster_it_runs_on(where, command, rel):
    assert problems(command, group_of(rel)) == [], f"{where}: {command}"


def test_every_gpu_manifest_runs_a_command_and_waits_for_its_autoscaler():
    targets = {rel for _, _, rel in COMMANDS}
    assert targets == {RAYJOB, RAYCLUSTER, LAUNCHER}
    # The documented entry points are all there: the RayJob's, the launcher's comment, each README section's.
    wheres = {where for where, _, _ in COMMANDS}
    assert {f"{RAYJOB} entrypoint", f"{LAUNCHER} comment", "infra/README.md KubeRay",
            "infra/README.md Cluster launcher (AWS)", "infra/README.md Scaling to N GPUs"} <= wheres
    for where, command, rel in COMMANDS:
        assert config_of(command).ray.wait_for_resources_s == 900, where
    for rel in (RAYJOB, RAYCLUSTER, LAUNCHER):
        assert group_of(rel).min_gpus == 0, rel  # the GPU groups start empty: the autoscaler adds them


def test_readme_scaling_one_liners_keep_the_global_batch():
    one_liners = [command for section, command in readme_commands() if section == "Scaling to N GPUs"]
    lines = README.read_text().splitlines()
    by_cards = {}
    for command in one_liners:
        args = run_args(command)
        cfg, preset = config_of(command).pretrain, load_config(args.config).pretrain
        by_cards[cfg.num_workers] = command
        accumulations = []
        for phase, base in zip(cfg.phases, preset.phases, strict=True):
            # The batch, micro-batch and learning rate stay the preset's; only the accumulation changes.
            assert (phase.global_batch_size, phase.micro_batch_size, phase.learning_rate) == \
                (base.global_batch_size, base.micro_batch_size, base.learning_rate), command
            accumulation = phase.global_batch_size // (phase.micro_batch_size * cfg.num_workers)
            base_accumulation = base.global_batch_size // (base.micro_batch_size * preset.num_workers)
            assert accumulation * phase.micro_batch_size * cfg.num_workers == phase.global_batch_size
            assert accumulation * cfg.num_workers == base_accumulation * preset.num_workers
            accumulations.append(accumulation)
        # The comment beside the one-liner states the same cards and accumulations.
        comment = next(line for line in lines if command in line).split(" #", 1)[1]
        stated = re.fullmatch(r"\s*(\d+) cards: (?:accumulation )?(\d+) / (\d+)\s*", comment)
        assert stated and [int(n) for n in stated.groups()] == [cfg.num_workers, *accumulations], comment
    assert {8, 16, 64} <= set(by_cards), one_liners


def test_presets_state_their_cards_and_the_learning_rate_rules_with_their_own_numbers():
    readme = README.read_text()
    for name in ("bert_large", "bert_large_lamb"):
        text = find_preset(name).read_text()
        assert sized_for_gb(name) == 80, name
        assert "Scaling to N GPUs" in text and "accumulation = global_batch_size / (micro_batch_size × N)" in text
    # AdamW: linear from the preset's own phase-1 lr and batch (its lr_schedule "run" uses phase 1's lr only).
    large = load_config("bert_large").pretrain
    assert large.optimizer == "adamw" and large.lr_schedule == "run"
    linear = re.compile(r"(\d(?:\.\d+)?e-\d) × B / (\d+)")
    for text in (readme, find_preset("bert_large").read_text()):
        assert {(float(lr), int(b)) for lr, b in linear.findall(text)} == \
            {(large.phases[0].learning_rate, large.phases[0].global_batch_size)}
    lamb = load_config("bert_large_lamb").pretrain
    assert lamb.optimizer == "lamb"
    stated = {(float(lr), int(b.replace(",", ""))) for lr, b in
              re.findall(r"(\d(?:\.\d+)?e-\d) × sqrt\(B / ([\d,]+)\)", find_preset("bert_large_lamb").read_text())}
    assert stated == {(ph.learning_rate, ph.global_batch_size) for ph in lamb.phases}
    in_readme = {(float(lr), int(b)) for lr, b in re.findall(r"(\d(?:\.\d+)?e-\d) × sqrt\(B / (\d+)\)", readme)}
    assert in_readme == stated


def test_the_checks_fail_a_cluster_or_command_that_does_not_fit():
    lamb16 = next(c for s, c in readme_commands() if s == "Scaling to N GPUs" and "num_workers=16" in c)
    entrypoint = load(RAYJOB)["spec"]["entrypoint"]
    assert problems(lamb16, group_of(RAYCLUSTER)) == [] and problems(entrypoint, group_of(RAYJOB)) == []

    cluster = load(RAYCLUSTER)
    cluster["spec"]["workerGroupSpecs"][0]["maxReplicas"] = 1  # 8 GPUs for 16 workers
    assert any("holds at most 8" in p for p in problems(lamb16, group_of(RAYCLUSTER, cluster)))

    job = load(RAYJOB)
    gpu_pod = job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]
    small = copy.deepcopy(job)
    term = small["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["affinity"]["nodeAffinity"]
    term["preferredDuringSchedulingIgnoredDuringExecution"][0]["preference"]["matchExpressions"][0][
        "values"].append("NVIDIA-A100-SXM4-40GB")
    assert any("may get 40 GB" in p for p in problems(entrypoint, group_of(RAYJOB, small)))
    del gpu_pod["affinity"]
    assert any("does not say which cards" in p for p in problems(entrypoint, group_of(RAYJOB, job)))

    launcher = load(LAUNCHER)
    launcher["available_node_types"]["gpu_worker"]["node_config"]["InstanceType"] = "p4d.24xlarge"
    launcher["max_workers"] = 1  # the cluster-wide cap, not only the node type's
    found = "\n".join(problems(lamb16, group_of(LAUNCHER, launcher)))
    assert "may get 40 GB" in found and "holds at most 8" in found

    # The commands: no wait on an autoscaled cluster, a worker count the batch does not split over, and
    # bert_large on 16 cards (micro 128 × 16 > 256) are all refused.
    no_wait = lamb16 + " --set ray.wait_for_resources_s=0"
    assert any("wait_for_resources_s" in p for p in problems(no_wait, group_of(RAYCLUSTER)))
    assert problems(lamb16.replace("num_workers=16", "num_workers=12"), group_of(RAYCLUSTER))[0].startswith(
        "does not load")
    assert problems(entrypoint + " --set pretrain.num_workers=16", group_of(RAYJOB))[0].startswith("does not load")


def test_the_divisibility_the_docs_state_is_what_the_config_checks():
    """bert_large_lamb splits over the powers of two up to 256 cards and refuses others; bert_large over 1 and 2."""
    for n in (1, 8, 16, 64, 256):
        load_config("bert_large_lamb", [f"pretrain.num_workers={n}"])
    for n in (3, 12, 512):
        with pytest.raises(ConfigError, match="not divisible"):
            load_config("bert_large_lamb", [f"pretrain.num_workers={n}"])
    for n in (1, 2):
        load_config("bert_large", [f"pretrain.num_workers={n}"])
    for n in (4, 8):  # phase 1's micro-batch 128 × 4 > 256: "4 with phase 1's micro-batch at 64"
        with pytest.raises(ConfigError, match="not divisible"):
            load_config("bert_large", [f"pretrain.num_workers={n}"])

"""The root config of a workflow run: one section per stage plus where it runs and where it is tracked.

Resolution order: dataclass defaults < YAML preset (`--config`) < `--set key.sub=value` overrides.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from bertpipe.jobs.services.configtools import (ConfigError, apply_overrides, from_dict, load_yaml, resolve_paths,
                                                to_dict)
from bertpipe.jobs.glue.config import GlueConfig
from bertpipe.jobs.features.config import FeaturesConfig
from bertpipe.jobs.ner.config import NerConfig
from bertpipe.jobs.squad.config import SquadConfig
from bertpipe.jobs.pretrain.config import FROM_INIT, ModelConfig, PretrainConfig
from bertpipe.pipeline.framework import storage
from bertpipe.pipeline.framework.config_fields import at_least, path_field, within
from bertpipe.pipeline.stages.config import CleanConfig, PairsConfig, VocabConfig
from bertpipe.pipeline.framework.paths import WorkdirPaths


@dataclass(frozen=True, kw_only=True)
class RayConfig:
    # Empty: $RAY_ADDRESS if set, else a local Ray started in-process ("embedded default").
    address: str = ""
    # Logical CPUs of the local Ray. More than the physical cores on purpose: training workers hold their CPU
    # for the whole run, and Ray Data read/map tasks still need free logical CPUs to make progress.
    num_cpus: int = 4
    # The local Ray's dashboard, on 127.0.0.1 (its URL is printed): jobs, Ray Data and Ray Train pages.
    dashboard: bool = True
    # Seconds a stage that needs more CPUs/GPUs than the cluster has waits for nodes to join (an autoscaler adding
    # them, KubeRay scaling a worker group up from zero). 0 = refuse at once. Unset (null): CLUSTER_WAIT_S when the
    # run connects to a cluster (ray.address, RAY_ADDRESS: `bertpipe submit`'s jobs too), 0 for the local Ray a run
    # starts, whose size never changes; load_config resolves it (`resolved_wait_s`), so stages see a number.
    wait_for_resources_s: float | None = None

    def __post_init__(self) -> None:
        at_least("ray", self, 1, "num_cpus")
        if self.wait_for_resources_s is not None:
            at_least("ray", self, 0, "wait_for_resources_s")


# What an unset ray.wait_for_resources_s waits on a cluster: an autoscaler adding a GPU node (a cloud VM, a pod
# pulling the image) takes minutes, and a run refused for want of nodes that were on their way has to be resubmitted
# by hand. On a fixed cluster the wait costs at most this long before the same refusal.
CLUSTER_WAIT_S = 900.0


def connects_to_cluster(ray: RayConfig, environ: Mapping[str, str] | None = None) -> bool:
    """Whether a run with this section joins an existing Ray (jobs/cluster.py ensure_ray's rule: ray.address, else
    RAY_ADDRESS, which Ray also sets for the driver of a submitted job) rather than starting a local one."""
    environ = os.environ if environ is None else environ
    return bool(ray.address or environ.get("RAY_ADDRESS"))


def resolved_wait_s(ray: RayConfig, environ: Mapping[str, str] | None = None) -> float:
    """ray.wait_for_resources_s as the run uses it: the value given, else CLUSTER_WAIT_S on a cluster and 0 (refuse
    at once) for a local Ray."""
    if ray.wait_for_resources_s is not None:
        return float(ray.wait_for_resources_s)
    return CLUSTER_WAIT_S if connects_to_cluster(ray, environ) else 0.0


@dataclass(frozen=True, kw_only=True)
class MlflowConfig:
    # Empty: $MLFLOW_TRACKING_URI if set, else a SQLite store under the workdir. "off" disables tracking.
    tracking_uri: str = ""
    experiment: str = "bertpipe"
    run_name: str = ""
    # Model registry name of the pre-trained model; empty = bertpipe-<config name> (one name per config).
    registered_model: str = ""
    # Training metric points a pre-training worker keeps while the tracking server is unreachable: training goes on
    # and they are sent, in order, once it is back. A full buffer drops its oldest points (one line says so).
    buffer_points: int = 100_000
    # Seconds the end of pre-training waits for buffered points to reach the server; a line counts those that did not.
    flush_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        at_least("mlflow", self, 1, "buffer_points")
        at_least("mlflow", self, 0, "flush_timeout_s")


@dataclass(frozen=True, kw_only=True)
class RootConfig:
    # Where stage outputs go: <workdir>/<stage>/ (any local path or s3:// / gs:// URI).
    workdir: str = path_field("work/tiny")
    seed: int = 12345
    ray: RayConfig = field(default_factory=RayConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    clean: CleanConfig = field(default_factory=CleanConfig)
    vocab: VocabConfig = field(default_factory=VocabConfig)
    pairs: PairsConfig = field(default_factory=PairsConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    pretrain: PretrainConfig = field(default_factory=PretrainConfig)
    glue: GlueConfig = field(default_factory=GlueConfig)
    squad: SquadConfig = field(default_factory=SquadConfig)
    ner: NerConfig = field(default_factory=NerConfig)
    features: FeaturesConfig = field(default_factory=FeaturesConfig)

    def __post_init__(self) -> None:
        if not self.workdir:
            raise ValueError("workdir must name a folder or URI")
        # numpy's generators (fine-tuning, masking) take seeds in [0, 2**32); one range for every consumer.
        within("", self, "seed", 0, 2**32, high_open=True)
        if self.model.preset == FROM_INIT and not self.pretrain.init:
            raise ValueError(f"model.preset {FROM_INIT} takes the shape of pretrain.init, which is not set")


# The presets: configs/ of a checkout, or bertpipe/configs/ of an installed wheel (pyproject's package data) or of a
# job's staged code (jobs/submit.py): beside jobs/ in all three, so one rule finds them without the checkout.
CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
log = logging.getLogger("bertpipe.config")


def preset_names() -> list[str]:
    """The bare names `--config` resolves to a preset (`tiny` for configs/tiny.yaml), sorted."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")) if CONFIG_DIR.is_dir() else []


def find_preset(name_or_path: str) -> Path:
    """`configs/tiny.yaml`, a path, or a bare preset name like `tiny`."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    # `configs/tiny.yaml` must also resolve when a job runs from another directory than the repo root.
    for candidate in (CONFIG_DIR.parent / name_or_path, CONFIG_DIR / name_or_path,
                      CONFIG_DIR / f"{name_or_path}.yaml"):
        if candidate.is_file():
            return candidate
    raise ConfigError(f"config {name_or_path!r} not found (presets: {preset_names()})")


def load_config(path: str | None = None, overrides: list[str] | None = None,
                workdir: str | None = None, base: str | None = None) -> RootConfig:
    """The run's config: checked (every value, every combination) and with every path absolute or a URI.

    Relative paths, in a preset, an override or `--workdir`, are relative to `base` (default: the current
    directory, where the user typed the command), never to wherever a later process happens to run."""
    data: dict[str, Any] = renamed_sections(load_yaml(find_preset(path)) if path else {})
    data = apply_overrides(data, [renamed_override(o) for o in overrides or []])
    if workdir:
        data["workdir"] = workdir
    try:
        cfg = from_dict(RootConfig, data)
    except ConfigError:
        raise
    except ValueError as exc:  # a __post_init__ check: the same one-line user error
        raise ConfigError(str(exc)) from None
    cfg = resolve_paths(cfg, base or os.getcwd())
    # Once, here on the driver: every stage (and the workers they start) reads the same number.
    cfg = dataclasses.replace(cfg, ray=dataclasses.replace(cfg.ray, wait_for_resources_s=resolved_wait_s(cfg.ray)))
    if cfg.pretrain.init:
        from bertpipe.jobs.pretrain.init import apply

        try:  # the init's vocabulary, casing and shape (checked: its folder exists and holds a BERT)
            cfg = apply(cfg, data)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    return cfg


def renamed_sections_table() -> dict[str, str]:
    """Config sections renamed, old name -> new: a renamed stage's section (named as the stage) was renamed with it,
    and its old name still loads (in a file or a --set), with a warning naming the new one."""
    from bertpipe.jobs.workflow.stages import STAGES  # imported here: the workflow's modules import this one

    return {old: s.name for s in STAGES for old in s.old_names if s.name in s.sections}


def renamed_sections(data: dict[str, Any]) -> dict[str, Any]:
    """`data` with every renamed section under its new name, a warning for each."""
    for old, new in renamed_sections_table().items():
        if old in data:
            if new in data:
                raise ConfigError(f"config sections {new} and {old} (its old name) are both set: keep {new}")
            _warn_renamed(old, new)
            data = {(new if k == old else k): v for k, v in data.items()}
    return data


def renamed_override(text: str) -> str:
    """A `--set` override with a renamed section's old name (`finetune.tasks=[MRPC]`) under the new one."""
    section, dot, rest = text.partition(".")
    renames = renamed_sections_table()
    if dot and section.strip() in renames:
        _warn_renamed(section.strip(), renames[section.strip()])
        return f"{renames[section.strip()]}.{rest}"
    return text


def _warn_renamed(old: str, new: str) -> None:
    log.warning("config section %s is now %s: read as %s (the old name will go; write %s)", old, new, new, new)


def resolved_tracking_uri(cfg: RootConfig) -> str:
    """MLflow tracking URI for this run ('' when tracking is off)."""
    uri = cfg.mlflow.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "")
    if uri == "off":
        return ""
    if uri:
        return uri
    if storage.is_remote(cfg.workdir):
        return ""  # no sensible local default for a remote workdir: track only when told where
    return "sqlite:///" + WorkdirPaths(cfg.workdir).mlflow_db


def config_as_dict(cfg: RootConfig) -> dict[str, Any]:
    return to_dict(cfg)

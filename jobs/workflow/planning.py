"""Planning a run before anything starts: each selected stage's inputs, raw inputs and fingerprint, and its
preflight, on the driver, before MLflow or Ray. Bad input fails here in seconds with one line and nothing written.

A stage's fingerprint covers its config sections, the seed, the schema version, its raw inputs (dump size +
checksum) and its inputs: the output ids of the upstream manifests, or, for an input the user named explicitly (a
vocab.txt, a shard folder, a checkpoint), that input's content checksums. A changed field, a different dump or a
rerun upstream stage makes it (and everything after it) stale.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bertpipe.jobs.config import RootConfig, connects_to_cluster
from bertpipe.jobs.services.configtools import stable_hash
from bertpipe.jobs.services.tracking import RunLogger
from bertpipe.jobs.workflow import stages as stage_list
from bertpipe.pipeline.framework import outputs
from bertpipe.pipeline.framework.console import Console
from bertpipe.pipeline.framework.identity import describe_tree
from bertpipe.pipeline.framework.paths import WorkdirPaths
from bertpipe.pipeline.framework.stage import (SCHEMA_VERSION, Stage, StageContext, StageInput, StageInputError,
                                               manifest_state)

FolderState = tuple[dict | None, list[str]]


def stage_uri(cfg: RootConfig, name: str) -> str:
    return WorkdirPaths(cfg.workdir).stage(name)


def stage_config(cfg: RootConfig, stage: Stage) -> dict[str, Any]:
    return {section: getattr(cfg, section) for section in stage.sections}


def _field(cfg: RootConfig, dotted: str) -> Any:
    section, key = dotted.split(".")
    return getattr(getattr(cfg, section), key)


def explicit_inputs(cfg: RootConfig, stage: Stage) -> dict[str, str]:
    """{upstream stage: URI} for the inputs the config names explicitly (they override upstream outputs)."""
    return {up: _field(cfg, key) for up, key in stage.explicit if _field(cfg, key)}


def needed_inputs(cfg: RootConfig, stage: Stage) -> tuple[str, ...]:
    explicit = explicit_inputs(cfg, stage)
    unneeded = {up for up, key in stage.unneeded_when if _field(cfg, key) and up not in explicit}
    return tuple(up for up in stage.inputs if up not in unneeded)


def raw_inputs_of(cfg: RootConfig, stage: Stage) -> list[dict[str, Any]]:
    """The stage's raw inputs, as its code describes them from its first config section."""
    return stage.code().describe_raw_inputs(getattr(cfg, stage.sections[0]))


def fingerprint(cfg: RootConfig, stage: Stage, inputs: dict[str, StageInput], raw: list[dict[str, Any]],
                explicit_ids: dict[str, list[dict[str, Any]]]) -> str:
    """The hash a committed manifest must carry for the stage to count as fresh: the stage's config sections, the
    seed, the schema version (pipeline/framework/stage.py `SCHEMA_VERSION`), the identity (uri, size, checksum) of
    its raw inputs, and per input the upstream manifest's output id, or, for an input the user named explicitly,
    that input's checksums."""
    upstream = {}
    for name, inp in sorted(inputs.items()):
        upstream[name] = ([{k: r.get(k) for k in ("uri", "size", "checksum")} for r in explicit_ids[name]]
                          if inp.explicit else (inp.manifest or {}).get("output_id"))
    return stable_hash({
        "stage": stage.name,
        "schema_version": SCHEMA_VERSION,
        "seed": cfg.seed,
        "config": stage_config(cfg, stage),
        "raw_inputs": [{k: r.get(k) for k in ("uri", "size", "checksum")} for r in raw],
        "upstream": upstream,
    })


def folder_state(uri: str, checksums: bool = False) -> FolderState:
    """(valid manifest or None, what makes the folder broken: an invalid manifest, a file missing, resized, changed
    or not in the manifest). (None, []) = never committed; (manifest, []) = committed and intact."""
    manifest, problem = manifest_state(uri)
    if problem:
        return None, [problem]
    return manifest, outputs.check(uri, manifest, checksums=checksums) if manifest else []


def folder_states(cfg: RootConfig, checksums: bool = False) -> dict[str, FolderState]:
    """{stage: folder_state} for every stage."""
    return {stage.name: folder_state(stage_uri(cfg, stage.name), checksums) for stage in stage_list.STAGES}


@dataclass
class StagePlan:
    """What planning found for one stage: its inputs, raw inputs and fingerprint (when computable now)."""

    stage: Stage
    inputs: dict[str, StageInput]
    raw: list[dict[str, Any]]
    explicit_ids: dict[str, list[dict[str, Any]]]

    def fingerprint(self, cfg: RootConfig) -> str:
        return fingerprint(cfg, self.stage, self.inputs, self.raw, self.explicit_ids)


def plan_stage(cfg: RootConfig, stage: Stage, states: dict[str, FolderState], will_run: set[str]) -> StagePlan:
    """Inputs of `stage` (explicit ones described by checksum), or StageInputError saying what is missing."""
    explicit = explicit_inputs(cfg, stage)
    inputs, ids = {}, {}
    for up in needed_inputs(cfg, stage):
        if up in explicit:
            key = dict(stage.explicit)[up]
            ids[up] = describe_tree(explicit[up], what=key)
            inputs[up] = StageInput(up, explicit[up], None, explicit=True)
            continue
        manifest, gone = states[up]
        if up not in will_run and (manifest is None or gone):
            why = (f"its committed output is broken: {'; '.join(gone[:3])}" if gone else
                   f"no {up}/_MANIFEST.json under {cfg.workdir}")
            hint = f" or set {dict(stage.explicit)[up]}" if up in dict(stage.explicit) else ""
            raise StageInputError(f"stage {stage.name} needs the committed output of {up} ({why}); "
                                  f"run `bertpipe run --from {up}`{hint}")
        inputs[up] = StageInput(up, stage_uri(cfg, up), manifest)
    return StagePlan(stage, inputs, raw_inputs_of(cfg, stage), ids)


def preflight(cfg: RootConfig, selected: list[str]) -> dict[str, StagePlan]:
    """Check every selected stage's inputs before anything runs; StageInputError / ValueError on the first problem."""
    states = folder_states(cfg)
    plans: dict[str, StagePlan] = {}
    for stage in stage_list.STAGES:
        if stage.name not in selected:
            continue
        plan = plan_stage(cfg, stage, states, set(plans))
        outputs.refuse_foreign(stage_uri(cfg, stage.name), stage.name)  # a rerun would have to delete it
        read = stage_config(cfg, stage)
        read.update({s: getattr(cfg, s) for s in stage.preflight_reads if s in selected or s in stage.sections})
        stage.code().preflight(context(cfg, stage, plan.inputs, sections=read))
        plans[stage.name] = plan
    return plans


def context(cfg: RootConfig, stage: Stage, inputs: dict[str, StageInput], run: RunLogger | None = None,
            registered: str = "", console: Console | None = None,
            sections: dict[str, Any] | None = None) -> StageContext:
    """What the stage's code gets: its config sections (`sections`: those and the ones its preflight reads), its
    inputs, its MLflow run and the run's console."""
    run = run or RunLogger(None)
    paths = WorkdirPaths(cfg.workdir)
    # registered_model: the name the pre-trained model is registered under in MLflow's model registry.
    tracking = {**run.coordinates, "registered_model": registered} if run.active else {}
    return StageContext(
        name=stage.name, output_uri=paths.stage(stage.name), config=sections or stage_config(cfg, stage),
        seed=cfg.seed, inputs=inputs, log_metrics=run.log_metrics,
        log_text=lambda text, name: run.log_bytes(text.encode(), name), tracking=tracking, paths=paths,
        wait_for_resources_s=cfg.ray.wait_for_resources_s, console=console or Console(),
        local_ray_cpus=0 if connects_to_cluster(cfg.ray) else cfg.ray.num_cpus)

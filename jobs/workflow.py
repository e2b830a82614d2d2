"""The workflow: stages in order, each skipped when its committed manifest matches its fingerprint.

clean -> vocab -> pairs -> pretrain -> finetune. A stage's fingerprint covers its config sections, the seed,
the schema version, its raw inputs (dump size + checksum) and the output ids of the upstream manifests; so a
changed field, a different dump or a rerun upstream stage makes it (and everything after it) stale.
"""
from __future__ import annotations

import importlib
import logging
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from jobs.config import RootConfig, config_as_dict, resolved_tracking_uri
from jobs.configtools import stable_hash, to_dict
from jobs.tracking import WorkflowTracker
from pipeline import storage
from pipeline.stage import (SCHEMA_VERSION, StageContext, StageInput, StageInputError, read_manifest,
                            write_manifest)

log = logging.getLogger("bertpipe")


@dataclass(frozen=True)
class Stage:
    name: str
    sections: tuple[str, ...]      # config sections that define the stage (its fingerprint and MLflow params)
    inputs: tuple[str, ...]        # upstream stages whose committed output it reads
    run: str                       # "module:function" — imported only when the stage runs
    raw_inputs: str = ""           # "module:function(section_config) -> [{uri,size,checksum}]"


STAGES: tuple[Stage, ...] = (
    Stage("clean", ("clean",), (), "pipeline.clean:run_stage", "pipeline.clean:describe_raw_inputs"),
    Stage("vocab", ("vocab",), ("clean",), "pipeline.vocab:run_stage", "pipeline.vocab:describe_raw_inputs"),
    Stage("pairs", ("pairs",), ("clean", "vocab"), "pipeline.pairs:run_stage"),
    Stage("pretrain", ("model", "pretrain"), ("pairs", "vocab"), "jobs.pretrain:run_stage"),
    Stage("finetune", ("finetune",), ("pretrain",), "jobs.finetune:run_stage",
          "jobs.finetune:describe_raw_inputs"),
)
STAGE_NAMES = tuple(s.name for s in STAGES)


def _load(ref: str) -> Callable[..., Any]:
    module, func = ref.split(":")
    return getattr(importlib.import_module(module), func, None)


def stage_uri(cfg: RootConfig, name: str) -> str:
    return storage.join(cfg.workdir, name)


def code_version() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parent, timeout=5)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def stage_config(cfg: RootConfig, stage: Stage) -> dict[str, Any]:
    return {section: getattr(cfg, section) for section in stage.sections}


def raw_inputs_of(cfg: RootConfig, stage: Stage) -> list[dict[str, Any]]:
    if not stage.raw_inputs:
        return []
    describe = _load(stage.raw_inputs)
    if describe is None:
        return []
    return describe(getattr(cfg, stage.sections[0]))


def fingerprint(cfg: RootConfig, stage: Stage, upstream: dict[str, dict | None],
                raw: list[dict[str, Any]]) -> str:
    return stable_hash({
        "stage": stage.name,
        "schema_version": SCHEMA_VERSION,
        "seed": cfg.seed,
        "config": stage_config(cfg, stage),
        "raw_inputs": [{k: r.get(k) for k in ("uri", "size", "checksum")} for r in raw],
        "upstream": {name: (m or {}).get("output_id") for name, m in sorted(upstream.items())},
    })


def select(only: list[str] | None, start: str | None) -> list[str]:
    for name in list(only or []) + ([start] if start else []):
        if name not in STAGE_NAMES:
            raise ValueError(f"unknown stage {name!r}; stages are {', '.join(STAGE_NAMES)}")
    if only and start:
        raise ValueError("--only and --from cannot be combined")
    if only:
        return [n for n in STAGE_NAMES if n in only]
    if start:
        return list(STAGE_NAMES[STAGE_NAMES.index(start):])
    return list(STAGE_NAMES)


def status(cfg: RootConfig) -> list[dict[str, Any]]:
    """Every stage with its state: fresh (committed, matches), stale (committed, would rerun), missing."""
    rows, states, manifests = [], {}, {}
    for stage in STAGES:
        uri = stage_uri(cfg, stage.name)
        manifest = read_manifest(uri)
        manifests[stage.name] = manifest
        try:
            raw = raw_inputs_of(cfg, stage)
            expected = fingerprint(cfg, stage, {n: manifests[n] for n in stage.inputs}, raw)
            problem = ""
        except (StageInputError, ValueError, OSError) as exc:
            expected, problem = "", str(exc)
        if manifest is None:
            state = "missing"
        elif manifest.get("fingerprint") != expected or any(states[n] != "fresh" for n in stage.inputs):
            state = "stale"
        else:
            state = "fresh"
        states[stage.name] = state
        rows.append({
            "stage": stage.name, "state": state, "output": uri,
            "rows": (manifest or {}).get("num_rows"), "bytes": (manifest or {}).get("num_bytes"),
            "seconds": (manifest or {}).get("seconds"), "finished_at": (manifest or {}).get("finished_at"),
            "fingerprint": expected, **({"problem": problem} if problem else {}),
        })
    return rows


def run(cfg: RootConfig, *, only: list[str] | None = None, start: str | None = None,
        force: bool = False) -> list[dict[str, Any]]:
    """Run the selected stages in order; returns one summary row per stage (ran / skipped)."""
    selected = select(only, start)
    tracker = WorkflowTracker(resolved_tracking_uri(cfg), cfg.mlflow.experiment,
                              artifact_root=storage.join(cfg.workdir, "mlartifacts"))
    tracker.start_parent(cfg.mlflow.run_name or f"workflow {time.strftime('%Y-%m-%d %H:%M:%S')}",
                         config_as_dict(cfg), {"bertpipe.stages": ",".join(selected)})
    manifests = {s.name: read_manifest(stage_uri(cfg, s.name)) for s in STAGES}
    summary: list[dict[str, Any]] = []
    ok = False
    try:
        for stage in STAGES:
            if stage.name not in selected:
                continue
            missing = [n for n in stage.inputs if manifests[n] is None]
            if missing:
                raise StageInputError(
                    f"stage {stage.name} needs the committed output of {', '.join(missing)} "
                    f"(no {missing[0]}/_MANIFEST.json under {cfg.workdir}); run those stages first")
            raw = raw_inputs_of(cfg, stage)
            fp = fingerprint(cfg, stage, {n: manifests[n] for n in stage.inputs}, raw)
            section_cfg = {k: to_dict(v) for k, v in stage_config(cfg, stage).items()}
            run_id = tracker.start_stage(stage.name, {**section_cfg, "seed": cfg.seed})
            current = manifests[stage.name]
            if current is not None and current.get("fingerprint") == fp and not force:
                log.info("stage %-8s fresh (fingerprint %s), skipped", stage.name, fp[:12])
                tracker.set_tag(run_id, "bertpipe.skipped", "fresh")
                tracker.log_metrics(run_id, {"num_rows": current.get("num_rows", 0), "skipped": 1})
                tracker.log_dict_artifact(run_id, current, "_MANIFEST.json")
                tracker.end(run_id, True)
                summary.append({"stage": stage.name, "action": "skipped", "rows": current.get("num_rows")})
                continue
            manifests[stage.name] = _run_stage(cfg, stage, fp, raw, manifests, tracker, run_id)
            summary.append({"stage": stage.name, "action": "ran", "rows": manifests[stage.name]["num_rows"],
                            "seconds": manifests[stage.name]["seconds"]})
        ok = True
    finally:
        tracker.end(tracker.parent_run_id, ok)
    return summary


def _run_stage(cfg: RootConfig, stage: Stage, fp: str, raw: list[dict[str, Any]],
               manifests: dict[str, dict | None], tracker: WorkflowTracker, run_id: str) -> dict[str, Any]:
    from jobs.raycluster import ensure_ray

    uri = stage_uri(cfg, stage.name)
    log.info("stage %-8s running -> %s", stage.name, uri)
    started = time.time()
    # Emptying the folder removes the old manifest first: from here until the new one is written the folder
    # reads as incomplete, so a crash can never leave a committed half-output.
    storage.reset_dir(uri)
    ensure_ray(cfg.ray.address, cfg.ray.num_cpus, cfg.ray.dashboard)
    ctx = StageContext(
        name=stage.name, output_uri=uri, config=stage_config(cfg, stage), seed=cfg.seed,
        inputs={n: StageInput(n, stage_uri(cfg, n), manifests[n]) for n in stage.inputs},
        log_metrics=lambda metrics, step=None: tracker.log_metrics(run_id, metrics, step),
        tracking=tracker.coordinates(run_id),
    )
    try:
        result = _load(stage.run)(ctx)
        if not result.raw_inputs:
            result.raw_inputs = raw
        storage.write_text_atomic(storage.join(uri, "_CONFIG.json"),
                                  _json({"seed": cfg.seed, **{k: to_dict(v) for k, v in ctx.config.items()}}))
        manifest = write_manifest(
            uri, stage=stage.name, fingerprint=fp, result=result,
            config={k: to_dict(v) for k, v in ctx.config.items()},
            inputs={n: manifests[n]["output_id"] for n in stage.inputs}, started=started,
            code_version=code_version(),
        )
    except BaseException:
        tracker.end(run_id, False)
        raise
    tracker.log_final_metrics(run_id, {**result.metrics, "num_rows": manifest["num_rows"],
                                       "num_bytes": manifest["num_bytes"], "seconds": manifest["seconds"]})
    tracker.log_dict_artifact(run_id, manifest, "_MANIFEST.json")
    tracker.end(run_id, True)
    log.info("stage %-8s done: %s rows in %.1f s", stage.name, manifest["num_rows"], manifest["seconds"])
    return manifest


def _json(data: Any) -> str:
    import json

    return json.dumps(data, indent=2, sort_keys=True)

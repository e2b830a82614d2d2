"""The workflow: stages in order, each skipped when its committed manifest matches its fingerprint.

clean -> vocab -> pairs -> pretrain -> glue. A stage's fingerprint covers its config sections, the seed,
the schema version, its raw inputs (dump size + checksum) and its inputs: the output ids of the upstream manifests,
or, for an input the user named explicitly (a vocab.txt, a shard folder, a checkpoint), that input's content
checksums. A changed field, a different dump or a rerun upstream stage makes it (and everything after it) stale.

Every run starts with a preflight on the driver, before MLflow or Ray: config values, inputs and raw inputs of
every selected stage are checked, so bad input fails in seconds with one line and nothing half-written.
"""
from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import subprocess
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from bertpipe.jobs import console_lines, run_record
from bertpipe.jobs.config import RootConfig, config_as_dict, resolved_tracking_uri
from bertpipe.jobs.services.configtools import stable_hash, to_dict
from bertpipe.jobs.glue.report import as_fractions
from bertpipe.pipeline.framework import outputs, parts, storage
from bertpipe.pipeline.framework.console import Console
from bertpipe.jobs.services.interrupts import interrupt_text, reinstall as reinstall_interrupts
from bertpipe.jobs.services.tracking import RunLogger, start_workflow_run
from bertpipe.pipeline.framework.identity import describe_tree
from bertpipe.pipeline.framework.paths import WorkdirPaths
from bertpipe.pipeline.framework.redact import mask_data
from bertpipe.pipeline.framework.stage import (CONFIG_NAME, SCHEMA_VERSION, StageContext, StageInput, StageInputError,
                                     manifest_state, read_manifest, write_manifest)

log = logging.getLogger("bertpipe")


class StageReferenceError(RuntimeError):
    """A stage's "module:function" reference names no module or no function: a bug in STAGES, never user input."""


def _check_reference(stage: str, ref: str) -> None:
    """At definition: the reference has the "module:function" shape and its module exists (found, not imported:
    stage code is imported only when used; `_load` then checks the function)."""
    module, _, func = ref.partition(":")
    try:
        found = importlib.util.find_spec(module) is not None if module and func.isidentifier() else False
    except ModuleNotFoundError:  # a parent package is missing
        found = False
    if not found:
        raise StageReferenceError(f"stage {stage}: {ref!r} does not resolve to an existing module:function")


@dataclass(frozen=True)
class Stage:
    name: str
    sections: tuple[str, ...]      # config sections that define the stage (its fingerprint and MLflow params)
    inputs: tuple[str, ...]        # upstream stages whose committed output it reads
    run: str                       # "module:function" — imported only when the stage runs
    raw_inputs: str = ""           # "module:function(section_config) -> [{uri,size,checksum}]"
    # upstream stage -> the config field ("section.key") that names that input explicitly instead
    explicit: tuple[tuple[str, str], ...] = ()
    check: str = ""                # "module:function(StageContext)": stage-specific preflight, raises on bad input
    training: bool = False         # MLflow system metrics (CPU, memory, GPU) are logged while it runs
    # Runs only when named (`--only squad`, `--from squad`): a job the default workflow leaves out because it
    # needs data the user must point at (SQuAD and CoNLL files).
    opt_in: bool = False
    # The names the stage writes in its folder (glob patterns, `*` crossing folders), announced in the run record
    # before it writes: a run killed outright leaves files the next run knows as its own
    # (pipeline/framework/outputs.py).
    # tests/test_crash_resume.py checks them against what real runs write.
    writes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for ref in self.references:
            _check_reference(self.name, ref)

    @property
    def references(self) -> tuple[str, ...]:
        """Its "module:function" references: run, raw inputs, check (those set)."""
        return tuple(r for r in (self.run, self.raw_inputs, self.check) if r)


STAGES: tuple[Stage, ...] = (
    Stage("clean", ("clean",), (), "bertpipe.pipeline.stages.clean:run_stage",
          "bertpipe.pipeline.stages.clean:describe_raw_inputs",
          check="bertpipe.pipeline.stages.clean:preflight", writes=("docs-*.parquet",)),
    Stage("vocab", ("vocab",), ("clean",), "bertpipe.pipeline.stages.vocab:run_stage",
          "bertpipe.pipeline.stages.vocab:describe_raw_inputs", explicit=(("clean", "vocab.input"),),
          check="bertpipe.pipeline.stages.vocab:preflight", writes=("vocab.txt", "tokenizer.json")),
    Stage("pairs", ("pairs", "vocab"), ("clean", "vocab"), "bertpipe.pipeline.stages.pairs:run_stage",
          explicit=(("clean", "pairs.input"), ("vocab", "vocab.path")),
          check="bertpipe.pipeline.stages.vocab:preflight",
          writes=("seq*/*.parquet", "_parts/seq*/*.arrow", "instances*")),
    # pretrain first: its raw inputs (pretrain.init's files) are described from the first section.
    Stage("pretrain", ("pretrain", "model"), ("pairs", "vocab"), "bertpipe.jobs.pretrain.stage:run_stage",
          "bertpipe.jobs.pretrain.init:describe_raw_inputs",
          explicit=(("pairs", "pretrain.input"), ("vocab", "vocab.path")),
          check="bertpipe.jobs.pretrain.stage:preflight", training=True,
          writes=("deepspeed_config.json", "metrics.json", "history.json", "baselines.json", "curve_*.png",
                  "export/*")),
    Stage("glue", ("glue",), ("pretrain",), "bertpipe.jobs.glue.stage:run_stage",
          "bertpipe.jobs.glue.stage:describe_raw_inputs", explicit=(("pretrain", "glue.init"),),
          check="bertpipe.jobs.glue.stage:preflight", training=True,
          writes=("models/*", "smoke_glue/*", "submission/*", "submission.zip", "summary.*", "_trials/*")),
    Stage("squad", ("squad",), ("pretrain",), "bertpipe.jobs.squad.stage:run_stage",
          "bertpipe.jobs.squad.stage:describe_raw_inputs", explicit=(("pretrain", "squad.init"),),
          check="bertpipe.jobs.squad.stage:preflight", training=True, opt_in=True),
    Stage("ner", ("ner",), ("pretrain",), "bertpipe.jobs.ner.stage:run_stage",
          "bertpipe.jobs.ner.stage:describe_raw_inputs", explicit=(("pretrain", "ner.init"),),
          check="bertpipe.jobs.ner.stage:preflight", training=True, opt_in=True),
    Stage("features", ("features",), ("pretrain",), "bertpipe.jobs.features.stage:run_stage",
          "bertpipe.jobs.features.stage:describe_raw_inputs", explicit=(("pretrain", "features.init"),),
          check="bertpipe.jobs.features.stage:preflight", opt_in=True),
)
STAGE_NAMES = tuple(s.name for s in STAGES)
# Stages renamed, old name -> new: `--only` / `--from` still take the old name, with a warning naming the new one.
# `finetune` was GLUE's alone, while SQuAD and NER fine-tune too.
RENAMED_STAGES = {"finetune": "glue"}
# What a stage's manifest counts (its num_rows), as the console says it: "97 documents", "40 steps".
UNITS = {"clean": "documents", "vocab": "vocabulary entries", "pairs": "instances", "pretrain": "steps",
         "glue": "trials", "squad": "eval questions", "ner": "eval sentences", "features": "sentences"}


class RunSummary(list):
    """What `run` returns: one row per stage (a list, as before), and the MLflow workflow run it made
    (`workflow_run`: tracking_uri, experiment_id, run_id; empty when tracking is off)."""

    workflow_run: dict[str, str] = {}


class StageFailed(RuntimeError):
    """A stage raised while running; carries its name so the CLI can say which stage and how to resume."""

    def __init__(self, stage: str, cause: BaseException):
        super().__init__(f"stage {stage} failed: {type(cause).__name__}: {cause}")
        self.stage = stage
        self.cause = cause


def _load(ref: str) -> Callable[..., Any]:
    """The function a stage reference names; StageReferenceError when it does not resolve (a typo must not read
    as "no raw inputs": their checksums would drop out of the fingerprint and stale outputs would look fresh)."""
    module, _, func = ref.partition(":")
    try:
        target = getattr(importlib.import_module(module), func)
    except ModuleNotFoundError as exc:
        if exc.name != module:
            raise  # the module exists but something it imports is missing: that error, as it is
        raise StageReferenceError(f"stage reference {ref!r}: no module {module}") from None
    except AttributeError:
        raise StageReferenceError(f"stage reference {ref!r}: {module} has no {func}") from None
    if not callable(target):
        raise StageReferenceError(f"stage reference {ref!r} is not a function")
    return target


def stage_uri(cfg: RootConfig, name: str) -> str:
    return WorkdirPaths(cfg.workdir).stage(name)


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, cwd=Path(__file__).resolve().parent,
                             timeout=5)
        return out.stdout.strip() if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def git_tags() -> dict[str, str]:
    """The code a run used: commit and whether the tree had uncommitted changes ("unknown" outside git)."""
    commit = _git("rev-parse", "--short", "HEAD")
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    return {"bertpipe.git_commit": commit or "unknown",
            "bertpipe.git_dirty": "unknown" if dirty is None else str(bool(dirty)).lower()}


def code_version(tags: dict[str, str]) -> str:
    """The manifest's code version: the commit, marked -dirty when the tree had uncommitted changes."""
    return tags["bertpipe.git_commit"] + ("-dirty" if tags["bertpipe.git_dirty"] == "true" else "")


def stage_config(cfg: RootConfig, stage: Stage) -> dict[str, Any]:
    return {section: getattr(cfg, section) for section in stage.sections}


def _field(cfg: RootConfig, dotted: str) -> Any:
    section, key = dotted.split(".")
    return getattr(getattr(cfg, section), key)


def explicit_inputs(cfg: RootConfig, stage: Stage) -> dict[str, str]:
    """{upstream stage: URI} for the inputs the config names explicitly (they override upstream outputs)."""
    return {up: _field(cfg, key) for up, key in stage.explicit if _field(cfg, key)}


def needed_inputs(cfg: RootConfig, stage: Stage) -> tuple[str, ...]:
    # A vocab stage given an existing vocab.txt reads no documents.
    if stage.name == "vocab" and cfg.vocab.path and not cfg.vocab.input:
        return ()
    return stage.inputs


def raw_inputs_of(cfg: RootConfig, stage: Stage) -> list[dict[str, Any]]:
    if not stage.raw_inputs:
        return []
    return _load(stage.raw_inputs)(getattr(cfg, stage.sections[0]))


def fingerprint(cfg: RootConfig, stage: Stage, inputs: dict[str, StageInput], raw: list[dict[str, Any]],
                explicit_ids: dict[str, list[dict[str, Any]]]) -> str:
    """The hash a committed manifest must carry for the stage to count as fresh: the stage's config sections, the
    seed, the schema version (pipeline/framework/stage.py `SCHEMA_VERSION`), the identity (uri, size, checksum) of
    its raw inputs, and per input the upstream manifest's output id, or, for an input the user named explicitly,
    that input's checksums. So a changed config field, a different dump, or a rerun of an upstream stage makes this
    stage and everything after it stale."""
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


def current_stage_names(names: list[str]) -> list[str]:
    """`names` with every renamed stage (RENAMED_STAGES) under its new name, a warning for each."""
    out = []
    for name in names:
        if name in RENAMED_STAGES:
            log.warning("stage %s is now %s: running %s (the old name will go; write %s)", name,
                        RENAMED_STAGES[name], RENAMED_STAGES[name], RENAMED_STAGES[name])
        out.append(RENAMED_STAGES.get(name, name))
    return out


def select(only: list[str] | None, start: str | None) -> list[str]:
    only = current_stage_names(only) if only else only
    start = current_stage_names([start])[0] if start else start
    for name in list(only or []) + ([start] if start else []):
        if name not in STAGE_NAMES:
            raise ValueError(f"unknown stage {name!r}; stages are {', '.join(STAGE_NAMES)}")
    if only and start:
        raise ValueError("--only and --from cannot be combined")
    if only:
        return [n for n in STAGE_NAMES if n in only]
    if start:
        return [s.name for s in STAGES[STAGE_NAMES.index(start):] if s.name == start or not s.opt_in]
    return [s.name for s in STAGES if not s.opt_in]


def folder_state(uri: str, checksums: bool = False) -> tuple[dict | None, list[str]]:
    """(valid manifest or None, what makes the folder broken: an invalid manifest, a file missing, resized, changed
    or not in the manifest). (None, []) = never committed; (manifest, []) = committed and intact."""
    manifest, problem = manifest_state(uri)
    if problem:
        return None, [problem]
    return manifest, outputs.check(uri, manifest, checksums=checksums) if manifest else []


def committed(cfg: RootConfig, checksums: bool = False) -> dict[str, tuple[dict | None, list[str]]]:
    """{stage: folder_state} for every stage."""
    return {stage.name: folder_state(stage_uri(cfg, stage.name), checksums) for stage in STAGES}


@dataclass
class Plan:
    """What preflight found for one stage: its inputs, raw inputs and fingerprint (when computable now)."""

    stage: Stage
    inputs: dict[str, StageInput]
    raw: list[dict[str, Any]]
    explicit_ids: dict[str, list[dict[str, Any]]]

    def fingerprint(self, cfg: RootConfig) -> str:
        return fingerprint(cfg, self.stage, self.inputs, self.raw, self.explicit_ids)


def _plan(cfg: RootConfig, stage: Stage, state: dict[str, tuple[dict | None, list[str]]],
          will_run: set[str]) -> Plan:
    """Inputs of `stage` (explicit ones described by checksum), or StageInputError saying what is missing."""
    explicit = explicit_inputs(cfg, stage)
    inputs, ids = {}, {}
    for up in needed_inputs(cfg, stage):
        if up in explicit:
            key = dict(stage.explicit)[up]
            ids[up] = describe_tree(explicit[up], what=key)
            inputs[up] = StageInput(up, explicit[up], None, explicit=True)
            continue
        manifest, gone = state[up]
        if up not in will_run and (manifest is None or gone):
            why = (f"its committed output is broken: {'; '.join(gone[:3])}" if gone else
                   f"no {up}/_MANIFEST.json under {cfg.workdir}")
            hint = f" or set {dict(stage.explicit)[up]}" if up in dict(stage.explicit) else ""
            raise StageInputError(f"stage {stage.name} needs the committed output of {up} ({why}); "
                                  f"run `bertpipe run --from {up}`{hint}")
        inputs[up] = StageInput(up, stage_uri(cfg, up), manifest)
    return Plan(stage, inputs, raw_inputs_of(cfg, stage), ids)


def preflight(cfg: RootConfig, selected: list[str]) -> dict[str, Plan]:
    """Check every selected stage's inputs before anything runs; StageInputError / ValueError on the first problem."""
    if "pretrain" in selected and not (cfg.ray.address or os.environ.get("RAY_ADDRESS")):
        from bertpipe.jobs.pretrain.stage import check_resources

        # The local Ray this run will start has ray.num_cpus CPUs: refuse a layout that would hang on it now.
        check_resources(cfg.pretrain, {"CPU": cfg.ray.num_cpus, "GPU": cfg.pretrain.num_workers})
    if {"pairs", "pretrain"} <= set(selected) and not cfg.pretrain.input:
        _check_phase_lengths(cfg)
    state = committed(cfg)
    plans: dict[str, Plan] = {}
    for stage in STAGES:
        if stage.name not in selected:
            continue
        plan = _plan(cfg, stage, state, set(plans))
        outputs.refuse_foreign(stage_uri(cfg, stage.name), stage.name)  # a rerun would have to delete it
        if stage.check:
            _load(stage.check)(_context(cfg, stage, plan.inputs))
        plans[stage.name] = plan
    return plans


def _check_phase_lengths(cfg: RootConfig) -> None:
    """Pre-training reads one shard set per phase: pairs must write every length a phase with steps trains at,
    or the run would fail only after clean, vocab and pairs ran."""
    wanted = [ph.max_seq_length for ph, steps in zip(cfg.pretrain.phases, cfg.pretrain.phase_steps()) if steps]
    lacking = [n for n in wanted if n not in cfg.pairs.max_seq_lengths]
    if lacking:
        raise StageInputError(f"pretrain.phases train at max_seq_length {lacking} but pairs.max_seq_lengths is "
                              f"{list(cfg.pairs.max_seq_lengths)}: add the length to pairs, or change the phases")


def _context(cfg: RootConfig, stage: Stage, inputs: dict[str, StageInput], run: RunLogger | None = None,
             registered: str = "", console: Console | None = None) -> StageContext:
    run = run or RunLogger(None)
    paths = WorkdirPaths(cfg.workdir)
    # registered_model: the name the pre-trained model is registered under in MLflow's model registry.
    tracking = {**run.coordinates, "registered_model": registered} if run.active else {}
    return StageContext(
        name=stage.name, output_uri=paths.stage(stage.name), config=stage_config(cfg, stage), seed=cfg.seed,
        inputs=inputs, log_metrics=run.log_metrics, log_text=lambda text, name: run.log_bytes(text.encode(), name),
        tracking=tracking, paths=paths,
        wait_for_resources_s=cfg.ray.wait_for_resources_s, console=console or Console())


def status(cfg: RootConfig, verify: bool = False) -> list[dict[str, Any]]:
    """Every stage with its state: fresh (committed, matches), stale (committed, would rerun), broken (its
    manifest is invalid, or a file it lists is gone or resized, or one it does not list is there; with `verify`,
    or a file's checksum changed: reruns), missing. Opt-in stages (squad, ner, features) only once they have a
    manifest: a workflow that never ran them is not missing anything. The pretrain row also says what its latest
    run resumed from or started from (`start`: pretrain_start)."""
    state = committed(cfg, checksums=verify)
    rows, states = [], {}
    for stage in STAGES:
        manifest, gone = state[stage.name]
        kept = parts.count(stage_uri(cfg, stage.name))  # trials a failed run finished: the stage is not committed
        if stage.opt_in and manifest is None and not gone and not kept:
            continue
        try:
            plan = _plan(cfg, stage, state, set())
            expected, problem = plan.fingerprint(cfg), ""
        except (StageInputError, ValueError, OSError) as exc:
            expected, problem = "", str(exc)
        if gone:
            st, problem = "broken", "; ".join(gone[:5]) + (f"; {len(gone) - 5} more" if len(gone) > 5 else "")
        elif manifest is None:
            st = "missing"
            if kept and not problem:
                problem = f"a failed run kept {kept} finished trial(s); `bertpipe run` runs the rest and commits"
        elif manifest.get("fingerprint") != expected or any(
                states.get(n, "fresh") != "fresh" for n in needed_inputs(cfg, stage)
                if n not in explicit_inputs(cfg, stage)):
            st = "stale"
        else:
            st = "fresh"
        states[stage.name] = st
        rows.append({
            "stage": stage.name, "state": st, "output": stage_uri(cfg, stage.name),
            "rows": (manifest or {}).get("num_rows"), "bytes": (manifest or {}).get("num_bytes"),
            "seconds": (manifest or {}).get("seconds"), "finished_at": (manifest or {}).get("finished_at"),
            "fingerprint": expected, **({"problem": problem} if problem else {}),
        })
        if stage.name == "pretrain":
            start = pretrain_start(cfg, manifest)
            if start:
                rows[-1]["start"] = start
    return rows


def pretrain_start(cfg: RootConfig, manifest: dict | None) -> dict[str, Any] | None:
    """What pre-training resumed from (step, checkpoint, layout then and now) or started from (pretrain.init or
    random), as the stage recorded it when it started (jobs/pretrain/stage.py start_record): the committed run's
    (its manifest), or a later start's (its run folder's identity record: a run in progress, or one that failed)."""
    from bertpipe.jobs.pretrain import runs

    committed = ((manifest or {}).get("extra") or {}).get("start")
    try:
        later = runs.latest_start(cfg.pretrain.storage_path or WorkdirPaths(cfg.workdir).ray_results,
                                      cfg.pretrain.run_name)
    except (OSError, ValueError):
        later = None
    found = [r for r in (committed, later) if isinstance(r, dict) and "started_from" in r]
    return max(found, key=lambda r: r.get("at", 0.0)) if found else None


# The workflow run's headline metrics, {stage: {manifest metric: MLflow name}}: one value each (step 0).
HEADLINE = {"pretrain": {n: f"pretrain/{n}" for n in ("loss", "eval_mlm_accuracy", "eval_nsp_accuracy",
                                                     "baseline_mlm_accuracy", "baseline_nsp_accuracy")},
            "glue": {"glue_score": "glue/score", "bert_paper_average": "glue/bert_paper_average"}}


def headline_metrics(cfg: RootConfig) -> dict[str, float]:
    """What two workflow runs are compared by, from the committed manifests: pre-training's final loss, held-out
    accuracies and their baselines, the best dev score of every GLUE task (glue/<task>) and the GLUE average."""
    out: dict[str, float] = {}
    for stage, names in HEADLINE.items():
        metrics = (read_manifest(stage_uri(cfg, stage)) or {}).get("metrics", {})
        if stage == "glue":  # GLUE's percent, as fractions: one scale in MLflow
            metrics = as_fractions(metrics)
            out.update({f"glue/{k[4:]}": v for k, v in metrics.items() if k.startswith("dev.")})
        out.update({name: metrics[n] for n, name in names.items() if isinstance(metrics.get(n), (int, float))})
    return out


def run(cfg: RootConfig, *, only: list[str] | None = None, start: str | None = None, force: bool = False,
        verbose: bool = False, config_name: str = "", plans: dict[str, Plan] | None = None,
        console: Console | None = None) -> RunSummary:
    """Run the selected stages in order; returns one summary row per stage (ran / skipped), and the MLflow
    workflow run (RunSummary.workflow_run).

    `plans`: the result of `preflight` when the caller already ran it (the CLI does, before opening its log).
    `console`: where the run's lines and progress go (the CLI passes its live one); by default one that shows the
    stage lines and no progress.
    Raises StageInputError / ValueError from the preflight (nothing started) or StageFailed (a stage raised)."""
    console = console or Console()
    selected = select(only, start)
    plans = plans if plans is not None else preflight(cfg, selected)
    name = config_name or "custom"
    code = git_tags()  # once per run: every run of the workflow and every manifest names the same code
    console.reset()  # the console is this run's again (a failed run before it with this console had quieted it)
    # Runs that an earlier run of this workdir left RUNNING (its driver was killed) become KILLED; this run's own
    # id is recorded until it is closed, for the next run to do the same (jobs/run_record.py).
    with console.doing("mlflow: opening the tracking store (a new SQLite store first creates its tables)"):
        run_record.close_left_running(cfg.workdir, resolved_tracking_uri(cfg),
                                      lambda line: console.error(f"note: {line}"))
        # An empty run name: "<config> #<n> · <date time>" (jobs/services/tracking.py workflow_run_name).
        parent = start_workflow_run(resolved_tracking_uri(cfg), cfg.mlflow.experiment, cfg.mlflow.run_name,
                                    config_as_dict(cfg), {"bertpipe.stages": ",".join(selected),
                                                          "bertpipe.config": name, **code},
                                    artifact_root=WorkdirPaths(cfg.workdir).mlflow_artifacts)
    if parent.active:
        run_record.remember(cfg.workdir, resolved_tracking_uri(cfg), parent.run_id)
    registered = cfg.mlflow.registered_model or f"bertpipe-{name}"
    summary = RunSummary()
    summary.workflow_run = dict(parent.coordinates) if parent.active else {}
    outcome = "failed"
    try:
        for k, stage_name in enumerate(selected, 1):
            summary.append(_run_or_skip(cfg, plans[stage_name], parent, force, (k, len(selected)), verbose,
                                        registered, code, console))
            # Downstream plans read this stage's fresh manifest (a new output id makes them stale).
            for later in plans.values():
                if stage_name in later.inputs and not later.inputs[stage_name].explicit:
                    uri = stage_uri(cfg, stage_name)
                    later.inputs[stage_name] = StageInput(stage_name, uri, read_manifest(uri))
        outcome = "succeeded"
    except KeyboardInterrupt:
        outcome = "killed"  # SIGINT / SIGTERM (jobs/services/interrupts.py): KILLED, not FAILED
        raise
    finally:
        # Best effort: the store may be on the disk whose filling failed the stage. A run not closed stays in the
        # record, and the next run of the workdir closes it.
        if parent.close(outcome, headline_metrics(cfg)) and parent.active:
            run_record.forget(cfg.workdir, parent.run_id)
    return summary


def _run_or_skip(cfg: RootConfig, plan: Plan, parent: RunLogger, force: bool, position: tuple[int, int],
                 verbose: bool, registered: str, code: dict[str, str], console: Console) -> dict[str, Any]:
    stage = plan.stage
    fp = plan.fingerprint(cfg)
    run = parent.child(stage.name, {"bertpipe.kind": "stage", "bertpipe.stage": stage.name, **code})
    run.log_params({**stage_config(cfg, stage), "seed": cfg.seed})
    uri = stage_uri(cfg, stage.name)
    current, gone = folder_state(uri)
    if current is not None and current.get("fingerprint") == fp and not force and not gone:
        console_lines.stage(console, *position, stage.name, f"fresh (fingerprint {fp[:12]}), skipped")
        run.set_tag("bertpipe.skipped", "fresh")
        run.log_metrics({"num_rows": current.get("num_rows", 0), "skipped": 1})
        run.log_dict(current, "_MANIFEST.json")
        run.end(True)
        return {"stage": stage.name, "action": "skipped", "rows": current.get("num_rows"),
                "unit": UNITS.get(stage.name, "rows")}
    console_lines.stage(console, *position, stage.name, "running" if current is None and not gone else "rerunning (" + (
        "--force" if force else f"broken: {gone[0]}" if gone else "stale: config or inputs changed") + ")")
    monitor = run.system_metrics() if stage.training else None
    try:
        with console.doing(f"{stage.name}: running"):  # named on the console if the stage goes quiet
            manifest = _run_stage(cfg, plan, fp, run, verbose, registered, code_version(code), console,
                                  keep_parts=not force)
    except BaseException as exc:
        console.end_quietly()
        if isinstance(exc, KeyboardInterrupt):  # a signal: the run is KILLED, and the CLI says in which stage
            run.kill(f"{interrupt_text(exc)} while stage {stage.name} ran")
            exc.stage = stage.name
            raise
        run.fail(exc, traceback.format_exc())
        if isinstance(exc, Exception):
            raise StageFailed(stage.name, exc) from exc
        raise
    finally:
        if monitor is not None:
            monitor.finish()
        # Ray Train's fit takes SIGINT for its own graceful abort and leaves its handler behind (it then calls
        # sys.exit(0) on Ctrl-C): the next stage gets the run's handler back.
        reinstall_interrupts()
    return {"stage": stage.name, "action": "ran", "rows": manifest["num_rows"], "seconds": manifest["seconds"],
            "unit": UNITS.get(stage.name, "rows")}


def _run_stage(cfg: RootConfig, plan: Plan, fp: str, run: RunLogger, verbose: bool, registered: str,
               version: str, console: Console, keep_parts: bool = True) -> dict[str, Any]:
    from bertpipe.jobs.cluster import ensure_ray

    stage = plan.stage
    uri = stage_uri(cfg, stage.name)
    started = time.time()
    # Uncommits the folder (its manifest goes first, so a crash never leaves a committed half-output) and deletes
    # only what earlier runs of this stage wrote; anything else there stops the run, nothing deleted.
    # Trials a failed run of the stage finished stay (pipeline/framework/parts.py): the stage reuses those of the
    # same config.
    run_id = outputs.claim(uri, stage.name, keep_parts, stage.writes)
    kept = parts.count(uri)
    if kept:
        console.say(f"  {stage.name}: {kept} finished trial(s) kept by a failed run, reused where the config matches")
    try:
        address = cfg.ray.address or os.environ.get("RAY_ADDRESS", "")
        with console.doing(f"{stage.name}: connecting to Ray at {address}" if address else
                            f"{stage.name}: starting a local Ray ({cfg.ray.num_cpus} CPUs)"):
            started_ray = ensure_ray(cfg.ray.address, cfg.ray.num_cpus, cfg.ray.dashboard, verbose)
        if started_ray is not None:
            console_lines.ray_started(console, *started_ray)
        ctx = _context(cfg, stage, plan.inputs, run, registered, console)
        result = _load(stage.run)(ctx)
        explicit = [r for ids in plan.explicit_ids.values() for r in ids]
        result.raw_inputs = (result.raw_inputs or plan.raw) + explicit
        # The recorded config (here and in the manifest) is for people to read: no password in an input URI.
        config = mask_data({k: to_dict(v) for k, v in ctx.config.items()})
        outputs.remove_temps(uri)
        storage.write_text_atomic(storage.join(uri, CONFIG_NAME), _json({"seed": cfg.seed, **config}))
        manifest = write_manifest(
            uri, stage=stage.name, fingerprint=fp, result=result, config=config,
            inputs={n: (i.manifest["output_id"] if i.manifest else i.uri) for n, i in plan.inputs.items()},
            started=started, code_version=version,
        )
    except BaseException as exc:
        _after_failure(uri, run_id, exc, console)
        raise
    outputs.release(uri)
    # The stage's summary, one value per figure at step 0 (MLflow draws a bar, not a one-point line): only what the
    # stage did not log into its run itself (no duplicate MLflow points), under its MLflow names.
    logged = run.logged_metric_names()
    summary = result.metrics if result.mlflow_summary is None else result.mlflow_summary
    final = {**summary, "num_rows": manifest["num_rows"], "num_bytes": manifest["num_bytes"],
             "seconds": manifest["seconds"]}
    run.log_metrics({k: v for k, v in final.items() if k not in logged})
    run.log_dict(manifest, "_MANIFEST.json")
    run.end(True)
    made = console_lines.amount(manifest["num_rows"], UNITS.get(stage.name, "rows"))
    console.say(f"  {stage.name} done: {made} in {manifest['seconds']:.1f} s")
    return manifest


def _after_failure(uri: str, run_id: str, exc: BaseException, console: Console) -> None:
    """A stage failed or was interrupted: stop its writers first (Ray tasks of this run go on writing otherwise),
    then remove its temporary files (a full disk gets its space back), then record what it left so the next run
    may delete it. Each step best effort: the stage's own error is the one to report."""
    import gc

    from bertpipe.jobs.cluster import stop_writers

    console.end_quietly()  # what the cleanup meets goes to the log file; the console ends with the CLI's three lines
    # The stage's frames, kept alive by the traceback, hold its Ray Data iterators: dropped now, while Ray is still
    # up, they shut their executors down (cancelling the dataset's tasks) instead of failing later, in __del__,
    # against a Ray that is gone. The traceback keeps its file names and lines for the log.
    traceback.clear_frames(exc.__traceback__)
    gc.collect()
    for step, args in ((stop_writers, ()), (outputs.remove_temps, (uri,)), (outputs.record_failure, (uri, run_id))):
        try:
            step(*args)
        except Exception:  # noqa: BLE001
            log.info("after the failure of %s: %s failed", uri, step.__name__, exc_info=True)


def _json(data: Any) -> str:
    import json

    return json.dumps(data, indent=2, sort_keys=True)

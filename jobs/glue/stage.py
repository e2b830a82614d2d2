"""The `glue` stage: GLUE on the fine-tuning engine — one trial per (task × learning rate × seed), in
parallel on Ray (jobs/tuning/fanout.py).

The driver reads every present task once (a bad file fails that task, with the file and line; the other tasks
still run, so that their trials are kept for the rerun) and ships the parsed rows and the initial checkpoint's
files through the object store. Per task the trial with the best dev score wins (the paper picks the learning
rate on dev); its test predictions become the GLUE submission files and its model is kept in models/<task>/.
MLflow: the stage's run is the sweep parent, one child run per task, one grandchild per trial with per-epoch
metrics (logged by the trial itself); the parent gets each task's best dev score, the GLUE score and the
summary table as artifacts.

Every requested task must succeed, every trial of it included: a sweep that drops one reports a GLUE score over
tasks nobody chose. A failed task or trial fails the stage (its error names each, one line); the finished trials
are kept for the rerun (jobs/tuning/fanout.py).
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from bertpipe.jobs.glue.config import GlueConfig
from bertpipe.jobs.glue.report import (SMOKE_LABEL, TaskOutcome, as_fractions, scores, summary_table,
                                      write_submission)
from bertpipe.jobs.glue.sample import write_sample
from bertpipe.jobs.glue.tasks import (AX, GLUE_TASKS, HF_GLUE, HF_SPLITS, TASKS, get_task, has_split, parquet_files,
                                     read_task, split_uri, task_format, task_present)
from bertpipe.jobs.services.tracking import RunLogger
from bertpipe.jobs.tuning import failures, fanout, kept
from bertpipe.jobs.tuning.inputs import check_init, init_uri, read_model_files
from bertpipe.pipeline.framework import parts, storage
from bertpipe.pipeline.framework.identity import describe_file
from bertpipe.pipeline.framework.stage import StageContext, StageInputError, StageResult

if TYPE_CHECKING:
    from bertpipe.jobs.glue.trial import GlueTask

log = logging.getLogger("bertpipe.glue")


def task_names(cfg: GlueConfig) -> tuple[str, ...]:
    for name in cfg.tasks:
        get_task(name)  # unknown task name → ValueError listing the valid ones
    return cfg.tasks or GLUE_TASKS


def describe_raw_inputs(cfg: GlueConfig) -> list[dict[str, Any]]:
    """Size + checksum of every GLUE file the stage would read (none for the built-in smoke sample)."""
    if not cfg.glue_data_dir:
        return []
    glue = cfg.glue_data_dir
    uris = [uri for name in task_names(cfg) if task_present(glue, TASKS[name])
            for fname in ("train.tsv", *(f for _, f in TASKS[name].dev_files), *(f for _, f in TASKS[name].test_files))
            for uri in split_uris(glue, TASKS[name], fname)]
    uris += [storage.join(glue, *AX[1].split("/"))] + parquet_files(glue, AX[2], "test")
    return [describe_file(uri, "GLUE file") for uri in uris if storage.is_file(uri)]


def split_uris(glue_dir: str, spec, fname: str) -> list[str]:
    """Every file of one split: its TSV, or its Parquet shards."""
    if task_format(glue_dir, spec) == "parquet":
        return parquet_files(glue_dir, HF_GLUE[spec.name][0], HF_SPLITS[fname])
    return [storage.join(glue_dir, spec.name, fname)]


def check_glue_dir(cfg: GlueConfig) -> None:
    """StageInputError naming every file a requested task lacks (train.tsv and its dev sets)."""
    if not cfg.glue_data_dir:
        return
    if not storage.exists(cfg.glue_data_dir):
        raise StageInputError(f"glue.glue_data_dir {cfg.glue_data_dir} does not exist")
    present = [n for n in task_names(cfg) if storage.exists(storage.join(cfg.glue_data_dir, n))
               or task_present(cfg.glue_data_dir, TASKS[n])]
    wanted = list(cfg.tasks) or present
    if not wanted:
        raise StageInputError(f"glue.glue_data_dir {cfg.glue_data_dir} holds none of the GLUE task folders "
                              f"({', '.join(GLUE_TASKS)}; or the Hugging Face nyu-mll/glue folders: "
                              f"{', '.join(HF_GLUE[t][0] for t in GLUE_TASKS)})")
    missing = [split_uri(cfg.glue_data_dir, TASKS[name], f) for name in wanted
               for f in ("train.tsv", *(f for _, f in TASKS[name].dev_files))
               if not has_split(cfg.glue_data_dir, TASKS[name], f)]
    if missing:
        raise StageInputError(f"GLUE data incomplete: missing {', '.join(missing)}")


def preflight(ctx: StageContext) -> None:
    """Before anything runs: an explicit init is a BERT checkpoint, and the GLUE folder has what the tasks need."""
    cfg = ctx.section(GlueConfig)
    task_names(cfg)
    check_init(ctx, "glue")
    check_glue_dir(cfg)


def plan_task(name: str, glue_dir: str, cfg: GlueConfig, ctx: StageContext, parent: RunLogger,
              raw_inputs: list[dict], model_digest: str) -> tuple[TaskOutcome, GlueTask | None, list]:
    """Read one task and plan its trials (none if absent or unreadable: the outcome says why)."""
    spec = TASKS[name]
    outcome = TaskOutcome(spec, "ok")
    if not task_present(glue_dir, spec):
        if cfg.tasks:  # named explicitly: its absence is an error
            outcome.status = "failed"
            outcome.error = (f"{storage.join(glue_dir, name)}: task folder or train.tsv missing (nor "
                             f"{storage.join(glue_dir, HF_GLUE[name][0])}/train*.parquet)")
        else:
            outcome.status = "absent"
        return outcome, None, []
    outcome.run = parent.child(name, {"bertpipe.kind": "glue_task", "bertpipe.task": name})
    try:
        data = read_task(glue_dir, spec)
    except (ValueError, StageInputError) as e:
        outcome.status, outcome.error = "failed", str(e)
        log.info("glue: task %s failed to read: %s", name, e)  # the stage's error names it at the end
        return outcome, None, []
    raw_inputs.extend(data.files if cfg.glue_data_dir else [])
    outcome.num_train = min(len(data.train), cfg.max_train_examples or len(data.train))
    log.info("glue: %s: %d train rows (%d used), dev %s, test %s", name, len(data.train), outcome.num_train,
             {k: len(v) for k, v in data.dev.items()}, {k: len(v) for k, v in data.test.items()})
    base = kept.base_key("glue", cfg, ctx.seed, model_digest, data.files, task=name)
    from bertpipe.jobs.glue.trial import GlueTask  # torch: imported when trials are planned, not for `status`

    return outcome, GlueTask(data), fanout.plan("glue", cfg, ctx, outcome.run, base, group=name)


def gather(trials: list[fanout.Trial], outcomes: list[TaskOutcome], out_uri: str) -> None:
    """Each task's trials, in plan order (kept ones included: the best trial is the same whichever run made it).
    A task with a failed trial fails; any failed task fails the stage (failures.TrialsFailed)."""
    by_name = {o.spec.name: o for o in outcomes}
    for key, cause in fanout.failed(trials).items():
        by_name[key.split("/")[0]].trial_errors.append(f"trial {key}: {cause}")
    for t in trials:
        if not isinstance(t.result, BaseException):
            by_name[t.group].trials.append(t)
    for o in outcomes:
        if o.status == "ok" and (o.trial_errors or not o.trials):
            o.status = "failed"
    failed = [o for o in outcomes if o.status == "failed"]
    if failed:
        end_task_runs(outcomes)
        raise failures.requested_failed(
            "GLUE tasks", {o.spec.name: o.errors for o in failed}, sum(o.status != "absent" for o in outcomes),
            out_uri, parts.count(out_uri), input_only=not any(o.trial_errors for o in failed))


def end_task_runs(outcomes: list[TaskOutcome]) -> None:
    """Each task's MLflow run ends: a failed one FAILED, with its error as a tag."""
    for o in outcomes:
        if o.run is not None:
            if o.errors:
                o.run.set_tag("bertpipe.error", o.errors[:5000])
            o.run.end(o.status == "ok")


def log_outcomes(outcomes: list[TaskOutcome], parent: RunLogger, metrics: dict[str, float],
                 files: dict[str, bytes], out_uri: str, smoke: bool) -> None:
    for o in outcomes:
        if o.run is None:
            continue
        if o.best:
            best = o.best.result
            # At the selected epoch's step, where the trial runs logged their own evaluation.
            o.run.log_metrics({**best.metrics, "score": best.score, "best_lr": best.learning_rate,
                               "best_epoch": best.epoch}, step=best.epoch)
            model_dir = storage.join(out_uri, "models", o.spec.name)
            if storage.exists(model_dir) and not storage.is_remote(model_dir):
                o.run.log_artifacts(model_dir, "model")
    end_task_runs(outcomes)
    if smoke:
        parent.set_tag("bertpipe.glue_data", SMOKE_LABEL)
    parent.log_metrics(as_fractions({k: v for k, v in metrics.items() if k != "seconds"}))
    for name, blob in files.items():
        parent.log_bytes(blob, name, "glue")


def write_report(out_uri: str, outcomes: list[TaskOutcome], smoke: bool) -> tuple[dict[str, bytes], list[str]]:
    """summary.md / summary.csv, the submission files and zip; (files for MLflow, submission file names)."""
    submission = write_submission(out_uri, outcomes)
    _, markdown, table_csv = summary_table(outcomes, smoke)
    report = {"summary.md": markdown.encode(), "summary.csv": table_csv.encode()}
    for name, blob in report.items():
        storage.write_bytes(storage.join(out_uri, name), blob)
    if submission:
        report["submission.zip"] = storage.read_bytes(storage.join(out_uri, "submission.zip"))
    return report, submission


def run_stage(ctx: StageContext) -> StageResult:
    started = time.perf_counter()
    cfg = ctx.section(GlueConfig)
    smoke = not cfg.glue_data_dir
    glue_dir = cfg.glue_data_dir or write_sample(storage.join(ctx.output_uri, "smoke_glue"), seed=ctx.seed)
    if smoke:
        log.info("glue: no glue_data_dir, using the project's smoke sample (NOT GLUE) at %s", glue_dir)
    init = init_uri(ctx, cfg.init)
    model_files = read_model_files(init)
    log.info("glue: initial model %s; tasks %s", init, ", ".join(task_names(cfg)))
    parent, raw_inputs = RunLogger(ctx.tracking), []
    planned = [plan_task(n, glue_dir, cfg, ctx, parent, raw_inputs, kept.files_digest(model_files))
               for n in task_names(cfg)]
    outcomes, trials = [o for o, _, _ in planned], [t for _, _, ts in planned for t in ts]
    parts.drop_all_but(ctx.output_uri, {t.part for t in trials if t.result is not None})  # other configs' trials
    num_kept = sum(t.result is not None for t in trials)
    fanout.run_all("glue", trials, {o.spec.name: task for o, task, _ in planned if task is not None},
                   model_files, cfg, ctx.output_uri, ctx.console)
    gather(trials, outcomes, ctx.output_uri)
    if not any(o.status == "ok" for o in outcomes):
        raise StageInputError(f"glue: no GLUE task present in {glue_dir}")
    report, submission = write_report(ctx.output_uri, outcomes, smoke)
    metrics = {**scores(outcomes), "num_trials": float(len(trials)), "num_trials_kept": float(num_kept),
               "num_tasks_ok": float(sum(o.status == "ok" for o in outcomes)),
               "seconds": time.perf_counter() - started}
    models = [f for o in outcomes if o.best for f in fanout.keep_best_model(ctx.output_uri, o.best, o.spec.name)]
    parts.drop_all(ctx.output_uri)  # every trial is in the outputs now: a committed folder holds no part
    log_outcomes(outcomes, parent, metrics, report, ctx.output_uri, smoke)
    return StageResult(
        num_rows=sum(len(o.trials) for o in outcomes), metrics=metrics, raw_inputs=raw_inputs,
        extra={"init": init, "glue_data_dir": glue_dir, "smoke_sample": smoke, "submission": submission,
               "tasks": {o.spec.name: {"status": o.status, "error": o.errors} for o in outcomes}},
        outputs=["summary.md", "summary.csv", *models, *(f"submission/{n}" for n in submission),
                 *(["submission.zip"] if submission else [])])


def headline_metrics(manifest_metrics: dict[str, Any]) -> dict[str, float]:
    """The best dev score of every task (glue/<task>) and the GLUE averages, as fractions (one scale in MLflow)."""
    metrics = as_fractions(manifest_metrics)
    out = {f"glue/{k[4:]}": v for k, v in metrics.items() if k.startswith("dev.")}
    names = {"glue_score": "glue/score", "bert_paper_average": "glue/bert_paper_average"}
    out.update({name: metrics[n] for n, name in names.items() if isinstance(metrics.get(n), (int, float))})
    return out

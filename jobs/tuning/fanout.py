"""The fan-out of every fine-tuning stage on Ray: one trial per (task ×) learning rate × seed, each a Ray task
with `cpus_per_trial` CPUs (and `gpus_per_trial` GPUs), at most `max_concurrent_trials` at once, each an MLflow
child run that logs its own epochs. GLUE has a group of trials per task; SQuAD and NER have one group.

Every requested trial must succeed: the best learning rate of a grid with holes is not the one asked for. A trial that
finishes is committed at once under `_trials/` (pipeline/framework/parts.py) with its fine-tuned model, so a failed or
interrupted run keeps it and the rerun with the same config runs only the rest (jobs/tuning/kept.py has the key).
Whatever a failed trial half wrote is deleted. The stage then keeps the best trial's model of each group.

While trials run, one progress line on the driver counts their optimizer steps (each trial reports through a
`pipeline.framework.progress.Reporter`), with the running trial, its epoch and loss, and the best score so far.
"""
from __future__ import annotations

import hashlib
import logging
import tempfile
from dataclasses import dataclass
from typing import Any

from bertpipe.jobs.services.tracking import RunLogger
from bertpipe.jobs.tuning import failures, kept
from bertpipe.jobs.tuning.inputs import write_model_files
from bertpipe.jobs.tuning.trial_types import TrialResult, TrialTask
from bertpipe.jobs.tuning.progress import TrialsProgress
from bertpipe.pipeline.framework import parts, storage
from bertpipe.pipeline.framework.console import Console
from bertpipe.pipeline.framework.stage import StageContext

log = logging.getLogger("bertpipe.tuning")
TRIAL_KIND = {"glue": "glue_trial", "squad": "squad_trial", "ner": "ner_trial"}  # the runs' bertpipe.kind tag


@dataclass
class Trial:
    group: str  # the task a trial belongs to (GLUE: "RTE"); "" in a one-task stage
    learning_rate: float
    sweep_seed: int  # the seed value of the sweep
    seed: int  # the trial's RNG seed: the sweep seed mixed with the workflow seed, the stage and the task
    run: RunLogger  # its MLflow run (inactive for a kept trial: it does not run again)
    part: str  # its folder for pipeline/framework/parts.py, relative to the stage's
    cache_key: str  # the key its kept result is valid for (jobs/tuning/kept.py)
    save_uri: str  # where it writes its fine-tuned model (inside its part)
    result: TrialResult | BaseException | None = None  # kept from a failed run, or what this run got

    @property
    def key(self) -> str:
        return "/".join(k for k in (self.group, f"lr={self.learning_rate:g}", f"seed={self.sweep_seed}") if k)


def trial_seed(workflow_seed: int, stage: str, sweep_seed: int, group: str = "") -> int:
    """The trial's RNG seed from the workflow seed, the stage, the task (if the stage has several) and the
    sweep's seed value."""
    path = f"{workflow_seed}/{stage}/{group}/{sweep_seed}" if group else f"{workflow_seed}/{stage}/{sweep_seed}"
    return int(hashlib.sha256(path.encode()).hexdigest()[:8], 16)


def plan(stage: str, recipe, ctx: StageContext, parent: RunLogger, base: dict, group: str = "") -> list[Trial]:
    """The trials of one group, each with the result a failed run kept under the same key (it will not run again)
    or a fresh child run of `parent`. A part of another config, or a half-written one, is deleted: this run
    rewrites it."""
    trials = []
    for sweep_seed in recipe.seeds:
        for lr in recipe.learning_rates:
            seed = trial_seed(ctx.seed, stage, sweep_seed, group)
            key = "/".join(k for k in (group, f"lr={lr:g}", f"seed={sweep_seed}") if k)
            part, cache_key = parts.part_path(*key.split("/")), kept.trial_key(base, lr, sweep_seed)
            done = kept.restore(ctx.output_uri, part, cache_key, TrialResult)
            if done is None:
                parts.drop(ctx.output_uri, part)
                run = parent.child(f"{group or stage}-lr{lr:g}-seed{sweep_seed}", {"bertpipe.kind": TRIAL_KIND[stage]})
                run.log_params({"learning_rate": lr, "seed": seed, "sweep_seed": sweep_seed, "device": recipe.device,
                                "recipe": recipe, **({"task": group} if group else {})})
            else:
                run = RunLogger(None)
            trials.append(Trial(group, lr, sweep_seed, seed, run, part, cache_key,
                                storage.join(ctx.output_uri, *part.split("/"), "model"), done))
    if any(t.result is not None for t in trials):
        parent.set_tag("bertpipe.kept_trials", ", ".join(t.key for t in trials if t.result is not None))
        log.info("%s: %d of %d trials kept from a failed run", group or stage,
                 sum(t.result is not None for t in trials), len(trials))
    return trials


TRIAL_RETRIES = 2  # times a trial whose node or worker process died runs again, elsewhere


def _trial_body(model_files: dict[str, bytes], task: TrialTask, lr: float, seed: int, recipe,
                coordinates: dict[str, str], save_uri: str, reporter) -> TrialResult:
    """What one Ray task runs: the model files as a local folder, the trial, its epochs logged to its run, its
    fine-tuned model uploaded into its part."""
    run = RunLogger(coordinates)
    with tempfile.TemporaryDirectory(prefix="bertpipe-trial-") as tmp:
        model_dir = write_model_files(model_files, tmp)
        saved = f"{tmp}/fine-tuned"
        from bertpipe.jobs.tuning.loop import run_trial  # torch: in the trial's own process

        result = run_trial(model_dir, task, lr, seed, recipe, lambda epoch, row: run.log_metrics(row, step=epoch),
                           reporter.set, saved)
        storage.upload_dir(saved, save_uri)
        return result


def run_all(stage: str, trials: list[Trial], tasks: dict[str, TrialTask], model_files: dict[str, bytes], recipe,
            stage_uri: str, console: Console) -> None:
    """Run every trial without a result, at most max_concurrent_trials at once. Each one that ends is committed
    as a part (or what it half wrote deleted) and its MLflow run ended, so a sweep stopped half way keeps what
    finished; its result or exception lands in `trial.result`."""
    import ray

    todo = [t for t in trials if t.result is None]
    log.info("%s: %d trials to run, %d kept from a failed run, %s CPU(s) each, at most %s at once", stage,
             len(todo), len(trials) - len(todo), recipe.cpus_per_trial, recipe.max_concurrent_trials or "all")
    if not todo:
        return
    # max_retries counts system failures only (the trial's worker process or its node died: a node lost to the
    # cluster, an autoscaler's scale-down); an exception in the trial is its own failure and is not retried.
    remote = ray.remote(_trial_body).options(num_cpus=recipe.cpus_per_trial, num_gpus=recipe.gpus_per_trial,
                                             max_retries=TRIAL_RETRIES, retry_exceptions=False)
    model_ref, task_refs = ray.put(model_files), {g: ray.put(tasks[g]) for g in {t.group for t in todo}}
    limit = recipe.max_concurrent_trials or len(todo)
    running: dict[Any, Trial] = {}
    with TrialsProgress(console, stage, todo) as progress:
        while todo or running:
            while todo and len(running) < limit:
                t = todo.pop(0)
                ref = remote.remote(model_ref, task_refs[t.group], t.learning_rate, t.seed, recipe,
                                    t.run.coordinates if t.run.active else {}, t.save_uri, progress.reporter(t))
                running[ref] = t
            ready, _ = ray.wait(list(running), num_returns=1, timeout=progress.poll_s)
            progress.poll()
            for ref in ready:
                trial = running.pop(ref)
                _finish(stage, trial, _outcome(ref), stage_uri)
                progress.done(trial)


def _outcome(ref) -> TrialResult | BaseException:
    import ray

    try:
        return ray.get(ref)
    except Exception as e:  # noqa: BLE001 - one trial failing must not stop the sweep
        return e


def _finish(stage: str, trial: Trial, result: TrialResult | BaseException, stage_uri: str) -> None:
    trial.result = result
    if isinstance(result, BaseException):
        # The log file gets the remote traceback; the console gets the stage's one-line error at the end.
        log.info("%s: trial %s failed: %s", stage, trial.key, result)
        trial.run.set_tag("bertpipe.error", failures.cause_line(result))
        parts.drop(stage_uri, trial.part)
    else:
        log.info("%s: trial %s done: score %.4f (epoch %d)", stage, trial.key, result.score, result.epoch)
        kept.save(stage_uri, trial.part, trial.cache_key, result)
    trial.run.end(not isinstance(result, BaseException))


def failed(trials: list[Trial]) -> dict[str, str]:
    """Each failed trial's key -> its cause in one line."""
    return {t.key: failures.cause_line(t.result) for t in trials if isinstance(t.result, BaseException)}


def best_of(trials: list[Trial]) -> Trial | None:
    """The finished trial with the highest score (the first on ties), or None."""
    ok = [t for t in trials if isinstance(t.result, TrialResult)]
    return max(ok, key=lambda t: t.result.score) if ok else None


def keep_best_model(stage_uri: str, trial: Trial, name: str) -> list[str]:
    """Copy the trial's fine-tuned model to models/<name>/; the kept files, relative to the stage folder."""
    target = storage.join(stage_uri, "models", name)
    storage.copy_tree(trial.save_uri, target)
    return [f"models/{name}/{rel}" for rel, _ in storage.list_files(target)]


def log_best(stage: str, parent: RunLogger, trials: list[Trial], best: Trial, table: str, started: float) -> dict:
    """The stage run's figures of a one-task sweep (the best trial's metrics, learning rate and epoch) and its
    grid table, logged to `parent`; returns the figures."""
    import time

    metrics = {f"best.{k}": v for k, v in best.result.metrics.items()}
    metrics.update({"best_lr": best.learning_rate, "best_epoch": float(best.result.epoch),
                    "num_trials": float(len(trials)), "seconds": time.perf_counter() - started})
    parent.log_metrics(metrics)
    parent.log_bytes(table.encode(), "summary.md", stage)
    return metrics


def grid_table(trials: list[Trial], metric_names: tuple[str, ...]) -> str:
    """Markdown: one row per trial (learning rate, seed, selected epoch, metrics in %, train seconds)."""
    lines = ["| learning rate | seed | epoch | " + " | ".join(metric_names) + " | train s |",
             "|" + "---|" * (len(metric_names) + 4)]
    for t in trials:
        r = t.result
        if isinstance(r, TrialResult):
            cells = " | ".join(f"{100 * r.metrics[m]:.2f}" for m in metric_names)
            lines.append(f"| {t.learning_rate:g} | {t.sweep_seed} | {r.epoch} | {cells} | {r.train_seconds:.1f} |")
        else:
            lines.append(f"| {t.learning_rate:g} | {t.sweep_seed} | | failed: {failures.cause_line(r)} |")
    return "\n".join(lines) + "\n"


def sweep(stage: str, task: TrialTask, ctx: StageContext, recipe, model_files: dict[str, bytes],
          data_files: list[dict], parent: RunLogger) -> list[Trial]:
    """A one-task stage's grid (SQuAD, NER): kept trials reused, the rest run. The trials, all finished;
    failures.TrialsFailed naming each failed trial otherwise (the finished ones stay kept for the rerun)."""
    base = kept.base_key(stage, recipe, ctx.seed, kept.files_digest(model_files), data_files)
    trials = plan(stage, recipe, ctx, parent, base)
    parts.drop_all_but(ctx.output_uri, {t.part for t in trials if t.result is not None})
    run_all(stage, trials, {"": task}, model_files, recipe, ctx.output_uri, ctx.console)
    bad = failed(trials)
    if bad:
        raise failures.requested_failed(f"{stage} trials", bad, len(trials), ctx.output_uri,
                                        parts.count(ctx.output_uri), input_only=False)
    return trials

"""The `finetune` stage: GLUE fan-out on Ray — one trial per (task × learning rate × seed), in parallel.

The driver reads every present task once (a bad file fails that task, with the file and line; the other tasks
still run, so that their trials are kept for the rerun), ships the parsed rows and the initial checkpoint's files
through the object store, and runs `trial.run_trial` as Ray tasks with `cpus_per_trial` CPUs each, at most
`max_concurrent_trials` at a time. Per task the trial with the best final-epoch dev score wins (the paper picks
the learning rate on dev); its test predictions become the GLUE submission files. MLflow: the stage's run is the
sweep parent, one child run per task, one grandchild per trial with per-epoch metrics (logged by the trial
itself); the parent gets each task's best dev score, the GLUE score and the summary table as artifacts.

Every requested task must succeed, every trial of it included: a sweep that drops one reports a GLUE score over
tasks nobody chose. A failed task or trial fails the stage (its error names each, one line), and the trials that
finished are kept, committed one by one under `_trials/` (pipeline/parts.py), so the rerun with the same config
runs only the failed ones and then commits the stage. Trials run into their part folder and the best model of
each task is copied to models/<task>/ once every task is done.
"""
from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable

from bertpipe.jobs.downstream import failures, kept
from bertpipe.jobs.finetune.config import FinetuneConfig
from bertpipe.jobs.finetune.glue_sample import write_sample
from bertpipe.jobs.finetune.glue_tasks import GLUE_TASKS, TASKS, get_task, read_task, task_present
from bertpipe.jobs.finetune.report import TaskOutcome, scores, summary_table, write_submission
from bertpipe.jobs.finetune.trial import TrialParams, TrialResult, run_trial
from bertpipe.jobs.tracking import RunLogger
from bertpipe.pipeline import parts, storage
from bertpipe.pipeline.identity import describe_file
from bertpipe.pipeline.progress import Progress
from bertpipe.pipeline.stage import StageContext, StageInputError, StageResult

log = logging.getLogger("bertpipe.finetune")

MODEL_FILES = ("config.json", "vocab.txt")
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def task_names(cfg: FinetuneConfig) -> tuple[str, ...]:
    for name in cfg.tasks:
        get_task(name)  # unknown task name → ValueError listing the valid ones
    return cfg.tasks or GLUE_TASKS


def describe_raw_inputs(cfg: FinetuneConfig) -> list[dict[str, Any]]:
    """Size + checksum of every GLUE file the stage would read (none for the built-in smoke sample)."""
    if not cfg.glue_data_dir:
        return []
    uris = [storage.join(cfg.glue_data_dir, name, fname) for name in task_names(cfg)
            for fname in ("train.tsv", *(f for _, f in TASKS[name].dev_files), *(f for _, f in TASKS[name].test_files))]
    return [describe_file(uri, "GLUE file") for uri in uris if storage.is_file(uri)]


def read_model_files(uri: str) -> dict[str, bytes]:
    """config.json, vocab.txt and the weights of a HF-layout folder, as bytes (shipped to trials by Ray)."""
    files = {}
    for name in MODEL_FILES:
        try:
            files[name] = storage.read_bytes(storage.join(uri, name))
        except Exception as e:  # noqa: BLE001 - not-found types differ per store
            raise StageInputError(f"{storage.join(uri, name)}: cannot read the initial model ({type(e).__name__}: {e})")
    for name in WEIGHT_FILES:
        if storage.is_file(storage.join(uri, name)):
            files[name] = storage.read_bytes(storage.join(uri, name))
            return files
    raise StageInputError(f"{uri}: no {' or '.join(WEIGHT_FILES)} in the initial model folder")


BERT_CONFIG_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


def check_checkpoint(uri: str) -> None:
    """StageInputError unless `uri` is a Hugging Face-layout BERT folder: config.json of a BERT, vocab.txt, weights."""
    import json

    if not storage.is_file(storage.join(uri, "config.json")):
        what = "does not exist" if not storage.exists(uri) else "has no config.json"
        raise StageInputError(f"finetune.init {uri} {what}: expected a BERT checkpoint folder "
                              "(config.json, vocab.txt, model.safetensors or pytorch_model.bin)")
    try:
        config = json.loads(storage.read_bytes(storage.join(uri, "config.json")))
    except ValueError as exc:
        raise StageInputError(f"finetune.init {uri}/config.json is not JSON: {exc}") from None
    lacking = [k for k in BERT_CONFIG_KEYS if k not in config]
    if lacking or config.get("model_type", "bert") != "bert":
        raise StageInputError(f"finetune.init {uri} is not a BERT checkpoint (model_type "
                              f"{config.get('model_type')!r}, config.json lacks {lacking})")
    if not storage.is_file(storage.join(uri, "vocab.txt")):
        raise StageInputError(f"finetune.init {uri} has no vocab.txt")
    if not any(storage.is_file(storage.join(uri, w)) for w in WEIGHT_FILES):
        raise StageInputError(f"finetune.init {uri} has no weights ({' or '.join(WEIGHT_FILES)})")


def check_glue_dir(cfg: FinetuneConfig) -> None:
    """StageInputError naming every file a requested task lacks (train.tsv and its dev sets)."""
    if not cfg.glue_data_dir:
        return
    if not storage.exists(cfg.glue_data_dir):
        raise StageInputError(f"finetune.glue_data_dir {cfg.glue_data_dir} does not exist")
    present = [n for n in task_names(cfg) if storage.exists(storage.join(cfg.glue_data_dir, n))]
    wanted = list(cfg.tasks) or present
    if not wanted:
        raise StageInputError(f"finetune.glue_data_dir {cfg.glue_data_dir} holds none of the GLUE task folders "
                              f"({', '.join(GLUE_TASKS)})")
    missing = [storage.join(cfg.glue_data_dir, name, f) for name in wanted
               for f in ("train.tsv", *(f for _, f in TASKS[name].dev_files))
               if not storage.is_file(storage.join(cfg.glue_data_dir, name, f))]
    if missing:
        raise StageInputError(f"GLUE data incomplete: missing {', '.join(missing)}")


def preflight(ctx: StageContext) -> None:
    """Before anything runs: an explicit init is a BERT checkpoint, and the GLUE folder has what the tasks need."""
    cfg: FinetuneConfig = ctx.config["finetune"]
    task_names(cfg)
    if ctx.input("pretrain").explicit:
        check_checkpoint(ctx.input("pretrain").uri)
    check_glue_dir(cfg)


def trial_seed(workflow_seed: int, task: str, seed: int) -> int:
    """The trial's RNG seed from the workflow seed, the task and the sweep's seed value."""
    digest = hashlib.sha256(f"{workflow_seed}/finetune/{task}/{seed}".encode()).hexdigest()
    return int(digest[:8], 16)


def _trial_body(model_files: dict[str, bytes], data, params: TrialParams, coordinates: dict[str, str],
                save_uri: str = "") -> TrialResult:
    """What one Ray task runs: materialise the checkpoint locally, fine-tune, log epochs to the trial's run, and
    (with `save_uri`) keep the fine-tuned model there."""
    run = RunLogger(coordinates)
    with tempfile.TemporaryDirectory(prefix="bertpipe-ft-") as tmp:
        for name, blob in model_files.items():
            with open(os.path.join(tmp, name), "wb") as f:
                f.write(blob)
        saved = os.path.join(tmp, "fine-tuned") if save_uri else None
        result = run_trial(tmp, data, params, lambda epoch, row: run.log_metrics(row, step=epoch), saved)
        if saved:
            storage.upload_dir(saved, save_uri)
        return result


@dataclass
class Trial:
    key: str
    outcome: TaskOutcome
    run: RunLogger
    params: TrialParams
    save_uri: str  # where the trial keeps its fine-tuned model ("" = not kept)
    model_ref: Any  # Ray object refs of the initial model's files and of the task's data
    data_ref: Any
    part: str = ""  # its folder for pipeline/parts.py, relative to the stage's ("" = not kept)
    cache_key: str = ""  # the key its kept result is valid for (jobs/downstream/kept.py)
    result: TrialResult | BaseException | None = None  # kept from a failed run, or what this run got

    def args(self) -> tuple:
        """The arguments of `_trial_body`."""
        return (self.model_ref, self.data_ref, self.params, self.run.coordinates if self.run.active else {},
                self.save_uri)


def run_trials(trials: list[Trial], cfg: FinetuneConfig,
               on_done: Callable[[Trial, Any], None] | None = None) -> list[TrialResult | BaseException]:
    """Run the trials as Ray tasks, at most max_concurrent_trials at once; each trial's result or exception, in
    order. `on_done(trial, result or exception)` as each one ends (a sweep stopped half way keeps what finished)."""
    import ray

    remote = ray.remote(_trial_body).options(num_cpus=cfg.cpus_per_trial, num_gpus=cfg.gpus_per_trial,
                                             max_retries=0)
    limit = cfg.max_concurrent_trials or len(trials)
    results: list[Any] = [None] * len(trials)
    running: dict[Any, int] = {}
    next_trial, best = 0, {}
    progress = Progress("finetune", len(trials), "trials", lambda f: "best " + " ".join(
        f"{task} {100 * score:.1f}" for task, score in f.items()) if f else "")
    while next_trial < len(trials) or running:
        while next_trial < len(trials) and len(running) < limit:
            running[remote.remote(*trials[next_trial].args())] = next_trial
            next_trial += 1
        ready, _ = ray.wait(list(running), num_returns=1)
        i = running.pop(ready[0])
        try:
            results[i] = ray.get(ready[0])
            task = trials[i].outcome.spec.name
            best[task] = max(best.get(task, float("-inf")), results[i].score)
            log.info("finetune: trial %s done: score %.4f", trials[i].key, results[i].score)
        except Exception as e:  # noqa: BLE001 - one trial failing must not stop the sweep
            results[i] = e
            # The log file gets the remote traceback; the console gets the stage's one-line error at the end.
            log.info("finetune: trial %s failed: %s", trials[i].key, e)
        if on_done is not None:
            on_done(trials[i], results[i])
        progress.add(1, **best)
    progress.close()
    return results


def plan_task(name: str, glue_dir: str, cfg: FinetuneConfig, ctx: StageContext, model_ref, parent: RunLogger,
              raw_inputs: list[dict], model_digest: str = "") -> tuple[TaskOutcome, list[Trial]]:
    """Read one task and make its trials (none if absent or unreadable: the outcome says why)."""
    spec = TASKS[name]
    outcome = TaskOutcome(spec, "ok")
    if not task_present(glue_dir, spec):
        if cfg.tasks:  # named explicitly: its absence is an error
            outcome.status = "failed"
            outcome.error = f"{storage.join(glue_dir, name)}: task folder or train.tsv missing"
        else:
            outcome.status = "absent"
        return outcome, []
    task_run = outcome.run = parent.child(name, {"bertpipe.kind": "glue_task", "bertpipe.task": name})
    try:
        data = read_task(glue_dir, spec)
    except (ValueError, StageInputError) as e:
        outcome.status, outcome.error = "failed", str(e)
        log.info("finetune: task %s failed to read: %s", name, e)  # the stage's error names it at the end
        return outcome, []
    raw_inputs.extend(data.files if cfg.glue_data_dir else [])
    outcome.num_train = min(len(data.train), cfg.max_train_examples or len(data.train))
    log.info("finetune: %s: %d train rows (%d used), dev %s, test %s", name, len(data.train), outcome.num_train,
             {k: len(v) for k, v in data.dev.items()}, {k: len(v) for k, v in data.test.items()})
    return outcome, make_trials(outcome, data, cfg, ctx, model_ref, model_digest)


def make_trials(outcome: TaskOutcome, data, cfg: FinetuneConfig, ctx: StageContext, model_ref,
                model_digest: str) -> list[Trial]:
    """One trial per (learning rate, seed) of a task that read. A trial a failed run kept under the same key comes
    with its result and no MLflow run: it will not run again."""
    import ray

    name, task_run = outcome.spec.name, outcome.run
    base = kept.base_key("finetune", cfg, ctx.seed, model_digest, data.files, task=name)
    trials = []
    for seed in cfg.seeds:
        for lr in cfg.learning_rates:
            params = TrialParams(learning_rate=lr, seed=trial_seed(ctx.seed, name, seed), recipe=cfg)
            key = f"{name}/lr={lr:g}/seed={seed}"
            part, cache_key = parts.part_path(*key.split("/")), kept.trial_key(base, lr, seed)
            done = kept.restore(ctx.output_uri, part, cache_key, TrialResult)
            if done is None:
                parts.drop(ctx.output_uri, part)  # a part of another config, or half-written: this run rewrites it
                run = task_run.child(f"{name}-lr{lr:g}-seed{seed}", {"bertpipe.kind": "glue_trial"})
                run.log_params({"learning_rate": lr, "seed": params.seed, "task": name, "sweep_seed": seed,
                                "device": params.device, "recipe": cfg})
            else:
                run = RunLogger(None)
            trials.append(Trial(key, outcome, run, params, storage.join(ctx.output_uri, *part.split("/"), "model"),
                                model_ref, None, part, cache_key, done))
    todo = [t for t in trials if t.result is None]
    if todo:
        data_ref = ray.put(data)
        for t in todo:
            t.data_ref = data_ref
    if len(todo) < len(trials):
        task_run.set_tag("bertpipe.kept_trials", ", ".join(t.key for t in trials if t.result is not None))
        log.info("finetune: %s: %d of %d trials kept from a failed run", name, len(trials) - len(todo), len(trials))
    return trials


def run_and_keep(todo: list[Trial], cfg: FinetuneConfig, out_uri: str) -> None:
    """Run the trials; commit each one as it finishes as a part (a rerun, even after Ctrl-C, will not redo it),
    delete whatever a failed one wrote (half done: nothing of it stays)."""

    def done(trial: Trial, result: Any) -> None:
        trial.result = result
        if isinstance(result, BaseException):
            trial.run.set_tag("bertpipe.error", failures.cause_line(result))
            parts.drop(out_uri, trial.part)
        else:
            kept.save(out_uri, trial.part, trial.cache_key, result)
        trial.run.end(not isinstance(result, BaseException))

    if todo:
        run_trials(todo, cfg, done)


def gather(trials: list[Trial], outcomes: list[TaskOutcome], out_uri: str) -> None:
    """Each task's trial results, in plan order (kept ones included: the best trial is the same whichever run made
    it). A task with a failed trial fails; any failed task fails the stage (failures.TrialsFailed)."""
    for trial in trials:
        if isinstance(trial.result, BaseException):
            trial.outcome.trial_errors.append(f"trial {trial.key}: {failures.cause_line(trial.result)}")
        else:
            trial.outcome.trials.append(trial.result)
    for o in outcomes:
        if o.status == "ok" and (o.trial_errors or not o.trials):
            o.status = "failed"
    failed = [o for o in outcomes if o.status == "failed"]
    if failed:
        end_task_runs(outcomes)
        raise failures.requested_failed(
            "GLUE tasks", {o.spec.name: o.errors for o in failed}, sum(o.status != "absent" for o in outcomes),
            out_uri, parts.count(out_uri), input_only=not any(o.trial_errors for o in failed))


def keep_best_models(out_uri: str, trials: list[Trial]) -> list[str]:
    """The best trial's fine-tuned model of each task is copied to models/<task>/; every trial's part is deleted.
    Returns the kept files, relative to the stage folder."""
    files = []
    for trial in trials:
        best = trial.outcome.best
        if best is not None and (trial.params.learning_rate, trial.params.seed) == (best.learning_rate, best.seed):
            target = storage.join(out_uri, "models", trial.outcome.spec.name)
            storage.copy_tree(trial.save_uri, target)
            files += [f"models/{trial.outcome.spec.name}/{rel}" for rel, _ in storage.list_files(target)]
    parts.drop_all(out_uri)
    return files


def end_task_runs(outcomes: list[TaskOutcome]) -> None:
    """Each task's MLflow run ends: a failed one FAILED, with its error as a tag."""
    for o in outcomes:
        if o.run is not None:
            if o.errors:
                o.run.set_tag("bertpipe.error", o.errors[:5000])
            o.run.end(o.status == "ok")


def log_outcomes(outcomes: list[TaskOutcome], parent: RunLogger, metrics: dict[str, float], files: dict[str, bytes],
                 out_uri: str):
    for o in outcomes:
        task_run = o.run
        if task_run is None:
            continue
        if o.best:
            best = {f"{s}.{m}": v for s, ms in o.best.dev_metrics.items() for m, v in ms.items()}
            # At the last epoch's step, where the trial runs logged their own final evaluation.
            task_run.log_metrics({**best, "score": o.best.score, "best_lr": o.best.learning_rate},
                                 step=len(o.best.history))
            model_dir = storage.join(out_uri, "models", o.spec.name)
            if storage.exists(model_dir) and "://" not in model_dir:
                task_run.log_artifacts(model_dir, "model")
    end_task_runs(outcomes)
    parent.log_metrics({k: v for k, v in metrics.items() if k != "seconds"})
    for name, blob in files.items():
        parent.log_bytes(blob, name, "glue")


def run_stage(ctx: StageContext) -> StageResult:
    import ray

    started = time.perf_counter()
    cfg: FinetuneConfig = ctx.config["finetune"]
    glue_dir = cfg.glue_data_dir or write_sample(storage.join(ctx.output_uri, "smoke_glue"), seed=ctx.seed)
    if not cfg.glue_data_dir:
        log.info("finetune: no glue_data_dir, using the project's smoke sample (NOT GLUE) at %s", glue_dir)
    pretrain = ctx.input("pretrain")
    init = pretrain.uri if pretrain.explicit else (cfg.init or ctx.paths.pretrain_export)
    model_files = read_model_files(init)
    model_ref, digest = ray.put(model_files), kept.files_digest(model_files)
    del model_files
    log.info("finetune: initial model %s; tasks %s", init, ", ".join(task_names(cfg)))
    parent, raw_inputs = RunLogger(ctx.tracking), []
    planned = [plan_task(n, glue_dir, cfg, ctx, model_ref, parent, raw_inputs, digest) for n in task_names(cfg)]
    outcomes, trials = [o for o, _ in planned], [t for _, ts in planned for t in ts]
    parts.drop_all_but(ctx.output_uri, {t.part for t in trials if t.result is not None})  # other configs' trials
    todo = [t for t in trials if t.result is None]
    log.info("finetune: %d trials over %d tasks (%d kept from a failed run), %s CPU(s) each, at most %s at once",
             len(todo), sum(o.status == "ok" for o in outcomes), len(trials) - len(todo), cfg.cpus_per_trial,
             cfg.max_concurrent_trials or "all")
    run_and_keep(todo, cfg, ctx.output_uri)
    gather(trials, outcomes, ctx.output_uri)
    if not any(o.status == "ok" for o in outcomes):
        raise StageInputError(f"finetune: no GLUE task present in {glue_dir}")
    submission = write_submission(ctx.output_uri, outcomes)
    _, markdown, table_csv = summary_table(outcomes)
    report = {"summary.md": markdown.encode(), "summary.csv": table_csv.encode()}
    for name, blob in report.items():
        storage.write_bytes(storage.join(ctx.output_uri, name), blob)
    metrics = {**scores(outcomes), "num_trials": float(len(trials)), "num_trials_kept": float(len(trials) - len(todo)),
               "num_trials_failed": float(sum(len(o.trial_errors) for o in outcomes)),
               "num_tasks_ok": float(sum(o.status == "ok" for o in outcomes)),
               "num_tasks_failed": float(sum(o.status == "failed" for o in outcomes)),
               "seconds": time.perf_counter() - started}
    if submission:
        report["submission.zip"] = storage.read_bytes(storage.join(ctx.output_uri, "submission.zip"))
    models = keep_best_models(ctx.output_uri, trials)
    log_outcomes(outcomes, parent, metrics, report, ctx.output_uri)
    return StageResult(
        num_rows=sum(len(o.trials) for o in outcomes), metrics=metrics, raw_inputs=raw_inputs,
        extra={"init": init, "glue_data_dir": glue_dir, "submission": submission,
               "tasks": {o.spec.name: {"status": o.status, "error": o.errors} for o in outcomes}},
        outputs=["summary.md", "summary.csv", *models, *(f"submission/{n}" for n in submission),
                 *(["submission.zip"] if submission else [])])

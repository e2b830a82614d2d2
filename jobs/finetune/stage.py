"""The `finetune` stage: GLUE fan-out on Ray — one trial per (task × learning rate × seed), in parallel.

The driver reads every present task once (a bad file fails that task alone, with the file and line), ships the
parsed rows and the initial checkpoint's files through the object store, and runs `finetune_trial.run_trial` as
Ray tasks with `cpus_per_trial` CPUs each, at most `max_concurrent_trials` at a time. Per task the trial with
the best final-epoch dev score wins (the paper picks the learning rate on dev); its test predictions become the
GLUE submission files. MLflow (explicit MlflowClient, so workers can log too): the stage's run is the sweep
parent, one child run per task, one grandchild per trial with per-epoch metrics; the parent gets each task's
best dev score, the GLUE score and the summary table as artifacts. The stage fails only if every task failed.
"""
from __future__ import annotations

import csv
import dataclasses
import hashlib
import io
import logging
import math
import os
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from typing import Any

from bertpipe.jobs.finetune.config import FinetuneConfig
from bertpipe.jobs.finetune.trial import TrialParams, TrialResult, run_trial
from bertpipe.jobs.finetune.glue_metrics import GLUE_TASKS, bert_paper_average, glue_score
from bertpipe.jobs.finetune.glue_sample import write_sample
from bertpipe.jobs.finetune.glue_tasks import TASKS, TaskSpec, file_exists, get_task, read_task, task_present
from bertpipe.pipeline.stage import StageContext, StageInputError, StageResult

log = logging.getLogger("bertpipe.finetune")

MODEL_FILES = ("config.json", "vocab.txt")
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def _join(uri: str, *parts: str) -> str:
    return "/".join([uri.rstrip("/"), *parts])


def _read(uri: str) -> bytes:
    import smart_open

    with smart_open.open(uri, "rb") as f:
        return f.read()


def _write(uri: str, data: bytes) -> None:
    import smart_open

    if "://" not in uri:
        os.makedirs(os.path.dirname(os.path.abspath(uri)), exist_ok=True)
    with smart_open.open(uri, "wb") as f:
        f.write(data)


def task_names(cfg: FinetuneConfig) -> tuple[str, ...]:
    for name in cfg.tasks:
        get_task(name)  # unknown task name → ValueError listing the valid ones
    return cfg.tasks or GLUE_TASKS


def describe_raw_inputs(cfg: FinetuneConfig) -> list[dict[str, Any]]:
    """Size + sha256 of every GLUE file the stage would read (none for the built-in smoke sample)."""
    if not cfg.glue_data_dir:
        return []
    out = []
    for name in task_names(cfg):
        spec = TASKS[name]
        for fname in ("train.tsv", *(f for _, f in spec.dev_files), *(f for _, f in spec.test_files)):
            uri = _join(cfg.glue_data_dir, name, fname)
            if file_exists(uri):
                data = _read(uri)
                out.append({"uri": uri, "size": len(data), "checksum": "sha256:" + hashlib.sha256(data).hexdigest()})
    return out


def read_model_files(uri: str) -> dict[str, bytes]:
    """config.json, vocab.txt and the weights of a HF-layout folder (any smart_open URI), as bytes."""
    files = {}
    for name in MODEL_FILES:
        try:
            files[name] = _read(_join(uri, name))
        except Exception as e:  # noqa: BLE001 - not-found types differ per store
            raise StageInputError(f"{_join(uri, name)}: cannot read the initial model ({type(e).__name__}: {e})")
    for name in WEIGHT_FILES:
        if file_exists(_join(uri, name)):
            files[name] = _read(_join(uri, name))
            return files
    raise StageInputError(f"{uri}: no {' or '.join(WEIGHT_FILES)} in the initial model folder")


BERT_CONFIG_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


def check_checkpoint(uri: str) -> None:
    """StageInputError unless `uri` is a Hugging Face-layout BERT folder: config.json of a BERT, vocab.txt, weights."""
    import json

    if not file_exists(_join(uri, "config.json")):
        what = "does not exist" if not _folder_exists(uri) else "has no config.json"
        raise StageInputError(f"finetune.init {uri} {what}: expected a BERT checkpoint folder "
                              "(config.json, vocab.txt, model.safetensors or pytorch_model.bin)")
    try:
        config = json.loads(_read(_join(uri, "config.json")))
    except ValueError as exc:
        raise StageInputError(f"finetune.init {uri}/config.json is not JSON: {exc}") from None
    lacking = [k for k in BERT_CONFIG_KEYS if k not in config]
    if lacking or config.get("model_type", "bert") != "bert":
        raise StageInputError(f"finetune.init {uri} is not a BERT checkpoint (model_type "
                              f"{config.get('model_type')!r}, config.json lacks {lacking})")
    if not file_exists(_join(uri, "vocab.txt")):
        raise StageInputError(f"finetune.init {uri} has no vocab.txt")
    if not any(file_exists(_join(uri, w)) for w in WEIGHT_FILES):
        raise StageInputError(f"finetune.init {uri} has no weights ({' or '.join(WEIGHT_FILES)})")


def _folder_exists(uri: str) -> bool:
    from bertpipe.pipeline import storage

    return storage.exists(uri)


def check_glue_dir(cfg: FinetuneConfig) -> None:
    """StageInputError naming every file a requested task lacks (train.tsv and its dev sets)."""
    if not cfg.glue_data_dir:
        return
    if not _folder_exists(cfg.glue_data_dir):
        raise StageInputError(f"finetune.glue_data_dir {cfg.glue_data_dir} does not exist")
    present = [n for n in task_names(cfg) if _folder_exists(_join(cfg.glue_data_dir, n))]
    wanted = list(cfg.tasks) or present
    if not wanted:
        raise StageInputError(f"finetune.glue_data_dir {cfg.glue_data_dir} holds none of the GLUE task folders "
                              f"({', '.join(GLUE_TASKS)})")
    missing = [_join(cfg.glue_data_dir, name, f) for name in wanted
               for f in ("train.tsv", *(f for _, f in TASKS[name].dev_files))
               if not file_exists(_join(cfg.glue_data_dir, name, f))]
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


def trial_params(cfg: FinetuneConfig, *, learning_rate: float, seed: int) -> TrialParams:
    """One trial's hyperparameters: the sweep config's shared fields plus this trial's lr and seed."""
    shared = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(TrialParams) if hasattr(cfg, f.name)}
    return TrialParams(**shared, learning_rate=learning_rate, seed=seed, num_threads=cfg.cpus_per_trial,
                       device="cuda" if cfg.gpus_per_trial > 0 else "cpu")


def _mlflow_client(tracking: dict[str, str]):
    if not tracking or not tracking.get("tracking_uri"):
        return None
    import mlflow

    return mlflow.MlflowClient(tracking["tracking_uri"])


def _log_metrics(client, run_id: str, metrics: dict[str, float], step: int = 0) -> None:
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    items = [Metric(k, float(v), now, step) for k, v in metrics.items() if math.isfinite(float(v))]
    if items:
        client.log_batch(run_id, metrics=items)


def _trial_body(model_files: dict[str, bytes], data, params: TrialParams, tracking: dict[str, str],
                run_id: str) -> TrialResult:
    """What one Ray task runs: materialise the checkpoint locally, fine-tune, log epochs to the trial's run."""
    client = _mlflow_client(tracking) if run_id else None
    on_epoch = (lambda epoch, row: _log_metrics(client, run_id, row, step=epoch)) if client else None
    with tempfile.TemporaryDirectory(prefix="bertpipe-ft-") as tmp:
        for name, blob in model_files.items():
            with open(os.path.join(tmp, name), "wb") as f:
                f.write(blob)
        return run_trial(tmp, data, params, on_epoch)


@dataclass
class TaskOutcome:
    spec: TaskSpec
    status: str  # ok | failed | absent
    error: str = ""
    run_id: str = ""
    trials: list[TrialResult] = field(default_factory=list)
    trial_errors: list[str] = field(default_factory=list)
    num_train: int = 0

    @property
    def best(self) -> TrialResult | None:
        return max(self.trials, key=lambda r: r.score) if self.trials else None  # max keeps the first on ties


def run_trials(jobs: list[tuple[Any, tuple]], cfg: FinetuneConfig) -> list[TrialResult | BaseException]:
    """Run `jobs` ([(key, args of _trial_body)]) as Ray tasks, at most max_concurrent_trials at once;
    returns each job's result or its exception, in job order."""
    import ray

    remote = ray.remote(_trial_body).options(num_cpus=cfg.cpus_per_trial, num_gpus=cfg.gpus_per_trial,
                                             max_retries=0)
    limit = cfg.max_concurrent_trials or len(jobs)
    results: list[Any] = [None] * len(jobs)
    running: dict[Any, int] = {}
    next_job, done_count = 0, 0
    while next_job < len(jobs) or running:
        while next_job < len(jobs) and len(running) < limit:
            running[remote.remote(*jobs[next_job][1])] = next_job
            next_job += 1
        ready, _ = ray.wait(list(running), num_returns=1)
        for ref in ready:
            i = running.pop(ref)
            try:
                results[i] = ray.get(ref)
                r = results[i]
                log.info("finetune: trial %s done: score %.4f (%d/%d)", jobs[i][0], r.score, done_count + 1, len(jobs))
            except Exception as e:  # noqa: BLE001 - one trial failing must not stop the sweep
                results[i] = e
                log.warning("finetune: trial %s failed: %s", jobs[i][0], e)
            done_count += 1
    return results


def submission_rows(spec: TaskSpec, preds: list) -> list[str]:
    """Predictions as GLUE's server wants them: label strings (0/1 for the binary tasks), STS-B floats in [0, 5]."""
    if spec.is_regression:
        return [f"{min(5.0, max(0.0, float(p))):.3f}" for p in preds]
    return [spec.labels[int(p)] for p in preds]


def write_submission(out_uri: str, outcomes: list[TaskOutcome]) -> list[str]:
    """submission/<name>.tsv per test set of each finished task + submission.zip; returns the file names."""
    files: dict[str, bytes] = {}
    for o in outcomes:
        if o.status != "ok" or o.best is None:
            continue
        for name, (index, preds) in o.best.test_predictions.items():
            lines = ["index\tprediction"] + [f"{i}\t{p}" for i, p in zip(index, submission_rows(o.spec, preds))]
            files[f"{name}.tsv"] = ("\n".join(lines) + "\n").encode()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for name, blob in sorted(files.items()):
            _write(_join(out_uri, "submission", name), blob)
            z.writestr(name, blob)
    if files:
        _write(_join(out_uri, "submission.zip"), buf.getvalue())
    return sorted(files)


def _fmt(o: TaskOutcome) -> str:
    best = o.best
    return " / ".join(f"{100 * v:.1f}" for ms in best.dev_metrics.values() for v in ms.values()) if best else ""


def summary_table(outcomes: list[TaskOutcome]) -> tuple[list[dict[str, Any]], str, str]:
    """(rows, Markdown, CSV) of the sweep: one row per task plus the two averages."""
    rows = []
    for o in outcomes:
        best = o.best
        rows.append({
            "task": o.spec.name, "status": o.status,
            "metrics": "/".join(f"{s}.{m}" if len(o.spec.dev_files) > 1 else m
                                for s, _ in o.spec.dev_files for m in o.spec.metrics),
            "dev": _fmt(o), "score": f"{100 * best.score:.2f}" if best else "",
            "best_lr": f"{best.learning_rate:g}" if best else "", "trials_ok": f"{len(o.trials)}",
            "trials_failed": f"{len(o.trial_errors)}", "num_train": f"{o.num_train}",
            "test_sets": ",".join(best.test_predictions) if best else "",
            "error": (o.error or "; ".join(o.trial_errors))[:300].replace("\n", " "),
        })
    scores = {o.spec.name: o.best.score for o in outcomes if o.best}
    glue, complete = glue_score(scores)
    paper, paper_complete = bert_paper_average({o.spec.name: o.best.dev_metrics for o in outcomes if o.best})
    cols = list(rows[0]) if rows else ["task"]
    md = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    md += ["| " + " | ".join(str(r[c]).replace("|", "\\|") for c in cols) + " |" for r in rows]
    md.append("")
    md.append(f"GLUE score (leaderboard way: mean of 9 task scores, two-metric tasks averaged, MNLI = mean of m/mm): "
              f"{glue:.2f}" + ("" if complete else f" — PARTIAL, {len(scores)} of 9 tasks, not comparable"))
    md.append(f"BERT paper average (no WNLI; MNLI-m, MNLI-mm, F1 for MRPC/QQP, Spearman for STS-B): {paper:.2f}"
              + ("" if paper_complete else " — PARTIAL"))
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=cols)
    writer.writeheader()
    writer.writerows(rows)
    return rows, "\n".join(md) + "\n", out.getvalue()


def run_stage(ctx: StageContext) -> StageResult:
    import ray

    started = time.perf_counter()
    cfg: FinetuneConfig = ctx.config["finetune"]
    names = task_names(cfg)
    glue_dir = cfg.glue_data_dir
    if not glue_dir:
        glue_dir = write_sample(_join(ctx.output_uri, "smoke_glue"), seed=ctx.seed)
        log.info("finetune: no glue_data_dir, using the project's smoke sample (NOT GLUE) at %s", glue_dir)
    pretrain = ctx.input("pretrain")
    init = pretrain.uri if pretrain.explicit else (cfg.init or _join(pretrain.uri, "export"))
    model_ref = ray.put(read_model_files(init))
    log.info("finetune: initial model %s; tasks %s", init, ", ".join(names))

    client = _mlflow_client(ctx.tracking)
    parent, experiment = ctx.tracking.get("run_id", ""), ctx.tracking.get("experiment_id", "")
    outcomes: list[TaskOutcome] = []
    jobs: list[tuple[Any, tuple]] = []
    job_owner: list[tuple[TaskOutcome, str]] = []
    raw_inputs: list[dict] = []
    for name in names:
        spec = TASKS[name]
        outcome = TaskOutcome(spec, "ok")
        outcomes.append(outcome)
        if not task_present(glue_dir, spec):
            if cfg.tasks:  # named explicitly: its absence is an error
                outcome.status, outcome.error = "failed", f"{_join(glue_dir, name)}: task folder or train.tsv missing"
            else:
                outcome.status = "absent"
            continue
        if client:
            outcome.run_id = client.create_run(experiment, run_name=name, tags={
                "mlflow.parentRunId": parent, "bertpipe.kind": "glue_task", "bertpipe.task": name}).info.run_id
        try:
            data = read_task(glue_dir, spec)
        except (ValueError, StageInputError) as e:
            outcome.status, outcome.error = "failed", str(e)
            log.warning("finetune: task %s failed to read: %s", name, e)
            continue
        raw_inputs.extend(data.files if cfg.glue_data_dir else [])
        outcome.num_train = min(len(data.train), cfg.max_train_examples or len(data.train))
        log.info("finetune: %s: %d train rows (%d used), dev %s, test %s", name, len(data.train), outcome.num_train,
                 {k: len(v) for k, v in data.dev.items()}, {k: len(v) for k, v in data.test.items()})
        data_ref = ray.put(data)
        for seed in cfg.seeds:
            for lr in cfg.learning_rates:
                params = trial_params(cfg, learning_rate=lr, seed=trial_seed(ctx.seed, name, seed))
                run_id = ""
                if client:
                    run_id = client.create_run(experiment, run_name=f"{name}-lr{lr:g}-seed{seed}", tags={
                        "mlflow.parentRunId": outcome.run_id, "bertpipe.kind": "glue_trial"}).info.run_id
                    from mlflow.entities import Param

                    client.log_batch(run_id, params=[Param(k, str(v)) for k, v in
                                                     {**params.__dict__, "task": name, "sweep_seed": seed}.items()])
                jobs.append((f"{name}/lr={lr:g}/seed={seed}", (model_ref, data_ref, params, ctx.tracking, run_id)))
                job_owner.append((outcome, run_id))

    log.info("finetune: %d trials over %d tasks, %s CPU(s) each, at most %s at once", len(jobs),
             sum(o.status == "ok" for o in outcomes), cfg.cpus_per_trial, cfg.max_concurrent_trials or "all")
    for (outcome, run_id), (key, _), result in zip(job_owner, jobs, run_trials(jobs, cfg)):
        if isinstance(result, BaseException):
            outcome.trial_errors.append(f"{key}: {type(result).__name__}: {result}")
        else:
            outcome.trials.append(result)
        if client:
            client.set_terminated(run_id, "FAILED" if isinstance(result, BaseException) else "FINISHED")
    for o in outcomes:
        if o.status == "ok" and not o.trials:
            o.status = "failed"

    submission = write_submission(ctx.output_uri, outcomes)
    rows, markdown, table_csv = summary_table(outcomes)
    _write(_join(ctx.output_uri, "summary.md"), markdown.encode())
    _write(_join(ctx.output_uri, "summary.csv"), table_csv.encode())
    print(markdown)

    scores = {o.spec.name: o.best.score for o in outcomes if o.best}
    glue, complete = glue_score(scores)
    paper, _ = bert_paper_average({o.spec.name: o.best.dev_metrics for o in outcomes if o.best})
    metrics: dict[str, float] = {f"dev.{k}": 100 * v for k, v in scores.items()}
    metrics.update({"glue_score": glue, "glue_score_complete": float(complete), "bert_paper_average": paper,
                    "num_trials": float(len(jobs)),
                    "num_trials_failed": float(sum(len(o.trial_errors) for o in outcomes)),
                    "num_tasks_ok": float(sum(o.status == "ok" for o in outcomes)),
                    "num_tasks_failed": float(sum(o.status == "failed" for o in outcomes)),
                    "seconds": time.perf_counter() - started})
    if client:
        for o in outcomes:
            if not o.run_id:
                continue
            if o.best:
                best = {f"{s}.{m}": v for s, ms in o.best.dev_metrics.items() for m, v in ms.items()}
                _log_metrics(client, o.run_id, {**best, "score": o.best.score, "best_lr": o.best.learning_rate})
            if o.error or o.trial_errors:
                client.set_tag(o.run_id, "bertpipe.error", (o.error or "; ".join(o.trial_errors))[:5000])
            client.set_terminated(o.run_id, "FINISHED" if o.status == "ok" else "FAILED")
        _log_metrics(client, parent, {k: v for k, v in metrics.items() if k != "seconds"})
        with tempfile.TemporaryDirectory() as tmp:
            for name, blob in (("summary.md", markdown.encode()), ("summary.csv", table_csv.encode())):
                with open(os.path.join(tmp, name), "wb") as f:
                    f.write(blob)
                client.log_artifact(parent, os.path.join(tmp, name), "glue")
            if submission:
                path = os.path.join(tmp, "submission.zip")
                with open(path, "wb") as f:
                    f.write(_read(_join(ctx.output_uri, "submission.zip")))
                client.log_artifact(parent, path, "glue")

    ran = [o for o in outcomes if o.status != "absent"]
    if not any(o.status == "ok" for o in ran):
        errors = "; ".join(f"{o.spec.name}: {o.error or '; '.join(o.trial_errors)}" for o in ran) or "no task present"
        raise StageInputError(f"finetune: every GLUE task failed ({errors}) in {glue_dir}")
    return StageResult(
        num_rows=sum(len(o.trials) for o in outcomes), metrics=metrics, raw_inputs=raw_inputs,
        extra={"init": init, "glue_data_dir": glue_dir, "submission": submission,
               "tasks": {o.spec.name: {"status": o.status, "error": o.error or "; ".join(o.trial_errors)}
                         for o in outcomes}},
        outputs=["summary.md", "summary.csv", *(f"submission/{n}" for n in submission),
                 *(["submission.zip"] if submission else [])])

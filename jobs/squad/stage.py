"""The `squad` stage: SQuAD v1.1 / v2.0 fine-tuning fan-out on Ray (learning rates x seeds, as GLUE's), the best
trial by eval F1, and its official-format predictions beside the metrics.

Outputs: predictions.json ({question id: answer text}, the official format; "" = no answer in v2.0),
metrics.json (exact_match / f1 in %, v2.0 also HasAns_ / NoAns_ and the tuned null threshold),
null_odds.json (v2.0: question id -> null score minus best span score), summary.md (every trial).

Every trial of the grid must succeed: one that fails fails the stage, naming it, and the finished ones are kept
for the rerun (jobs/downstream/fanout.sweep).
"""
from __future__ import annotations

import json
import logging
import math
import time

from bertpipe.jobs.downstream import fanout
from bertpipe.jobs.downstream.inputs import check_init, describe, init_uri, model_files, require_file
from bertpipe.jobs.squad.config import SquadConfig
from bertpipe.jobs.squad.data import read_squad
from bertpipe.jobs.squad.trial import SquadData, SquadResult, run_squad_trial
from bertpipe.jobs.tracking import RunLogger
from bertpipe.pipeline import parts, storage
from bertpipe.pipeline.stage import StageContext, StageInputError, StageResult

log = logging.getLogger("bertpipe.squad")
SHOWN = ("exact_match", "f1")


def describe_raw_inputs(cfg: SquadConfig) -> list[dict]:
    return describe([cfg.train_file, cfg.eval_file], "SQuAD file")


def load_data(cfg: SquadConfig) -> SquadData:
    """Both sets, checked (StageInputError naming the file and question id); the eval set decides the version."""
    train = read_squad(cfg.train_file, cfg.train_articles)
    evaluation = read_squad(cfg.eval_file, cfg.eval_articles)
    if not train.examples or not evaluation.examples:
        empty = cfg.train_file if not train.examples else cfg.eval_file
        raise StageInputError(f"{empty}: no questions in the selected articles")
    shared = {e.qid for e in train.examples} & {e.qid for e in evaluation.examples}
    if shared:
        raise StageInputError(f"{cfg.eval_file}: {len(shared)} eval questions are also training questions "
                              f"(e.g. {sorted(shared)[0]}): split the file by article (squad.train_articles / "
                              "squad.eval_articles)")
    version_2 = evaluation.version_2 if cfg.version == "auto" else cfg.version == "2.0"
    return SquadData(train.examples, evaluation.examples, version_2)


def preflight(ctx: StageContext) -> None:
    cfg: SquadConfig = ctx.config["squad"]
    require_file(cfg.train_file, "squad.train_file", "SQuAD training file")
    require_file(cfg.eval_file, "squad.eval_file", "SQuAD evaluation file")
    check_init(ctx, "squad")
    load_data(cfg)


def write_outputs(uri: str, best, table: str, version_2: bool) -> list[str]:
    metrics = {k: (100 * v if k.endswith(("exact_match", "f1")) else v) for k, v in best.metrics.items()}
    files = {"predictions.json": best.predictions, "metrics.json": metrics}
    if version_2:  # JSON has no infinity: a question with no valid span gets a margin above every threshold
        files["null_odds.json"] = {q: (m if math.isfinite(m) else 1e9) for q, m in best.null_margins.items()}
    for name, data in files.items():
        storage.write_bytes(storage.join(uri, name), json.dumps(data, indent=1, sort_keys=True).encode())
    storage.write_bytes(storage.join(uri, "summary.md"), table.encode())
    return [*files, "summary.md"]


def run_stage(ctx: StageContext) -> StageResult:
    started = time.perf_counter()
    cfg: SquadConfig = ctx.config["squad"]
    data = load_data(cfg)
    init = init_uri(ctx, "squad")
    log.info("squad: %d train / %d eval questions (v%s), init %s", len(data.train), len(data.eval),
             "2.0" if data.version_2 else "1.1", init)
    parent = RunLogger(ctx.tracking)
    trials, results = fanout.sweep("squad", run_squad_trial, ctx, cfg, model_files(init), data,
                                   describe_raw_inputs(cfg), SquadResult, parent)
    trial, best = fanout.best_of(trials, results)
    shown = SHOWN + (("HasAns_f1", "NoAns_f1") if data.version_2 else ())
    used = min(len(data.train), cfg.max_train_examples or len(data.train))
    table = f"# SQuAD v{'2.0' if data.version_2 else '1.1'}: {used} of {len(data.train)} train / {len(data.eval)} " \
            f"eval questions; best {trial.key}\n\n" + fanout.grid_table(trials, results, shown)
    outputs = write_outputs(ctx.output_uri, best, table, data.version_2)
    parts.drop_all(ctx.output_uri)  # every trial is in the outputs now: a committed folder holds no part
    metrics = {f"best.{k}": v for k, v in best.metrics.items()}
    metrics.update({"best_lr": trial.learning_rate, "num_trials": float(len(trials)),
                    "num_trials_failed": float(sum(isinstance(r, BaseException) for r in results)),
                    "seconds": time.perf_counter() - started})
    parent.log_metrics(metrics)
    parent.log_bytes(table.encode(), "summary.md", "squad")
    return StageResult(num_rows=len(data.eval), metrics=metrics, outputs=outputs,
                       extra={"init": init, "best_trial": trial.key, "version": "2.0" if data.version_2 else "1.1"})

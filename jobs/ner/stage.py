"""The `ner` stage: CoNLL-2003 NER fine-tuning fan-out on Ray (learning rates x seeds, as GLUE's), the best trial
by entity F1 on the eval file, its predictions in CoNLL format (`word gold predicted`, IOB2 predictions: what
conlleval reads) and conlleval's figures.

Outputs: predictions.txt, metrics.json (precision / recall / f1 / per-type f1 in %, counts), summary.md.

Every trial of the grid must succeed: one that fails fails the stage, naming it, and the finished ones are kept
for the rerun (jobs/downstream/fanout.sweep).
"""
from __future__ import annotations

import json
import logging
import time

from bertpipe.jobs.downstream import fanout
from bertpipe.jobs.downstream.inputs import check_init, describe, init_uri, model_files, require_file
from bertpipe.jobs.ner.config import NerConfig
from bertpipe.jobs.ner.conll import format_predictions, read_conll
from bertpipe.jobs.ner.trial import NerData, NerResult, run_ner_trial
from bertpipe.jobs.tracking import RunLogger
from bertpipe.pipeline import parts, storage
from bertpipe.pipeline.stage import StageContext, StageResult

log = logging.getLogger("bertpipe.ner")


def describe_raw_inputs(cfg: NerConfig) -> list[dict]:
    return describe([cfg.train_file, cfg.eval_file], "CoNLL file")


def load_data(cfg: NerConfig):
    """(NerData, train file, eval file): both read and checked (StageInputError naming file:line)."""
    train = read_conll(cfg.train_file, cfg.entity_types, cfg.scheme)
    evaluation = read_conll(cfg.eval_file, cfg.entity_types, cfg.scheme)
    return NerData(train.sentences, evaluation.sentences, cfg.labels), train, evaluation


def preflight(ctx: StageContext) -> None:
    cfg: NerConfig = ctx.config["ner"]
    require_file(cfg.train_file, "ner.train_file", "CoNLL training file")
    require_file(cfg.eval_file, "ner.eval_file", "CoNLL evaluation file")
    check_init(ctx, "ner")
    load_data(cfg)


def run_stage(ctx: StageContext) -> StageResult:
    started = time.perf_counter()
    cfg: NerConfig = ctx.config["ner"]
    data, train, evaluation = load_data(cfg)
    init = init_uri(ctx, "ner")
    log.info("ner: %d train / %d eval sentences (%s / %s), init %s", len(data.train), len(data.eval), train.scheme,
             evaluation.scheme, init)
    parent = RunLogger(ctx.tracking)
    trials, results = fanout.sweep("ner", run_ner_trial, ctx, cfg, model_files(init), data, describe_raw_inputs(cfg),
                                   NerResult, parent)
    trial, best = fanout.best_of(trials, results)
    used = min(len(data.train), cfg.max_train_examples or len(data.train))
    table = f"# CoNLL NER: {used} of {len(data.train)} train / {len(data.eval)} eval sentences; best {trial.key}\n\n" + \
        fanout.grid_table(trials, results, ("precision", "recall", "f1"))
    shown = {k: (v if k in ("correct", "guessed", "gold") else 100 * v) for k, v in best.metrics.items()}
    files = {"predictions.txt": format_predictions(data.eval, best.predicted),
             "metrics.json": json.dumps(shown, indent=1, sort_keys=True), "summary.md": table}
    for name, text in files.items():
        storage.write_bytes(storage.join(ctx.output_uri, name), text.encode())
    parts.drop_all(ctx.output_uri)  # every trial is in the outputs now: a committed folder holds no part
    metrics = {f"best.{k}": v for k, v in best.metrics.items()}
    metrics.update({"best_lr": trial.learning_rate, "num_trials": float(len(trials)),
                    "num_trials_failed": float(sum(isinstance(r, BaseException) for r in results)),
                    "seconds": time.perf_counter() - started})
    parent.log_metrics(metrics)
    parent.log_bytes(table.encode(), "summary.md", "ner")
    return StageResult(num_rows=len(data.eval), metrics=metrics, outputs=list(files),
                       extra={"init": init, "best_trial": trial.key, "schemes": [train.scheme, evaluation.scheme]})

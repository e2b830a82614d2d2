"""The `ner` stage: CoNLL-2003 NER on the fine-tuning engine (learning rates x seeds on Ray, as GLUE's), the best
trial by entity F1 on the eval file, its predictions in CoNLL format (`word gold predicted`, IOB2 predictions:
what conlleval reads), conlleval's figures and its model (whose config names the IOB2 labels).

Outputs: predictions.txt, metrics.json (precision / recall / f1 / per-type f1 in %, counts), summary.md,
models/ner/.

Every trial of the grid must succeed: one that fails fails the stage, naming it, and the finished ones are kept
for the rerun (jobs/tuning/fanout.py).
"""
from __future__ import annotations

import json
import logging
import time

from bertpipe.jobs.ner.config import NerConfig
from bertpipe.jobs.services.tracking import RunLogger
from bertpipe.jobs.tuning import fanout
from bertpipe.jobs.tuning.conll import format_predictions, read_conll
from bertpipe.jobs.tuning.inputs import check_train_eval, file_checksums, init_uri, read_model_files
from bertpipe.pipeline.framework import parts, storage
from bertpipe.pipeline.framework.stage import StageContext, StageResult

log = logging.getLogger("bertpipe.ner")
COUNTS = ("correct", "guessed", "gold")


def describe_raw_inputs(cfg: NerConfig) -> list[dict]:
    return file_checksums([cfg.train_file, cfg.eval_file], "CoNLL file")


def load_conll_data(cfg: NerConfig):
    """(NerData, train file, eval file): both read and checked (StageInputError naming file:line)."""
    train = read_conll(cfg.train_file, cfg.entity_types, cfg.scheme)
    evaluation = read_conll(cfg.eval_file, cfg.entity_types, cfg.scheme)
    from bertpipe.jobs.ner.trial import NerData  # torch: imported when the stage runs

    return NerData(train.sentences, evaluation.sentences, cfg.labels), train, evaluation


def preflight(ctx: StageContext) -> None:
    check_train_eval(ctx, "ner", "CoNLL")
    load_conll_data(ctx.section(NerConfig))


def run_stage(ctx: StageContext) -> StageResult:
    started = time.perf_counter()
    cfg = ctx.section(NerConfig)
    data, train, evaluation = load_conll_data(cfg)
    init = init_uri(ctx, cfg.init)
    log.info("ner: %d train / %d eval sentences (%s / %s), init %s", len(data.train), len(data.eval), train.scheme,
             evaluation.scheme, init)
    parent = RunLogger(ctx.tracking)
    from bertpipe.jobs.ner.trial import NerTask  # torch: imported when the stage runs

    trials = fanout.sweep("ner", NerTask(data), ctx, cfg, read_model_files(init), describe_raw_inputs(cfg), parent)
    best = fanout.best_of(trials)
    used = min(len(data.train), cfg.max_train_examples or len(data.train))
    table = (f"# CoNLL NER: {used} of {len(data.train)} train / {len(data.eval)} eval sentences; best {best.key}, "
             f"epoch {best.result.epoch}\n\n" + fanout.grid_table(trials, ("precision", "recall", "f1")))
    shown = {k: (v if k in COUNTS else 100 * v) for k, v in best.result.metrics.items()}
    files = {"predictions.txt": format_predictions(data.eval, best.result.outputs["predicted"]),
             "metrics.json": json.dumps(shown, indent=1, sort_keys=True), "summary.md": table}
    for name, text in files.items():
        storage.write_bytes(storage.join(ctx.output_uri, name), text.encode())
    models = fanout.keep_best_model(ctx.output_uri, best, "ner")
    parts.drop_all(ctx.output_uri)  # every trial is in the outputs now: a committed folder holds no part
    metrics = fanout.log_best("ner", parent, trials, best, table, started)
    return StageResult(num_rows=len(data.eval), metrics=metrics, outputs=[*files, *models],
                       extra={"init": init, "best_trial": best.key, "schemes": [train.scheme, evaluation.scheme]})

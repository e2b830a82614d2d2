"""The `squad` stage: SQuAD v1.1 / v2.0 on the fine-tuning engine (learning rates x seeds on Ray, as GLUE's), the
best trial by eval F1, its official-format predictions beside the metrics and its model.

Outputs: predictions.json ({question id: answer text}, the official format; "" = no answer in v2.0),
metrics.json (exact_match / f1 in %, v2.0 also HasAns_ / NoAns_ and the tuned null threshold),
null_odds.json (v2.0: question id -> null score minus best span score), summary.md (every trial), models/squad/.

Every trial of the grid must succeed: one that fails fails the stage, naming it, and the finished ones are kept
for the rerun (jobs/tuning/fanout.py).
"""
from __future__ import annotations

import json
import logging
import math
import time
from typing import TYPE_CHECKING

from bertpipe.jobs.squad.config import SquadConfig
from bertpipe.jobs.squad.data import read_squad
from bertpipe.jobs.services.tracking import RunLogger
from bertpipe.jobs.tuning import fanout
from bertpipe.jobs.tuning.inputs import check_train_eval, file_checksums, init_uri, read_model_files
from bertpipe.pipeline.framework import parts, storage
from bertpipe.pipeline.framework.stage import StageContext, StageInputError, StageResult

if TYPE_CHECKING:
    from bertpipe.jobs.squad.trial import SquadData

log = logging.getLogger("bertpipe.squad")
SHOWN = ("exact_match", "f1")


def describe_raw_inputs(cfg: SquadConfig) -> list[dict]:
    return file_checksums([cfg.train_file, cfg.eval_file], "SQuAD file")


def load_squad_data(cfg: SquadConfig) -> SquadData:
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
    from bertpipe.jobs.squad.trial import SquadData  # torch: imported when the stage runs

    return SquadData(train.examples, evaluation.examples, version_2)


def preflight(ctx: StageContext) -> None:
    check_train_eval(ctx, "squad", "SQuAD")
    load_squad_data(ctx.section(SquadConfig))


def write_outputs(uri: str, best, table: str, version_2: bool) -> list[str]:
    metrics = {k: (100 * v if k.endswith(("exact_match", "f1")) else v) for k, v in best.metrics.items()}
    files = {"predictions.json": best.outputs["predictions"], "metrics.json": metrics}
    if version_2:  # JSON has no infinity: a question with no valid span gets a margin above every threshold
        files["null_odds.json"] = {q: (m if math.isfinite(m) else 1e9)
                                   for q, m in best.outputs["null_margins"].items()}
    for name, data in files.items():
        storage.write_bytes(storage.join(uri, name), json.dumps(data, indent=1, sort_keys=True).encode())
    storage.write_bytes(storage.join(uri, "summary.md"), table.encode())
    return [*files, "summary.md"]


def run_stage(ctx: StageContext) -> StageResult:
    started = time.perf_counter()
    cfg = ctx.section(SquadConfig)
    data = load_squad_data(cfg)
    init = init_uri(ctx, cfg.init)
    log.info("squad: %d train / %d eval questions (v%s), init %s", len(data.train), len(data.eval),
             "2.0" if data.version_2 else "1.1", init)
    parent = RunLogger(ctx.tracking)
    from bertpipe.jobs.squad.trial import SquadTask  # torch: imported when the stage runs

    trials = fanout.sweep("squad", SquadTask(data), ctx, cfg, read_model_files(init), describe_raw_inputs(cfg),
                          parent)
    best = fanout.best_of(trials)
    shown = SHOWN + (("HasAns_f1", "NoAns_f1") if data.version_2 else ())
    used = min(len(data.train), cfg.max_train_examples or len(data.train))
    table = (f"# SQuAD v{'2.0' if data.version_2 else '1.1'}: {used} of {len(data.train)} train / "
             f"{len(data.eval)} eval questions; best {best.key}, epoch {best.result.epoch}\n\n"
             + fanout.grid_table(trials, shown))
    outputs = write_outputs(ctx.output_uri, best.result, table, data.version_2)
    outputs += fanout.keep_best_model(ctx.output_uri, best, "squad")
    parts.drop_all(ctx.output_uri)  # every trial is in the outputs now: a committed folder holds no part
    metrics = fanout.log_best("squad", parent, trials, best, table, started)
    return StageResult(num_rows=len(data.eval), metrics=metrics, outputs=outputs,
                       extra={"init": init, "best_trial": best.key, "version": "2.0" if data.version_2 else "1.1"})

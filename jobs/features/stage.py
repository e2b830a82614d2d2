"""The `features` stage: a Ray Data job that runs a frozen BERT over the sentences of a CoNLL file on an actor
pool (one model load per actor) and writes word-aligned Parquet: sentence index, words, tags, and one feature
vector per word (`features.mode`: last four layers concatenated, last layer, or their sum)."""
from __future__ import annotations

import logging
import time

from bertpipe.jobs.tuning.inputs import check_init, file_checksums, init_uri, read_model_files, require_file
from bertpipe.jobs.features.config import FeaturesConfig
from bertpipe.jobs.tuning.conll import read_conll
from bertpipe.pipeline.framework import storage
from bertpipe.pipeline.framework.stage import StageContext, StageResult

log = logging.getLogger("bertpipe.features")


def describe_raw_inputs(cfg: FeaturesConfig) -> list[dict]:
    return file_checksums([cfg.input_file], "CoNLL file")


def preflight(ctx: StageContext) -> None:
    cfg = ctx.section(FeaturesConfig)
    require_file(cfg.input_file, "features.input_file", "CoNLL file")
    check_init(ctx, "features")
    read_conll(cfg.input_file, cfg.entity_types)


def run_stage(ctx: StageContext) -> StageResult:
    import ray

    from bertpipe.jobs.features.extract import Extractor  # torch: imported when the stage runs, not for `status`

    started = time.perf_counter()
    cfg = ctx.section(FeaturesConfig)
    sentences = read_conll(cfg.input_file, cfg.entity_types).sentences
    init = init_uri(ctx, cfg.init)
    rows = [{"sentence": i, "words": s.words, "tags": s.tags} for i, s in enumerate(sentences)]
    ds = ray.data.from_items(rows).map_batches(
        Extractor, fn_constructor_kwargs={"model_files": read_model_files(init), "mode": cfg.mode,
                                          "max_seq_length": cfg.max_seq_length, "threads": cfg.cpus_per_actor},
        batch_size=cfg.batch_size, concurrency=cfg.num_actors, num_cpus=cfg.cpus_per_actor, batch_format="numpy")
    out = storage.join(ctx.output_uri, "features")
    ds.write_parquet(out)
    files = [f"features/{rel}" for rel, _ in storage.list_files(out)]
    seconds = time.perf_counter() - started
    words = sum(len(s.words) for s in sentences)
    log.info("features: %d sentences, %d words in %.1f s", len(sentences), words, seconds)
    return StageResult(num_rows=len(sentences), outputs=files, extra={"init": init, "mode": cfg.mode},
                       metrics={"words": float(words), "words_per_second": words / seconds if seconds else 0.0})

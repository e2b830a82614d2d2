"""The `pretrain` stage: checks inputs and resources, then runs a Ray Train TorchTrainer (DeepSpeed per worker).

Outputs in the stage folder: `export/` (model.safetensors + config.json + vocab.txt: what fine-tuning reads),
`metrics.json` and `deepspeed_config.json`. Checkpoints live in Ray Train's storage, by default
`<parent of the output folder>/ray_results/<run name>`: outside the output folder, which the workflow empties
before a rerun — so rerunning the stage after a crash continues from the latest checkpoint (Ray Train V2
resumes a run started again with the same storage_path and name). The run name hashes the config, the seed
and the input manifests, so a changed config starts a fresh run instead of resuming a foreign one.
"""
from __future__ import annotations

import json
import logging
import os
import posixpath
import time
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from bertpipe.jobs.configtools import stable_hash, to_dict
from bertpipe.jobs.pretrain.deepspeed_config import deepspeed_config
from bertpipe.jobs.pretrain.config import ModelConfig, PretrainConfig, validate
from bertpipe.jobs.pretrain.loop import train_loop_per_worker
from bertpipe.pipeline import storage
from bertpipe.pipeline.stage import StageContext, StageInputError, StageResult

log = logging.getLogger("bertpipe.pretrain")
COLUMNS = ["input_ids", "segment_b_start", "next_sentence_label"]
EXPORT_FILES = ("config.json", "model.safetensors", "vocab.txt")  # what fine-tuning (and transformers) loads


def check_resources(cfg: PretrainConfig, cluster: dict[str, float]) -> None:
    """Trainer workers that take every CPU leave none for Ray Data's read tasks and the run hangs: refuse."""
    need_cpu = cfg.num_workers * cfg.cpus_per_worker
    have_cpu = float(cluster.get("CPU", 0))
    if have_cpu - need_cpu < 1:
        raise ValueError(f"pretrain needs num_workers × cpus_per_worker = {cfg.num_workers} × {cfg.cpus_per_worker}"
                         f" = {need_cpu} CPUs plus at least 1 for data loading, but the Ray cluster has {have_cpu:g}"
                         " CPUs; lower pretrain.num_workers / cpus_per_worker or add nodes")
    if cfg.use_gpu and float(cluster.get("GPU", 0)) < cfg.num_workers:
        raise ValueError(f"pretrain.use_gpu with {cfg.num_workers} workers needs {cfg.num_workers} GPUs, "
                         f"the Ray cluster has {cluster.get('GPU', 0):g}")


def check_shard(uri: str, vocab_hash: str, max_seq_length: int) -> int:
    """Rows of one shard after checking it is readable, built with our vocabulary and for this length."""
    from bertpipe.pipeline.shards import check_vocab, read_shard_meta

    if not storage.exists(uri):
        raise StageInputError(f"shard {uri} is missing")
    meta = read_shard_meta(uri)
    check_vocab(meta, vocab_hash, uri)
    if meta.get("max_seq_length") != max_seq_length:
        raise StageInputError(f"{uri} was built for max_seq_length {meta.get('max_seq_length')}, "
                              f"expected {max_seq_length}")
    fs, path = storage.resolve(uri)
    try:
        with fs.open_input_file(path) as f:
            pf = pq.ParquetFile(f)
            missing = [c for c in COLUMNS if c not in pf.schema_arrow.names]
            num_rows = pf.metadata.num_rows
    except (OSError, pa.ArrowException) as exc:
        raise StageInputError(f"{uri} is not a readable Parquet shard: {exc}") from exc
    if missing:
        raise StageInputError(f"{uri} lacks the columns {missing}")
    return num_rows


def preflight(ctx: StageContext) -> None:
    """Before anything runs: explicit shards and vocabulary exist, carry this vocabulary and cover every phase."""
    from bertpipe.pipeline.shards import list_shards
    from bertpipe.pipeline.vocab import load_vocab, vocab_file, vocab_hash

    cfg: PretrainConfig = ctx.config["pretrain"]
    vocab, pairs = ctx.input("vocab"), ctx.input("pairs")
    if vocab.explicit:
        load_vocab(vocab_file(vocab.uri))
    elif pairs.explicit:
        raise StageInputError("pretrain.input names a shard folder: name its vocabulary too (vocab.path=...vocab.txt)")
    if pairs.explicit:
        vhash = vocab_hash(vocab.uri)
        for phase, steps in zip(cfg.phases, cfg.phase_steps()):
            if steps:
                train, heldout = list_shards(pairs.uri, phase.max_seq_length)
                for uri in (train[0], heldout):
                    check_shard(uri, vhash, phase.max_seq_length)


def default_storage_path(output_uri: str) -> str:
    parent = posixpath.dirname(output_uri.rstrip("/")) if "://" in output_uri else os.path.dirname(
        os.path.abspath(output_uri))
    return storage.join(parent, "ray_results")


def run_name(ctx: StageContext, cfg: PretrainConfig) -> str:
    if cfg.run_name:
        return cfg.run_name
    ids = {n: (i.manifest or {}).get("output_id", i.uri) for n, i in sorted(ctx.inputs.items())}
    # fail_at_step is a test hook: a run with it must resume the same run without it.
    key = {k: to_dict(v) for k, v in ctx.config.items()}
    key["pretrain"].pop("fail_at_step", None)
    return "pretrain-" + stable_hash({"config": key, "seed": ctx.seed, "inputs": ids})[:12]


def latest_checkpoint(storage_path: str, name: str, cfg: PretrainConfig) -> str | None:
    """The complete checkpoint with the highest step under <storage_path>/<name>, or None.

    Ray Train V2 restores a rerun with the same (storage_path, name) from its snapshot, but a run that died
    right after reporting may not have written the snapshot yet; scanning the folders (a checkpoint counts once
    every rank's DeepSpeed files and our position.json are there) makes the rerun resume in that case too."""
    from bertpipe.jobs.pretrain.loop import CKPT_TAG, STATE_FILE

    run_dir = storage.join(storage_path, name)
    if not storage.exists(run_dir):
        return None
    fs, path = storage.resolve(run_dir)
    best: tuple[int, str] | None = None
    for info in fs.get_file_info(pafs.FileSelector(path)):
        base = posixpath.basename(info.path)
        if info.type != pafs.FileType.Directory or not base.startswith("checkpoint_"):
            continue
        ckpt = storage.join(run_dir, base)
        if cfg.zero_stage == 0:
            needed = ["mp_rank_00_model_states.pt"]
        else:
            needed = [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(cfg.num_workers)]
        if not all(storage.exists(storage.join(ckpt, CKPT_TAG, n)) for n in needed):
            continue
        try:
            step = int(json.loads(storage.read_text(storage.join(ckpt, STATE_FILE)))["step"])
        except (OSError, ValueError, KeyError):
            continue
        if best is None or step > best[0]:
            best = (step, ckpt)
    return best[1] if best else None


def _datasets(pairs_uri: str, vocab_hash: str, cfg: PretrainConfig) -> tuple[dict[str, Any], dict[str, int]]:
    import ray.data

    from bertpipe.pipeline.shards import list_shards

    datasets, rows = {}, {}
    for phase, steps in zip(cfg.phases, cfg.phase_steps()):
        L = phase.max_seq_length
        train, heldout = list_shards(pairs_uri, L)
        rows[f"train_{L}"] = sum(check_shard(u, vocab_hash, L) for u in train)
        rows[f"heldout_{L}"] = check_shard(heldout, vocab_hash, L)
        per_worker = rows[f"train_{L}"] // cfg.num_workers
        if steps and per_worker < phase.micro_batch_size:
            raise ValueError(f"{rows[f'train_{L}']} training rows at seq {L} are too few for {cfg.num_workers} "
                             f"workers × micro_batch_size {phase.micro_batch_size}")
        if rows[f"heldout_{L}"] < cfg.num_workers:
            raise StageInputError(f"held-out shard {heldout} has {rows[f'heldout_{L}']} rows, fewer than the "
                                  f"{cfg.num_workers} workers")
        datasets[f"train_{L}"] = ray.data.read_parquet(train).select_columns(COLUMNS)
        datasets[f"heldout_{L}"] = ray.data.read_parquet(heldout).select_columns(COLUMNS)
    return datasets, rows


def _log_run_config(ctx: StageContext, ds_json: dict[str, Any]) -> None:
    if not (ctx.tracking.get("tracking_uri") and ctx.tracking.get("run_id")):
        return
    from mlflow.entities import Param
    from mlflow.tracking import MlflowClient

    from bertpipe.jobs.tracking import flatten

    client = MlflowClient(ctx.tracking["tracking_uri"])
    run_id = ctx.tracking["run_id"]
    existing = client.get_run(run_id).data.params
    params = {k: v[:500] for k, v in flatten({k: to_dict(v) for k, v in ctx.config.items()}).items()}
    params = {k: v for k, v in params.items() if k not in existing}  # the workflow may have logged them
    items = list(params.items())
    for i in range(0, len(items), 100):
        client.log_batch(run_id, params=[Param(k, v) for k, v in items[i:i + 100]])
    client.log_dict(run_id, ds_json, "deepspeed_config.json")


def run_stage(ctx: StageContext) -> StageResult:
    import ray
    import ray.train
    from ray.data import ExecutionOptions
    from ray.train.torch import TorchTrainer

    from bertpipe.pipeline.vocab import load_vocab, vocab_file, vocab_hash

    started = time.time()
    model_cfg: ModelConfig = ctx.config["model"]
    cfg: PretrainConfig = ctx.config["pretrain"]
    validate(cfg)
    check_resources(cfg, ray.cluster_resources())

    vocab_uri = vocab_file(ctx.input("vocab").uri)
    tokens = load_vocab(vocab_uri)
    vhash = vocab_hash(vocab_uri)
    fs, path = storage.resolve(vocab_uri)
    with fs.open_input_stream(path) as f:
        vocab_bytes = f.read()
    datasets, rows = _datasets(ctx.input("pairs").uri, vhash, cfg)

    ds_json = deepspeed_config(cfg, cfg.phases[0], cfg.num_workers)
    storage.write_text_atomic(storage.join(ctx.output_uri, "deepspeed_config.json"),
                              json.dumps(ds_json, indent=2, sort_keys=True))
    _log_run_config(ctx, ds_json)

    storage_path = cfg.storage_path or default_storage_path(ctx.output_uri)
    name = run_name(ctx, cfg)
    marker = ""
    if cfg.fail_at_step:
        if "://" in storage_path:
            raise ValueError("pretrain.fail_at_step (a test hook) needs a local storage_path")
        os.makedirs(os.path.join(storage_path, name), exist_ok=True)
        marker = os.path.join(storage_path, name, "fault_injected")
    resume = latest_checkpoint(storage_path, name, cfg)
    log.info("pretrain: %d workers, ZeRO %d, %s steps, storage %s/%s%s", cfg.num_workers, cfg.zero_stage,
             list(cfg.phase_steps()), storage_path, name, f", resuming from {resume}" if resume else "")
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"pretrain": cfg, "model": model_cfg, "seed": ctx.seed, "vocab_tokens": tokens,
                           "vocab_bytes": vocab_bytes, "tracking": dict(ctx.tracking),
                           "export_uri": storage.join(ctx.output_uri, "export"), "fail_marker": marker,
                           "storage_path": storage_path, "run_name": name},
        scaling_config=ray.train.ScalingConfig(num_workers=cfg.num_workers, use_gpu=cfg.use_gpu,
                                               resources_per_worker={"CPU": cfg.cpus_per_worker}),
        run_config=ray.train.RunConfig(
            name=name, storage_path=storage_path,
            failure_config=ray.train.FailureConfig(max_failures=cfg.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=cfg.num_checkpoints_to_keep)),
        datasets=datasets,
        # preserve_order makes the streaming split deterministic (which rows reach which worker, in which
        # order): the precondition for resuming by skipping a known number of batches.
        dataset_config=ray.train.DataConfig(execution_options=ExecutionOptions(preserve_order=True)),
    )
    result = trainer.fit()
    metrics = {k: float(v) for k, v in (result.metrics or {}).items() if isinstance(v, (int, float))}
    metrics["seconds"] = time.time() - started
    storage.write_text_atomic(storage.join(ctx.output_uri, "metrics.json"), json.dumps(metrics, indent=2))
    ctx.log_metrics({k: v for k, v in metrics.items() if k.startswith(("eval_", "step"))}, None)
    return StageResult(num_rows=int(metrics.get("step", 0)), metrics=metrics,
                       extra={"export": storage.join(ctx.output_uri, "export"),
                              "checkpoints": storage.join(storage_path, name),
                              "train_rows": rows, "checkpoint": result.checkpoint.path if result.checkpoint else ""},
                       outputs=[f"export/{name}" for name in EXPORT_FILES])

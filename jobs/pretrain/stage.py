"""The `pretrain` stage, driver side: checks inputs and resources, then runs a Ray Train TorchTrainer whose workers
(loop.py) train with DeepSpeed.

Outputs in the stage folder: `export/` (model.safetensors + config.json + vocab.txt: what fine-tuning reads),
`metrics.json` and `deepspeed_config.json`. Checkpoints live in Ray Train's storage, by default
`<workdir>/ray_results/<run name>`: outside the output folder, which the workflow empties before a rerun, so
rerunning the stage after a crash continues from the latest checkpoint (Ray Train V2 resumes a run started again
with the same storage_path and name). The run name hashes the config, the seed and the inputs, so a changed
config starts a fresh run instead of resuming a foreign one.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import signal
import time
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from bertpipe.jobs.pretrain.checkpointing import export_card
from bertpipe.jobs.services.capacity import FIX, Need, ask_autoscaler, release_request, wait_for
from bertpipe.jobs.services.code_version import COMMIT_TAG, code_version
from bertpipe.jobs.services.configtools import stable_hash, to_dict
from bertpipe.jobs.services.interrupts import Interrupted
from bertpipe.jobs.pretrain import runs
from bertpipe.jobs.pretrain.init import describe_raw_inputs  # noqa: F401 - the stage's raw inputs: pretrain.init's files
from bertpipe.jobs.pretrain.checkpointing.export import EXPORT_FILES
from bertpipe.jobs.pretrain.checkpointing.folders import state_of, step_of, survey, take_stop_reason
from bertpipe.jobs.pretrain.config import ModelConfig, PretrainConfig, layout_warning
from bertpipe.jobs.pretrain.controller_env import controller_env
from bertpipe.jobs.pretrain.engine.deepspeed_config import deepspeed_config
from bertpipe.jobs.pretrain.metrics.rate import ProgressFigures
from bertpipe.jobs.pretrain.worker_spec import WorkerSpec
from bertpipe.jobs.services.tracking import MODEL_ALIAS, RunLogger, unwrap
from bertpipe.pipeline.formats.shards import TRAINING_COLUMNS
from bertpipe.pipeline.framework import storage
from bertpipe.pipeline.framework.console import Console
from bertpipe.pipeline.framework.paths import export_of
from bertpipe.pipeline.framework.stage import StageContext, StageInputError, StageResult

log = logging.getLogger("bertpipe.pretrain")


def resource_need(cfg: PretrainConfig) -> Need:
    """Trainer workers that take every CPU leave none for Ray Data's read tasks and the run hangs: one CPU stays
    free beside them."""
    return Need("pretrain", cfg.whole_batch_worlds()[0] if cfg.elastic else cfg.num_workers, cfg.cpus_per_worker,
                1.0 if cfg.use_gpu else 0.0)


def wait_for_capacity(cfg: PretrainConfig, wait_s: float, console: Console) -> None:
    """Until the cluster can hold the workers and a data CPU: at once, after nodes joined, or ValueError."""
    import ray

    waited = wait_for(resource_need(cfg), wait_s, ray.cluster_resources, lambda line: console.tell(line, log),
                      ask=ask_autoscaler)
    if waited:
        log.info("pretrain: started after waiting %.0f s for the cluster to grow", waited)
        release_request()


def resume_point(storage_path: str, run_name: str, cfg: PretrainConfig, console: Console) -> str | None:
    """The newest complete checkpoint of the run (the workers resume there), saying in one line when newer ones are
    incomplete."""
    resume, torn = survey(storage_path, run_name, cfg)
    if torn:
        console.tell(f"pretrain: the newest checkpoint is incomplete (a crash while saving: a rank's file missing or "
                     f"cut short: {torn[-1]}); resuming from "
                     + (f"the step-{step_of(resume)} checkpoint" if resume else "step 0"), log)
    return resume


def check_resources(cfg: PretrainConfig, cluster: dict[str, float]) -> None:
    """ValueError when a cluster of these totals cannot run the workers (the local Ray a run will start)."""
    missing = resource_need(cfg).shortfall(cluster)
    if missing:
        raise ValueError(f"{missing}; {FIX}")


def check_shard(uri: str, vocab_hash: str, max_seq_length: int) -> int:
    """Rows of one shard after checking it is readable, built with our vocabulary and for this length."""
    from bertpipe.pipeline.formats.shards import check_vocab, read_shard_meta

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
            missing = [c for c in TRAINING_COLUMNS if c not in pf.schema_arrow.names]
            num_rows = pf.metadata.num_rows
    except (OSError, pa.ArrowException) as exc:
        raise StageInputError(f"{uri} is not a readable Parquet shard: {exc}") from exc
    if missing:
        raise StageInputError(f"{uri} lacks the columns {missing}")
    return num_rows


def preflight(ctx: StageContext) -> None:
    """Before anything runs: explicit shards and vocabulary exist, carry this vocabulary and cover every phase."""
    from bertpipe.pipeline.formats.shards import list_shards
    from bertpipe.pipeline.formats.vocabulary import load_vocab, vocab_file, vocab_hash

    cfg = ctx.section(PretrainConfig)
    if ctx.local_ray_cpus:  # the local Ray this run will start: refuse a layout that would hang on it now
        check_resources(cfg, {"CPU": ctx.local_ray_cpus, "GPU": cfg.max_workers})
    vocab, pairs = ctx.input("vocab"), ctx.input("pairs")
    if not pairs.explicit and "pairs" in ctx.config:  # pairs runs before it in this workflow
        check_phase_lengths(cfg, ctx.config["pairs"].max_seq_lengths)
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
    if cfg.init:
        init_heads(ctx)


def check_phase_lengths(cfg: PretrainConfig, written: tuple[int, ...]) -> None:
    """Pre-training reads one shard set per phase: pairs must write (`written`: pairs.max_seq_lengths) every length a
    phase with steps trains at, or the run would fail only after clean, vocab and pairs ran."""
    wanted = [ph.max_seq_length for ph, steps in zip(cfg.phases, cfg.phase_steps()) if steps]
    lacking = [n for n in wanted if n not in written]
    if lacking:
        raise StageInputError(f"pretrain.phases train at max_seq_length {lacking} but pairs.max_seq_lengths is "
                              f"{list(written)}: add the length to pairs, or change the phases")


def init_heads(ctx: StageContext) -> list[str]:
    """pretrain.init's weights checked against the model (names, shapes; jobs/pretrain/init.py) and the heads they
    lack, by Hugging Face name."""
    from bertpipe.jobs.pretrain.init import missing_heads
    from bertpipe.pipeline.formats.vocabulary import load_vocab, vocab_file

    cfg = ctx.section(PretrainConfig)
    return missing_heads(cfg.init, ctx.section(ModelConfig), len(load_vocab(vocab_file(ctx.input("vocab").uri))))


def run_identity(ctx: StageContext) -> dict[str, Any]:
    ids = {n: (i.manifest or {}).get("output_id", i.uri) for n, i in sorted(ctx.inputs.items())}
    return runs.identity(ctx.config, ctx.seed, ids)


def run_name(ctx: StageContext, cfg: PretrainConfig, storage_path: str) -> str:
    """The run folder this stage trains in: its identity's (jobs/pretrain/runs.py), or `pretrain.run_name`."""
    if cfg.run_name:
        return cfg.run_name
    return runs.choose_name(runs.base_name(run_identity(ctx)), runs.run_folders(storage_path),
                                cfg.restart)


def start_record(ctx: StageContext, cfg: PretrainConfig, storage_path: str, name: str, resume: str | None,
                 rows: dict[str, int]) -> dict[str, Any]:
    """What training starts from: a checkpoint (its step, where it is, its layout and this one, what carries over:
    resume_plan), or step 0 and why; and, either way, the weights the run started from (pretrain.init or random).
    The one record of it: the console line, MLflow's tags, the run folder's identity record and the stage's manifest
    (`bertpipe status`) all show this. Refuses a checkpoint this layout cannot load (runs.check_layout)."""
    from bertpipe.jobs.pretrain.checkpointing.resume import position_of, resume_plan

    now = runs.layout_of(cfg.max_workers, [p.micro_batch_size for p in cfg.phases], cfg.zero_stage,
                         cfg.num_workers if cfg.elastic else None)
    record: dict[str, Any] = {"at": time.time(), "started_from": f"the weights of {cfg.init}" if cfg.init
                              else "random initialisation", "layout_now": now}
    if resume:
        state = state_of(resume)  # a complete checkpoint (survey): its position.json was read whole
        then, step = state.get("layout"), int(state["step"])
        runs.check_layout(then, now, step)
        goes_on = resume_plan(position_of(state, then or now), then, now, cfg, rows)
        return {**record, "resumed_from_step": step, "checkpoint": resume, "layout_then": then,
                "carries": goes_on.carries, "left_out": goes_on.left_out, "repartitioned": goes_on.repartition}
    previous = runs.previous_run(storage_path, name)
    changed = runs.changes(previous[1], run_identity(ctx)) if previous else []
    why = ("pretrain.restart" if cfg.restart else
           f"{'; '.join(changed[:4])}{' ...' if len(changed) > 4 else ''} since run {previous[0]}" if changed
           else "no checkpoint of these settings yet")
    return {**record, "resumed_from_step": 0, "why": why}


def start_tags(record: dict[str, Any]) -> dict[str, str]:
    """The start record as the stage run's MLflow tags."""
    tags = {"bertpipe.started_from": record["started_from"],
            "bertpipe.layout": runs.describe_layout(record["layout_now"])}
    if record.get("checkpoint"):
        tags.update({"bertpipe.resumed_from_step": str(record["resumed_from_step"]),
                     "bertpipe.resumed_from_checkpoint": record["checkpoint"],
                     "bertpipe.resumed_layout": runs.describe_layout(record.get("layout_then")),
                     "bertpipe.resume_carries": record["carries"]})
    else:
        tags["bertpipe.restarted_because"] = record["why"]
    return tags


def announce_start(ctx: StageContext, cfg: PretrainConfig, storage_path: str, name: str, resume: str | None,
                   run: RunLogger, rows: dict[str, int] | None = None) -> dict[str, Any]:
    """One line on what training starts from (start_record), the same in MLflow's tags and the run folder's
    identity record; returns the record (the stage's manifest keeps it too)."""
    record = start_record(ctx, cfg, storage_path, name, resume, rows or {})
    ctx.console.tell(runs.describe_start(record), log)
    run.set_tags(start_tags(record))
    runs.record(storage_path, name, run_identity(ctx), start=record)
    return record


def _datasets(pairs_uri: str, spec: WorkerSpec) -> tuple[dict[str, Any], WorkerSpec]:
    """The training datasets for Ray Train ({"train_128": dataset, ...}), after checking every shard, and the spec
    with every shard's rows ({"train_128": rows, "heldout_128": rows, ...}) and the held-out shards ({128: uri, ...}:
    the workers read them themselves, heldout.py)."""
    import hashlib

    from bertpipe.pipeline.framework.ray_reads import read_parquet
    from bertpipe.pipeline.formats.shards import list_shards

    cfg = spec.pretrain
    # The vocabulary's identity from the bytes the workers get (pipeline.formats.vocabulary.vocab_hash, without a
    # second read).
    vocab_hash = hashlib.sha256(spec.vocab_bytes).hexdigest()
    datasets, rows, heldouts, shards = {}, {}, {}, {}
    for phase, steps in zip(cfg.phases, cfg.phase_steps()):
        L = phase.max_seq_length
        train, heldout = list_shards(pairs_uri, L)
        rows[f"train_{L}"] = sum(check_shard(u, vocab_hash, L) for u in train)
        rows[f"heldout_{L}"] = check_shard(heldout, vocab_hash, L)
        per_worker = rows[f"train_{L}"] // cfg.max_workers
        if steps and per_worker < phase.micro_batch_size:
            raise ValueError(f"{rows[f'train_{L}']} training rows at seq {L} are too few for {cfg.max_workers} "
                             f"workers × micro_batch_size {phase.micro_batch_size}")
        if rows[f"heldout_{L}"] < cfg.max_workers:
            raise StageInputError(f"held-out shard {heldout} has {rows[f'heldout_{L}']} rows, fewer than the "
                                  f"{cfg.max_workers} workers")
        if cfg.elastic:  # the workers read the shards themselves, in the order every worker count shares
            shards[L] = train
        else:
            datasets[f"train_{L}"] = read_parquet(train, TRAINING_COLUMNS)
        heldouts[L] = heldout
    return datasets, dataclasses.replace(spec, rows=rows, heldout=heldouts, train_shards=shards)


def workers_text(cfg: PretrainConfig) -> str:
    return f"{cfg.min_workers}-{cfg.max_workers}" if cfg.elastic else str(cfg.num_workers)


def worker_spec(ctx: StageContext, cfg: PretrainConfig, storage_path: str, name: str) -> WorkerSpec:
    from bertpipe.pipeline.formats.vocabulary import load_vocab, vocab_file

    vocab_uri = vocab_file(ctx.input("vocab").uri)
    tokens = load_vocab(vocab_uri)  # validated: special tokens present, no duplicates
    init_config = json.loads(storage.read_bytes(storage.join(cfg.init, "config.json"))) if cfg.init else {}
    return WorkerSpec(pretrain=cfg, model=ctx.section(ModelConfig), seed=ctx.seed, vocab_tokens=tokens,
                      vocab_bytes=storage.read_bytes(vocab_uri), tracking=dict(ctx.tracking),
                      export_uri=export_of(ctx.output_uri), storage_path=storage_path, run_name=name,
                      init=cfg.init, init_config=init_config)


def trainer(spec: WorkerSpec, datasets: dict[str, Any]):
    import ray.train
    from ray.data import ExecutionOptions

    from bertpipe.jobs.pretrain.attempt_clock import AttemptClock
    from bertpipe.jobs.pretrain.elastic import ElasticTorchTrainer
    from bertpipe.jobs.pretrain.failed_start import FixedTorchTrainer
    from bertpipe.jobs.pretrain.loop import train_loop_per_worker
    from bertpipe.jobs.pretrain.warm_start.runtime_env import worker_runtime_env

    cfg = spec.pretrain
    kind = (functools.partial(ElasticTorchTrainer, worlds=cfg.whole_batch_worlds(), last_step=cfg.max_steps)
            if cfg.elastic else FixedTorchTrainer)
    return kind(
        train_loop_per_worker, train_loop_config={"spec": spec},
        scaling_config=ray.train.ScalingConfig(num_workers=cfg.num_workers, use_gpu=cfg.use_gpu,
                                               resources_per_worker={"CPU": cfg.cpus_per_worker},
                                               elastic_resize_monitor_interval_s=cfg.elastic_resize_check_s),
        run_config=ray.train.RunConfig(
            name=spec.run_name, storage_path=spec.storage_path,
            failure_config=ray.train.FailureConfig(max_failures=cfg.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=cfg.num_checkpoints_to_keep),
            callbacks=[AttemptClock()],  # when each attempt started, for its restart's breakdown
            worker_runtime_env=worker_runtime_env(cfg.warm_worker_start, ray.get_runtime_context().runtime_env)),
        datasets=datasets,
        # preserve_order makes the streaming split deterministic (which rows reach which worker, in which
        # order): the precondition for resuming by skipping a known number of batches.
        dataset_config=ray.train.DataConfig(execution_options=ExecutionOptions(preserve_order=True)))


def fit(spec: WorkerSpec, datasets: dict[str, Any]):
    """Ray Train's run of the workers, with the controller settings of controller_env.py; its Result."""
    with controller_env(spec.pretrain):
        return trainer(spec, datasets).fit()


MODEL_DESCRIPTION = unwrap(f"""
BERT pre-trained by bertpipe (masked LM + next-sentence prediction) on Wikipedia text. One version per
pre-training: its description says what it reached on held-out data, its tags name the config (`config`,
`config_hash`), the training data (`data`: the pairs stage's output id) and the code (`git_commit`). The alias
`{MODEL_ALIAS}` is the latest version.

Load it without bertpipe (needs torch, transformers, safetensors):
`mlflow.pyfunc.load_model("models:/<name>@{MODEL_ALIAS}")`. The model is code plus weights, no pickle. `predict`
takes a DataFrame with a column `input_ids` (WordPiece ids of `[CLS] … [SEP]`; the vocabulary is `vocab.txt`
beside the weights) and returns float32 [rows, hidden_size]: each row's final hidden state of `[CLS]`. The Hugging
Face folder (config.json, model.safetensors, vocab.txt) is the model's artifact `artifacts/export`.
""")
# The pre-training figures that are one value per run: the stage run's summary in MLflow (the series are logged by
# the workers under jobs/services/tracking.py's names).
SUMMARY = ("baseline_mlm_accuracy", "baseline_nsp_accuracy", "nsp_overlap_rule_accuracy", "eval_mlm_over_baseline",
           "eval_nsp_over_baseline")


def model_card(ctx: StageContext, metrics: dict[str, float], run: RunLogger) -> tuple[str, dict[str, str]]:
    """(description, tags) of the registered model version made by this pre-training: what it reached on the
    held-out data first (the versions table shows the description's start), then which config, data and code."""
    tags, parent = run.tags(), run.parent_tags()
    inputs = {name: ((i.manifest or {}).get("output_id") or i.uri) for name, i in ctx.inputs.items()}
    out = {"config": parent.get("bertpipe.config", ""),
           "config_hash": stable_hash({"config": {k: to_dict(v) for k, v in ctx.config.items()},
                                       "seed": ctx.seed})[:12],
           "data": inputs.get("pairs", ""), "vocab": inputs.get("vocab", ""),
           "steps": str(int(metrics.get("step", 0)))}
    if tags.get(COMMIT_TAG, "unknown") != "unknown":  # a git checkout
        out["git_commit"] = code_version(tags)
    out = {k: v for k, v in out.items() if v}
    figures = [f"{what} {metrics[f'eval_{task}_accuracy']:.3f}"
               + (f" (baseline {metrics[f'baseline_{task}_accuracy']:.3f})"
                  if f"baseline_{task}_accuracy" in metrics else "")
               for task, what in (("mlm", "MLM accuracy"), ("nsp", "NSP accuracy"))
               if f"eval_{task}_accuracy" in metrics]
    cfg = ctx.section(PretrainConfig)
    lengths = [p.max_seq_length for p, n in zip(cfg.phases, cfg.phase_steps()) if n]
    text = ("Held-out " + ", ".join(figures) + ". " if figures else "") + (
        f"{ctx.section(ModelConfig).preset} BERT{f' continued from {cfg.init}' if cfg.init else ''}, {out['steps']} "
        f"optimizer steps at seq "
        f"{' then '.join(map(str, lengths))}, on pairs output `{out.get('data', '')}`")
    if parent.get("mlflow.runName"):
        text += f", by workflow run `{parent['mlflow.runName']}`"
    return text + ".", out


def log_summary(run: RunLogger, metrics: dict[str, float]) -> None:
    """The run's one-value figures, at step 0 (the workers logged the series). The manifest's names are not
    MLflow's, so the stage hands the workflow mlflow_summary={}: it adds only its own (rows, bytes, seconds)."""
    run.log_metrics({**{k: metrics[k] for k in SUMMARY if k in metrics},
                     "heldout_sequences": metrics.get("eval_sequences")})
    if metrics.get("resumed_from_step"):
        run.set_tag("bertpipe.resumed_from_step", str(int(metrics["resumed_from_step"])))


def register(run: RunLogger, export_uri: str, registered_name: str, version_description: str = "",
             version_tags: dict[str, str] | None = None) -> str:
    """The exported model as an MLflow model of the stage's run (its safetensors, config and vocabulary, loaded by
    code: jobs/services/pyfunc_model.py), registered under `registered_name` with MODEL_DESCRIPTION, the version's
    description and tags (model_card), and the alias MODEL_ALIAS on the new version."""
    if not (run.active and registered_name):
        return ""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        for name in EXPORT_FILES:
            storage.write_bytes(f"{tmp}/export/{name}", storage.read_bytes(storage.join(export_uri, name)))
        hidden = json.loads(storage.read_text(f"{tmp}/export/config.json"))["hidden_size"]
        return run.log_export(f"{tmp}/export", registered_name, hidden, MODEL_DESCRIPTION, version_description,
                              version_tags)


def final_baselines(ctx: StageContext, cfg: PretrainConfig, tokens: list[str]) -> dict:
    """The trivial predictors' held-out accuracy at the final evaluation's length (the phase it reads), with the
    plotting library loaded: run on the driver while the workers train, so that the stage's tail is short."""
    from bertpipe.jobs.pretrain.learning.baselines import baselines
    from bertpipe.jobs.pretrain.learning.curves import warm_plotting
    from bertpipe.jobs.pretrain.data.masking import MaskingSpec
    from bertpipe.pipeline.formats.shards import list_shards

    final_phase = cfg.phases[cfg.final_phase()]
    train, heldout = list_shards(ctx.input("pairs").uri, final_phase.max_seq_length)
    spec = MaskingSpec.from_vocab(tokens, max_seq_length=final_phase.max_seq_length,
                                  max_predictions=final_phase.max_predictions_per_seq)
    base = baselines(train, heldout, spec)
    base["baseline_mlm_token"] = tokens[int(base["baseline_mlm_token_id"])]
    warm_plotting()
    return base


def write_learning(ctx: StageContext, base: dict, history: list[dict],
                   run: RunLogger) -> tuple[dict[str, float], list[str]]:
    """The baselines of the final held-out evaluation (`final_baselines`), and the loss/accuracy curves, written
    beside the export and logged to MLflow; returns the baselines and the files written (relative to the stage
    folder)."""
    from bertpipe.jobs.pretrain.learning.curves import curve_pngs

    files = {"baselines.json": json.dumps(base, indent=2).encode(),
             "history.json": json.dumps(history, indent=1).encode(), **curve_pngs(history, base)}
    for name, blob in files.items():
        storage.write_bytes(storage.join(ctx.output_uri, name), blob)
        run.log_bytes(blob, name, "learning")
    return {k: v for k, v in base.items() if isinstance(v, float)}, sorted(files)


def final_metrics(ctx: StageContext, result: Any, baselines: dict, run: RunLogger) -> tuple[dict, list[str]]:
    """The workers' final figures with the baselines and how far above them the held-out accuracies are; the
    learning files written."""
    metrics = {k: float(v) for k, v in (result.metrics or {}).items() if isinstance(v, (int, float))}
    with ctx.console.doing("pretrain: baselines and learning curves"):
        base, learning_files = write_learning(ctx, baselines, (result.metrics or {}).get("history", []), run)
    metrics.update(base)
    for task in ("mlm", "nsp"):  # how far above the trivial predictor the held-out accuracy is
        baseline = metrics.get(f"baseline_{task}_accuracy")
        if baseline and f"eval_{task}_accuracy" in metrics:
            metrics[f"eval_{task}_over_baseline"] = metrics[f"eval_{task}_accuracy"] / baseline
    return metrics, learning_files


def attempt_watch(cfg: PretrainConfig, run: RunLogger):
    from bertpipe.jobs.pretrain.attempts import AttemptWatch  # Ray Train: imported when the stage runs

    return AttemptWatch(cfg.max_failures, run)


def raise_if_stopped(storage_path: str, run_name: str) -> None:
    """NonFiniteError when the workers stopped the run because the loss or gradient norm stopped being finite."""
    stopped = take_stop_reason(storage_path, run_name)
    if stopped:
        from bertpipe.jobs.pretrain.metrics.meter import NonFiniteError  # torch: imported when the stage runs

        raise NonFiniteError(stopped)


def run_stage(ctx: StageContext) -> StageResult:
    import concurrent.futures

    started = time.time()
    cfg = ctx.section(PretrainConfig)
    wait_for_capacity(cfg, ctx.wait_for_resources_s, ctx.console)
    if layout_warning(cfg):
        log.warning("%s", layout_warning(cfg))
    storage_path = cfg.storage_path or ctx.paths.ray_results
    spec = worker_spec(ctx, cfg, storage_path, run_name(ctx, cfg, storage_path))
    if cfg.init:  # what the checkpoint lacks, in one line (the workers load it before DeepSpeed wraps the model)
        from bertpipe.jobs.pretrain.init import heads_line

        ctx.console.tell(heads_line(cfg.init, init_heads(ctx)), log)
    datasets, spec = _datasets(ctx.input("pairs").uri, spec)
    ds_json = deepspeed_config(cfg, cfg.phases[0], cfg.whole_batch_worlds()[-1] if cfg.elastic else cfg.num_workers)
    storage.write_text_atomic(storage.join(ctx.output_uri, "deepspeed_config.json"),
                              json.dumps(ds_json, indent=2, sort_keys=True))
    run = RunLogger(ctx.tracking)
    run.log_params(ctx.config, skip_logged=True)
    run.log_dict(ds_json, "deepspeed_config.json")
    resume = resume_point(storage_path, spec.run_name, cfg, ctx.console)
    start = announce_start(ctx, cfg, storage_path, spec.run_name, resume, run, spec.rows)
    if cfg.elastic:
        from bertpipe.jobs.pretrain.elastic import worlds_line

        ctx.console.tell(worlds_line(cfg), log)
    log.info("pretrain: %s workers, ZeRO %d, %s steps, storage %s/%s%s", workers_text(cfg), cfg.zero_stage,
             list(cfg.phase_steps()), storage_path, spec.run_name, f", resuming from {resume}" if resume else "")
    watch = attempt_watch(cfg, run)
    with ctx.console.remote_progress("pretrain", cfg.max_steps, "steps", ProgressFigures(cfg), watch=watch) \
            as progress, \
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="baselines") as driver_side:
        progress.set(0, doing=f"starting {workers_text(cfg)} Ray Train workers")
        early_baselines = driver_side.submit(final_baselines, ctx, cfg, spec.vocab_tokens)
        try:
            result = fit(dataclasses.replace(spec, progress=progress), datasets)
        except SystemExit as exc:
            # Ray Train's controller answers Ctrl-C by aborting the run and sys.exit(0): a user's interrupt, and
            # the CLI must end it as one (exit 130, MLflow runs KILLED), not as a success.
            raise Interrupted(signal.SIGINT) from exc
    for line in watch.held_back():  # a restart in the last seconds of training: the cluster named no cause in time
        ctx.console.tell(f"pretrain: {line}", log)
    raise_if_stopped(storage_path, spec.run_name)
    tail = time.perf_counter()
    metrics, learning_files = final_metrics(ctx, result, early_baselines.result(), run)
    metrics["seconds"] = time.time() - started
    storage.write_text_atomic(storage.join(ctx.output_uri, "metrics.json"), json.dumps(metrics, indent=2))
    learning_files += export_card.write(ctx, metrics, run)  # the export's README.md and tokenizer.json: Hub-ready
    registered = ctx.tracking.get("registered_model", "")
    with ctx.console.doing(f"pretrain: registering the model in MLflow as {registered}"):
        model_uri = register(run, spec.export_uri, registered,
                             *(model_card(ctx, metrics, run) if run.active and registered else ()))
    log.info("pretrain: %.1f s after training (baselines, curves, registration)", time.perf_counter() - tail)
    log_summary(run, metrics)
    return StageResult(num_rows=int(metrics.get("step", 0)), metrics=metrics, mlflow_summary={},
                       extra={"export": spec.export_uri, "checkpoints": storage.join(storage_path, spec.run_name),
                              "mlflow_model": model_uri, "train_rows": spec.rows, "start": start,
                              "checkpoint": result.checkpoint.path if result.checkpoint else ""},
                       outputs=[*(f"export/{name}" for name in EXPORT_FILES), *learning_files])


# The workflow run's headline figures from pre-training: {manifest metric: MLflow name}, one value each.
HEADLINE = {n: f"pretrain/{n}" for n in ("loss", "eval_mlm_accuracy", "eval_nsp_accuracy", "baseline_mlm_accuracy",
                                        "baseline_nsp_accuracy")}


def headline_metrics(manifest_metrics: dict[str, Any]) -> dict[str, float]:
    """Pre-training's final loss, held-out accuracies and their baselines, under the workflow run's names."""
    return {name: manifest_metrics[n] for n, name in HEADLINE.items()
            if isinstance(manifest_metrics.get(n), (int, float))}


def latest_start(ctx: StageContext, manifest: dict[str, Any] | None) -> dict[str, Any] | None:
    """What pre-training resumed from (step, checkpoint, layout then and now) or started from (pretrain.init or
    random), as start_record wrote it: the committed run's (its manifest), or a later start's (its run folder's
    identity record: a run in progress, or one that failed)."""
    cfg = ctx.section(PretrainConfig)
    committed = ((manifest or {}).get("extra") or {}).get("start")
    try:
        later = runs.latest_start(cfg.storage_path or ctx.paths.ray_results, cfg.run_name)
    except (OSError, ValueError):
        later = None
    found = [r for r in (committed, later) if isinstance(r, dict) and "started_from" in r]
    return max(found, key=lambda r: r.get("at", 0.0)) if found else None

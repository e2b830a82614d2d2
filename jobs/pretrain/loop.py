"""The per-worker training function of pre-training (runs inside each Ray Train worker).

One DeepSpeed engine per worker trains through the phases (seq 128, then 512) on its share of the shards
(`ray.train.get_dataset_shard`, streamed, order preserved so the split is deterministic), masking each batch
on the fly. The position in the data is (phase, epoch, batch index): a checkpoint stores it, and a resumed
worker re-reads the epoch and drops the batches it had already consumed without collating them — with
per-batch mask generators and a per-batch dropout seed the resumed run computes exactly what an
uninterrupted run computes.
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from bertpipe.jobs.pretrain.deepspeed_config import deepspeed_config
from bertpipe.jobs.pretrain.length_binning import length_binned
from bertpipe.jobs.pretrain.masking import MaskingSpec, batch_rng, collate
from bertpipe.jobs.pretrain.config import ModelConfig, PretrainConfig
from bertpipe.jobs.pretrain.optim import make_optimizer, make_scheduler, param_groups

log = logging.getLogger("bertpipe.pretrain")
CKPT_TAG = "ckpt"
STATE_FILE = "position.json"  # beside DeepSpeed's files: where in the data the checkpoint was taken


def _seed_of(*parts: int) -> int:
    return int(np.random.SeedSequence(list(parts)).generate_state(1)[0])


def build_model(model_cfg: ModelConfig, vocab_size: int, seed: int):
    from bertpipe.model import BertConfig, BertForPreTraining

    bert_cfg = BertConfig.preset(model_cfg.preset, vocab_size=vocab_size,
                                 activation_checkpointing=model_cfg.activation_checkpointing,
                                 hidden_dropout_prob=model_cfg.hidden_dropout_prob,
                                 attention_probs_dropout_prob=model_cfg.attention_probs_dropout_prob)
    torch.manual_seed(seed)  # identical initial weights on every rank (ZeRO-3 partitions each rank's copy)
    return BertForPreTraining(bert_cfg)


class _Tracker:
    """MLflow from rank 0 only; a no-op without coordinates."""

    def __init__(self, tracking: dict[str, str], rank: int):
        self.client = None
        if rank == 0 and tracking.get("tracking_uri") and tracking.get("run_id"):
            from mlflow.tracking import MlflowClient

            self.client = MlflowClient(tracking["tracking_uri"])
            self.run_id = tracking["run_id"]

    def metrics(self, values: dict[str, float], step: int) -> None:
        if self.client is None:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in values.items()])

    def artifacts(self, local_dir: str, path: str) -> None:
        if self.client is not None:
            self.client.log_artifacts(self.run_id, local_dir, path)


def _all_sum(values: list[float], device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def _forward(engine, batch: dict[str, torch.Tensor], device):
    b = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    return engine(b["input_ids"], b["token_type_ids"], b["attention_mask"], b["masked_positions"],
                  b["masked_lm_labels"], b["next_sentence_label"])


def evaluate(engine, shard, spec: MaskingSpec, cfg: PretrainConfig, seed: int, rank: int, device) -> dict:
    """Held-out MLM/NSP accuracy with a fixed masking seed, summed over all workers (every rank runs the same
    number of forwards: ZeRO-3 gathers parameters collectively)."""
    engine.eval()
    sums = [0.0] * 5  # mlm_correct, mlm_count, nsp_correct, nsp_count, mlm_loss × count
    with torch.no_grad():
        it = shard.iter_batches(batch_size=32, batch_format="numpy", drop_last=False, prefetch_batches=2)
        for i, raw in enumerate(it):
            if i >= cfg.eval_max_batches:
                break
            out = _forward(engine, collate(raw, spec, batch_rng(seed, 99, 0, rank, i)), device)
            n = len(raw["next_sentence_label"])
            sums = [sums[0] + out.mlm_correct.item(), sums[1] + out.mlm_count.item(),
                    sums[2] + out.nsp_correct.item(), sums[3] + n, sums[4] + out.mlm_loss.item() * out.mlm_count.item()]
    engine.train()
    c, n, nc, nn_, loss = _all_sum(sums, device)
    return {"eval_mlm_accuracy": c / max(n, 1), "eval_nsp_accuracy": nc / max(nn_, 1),
            "eval_mlm_loss": loss / max(n, 1), "eval_sequences": nn_}


def _save_and_report(engine, position: dict, metrics: dict) -> None:
    import ray.train

    with tempfile.TemporaryDirectory() as d:
        engine.save_checkpoint(d, tag=CKPT_TAG)
        with open(os.path.join(d, STATE_FILE), "w") as f:
            json.dump(position, f)
        # Every rank reports its own files (ZeRO shards differ per rank); Ray merges them into one checkpoint.
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d))


def train_loop_per_worker(config: dict[str, Any]) -> None:
    import deepspeed
    import ray.train
    import ray.train.torch

    cfg: PretrainConfig = config["pretrain"]
    seed: int = config["seed"]
    tokens: list[str] = config["vocab_tokens"]
    rctx = ray.train.get_context()
    rank, world = rctx.get_world_rank(), rctx.get_world_size()
    torch.set_num_threads(cfg.cpus_per_worker)
    device = ray.train.torch.get_device()
    tracker = _Tracker(config.get("tracking") or {}, rank)

    model = build_model(config["model"], len(tokens), seed)
    steps = cfg.phase_steps()
    ds_cfg = deepspeed_config(cfg, cfg.phases[0], world)
    if cfg.optimizer_impl == "torch":
        optimizer, params = make_optimizer(cfg, model), None
    else:
        optimizer, params = None, param_groups(model, cfg.weight_decay)
    engine, _, _, scheduler = deepspeed.initialize(
        model=model, optimizer=optimizer, model_parameters=params, config=ds_cfg, dist_init_required=False,
        lr_scheduler=lambda opt: make_scheduler(cfg, opt))

    position = {"step": 0, "phase": 0, "epoch": 0, "batch": 0}
    # Ray Train's own (a retry, or a rerun it has a snapshot for) first. Else scan the run folder: a rerun after a
    # crash, or a retry that starts before the controller registered the last reported checkpoint (seen when a
    # worker dies right after reporting) still finds it there. Rank 0 decides so that every rank loads the same.
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        from bertpipe.jobs.pretrain.stage import latest_checkpoint

        found = [latest_checkpoint(config["storage_path"], config["run_name"], cfg) if rank == 0 else None]
        dist.broadcast_object_list(found, src=0)
        if found[0]:
            checkpoint = ray.train.Checkpoint(found[0])
    if checkpoint:
        with checkpoint.as_directory() as d:
            engine.load_checkpoint(d, tag=CKPT_TAG, load_optimizer_states=True, load_lr_scheduler_states=True)
            with open(os.path.join(d, STATE_FILE)) as f:
                position = json.load(f)
        log.info("rank %d resumed at %s", rank, position)
    step = position["step"]
    resumed_from = step
    assert engine.global_steps == step, (engine.global_steps, step)

    last_metrics: dict[str, float] = {}
    for phase_index, (phase, num_steps) in enumerate(zip(cfg.phases, steps)):
        phase_end = sum(steps[: phase_index + 1])
        if step >= phase_end or num_steps == 0:
            continue
        if phase_index != position["phase"]:
            position = {"step": step, "phase": phase_index, "epoch": 0, "batch": 0}
        L = phase.max_seq_length
        engine.set_train_micro_batch_size(phase.micro_batch_size)
        engine.set_train_batch_size(phase.global_batch_size)
        # DeepSpeed finds accumulation boundaries by micro_steps % accumulation steps; a phase (and a resume)
        # always starts on a boundary, so restart the count where the accumulation steps may change.
        engine.micro_steps = 0
        spec = MaskingSpec.from_vocab(tokens, max_seq_length=L, max_predictions=phase.max_predictions_per_seq,
                                      masked_lm_prob=cfg.masked_lm_prob, whole_word=cfg.whole_word_masking)
        train_shard = ray.train.get_dataset_shard(f"train_{L}")
        eval_shard = ray.train.get_dataset_shard(f"heldout_{L}")
        window = dict(t0=time.perf_counter(), wait=0.0, seqs=0.0, tokens=0.0, slots=0.0, sums=[0.0] * 8)
        while step < phase_end:
            epoch, skip = position["epoch"], position["batch"]
            batches = train_shard.iter_batches(
                batch_size=phase.micro_batch_size, batch_format="numpy", drop_last=True,
                prefetch_batches=cfg.prefetch_batches, local_shuffle_buffer_size=cfg.shuffle_buffer_rows or None,
                local_shuffle_seed=_seed_of(seed, phase_index, epoch, rank))
            it = length_binned(batches, cfg.length_bin_window,
                               np.random.default_rng(_seed_of(seed, phase_index, epoch, rank, 2)))
            batch_index, seen = 0, 0
            while step < phase_end:
                t_wait = time.perf_counter()
                raw = next(it, None)
                if raw is None:
                    break
                seen += 1
                if batch_index < skip:  # consumed before the checkpoint we resumed from
                    batch_index += 1
                    continue
                batch = collate(raw, spec, batch_rng(seed, phase_index, epoch, rank, batch_index))
                window["wait"] += time.perf_counter() - t_wait
                torch.manual_seed(_seed_of(seed, phase_index, epoch, rank, batch_index, 1))  # dropout
                out = _forward(engine, batch, device)
                engine.backward(out.loss)
                engine.step()
                batch_index += 1
                s = window["sums"]
                n_seq = batch["input_ids"].shape[0]
                for i, v in enumerate((out.loss.item(), out.mlm_loss.item(), out.nsp_loss.item(),
                                       out.mlm_correct.item(), out.mlm_count.item(), out.nsp_correct.item(),
                                       n_seq, 1)):
                    s[i] += v
                window["seqs"] += n_seq
                window["tokens"] += float(batch["attention_mask"].sum())
                window["slots"] += float(batch["attention_mask"].numel())  # real + padding
                if engine.global_steps == step:
                    continue  # inside a gradient accumulation
                step = engine.global_steps
                position = {"step": step, "phase": phase_index, "epoch": epoch, "batch": batch_index}
                if cfg.fail_at_step and step == cfg.fail_at_step and rank == min(1, world - 1):
                    marker = config["fail_marker"]
                    if not os.path.exists(marker):
                        open(marker, "w").close()
                        os._exit(1)  # simulated worker crash (test hook), only on the first attempt
                last_metrics = _maybe_log(engine, scheduler, cfg, window, step, phase_end, L, device, tracker) or last_metrics
                if cfg.eval_every_steps and step % cfg.eval_every_steps == 0 and step < cfg.max_steps:
                    ev = evaluate(engine, eval_shard, spec, cfg, seed, rank, device)
                    tracker.metrics(ev, step)
                if step % cfg.checkpoint_every_steps == 0 and step < cfg.max_steps:
                    _save_and_report(engine, position, {"step": step, **last_metrics})
                    window["t0"] = time.perf_counter()  # keep checkpoint time out of throughput
            if seen == 0:
                raise ValueError(f"worker {rank} got no batch of {phase.micro_batch_size} rows at seq {L}: "
                                 "too few training rows for num_workers × micro_batch_size")
            if step < phase_end:
                position = {"step": step, "phase": phase_index, "epoch": epoch + 1, "batch": 0}

    # resumed_from_step: where this attempt started — a test reads it to prove no progress was lost.
    final = {"step": step, "resumed_from_step": resumed_from, **last_metrics}
    last = cfg.phases[-1] if steps[-1] else cfg.phases[0]
    last_L = last.max_seq_length
    last_spec = MaskingSpec.from_vocab(tokens, max_seq_length=last_L, max_predictions=last.max_predictions_per_seq)
    final.update(evaluate(engine, ray.train.get_dataset_shard(f"heldout_{last_L}"), last_spec, cfg, seed, rank,
                          device))
    tracker.metrics({k: v for k, v in final.items() if k.startswith("eval_")}, step)
    _export(engine, config, cfg, rank, tracker)
    _save_and_report(engine, position, final)


def _maybe_log(engine, scheduler, cfg, window, step, phase_end, L, device, tracker) -> dict[str, float]:
    if step % cfg.log_every_steps and step != phase_end:
        return {}
    loss, mlm, nsp, correct, count, nsp_correct, n_seq, n_micro = _all_sum(window["sums"], device)
    seqs, toks, slots, wait = _all_sum([window["seqs"], window["tokens"], window["slots"], window["wait"]], device)
    elapsed = max(time.perf_counter() - window["t0"], 1e-9)
    world = dist.get_world_size()
    grad_norm = engine.get_global_grad_norm()
    metrics = {
        "loss": loss / n_micro, "mlm_loss": mlm / n_micro, "nsp_loss": nsp / n_micro,
        "mlm_accuracy": correct / max(count, 1), "nsp_accuracy": nsp_correct / max(n_seq, 1),
        "lr": scheduler.get_last_lr()[0], "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
        "sequences_per_second": seqs / elapsed, "tokens_per_second": toks / elapsed,
        "data_wait_fraction": wait / world / elapsed, "padding_fraction": 1.0 - toks / max(slots, 1.0),
        "seq_length": L,
    }
    tracker.metrics(metrics, step)
    if dist.get_rank() == 0:
        log.info("step %d seq %d loss %.4f mlm_acc %.3f nsp_acc %.3f lr %.2e %.1f seq/s wait %.1f%%", step, L,
                 metrics["loss"], metrics["mlm_accuracy"], metrics["nsp_accuracy"], metrics["lr"],
                 metrics["sequences_per_second"], 100 * metrics["data_wait_fraction"])
    window.update(t0=time.perf_counter(), wait=0.0, seqs=0.0, tokens=0.0, slots=0.0, sums=[0.0] * 8)
    return metrics


def _export(engine, config: dict, cfg: PretrainConfig, rank: int, tracker: _Tracker) -> None:
    """HF-layout export (model.safetensors + config.json + vocab.txt) to <output>/export from rank 0. Under
    ZeRO-3 every rank takes part in gathering the full parameters."""
    import deepspeed
    import pyarrow.fs as pafs

    from bertpipe.model import save_pretrained
    from bertpipe.pipeline import storage

    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None,
                                           enabled=cfg.zero_stage == 3):
        if rank == 0:
            with tempfile.TemporaryDirectory() as d:
                vocab_path = os.path.join(d, "vocab-source.txt")
                with open(vocab_path, "wb") as f:
                    f.write(config["vocab_bytes"])
                export_dir = os.path.join(d, "export")
                save_pretrained(engine.module, export_dir, vocab_path)
                fs, path = storage.resolve(config["export_uri"])
                fs.create_dir(path, recursive=True)
                pafs.copy_files(export_dir, path, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)
                tracker.artifacts(export_dir, "export")
    if dist.is_initialized():
        dist.barrier()

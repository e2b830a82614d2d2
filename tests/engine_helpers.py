"""A pre-training worker without Ray: one process, torch.distributed over gloo with world size 1, the DeepSpeed
engine that `engine.build_engine` builds, and shard rows from pretrain_helpers. For the CPU tests of the step path
(host reads, the non-finite stop, compile) and benchmarks/bench_step_profile.py."""
from __future__ import annotations

import dataclasses
import os
from contextlib import contextmanager

import numpy as np
import torch

import pretrain_helpers as h
from ports import free_port_block


@contextmanager
def process_group():
    """A one-rank gloo process group, made once per process and kept: DeepSpeed caches its groups, so a second
    default group in the same process would meet stale ones."""
    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port_block(1)), RANK="0",
                          LOCAL_RANK="0", WORLD_SIZE="1")
        dist.init_process_group("gloo", rank=0, world_size=1)
    yield


def worker(cfg, *, model=None, precision: str = "fp32", vocab=h.TOKENS, seed: int = 7):
    """A worker.Worker on the CPU with the engine of `cfg`; precision "bf16" switches DeepSpeed's bf16 on the way
    the GPU config does (DeepSpeed runs it on CPU too), which the product's CPU validation refuses."""
    from bertpipe.jobs.pretrain.engine import deepspeed_config as dsc
    from bertpipe.jobs.pretrain.engine import build as engines
    from bertpipe.jobs.pretrain import worker, worker_spec
    from bertpipe.jobs.pretrain.config import ModelConfig
    from bertpipe.jobs.services.tracking import RunLogger

    model = model or ModelConfig(preset="tiny", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    if precision == "bf16":  # the GPU JSON: resolved_precision is what makes it bf16
        original = dsc.resolved_precision
        dsc.resolved_precision = lambda c: "bf16"
        try:
            engine, scheduler = engines.build_engine(cfg, model, len(vocab), seed, 1)
        finally:
            dsc.resolved_precision = original
    else:
        engine, scheduler = engines.build_engine(cfg, model, len(vocab), seed, 1)
    spec = worker_spec.WorkerSpec(pretrain=cfg, model=model, seed=seed, vocab_tokens=list(vocab), vocab_bytes=b"",
                           tracking={}, export_uri="", storage_path="", run_name="test")
    return worker.Worker.build(spec, engine, scheduler, 0, 1, torch.device("cpu"), RunLogger({}, enabled=False))


def with_config(w, cfg):
    """The worker `w` (its engine, its state) under another pretrain config: its parts made anew around the engine,
    as a resumed worker's are."""
    from bertpipe.jobs.pretrain import worker

    return worker.Worker.build(dataclasses.replace(w.spec, pretrain=cfg), w.engine, w.scheduler, w.rank, w.world,
                               w.device, w.metrics.run)


def raw_batches(n: int, micro: int, L: int, seed: int = 0) -> list[dict]:
    """n micro-batches of shard rows as Ray Data hands them to a worker (numpy columns)."""
    table = h.make_rows(np.random.default_rng(seed), n * micro, L)
    cols = ("input_ids", "segment_b_start", "next_sentence_label")
    return [{k: table.slice(i * micro, micro).column(k).to_numpy(zero_copy_only=False) for k in cols}
            for i in range(n)]


def single_phase(cfg, **phase):
    return dataclasses.replace(cfg, phases=(dataclasses.replace(cfg.phases[0], **phase),))

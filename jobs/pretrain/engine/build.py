"""The model and DeepSpeed engine a pre-training worker trains, built apart from the loop that trains it: the model
(seeded, or loaded from pretrain.init), the optimizer and schedule, DeepSpeed's engine, and what the project changes
in DeepSpeed (no inference communication op, per-parameter LAMB layouts, the ZeRO 1/2 fast paths, compile).
What every worker runs, and what the CPU tests and the step profiles build without Ray."""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from bertpipe.jobs.pretrain.engine import zero_fast_paths
from bertpipe.jobs.pretrain.config import ModelConfig, PretrainConfig, bert_config
from bertpipe.jobs.pretrain.engine.deepspeed_config import deepspeed_config
from bertpipe.jobs.pretrain.engine.deepspeed_start import start_deepspeed
from bertpipe.jobs.pretrain.engine.lamb_layout import attach_lamb_layouts
from bertpipe.jobs.pretrain.engine.optim import make_optimizer, make_scheduler
from bertpipe.model.training import param_groups

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine
    from torch.optim.lr_scheduler import LambdaLR

log = logging.getLogger("bertpipe.pretrain")


def build_model(model_cfg: ModelConfig, vocab_size: int, seed: int, init: str = "", init_config: dict | None = None):
    """The model a worker trains: randomly initialised, or (`init`, pretrain.init) with the checkpoint's weights,
    loaded here, before DeepSpeed wraps it; what the checkpoint lacks keeps the seeded initialisation."""
    from bertpipe.model import BertForPreTraining

    bert_cfg = bert_config(model_cfg, vocab_size, init_config,
                           activation_checkpointing=model_cfg.activation_checkpointing,
                           hidden_dropout_prob=model_cfg.hidden_dropout_prob,
                           attention_probs_dropout_prob=model_cfg.attention_probs_dropout_prob)
    torch.manual_seed(seed)  # identical initial weights on every rank (ZeRO-3 partitions each rank's copy)
    model = BertForPreTraining(bert_cfg)
    if init:
        from bertpipe.jobs.pretrain.init import heads_line, heads_named, load_into

        started = time.perf_counter()
        fresh = load_into(model, init)
        log.info("%s (loaded in %.1f s)", heads_line(init, heads_named(model, fresh)), time.perf_counter() - started)
    return model


def build_engine(cfg: PretrainConfig, model_cfg: ModelConfig, vocab_size: int, seed: int, world: int,
                 init_config: dict | None = None) -> tuple[DeepSpeedEngine, LambdaLR]:
    """The DeepSpeed engine and LR scheduler of one worker (torch.distributed already initialised). With
    pretrain.init set, the model starts from that checkpoint's weights (`init_config`: its config.json)."""
    deepspeed = start_deepspeed()  # without what a run does not use (engine/deepspeed_start.py)
    model = build_model(model_cfg, vocab_size, seed, cfg.init, init_config)
    if cfg.optimizer_impl == "torch":
        optimizer, params = make_optimizer(cfg, model), None
    else:
        optimizer, params = None, param_groups(model, cfg.weight_decay)
    engine, _, _, scheduler = deepspeed.initialize(
        model=model, optimizer=optimizer, model_parameters=params, config=deepspeed_config(cfg, cfg.phases[0], world),
        dist_init_required=False, lr_scheduler=lambda opt: make_scheduler(cfg, opt))
    if cfg.optimizer == "lamb":
        attach_lamb_layouts(engine)  # DeepSpeed now holds flat partitions: one trust ratio per parameter still
    zero_fast_paths.install_fast_paths(engine)
    if compile_enabled(cfg):
        engine.compile()  # lazy: the first forward of each new shape compiles (loop.timed_first_step says so)
    return engine, scheduler


def compile_enabled(cfg: PretrainConfig) -> bool:
    return cfg.use_gpu if cfg.compile is None else cfg.compile

"""LAMB under DeepSpeed with 2 CPU ranks (torch.multiprocessing + gloo) and the same steps in one process.

Both sides start from the same tiny BERT (dropout off, so nothing random remains), see the same fixed batches
and clip the global gradient norm to 1.0 before LAMB. Rank r trains on half r of each batch; data parallelism
averages the two halves' gradients, so the one-process reference steps on the mean of the two halves' losses.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

VOCAB, SEQ, BATCH, PREDS = 48, 16, 8, 3
STEPS, LR, CLIP = 3, 0.05, 1.0


def make_model():
    from bertpipe.model import BertConfig, BertForPreTraining

    torch.manual_seed(0)
    return BertForPreTraining(BertConfig.preset("tiny", vocab_size=VOCAB, hidden_dropout_prob=0.0,
                                                attention_probs_dropout_prob=0.0))


def batches() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        out.append({"input_ids": torch.randint(5, VOCAB, (BATCH, SEQ), generator=g),
                    "token_type_ids": (torch.arange(SEQ) >= SEQ // 2).long().expand(BATCH, SEQ).clone(),
                    "attention_mask": torch.ones(BATCH, SEQ, dtype=torch.long),
                    "masked_positions": torch.randint(1, SEQ, (BATCH, PREDS), generator=g),
                    "masked_lm_labels": torch.randint(5, VOCAB, (BATCH, PREDS), generator=g),
                    "next_sentence_label": torch.randint(0, 2, (BATCH,), generator=g)})
    return out


def half(batch: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    n = BATCH // 2
    return {k: v[rank * n: (rank + 1) * n] for k, v in batch.items()}


def loss_of(model, b: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(b["input_ids"], b["token_type_ids"], b["attention_mask"], b["masked_positions"],
                 b["masked_lm_labels"], b["next_sentence_label"]).loss


def reference() -> dict[str, torch.Tensor]:
    """STEPS steps of the plain per-parameter Lamb in one process (no layout: each tensor is one parameter)."""
    from bertpipe.jobs.pretrain.engine.optim import Lamb
    from bertpipe.model.training import param_groups

    model = make_model()
    opt = Lamb(param_groups(model, 0.01), lr=LR)
    for batch in batches():
        opt.zero_grad()
        ((loss_of(model, half(batch, 0)) + loss_of(model, half(batch, 1))) / 2).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
    return {k: p.detach().clone() for k, p in model.named_parameters()}


def ds_config(zero_stage: int, precision: str) -> dict:
    """The project's DeepSpeed JSON for 2 workers; precision "bf16" switches bf16 on (the project's CPU config is
    fp32, bf16 is here only to measure it), "bf16_fp32_accum" also accumulates gradients in fp32, which makes
    DeepSpeed wrap ZeRO 1 in its BF16_Optimizer instead of the ZeRO optimizer."""
    from bertpipe.jobs.pretrain.config import PhaseConfig, PretrainConfig
    from bertpipe.jobs.pretrain.engine.deepspeed_config import deepspeed_config

    cfg = PretrainConfig(zero_stage=zero_stage, optimizer="lamb", gradient_clipping=CLIP, num_workers=2)
    ds = deepspeed_config(cfg, PhaseConfig(global_batch_size=BATCH, micro_batch_size=BATCH // 2), world_size=2)
    ds["bf16"]["enabled"] = precision != "fp32"
    if precision == "bf16_fp32_accum":
        ds["data_types"] = {"grad_accum_dtype": "fp32"}
    return ds


def fp32_weights(engine) -> dict[str, torch.Tensor]:
    """Every parameter's full fp32 master copy (collective under ZeRO: every rank calls it)."""
    from deepspeed.utils import safe_get_full_fp32_param

    wrapper, named = engine.optimizer, list(engine.module.named_parameters())
    if hasattr(wrapper, "fp16_groups") and not engine.zero_optimization_stage():  # FP16_UnfusedOptimizer
        masters = {id(p): m for lp, hp in zip(wrapper.fp16_groups, wrapper.fp32_groups) for p, m in zip(lp, hp)}
        return {k: masters[id(p)].detach().clone() for k, p in named}
    if engine.zero_optimization_stage() or engine.bfloat16_enabled():
        return {k: safe_get_full_fp32_param(p).clone() for k, p in named}
    return {k: p.detach().float().clone() for k, p in named}


def worker(rank: int, port: int, zero_stage: int, precision: str, out: str) -> None:
    """One rank: DeepSpeed + our Lamb + attach_lamb_layouts, STEPS steps; rank 0 saves the fp32 weights."""
    import torch.distributed as dist

    from bertpipe.jobs.pretrain.engine.lamb_layout import attach_lamb_layouts
    from bertpipe.jobs.pretrain.engine.deepspeed_start import start_deepspeed
    from bertpipe.jobs.pretrain.engine.optim import Lamb
    from bertpipe.model.training import param_groups

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    deepspeed = start_deepspeed()  # as the product's build_engine starts it (engine/deepspeed_start.py)
    model = make_model()
    engine, *_ = deepspeed.initialize(model=model, optimizer=Lamb(param_groups(model, 0.01), lr=LR),
                                      config=ds_config(zero_stage, precision), dist_init_required=False)
    layouts = attach_lamb_layouts(engine)
    for batch in batches():
        engine.backward(loss_of(engine, half(batch, rank)))
        engine.step()
    weights = fp32_weights(engine)
    if rank == 0:
        torch.save({"params": weights, "layouts": layouts, "wrapper": type(engine.optimizer).__name__,
                    "skipped": engine.skipped_steps}, out)
    dist.barrier()
    dist.destroy_process_group()


def run_deepspeed(tmp: Path, zero_stage: int, precision: str = "fp32") -> dict:
    """Weights after STEPS steps on 2 ranks, the number of layouts attached and DeepSpeed's optimizer wrapper."""
    import torch.multiprocessing as mp

    from ports import free_port_block

    out = str(tmp / f"zero{zero_stage}_{precision}.pt")
    mp.start_processes(worker, args=(free_port_block(1), zero_stage, precision, out), nprocs=2, join=True,
                       start_method="spawn")
    return torch.load(out)

"""Optimizer step cost of our layer-wise LAMB vs torch AdamW under DeepSpeed ZeRO 1, 2 CPU workers (gloo).

    python benchmarks/bench_lamb.py [--preset mini] [--steps 10] [--seq 128] [--micro 8]

Each optimizer trains the same BERT on the same random batches in its own pair of processes (spawned one after the
other, LAMB first, then AdamW, then LAMB and AdamW again: `--rounds`). Timed per optimizer step, after 2 warm-up
steps: the whole step (forward + backward + engine.step), DeepSpeed's optimizer step alone, and for LAMB the one
all-reduce of per-parameter squared norms (the price of per-layer trust ratios over flat ZeRO partitions), timed
by wrapping the `dist.all_reduce` our optimizer module calls. Medians over steps and rounds, rank 0.

Measured once on the 2-core development machine, no GPU, other jobs running (load average ~30), defaults:

| optimizer | step (fwd+bwd+opt) s | optimizer step s | norm all-reduce ms | all-reduces/step | all-reduce share |
|---|---|---|---|---|---|
| lamb | 1.455 | 0.276 | 35.76 | 1 | 2.46% |
| adamw | 1.360 | 0.175 | 0.00 | 0 | 0.00% |

The all-reduce moves 2 × 1.3k floats (2 per parameter); most of its time is the wait for the other rank to
finish its half of the update, which an oversubscribed 2-core machine stretches.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO / "tests"))
VOCAB = 30522


def timed_all_reduce(log: list[float]):
    """dist.all_reduce that appends its wall time to `log` (installed in the optimizer module only)."""
    import torch.distributed as dist

    def all_reduce(tensor, *args, **kwargs):
        t = time.perf_counter()
        out = dist.all_reduce(tensor, *args, **kwargs)
        log.append(time.perf_counter() - t)
        return out
    return all_reduce


def engine_for(optimizer_name: str, preset: str, micro: int):
    import deepspeed

    from bertpipe.jobs.pretrain.engine import optim
    from bertpipe.jobs.pretrain.config import PhaseConfig, PretrainConfig
    from bertpipe.jobs.pretrain.engine.deepspeed_config import deepspeed_config
    from bertpipe.jobs.pretrain.engine.lamb_layout import attach_lamb_layouts
    from bertpipe.jobs.pretrain.engine.build import skip_inference_comm_op
    from bertpipe.model import BertConfig, BertForPreTraining

    torch.manual_seed(0)
    model = BertForPreTraining(BertConfig.preset(preset, vocab_size=VOCAB))
    cfg = PretrainConfig(zero_stage=1, optimizer=optimizer_name, num_workers=2)
    ds = deepspeed_config(cfg, PhaseConfig(global_batch_size=2 * micro, micro_batch_size=micro), world_size=2)
    skip_inference_comm_op()  # as the product's build_engine
    engine, *_ = deepspeed.initialize(model=model, optimizer=optim.make_optimizer(cfg, model), config=ds,
                                      dist_init_required=False)
    for group in engine.optimizer.param_groups:
        group["lr"] = 1e-4  # make_optimizer builds with lr 1.0 for the LambdaLR; a fixed small lr here
    if optimizer_name == "lamb":
        attach_lamb_layouts(engine)
    return engine


def worker(rank: int, port: int, name: str, args, out: str) -> None:
    import torch.distributed as dist

    from bertpipe.jobs.pretrain.engine import optim

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    engine = engine_for(name, args.preset, args.micro)
    reduce_log: list[float] = []
    # only the optimizer module's all_reduce (ours), not DeepSpeed's gradient reduction
    optim.dist = types.SimpleNamespace(all_reduce=timed_all_reduce(reduce_log))
    g = torch.Generator().manual_seed(rank)
    rows = []
    for step in range(args.steps + 2):
        ids = torch.randint(5, VOCAB, (args.micro, args.seq), generator=g)
        positions = torch.randint(1, args.seq, (args.micro, args.seq * 20 // 128), generator=g)
        t0 = time.perf_counter()
        out_ = engine(ids, torch.zeros_like(ids), torch.ones_like(ids), positions,
                      torch.randint(5, VOCAB, positions.shape, generator=g), torch.randint(0, 2, (args.micro,)))
        engine.backward(out_.loss)
        t1 = time.perf_counter()
        before = len(reduce_log)
        engine.step()
        t2 = time.perf_counter()
        if step >= 2:
            rows.append((t2 - t0, t2 - t1, sum(reduce_log[before:]), len(reduce_log) - before))
    if rank == 0:
        torch.save(rows, out)
    dist.barrier()
    dist.destroy_process_group()


def run(name: str, args, tmp: str) -> list[tuple]:
    import torch.multiprocessing as mp

    from ports import free_port_block

    out = os.path.join(tmp, f"{name}.pt")
    mp.start_processes(worker, args=(free_port_block(1), name, args, out), nprocs=2, join=True,
                       start_method="spawn")
    return torch.load(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="mini")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    rows: dict[str, list] = {"lamb": [], "adamw": []}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for name in rows:
                rows[name] += run(name, args, tmp)
    print(f"\nBERT-{args.preset}, ZeRO 1, 2 CPU workers (gloo), micro-batch {args.micro} × seq {args.seq}, "
          f"{len(rows['lamb'])} timed steps each (medians, rank 0)\n")
    print("| optimizer | step (fwd+bwd+opt) s | optimizer step s | norm all-reduce ms | all-reduces/step "
          "| all-reduce share |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        step, opt, red = (statistics.median(x[i] for x in r) for i in range(3))
        calls = statistics.median(x[3] for x in r)
        print(f"| {name} | {step:.3f} | {opt:.3f} | {1e3 * red:.2f} | {calls:g} | {100 * red / step:.2f}% |")


if __name__ == "__main__":
    main()

"""How many sequences fit on a GPU: the activation memory one BERT sequence keeps for the backward pass, measured
on the CPU (bf16 autocast, the tensors autograd saves, each storage counted once), and the micro-batch that
leaves room for it beside the weights, gradients and ZeRO-1 optimizer state on an 80 GB and a 40 GB card.

    python benchmarks/bench_activation_memory.py [--preset large] [--workers 1]

The CPU's attention kernel saves at least what CUDA's flash/memory-efficient kernels save, so the figures err
on the safe side. The sizing keeps HEADROOM of the card free for the allocator, workspaces and the MLM logits.
"""
from __future__ import annotations

import argparse

HEADROOM = 0.25


def saved_bytes_per_sequence(preset: str, seq: int, checkpointing: bool, batch: int = 2) -> float:
    import torch

    from bertpipe.model import BertConfig, BertForPreTraining

    torch.manual_seed(0)
    model = BertForPreTraining(BertConfig.preset(preset, vocab_size=30522, activation_checkpointing=checkpointing))
    ids = torch.randint(5, 30522, (batch, seq))
    args = (ids, torch.zeros_like(ids), torch.ones_like(ids), torch.randint(0, seq, (batch, seq * 15 // 100)),
            torch.randint(5, 30522, (batch, seq * 15 // 100)), torch.zeros(batch, dtype=torch.long))
    storages: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        model(*args).loss.backward()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in storages.items() if ptr not in params) / batch


def state_bytes(preset: str, workers: int) -> float:
    """bf16 weights + bf16 gradients + (fp32 master + Adam m, v) / workers under ZeRO 1."""
    from bertpipe.model import BertConfig, BertForPreTraining

    import torch

    with torch.device("meta"):
        n = sum(p.numel() for p in BertForPreTraining(BertConfig.preset(preset, vocab_size=30522)).parameters())
    return n * (2 + 2 + 12 / workers)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="large")
    ap.add_argument("--workers", type=int, default=1, help="ZeRO-1 data-parallel workers (splits optimizer state)")
    args = ap.parse_args()
    state = state_bytes(args.preset, args.workers)
    print(f"BERT-{args.preset}: weights + gradients + ZeRO-1 state over {args.workers} worker(s): "
          f"{state / 2**30:.1f} GiB; headroom {HEADROOM:.0%}")
    print("| seq | activation checkpointing | saved per sequence | largest micro-batch, 80 GB | 40 GB |")
    print("|---|---|---|---|---|")
    for seq in (128, 512):
        for ckpt in (False, True):
            per = saved_bytes_per_sequence(args.preset, seq, ckpt)
            fit = {gb: int(((gb * 1e9 * (1 - HEADROOM)) - state) // per) for gb in (80, 40)}
            print(f"| {seq} | {'on' if ckpt else 'off'} | {per / 2**20:,.0f} MiB | {fit[80]} | {fit[40]} |")


if __name__ == "__main__":
    main()

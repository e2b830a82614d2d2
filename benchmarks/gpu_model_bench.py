"""BERT-LARGE pre-training step on one GPU, bf16: sequences/s and MFU, ours vs transformers, same run.

Step = forward + backward + fused AdamW under torch.autocast(bf16) with fp32 master weights, seq 128,
`max_pred` masked positions per sequence (ours gathers them; transformers gets -100 labels elsewhere and
projects every token). MFU = useful model FLOPs / step time / measured bf16 matmul peak, where useful FLOPs
are the same for both implementations:
    6 · (encoder matmul weights) · tokens          (forward + backward)
  + 6 · (H² + V · H) · masked tokens               (MLM transform and tied vocabulary projection, where needed)
  + 6 · (H² + 2H) · sequences                      (pooler and NSP classifier, on [CLS])
  + 12 · L · B · T² · H                            (attention scores and weighted sum, forward + backward)
Transformers does more FLOPs than this (vocabulary projection of every token); they are not counted as
useful. The peak is measured here (a large bf16 matmul), not taken from a spec sheet.

    python benchmarks/gpu_model_bench.py                         # large, batch 64, seq 128, cuda
    python benchmarks/gpu_model_bench.py --compile               # also time torch.compile(ours)
    python benchmarks/gpu_model_bench.py --device cpu --preset tiny --batch 4 --steps 2   # smoke test
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bertpipe.model import BertConfig, BertForPreTraining  # noqa: E402
from bertpipe.model.flops import step_flops  # noqa: E402


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def matmul_peak_tflops(device: str, n: int = 8192, iters: int = 20) -> float:
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        a @ b
    sync(device)
    return 2 * n**3 * iters / (time.perf_counter() - t0) / 1e12


def useful_flops(config: BertConfig, batch: int, seq: int, max_pred: int) -> float:
    """The product's count (model/flops.py), the one the pre-training stage logs its utilisation with."""
    return step_flops(config, batch, seq, max_pred)


def make_batch(config: BertConfig, batch: int, seq: int, max_pred: int, device: str):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, config.vocab_size, (batch, seq), generator=g)
    tt = torch.zeros_like(ids)
    tt[:, seq // 2:] = 1
    am = torch.ones_like(ids)
    positions = torch.stack([torch.randperm(seq - 1, generator=g)[:max_pred] + 1 for _ in range(batch)])
    labels = torch.randint(1000, config.vocab_size, (batch, max_pred), generator=g)
    nsp = torch.randint(0, 2, (batch,), generator=g)
    full_labels = torch.full_like(ids, -100).scatter(1, positions, labels)
    return [t.to(device) for t in (ids, tt, am, positions, labels, nsp, full_labels)]


def time_impl(name: str, config: BertConfig, args, data) -> dict:
    result = _measure(name, config, args, data)  # its model and optimizer are freed when it returns
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return result


def _measure(name: str, config: BertConfig, args, data) -> dict:
    ids, tt, am, positions, labels, nsp, full_labels = data
    torch.manual_seed(0)
    if name.startswith("ours"):
        model = BertForPreTraining(config).to(args.device)
        step_model = torch.compile(model) if name == "ours+compile" else model

        def loss_fn():
            return step_model(ids, tt, am, positions, labels, nsp).loss
    else:
        import transformers
        model = transformers.BertForPreTraining(transformers.BertConfig(**config.to_hf_dict())).to(args.device)

        def loss_fn():
            return model(input_ids=ids, token_type_ids=tt, attention_mask=am, labels=full_labels,
                         next_sentence_label=nsp).loss
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01,
                                  fused=args.device == "cuda")
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()

    def step():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(args.device, dtype=torch.bfloat16):
            loss = loss_fn()
        loss.backward()
        optimizer.step()
        return loss

    for _ in range(args.warmup):
        step()
    sync(args.device)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    sync(args.device)
    step_s = (time.perf_counter() - t0) / args.steps
    peak_gb = torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else float("nan")
    return dict(impl=name, step_s=step_s, loss=float(loss), peak_gb=peak_gb)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="large")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--max-pred", type=int, default=20)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--compile", action="store_true", help="also time torch.compile(ours)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: this benchmark needs one GPU (use --device cpu --preset tiny to smoke-test)")
    torch.backends.cuda.matmul.allow_tf32 = True

    config = BertConfig.preset(args.preset)
    data = make_batch(config, args.batch, args.seq, args.max_pred, args.device)
    peak = matmul_peak_tflops(args.device, n=8192 if args.device == "cuda" else 512)
    flops = useful_flops(config, args.batch, args.seq, args.max_pred)
    impls = ["transformers", "ours"] + (["ours+compile"] if args.compile else [])
    rows = [time_impl(name, config, args, data) for name in impls]

    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"\n{device_name}, BERT-{args.preset} bf16 autocast, batch {args.batch} × seq {args.seq}, "
          f"{args.max_pred} masked/seq, measured bf16 matmul peak {peak:.0f} TFLOP/s, "
          f"useful FLOPs/step {flops / 1e12:.2f} T")
    print("| impl         | step ms | sequences/s | TFLOP/s | MFU   | vs transformers | peak mem GB | loss   |")
    print("|--------------|---------|-------------|---------|-------|-----------------|-------------|--------|")
    ref = rows[0]["step_s"]
    for r in rows:
        tflops = flops / r["step_s"] / 1e12
        print(f"| {r['impl']:12} | {r['step_s'] * 1e3:7.1f} | {args.batch / r['step_s']:11.1f} | {tflops:7.1f} | "
              f"{tflops / peak:5.1%} | {ref / r['step_s']:14.2f}× | {r['peak_gb']:11.1f} | {r['loss']:6.3f} |")


if __name__ == "__main__":
    main()

"""Training-step throughput of our BERT vs transformers' BertForPreTraining on this CPU.

One step = forward + backward + AdamW step on a [batch, seq] batch of real-length sequences with
`max_pred` masked positions each (our model projects only those onto the vocabulary; transformers gets
labels of -100 everywhere else, its standard usage, and projects every token). Same config, weights
dtype (fp32), thread count and inputs on both sides. Each (model, size) runs in its own subprocess so its
peak RSS (ru_maxrss, includes the ~0.4 GB of Python + torch) is its own.

    python benchmarks/bench_model.py                 # mini (b32 s128) and base (b8 s128), 2 threads
    python benchmarks/bench_model.py --sizes mini --steps 10 --threads 2
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

CASES = {"mini": dict(batch=32, seq=128), "base": dict(batch=8, seq=128)}


def worker(impl: str, size: str, batch: int, seq: int, max_pred: int, steps: int, warmup: int, threads: int) -> dict:
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from gpu_model_bench import make_batch  # the same synthetic batch as the GPU benchmark
    from bertpipe.model import BertConfig, BertForPreTraining

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    config = BertConfig.preset(size)
    ids, token_type_ids, attention_mask, positions, labels, nsp, full_labels = make_batch(
        config, batch, seq, max_pred, "cpu")

    if impl == "ours":
        model = BertForPreTraining(config)

        def loss_fn():
            return model(ids, token_type_ids, attention_mask, positions, labels, nsp).loss
    else:
        import transformers
        model = transformers.BertForPreTraining(transformers.BertConfig(**config.to_hf_dict()))

        def loss_fn():
            return model(input_ids=ids, token_type_ids=token_type_ids, attention_mask=attention_mask,
                         labels=full_labels, next_sentence_label=nsp).loss
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    times = []
    for step in range(warmup + steps):
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn()
        loss.backward()
        optimizer.step()
        if step >= warmup:
            times.append(time.perf_counter() - t0)
    times.sort()
    median = times[len(times) // 2]
    return dict(impl=impl, size=size, batch=batch, seq=seq, steps=steps, step_s=median,
                tokens_per_s=batch * seq / median, params=sum(p.numel() for p in model.parameters()),
                peak_rss_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, loss=float(loss))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--steps", type=int, default=None, help="measured steps (default: mini 10, base 5)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-pred", type=int, default=20, help="masked positions per sequence")
    parser.add_argument("--worker", nargs=2, metavar=("IMPL", "SIZE"), help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--seq", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker, args.batch, args.seq, args.max_pred, args.steps, args.warmup,
                                args.threads)))
        return

    rows = []
    for size in args.sizes:
        steps = args.steps or (10 if size == "mini" else 5)
        for impl in ("transformers", "ours"):
            cmd = [sys.executable, __file__, "--worker", impl, size, "--batch", str(CASES[size]["batch"]),
                   "--seq", str(CASES[size]["seq"]), "--steps", str(steps), "--warmup", str(args.warmup),
                   "--threads", str(args.threads), "--max-pred", str(args.max_pred)]
            result = subprocess.run(cmd, capture_output=True, text=True, check=True)
            rows.append(json.loads(result.stdout.strip().splitlines()[-1]))
            print(f"  {size:5} {impl:12} {rows[-1]['tokens_per_s']:9.0f} tok/s", file=sys.stderr, flush=True)

    print(f"\nCPU, {args.threads} threads, fp32, AdamW, {args.max_pred} masked positions/seq, median step time")
    header = f"| {'size':5} | {'batch×seq':9} | {'impl':12} | {'params':>7} | {'step s':>7} | {'tokens/s':>8} | " \
             f"{'ratio':>5} | {'peak RSS GB':>11} |"
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    for row in rows:
        ref = next(r for r in rows if r["size"] == row["size"] and r["impl"] == "transformers")
        print(f"| {row['size']:5} | {row['batch']:>3}×{row['seq']:<5} | {row['impl']:12} | "
              f"{row['params'] / 1e6:6.1f}M | {row['step_s']:7.3f} | {row['tokens_per_s']:8.0f} | "
              f"{row['tokens_per_s'] / ref['tokens_per_s']:5.2f} | {row['peak_rss_gb']:11.2f} |")


if __name__ == "__main__":
    main()

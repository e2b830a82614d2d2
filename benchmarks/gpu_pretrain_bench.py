"""BERT-Large phase 1 (seq 128) sequences/s on one GPU: the bare compiled model step and the whole stack, at the
same micro-batch, in one run, and their ratio (the share of the model's own speed the product keeps).

- bare: our BertForPreTraining under torch.compile, bf16 autocast, fused AdamW, one fixed batch, no data loading
  (benchmarks/gpu_model_bench.py's "ours+compile");
- stack: Ray Data shards → dynamic masking → DeepSpeed (bf16, ZeRO 1, torch fused AdamW, the product's defaults:
  no per-gradient overflow check, engine.compile()) inside a Ray Train worker, as `bertpipe run` trains.

    python benchmarks/gpu_pretrain_bench.py [--micro 256] [--accum 1] [--steps 40] [--zero 1] [--preset large]
                                            [--no-compile] [--skip-bare]

Needs a CUDA GPU and ≥ 3 CPUs. Shards are synthetic at BERT's real vocabulary size (30,522 rows), so the
embedding/MLM-projection cost is the real one. The stack figure is the mean over logging windows after the first
(which holds the compilation). Target (issue 23): stack ≥ 90% of bare and ≥ 1,500 seq/s on an H100.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO / "tests"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="large")
    ap.add_argument("--micro", type=int, default=256)
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--zero", type=int, default=1)
    ap.add_argument("--seq", type=int, default=128, help="sequence length (max predictions 20 per 128 tokens)")
    ap.add_argument("--optimizer", default="adamw", choices=("adamw", "lamb"))
    ap.add_argument("--checkpointing", action="store_true", help="activation checkpointing")
    ap.add_argument("--no-compile", action="store_true", help="pretrain.compile=false for the stack")
    ap.add_argument("--skip-bare", action="store_true", help="time the stack only")
    args = ap.parse_args()

    import os

    import ray
    import torch
    from mlflow.tracking import MlflowClient

    if not torch.cuda.is_available():
        sys.exit("no CUDA GPU: this benchmark needs one")
    from bertpipe.jobs.pretrain.stage import run_stage
    from bertpipe.jobs.services.tracking import metric_name
    from bertpipe.jobs.pretrain.config import ModelConfig, PhaseConfig, PretrainConfig
    import pretrain_helpers as h

    vocab = h.SPECIALS + [f"w{i}" for i in range(30_522 - len(h.SPECIALS))]
    ray.init(num_cpus=max(4, (os.cpu_count() or 4)), num_gpus=1, include_dashboard=False, log_to_driver=True)
    batch = args.micro * args.accum
    max_pred = max(20, args.seq * 20 // 128)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        inputs = h.make_inputs(root, lengths=(args.seq,), rows_per_shard=(args.steps + 5) * batch // 4 + 1,
                               num_shards=4, heldout_rows=256, vocab_tokens=vocab)
        client = MlflowClient(f"sqlite:///{root}/mlflow.db")
        exp = client.create_experiment("gpu-bench", artifact_location=str(root / "artifacts"))
        run = client.create_run(exp)
        cfg = PretrainConfig(num_workers=1, use_gpu=True, cpus_per_worker=2, max_steps=args.steps,
                             zero_stage=args.zero, optimizer=args.optimizer, log_every_steps=5, eval_every_steps=0,
                             eval_max_batches=2,
                             checkpoint_every_steps=10**6, max_failures=0, prefetch_batches=8,
                             compile=False if args.no_compile else None,
                             phases=(PhaseConfig(max_seq_length=args.seq, max_predictions_per_seq=max_pred,
                                                 global_batch_size=batch, micro_batch_size=args.micro,
                                                 learning_rate=1e-4, warmup_steps=10),))
        ctx = h.context(root, inputs, cfg, model=ModelConfig(preset=args.preset,
                                                              activation_checkpointing=args.checkpointing),
                        tracking={"tracking_uri": client.tracking_uri, "run_id": run.info.run_id})
        run_stage(ctx)
        # The workers log under MLflow's sections (train/throughput/..., train/loss) and skip the start-up window.
        hist = {k: [m.value for m in sorted(client.get_metric_history(run.info.run_id, metric_name(k)),
                                            key=lambda m: m.step)]
                for k in ("sequences_per_second", "data_wait_fraction", "loss", "model_flops_utilization")}
    ray.shutdown()
    sps = sum(hist["sequences_per_second"]) / len(hist["sequences_per_second"])
    wait = sum(hist["data_wait_fraction"]) / len(hist["data_wait_fraction"])
    mfu = sum(hist["model_flops_utilization"]) / max(len(hist["model_flops_utilization"]), 1)
    print(f"\nBERT-{args.preset} seq {args.seq}, {args.optimizer}, 1 GPU ({torch.cuda.get_device_name(0)}), bf16, "
          f"ZeRO {args.zero}, "
          f"micro {args.micro} × accum {args.accum}, compile {'off' if args.no_compile else 'on'}")
    print(f"| what | sequences/s |\n|---|---|\n| whole stack | {sps:,.1f} (data wait {100 * wait:.1f}%, "
          f"MFU {100 * mfu:.1f}% of the spec sheet's peak, last loss {hist['loss'][-1]:.3f}) |")
    if not args.skip_bare:
        bare = bare_step(args.preset, args.micro, args.seq, max_pred)
        print(f"| bare compiled model step, batch {args.micro} | {bare:,.1f} |")
        print(f"| stack / bare | {sps / bare:.2f} |")


def bare_step(preset: str, batch: int, seq: int = 128, max_pred: int = 20, steps: int = 20) -> float:
    """Sequences/s of the bare compiled model step at this batch, length and masked positions per sequence."""
    import types

    import torch

    sys.path.append(str(REPO / "benchmarks"))
    import gpu_model_bench as g

    config = g.BertConfig.preset(preset, vocab_size=30_522)
    args = types.SimpleNamespace(device="cuda", warmup=5, steps=steps)
    result = g.time_impl("ours+compile", config, args, g.make_batch(config, batch, seq, max_pred, "cuda"))
    torch.cuda.empty_cache()
    return batch / result["step_s"]


if __name__ == "__main__":
    main()

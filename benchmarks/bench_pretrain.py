"""Pre-training throughput on this machine's CPU: sequences/s and the fraction of time spent waiting for data,
for ZeRO 0/1/2/3 with 2 workers, through the whole stage (Ray Data shards → masking → DeepSpeed).

    python benchmarks/bench_pretrain.py [--preset tiny] [--steps 60] [--seq 128]

The shards are synthetic (random topics, see tests/pretrain_helpers.py) at the requested length; figures are
averaged over the logging windows after the first (which holds worker start-up and the pipeline's warm-up).
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
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro", type=int, default=16)
    ap.add_argument("--stages", default="0,1,2,3")
    ap.add_argument("--length-bin-window", type=int, default=None, help="1 = off (default: the config default)")
    args = ap.parse_args()

    import ray
    from mlflow.tracking import MlflowClient

    from bertpipe.jobs.pretrain.stage import run_stage
    from bertpipe.jobs.services.tracking import metric_name
    from bertpipe.jobs.pretrain.config import ModelConfig, PhaseConfig
    from pretrain_helpers import context, make_inputs, tiny_config

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        per_step = 2 * args.micro
        inputs = make_inputs(root, lengths=(args.seq,), rows_per_shard=(args.steps + 20) * per_step // 4 + 1,
                             num_shards=4, heldout_rows=64)
        client = MlflowClient(f"sqlite:///{root}/mlflow.db")
        exp = client.create_experiment("bench", artifact_location=str(root / "artifacts"))
        for stage in (int(s) for s in args.stages.split(",")):
            run = client.create_run(exp)
            binning = {} if args.length_bin_window is None else {"length_bin_window": args.length_bin_window}
            cfg = tiny_config(max_steps=args.steps, zero_stage=stage, log_every_steps=10, **binning,
                              checkpoint_every_steps=10**6, eval_max_batches=1,
                              phases=(PhaseConfig(max_seq_length=args.seq,
                                                  max_predictions_per_seq=max(1, args.seq * 20 // 128),
                                                  global_batch_size=per_step, micro_batch_size=args.micro,
                                                  learning_rate=1e-3, warmup_steps=5),))
            ctx = context(root, inputs, cfg, model=ModelConfig(preset=args.preset), output=f"out{stage}",
                          tracking={"tracking_uri": client.tracking_uri, "run_id": run.info.run_id})
            run_stage(ctx)
            # MLflow names (train/throughput/...); the workers already leave out the start-up window.
            hist = {k: [m.value for m in sorted(client.get_metric_history(run.info.run_id, metric_name(k)),
                                                key=lambda m: m.step)]
                    for k in ("sequences_per_second", "tokens_per_second", "data_wait_fraction", "padding_fraction")}
            rows.append((stage, *(sum(v) / max(len(v), 1) for v in hist.values())))
    ray.shutdown()
    print(f"\npreset {args.preset}, seq {args.seq}, 2 workers × 1 CPU, micro-batch {args.micro}, {args.steps} steps, "
          f"length-bin window {cfg.length_bin_window}")
    print(f"{'ZeRO':>4} | {'sequences/s':>11} | {'tokens/s':>9} | {'data wait':>9} | {'padding':>7}")
    for stage, sps, tps, wait, pad in rows:
        print(f"{stage:>4} | {sps:>11.1f} | {tps:>9.0f} | {100 * wait:>8.1f}% | {100 * pad:>6.1f}%")


if __name__ == "__main__":
    main()
